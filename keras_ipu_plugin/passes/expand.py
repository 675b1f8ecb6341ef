"""`Expand`: inline custom layers into the sub-layers their `call` uses.

Each expanded layer's node is replaced by the nodes its `call` traces to,
named `parent.child`. With `targets="all"` expansion repeats until only
built-in Keras layers (and layers that cannot be traced, which stay opaque
and are reported) remain. Sub-layers shared between call sites stay shared,
because the same layer objects are called.
"""

import re

import keras

from keras_ipu_plugin import _compat
from keras_ipu_plugin.frontend import tracing
from keras_ipu_plugin.runtime.batch_sized import BatchSizedOperation
from keras_ipu_plugin.errors import PassError
from keras_ipu_plugin.ir.graph import UNTRACED_MASK
from keras_ipu_plugin.ir.graph import InlinedBlock
from keras_ipu_plugin.ir.graph import Node
from keras_ipu_plugin.ir.graph import Value
from keras_ipu_plugin.ir.graph import map_values
from keras_ipu_plugin.ir.graph import values_in
from keras_ipu_plugin.passes.base import ALL
from keras_ipu_plugin.passes.base import Pass
from keras_ipu_plugin.passes.base import as_targets
from keras_ipu_plugin.passes.base import describe
from keras_ipu_plugin.passes.base import matched_blocks
from keras_ipu_plugin.passes.base import matched_nodes_and_blocks
from keras_ipu_plugin.passes.base import matches
from keras_ipu_plugin.passes.base import register_pass
from keras_ipu_plugin.passes.base import saved_config
from keras_ipu_plugin.passes.base import targets_config
from keras_ipu_plugin.passes.base import targets_from_config
from keras_ipu_plugin.runtime.layer_kinds import is_expandable
from keras_ipu_plugin.runtime.layer_kinds import training_agnostic
from keras_ipu_plugin.runtime.masks import AttachMask
from keras_ipu_plugin.runtime.reads import ReadLayers
from keras_ipu_plugin.runtime.random_draws import RandomDraw
from keras_ipu_plugin.runtime.reads import is_read


@register_pass("expand", order=0)
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

    # -- configs and saving ------------------------------------------------------
    def get_config(self):
        return {"targets": targets_config(self.targets, "Expand")}

    @classmethod
    def from_config(cls, config):
        config = saved_config(config, "Expand", required=("targets",))
        return cls(targets_from_config(config["targets"], "Expand"))

    @classmethod
    def from_user_config(cls, value, path, reader):
        """`expand: all` (or `true`), `expand: Block`, `expand: [block_1, Block]`."""
        return cls(reader.targets(value, path))

    def run(self, graph, report):
        if self.targets == (ALL,):
            expand_graph(graph, lambda node: is_expandable(node.operation), report,
                         self.step, recursive=True)
        else:
            # A target inside a layer is reached by expanding that layer; a
            # block already expanded needs nothing more.
            for target in self.targets:
                expand_to_reach(graph, target, report, self.step)
            nodes, _ = matched_nodes_and_blocks(graph, self.targets, self.step)
            matched = {id(node) for node in nodes}
            expand_graph(graph, lambda node: id(node) in matched, report, self.step,
                         recursive=False)
        return graph


def expand_graph(graph, should_expand, report, step, recursive):
    """Expand every node for which `should_expand(node)` holds, in one walk
    over the graph (linear in its size); with `recursive`, the nodes an
    expansion produces are offered to `should_expand` too.

    Returns the nodes that stayed opaque although `should_expand` chose them.
    """
    # old output Value -> the Value that stands for it. Keyed by the Values
    # themselves, not their ids: an expanded node nested in another one is
    # referenced by nothing else once expanded, and a dead Value's id can
    # come back as a new Value's (which would then be rewired silently).
    replaced = {}
    nodes, opaque = [], []
    reads = ReadLayers.of_graph(graph)
    # Names in use across the whole graph: the operations a trace makes are
    # named after their parent's path, and a sub-model shared between call
    # sites is expanded once per site (`Embedding.convert_to_tensor` twice
    # made the rebuilt functional model invalid).
    names = {node.name for node in graph.nodes}

    def resolve(value):
        while value in replaced:
            value = replaced[value]
        return value

    def visit(node, offered):
        if replaced:
            node.args = map_values(resolve, node.args)
            node.kwargs = map_values(resolve, node.kwargs)
            for value in node.input_values:
                if isinstance(value.mask, Value):  # its producer may be expanded
                    value.mask = resolve(value.mask)
        if not (offered and should_expand(node)):
            nodes.append(node)
            return
        traced = trace_node(node, report, reads, names)
        if traced is None:
            nodes.append(node)
            opaque.append(node)
            return
        new_nodes, output_map = traced
        replaced.update(output_map)
        report.add(step, node.name, "expanded", ", ".join(n.name for n in new_nodes))
        for new in new_nodes:
            visit(new, recursive)

    for node in graph.nodes:
        visit(node, True)
    graph.nodes = nodes
    if replaced:
        graph.outputs = map_values(resolve, graph.outputs)
    return opaque


def expand_to_reach(graph, target, report, step):
    """Expand the custom layers that hold `target` (a name, a `parent.child`
    path or a class) among their sub-layers, recursively, until the layers
    it matches are nodes of the graph; a class target then matches a block
    wherever it sits. Raises `PassError` naming the layer when one that
    holds it cannot be expanded. `"all"` needs nothing."""
    if target == ALL:
        return

    def holds_target(node):
        return (
            is_expandable(node.operation) and not node.opaque_reason
            and not matches(node, target) and contains(node, target)
        )

    opaque = expand_graph(graph, holds_target, report, step, recursive=True)
    if opaque:
        node = opaque[0]
        raise PassError(
            f"{step}: target {describe(target)} is inside layer "
            f"`{node.name}`, which cannot be expanded: {node.opaque_reason}"
        )
    # Layers kept opaque at conversion hold what they hold out of reach:
    # the target is an error if found nowhere else, else the report says
    # which of its layers were not reached.
    unreached = [
        node for node in graph.nodes
        if node.opaque_reason and not matches(node, target) and contains(node, target)
    ]
    if not unreached:
        return
    found = any(matches(node, target) for node in graph.nodes) or matched_blocks(graph, target)
    if not found:
        node = unreached[0]
        raise PassError(
            f"{step}: target {describe(target)} is inside layer "
            f"`{node.name}`, which cannot be expanded: {node.opaque_reason}"
        )
    for node in unreached:
        report.add(step, node.name, "not reached",
                   f"{describe(target)} inside it stays as it is: {node.opaque_reason}")


def contains(node, target):
    """Whether `target` (a name, a `parent.child` path or a class) is a
    sub-layer of the layer of `node`."""
    if isinstance(target, str) and target.startswith(node.name + "."):
        return True
    for sub in _compat.sub_layers(node.operation):
        if isinstance(target, str):
            if target == sub.name:
                return True
        elif isinstance(sub, target):
            return True
    return False


def trace_node(node, report, reads=None, names=None):
    """Trace the layer of `node` into new nodes named `node.name + ".child"`.

    `reads` (`reads.ReadLayers`) gives the variable reads already in the
    graph, so a variable read at several places has one read layer.

    Returns `(new_nodes, output_map)`, `output_map` mapping each output
    Value of `node` to the Value that replaces it; or None when the
    layer cannot be traced (then `node.opaque_reason` says why, and the
    report has it). `names`: node names already in use in the graph; the
    new nodes' names are added to it.
    """
    layer = node.operation
    inputs = values_in((node.args, node.kwargs))
    untraced = [value for value in (*inputs, *node.outputs) if value.mask is UNTRACED_MASK]
    if untraced:
        return _stay_opaque(node, (
            f"Keras attaches a mask to {_describe_value(untraced[0], node)} that "
            "could not be traced into the graph (not computed from the model's "
            "inputs by Keras operations), so the expanded layers could not be "
            "handed it as Keras hands it to the layer"
        ), report)
    placeholders, tensors = {}, {}

    def placeholder(value):
        if id(value) not in tensors:
            tensor = keras.KerasTensor(value.spec.shape, dtype=value.spec.dtype)
            tensors[id(value)] = tensor
            placeholders[id(tensor)] = value
            if isinstance(value.mask, Value):
                # The tensor carries its Keras mask in the trace as it does
                # when the graph runs: sub-layers are handed it as they were
                # inside the original call.
                _compat.set_keras_mask(tensor, placeholder(value.mask))
        return tensors[id(value)]

    for value in inputs:
        placeholder(value)
    args = map_values(lambda v: tensors[id(v)], node.args)
    kwargs = map_values(lambda v: tensors[id(v)], node.kwargs)
    # `call` is traced directly, not through `__call__`, which would hand it
    # the masks its inputs carry (`call(x, mask=None)` of a masking layer).
    kwargs.update(_compat.masks_keras_would_pass(layer, args, kwargs))
    # A block whose call pinned `training` is traced under that value only:
    # every sub-layer then records a concrete mode (`trace_call` pins them),
    # so one following the block's `training` gets the block's pinned value.
    training = node.training if node.training in (True, False) else None
    agnostic = training is None and training_agnostic(layer)
    if agnostic:
        training = False  # one trace is enough: no sub-layer reads it
    try:
        new_nodes, outputs = tracing.trace_call(
            layer, args, kwargs, placeholders, training=training,
            prefix=node.name + ".", reads=reads,
        )
    except tracing.TraceError as error:
        return _stay_opaque(node, error.reason, report)
    # None leaves (a cache not given) are no Values: the node had none.
    flat_outputs = [leaf for leaf in keras.tree.flatten(outputs) if leaf is not None]
    if len(flat_outputs) != len(node.outputs):
        return _stay_opaque(node, (
            f"`call` traced to {len(flat_outputs)} outputs but the layer "
            f"produced {len(node.outputs)}"
        ), report)
    used = set() if names is None else names
    block = InlinedBlock(node.name, layer)
    for new in new_nodes:
        new.from_blocks = [*node.from_blocks, block, *new.from_blocks]
        if new.opaque_reason:  # a dynamic sub-layer, kept whole
            report.add_opaque(f"{node.name}.{new.operation.name}", new.opaque_reason)
        if agnostic:
            new.training = None
        _name_after_path(new, node.name, used)
    flat_outputs = _with_masks_of_call(node, layer, flat_outputs, new_nodes, block, used)
    return new_nodes, dict(zip(node.outputs, flat_outputs))


def _with_masks_of_call(node, layer, outputs, new_nodes, block, used):
    """`outputs` of the expanded `call`, each carrying the Keras mask the
    layer's `__call__` gave the original output: Keras keeps the masks
    `call` set when every output has one, and otherwise (for a layer that
    supports masking) attaches its `compute_mask` result, the mask the
    node's output carries in the graph, to each output without one. An
    `AttachMask` node (appended to `new_nodes`) attaches it."""
    if not layer.supports_masking or all(value.mask is not None for value in outputs):
        return outputs
    attached = []
    for old, new in zip(node.outputs, outputs):
        if new.mask is not None or old.mask is None:
            attached.append(new)
            continue
        name, count = f"{node.name}.mask", 0
        while name in used:
            count += 1
            name = f"{node.name}.mask_{count}"
        used.add(name)
        attach = Node(name, AttachMask(name=name), (new,), {"mask": old.mask},
                      output_structure=None)
        attach.from_blocks = [*node.from_blocks, block]
        attach.outputs = [Value(attach, 0, new.spec, mask=old.mask)]
        new_nodes.append(attach)
        attached.append(attach.outputs[0])
    return attached


def _describe_value(value, node):
    if value in node.outputs:
        return f"output {node.outputs.index(value)} of `{node.name}`"
    where = value.producer.name if value.producer is not None else "the model's input"
    return f"an input of `{node.name}` (from `{where}`)"


def _stay_opaque(node, reason, report):
    node.opaque_reason = reason
    report.add_opaque(node.name, reason)
    return None


_AUTO_SUFFIX = re.compile(r"_\d+$")


def _name_after_path(node, parent_path, used):
    """Name `node` `parent.child`.

    The user's layers keep their own names (`Graph.rebuild` calls a layer
    whose name is already taken through a `LayerAlias` named after its
    path). The `keras.ops` operations the trace made are ours: they take
    their path as their name, since their auto-generated one (`add_17`)
    depends on what ran before.
    """
    operation = node.operation
    if is_read(operation):
        # Named after its path when traced (`parent.scale`); a variable read
        # at several places keeps one layer, named after the first.
        used.add(node.name)
        return
    if not isinstance(operation, keras.layers.Layer) or isinstance(
        operation, (BatchSizedOperation, RandomDraw)
    ):
        # A keras.ops operation the trace made: its auto-generated name
        # (`add_17`) depends on what ran before; number it within its parent.
        base = _AUTO_SUFFIX.sub("", operation.name) or "op"
        name, count = f"{parent_path}.{base}", 0
        while name in used:
            count += 1
            name = f"{parent_path}.{base}_{count}"
        used.add(name)
        node.name = operation.name = name
        return
    # A sub-layer called twice in one `call` (a rotary embedding applied to
    # the queries and the keys) gets a numbered path at its second node:
    # expanded, each call site's nodes need names of their own.
    base = name = f"{parent_path}.{operation.name}"
    count = 0
    while name in used:
        count += 1
        name = f"{base}_{count}"
    node.name = name
    used.add(name)
