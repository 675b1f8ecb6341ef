"""Choosing recomputation checkpoints: a pure planner over per-node costs.

The model is a chain: the graph's nodes in the order the executor runs
them, each described by a `NodeCost` (bytes it keeps for the backward pass,
bytes crossing the cut after it, forward cost, gradient bytes). A plan is the
set of nodes after which a checkpoint ends a recomputed segment, with the
executor's own rules (`executor.make_plan`):

- a node with forward state (`fixed`) runs alone, never recomputed;
- nodes up to a checkpoint form a recomputed segment; the nodes after the
  last checkpoint, and those before a fixed node, run normally;
- the last recomputed segment runs normally when the nodes after it are
  smaller (elements per example) than its largest output.

The plan chooses per node between three kinds (a plan is a partition of
the chain into runs of these):

- *keep*: the node runs normally and its activations are kept; a kept node
  right before a recomputed segment is marked (`keeps`), so the executor
  ends the run there (`remat="keep"`) instead of folding it into the segment;
- *recompute inside its layer*: a segment of one node, or a node of a
  *nested* segment (`nested`: its nodes with internal tensors run under
  their own checkpoint, `remat="inside"`): its internal tensors (a Dense's
  pre-activation, gelu's intermediates, attention scores) are dropped and
  recomputed from its input, its outputs kept, what `keras.RematScope`
  does to a layer; nested, the segment's recomputation keeps only the
  nodes' outputs and recomputes each node's internals once more;
- *recompute from a checkpoint*: a node of a segment of several nodes.

Independently of these, a Dense layer may recompute only its activation
from its kept pre-activation (`activation_remat`: PyTorch's selective
checkpointing for one layer). That choice is made before the search, from
each layer's traced costs (`graph_planning.runs_split`): it keeps less in
every kind above at a few percent of the layer's cost, so the chain the
search sees already has it (`NodeCost.recompute_flops`).

Memory is estimated for the whole training step the way the backward pass
frees it: at the backward of node `t`, what the forward pass kept for the
nodes before `t`, what `t` keeps, its weight gradients and its output's
size (the working memory of its backward). Weight gradients of the nodes
after `t` count too only when they are held until the backward pass ends
(`held_gradients=True`: gradients all-reduced or clipped together);
otherwise each is applied and freed as soon as it is produced, which is what
a single-device optimizer step does (measured on a 48-layer MLP: counting
them all made a checkpoint after every layer look best, and it held 1.5x
the memory of a checkpoint every 3 layers). A recomputed segment keeps only its inputs (the
checkpoint) in the forward pass and holds all its activations again while
its backward runs. `estimate_peak` computes that for a plan; the planners
find plans by a dynamic program over the node order that computes the very
same figures (tests compare it with brute force on small chains).

Example:
    ```python
    costs = [NodeCost(f"h{i}", kept=8, boundary=4, flops=1, grads=2,
                      output=4, kept_by_consumer=4) for i in range(16)]
    plan = plan_smallest_peak(costs)
    plan.peak < plan.baseline_peak
    # -> True
    plan_for_budget(costs, 0.6 * plan.baseline_peak).extra_flops
    # -> 6.0
    ```
"""

import math

from dataclasses import dataclass
from dataclasses import field

#: A plan without a budget takes the least recomputation among the plans
#: whose peak is within this fraction of the smallest one: the last percent
#: of memory can cost a whole extra segment of recomputation.
SMALLEST_PEAK_TOLERANCE = 0.02

#: Without a budget, the smallest peak among the plans that recompute at
#: most this many forward passes: a forward pass is about a third of a
#: training step, so one more keeps the step within about 1.35x.
MAX_EXTRA_FORWARDS = 1.0


@dataclass(frozen=True)
class NodeCost:
    """What one node costs, for planning.

    kept: bytes its backward pass needs that are neither its inputs from the
        node before it nor its own outputs (intermediates, inputs from
        further back).
    kept_output: bytes of its own outputs its backward pass needs.
    kept_by_consumer: bytes of its outputs the next node's backward needs.
    boundary: bytes of the tensors crossing the cut after it (computed at or
        before it, read after it): a recomputed segment starting after it
        keeps these.
    flops: its forward cost (what recomputing it costs).
    grads: bytes of the gradients its backward pass produces.
    output: the working memory of its backward: its incoming gradient (the
        bytes of its outputs) and the most its backward's temporaries hold
        at once.
    weights: bytes of its layer's weights (at its layer's first node); a
        recomputed segment passes them on uncopied (only its inputs are
        copied behind the incoming gradient, see `recompute_grad`), so they
        add nothing to the peak.
    elements: elements per example of its outputs (what the executor
        compares to keep the last segment; see `executor._keep_last_segment`).
    fixed: it has forward state and never sits in a recomputed segment.
    can_checkpoint: a segment may end after it.
    recompute_flops: forward cost its own backward recomputes whatever the
        plan (a Dense whose activation is recomputed from its kept
        pre-activation: the activation's); counted in every plan's
        `extra_flops`.
    """

    name: str
    kept: float = 0
    kept_output: float = 0
    kept_by_consumer: float = 0
    boundary: float = 0
    flops: float = 0
    grads: float = 0
    output: float = 0
    weights: float = 0
    elements: float = 0
    fixed: bool = False
    can_checkpoint: bool = True
    recompute_flops: float = 0


@dataclass(frozen=True)
class RecomputePlan:
    """A chosen plan: `checkpoints` (node indices), the `segments` that are
    recomputed (`(first, last)` indices), the estimated `peak` with it and
    `baseline_peak` without, and the forward cost recomputed
    (`extra_flops`) against the whole forward pass (`forward_flops`);
    `keeps`, `nested` and `inside` as in the module docstring."""

    checkpoints: tuple
    segments: tuple
    peak: float
    baseline_peak: float
    extra_flops: float
    forward_flops: float
    notes: tuple = field(default_factory=tuple)
    keeps: tuple = ()  # kept nodes that end a run right before a segment
    nested: tuple = ()  # the last nodes of the nested segments
    inside: tuple = ()  # nodes of nested segments recomputed inside their layer

    def kind(self, index):
        """`"keep"`, `"inside"` (recomputed from its own input) or
        `"checkpoint"` (recomputed from the segment's checkpoint)."""
        for first, last in self.segments:
            if first <= index <= last:
                return "inside" if first == last or index in self.inside else "checkpoint"
        return "keep"

    @property
    def extra_fraction(self):
        """Recomputed forward cost as a fraction of one forward pass."""
        return self.extra_flops / self.forward_flops if self.forward_flops else 0.0


class UnmeetableBudget(ValueError):
    """No plan meets the budget; `smallest` is the smallest peak any plan reaches."""

    def __init__(self, budget, smallest, baseline):
        self.budget, self.smallest, self.baseline = budget, smallest, baseline
        super().__init__(
            f"memory budget {budget:.0f} bytes is below the smallest peak any plan reaches "
            f"({smallest:.0f} bytes; {baseline:.0f} without recomputation)")


# -- what a plan is and what it costs ---------------------------------------------
def segments_of(costs, checkpoints, keeps=(), nested=()):
    """`[(first, last, recomputed, nested)]`: the segments the executor
    makes of `checkpoints` and `keeps`, its rules applied (see the module
    docstring); `nested` holds the last nodes of nested segments."""
    checkpoints, keeps, nested = set(checkpoints), set(keeps), set(nested)
    segments, start = [], None
    for index, cost in enumerate(costs):
        if cost.fixed or index in keeps:
            if start is not None:
                segments.append([start, index - 1, False, False])
                start = None
            segments.append([index, index, False, False])
            continue
        if start is None:
            start = index
        if index in checkpoints:
            segments.append([start, index, True, index in nested and index > start])
            start = None
    if start is not None:
        segments.append([start, len(costs) - 1, False, False])
    recomputed = [segment for segment in segments if segment[2]]
    if recomputed and _runs_normally_as_last(costs, recomputed[-1][0], recomputed[-1][1]):
        recomputed[-1][2] = recomputed[-1][3] = False
    return [tuple(segment) for segment in segments]


def estimate_peak(costs, checkpoints=(), held_gradients=False, keeps=(), nested=(),
                  inside=None):
    """The estimated peak bytes of a training step with `checkpoints`
    (`held_gradients`, `keeps`, `nested`: see the module docstring;
    `inside`: the nodes of nested segments recomputed inside their layer,
    when not every one that has internal tensors)."""
    return _evaluate(costs, segments_of(costs, checkpoints, keeps, nested), held_gradients,
                     inside)[0]


def describe_plan(costs, checkpoints, held_gradients=False, keeps=(), nested=(),
                  inside=None):
    """The `RecomputePlan` of `checkpoints`, as the executor would run it
    (`inside`: as in `estimate_peak`)."""
    segments = segments_of(costs, checkpoints, keeps, nested)
    peak, extra = _evaluate(costs, segments, held_gradients, inside)
    recomputed = tuple((first, last) for first, last, again, _ in segments if again)
    nested_nodes = tuple(index for first, last, again, deep in segments if again and deep
                         for index in range(first, last + 1)
                         if _nests(costs[index], index, inside))
    return RecomputePlan(
        checkpoints=tuple(sorted(set(checkpoints))), segments=recomputed, peak=peak,
        baseline_peak=estimate_peak(costs, (), held_gradients),
        extra_flops=extra + _own_recompute_flops(costs),
        forward_flops=float(sum(cost.flops for cost in costs)),
        keeps=tuple(sorted(set(keeps))),
        nested=tuple(last for _, last, again, deep in segments if again and deep),
        inside=nested_nodes,
    )


def _evaluate(costs, segments, held_gradients, inside=None):
    """(peak, recomputed flops) of `segments`: the figures the dynamic
    program computes transition by transition (`inside`: as in
    `estimate_peak`)."""
    after = _gradients_after(costs, held_gradients)
    kept, peak, extra, previous = 0.0, 0.0, 0.0, _START
    for first, last, recomputed, nested in segments:
        if recomputed:
            kept += _checkpoint_bytes(costs, first)
            local = (_nested_local_peak(costs, after, first, last, inside) if nested
                     else _segment_local_peak(costs, after, first, last))
            peak = max(peak, kept + local)
            extra += _segment_flops(costs, first, last, nested, inside)
            previous = _RECOMPUTED
            continue
        for index in range(first, last + 1):
            kept += _cut_bytes(costs, index, previous)
            peak = max(peak, kept + _node_local_peak(costs, after, index))
            kept += costs[index].kept
            previous = _FIXED if costs[index].fixed else _NORMAL
    return peak, extra


# -- the pieces both the evaluation and the dynamic program add up ------------------
_START, _NORMAL, _FIXED, _RECOMPUTED = 0, 1, 2, 3
#: What may precede a recomputed segment: anything. After a run of nodes
#: that run normally the plan marks the last of them `keep` (the executor
#: would otherwise fold the run into the segment).
_SEGMENT_MAY_FOLLOW = (_START, _NORMAL, _FIXED, _RECOMPUTED)


def _own_recompute_flops(costs):
    """What the nodes' own backward passes recompute in every plan (see
    `NodeCost.recompute_flops`): the same for all plans, so the search
    leaves it out and the plan adds it."""
    return float(sum(cost.recompute_flops for cost in costs))


def _nests(cost, index=None, inside=None):
    """Whether a node of a nested segment runs under its own checkpoint:
    only one with internal tensors to drop (others would recompute for
    nothing), and, when `inside` (node indices) is given, one it holds."""
    return cost.kept > 0 and cost.can_checkpoint and (inside is None or index in inside)


def _segment_flops(costs, first, last, nested, inside=None):
    """Forward cost a segment recomputes: once, and its nested nodes twice."""
    flops = sum(cost.flops for cost in costs[first:last + 1])
    if nested:
        flops += sum(costs[index].flops for index in range(first, last + 1)
                     if _nests(costs[index], index, inside))
    return flops


def _gradients_after(costs, held_gradients):
    """`after[i]`: gradient bytes of the nodes after node i still held
    when node i's backward runs: all of them when `held_gradients`, else
    none (each was applied and freed when produced)."""
    after, total = [0.0] * len(costs), 0.0
    if not held_gradients:
        return after
    for index in range(len(costs) - 1, -1, -1):
        after[index] = total
        total += costs[index].grads
    return after


def _cut_bytes(costs, index, previous):
    """Bytes the forward pass keeps at the cut before node `index` when it
    runs normally, given how the node before it ran: the larger of what
    the producer and this node keep of it (one tensor in a chain)."""
    if previous == _START:
        return 0.0
    before = costs[index - 1]
    if previous in (_NORMAL, _FIXED):
        return max(before.kept_output, before.kept_by_consumer)
    return before.kept_by_consumer


def _checkpoint_bytes(costs, first):
    """Bytes a recomputed segment starting at `first` keeps: its inputs."""
    return costs[first - 1].boundary if first > 0 else 0.0


def _node_local_peak(costs, after, index):
    """Memory at node `index`'s backward on top of what the nodes before it
    keep (the cut before it included in `kept` already): what it keeps, the
    gradients held, its own weight gradients and its output's size."""
    cost = costs[index]
    return cost.kept + cost.kept_output + after[index] + cost.grads + cost.output


def _segment_local_peak(costs, after, first, last):
    """The largest memory while segment `[first, last]` runs its backward
    (all its activations recomputed), on top of what the forward pass keeps
    before it (its checkpoint included): the copy of its inputs the
    recomputation starts from, and its activations. (Its weights are read
    once in the forward pass and passed on uncopied: see
    `recompute_grad`'s `anchored`.)"""
    inside, peak = 0.0, 0.0
    for index in range(first, last + 1):
        if index > first:
            inside += max(costs[index - 1].kept_output, costs[index - 1].kept_by_consumer)
        peak = max(peak, inside + _node_local_peak(costs, after, index))
        inside += costs[index].kept
    return _checkpoint_bytes(costs, first) + peak


def _nested_local_peak(costs, after, first, last, inside=None):
    """As `_segment_local_peak`, for a nested segment: its recomputation
    keeps the nodes' outputs only, and each nested node recomputes its own
    internals (from a copy of its input) when its backward runs (`inside`:
    as in `estimate_peak`)."""
    held, peak = 0.0, 0.0
    for index in range(first, last + 1):
        cut = 0.0
        if index > first:
            cut = max(costs[index - 1].kept_output, costs[index - 1].kept_by_consumer)
            held += cut
        nests = _nests(costs[index], index, inside)
        copy = cut if nests else 0.0
        peak = max(peak, held + copy + _node_local_peak(costs, after, index))
        if not nests:
            held += costs[index].kept
    return _checkpoint_bytes(costs, first) + peak


def _runs_normally_as_last(costs, first, last):
    """The executor's rule: as the last recomputed segment, `[first, last]`
    runs normally when the nodes after it are smaller than its largest
    output (recomputing it would save nothing)."""
    tail = sum(cost.elements for cost in costs[last + 1:])
    return tail < max(cost.elements for cost in costs[first:last + 1])


# -- the dynamic program ------------------------------------------------------------
@dataclass(frozen=True)
class _Label:
    """A partial plan over the nodes before a position: the bytes its
    forward pass keeps, its recomputed flops, its peak so far, and its
    choices (a linked list of `(kind, index)`, for the plan)."""

    kept: float
    flops: float
    peak: float
    checkpoints: object = None  # ((kind, index), rest) or None


# A label's state: how the last node ran (_START / _NORMAL / _FIXED /
# _RECOMPUTED),
# whether the last recomputed segment is one the executor would run normally
# were it the last (then another must follow), and whether a checkpoint was
# spent on such a segment at the end (then none may follow).
def _search(costs, budget, minimise, held_gradients):
    """Labels reaching the end. `minimise="flops"`: under `budget`, the
    least recomputation; `"peak"`: the smallest peak."""
    n = len(costs)
    after = _gradients_after(costs, held_gradients)
    fronts = [dict() for _ in range(n + 1)]
    fronts[0][(_START, False, False)] = [_Label(0.0, 0.0, 0.0)]
    ends = {}
    for position in range(n):
        for (previous, pending, closed), labels in fronts[position].items():
            # A kept node marked to end its run is marked for all of its
            # layer's calls: only a layer called once may be.
            segments = not closed and previous in _SEGMENT_MAY_FOLLOW and (
                previous != _NORMAL or costs[position - 1].can_checkpoint)
            if segments and previous not in ends:
                ends[previous] = _segment_ends(costs, after, position, previous)
            for label in labels:
                _step_normal(costs, after, budget, fronts, position, previous, pending,
                             closed, label)
                if segments:
                    start = label
                    if previous == _NORMAL:  # the run before ends at a kept node
                        start = _Label(label.kept, label.flops, label.peak,
                                       (("keep", position - 1), label.checkpoints))
                    _step_segments(ends[previous], budget, fronts, pending, start)
        ends = {}
        for key in fronts[position + 1]:
            fronts[position + 1][key] = _pareto(fronts[position + 1][key], minimise)
        fronts[position] = None  # free
    return [label for (_, pending, _), labels in fronts[n].items() if not pending
            for label in labels]


def _step_normal(costs, after, budget, fronts, position, previous, pending, closed, label):
    kept = label.kept + _cut_bytes(costs, position, previous)
    peak = max(label.peak, kept + _node_local_peak(costs, after, position))
    if peak <= budget:
        now = _FIXED if costs[position].fixed else _NORMAL
        _add(fronts[position + 1], (now, pending, closed),
             _Label(kept + costs[position].kept, label.flops, peak, label.checkpoints))


def _segment_ends(costs, after, position, previous):
    """Every segment that may start at `position`, as `(last, checkpoint
    bytes, [(local peak, flops, nested)], spent, plain kept, plain local
    peak, can end)`: what recomputing it adds, plainly or nested (see
    `_segment_local_peak`, `_nested_local_peak`), whether the executor
    would run it normally were it the last (`spent`), and, for running it
    normally instead, the bytes it keeps and its peak above what comes
    before. The same for every label at `position`, so computed once."""
    checkpoint = _checkpoint_bytes(costs, position)
    ends = []
    inside, local, flops = 0.0, 0.0, 0.0
    deep_inside, deep_local, deep_flops, deep = 0.0, 0.0, 0.0, False
    plain_kept, plain_local, plain_previous = 0.0, 0.0, previous
    largest, tail = 0.0, sum(cost.elements for cost in costs[position:])
    for last in range(position, len(costs)):
        cost = costs[last]
        if cost.fixed:
            break
        cut = 0.0
        if last > position:
            cut = max(costs[last - 1].kept_output, costs[last - 1].kept_by_consumer)
            inside += cut
            deep_inside += cut
        local = max(local, inside + _node_local_peak(costs, after, last))
        inside += cost.kept
        flops += cost.flops
        nests = _nests(cost)
        deep = deep or nests
        deep_local = max(deep_local, deep_inside + (cut if nests else 0.0)
                         + _node_local_peak(costs, after, last))
        deep_inside += 0.0 if nests else cost.kept
        deep_flops += cost.flops * (2 if nests else 1)
        plain_kept += _cut_bytes(costs, last, plain_previous)
        plain_local = max(plain_local, plain_kept + _node_local_peak(costs, after, last))
        plain_kept += cost.kept
        plain_previous = _NORMAL
        largest = max(largest, cost.elements)
        tail -= cost.elements
        options = [(checkpoint + checkpoint + local, flops, False)]
        if last > position and deep:
            options.append((checkpoint + checkpoint + deep_local, deep_flops, True))
        ends.append((last, checkpoint, options, tail < largest, plain_kept, plain_local,
                     cost.can_checkpoint))
    return ends


def _step_segments(ends, budget, fronts, pending, label):
    """Every segment starting where `label` ends: recomputed (plainly or
    nested), or (only to settle a pending segment) spent as the last one,
    which the executor runs normally."""
    for last, checkpoint, options, spent, plain_kept, plain_local, can_end in ends:
        peaks = [max(label.peak, label.kept + local) for local, _, _ in options]
        plain_peak = max(label.peak, label.kept + plain_local)
        if min(peaks) > budget and plain_peak > budget:
            return  # a longer segment only needs more
        if not can_end:
            continue
        for peak, (_, flops, nested) in zip(peaks, options):
            if peak <= budget:
                choice = (("nested" if nested else "checkpoint", last), label.checkpoints)
                _add(fronts[last + 1], (_RECOMPUTED, spent, False),
                     _Label(label.kept + checkpoint, label.flops + flops, peak, choice))
        if pending and spent and plain_peak <= budget:
            _add(fronts[last + 1], (_NORMAL, False, True),
                 _Label(label.kept + plain_kept, label.flops, plain_peak,
                        (("checkpoint", last), label.checkpoints)))


def _add(front, key, label):
    front.setdefault(key, []).append(label)


def _pareto(labels, minimise):
    """The labels no other label beats: less kept and less of the objective."""
    objective = (lambda label: label.flops) if minimise == "flops" else (
        lambda label: label.peak)
    labels = sorted(labels, key=lambda label: (label.kept, objective(label), label.peak))
    kept, best = [], None
    for label in labels:
        if best is None or objective(label) < best:
            kept.append(label)
            best = objective(label)
    return kept


def _choices(label):
    """(checkpoints, keeps, nested) of a label's plan."""
    found = {"checkpoint": set(), "keep": set(), "nested": set()}
    link = label.checkpoints
    while link is not None:
        kind, index = link[0]
        found[kind].add(index)
        link = link[1]
    checkpoints = found["checkpoint"] | found["nested"]
    return tuple(sorted(checkpoints)), tuple(sorted(found["keep"])), tuple(sorted(found["nested"]))


def _described(costs, label, held_gradients):
    checkpoints, keeps, nested = _choices(label)
    return describe_plan(costs, checkpoints, held_gradients, keeps, nested)


# -- the planners -------------------------------------------------------------------
def smallest_peak(costs, held_gradients=False, max_extra_flops=None):
    """The smallest estimated peak any plan reaches (recomputing at most
    `max_extra_flops`, when given)."""
    if not costs:
        return 0.0
    # No plan needs more than running everything normally (a plan too).
    baseline = estimate_peak(costs, (), held_gradients)
    if max_extra_flops is None:
        return min(label.peak for label in _search(costs, baseline, "peak", held_gradients))
    # The least recomputation meeting a budget falls as the budget grows:
    # the smallest budget met within `max_extra_flops` is found by bisection.
    low = min(label.peak for label in _search(costs, baseline, "peak", held_gradients))
    if _least_flops(costs, low, held_gradients) <= max_extra_flops:
        return low
    high = baseline
    while high - low > max(1.0, 1e-4 * baseline):
        middle = (low + high) / 2
        if _least_flops(costs, middle, held_gradients) <= max_extra_flops:
            high = middle
        else:
            low = middle
    return high


def _least_flops(costs, budget, held_gradients):
    labels = _search(costs, budget, "flops", held_gradients)
    return min((label.flops for label in labels), default=math.inf)


def plan_for_budget(costs, budget, held_gradients=False):
    """The plan with the least recomputation whose estimated peak is at
    most `budget` bytes; `UnmeetableBudget` when none is.

    Example:
        ```python
        plan_for_budget(costs, 200 * 2**20).checkpoints
        # -> (5, 11, 17)
        ```
    """
    if not costs:
        return describe_plan(costs, (), held_gradients)
    labels = _search(costs, budget, "flops", held_gradients)
    if not labels:
        raise UnmeetableBudget(budget, smallest_peak(costs, held_gradients),
                               estimate_peak(costs, (), held_gradients))
    best = min(labels, key=lambda label: (label.flops, label.peak))
    return _described(costs, best, held_gradients)


def plan_smallest_peak(costs, tolerance=SMALLEST_PEAK_TOLERANCE, held_gradients=False,
                       max_extra_forwards=MAX_EXTRA_FORWARDS):
    """The plan with the least recomputation among those whose peak is
    within `tolerance` of the smallest that recomputes at most
    `max_extra_forwards` forward passes (None: any number).

    Example:
        ```python
        plan_smallest_peak(costs).checkpoints
        # -> (6, 13, 20, 27, 34, 41)
        ```
    """
    if not costs:
        return describe_plan(costs, (), held_gradients)
    cap = None
    if max_extra_forwards is not None:
        cap = max_extra_forwards * sum(cost.flops for cost in costs) * (1 + 1e-9)
        cap = max(0.0, cap - _own_recompute_flops(costs))
    smallest = smallest_peak(costs, held_gradients, cap)
    return plan_for_budget(costs, smallest * (1 + tolerance), held_gradients)
