"""`Expand` and what it does at each node it expands: inline one call of a custom
layer. One concept: inlining.

`Expand`: inline custom layers into the sub-layers their `call` uses.

Each expanded layer's node is replaced by the nodes its `call` traces to,
named `parent.child` (`inline_call`, below). With `targets="all"`
expansion repeats until only built-in Keras layers (and layers that cannot
be traced, which stay opaque and are reported) remain. Sub-layers shared
between call sites stay shared, because the same layer objects are called.

Inline one call of a custom layer: what `Expand` does at each node.

`inline_call(graph, node, ...)` traces the layer's `call` at `node` (or
replays the trace of a block of the same kind, `frontend/replay.py`) and
puts the nodes it makes in the node's place with the graph's primitives:
inserted before it, the node's users rewired to the new outputs, the node
erased. The new nodes are named after their path, `parent.child`, in the
graph's one namespace (the second call of a sub-layer in one `call` is
`parent.child_1`).

Masks follow Keras: the layer's `call` is handed the masks its inputs carry
as `__call__` would hand them, and its outputs carry the masks `__call__`
would attach (an `AttachMask` node, `parent.mask`, where the inlined ops
leave an output without one).
"""

import re

import keras

from keras_ipu_plugin import _compat
from keras_ipu_plugin.errors import PassError
from keras_ipu_plugin.frontend.replay import CallTemplates
from keras_ipu_plugin.frontend.trace.attribute_paths import attribute_paths, path_of
from keras_ipu_plugin.frontend.trace.failures import TraceError
from keras_ipu_plugin.frontend.trace.tracer import tracer_of
from keras_ipu_plugin.frontend.trace.training_modes import with_branch_nodes
from keras_ipu_plugin.ir.graph import (
    UNTRACED_MASK,
    InlinedBlock,
    Node,
    Value,
    map_values,
    values_in,
)
from keras_ipu_plugin.layers.keras_ops.batch_sized import BatchSizedOperation
from keras_ipu_plugin.layers.keras_ops.masks import AttachMask
from keras_ipu_plugin.layers.keras_ops.random_draws import RandomDraw
from keras_ipu_plugin.layers.layer_kinds import is_expandable, training_agnostic
from keras_ipu_plugin.layers.opaque import OpaqueLayer
from keras_ipu_plugin.layers.state import ReadLayers, is_read, is_write_node
from keras_ipu_plugin.layers.user_code import is_keras_module
from keras_ipu_plugin.passes.infra.base import (
    ALL,
    contains,
    Pass,
    as_targets,
    describe,
    matched_blocks,
    matched_nodes_and_blocks,
    matches,
    register_pass,
    saved_config,
    targets_config,
    targets_from_config,
)
from keras_ipu_plugin.passes.infra.base import in_branches, run_inside, split_targets
from keras_ipu_plugin.passes.infra.patterns import Chain, names_a_path
from keras_ipu_plugin.runtime.mode_switch import ModeSwitch


@register_pass("expand", order=0)
class Expand(Pass):
    """Inline custom layers (and nested models) into their sub-layers.

    Example:
        ```python
        passed = kip.apply_passes(converted, [kip.passes.Expand()])
        [n.name for n in passed.kip_graph.nodes][:3]
        # -> ['block_1.dense', 'block_1.batch_normalization', 'block_1.add']
        ```
    """

    step = "expand"

    def __init__(self, targets=ALL):
        self.targets = as_targets(targets)
        if any(isinstance(target, Chain) for target in self.targets):
            raise PassError("Expand takes layers to expand (names, classes or 'all'), "
                            "not a Chain: a chain's nodes are already nodes of the graph.")

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
            expand_graph(graph, lambda node: _expandable(node), report,
                         self.step, recursive=True)
            # A layer branching on `training` became a switch: its modes' graphs too.
            in_branches(graph, lambda branch, mode: self.run(branch, report))
        else:
            # A target inside a layer is reached by expanding that layer; a
            # block already expanded needs nothing more.
            for target in self.targets:
                expand_to_reach(graph, target, report, self.step)
            here, inside = split_targets(graph, self.targets)
            if here:
                nodes, _ = matched_nodes_and_blocks(graph, here, self.step)
                # A switch is a layer's call already traced, in each mode.
                matched = {id(node) for node in nodes
                           if not isinstance(node.operation, ModeSwitch)}
                expand_graph(graph, lambda node: id(node) in matched, report, self.step,
                             recursive=False)
            run_inside(graph, inside,
                       lambda targets: lambda branch: Expand(targets).run(branch, report))
        return graph


def expand_graph(graph, should_expand, report, step, recursive, templates=None):
    """Expand every node for which `should_expand(node)` holds, in one walk
    over the graph; with `recursive`, the nodes an expansion produces are
    offered to `should_expand` too (before the nodes after them).
    `templates` (`replay.CallTemplates`, a new one by default) holds the
    traces replayed over blocks of the same kind.

    Returns the nodes that stayed opaque although `should_expand` chose them.
    """
    reads = ReadLayers.of_graph(graph)  # one read layer per variable
    if templates is None:
        templates = CallTemplates()  # each kind of block is traced once
    opaque, pending = [], list(reversed(graph.nodes))
    while pending:
        node = pending.pop()
        if not should_expand(node):
            continue
        new_nodes = inline_call(graph, node, report, reads, templates)
        if new_nodes is None:
            opaque.append(node)
            continue
        report.add(step, node.name, "expanded", ", ".join(n.name for n in new_nodes))
        if recursive:
            pending.extend(reversed(new_nodes))
    return opaque


def expandable_blocks(graph):
    """The nodes `Expand()` would inline (custom layers and nested models
    that can be traced), leaving out those another pass annotated already
    (an annotation is the block's, and would be lost with it)."""
    return [node for node in graph.nodes
            if _expandable(node) and not node.opaque_reason and not node.annotations]


def expand_blocks(graph, report, step):
    """Inline every node of `expandable_blocks(graph)`, recursively, as
    `Expand()` does; returns the names of those expanded."""
    chosen = {id(node) for node in expandable_blocks(graph)}
    before = {id(node) for node in graph.nodes}
    names = [node.name for node in graph.nodes if id(node) in chosen]
    # The nodes an expansion makes are new: expanded too when expandable.
    expand_graph(graph, lambda node: id(node) in chosen or (
        id(node) not in before and _expandable(node) and not node.opaque_reason),
        report, step, recursive=True)
    return names


def expand_to_reach(graph, target, report, step, reach_inside=None):
    """Expand the custom layers that hold `target` (a name, a `parent.child`
    path or a class) among their sub-layers, recursively, until the layers
    it matches are nodes of the graph; a class target then matches a block
    wherever it sits. Returns `[(node path, reason)]` for the layers holding
    it that stay out of reach (each also in the report, "not reached");
    raises `PassError` naming the layer when the target is found nowhere
    else. `"all"` needs nothing.

    `reach_inside(node)`: the caller's own way into one of Keras's layers
    holding layers (Replace rebuilds an RNN around a new cell): None once
    it reached the target there, else the reason it could not."""
    if target == ALL:
        return []
    if isinstance(target, Chain):
        # Its layer steps are reached as targets of their own; an operation
        # step is found wherever Expand has made one a node.
        for lead in target.lead_steps():
            alias = not names_a_path(graph, lead)
            expand_graph(graph, lambda node, lead=lead, alias=alias: (
                _expandable(node) and not node.opaque_reason
                and not matches(node, lead, alias) and contains(node, lead, alias)
            ), report, step, recursive=True)
        return []
    # Decided before expanding: a path stays a path as its holders expand.
    aliases = not names_a_path(graph, target)

    def holds_target(node):
        return (
            _expandable(node) and not node.opaque_reason
            and not matches(node, target, aliases) and contains(node, target, aliases)
        )

    opaque = expand_graph(graph, holds_target, report, step, recursive=True)
    # What stays out of reach: layers that cannot be expanded (now, or kept
    # opaque at conversion), and Keras's own layers holding layers (an RNN's
    # cell, Bidirectional, TimeDistributed), which Expand does not inline.
    # The target is an error if found nowhere else, else the report names
    # each layer not reached, with why.
    reasons = {id(node): node.opaque_reason for node in opaque}
    unreached = [
        node for node in graph.nodes
        if node.is_layer and not matches(node, target, aliases)
        and (node.opaque_reason or id(node) in reasons or _keras_layer_holding_layers(node))
        and contains(node, target, aliases)
    ]
    reached_inside = False
    if reach_inside is not None:
        kept = []
        for node in unreached:
            if node.opaque_reason or id(node) in reasons or node.made_by_pass:
                kept.append(node)
                continue
            why = reach_inside(node)
            if why is None:
                reached_inside = True
                continue
            reasons[id(node)] = why
            kept.append(node)
        unreached = [node for node in kept if not node.made_by_pass]
    if not unreached:
        return []
    found = (reached_inside or any(matches(node, target, aliases) for node in graph.nodes)
             or matched_blocks(graph, target))
    if not found:
        node = unreached[0]
        raise PassError(
            f"{step}: target {describe(target)} is inside layer "
            f"`{node.name}`, which cannot be expanded: {_why_not_reached(node, reasons)}"
        )
    left = []
    for node in unreached:
        why = _why_not_reached(node, reasons)
        report.add(step, node.name, "not reached",
                   f"{describe(target)} inside it stays as it is: {why}")
        left.append((node.name, why))
    return left


def _keras_layer_holding_layers(node):
    """Whether `node` is one of Keras's own layers that Expand does not
    inline (an RNN, a wrapper): a `ModeSwitch` or another kip layer holding
    graphs is reached inside by the passes themselves (`run_inside`)."""
    return is_keras_module(type(node.operation).__module__) and not _expandable(node)


def _why_not_reached(node, reasons):
    reason = node.opaque_reason or reasons.get(id(node))
    if reason:
        return reason
    return (f"`{node.name}` is a {type(node.operation).__name__}, one of Keras's own layers "
            "holding layers (an RNN's cell, a wrapper), which Expand does not inline")


def _expandable(node):
    """Whether Expand may inline `node`: a layer the graph's tracer
    (`Tracer.is_user_code`, overridable) says is user code, or a nested model."""
    return is_expandable(node.operation, tracer_of(node.graph).is_user_code)


_AUTO_SUFFIX = re.compile(r"_\d+$")


def inline_call(graph, node, report, reads, templates):
    """Replace `node` by the nodes its layer's `call` traces to.

    `reads` (`reads.ReadLayers`) holds the graph's variable reads (one read
    layer per variable); `templates` (`replay.CallTemplates`) the traces to
    replay. Returns the new nodes, in order; or None when the layer cannot
    be traced (then `node.opaque_reason` says why, and the report has it).

    Example:
        ```python
        new_nodes = inline_call(graph, graph.node("block_1"), report,
                                ReadLayers.of_graph(graph), CallTemplates())
        [n.name for n in new_nodes]
        # -> ['block_1.dense', 'block_1.norm', 'block_1.add']
        ```
    """
    layer = node.operation
    untraced = [value for value in (*node.input_values, *node.outputs)
                if value.mask is UNTRACED_MASK]
    if untraced:
        return _stay_opaque(node, (
            f"Keras attaches a mask to {_describe_value(untraced[0], node)} that "
            "could not be traced into the graph (not computed from the model's "
            "inputs by Keras operations), so the expanded layers could not be "
            "handed it as Keras hands it to the layer"
        ), report)
    # A block whose call pinned `training` is traced under that value only:
    # every sub-layer then records a concrete mode (`Tracer.trace` pins them),
    # so one following the block's `training` gets the block's pinned value.
    training = node.training if node.training in (True, False) else None
    agnostic = training is None and training_agnostic(layer)
    traced = templates.replay(node, reads) or _trace(graph, node, report, reads, templates,
                                                     agnostic)
    if traced is None:
        return None
    new_nodes, outputs = traced
    block = InlinedBlock(node.name, layer)
    paths = attribute_paths(layer)
    for new in new_nodes:
        new.from_blocks = [*node.from_blocks, block, *new.from_blocks]
        if isinstance(new.operation, ModeSwitch):
            # The nodes of its modes come from the block too (a target
            # naming the block's class reaches them).
            for inner in branch_nodes(new):
                inner.from_blocks = [*node.from_blocks, block, *inner.from_blocks]
        if agnostic:
            new.training = None
        new.name = _path(new, node.name, paths)
        if new.opaque_reason:  # a dynamic sub-layer, kept whole
            report.add_opaque(new.name, new.opaque_reason)
    attach_nodes, outputs = _with_masks_of_call(node, outputs, block)
    if "stage" in node.annotations:
        # The block's pipeline stage runs all of its call: the layers it
        # opens into stay in that stage (else they fall back to stage 0,
        # ahead of the stages they read from).
        for new in new_nodes + attach_nodes:
            new.annotations.setdefault("stage", node.annotations["stage"])
    graph.insert_before(node, new_nodes + attach_nodes)
    for new in new_nodes + attach_nodes:
        if _is_ours(new.operation):
            # A keras.ops operation the trace made: named as its node, as its
            # auto-generated name (`add_17`) depends on what ran before.
            new.operation.name = new.name
    for old, replacement in zip(node.outputs, outputs):
        if replacement is not None:  # else unread (`_unread_none_outputs`)
            graph.replace_all_uses_with(old, replacement)
    graph.erase_node(node)
    switches = [new for new in new_nodes if isinstance(new.operation, ModeSwitch)]
    if switches:
        # The switch is the whole call: it takes the node's path, free now.
        graph.rename_nodes({switches[0]: node.name})
        switches[0].operation.name = node.name
    return new_nodes + attach_nodes


def branch_nodes(node):
    """The nodes of the graphs of every mode a `ModeSwitch` node holds."""
    return with_branch_nodes([node])[1:]


def _with_masks_of_call(node, outputs, block):
    """`(AttachMask nodes, outputs)`: the `outputs` of the inlined `call`,
    each carrying the Keras mask the layer's `__call__` gave the node's
    output. Keras keeps the masks `call` set when every output has one,
    and otherwise (for a layer that supports masking) attaches its
    `compute_mask` result, the mask the node's output carries in the
    graph, to each output without one: an `AttachMask` node does."""
    layer = node.operation
    if not layer.supports_masking or all(value.mask is not None for value in outputs):
        return [], outputs
    attach_nodes, attached = [], []
    for old, new in zip(node.outputs, outputs):
        if new.mask is not None or old.mask is None:
            attached.append(new)
            continue
        name = f"{node.name}.mask"  # the graph's namespace numbers it if taken
        attach = Node(name, AttachMask(name=name), (new,), {"mask": old.mask},
                      output_structure=None)
        attach.from_blocks = [*node.from_blocks, block]
        attach.outputs = [Value(attach, 0, new.spec, mask=old.mask)]
        attach_nodes.append(attach)
        attached.append(attach.outputs[0])
    return attach_nodes, attached


def _describe_value(value, node):
    if value in node.outputs:
        return f"output {node.outputs.index(value)} of `{node.name}`"
    where = value.producer.name if value.producer is not None else "the model's input"
    return f"an input of `{node.name}` (from `{where}`)"


def _trace(graph, node, report, reads, templates, agnostic):
    """`(new nodes, flat outputs)` of tracing the layer at `node`, or None."""
    placeholders, tensors = {}, {}

    def placeholder(value):
        if value not in tensors:
            tensor = tensors[value] = keras.KerasTensor(value.spec.shape, dtype=value.spec.dtype)
            placeholders[id(tensor)] = value
            if isinstance(value.mask, Value):
                # The tensor carries its Keras mask in the trace as it does
                # when the graph runs: sub-layers are handed it as they were
                # inside the original call.
                _compat.set_keras_mask(tensor, placeholder(value.mask))
        return tensors[value]

    layer = node.operation
    args = map_values(placeholder, node.args)
    kwargs = map_values(placeholder, node.kwargs)
    # `call` is traced directly, not through `__call__`, which would hand it
    # the masks its inputs carry (`call(x, mask=None)` of a masking layer).
    kwargs.update(_compat.masks_keras_would_pass(layer, args, kwargs))
    training = node.training if node.training in (True, False) else None
    try:
        # the tracer `apply_passes` was given, handed over with the graph
        new_nodes, outputs = tracer_of(graph).trace(
            layer, args, kwargs, placeholders,
            # one trace is enough where no sub-layer reads `training`
            training=False if agnostic else training, prefix=node.name + ".", reads=reads,
        )
    except TraceError as error:
        return _stay_opaque(node, error.reason, report)
    leaves = keras.tree.flatten(outputs)
    if len(leaves) == len(node.outputs) and None in leaves:
        reason = _unread_none_outputs(graph, node, leaves)
        if reason:
            return _stay_opaque(node, reason, report)
        outputs = leaves
    else:
        # None leaves (a cache not given) are no Values: the node had none.
        outputs = [leaf for leaf in leaves if leaf is not None]
    if len(outputs) != len(node.outputs):
        return _stay_opaque(node, (
            f"`call` traced to {len(outputs)} outputs but the layer "
            f"produced {len(node.outputs)}"
        ), report)
    templates.record(node, new_nodes, outputs, reads)
    return new_nodes, outputs


def _unread_none_outputs(graph, node, leaves):
    """Why the call at `node` cannot return None where the node has an
    output Value, or '' when nothing reads those outputs.

    A layer stating its output shape (`compute_output_shape`) gives a
    functional model an output that its `call` returns as None (keras_hub's
    XLNet encoder: `(content, None)` with no query stream); Keras's own
    model never reads it, nor may the expanded graph."""
    graph_outputs = set(values_in(graph.outputs))
    for index, (leaf, value) in enumerate(zip(leaves, node.outputs)):
        if leaf is not None:
            continue
        readers = [user.name for user in value.users]
        if readers or value in graph_outputs or value.masked:
            where = f"`{readers[0]}` reads it" if readers else "the model returns it"
            return (f"`call` returns None as output {index}, which the graph has as a "
                    f"tensor: {where}")
    return ""


def _stay_opaque(node, reason, report):
    node.opaque_reason = reason
    report.add_opaque(node.name, reason)
    return None


def _is_ours(operation):
    """A keras.ops operation, random draw or mask the trace or Expand made
    (not the user's layer: its name may follow its node's)."""
    return not isinstance(operation, keras.layers.Layer) or isinstance(
        operation, (BatchSizedOperation, RandomDraw, AttachMask, ModeSwitch))


def _path(node, parent, paths):
    """The name `node` asks for (the namespace numbers it if taken).

    The user's layers are named after their attribute path in the parent
    layer (`parent.dense`, `parent.layers.0`; `paths` from
    `attribute_paths`), or their own name where no attribute holds them
    (the layer itself keeps its name). A variable read keeps the name the trace
    gave it after its attribute (`parent.scale`). A keras.ops operation
    the trace made is numbered within its parent (`parent.add`), its
    auto-generated suffix dropped.
    """
    if is_read(node.operation) or is_write_node(node.operation):
        return node.name  # named by the trace, after the attribute
    if isinstance(node.operation, ModeSwitch):
        return parent  # the whole call, in each `training` mode
    if _is_ours(node.operation):
        return f"{parent}.{_AUTO_SUFFIX.sub('', node.operation.name) or 'op'}"
    layer = node.operation
    if isinstance(layer, OpaqueLayer):
        layer = layer.layer
    return f"{parent}.{path_of(layer, paths)}"
