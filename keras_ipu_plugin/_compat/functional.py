"""Keras's functional model: its base class, its run of a graph of layers, its nodes and output structure.

Part of `_compat`, the one package that touches private Keras / TensorFlow
APIs (see its `__init__`)."""

from keras.src.models.functional import Functional  # noqa: F401 (the base class of KipFunctional)

from keras_ipu_plugin._compat.nodes import set_keras_mask


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
        >>> run = graph_call_through(backbone, lambda op: op)   # same as backbone.call
        >>> outputs = run(inputs, training=True)
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
