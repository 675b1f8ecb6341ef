"""The nodes Keras records for a symbolic call and the tensors they make.

Part of `_compat`, the one package that touches private Keras / TensorFlow
APIs (see its `__init__`)."""

from keras.src.ops.node import Node as KerasNode
from keras.src.ops.operation import Operation  # noqa: F401 (the base class of keras.ops operations)
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
        >>> with node_lists_snapshot(all_layers(model)):
        ...     converted = rebuild(graph)
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
    again, for another block's graph (`frontend/replay/templates.py`). Keras's
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
