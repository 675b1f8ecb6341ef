"""`Expand`: inline custom layers into the sub-layers their `call` uses.

Each expanded layer's node is replaced by the nodes its `call` traces to,
named `parent.child`. With `targets="all"` expansion repeats until only
built-in Keras layers (and layers that cannot be traced, which stay opaque
and are reported) remain. Sub-layers shared between call sites stay shared,
because the same layer objects are called.
"""

import keras

from keras_ipu_plugin import tracing
from keras_ipu_plugin.graph import FOLLOW
from keras_ipu_plugin.graph import map_values
from keras_ipu_plugin.graph import values_in
from keras_ipu_plugin.opaque import OpaqueLayer
from keras_ipu_plugin.passes.base import ALL
from keras_ipu_plugin.passes.base import Pass
from keras_ipu_plugin.passes.base import as_targets
from keras_ipu_plugin.passes.base import matched_nodes


class Expand(Pass):
    """Inline custom layers (and nested models) into their sub-layers.

    Example:
        >>> passed = kip.apply_passes(converted, [kip.passes.Expand()])
        >>> [n.name for n in passed.kip_graph.nodes][:3]
        ['block_1.dense', 'block_1.batch_normalization', 'block_1.add']
    """

    step = "expand"

    def __init__(self, targets=ALL):
        self.targets = as_targets(targets)

    def run(self, graph, report):
        if self.targets == (ALL,):
            pending = [node for node in graph.nodes if is_expandable(node.operation)]
            recursive = True
        else:
            pending = matched_nodes(graph, self.targets, self.step)
            recursive = False
        while pending:
            node = pending.pop(0)
            new_nodes = expand_node(graph, node, report, self.step)
            if recursive:
                pending = [n for n in new_nodes if is_expandable(n.operation)] + pending
        return graph


def is_expandable(operation):
    """Custom layers and nested functional / sequential models."""
    if not isinstance(operation, keras.layers.Layer) or isinstance(operation, OpaqueLayer):
        return False
    if isinstance(operation, keras.Model):
        return True
    return not type(operation).__module__.startswith("keras.")


def expand_node(graph, node, report, step):
    """Replace `node` by the traced body of its layer; return the new nodes
    (an empty list when the layer stays opaque)."""
    layer = node.operation
    placeholders, tensors = {}, {}
    for value in values_in((node.args, node.kwargs)):
        if id(value) not in tensors:
            tensor = keras.KerasTensor(value.spec.shape, dtype=value.spec.dtype)
            tensors[id(value)] = tensor
            placeholders[id(tensor)] = value
    args = map_values(lambda v: tensors[id(v)], node.args)
    kwargs = map_values(lambda v: tensors[id(v)], node.kwargs)
    training = node.training if node.training in (True, False) else None
    try:
        new_nodes, outputs = tracing.trace_call(
            layer, args, kwargs, placeholders, training=training,
            prefix=node.name + ".",
        )
    except tracing.TraceError as error:
        node.opaque_reason = error.reason
        report.add_opaque(node.name, error.reason)
        return []
    flat_outputs = keras.tree.flatten(outputs)
    if len(flat_outputs) != len(node.outputs):
        reason = (
            f"`call` traced to {len(flat_outputs)} outputs but the layer "
            f"produced {len(node.outputs)}"
        )
        node.opaque_reason = reason
        report.add_opaque(node.name, reason)
        return []
    for new in new_nodes:
        if new.training == FOLLOW and node.training in (True, False):
            new.training = node.training
    output_map = {id(old): new for old, new in zip(node.outputs, flat_outputs)}
    graph.splice(node, new_nodes, output_map)
    report.add(step, node.name, "expanded", ", ".join(n.name for n in new_nodes))
    return new_nodes
