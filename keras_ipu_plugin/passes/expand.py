"""`Expand`: inline custom layers into the sub-layers their `call` uses.

Each expanded layer's node is replaced by the nodes its `call` traces to,
named `parent.child` (`inline.inline_call`). With `targets="all"`
expansion repeats until only built-in Keras layers (and layers that cannot
be traced, which stay opaque and are reported) remain. Sub-layers shared
between call sites stay shared, because the same layer objects are called.
"""

from keras_ipu_plugin.errors import PassError
from keras_ipu_plugin.frontend.replay import CallTemplates
from keras_ipu_plugin.passes.infra.base import ALL
from keras_ipu_plugin.passes.infra.base import contains
from keras_ipu_plugin.passes.infra.branches import in_branches
from keras_ipu_plugin.passes.infra.branches import run_inside
from keras_ipu_plugin.passes.infra.branches import split_targets
from keras_ipu_plugin.passes.infra.base import Pass
from keras_ipu_plugin.passes.infra.base import as_targets
from keras_ipu_plugin.passes.infra.base import describe
from keras_ipu_plugin.passes.infra.base import matched_blocks
from keras_ipu_plugin.passes.infra.base import matched_nodes_and_blocks
from keras_ipu_plugin.passes.infra.base import matches
from keras_ipu_plugin.passes.infra.base import register_pass
from keras_ipu_plugin.passes.infra.base import saved_config
from keras_ipu_plugin.passes.infra.base import targets_config
from keras_ipu_plugin.passes.infra.base import targets_from_config
from keras_ipu_plugin.passes.inline import inline_call
from keras_ipu_plugin.passes.infra.patterns import Chain
from keras_ipu_plugin.passes.infra.patterns import names_a_path
from keras_ipu_plugin.frontend.trace.tracer import current_tracer
from keras_ipu_plugin.layers.layer_kinds import is_expandable
from keras_ipu_plugin.layers.user_code import is_keras_module
from keras_ipu_plugin.runtime.mode_switch import ModeSwitch
from keras_ipu_plugin.layers.state import ReadLayers


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
    """Whether Expand may inline `node`: a layer the tracer in use
    (`Tracer.is_user_code`, overridable) says is user code, or a nested model."""
    return is_expandable(node.operation, current_tracer().is_user_code)
