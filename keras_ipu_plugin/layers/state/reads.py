"""Graph nodes for values a layer's `call` holds rather than receives.

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
    >>> read = VariableRead(model.cls_token, like=model, name="cls_token")
    >>> read(x).shape == model.cls_token.shape
    True
"""

import contextlib
import threading

import keras
import numpy as np
import tensorflow as tf

from keras_ipu_plugin.layers import saved_values


class HoldsVariable:
    """What a graph layer holding one variable of the model (a read, a
    write) shares: the very variable object, tracked (so the functional
    model trains and saves it), or, loaded from a file, a placeholder that
    the loading `KipFunctional` points at the variable of the layer that
    owns it (`variable_owner`, see `shared_variables.py`): a variable held
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
                                "a graph node holds: keras_ipu_plugin.layers.state.reads."
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
        >>> read = VariableRead(layer.scale, like=layer, name="block.scale")
        >>> read(x) is not None and read.variable is layer.scale
        True
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
        >>> positions = HeldConstant(np.arange(16), name="positions")
        >>> positions(x).shape
        (16,)
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
    (`variable_write.py`) and return the variable's value after the write.
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
        >>> with recording_writes(lambda read, method, value: value):
        ...     read_tensor.assign(new_value)
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
        >>> reads = ReadLayers.of_graph(graph)
        >>> reads.variable_read(layer.scale, like=layer, name="block.scale")
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
            >>> reads.gives(node.operation, layer.scale, like=layer)
            True
        """
        entry = self._layers.get(_key(variable, like))
        return entry is not None and entry[1] is read


def _key(variable, layer):
    return (id(variable), layer.dtype_policy.name, bool(layer.autocast), bool(layer.trainable))


__all__ = ["HoldsVariable", "VariableRead", "HeldConstant", "ReadLayers", "ReadTensor",
           "is_read", "recording_writes"]
