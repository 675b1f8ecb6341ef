"""Inline one call of a custom layer: what `Expand` does at each node.

`inline_call(graph, node, ...)` traces the layer's `call` at `node` (or
replays the trace of a block of the same kind, `frontend/replay.py`) and
puts the nodes it makes in the node's place with the graph's primitives:
inserted before it, the node's users rewired to the new outputs, the node
erased. The new nodes are named after their path, `parent.child`, in the
graph's one namespace (the second call of a sub-layer in one `call` is
`parent.child_1`).
"""

import re

import keras

from keras_ipu_plugin.frontend import tracing
from keras_ipu_plugin.ir.graph import InlinedBlock
from keras_ipu_plugin.ir.graph import map_values
from keras_ipu_plugin.ir.graph import values_in
from keras_ipu_plugin.runtime.batch_sized import BatchSizedOperation
from keras_ipu_plugin.runtime.layer_kinds import training_agnostic
from keras_ipu_plugin.runtime.reads import is_read

_AUTO_SUFFIX = re.compile(r"_\d+$")


def inline_call(graph, node, report, reads, templates):
    """Replace `node` by the nodes its layer's `call` traces to.

    `reads` (`reads.ReadLayers`) holds the graph's variable reads (one read
    layer per variable); `templates` (`replay.CallTemplates`) the traces to
    replay. Returns the new nodes, in order; or None when the layer cannot
    be traced (then `node.opaque_reason` says why, and the report has it).

    Example:
        >>> new_nodes = inline_call(graph, graph.node("block_1"), report,
        ...                         ReadLayers.of_graph(graph), CallTemplates())
        >>> [n.name for n in new_nodes]
        ['block_1.dense', 'block_1.norm', 'block_1.add']
    """
    layer = node.operation
    # A block whose call pinned `training` is traced under that value only:
    # every sub-layer then records a concrete mode (`trace_call` pins them),
    # so one following the block's `training` gets the block's pinned value.
    training = node.training if node.training in (True, False) else None
    agnostic = training is None and training_agnostic(layer)
    traced = templates.replay(node) or _trace(node, report, reads, templates, agnostic)
    if traced is None:
        return None
    new_nodes, outputs = traced
    block = InlinedBlock(node.name, layer)
    for new in new_nodes:
        new.from_blocks = [*node.from_blocks, block, *new.from_blocks]
        if new.opaque_reason:  # a dynamic sub-layer, kept whole
            report.add_opaque(f"{node.name}.{new.operation.name}", new.opaque_reason)
        if agnostic:
            new.training = None
        new.name = _path(new, node.name)
    graph.insert_before(node, new_nodes)
    for new in new_nodes:
        if _is_ours(new.operation):
            # A keras.ops operation the trace made: named as its node, as its
            # auto-generated name (`add_17`) depends on what ran before.
            new.operation.name = new.name
    for old, replacement in zip(node.outputs, outputs):
        graph.replace_all_uses_with(old, replacement)
    graph.erase_node(node)
    return new_nodes


def _trace(node, report, reads, templates, agnostic):
    """`(new nodes, flat outputs)` of tracing the layer at `node`, or None."""
    placeholders, tensors = {}, {}
    for value in values_in((node.args, node.kwargs)):
        if value not in tensors:
            tensors[value] = keras.KerasTensor(value.spec.shape, dtype=value.spec.dtype)
            placeholders[id(tensors[value])] = value
    training = node.training if node.training in (True, False) else None
    try:
        new_nodes, outputs = tracing.trace_call(
            node.operation, map_values(tensors.__getitem__, node.args),
            map_values(tensors.__getitem__, node.kwargs), placeholders,
            # one trace is enough where no sub-layer reads `training`
            training=False if agnostic else training, prefix=node.name + ".", reads=reads,
        )
    except tracing.TraceError as error:
        return _stay_opaque(node, error.reason, report)
    outputs = keras.tree.flatten(outputs)
    if len(outputs) != len(node.outputs):
        return _stay_opaque(node, (
            f"`call` traced to {len(outputs)} outputs but the layer "
            f"produced {len(node.outputs)}"
        ), report)
    templates.record(node, new_nodes, outputs)
    return new_nodes, outputs


def _stay_opaque(node, reason, report):
    node.opaque_reason = reason
    report.add_opaque(node.name, reason)
    return None


def _is_ours(operation):
    return not isinstance(operation, keras.layers.Layer) or isinstance(
        operation, BatchSizedOperation)


def _path(node, parent):
    """The name `node` asks for (the namespace numbers it if taken).

    The user's layers are named after their own name (`parent.dense`; the
    layer itself keeps its name). A variable read keeps the name the trace
    gave it after its attribute (`parent.scale`). A keras.ops operation
    the trace made is numbered within its parent (`parent.add`), its
    auto-generated suffix dropped.
    """
    if is_read(node.operation):
        return node.name
    if _is_ours(node.operation):
        return f"{parent}.{_AUTO_SUFFIX.sub('', node.operation.name) or 'op'}"
    return f"{parent}.{node.operation.name}"
