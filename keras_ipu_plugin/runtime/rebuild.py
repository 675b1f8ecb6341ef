"""One step from the IR to Keras: `rebuild(graph)` makes the functional model.

The model calls the very same layer objects as the graph's nodes (so every
variable a pass did not replace is shared), records each node without
calling the layer where the IR already knows its output shapes, and keeps
the graph, the pinned `training` values and the pass annotations on the
model (`KipFunctional`).
"""

import keras

from keras_ipu_plugin import _compat
from keras_ipu_plugin.ir.graph import Value
from keras_ipu_plugin.ir.graph import map_leaves
from keras_ipu_plugin.ir.names import Namespace
from keras_ipu_plugin.runtime.alias import LayerAlias
from keras_ipu_plugin.runtime.functional import KipFunctional


def rebuild(graph, name=None):
    """A `KipFunctional` model running `graph`, with the same layers.

    Example:
        >>> model = rebuild(graph, name="passed")
        >>> model.kip_graph is graph
        True
    """
    inputs = keras.tree.map_structure(
        lambda spec: spec.keras_input(), graph.input_specs
    )
    tensors = {
        id(value): tensor
        for value, tensor in zip(
            keras.tree.flatten(graph.input_values), keras.tree.flatten(inputs)
        )
    }

    def resolve(leaf):
        if isinstance(leaf, Value):
            return tensors[id(leaf)]
        return leaf

    pinned, annotations = {}, {}
    named = _UniqueNames()
    for node in graph.nodes:
        operation = named.operation_for(node)
        args = map_leaves(resolve, node.args)
        kwargs = map_leaves(resolve, node.kwargs)
        kwargs.pop("training", None)
        if node.training in (True, False):
            kwargs["training"] = node.training
            pinned[operation.name] = node.training
        if node.made_by_pass:
            # A new layer may compute other shapes than the one it
            # replaced: let Keras work them out.
            with _compat.call_context(operation, None):
                outputs = keras.tree.flatten(operation(*args, **kwargs))
            for value, tensor in zip(node.outputs, outputs):
                value.spec = tensor
        else:
            outputs = _compat.record_call(
                operation, args, kwargs, [value.spec for value in node.outputs]
            )
        for value, tensor in zip(node.outputs, outputs):
            tensors[id(value)] = tensor
        if node.annotations:
            annotations.setdefault(operation.name, {}).update(node.annotations)
    outputs = map_leaves(resolve, graph.outputs)
    model = KipFunctional(
        inputs,
        outputs,
        name=name or graph.name,
        kip_pinned_training=pinned,
        kip_annotations=annotations,
    )
    model.kip_graph = graph
    object.__setattr__(model, "kip_replaced", tuple(graph.replaced))
    return model


class _UniqueNames:
    """Names the rebuilt model's layers after their nodes.

    A layer inlined by Expand has the node name `parent.child`; the user's
    layer object keeps its own name (the plugin does not rename user
    objects), so the rebuilt model calls it through a `LayerAlias` with the
    node's name. That also gives every layer the distinct name a functional
    model needs when blocks share sub-layer names (`conv1` in every block).
    A layer called at several nodes gets one alias, named after the first.
    Layers a pass created (Replace) are ours and keep the name they were
    given.
    """

    def __init__(self):
        self.taken = Namespace()
        self.chosen = {}  # id(layer) -> the layer or its alias

    def operation_for(self, node):
        operation = node.operation
        if not isinstance(operation, keras.layers.Layer):
            return operation  # keras.ops operations: ours, already named
        if id(operation) in self.chosen:
            return self.chosen[id(operation)]
        own_name = node.name == operation.name or node.made_by_pass
        if own_name and operation.name not in self.taken:
            chosen = operation
            self.taken.add(chosen.name)
        else:
            chosen = LayerAlias(operation, name=self.taken.create(node.name))
        self.chosen[id(operation)] = chosen
        return chosen
