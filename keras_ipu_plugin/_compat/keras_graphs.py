"""Keras's symbolic graphs:

- the nodes Keras records for a symbolic call and the tensors they make;
- how Keras calls a layer: the call context (`training`), the arguments
  `__call__` reads and the masks it adds;
- Keras's functional model: its base class, its run of a graph of layers,
  its nodes and output structure.

Part of `_compat`, the one package that touches private Keras / TensorFlow
APIs (see its `__init__`).
"""

import contextlib

from keras.src.backend.common import global_state
from keras.src.layers.layer import CallContext
from keras.src.models.functional import Functional
from keras.src.ops.node import Node as KerasNode
from keras.src.ops.operation import Operation
from keras.src.utils import naming as _naming


def keras_history(tensor):
    """`(operation, node_index, tensor_index)` of a KerasTensor, or None."""
    return getattr(tensor, "_keras_history", None)


def producing_node(tensor):
    history = keras_history(tensor)
    if history is None:
        return None, None
    operation, node_index, tensor_index = history
    return operation._inbound_nodes[node_index], tensor_index


def node_arguments(node):
    """The `(args, kwargs)` a Keras node was recorded with."""
    return node.arguments.args, node.arguments.kwargs


def node_input_tensors(node):
    """The Keras tensors a Keras node was called on, in its arguments' order."""
    return list(node.arguments.keras_tensors)


def node_outputs(node):
    return list(node.outputs)


def is_input_node(node):
    return node.is_input


class node_lists_snapshot:
    """Undo the node bookkeeping a failed symbolic call leaves on `layers`.

    A symbolic call appends a Node to each called layer's inbound/outbound
    node lists. When a trace fails half way (or is interrupted: Ctrl-C),
    those dangling nodes would stay on the user's layers; leaving the block
    with an exception restores the lists' lengths. With `always=True` they
    are restored on success too (a trace whose result is kept only in our
    IR).

    A class, not a generator: resuming a generator on a clean exit is a
    moment a Ctrl-C can land in, inside its `try`, which would take away
    the nodes of a block that has completed (a conversion already kept).
    It reads the outcome from `__exit__`'s arguments, not `sys.exc_info()`
    (which inside an `except` clause is the caught error).

    Example:
        ```python
        with node_lists_snapshot(all_layers(model)):
            converted = rebuild(graph)
        ```
    """

    def __init__(self, layers, always=False):
        self.lengths = [
            (layer, len(layer._inbound_nodes), len(layer._outbound_nodes))
            for layer in layers
        ]
        self.always = always

    def __enter__(self):
        return self

    def __exit__(self, kind, error, traceback):
        if kind is not None or self.always:
            self.restore()
        return False

    def restore(self):
        """Drop the nodes recorded since the snapshot."""
        for layer, n_in, n_out in self.lengths:
            del layer._inbound_nodes[n_in:]
            del layer._outbound_nodes[n_out:]


def converts_input_args(layer):
    """Whether `layer.__call__` converts its inputs' dtypes before `call`
    (`_convert_input_args`: True for layers and subclassed models, False
    for functional models, which leave it to their layers)."""
    return bool(getattr(layer, "_convert_input_args", True))


def set_keras_mask(tensor, mask):
    from keras.src import backend

    backend.set_keras_mask(tensor, mask)


def node_input_ids(node):
    return [id(tensor) for tensor in node.arguments.keras_tensors]


def node_fill_in(node, tensors):
    """`(args, kwargs)` of `node` with its KerasTensors replaced from
    `tensors` (a dict keyed by KerasTensor id)."""
    return node.arguments.fill_in(tensors)


def record_call(operation, args, kwargs, output_specs):
    """Record `operation(*args, **kwargs)` in a functional graph without
    calling it: its outputs are new KerasTensors shaped like `output_specs`
    (KerasTensors the graph IR kept from the trace).

    A symbolic call would run Keras's `compute_output_spec`, which for a
    layer without `compute_output_shape` traces its whole `call` in a
    scratch TensorFlow graph; the IR already knows every output shape, and
    every layer in it is built, so rebuilding needs only the node.
    """
    outputs = [
        keras_tensor_like(spec, ragged=getattr(spec, "ragged", False))
        for spec in output_specs
    ]
    KerasNode(operation, call_args=args, call_kwargs=kwargs, outputs=outputs)
    return outputs


def keras_tensor_like(spec, ragged=None):
    """A new KerasTensor with `spec`'s shape, dtype, sparse and ragged
    flags, named as Keras names one (`keras_tensor_17`).

    Keras derives that name from the class name with three regular
    expressions per tensor, two thirds of a KerasTensor's cost; a rebuilt
    model of 2,000 layers makes one per layer output. The same counter
    numbers it here.
    """
    import keras

    return keras.KerasTensor(
        spec.shape, dtype=spec.dtype, sparse=spec.sparse,
        ragged=spec.ragged if ragged is None else ragged,
        name=_naming.uniquify("keras_tensor"),
    )


# A `keras.Operation`'s own attributes that are Keras's bookkeeping, not
# what the operation computes (see `copied_operation`).
OPERATION_BOOKKEEPING = frozenset({
    "name", "_inbound_nodes", "_outbound_nodes", "_auto_config", "_auto_config_error_args",
    "_lock", "_remat_mode",
})


def copied_operation(operation):
    """A new `keras.Operation` (not a layer) of `operation`'s class with its
    attributes but none of its Keras nodes: the same `keras.ops` call made
    again, for another block's graph (`frontend/replay.py`). Keras's
    operations hold their arguments as plain attributes and change none of
    them once made; the attributes are shared."""
    new = object.__new__(type(operation))
    vars(new).update(vars(operation))
    new._inbound_nodes = []
    new._outbound_nodes = []
    return new


def forget_nodes(layers):
    """Drop every Keras node recorded on `layers` (layers the plugin made
    for one trace, whose symbolic calls are kept only in the graph IR)."""
    for layer in layers:
        del layer._inbound_nodes[:]
        del layer._outbound_nodes[:]


def broadcast_to_operation(shape):
    """The `keras.ops.broadcast_to` operation for a target `shape` (which may
    hold None, filled in by `BatchSizedOperation` when the graph runs)."""
    from keras.src.ops.numpy import BroadcastTo

    return BroadcastTo(shape=tuple(shape))


def batch_index_operations(axis, dtype):
    """The `keras.ops` operations a graph makes a range over the batch with
    (`start + index * step` along `axis`, the index the running sum of ones
    less one): `{"cumsum", "subtract", "cast", "multiply", "add"}`."""
    from keras.src.ops.core import Cast
    from keras.src.ops.numpy import Add
    from keras.src.ops.numpy import Cumsum
    from keras.src.ops.numpy import Multiply
    from keras.src.ops.numpy import Subtract

    return {"cumsum": Cumsum(axis=axis), "subtract": Subtract(), "cast": Cast(dtype),
            "multiply": Multiply(), "add": Add()}


def keras_mask(tensor):
    """The Keras mask a tensor carries (`_keras_mask`), or None."""
    from keras.src import backend

    return backend.get_keras_mask(tensor) if tensor is not None else None


def in_shape_inference():
    """Whether Keras is only working out output shapes (its
    `compute_output_spec`, a model's symbolic build): nothing computed here
    is ever run."""
    from keras.src.backend.common.symbolic_scope import in_symbolic_scope

    return in_symbolic_scope()


_CALL_CTX = "current_call_ctx"


@contextlib.contextmanager
def call_context(entry_layer, training):
    """Run a block as if inside `entry_layer.__call__(..., training=training)`.

    Sub-layers called without an explicit `training` then resolve it from this
    context exactly as they would inside the real `__call__`.
    """
    previous = global_state.get_global_attribute(_CALL_CTX)
    context = CallContext(entry_layer=entry_layer)
    context.set_value("training", training)
    global_state.set_global_attribute(_CALL_CTX, context)
    try:
        yield
    finally:
        global_state.set_global_attribute(_CALL_CTX, previous)


def call_context_args(operation):
    return getattr(operation, "_call_context_args", ())


def current_training():
    """The `training` value of the Keras call in progress (None outside one)."""
    context = global_state.get_global_attribute(_CALL_CTX)
    return None if context is None else context.get_value("training")


def adopt_call_signature(alias, layer):
    """Make Keras's `alias.__call__` read its arguments as `layer.__call__`
    reads them: which is the first argument, which tensors' masks fill
    `mask` / `<name>_mask`, and so what `compute_mask` is handed.

    Without it a `call(*args, **kwargs)` wrapper hands `compute_mask` the
    tuple of all positional arguments and the tuple of their masks (an
    `Attention` behind an alias then failed to validate its inputs, and an
    embedding's `not_equal(inputs, 0)` mask gained a leading dimension).
    """
    for name in ("_call_signature", "call_signature_parameters", "_call_has_training_arg",
                 "_call_has_mask_arg", "_call_context_args", "_call_has_context_arg",
                 "_allow_non_tensor_positional_args"):
        object.__setattr__(alias, name, getattr(layer, name))


def call_takes_training_argument(layer):
    """Whether Keras hands `layer.__call__`'s `training` on to its `call`
    (`_call_has_training_arg`, also what `fit` reads to call a model as
    `model(x, training=True)` or as `model(x)`)."""
    return layer._call_has_training_arg


def set_call_takes_training_argument(layer, value):
    """Set what `call_takes_training_argument` reads (a converted model
    takes it from the model it was converted from)."""
    object.__setattr__(layer, "_call_has_training_arg", value)


def masks_keras_would_pass(layer, args, kwargs):
    """The mask arguments `layer.__call__(*args, **kwargs)` adds before it
    runs `call` (Keras 3.15's `Layer.__call__`, step 6): `mask` from the
    Keras masks of the one tensor argument when `call` takes `mask`, or
    `<name>_mask` for each tensor argument `<name>` when there are several;
    only those the caller left None. Returns `{argument: masks}` to add.

    Expand calls a layer's `call` directly, not through `__call__`, and
    must hand it the masks `__call__` would have.
    """
    from keras import tree
    from keras.src.layers.layer import CallSpec

    import numpy as np
    import keras

    # `__call__` converts arrays to tensors before it reads the arguments
    # (a graph layer's `(x, self.edges)`), and such tensors carry no mask:
    # stand-ins of their specs keep a nest mixing them with KerasTensors,
    # which Keras refuses, as Keras reads it.
    args, kwargs = tree.map_structure(
        lambda leaf: keras.KerasTensor(leaf.shape, dtype=leaf.dtype.name)
        if isinstance(leaf, np.ndarray) else leaf, (args, dict(kwargs)))
    call_spec = CallSpec(layer._call_signature, layer._call_context_args, args, kwargs)
    added = {}
    tensors = call_spec.tensor_arguments_dict
    if len(tensors) == 1:
        if "mask" in call_spec.argument_names and call_spec.arguments_dict["mask"] is None:
            only = next(iter(tensors.values()))
            added["mask"] = tree.map_structure(keras_mask, only)
    elif len(tensors) > 1:
        for name, value in tensors.items():
            mask_name = f"{name}_mask"
            if mask_name in call_spec.argument_names and call_spec.arguments_dict[mask_name] is None:
                added[mask_name] = tree.map_structure(keras_mask, value)
    return added


def run_functional_graph(model, inputs, mask, operation_fn):
    """`Functional.call`, with a caller-supplied `operation_fn(op) -> callable`.

    Keras 3.10-3.15's `Functional.call` overwrites a `training` value recorded
    on a node (a sub-layer called with a hard-coded `training=False`) with the
    outer `training`; running the graph through our own `operation_fn` lets the
    converted model keep such recorded values.
    """
    from keras import tree

    inputs = model._standardize_inputs(inputs)
    if mask is not None:
        for x, one_mask in zip(inputs, tree.flatten(mask)):
            if one_mask is not None:
                set_keras_mask(x, one_mask)
    outputs = model._run_through_graph(inputs, operation_fn=operation_fn)
    if isinstance(outputs, (list, tuple)) and len(outputs) == 1:
        return outputs[0]
    return outputs


def graph_call_through(model, wrap):
    """`model.call` where it is Keras's run of a graph of layers
    (`Functional.call`, or a built `Sequential`'s, which runs its inner
    functional model), as a function of that `call`'s arguments that calls
    `wrap(operation)` in place of each operation, handing it the call-context
    arguments (`training`) exactly as `Functional.call` does; None for any
    other `call` (a subclass's own).

    Example:
        ```python
        run = graph_call_through(backbone, lambda op: op)   # same as backbone.call
        outputs = run(inputs, training=True)
        ```
    """
    import keras
    from keras.src.models import functional as functional_lib

    call = getattr(type(model), "call", None)
    if call is Functional.call:
        graph = model
    elif (isinstance(model, keras.Sequential) and call is keras.Sequential.call
          and getattr(model, "_functional", None) is not None):
        graph = model._functional
    else:
        return None

    def run(inputs, training=None, mask=None, **kwargs):
        return run_functional_graph(
            graph, inputs, mask,
            lambda op: functional_lib.operation_fn(wrap(op), training=training, **kwargs))

    return run


def functional_nodes(model):
    """The nodes of a functional model in execution order (inputs excluded)."""
    ordered = []
    for depth in sorted(model._nodes_by_depth, reverse=True):
        for node in model._nodes_by_depth[depth]:
            if node.operation is not None and not node.is_input:
                ordered.append(node)
    return ordered


def inbound_nodes(operation):
    """The Keras nodes of `operation`'s calls, in the order they were made
    (a saved functional model loads them back in this order)."""
    return list(getattr(operation, "_inbound_nodes", ()))


def standardize_inputs(model, inputs):
    return model._standardize_inputs(inputs)


def output_structure(model):
    """The nest a functional model's outputs are packed into."""
    return model._outputs_struct


def is_graph_model(model):
    """Whether `model` is a graph of layers (a functional or sequential model
    built on inputs), not a subclassed one."""
    return hasattr(model, "_nodes_by_depth")
