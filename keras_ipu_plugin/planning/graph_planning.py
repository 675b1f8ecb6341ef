"""The planning passes' graph side: from the graph IR to cost lists, the
pure planners (`recompute_plan`, `stage_balance`) on them, and the plan back
onto the nodes as annotations, with a report table.

Example:
    ```python
    plan_recompute(graph, memory_budget=0.5, report=report, step="recompute")
    print(report)          # ... and a "Recompute plan" table
    ```
"""

import dataclasses
import math
import time

import keras

from keras_ipu_plugin.errors import PassError
from keras_ipu_plugin.errors import short_repr
from keras_ipu_plugin.planning import exact_plan
from keras_ipu_plugin.planning import node_costs
from keras_ipu_plugin.planning import recompute_plan
from keras_ipu_plugin.planning import stage_balance
from keras_ipu_plugin.planning import stage_timing
from keras_ipu_plugin.report import PlanTable
from keras_ipu_plugin.runtime import effects

BALANCES = ("params", "activations", "time")

#: How many times `balance="time"` re-plans from whole-stage timings.
STAGE_TIMING_ROUNDS = 3

ESTIMATE_COVERS = ("activations the backward pass reads, the copies a recomputation runs "
                   "on, the weight gradients, an optimizer update's temporaries and the "
                   "prefetched input batches, at the first batch; weights and optimizer "
                   "state are not included")

#: An optimizer's update of one variable holds this many temporaries of the
#: variable's size at once (Adam's `m`, `v` and step expressions, evaluated
#: elementwise): counted once, for the largest trainable variable, on top of
#: every plan's peak.
UPDATE_TEMPORARIES = 2

#: Input batches alive beside the step's own: the one the step reads and the
#: one `fit`'s dataset prefetches.
PREFETCHED_BATCHES = 2


def planning_batch(graph, owner):
    """The per-replica batch the plan is made for (see
    `node_costs.first_batch_rows`), or a `PassError` saying how to give one."""
    batch = getattr(graph, "batch_rows", None)
    if not batch:
        raise PassError(
            f"{owner} plans from the first batch's shapes, but `{graph.name}` keeps no "
            "first batch: convert it with kip.convert_to_functional(model, data) (which "
            "keeps it), or with static_batch=True.")
    return int(batch)


def check_auto(auto, owner):
    if not isinstance(auto, bool):
        raise PassError(f"{owner}: auto is True or False; got {short_repr(auto)}.", field="auto")
    return auto


def check_memory_budget(memory_budget, auto):
    """`memory_budget` checked: None, bytes (an int), or a fraction of the
    estimated peak (a float in (0, 1])."""
    if memory_budget is None:
        return None
    if not auto:
        raise PassError("Recompute: memory_budget plans the checkpoints; it needs "
                        "auto=True (with targets the checkpoints are given).",
                        field="memory_budget")
    if isinstance(memory_budget, bool) or not isinstance(memory_budget, (int, float)):
        raise PassError("Recompute: memory_budget is bytes (an int) or a fraction of the "
                        f"estimated peak (a float in (0, 1]); got {short_repr(memory_budget)}.",
                        field="memory_budget")
    if isinstance(memory_budget, float) and not math.isfinite(memory_budget):
        # NaN compares false with every bound and inf has no int: both would
        # otherwise fail below with a bare ValueError / OverflowError.
        raise PassError(f"Recompute: memory_budget={memory_budget!r} is not a number of bytes "
                        "(an int) or a fraction of the estimated peak (a float in (0, 1]).",
                        field="memory_budget")
    if isinstance(memory_budget, float) and not 0 < memory_budget <= 1:
        raise PassError(
            f"Recompute: memory_budget={memory_budget!r} is a float, so a fraction of the "
            "estimated peak without recomputation, which must be in (0, 1]; give bytes as "
            f"an int (memory_budget={int(memory_budget)}).", field="memory_budget")
    if isinstance(memory_budget, int) and memory_budget < 1:
        raise PassError(f"Recompute: memory_budget is a positive number of bytes; got "
                        f"{memory_budget}.", field="memory_budget")
    return memory_budget


# -- Recompute(auto=True) --------------------------------------------------------------
def recompute_costs(graph, order, profiles, batch, split=True):
    """The `recompute_plan.NodeCost` chain of `graph` in `order` (the
    executor's), from `profiles` (graph order) at `batch` rows; `split`:
    with the Dense layers that `runs_split` picks split (False: every node
    as it runs without recomputation; `"every"`: every Dense that may run
    split, split)."""
    by_node = {id(profile.node): profile for profile in profiles}
    position = {id(node): index for index, node in enumerate(order)}
    producer = {id(value): node for node in graph.nodes for value in node.outputs}
    last_reader = _last_readers(graph, order, position)
    costs, live = [], {}
    for index, node in enumerate(order):
        profile = by_node[id(node)]
        figures = _as_run(node, profile, split)
        kept = figures.internal
        for value, size in zip(node.input_values, figures.kept_inputs):
            source = producer.get(id(value))
            if source is not None and position[id(source)] != index - 1:
                kept += size  # from further back (the previous node's: at the cut)
        after = order[index + 1] if index + 1 < len(order) else None
        by_next = 0
        if after is not None:
            following = _as_run(after, by_node[id(after)], split)
            by_next = sum(size for value, size in zip(after.input_values, following.kept_inputs)
                          if producer.get(id(value)) is node)
        for value in node.outputs:
            live[id(value)] = (value, last_reader.get(id(value), index))
        live = {key: item for key, item in live.items() if item[1] > index}
        boundary = sum(node_costs.value_bytes(value, batch) for value, _ in live.values())
        costs.append(recompute_plan.NodeCost(
            name=node.name, kept=kept, kept_output=figures.kept_output,
            kept_by_consumer=by_next, boundary=boundary, flops=profile.flops,
            grads=profile.grad_bytes,
            output=profile.output_bytes + figures.backward_bytes,
            weights=profile.weight_bytes,
            elements=profile.output_elements, fixed=profile.fixed,
            recompute_flops=figures.recompute_flops,
        ))
    return costs


def runs_split(node, profile):
    """Whether the plan recomputes the node's activation from its kept
    pre-activation (the `activation_remat` note): where the traced backward
    of the split layer keeps less than the layer's own, at the cost of
    recomputing the activation (a few percent of a Dense's matmul). Not
    where an outlined body replaces the layer's call."""
    return may_run_split(node, profile) and profile.split.kept_bytes < profile.kept_bytes


def may_run_split(node, profile):
    """Whether the node's activation may be recomputed from its kept
    pre-activation at all (`runs_split` also asks that it keep less so)."""
    return profile.split is not None and "outline" not in node.annotations


def _as_run(node, profile, split=True):
    """The figures of `profile` as the node will run: split (`runs_split`,
    when `split`; `may_run_split`, when `split == "every"`), or as it is."""
    if split == "every" and may_run_split(node, profile):
        return profile.split
    if split is True and runs_split(node, profile):
        return profile.split
    return node_costs.SplitProfile(profile.internal, profile.kept_output,
                                   tuple(profile.kept_inputs), profile.backward_bytes, 0.0)


def _last_readers(graph, order, position):
    """{id(value): the order position of its last reader}; graph outputs are
    read at the end."""
    last = {}
    for node in order:
        for value in node.input_values:
            last[id(value)] = max(last.get(id(value), -1), position[id(node)])
    for value in keras.tree.flatten(graph.outputs):
        last[id(value)] = len(order)
    return last


@dataclasses.dataclass
class RecomputeChoice:
    """A plan chosen for a graph, not yet written onto it: what
    `choose_recompute` gives and `apply_recompute` writes."""

    graph: object
    order: list
    profiles: list
    costs: list
    plan: object  # recompute_plan.RecomputePlan
    batch: int
    memory_budget: object
    budget: object  # bytes, or None
    #: the order positions of the nodes whose activation is recomputed from
    #: their kept pre-activation; None: those `runs_split` picks
    splits: object = None
    planner: str = "dynamic program over the checkpoints"

    @property
    def extra_flops(self):
        return self.plan.extra_flops


def step_overhead(graph, batch):
    """Bytes a training step holds beside the activations and gradients the
    plan chooses between, alike for every plan: an optimizer update's
    temporaries (`UPDATE_TEMPORARIES` of the largest trainable variable)
    and the prefetched input batches (`PREFETCHED_BATCHES`). Left out, the
    estimate was 7-31 % under the measured step peak of the MLP and
    transformer models of `benchmarks/remat_peers.py`."""
    largest = max((node_costs.variable_bytes(v) for layer in graph.layers()
                   for v in getattr(layer, "trainable_weights", [])), default=0)
    inputs = sum(node_costs.value_bytes(value, batch)
                 for value in keras.tree.flatten(graph.input_values))
    return UPDATE_TEMPORARIES * largest + PREFETCHED_BATCHES * inputs


def recompute_budget(graph, memory_budget):
    """The budget in bytes of `memory_budget` for `graph` (a fraction is of
    its estimated peak without recomputation), or None."""
    if memory_budget is None:
        return None
    if not isinstance(memory_budget, float):
        return memory_budget
    batch = planning_batch(graph, "Recompute(auto=True)")
    profiles = node_costs.profile_nodes(graph, batch)
    order = graph.nodes  # the order the interpreter runs them in
    return memory_budget * (step_overhead(graph, batch) + recompute_plan.estimate_peak(
        recompute_costs(graph, order, profiles, batch, split=False)))


def choose_recompute(graph, memory_budget, step, budget=None):
    """The plan for `graph` (a `RecomputeChoice`; nothing is annotated):
    the smallest peak (`memory_budget=None`) or the least recomputation
    under `memory_budget` (bytes, or a fraction of the estimated peak
    without recomputation; `budget`: the bytes it stands for, when worked
    out on another graph already). A `PassError` saying what the smallest
    reachable peak is when no plan meets the budget."""
    batch = planning_batch(graph, "Recompute(auto=True)")
    profiles = node_costs.profile_nodes(graph, batch)
    order = graph.nodes  # the order the interpreter runs them in
    costs = recompute_costs(graph, order, profiles, batch)
    # What every plan holds alike (the plans differ in activations only).
    fixed_bytes = step_overhead(graph, batch)
    # Without recomputation of any kind: no activation split either.
    baseline = fixed_bytes + recompute_plan.estimate_peak(
        recompute_costs(graph, order, profiles, batch, split=False))
    if budget is None and memory_budget is not None:
        budget = memory_budget * baseline if isinstance(memory_budget, float) else memory_budget
    try:
        plan = (recompute_plan.plan_smallest_peak(costs) if budget is None
                else recompute_plan.plan_for_budget(costs, budget - fixed_bytes))
        plan = dataclasses.replace(plan, baseline_peak=baseline, peak=plan.peak + fixed_bytes)
    except recompute_plan.UnmeetableBudget as error:
        fixed = [cost.name for cost in costs if cost.fixed]
        raise PassError(
            f"{step}: the memory budget {_budget_text(memory_budget, budget)} cannot be met "
            f"for `{graph.name}` at a batch of {batch}: the smallest estimated peak any "
            f"checkpoint plan reaches is {_mib(error.smallest + fixed_bytes)} (without "
            f"recomputation "
            f"{_mib(baseline)}). The estimate covers {ESTIMATE_COVERS}."
            + (f" Layers with forward state are never recomputed: "
               f"{_names(fixed)}." if fixed else "")
            + " Raise the budget, or lower the batch.") from None
    choice = RecomputeChoice(graph, order, profiles, costs, plan, batch, memory_budget, budget)
    return _exact_if_small(choice, fixed_bytes) if len(order) <= EXACT_NODES else choice


#: Graphs of at most this many nodes are planned by the exact search
#: (`exact_plan`) when it ends within `EXACT_PLAN_LABELS` labels looked at
#: (counted, not timed, so that the plan is the same on every machine);
#: larger ones, or a search that gives up, keep the dynamic program's plan.
#: Measured: 31 nodes (a 4-block transformer) 9,000-12,000 labels, about a
#: second; 58 nodes (48 Dense layers in residual blocks) 105,000 labels.
EXACT_NODES = 40
EXACT_PLAN_LABELS = 400_000


def _exact_if_small(choice, fixed_bytes):
    """`choice` with the exact search's plan, where it finds a better one
    (less recomputation under the budget, or a smaller peak within the same
    recomputation cap and tolerance as `plan_smallest_peak`)."""
    graph, order, profiles, batch = choice.graph, choice.order, choice.profiles, choice.batch
    plain = recompute_costs(graph, order, profiles, batch, split=False)
    split = recompute_costs(graph, order, profiles, batch, split="every")
    deadline = exact_plan.WorkLimit(EXACT_PLAN_LABELS)
    try:
        if choice.budget is None:
            cap = recompute_plan.MAX_EXTRA_FORWARDS * sum(c.flops for c in plain) * (1 + 1e-9)
            smallest = exact_plan.smallest_peak_within(plain, split, cap, deadline=deadline,
                                                       known=choice.plan.peak - fixed_bytes)
            found = exact_plan.least_recompute(
                plain, split, smallest.peak * (1 + recompute_plan.SMALLEST_PEAK_TOLERANCE),
                deadline=deadline, max_extra_flops=cap)
            better = found is not None and found.peak + fixed_bytes <= choice.plan.peak * (
                1 + recompute_plan.SMALLEST_PEAK_TOLERANCE) and (
                found.peak + fixed_bytes < choice.plan.peak
                or found.extra_flops < choice.plan.extra_flops)
        else:
            found = exact_plan.least_recompute(plain, split, choice.budget - fixed_bytes,
                                               deadline=deadline)
            better = found is not None and found.extra_flops < choice.plan.extra_flops
    except exact_plan.SolveTimeout:
        return choice
    if not better:
        return choice
    chain = exact_plan.chain_of(plain, split, found.splits)
    plan = recompute_plan.describe_plan(chain, found.checkpoints, False, found.keeps,
                                        found.nested, inside=set(found.inside))
    plan = dataclasses.replace(plan, baseline_peak=choice.plan.baseline_peak,
                               peak=plan.peak + fixed_bytes)
    return dataclasses.replace(choice, costs=chain, plan=plan, splits=found.splits,
                               planner="exact search (per-node splits and nesting)")


#: How long `exact_optimum` searches by default.
EXACT_SECONDS = 20.0


@dataclasses.dataclass(frozen=True)
class Optimum:
    """The optimum of the cost model beside a chosen plan: `peak` (bytes,
    the step's overhead included like the plan's), its recomputation as a
    fraction of a forward pass, the `exact_plan.ExactPlan`, and the
    seconds the search took."""

    peak: float
    extra_fraction: float
    plan: object
    seconds: float


def exact_optimum(choice, seconds=EXACT_SECONDS):
    """The smallest estimated peak any plan reaches recomputing no more
    than `choice`'s plan, where each Dense's activation split and each
    nested node's recomputation inside its layer are chosen per node with
    the checkpoints (`exact_plan`); `exact_plan.SolveTimeout` after
    `seconds`. `choice.plan.peak / optimum.peak` is how far the planner is
    from the optimum of its own cost model.

    Example:
        ```python
        choice = choose_recompute(graph, 0.2, "recompute")
        exact_optimum(choice).peak <= choice.plan.peak
        # -> True
        ```
    """
    graph, order, profiles, batch = choice.graph, choice.order, choice.profiles, choice.batch
    plain = recompute_costs(graph, order, profiles, batch, split=False)
    split = recompute_costs(graph, order, profiles, batch, split="every")
    overhead = step_overhead(graph, batch)
    start = time.monotonic()
    found = exact_plan.smallest_peak_within(plain, split, choice.plan.extra_flops,
                                            deadline=start + seconds,
                                            known=choice.plan.peak - overhead)
    forward = sum(cost.flops for cost in plain)
    return Optimum(peak=found.peak + overhead,
                   extra_fraction=found.extra_flops / forward if forward else 0.0,
                   plan=found, seconds=time.monotonic() - start)


def apply_recompute(choice, report, step, note=None):
    """Write `choice`'s plan onto its graph's nodes and its table into
    `report` (`note`: one more row, why the plan was made where it was)."""
    order, plan, profiles = choice.order, choice.plan, choice.profiles
    for index in plan.checkpoints:
        node = order[index]
        node.annotations["recompute"] = True
        report.add(step, node.name, "checkpoint after", "planned (Recompute(auto=True))")
    for index in plan.keeps:
        order[index].annotations["remat"] = "keep"
        report.add(step, order[index].name, "kept, ends the run before a segment",
                   "planned (Recompute(auto=True))")
    for index in plan.inside:
        order[index].annotations["remat"] = "inside"
        report.add(step, order[index].name, "recomputed inside its layer",
                   "planned (Recompute(auto=True)): nested in its segment")
    by_node = {id(profile.node): profile for profile in profiles}
    split = ([node for node in order if runs_split(node, by_node[id(node)])]
             if choice.splits is None else [order[index] for index in choice.splits])
    for node in split:
        node.annotations[effects.ACTIVATION_REMAT] = True
        report.add(step, node.name, "activation recomputed from its kept pre-activation",
                   "planned (Recompute(auto=True)): keeps less at a few percent of its cost")
    table = _recompute_table(choice.graph, choice.costs, order, plan, choice.batch,
                             choice.memory_budget, choice.budget, profiles, split,
                             choice.planner)
    if note:
        table = dataclasses.replace(table, rows=table.rows + (("planned on", note),),
                                    figures={**table.figures, "planned_on": note})
    report.add_plan(table)
    return plan


def plan_recompute(graph, memory_budget, report, step):
    """Choose checkpoints for `graph` (annotating their nodes), for the
    smallest peak (`memory_budget=None`) or the least recomputation under
    `memory_budget` (bytes, or a fraction of the estimated peak without
    recomputation). Adds the plan's table to `report`."""
    return apply_recompute(choose_recompute(graph, memory_budget, step), report, step)


def _recompute_table(graph, costs, order, plan, batch, memory_budget, budget, profiles,
                     split=(), planner=RecomputeChoice.planner):
    # The plan's peak holds the step's overhead (`step_overhead`) beside its
    # activations: the same with the gradients held.
    inside = set(plan.inside)
    overhead = plan.peak - recompute_plan.estimate_peak(
        costs, plan.checkpoints, False, plan.keeps, plan.nested, inside)
    held = overhead + recompute_plan.estimate_peak(
        costs, plan.checkpoints, True, plan.keeps, plan.nested, inside)
    rows = [
        ("batch (per replica)", str(batch)),
        ("planned by", planner),
        ("checkpoints", _names([order[i].name for i in plan.checkpoints]) or "none"),
        ("recomputed segments", "; ".join(
            f"{order[first].name} .. {order[last].name} ({last - first + 1} nodes"
            + (", nested" if last in plan.nested else "") + ")"
            for first, last in plan.segments) or "none"),
        ("per node", _kinds_text(plan, len(order))),
        ("activation recomputed",  # from its kept pre-activation (Dense split)
         _names([node.name for node in split]) or "none"),
    ]
    fixed = [cost.name for cost in costs if cost.fixed]
    if fixed:
        rows.append(("never recomputed (forward state)", _names(fixed)))
    rows += [
        ("estimated peak without recompute", _mib(plan.baseline_peak)),
        ("estimated peak with the plan",
         f"{_mib(plan.peak)} ({plan.peak / plan.baseline_peak:.2f}x)" if plan.baseline_peak
         else _mib(plan.peak)),
        ("memory budget", _budget_text(memory_budget, budget) if budget is not None
         else "none: the smallest peak within one extra forward pass, then the least recomputation"),
        # The plan assumes each weight gradient is applied and freed as it
        # is produced (measured so for Keras's optimizers on one device);
        # an optimizer that needs them all at once holds them: say what
        # that would cost, rather than hide it.
        ("if all weight gradients are held",
         f"{_mib(held)}"
         " with the plan (clipping by global norm, gradient accumulation and loss scaling "
         "hold them until the last; the plan assumes each is freed once applied)"),
        ("estimated extra compute",
         f"{plan.extra_fraction:.2f} of a forward pass (about "
         f"+{plan.extra_fraction / 3:.0%} of a training step)"),
        ("the estimate covers", ESTIMATE_COVERS),
    ]
    shaped = [p.node.name for p in profiles if p.note]
    if shaped:
        rows.append(("estimated from shapes only", _names(shaped)))
    figures = {
        "batch": batch, "checkpoints": [order[i].name for i in plan.checkpoints],
        "segments": [(order[first].name, order[last].name) for first, last in plan.segments],
        "peak": plan.peak, "baseline_peak": plan.baseline_peak, "budget": budget,
        "peak_if_gradients_held": held,
        "keeps": [order[i].name for i in plan.keeps],
        "inside_notes": [order[i].name for i in plan.inside],  # nested in segments
        "inside": [order[i].name for i in range(len(order)) if plan.kind(i) == "inside"],
        "kinds": {order[i].name: plan.kind(i) for i in range(len(order))},
        "extra_fraction": plan.extra_fraction,
        "activation_remat": [node.name for node in split],
        "planner": planner,
    }
    return PlanTable(f"Recompute plan of {graph.name!r}", ("quantity", "value"), tuple(rows),
                     figures)


def _kinds_text(plan, count):
    """How many nodes the plan keeps, recomputes inside their layer, and
    recomputes from a checkpoint."""
    kinds = [plan.kind(index) for index in range(count)]
    return (f"{kinds.count('keep')} kept, {kinds.count('inside')} recomputed inside their "
            f"layer, {kinds.count('checkpoint')} recomputed from a checkpoint")


def _budget_text(memory_budget, budget):
    if isinstance(memory_budget, float):
        return f"{_mib(budget)} ({memory_budget:g} of the estimated peak)"
    return _mib(budget)


# -- PipelineStages(num_stages=N) ------------------------------------------------------
def plan_stages(graph, num_stages, balance, report, step):
    """Cut `graph`'s nodes (topological order) into `num_stages` contiguous
    stages with the smallest largest cost (`balance`), annotate each node's
    stage and add the plan's table to `report`."""
    nodes = graph.nodes
    owner = f"PipelineStages(num_stages={num_stages}, balance={balance!r})"
    batch = planning_batch(graph, owner) if balance != "params" else None
    profiles = (node_costs.profile_nodes(graph, batch) if batch
                else [_params_profile(node) for node in nodes])
    if balance == "params":
        _count_params_once(profiles)
    costs, unit, notes = _stage_costs(graph, profiles, balance, batch)
    allowed = None  # a stage may end after any node: each call site has its own stage
    try:
        stages = stage_balance.balanced_partition(costs, num_stages, allowed)
    except stage_balance.CannotPartition as error:
        raise PassError(f"{step}: cannot cut `{graph.name}` into {num_stages} stages: "
                        f"{error}.") from None
    sums = stage_balance.stage_sums(costs, stages)
    if balance == "time" and num_stages > 1:
        stages, sums, note = _replan_on_stage_times(graph, batch, costs, stages, allowed)
        notes.append(note)
    for index, (first, last) in enumerate(stages):
        for node in nodes[first:last + 1]:
            node.annotations["stage"] = index
            report.add(step, node.name, f"stage {index}", f"planned (balance={balance!r})")
    rows = [
        (str(index), f"{nodes[first].name} .. {nodes[last].name}", str(last - first + 1),
         _cost_text(cost, unit), f"{cost / sum(sums):.0%}" if sum(sums) else "-")
        for index, ((first, last), cost) in enumerate(zip(stages, sums))
    ]
    rows.append(("imbalance", "largest / mean", "", f"{stage_balance.imbalance(sums):.2f}", ""))
    for note in notes:
        rows.append(("note", note, "", "", ""))
    figures = {
        "balance": balance, "costs": sums, "imbalance": stage_balance.imbalance(sums),
        "stages": [[node.name for node in nodes[first:last + 1]] for first, last in stages],
    }
    report.add_plan(PlanTable(f"Pipeline stages of {graph.name!r} (balance={balance!r})",
                              ("stage", "layers", "nodes", "cost", "share"), tuple(rows),
                              figures))
    return stages


def _replan_on_stage_times(graph, batch, costs, stages, allowed,
                           rounds=STAGE_TIMING_ROUNDS):
    """(stages, their measured seconds, a note): the partition balanced on
    node times, then re-planned on whole-stage times.

    Nodes timed alone do not add up to their stage's time (see
    `stage_timing`), so each round times the stages of the current plan,
    scales the node times of each stage by its measured / summed time, and
    plans again; the candidates met are timed side by side and the one with
    the smallest largest / mean kept."""
    candidates, scaled = [stages], list(costs)
    try:
        for _ in range(rounds):
            measured = stage_timing.time_stages(graph, batch, [stages])[0]
            for (first, last), seconds in zip(stages, measured):
                predicted = sum(scaled[first:last + 1])
                if predicted > 0:
                    for index in range(first, last + 1):
                        scaled[index] *= seconds / predicted
            stages = stage_balance.balanced_partition(scaled, len(stages), allowed)
            if stages in candidates:
                break
            candidates.append(stages)
        timed = stage_timing.time_stages(graph, batch, candidates)
    except Exception as error:  # noqa: BLE001 - a stage that cannot run alone
        return (candidates[0], stage_balance.stage_sums(costs, candidates[0]),
                f"stages not timed whole ({type(error).__name__}: {error}); "
                "balanced on node times alone")
    best = min(range(len(candidates)), key=lambda k: stage_balance.imbalance(timed[k]))
    return (candidates[best], timed[best],
            f"stage costs are whole stages timed (forward and backward); their nodes timed "
            f"alone sum to {sum(costs) * 1e3:.2f} ms; {len(candidates)} plan(s) compared")


def _params_profile(node):
    return node_costs.NodeProfile(node=node)


def _count_params_once(profiles):
    counted = set()
    for profile in profiles:
        operation = profile.node.operation
        if isinstance(operation, keras.layers.Layer) and id(operation) not in counted:
            counted.add(id(operation))
            profile.params = int(sum(int(_size(v.shape)) for v in operation.weights))


def _size(shape):
    size = 1
    for dim in shape:
        size *= int(dim)
    return size


def _stage_costs(graph, profiles, balance, batch):
    """(costs, unit, notes): one cost per node in graph order."""
    if balance == "params":
        return [float(p.params) for p in profiles], "params", []
    if balance == "activations":
        return [float(p.kept_bytes) for p in profiles], "bytes", []
    times = node_costs.time_nodes(graph, batch, profiles=profiles)
    notes = []
    missing = [i for i, t in enumerate(times) if t is None]
    if missing:
        # A node that cannot run alone is costed by its FLOPs at the rate of
        # the nodes that ran.
        timed = [(t, profiles[i].flops) for i, t in enumerate(times) if t is not None]
        rate = sum(t for t, _ in timed) / max(sum(f for _, f in timed), 1.0)
        for i in missing:
            times[i] = profiles[i].flops * rate
        notes.append("not timed alone, costed by FLOPs: "
                     + _names([profiles[i].node.name for i in missing]))
    return [float(t) for t in times], "seconds", notes


def _cost_text(cost, unit):
    if unit == "seconds":
        return f"{cost * 1e3:.2f} ms"
    if unit == "bytes":
        return _mib(cost)
    return f"{cost:,.0f} params"


# -- text -----------------------------------------------------------------------------
def _mib(size):
    return f"{size / 2 ** 20:,.1f} MiB"


def _names(names, limit=12):
    text = ", ".join(names[:limit])
    return text + (f", ... ({len(names)} in all)" if len(names) > limit else "")
