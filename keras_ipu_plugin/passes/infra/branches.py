"""Passes inside the `training` modes of `ModeSwitch` nodes.

A layer whose `call` branches on `training` in Python becomes a
`ModeSwitch` node holding one graph per mode (`runtime/mode_switch.py`).
A pass that reaches inside (Expand, Replace, Recompute) runs on each of
those graphs for the targets found there, and the node gets a new switch
made from the graphs it returned (`in_branches`); a pass that does not
(Outline, PipelineStages by targets) raises `refuse_inside`'s error when
a target is found only inside a switch, never skipping it silently.

Example:
    >>> here, inside = split_targets(graph, ["blocks.0.drop_path.dense"])
    >>> in_branches(graph, lambda branch, mode: Expand(inside).run(branch, report))
"""

from keras_ipu_plugin.errors import PassError
from keras_ipu_plugin.frontend.trace.tracer import TraceError
from keras_ipu_plugin.frontend.trace.tracer import trace_model
from keras_ipu_plugin.ir.graph import InputSpec
from keras_ipu_plugin.passes.infra.base import ALL
from keras_ipu_plugin.passes.infra.base import contains
from keras_ipu_plugin.passes.infra.base import describe
from keras_ipu_plugin.passes.infra.base import matched_blocks
from keras_ipu_plugin.passes.infra.base import nodes_matching
from keras_ipu_plugin.passes.infra.patterns import Chain
from keras_ipu_plugin.frontend.trace.tracer import current_tracer
from keras_ipu_plugin.layers.layer_kinds import is_expandable
from keras_ipu_plugin.runtime.mode_switch import ModeSwitch


def switch_nodes(graph):
    """The `ModeSwitch` nodes of `graph` (not those nested inside them)."""
    return [node for node in graph.nodes if isinstance(node.operation, ModeSwitch)]


def branch_graphs(switch):
    """`{mode: IR graph}` of a switch, copies a pass may edit: the graphs
    it was made from, or (a loaded switch) read from each mode's model."""
    if switch.branch_graphs is None:
        object.__setattr__(switch, "branch_graphs", {
            mode: _graph_of_mode(switch, mode) for mode in switch.mode_outputs})
    return {mode: graph.copy() for mode, graph in switch.branch_graphs.items()}


def _graph_of_mode(switch, mode):
    from keras_ipu_plugin.runtime.functional import KipFunctional

    model = switch.mode_model(mode)
    plain = KipFunctional(model.inputs, model.outputs, name=model.name,
                          kip_pinned_training=model.kip_pinned_training)
    specs = [InputSpec(name=t.name, shape=tuple(t.shape[1:]), dtype=t.dtype,
                       batch_size=t.shape[0]) for t in model.inputs]
    try:
        graph = trace_model(plain, specs)
    except TraceError as error:  # pragma: no cover - functional models trace
        raise PassError(f"Cannot read the `{mode}` graph of `{switch.name}`: {error.reason}")
    annotations = model.kip_annotations
    paths = switch.paths.get(mode, {})
    by_layer = {}
    for path, name in paths.items():
        by_layer.setdefault(name, []).append(path)
    renamed = {}
    for node in graph.nodes:
        node.annotations.update(annotations.get(getattr(node.operation, "name", None), {}))
        if node.is_layer and len(by_layer.get(node.operation.name, ())) == 1:
            renamed[node] = by_layer[node.operation.name][0]
    graph.rename_nodes(renamed)
    return graph


def in_branches(graph, run, wanted=None):
    """Run `run(branch_graph, mode)` (returning the graph to keep) on the
    graph of each mode of each switch of `graph` (those `wanted(branch)`
    accepts, when given), and put a switch made from the results in each
    node whose graphs it ran on. Returns the `(old, new)` layer pairs
    Replace made inside, also added to `graph.replaced`."""
    replaced = []
    for node in switch_nodes(graph):
        switch = node.operation
        branches = branch_graphs(switch)
        if wanted is not None and not any(map(wanted, branches.values())):
            continue  # nothing to do inside: the switch stays as it is
        graphs = {}
        for mode, branch in branches.items():
            result = run(branch, mode) if wanted is None or wanted(branch) else branch
            graphs[mode] = result
            replaced.extend(pair for pair in result.replaced if pair not in replaced)
        node.operation = switch.with_branch_graphs(graphs)
    known = {(id(old), id(new)) for old, new in graph.replaced}
    for old, new in replaced:
        if (id(old), id(new)) not in known:
            graph.replaced.append((old, new))
            known.add((id(old), id(new)))
    return replaced


def run_inside(graph, targets, run_for):
    """Run the pass `run_for(targets)` returns (`fn(branch) -> graph`) on
    each mode's graph of each switch of `graph` where some of `targets`
    are found, with those targets."""
    def found(branch):
        return [t for t in targets
                if t == ALL or reachable_here(branch, t) or reachable_inside(branch, t)]

    return in_branches(graph, lambda branch, mode: run_for(found(branch))(branch),
                       wanted=lambda branch: bool(found(branch)))


def reachable_here(graph, target):
    """Whether `target` matches a node or an inlined block of `graph`, or a
    sub-layer of a layer `graph` could expand to reach it."""
    if target == ALL or isinstance(target, Chain):
        return True
    if nodes_matching(graph, target) or matched_blocks(graph, target):
        return True
    return any(is_expandable(node.operation, current_tracer().is_user_code)
               and contains(node, target)
               for node in graph.nodes)


def reachable_inside(graph, target):
    """Whether `target` is reachable in the graph of a mode of a switch of
    `graph` (at any depth)."""
    if isinstance(target, Chain):
        return False
    for node in switch_nodes(graph):
        for branch in branch_graphs(node.operation).values():
            if target == ALL or reachable_here(branch, target) or reachable_inside(branch, target):
                return True
    return False


def split_targets(graph, targets):
    """`(here, inside)`: the targets to match in `graph` itself (those found
    here, and those found nowhere, whose pass then says so) and those
    found inside its switches (a class may be in both)."""
    here, inside = [], []
    for target in targets:
        in_switch = reachable_inside(graph, target)
        if in_switch:
            inside.append(target)
        if not in_switch or reachable_here(graph, target):
            here.append(target)
    return here, inside


def refuse_inside(graph, targets, step):
    """Raise `PassError` for a target found only inside a switch: `step`
    does not reach into the modes of a layer that branches on `training`."""
    for target in targets:
        if target != ALL and not reachable_here(graph, target) and reachable_inside(graph, target):
            node = next(node for node in switch_nodes(graph)
                        if any(reachable_here(b, target) or reachable_inside(b, target)
                               for b in branch_graphs(node.operation).values()))
            raise PassError(
                f"{step}: target {describe(target)} is inside `{node.name}`, which holds "
                f"the `training` modes of `{node.operation.of_layer or node.name}` (its "
                f"`call` branches on `training` in Python) as one node; {step} does not "
                "reach into the modes: name the whole node instead")


__all__ = ["branch_graphs", "in_branches", "run_inside", "reachable_here",
           "reachable_inside", "refuse_inside", "split_targets", "switch_nodes"]
