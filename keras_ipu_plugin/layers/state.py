"""Layers for the model state a graph reads and writes: variable reads and held
constants, the losses a `call` adds, variable writes and what must come after
them, and a variable held by several layers saved as one. One concept: the
state nodes of a graph.

Graph nodes for values a layer's `call` holds rather than receives.

A layer may compute with its own weight (`x * self.scale`, a CLS token, a
position table) or with a tensor it keeps (a graph's edge list). Traced
symbolically, such a value would be read once and baked into the graph as a
constant: the weight would never train again. Instead the trace records the
read itself as a node, as torch.fx records `get_attr`:

- `VariableRead` returns the value of one variable: the very variable object
  (so training the converted model trains the user's model), tracked by the
  read layer so the functional model's `trainable_variables` hold it (once:
  one read layer per variable in a graph). It takes the reading layer's dtype
  policy, so mixed precision casts the read exactly as the original did.
- `HeldConstant` returns a fixed tensor (a concrete input of a sub-layer
  computed inside `call`, e.g. `self.position_embedding(ops.arange(n))`), so
  the sub-layer's call is a node of the graph, not its frozen result.

A functional model needs every node reachable from its inputs, so both take
one graph tensor (`anchor`) and ignore it.

Example:
    ```python
    read = VariableRead(model.cls_token, like=model, name="cls_token")
    read(x).shape == model.cls_token.shape
    # -> True
    ```

`AddedLoss`: a loss a layer's `call` adds (`self.add_loss(...)`), as a
graph node.

keras.io's VQ-VAE quantizer adds its commitment and codebook losses in
`call`, `self.add_loss(self.beta * commitment_loss + codebook_loss)`; the
Switch Transformer's router adds its load-balancing loss. Keras 3 takes
`add_loss` on concrete tensors only, so a functional model cannot carry
such a loss from its symbolic build, and the layer used to run whole. The
tracer records the call as this layer instead (`frontend/trace/trace_views.py`): it
is called on the loss's graph tensor and adds it with Keras's own
`add_loss` each time the graph runs, so `model.losses` of the graph's
model holds the same loss after a call as the original's does, and Keras's
`compute_loss` adds it to the training loss as it adds the original's.

The node returns the loss (so that the call's first output can be ordered
after it: a functional model runs only what its outputs need,
`frontend/trace/writes.py`); it is never expanded and never outlined, and
saves with the model.

A call of the graph's model replaces what the node added at its previous
call (one loss per call, as the original's layer has after each call of
its model), also when the graph runs nested in another model, which Keras
clears only at its outermost call.

Example:
    ```python
    added = AddedLoss(name="vector_quantizer.add_loss")
    loss = added(commitment + codebook)     # in a graph: added at each run
    graph_model(x); graph_model.losses      # [the loss of this call]
    ```

Graph nodes for the variable writes a layer's `call` makes.

keras.io's PixelCNN masks its kernel on every call,
`self.conv.kernel.assign(self.conv.kernel * self.mask)`, then calls the
conv; a step counter does `self.count.assign_add(1)`; an EMA codebook
`self.ema.assign(decay * self.ema + (1 - decay) * stats)`. Traced, such a
write is recorded as a node (`frontend/trace/writes.py`), as a read is
(`VariableRead`, above):

- `VariableWrite(value, after=[...])` makes the write when the graph runs
  (`variable.assign(value)`, `assign_add`, `assign_sub`: Keras's own methods,
  so shape checks and dtype conversion are the original's) and returns the
  variable's value after it. It holds the very variable object, as a
  `VariableRead` does. `after` are tensors that must exist before the write
  is made (the reads and layer calls that came before it in `call`, which
  must see the old value); the node ignores their values.
- `AfterWrites(x, writes)` returns `x` once `writes` (outputs of
  `VariableWrite` nodes) are computed: a layer that uses the variable after
  the write in `call` (the PixelCNN's conv) is called on it, so it runs
  after the write.

The order is in the graph as data dependencies: Keras runs a functional
model's nodes in an order that respects them, and in a `tf.function`
TensorFlow orders the operations on one variable as they were made.
A write is never differentiated: `assign` has no gradient, and reads after
it get the gradient, as in the original.

Example:
    ```python
    write = VariableWrite(layer.count, "assign_add", like=layer, name="count.assign_add")
    new_count = write(np.ones(()), after=[])
    y = AfterWrites(name="after_writes")(x, [new_count])   # x, once written
    ```

One variable held by several layers of a graph, saved and loaded as one.

A graph's read and write nodes (`VariableRead`, `VariableWrite`) hold the
very variable they read or write, which a layer of the graph often holds
too: PixelCNN's masked conv is a `Conv2D` holding its kernel, a read of the
kernel and a write of it. Keras saves each layer's variables and loads a
file into new variables, one per layer: the conv would then read one
kernel and the write node write another, a silently different model.

`KipFunctional.get_config` records, in the config of each read or write
node whose variable another layer holds, where that variable is
(`variable_owner`: the layer's name and the variable's index in its
`weights`; a layer not a read or write node is preferred, else the first
node that holds it). Loading makes each such node hold the owner's
variable (`link_shared_variables`) before the weights are loaded.

Example:
    ```python
    config = model.get_config()        # `mark_shared_variables` ran
    loaded = KipFunctional.from_config(config)
    loaded.get_layer("first.conv.kernel.assign").variable is \
        loaded.get_layer("conv2d").kernel
    # -> True
    ```
"""

import contextlib
import threading
import weakref

import keras
import numpy as np
import tensorflow as tf

from keras_ipu_plugin import _compat
from keras_ipu_plugin.layers import saved_values

__all__ = [
    "HoldsVariable",
    "VariableRead",
    "HeldConstant",
    "ReadLayers",
    "ReadTensor",
    "is_read",
    "recording_writes",
    "AddedLoss",
    "added_losses",
    "loss_nodes",
    "METHODS",
    "VariableWrite",
    "AfterWrites",
    "is_write_node",
    "mark_shared_variables",
    "link_shared_variables",
]


class HoldsVariable:
    """What a graph layer holding one variable of the model (a read, a
    write) shares: the very variable object, tracked (so the functional
    model trains and saves it), or, loaded from a file, a placeholder that
    the loading `KipFunctional` points at the variable of the layer that
    owns it (`variable_owner`, see `mark_shared_variables` below): a variable held
    by two layers of a file is loaded as two variables, which would then
    train apart."""

    def _hold(self, variable, variable_shape, variable_dtype, variable_trainable,
              variable_owner):
        if variable is None:  # loaded from a config: the saved weights fill it
            variable = self.add_weight(
                shape=tuple(variable_shape), dtype=variable_dtype,
                trainable=variable_trainable, initializer="zeros", name="variable",
            )
        # Tracked (not a copy): the optimizer updates the user's variable.
        self.variable = variable
        # (layer name, index in its weights) of the layer whose variable
        # this one is, in a loaded model; None where this layer owns it.
        self.variable_owner = None if variable_owner is None else tuple(variable_owner)

    def link_variable(self, variable):
        """Hold `variable` (the owner's) in place of the loaded placeholder."""
        del self.variable  # untracks the placeholder
        self.variable = variable
        self.variable_owner = None

    def _variable_config(self):
        return dict(
            variable_shape=list(self.variable.shape),
            # outside a call no autocast scope is active: the stored dtype
            variable_dtype=self.variable.dtype,
            variable_trainable=self.variable.trainable,
        )

    @staticmethod
    def check_variable_config(config, entry):
        """The checks of a saved holder's variable entries (`kip.LoadError`
        naming the key)."""
        shape = saved_values.saved_shape(config.get("variable_shape"), entry, "variable_shape",
                                         allow_unknown=False)
        # The variable is made (and filled) at load before the saved weights
        # are read: its size is the file's to say, so it is bounded.
        values = 1
        for dim in shape:
            values *= dim
        if values > MAX_SAVED_VARIABLE_VALUES:
            saved_values.refuse(entry, "variable_shape", "a shape of at most "
                                f"{MAX_SAVED_VARIABLE_VALUES} values (kip's limit on a variable "
                                "a graph node holds: keras_ipu_plugin.layers.state."
                                "MAX_SAVED_VARIABLE_VALUES)", list(shape))
        saved_values.saved_dtype(config.get("variable_dtype"), entry, "variable_dtype")
        saved_values.saved_bool(config.get("variable_trainable", True), entry,
                                "variable_trainable")
        owner = config.get("variable_owner")
        if owner is not None and not (
            isinstance(owner, (list, tuple)) and len(owner) == 2
            and isinstance(owner[0], str) and isinstance(owner[1], int)
            and not isinstance(owner[1], bool) and owner[1] >= 0
        ):
            saved_values.refuse(entry, "variable_owner",
                                "null or [layer name, index of the variable in its weights]", owner)


#: The most values a variable a saved read or write node makes may hold
#: (1 GiB of float32): loading makes it before reading the saved weights, so
#: a shape edited into a file would allocate memory no weight fills.
MAX_SAVED_VARIABLE_VALUES = 2 ** 28


@keras.saving.register_keras_serializable(package="keras_ipu_plugin")
class VariableRead(HoldsVariable, keras.layers.Layer):
    """Reads `variable` (the same object) in the graph; `anchor` is ignored.

    `like`: the layer whose `call` reads the variable; the read takes its
    dtype policy and `autocast`, so a mixed-precision read is cast the same.

    Example:
        ```python
        read = VariableRead(layer.scale, like=layer, name="block.scale")
        read(x) is not None and read.variable is layer.scale
        # -> True
        ```
    """

    def __init__(self, variable=None, like=None, *, variable_shape=None,
                 variable_dtype=None, variable_trainable=True, variable_owner=None, **kwargs):
        if like is not None:
            kwargs.setdefault("dtype", like.dtype_policy)
            kwargs.setdefault("autocast", like.autocast)
            kwargs.setdefault("trainable", like.trainable)
        super().__init__(**kwargs)
        self._hold(variable, variable_shape, variable_dtype, variable_trainable, variable_owner)
        self.path_named = False  # Expand names it after its path once
        self.built = True

    def call(self, anchor):
        del anchor  # only ties the read to the graph's inputs
        # `.value` is cast under the autocast scope of this layer's policy,
        # as the original read was under the reading layer's.
        return tf.identity(self.variable.value)

    def compute_output_spec(self, anchor):
        del anchor
        # `variable.dtype` is the autocast one inside this layer's call.
        return ReadTensor(self.variable)

    def get_config(self):
        config = super().get_config()
        config.update(autocast=self.autocast, **self._variable_config())
        return config

    @classmethod
    def from_config(cls, config):
        entry = f"VariableRead `{config.get('name')}`"
        saved_values.saved_layer_config(config, entry, (
            "variable_shape", "variable_dtype", "variable_trainable", "variable_owner"))
        cls.check_variable_config(config, entry)
        return cls(**config)


@keras.saving.register_keras_serializable(package="keras_ipu_plugin")
class HeldConstant(keras.layers.Layer):
    """Returns a fixed tensor in the graph; `anchor` is ignored.

    Example:
        ```python
        positions = HeldConstant(np.arange(16), name="positions")
        positions(x).shape
        # -> (16,)
        ```
    """

    def __init__(self, value, value_dtype=None, **kwargs):
        super().__init__(**kwargs)
        value = np.asarray(value)
        self.value = value.astype(value_dtype) if value_dtype else value
        self.built = True

    def call(self, anchor):
        del anchor
        return tf.constant(self.value)

    def compute_output_spec(self, anchor):
        del anchor
        return keras.KerasTensor(self.value.shape, dtype=str(self.value.dtype))

    def get_config(self):
        config = super().get_config()
        config.update(value=self.value.tolist(), value_dtype=str(self.value.dtype))
        return config

    @classmethod
    def from_config(cls, config):
        entry = f"HeldConstant `{config.get('name')}`"
        saved_values.saved_layer_config(config, entry, ("value", "value_dtype"))
        dtype = saved_values.saved_dtype(config.get("value_dtype"), entry, "value_dtype")
        value = config.get("value")
        try:
            # Data only: numbers, booleans or strings, nested in lists.
            array = np.asarray(value)
            ok = array.dtype.kind in "biufcUS"
        except (ValueError, TypeError):
            ok = False
        if not ok:
            saved_values.refuse(entry, "value", f"a (nested) list of {dtype} values",
                                value)
        return cls(**config)


class ReadTensor(keras.KerasTensor):
    """The symbolic value of a variable read, standing for the variable in a
    traced `call`: `keras.ops` on it stay in the graph, and what only a real
    variable can do fails the trace with a message that says so (the layer
    then runs whole, as an opaque node) rather than reading it once.

    `assign` / `assign_add` / `assign_sub` on it, while a trace records
    writes (`recording_writes`), become a `VariableWrite` node of the graph
    (`VariableWrite`, below) and return the variable's value after the write.
    """

    def __init__(self, variable, dtype=None):
        super().__init__(variable.shape, dtype=dtype or variable.dtype)
        self.variable_path = variable.path
        self.trainable = variable.trainable
        self.variable = variable  # the very variable: what a write node writes

    @property
    def value(self):
        return self

    def _write(self, method, value):
        recorder = getattr(_recorder, "write", None)
        if recorder is None:
            raise TypeError(
                f"`call` assigns to the variable `{self.variable_path}` (state "
                "updated in the forward pass)"
            )
        return recorder(self, method, value)

    def assign(self, value):
        return self._write("assign", value)

    def assign_add(self, value):
        return self._write("assign_add", value)

    def assign_sub(self, value):
        return self._write("assign_sub", value)

    def _other_update(self, *args, **kwargs):
        raise TypeError(
            f"`call` updates part of the variable `{self.variable_path}` (a scatter "
            "or sliced assign), which a graph records only as a whole-variable "
            "`assign`: write `self.v.assign(ops.scatter_update(self.v, indices, "
            "updates))` for the layer to expand"
        )

    scatter_update = scatter_add = scatter_sub = scatter_nd_update = _other_update

    def numpy(self):
        raise TypeError(
            f"`call` reads the value of the variable `{self.variable_path}` "
            "in Python (`.numpy()`)"
        )


_recorder = threading.local()  # .write: what a traced `assign` on a read calls


@contextlib.contextmanager
def recording_writes(record):
    """Within, `assign` / `assign_add` / `assign_sub` on a `ReadTensor` call
    `record(read, method, value)` (the trace in progress records a write
    node) rather than fail.

    Example:
        ```python
        with recording_writes(lambda read, method, value: value):
            read_tensor.assign(new_value)
        ```
    """
    previous = getattr(_recorder, "write", None)
    _recorder.write = record
    try:
        yield
    finally:
        _recorder.write = previous


def is_read(operation):
    """Whether `operation` is a read node's layer (never expanded)."""
    return isinstance(operation, (VariableRead, HeldConstant))


class ReadLayers:
    """One `VariableRead` per variable (and dtype policy) in a graph: a
    variable tracked by two layers would be saved twice and loaded as two
    variables, which would then train apart.

    Example:
        ```python
        reads = ReadLayers.of_graph(graph)
        reads.variable_read(layer.scale, like=layer, name="block.scale")
        ```
    """

    def __init__(self):
        self._layers = {}  # (id(variable), policy, autocast) -> (variable, VariableRead)

    @classmethod
    def of_graph(cls, graph):
        reads = cls()
        for node in graph.nodes:
            if isinstance(node.operation, VariableRead):
                reads._remember(node.operation)
        return reads

    def _remember(self, read):
        self._layers[_key(read.variable, read)] = (read.variable, read)

    def variable_read(self, variable, like, name):
        key = _key(variable, like)
        if key not in self._layers:
            self._remember(VariableRead(variable, like=like, name=name))
        return self._layers[key][1]

    def layers(self):
        return [read for _, read in self._layers.values()]

    def gives(self, read, variable, like):
        """Whether `read` is the layer `variable_read(variable, like=like)`
        gives (asking makes nothing).

        Example:
            ```python
            reads.gives(node.operation, layer.scale, like=layer)
            # -> True
            ```
        """
        entry = self._layers.get(_key(variable, like))
        return entry is not None and entry[1] is read


def _key(variable, layer):
    return (id(variable), layer.dtype_policy.name, bool(layer.autocast), bool(layer.trainable))


@keras.saving.register_keras_serializable(package="keras_ipu_plugin")
class AddedLoss(keras.layers.Layer):
    """Adds its input to the losses of the model holding it (Keras's
    `add_loss`) each time it runs; returns it.

    Example:
        ```python
        AddedLoss(name="router.add_loss")(aux_loss)
        ```
    """

    def __init__(self, adds_for=None, **kwargs):
        # The loss is added as `call` computed it: never cast by a policy.
        kwargs["autocast"] = False
        super().__init__(**kwargs)
        # The user's layer whose `add_loss` this is (not saved, not tracked):
        # what that layer added at an earlier call of the user's model is
        # this node's to stand for (`training/session/step_self.py`).
        self.adds_for = None if adds_for is None else weakref.ref(adds_for)
        self.built = True

    def call(self, loss):
        self.add_loss(loss)
        return loss

    def add_loss(self, loss):
        # One node is one `add_loss` call of the original's `call`: what an
        # earlier run added is this run's to replace. (Also when the
        # executor adds the loss of a recomputed segment's run; a
        # recomputation in the backward pass, in a stateless scope, leaves
        # the forward pass's loss in place.)
        _compat.clear_own_losses(self)
        super().add_loss(loss)

    def compute_output_spec(self, loss):
        return keras.KerasTensor(loss.shape, dtype=loss.dtype)

    def get_config(self):
        config = super().get_config()
        config.pop("autocast", None)
        return config

    @classmethod
    def from_config(cls, config):
        saved_values.saved_layer_config(config, f"AddedLoss `{config.get('name')}`")
        return cls(**config)


def loss_nodes(model):
    """The `AddedLoss` layers of `model` (its graph, the `ModeSwitch` bodies
    and nested graph models it holds)."""
    return [layer for layer in _compat.all_layers(model) if isinstance(layer, AddedLoss)]


def added_losses(model):
    """The losses the `AddedLoss` nodes of `model` (a graph's model, and the
    `ModeSwitch` bodies and nested graph models it holds) added at their
    latest run.

    Example:
        ```python
        converted(x)
        added_losses(converted)     # [the quantizer's loss]
        ```
    """
    return [loss for layer in loss_nodes(model) for loss in layer.losses]


#: The write methods a node can make (the names of `keras.Variable`'s).
METHODS = ("assign", "assign_add", "assign_sub")


@keras.saving.register_keras_serializable(package="keras_ipu_plugin")
class VariableWrite(HoldsVariable, keras.layers.Layer):
    """Writes `variable` (the same object) with `method` when called on
    `value`; returns the variable's value after the write.

    `like`: the layer whose `call` made the write; the node takes its dtype
    policy and `autocast`, so the value read after the write is cast as a
    read in that `call` would be.

    Example:
        ```python
        write = VariableWrite(conv.kernel, "assign", like=block, name="conv.kernel.assign")
        masked = write(kernel * mask, after=[read_of_kernel])
        ```
    """

    def __init__(self, variable=None, method="assign", like=None, *, variable_shape=None,
                 variable_dtype=None, variable_trainable=True, variable_owner=None, **kwargs):
        if method not in METHODS:
            raise ValueError(f"Unknown write method {method!r}: one of {', '.join(METHODS)}.")
        if like is not None:
            kwargs.setdefault("dtype", like.dtype_policy)
            kwargs.setdefault("autocast", like.autocast)
            kwargs.setdefault("trainable", like.trainable)
        super().__init__(**kwargs)
        self._hold(variable, variable_shape, variable_dtype, variable_trainable, variable_owner)
        self.method = method
        self.built = True

    def call(self, value, after=()):
        del after  # only orders the write after them
        getattr(self.variable, self.method)(value)
        return tf.identity(self.variable.value)

    def compute_output_spec(self, value, after=()):
        del value, after
        return ReadTensor(self.variable)

    def get_config(self):
        config = super().get_config()
        config.update(autocast=self.autocast, method=self.method, **self._variable_config())
        return config

    @classmethod
    def from_config(cls, config):
        entry = f"VariableWrite `{config.get('name')}`"
        saved_values.saved_layer_config(config, entry, (
            "method", "variable_shape", "variable_dtype", "variable_trainable",
            "variable_owner"))
        method = config.get("method")
        if method not in METHODS:
            saved_values.refuse(entry, "method", f"one of {', '.join(METHODS)}", method)
        cls.check_variable_config(config, entry)
        return cls(**config)


@keras.saving.register_keras_serializable(package="keras_ipu_plugin")
class AfterWrites(keras.layers.Layer):
    """Returns `x` (with its Keras mask) once `writes` are computed.

    Example:
        ```python
        x_after = AfterWrites(name="after_writes")(x, [written_kernel])
        ```
    """

    def __init__(self, **kwargs):
        # `x` passes through as it is: never cast by a policy.
        kwargs["autocast"] = False
        super().__init__(**kwargs)
        self.supports_masking = True
        self.built = True

    def call(self, x, writes):
        with tf.control_dependencies(list(writes)):
            return tf.identity(x)

    def compute_output_spec(self, x, writes):
        del writes
        return keras.KerasTensor(x.shape, dtype=x.dtype)

    def compute_mask(self, x, mask=None):
        return mask

    def get_config(self):
        config = super().get_config()
        config.pop("autocast", None)
        return config

    @classmethod
    def from_config(cls, config):
        saved_values.saved_layer_config(config, f"AfterWrites `{config.get('name')}`")
        return cls(**config)


def is_write_node(operation):
    """Whether `operation` is one of the layers above, or a loss `call`
    added (`AddedLoss`): a node a trace makes for an effect of `call`,
    named by the trace, never expanded, run as itself."""
    return isinstance(operation, (VariableWrite, AfterWrites, AddedLoss))


def mark_shared_variables(model, config):
    """Put `variable_owner` in the saved config (`config`, `model`'s) of each
    read or write node whose variable another layer holds."""
    owners = {}  # id(variable) -> (owner name, index)
    holders = [layer for layer in model.layers if not isinstance(layer, HoldsVariable)]
    holders += [layer for layer in model.layers if isinstance(layer, HoldsVariable)]
    for layer in holders:
        for index, variable in enumerate(layer.weights):
            owners.setdefault(id(variable), (layer.name, index))
    entries = {entry.get("name") or entry.get("config", {}).get("name"): entry
               for entry in config.get("layers", [])}
    for layer in model.layers:
        if not isinstance(layer, HoldsVariable):
            continue
        owner = owners[id(layer.variable)]
        if owner[0] != layer.name and layer.name in entries:
            entries[layer.name]["config"]["variable_owner"] = list(owner)


def link_shared_variables(model, entry):
    """Make each loaded read or write node of `model` that names a
    `variable_owner` hold that layer's variable; `kip.LoadError` naming the
    node when the owner or the variable is not there or does not match."""
    for layer in model.layers:
        owner = getattr(layer, "variable_owner", None)
        if not isinstance(layer, HoldsVariable) or owner is None:
            continue
        where = f"{entry}: {type(layer).__name__} `{layer.name}`"
        name, index = owner
        found = [other for other in model.layers if other.name == name and other is not layer]
        if not found:
            saved_values.refuse(where, "variable_owner", "the name of another layer of the model",
                                name)
        weights = found[0].weights
        if index >= len(weights):
            saved_values.refuse(where, "variable_owner",
                                f"an index among the {len(weights)} weights of `{name}`", index)
        variable, placeholder = weights[index], layer.variable
        if (tuple(variable.shape) != tuple(placeholder.shape)
                or variable.dtype != placeholder.dtype
                or variable.trainable != placeholder.trainable):
            saved_values.refuse(
                where, "variable_owner",
                f"a variable of shape {tuple(placeholder.shape)}, {placeholder.dtype}, "
                f"trainable={placeholder.trainable}",
                f"`{variable.path}` of shape {tuple(variable.shape)}, {variable.dtype}, "
                f"trainable={variable.trainable}")
        layer.link_variable(variable)
