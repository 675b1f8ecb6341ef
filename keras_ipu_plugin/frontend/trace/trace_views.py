"""The views a trace calls instead of the user's layers: their classes, the output
specs their symbolic calls give, and the losses their `add_loss` records.

The classes of the views a trace calls instead of the user's layers.

`call` runs on a view of the traced layer (`user_code.layer_view`) whose
user-written sub-layers are views too, of a class made here
(`inline_view_class`): their symbolic calls work out the output shapes by
running their own `call` inline on the KerasTensors
(`_inline_output_spec`). Keras would otherwise trace each custom block's
`call` in a scratch TensorFlow graph (`compute_output_spec`), several times
slower. A block whose `call` does not run on KerasTensors (TensorFlow ops on
them) falls back to Keras's own way; one that fails that way too (Python
control flow on a tensor's value) but runs once AutoGraph has converted it
is marked to become one opaque node (`OPAQUE`), so the rest of the model is
still traced.

Keras's own layers held by the traced layer are called through views of
`builtin_view_class`: a call on concrete tensors only is lifted onto
`HeldConstant` nodes (`_lifting_call`) and their output specs are made
precise (`precise_specs`, below). Both kinds consult the trace in progress
(`current_trace`, set by `CallTrace.active` in `call_trace.py`).

Example:
    ```python
    view = layer_view(block, inline_view_class)   # what `trace_once` calls
    ```

Output specs as precise as the inputs allow (spec precision).

Keras's own output specs leave a dimension unknown where a layer's formula
cannot tell it (`EinsumDense(output_shape=(None, heads, dim))` leaves the
sequence length out) and call a product sparse where one factor is not a
Keras tensor. Later code in a traced `call` reads these shapes
(`ops.arange(ops.shape(x)[1])`), and a None there would be taken for the
batch size: `precise_specs` asks TensorFlow's shape inference instead, and
`dense_unless_given_sparse` keeps a spec dense that no sparse argument made.

Example:
    ```python
    precise_specs(einsum_dense, (x,), {}, recorded)   # (None, 7, 4, 8), not (None, None, 4, 8)
    ```

The losses a traced `call` adds (`self.add_loss(...)`), recorded as graph nodes.

keras.io's VQ-VAE (https://keras.io/examples/generative/vq_vae/) adds its
quantizer's losses in `call`:

    self.add_loss(self.beta * commitment_loss + codebook_loss)

Traced, the loss is a symbolic tensor, which Keras's `add_loss` refuses
("can only be called ... on a tensor input"), and the layer stayed whole.
The views tracing calls (`inline_view_class`) take `add_loss`
here instead: the traced layer's own `add_loss` of a symbolic loss becomes
an `AddedLoss` node on it (`layers/state.py`), which adds the loss
each time the graph runs; the call's first output comes after it, as after
a variable write (`writes_lib.WriteRecorder.finish`), so no loss is left
out of the graph. A concrete loss (computed eagerly while traced, from no
input) is held by a `HeldConstant` node, as other concrete tensors are,
and checked not to be computed from a weight the graph would freeze.

A sub-layer's `add_loss` met while its output shape is worked out (its
`call` run inline for the spec, the sub-layer being one node of the traced
graph) records nothing: the sub-layer's node adds its loss when it runs,
or its own trace records it when Expand inlines it. Outside a trace, and
on a concrete loss anywhere, `add_loss` is Keras's own.

Example:
    ```python
    # in `type(layer).call(view, x)` while tracing `layer`:
    view.add_loss(ops.mean(x ** 2))    # an AddedLoss node; None
    ```
"""

import contextlib
import functools
import threading

import keras
import numpy as np
import tensorflow as tf

from keras_ipu_plugin import _compat
from keras_ipu_plugin.frontend.replay import output_specs_key
from keras_ipu_plugin.frontend.trace import writes as writes_lib
from keras_ipu_plugin.frontend.trace.failures import (
    describe_failure,
    TraceError,
    ModeStructureError,
)
from keras_ipu_plugin.layers.state import AddedLoss
from keras_ipu_plugin.layers.state import is_read
from keras_ipu_plugin.layers.user_code import takes_keyword, takes_training
from keras_ipu_plugin.layers.user_code import shallow_view, viewed_layer

__all__ = ["traced_add_loss"]


_active = threading.local()  # the stack of traces in progress, on this thread


def current_trace():
    """The `CallTrace` in progress on this thread (the innermost), or None."""
    stack = getattr(_active, "stack", None)
    return stack[-1] if stack else None


@contextlib.contextmanager
def in_progress(trace):
    """Make `trace` the one in progress while the context lasts."""
    stack = _active.__dict__.setdefault("stack", [])
    stack.append(trace)
    try:
        yield
    finally:
        stack.pop()


@functools.lru_cache(maxsize=None)
def inline_view_class(cls, function):
    """A subclass of `cls` whose symbolic calls run `call` inline (see the
    module docstring); classes that say their own output shape keep it."""
    # `add_loss` of a symbolic loss is a graph node (`frontend/trace/trace_views.py`).
    if states_own_output_shape(cls):
        return type(cls.__name__, (cls,), {"__module__": cls.__module__,
                                           "compute_output_spec": _own_output_spec,
                                           "__call__": _lifting_call,
                                           "add_loss": traced_add_loss})
    return type(cls.__name__, (cls,), {
        "__module__": cls.__module__,
        "compute_output_spec": _inline_output_spec,
        "__call__": _lifting_call,
        "add_loss": traced_add_loss,
    })


_NONE_LEAVES = "_kip_none_leaves"  # in a view's dict: see `_tensors_only`


def _tensors_only(view, outputs):
    """`outputs` for Keras's node: a layer may return None among its outputs
    (keras_hub's attention returns `(output, None)` when given no cache),
    which a Keras node rejects. The node then records the tensors alone, and
    the structure with its None leaves is kept on the view until its
    `__call__` (`_lifting_call`) hands it back to the calling code."""
    leaves = keras.tree.flatten(outputs)
    if not any(leaf is None for leaf in leaves):
        return outputs
    if all(leaf is None for leaf in leaves):
        raise TraceError(f"`{viewed_layer(view).name}` returns no tensor, only None")
    vars(view)[_NONE_LEAVES] = outputs
    return [leaf for leaf in leaves if leaf is not None]


def _own_output_spec(self, *args, **kwargs):
    """The class's own `compute_output_spec`, with None outputs kept aside
    (`_tensors_only`), handed `training` only if it takes it: Keras passes
    the mode of the trace on to every layer whose `call` takes it, and
    keras_hub's `DINOV2Embedding.compute_output_spec(inputs)` does not."""
    compute_output_spec = super(type(self), self).compute_output_spec
    if "training" in kwargs and not takes_keyword(compute_output_spec, "training"):
        kwargs = {key: value for key, value in kwargs.items() if key != "training"}
    return _tensors_only(self, compute_output_spec(*args, **kwargs))


OPAQUE = "_kip_opaque"  # in a view's dict: (reason, output specs) when opaque


def _inline_output_spec(self, *args, **kwargs):
    """Output KerasTensors of `self.call(*args, **kwargs)`, run on the
    KerasTensors themselves; Keras's scratch-graph way if that fails, and
    AutoGraph's (the view then stands for an opaque node) if that fails."""
    # Blocks of one kind (`replay.output_specs_key`) give the same output
    # specs: their `call` runs once per trace, not once per block.
    trace = current_trace()
    key = None if trace is None else output_specs_key(
        viewed_layer(self), args, kwargs, _compat.current_training())
    if key is not None and key in trace.output_specs:
        return _tensors_only(
            self, keras.tree.map_structure(fresh_keras_tensor, trace.output_specs[key]))
    layers = _compat.all_layers(self)
    # A failure of the layer's own code (a TraceError too: a draw the graph
    # cannot order) makes this layer opaque, not the one calling it; only
    # `_tensors_only`'s refusal (a layer returning no tensor) goes up.
    try:
        with _compat.node_lists_snapshot(layers, always=True), \
                writes_lib.deferred(viewed_layer(self)):
            outputs = keras.tree.map_structure(fresh_keras_tensor, self.call(*args, **kwargs))
    except ModeStructureError:
        raise  # no node can hold it: up to the model (`ModeStructureError`)
    except Exception:
        pass
    else:
        if key is not None:
            trace.output_specs[key] = outputs
        return _tensors_only(self, outputs)
    try:
        outputs = super(type(self), self).compute_output_spec(*args, **kwargs)
    except Exception as error:
        layer = viewed_layer(self)  # only views have this method
        try:
            outputs = _scratch_graph_output_spec(self, args, kwargs)
        except Exception:
            try:
                outputs = _autograph_output_spec(layer, args, kwargs)
            except Exception:
                raise error from None
            vars(self)[OPAQUE] = (describe_failure(error, default=layer.name), outputs)
    return _tensors_only(self, outputs)


def _scratch_graph_output_spec(view, args, kwargs):
    """Output KerasTensors of `view.call` run on symbolic TensorFlow tensors
    in a scratch graph, as Keras runs a layer stating no output shape.

    A class here inherits its `compute_output_spec` from a class whose `call`
    it overrides (keras_hub's XLNet `TwoStreamRelativeAttention`, a
    `MultiHeadAttention` called with `content_stream=...`), so that one
    refuses the arguments; and `call` on KerasTensors can fail where a
    sub-layer's own spec is less precise than TensorFlow's shape inference
    (an `EinsumDense(output_shape=(None, heads, dim))` leaving the sequence
    length unknown, which `call` then computes with)."""
    if states_own_output_shape(type(viewed_layer(view))):
        raise TypeError("the class states its own output shape")
    return _compat.Operation.compute_output_spec(view, *args, **kwargs)


def _autograph_output_spec(layer, args, kwargs):
    """Output KerasTensors of `layer`'s call run as an `OpaqueLayer` runs it
    in graph mode (AutoGraph-converted), traced in a scratch graph."""
    from keras_ipu_plugin.layers.opaque import autograph_call

    symbols = [leaf for leaf in keras.tree.flatten((args, kwargs))
               if isinstance(leaf, keras.KerasTensor)]

    def run(*tensors):
        supply = iter(tensors)
        filled_args, filled_kwargs = keras.tree.map_structure(
            lambda leaf: next(supply) if isinstance(leaf, keras.KerasTensor) else leaf,
            (args, kwargs),
        )
        return autograph_call(layer, filled_args, filled_kwargs)

    function = tf.function(run, autograph=False)
    traced = function.get_concrete_function(
        *[tf.TensorSpec(t.shape, t.dtype) for t in symbols]
    )
    return keras.tree.map_structure(
        lambda t: keras.KerasTensor(t.shape, dtype=t.dtype), traced.structured_outputs
    )


def _lifting_call(self, *args, **kwargs):
    """`__call__` of a view: a direct sub-layer of the traced layer called
    on concrete tensors only (`self.embedding(ops.arange(n))`) would run
    eagerly and its output, computed from its weights, would be frozen into
    the graph; it is called on `HeldConstant` nodes holding them instead."""
    trace = current_trace()
    if trace is not None and id(self) in trace.lift_for:
        leaves = keras.tree.flatten((args, kwargs))
        if not any(isinstance(leaf, keras.KerasTensor) for leaf in leaves) and any(
            is_concrete(leaf) for leaf in leaves
        ):
            args, kwargs = trace.lift(args, kwargs, viewed_layer(self))
    if trace is None:
        outputs = super(type(self), self).__call__(*args, **kwargs)
    else:  # ordered among the writes `call` makes (`writes.py`)
        args, kwargs = trace.writes.before_call(self, args, kwargs)
        outputs = None
        try:
            outputs = super(type(self), self).__call__(*args, **kwargs)
        finally:
            trace.writes.after_call(self, outputs)
    structure = vars(self).pop(_NONE_LEAVES, None)
    if structure is None:
        return outputs
    # Keras recorded the tensors alone (`_tensors_only`); the calling code
    # gets the structure it returned, None leaves and all, holding the very
    # tensors Keras recorded (and set masks on).
    if trace is not None:
        # The Keras node is kept with the entry: a node of an inline
        # computation is dropped once it ends, and its id can come back as
        # another node's.
        keras_node = _compat.producing_node(outputs[0])[0]
        trace.none_leaves[id(keras_node)] = (keras_node, structure)
    return structure


def graph_operation(operation):
    """`operation`, one of the layers of a functional model whose graph a
    trace runs, as the trace calls it: `Functional.call` hands `training` to
    every layer whose `call` takes it, and a symbolic call hands it on to
    the layer's `compute_output_spec`, which may not take it (keras_hub's
    `DINOV2Embedding.compute_output_spec(inputs)`: Keras builds the model
    without `training`, so never calls it with one). Such a layer is called
    through a view whose `compute_output_spec` is called without it, as
    Keras calls it; its node still records `training`, which its `call`
    is handed when the graph runs.

    Example:
        ```python
        run = _compat.graph_call_through(backbone, graph_operation)
        ```
    """
    if not isinstance(operation, keras.layers.Layer) or not takes_training(operation):
        return operation
    if not _spec_refuses_training(type(operation)):
        return operation
    return shallow_view(operation, _spec_without_training_class(type(operation)))


@functools.lru_cache(maxsize=None)
def _spec_refuses_training(cls):
    return not takes_keyword(cls.compute_output_spec, "training")


@functools.lru_cache(maxsize=None)
def _spec_without_training_class(cls):
    def compute_output_spec(self, *args, **kwargs):
        kwargs = {key: value for key, value in kwargs.items() if key != "training"}
        return super(view_class, self).compute_output_spec(*args, **kwargs)

    view_class = type(cls.__name__, (cls,), {"__module__": cls.__module__,
                                             "compute_output_spec": compute_output_spec})
    return view_class


@functools.lru_cache(maxsize=None)
def builtin_view_class(cls, variable_names=frozenset()):
    """A subclass of a Keras layer class whose calls on concrete tensors are
    lifted (`_lifting_call`), whose output shapes are as precise as its
    inputs allow (`_precise_output_spec`) and whose variables
    `variable_names` read as graph values from the traced `call`'s own code
    (`writes_lib.reading_members`); everything else is the class's own."""
    return type(cls.__name__, (cls,), {"__module__": cls.__module__,
                                       "__call__": _lifting_call,
                                       "compute_output_spec": _precise_output_spec,
                                       **writes_lib.reading_members(cls, variable_names)})


def _precise_output_spec(self, *args, **kwargs):
    """The layer's own output spec, made precise by `precise_specs` where
    it leaves a dimension unknown that its inputs know: the code after it
    in `call` reads it (keras_hub's Gemma attention reshapes to
    `ops.shape(q)` after an `EinsumDense(output_shape=(None, heads, dim))`,
    whose own spec leaves the sequence length out; a None there would be
    taken for the batch size)."""
    outputs = super(type(self), self).compute_output_spec(*args, **kwargs)
    flat = keras.tree.flatten(outputs)
    if not all(isinstance(t, keras.KerasTensor) for t in flat):
        return outputs
    precise = precise_specs(self, args, kwargs, flat)
    if precise is flat:
        return outputs
    return keras.tree.pack_sequence_as(outputs, precise)


def is_concrete(leaf):
    return isinstance(leaf, np.ndarray) or (
        tf.is_tensor(leaf) and not isinstance(leaf, (keras.KerasTensor, keras.Variable))
        and not isinstance(leaf, tf.Variable)
    )


def fresh_keras_tensor(tensor):
    if tensor is None:  # kept aside by `_tensors_only`
        return None
    if not isinstance(tensor, keras.KerasTensor):
        raise TypeError(f"`call` returned a {type(tensor).__name__}")
    return _compat.keras_tensor_like(tensor)


def states_own_output_shape(cls):
    """Whether `cls` defines its output shape for the `call` it has: a
    `compute_output_spec` / `compute_output_shape` of its own, not only one
    inherited from a class whose `call` it overrides. (keras_hub's
    `CachedMultiHeadAttention` adds `cache` to `MultiHeadAttention.call`,
    whose `compute_output_spec` knows no `cache` argument.)"""
    def owner(name):
        return next(klass for klass in cls.__mro__ if name in vars(klass))

    call_owner = owner("call")
    for name in ("compute_output_spec", "compute_output_shape"):
        spec_owner = owner(name)
        if spec_owner in (keras.layers.Layer, _compat.Operation):
            continue
        if issubclass(spec_owner, call_owner):
            return True
    return False


def precise_specs(operation, args, kwargs, outputs):
    """The output specs of a layer's call: as recorded, or, where Keras
    left a dimension other than the batch unknown although the inputs
    know theirs (`EinsumDense(output_shape=(None, heads, dim))` leaves the
    sequence length out), as TensorFlow's shape inference on the layer's
    `call` works them out. Later traces of the graph start from these
    shapes, and code such as `ops.arange(ops.shape(x)[1])` needs them."""
    if not isinstance(operation, keras.layers.Layer) or is_read(operation) or all(
        None not in tuple(t.shape)[1:] for t in outputs
    ):
        return outputs
    inputs = [leaf for leaf in keras.tree.flatten((args, kwargs))
              if isinstance(leaf, keras.KerasTensor)]
    if any(None in tuple(t.shape)[1:] for t in inputs):
        return outputs
    try:  # `call` run on symbolic TensorFlow tensors, not the layer's formula
        inferred = [t for t in keras.tree.flatten(
            _compat.Operation.compute_output_spec(operation, *args, **kwargs)
        ) if t is not None]
    except Exception:  # the recorded shapes are right, only less precise
        return outputs
    if len(inferred) != len(outputs):
        return outputs
    precise = []
    for recorded, better in zip(outputs, inferred):
        shape, known = tuple(recorded.shape), tuple(better.shape)
        if len(shape) != len(known) or any(
            a is not None and a != b for a, b in zip(shape[1:], known[1:])
        ):
            return outputs
        precise.append(keras.KerasTensor(
            shape[:1] + known[1:], dtype=recorded.dtype, sparse=recorded.sparse))
    return precise


def dense_unless_given_sparse(specs, structure):
    """`specs` with `sparse=False` where no argument is sparse. Keras's
    `ops.multiply` calls its output sparse when either argument is not a
    tensor of its own (`x * ops.cast(scale, x.dtype)` in keras_hub's Gemma
    embedding); a layer later rebuilt on such a spec is traced on a
    SparseTensor and fails (or computes sparse). `structure`: the
    arguments, a KerasTensor given as the spec recorded for it."""
    if not any(spec.sparse for spec in specs) or any(
        getattr(leaf, "sparse", False) is True or isinstance(leaf, tf.SparseTensor)
        for leaf in keras.tree.flatten(structure)
    ):
        return specs
    return [
        keras.KerasTensor(spec.shape, dtype=spec.dtype, ragged=spec.ragged) if spec.sparse else spec
        for spec in specs
    ]


def traced_add_loss(view, loss):
    """`add_loss` of a view of a user layer (see the module docstring)."""
    leaves = keras.tree.flatten(loss)
    recorder = writes_lib.current()
    symbolic = any(isinstance(leaf, keras.KerasTensor) for leaf in leaves)
    if recorder is None:
        return super(type(view), view).add_loss(loss)
    trace = recorder.trace
    if view is not recorder.view and _user_layer(view) is not _user_layer(trace.layer):
        if symbolic:
            return None  # a sub-layer's spec: its own node or trace adds the loss
        return super(type(view), view).add_loss(loss)
    if not recorder.in_own_context():
        raise writes_lib.WriteError(
            "`call` adds a loss (`self.add_loss(...)`) inside a branch or a loop "
            "(`ops.cond`, `ops.while_loop`, `ops.scan`...), which one graph node cannot "
            "hold: write the loss outside it, added once, choosing with "
            "`ops.where(condition, loss, 0.0)`, for the layer to expand")
    if not all(isinstance(leaf, keras.KerasTensor) or keras.ops.is_tensor(leaf)
               for leaf in leaves):
        # a number: Keras refuses it, in the original's call as here
        return super(type(view), view).add_loss(loss)
    for leaf in leaves:
        if not isinstance(leaf, keras.KerasTensor):
            # computed eagerly while traced, from no input: held by the graph
            # as other concrete tensors are (and checked not to be a weight
            # the graph would freeze)
            leaf = trace.lift((leaf,), {}, trace.layer, role="added_loss")[0][0]
        name = trace.unique_name("add_loss")
        added = AddedLoss(adds_for=_user_layer(trace.layer), name=name)
        output = trace.record_layer(added, name, leaf)
        recorder.writes.append(output)  # the call's first output comes after it
    return None


def _user_layer(layer):
    """The user's layer behind `layer` (a view, a view of a view, or it)."""
    while viewed_layer(layer) is not None:
        layer = viewed_layer(layer)
    return layer
