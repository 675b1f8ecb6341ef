"""The optimum of the recompute planner's cost model, by an exact search.

`recompute_plan` finds the best checkpoints exactly, but over a plan space
narrowed by two choices made around its search:

- whether a Dense recomputes its activation from its kept pre-activation
  (`activation_remat`) is decided per layer before the search
  (`graph_planning.runs_split`: where it keeps less);
- a nested segment recomputes inside its layer every one of its nodes that
  has internal tensors, or none.

This module searches the larger space where both are chosen per node,
jointly with the checkpoints, keeps and segments, under the very same cost
model (`recompute_plan.estimate_peak` of the plan's chain is the figure it
optimises). It measures how far the planner's plans are from the optimum
of their own cost model: the smallest estimated peak any plan reaches with
no more recomputation (`smallest_peak_within`), or the least recomputation
under a budget (`least_recompute`).

The search is a dynamic program over the node order, like the planner's,
with labels (bytes kept, recomputed flops, peak so far) kept where no other
label is better in all three; a segment's options are enumerated node by
node the same way. It is exact, and its time grows with the number of
Pareto-optimal partial plans: `deadline` bounds it (`SolveTimeout`).

Example:
    >>> plain = [NodeCost(f"h{i}", kept=12, kept_by_consumer=4, boundary=4, flops=1,
    ...                   output=4, elements=1024) for i in range(12)]
    >>> best = smallest_peak_within(plain, plain, max_extra_flops=12)
    >>> best.peak <= recompute_plan.plan_smallest_peak(plain).peak
    True
"""

import bisect
import dataclasses
import math
import time

from dataclasses import dataclass

from keras_ipu_plugin.planning import recompute_plan
from keras_ipu_plugin.planning.recompute_plan import NodeCost  # noqa: F401 (the example)

_START, _NORMAL, _FIXED, _RECOMPUTED = 0, 1, 2, 3


#: The smallest peak under a recomputation cap is found to within this
#: fraction (peaks in bytes are whole numbers: far below one byte on small
#: chains, where it is exact).
PEAK_TOLERANCE = 1e-3


class WorkLimit:
    """A deadline counted in labels looked at rather than in seconds, so
    that a search ends (or gives up) at the same point on every machine:
    a plan must not depend on how loaded the machine that made it was.
    Shared by the searches of one plan (pass it as `deadline`)."""

    def __init__(self, labels):
        self.labels, self.spent = labels, 0

    def spend(self, labels):
        self.spent += labels
        if self.spent > self.labels:
            raise SolveTimeout(f"the exact recompute search looked at more than "
                               f"{self.labels} labels")


class SolveTimeout(RuntimeError):
    """The exact search did not finish before its deadline."""


@dataclass(frozen=True)
class ExactPlan:
    """A plan of the larger space: `splits` (the nodes whose activation is
    recomputed from their kept pre-activation), `checkpoints`, `keeps`,
    `nested` and `inside` as in `recompute_plan.RecomputePlan`, with its
    estimated `peak` and recomputed `extra_flops`, and `seconds` the search
    took."""

    splits: tuple
    checkpoints: tuple
    keeps: tuple
    nested: tuple
    inside: tuple
    peak: float
    extra_flops: float
    seconds: float = 0.0


def chain_of(plain, split, splits):
    """The `NodeCost` chain with the nodes in `splits` split: each node's
    own figures from its chain, and what it keeps of the node before it
    (that node's `kept_by_consumer`) from its own chain too.

    Example:
        >>> plain = [NodeCost(f"h{i}", kept=12, kept_by_consumer=4) for i in range(3)]
        >>> split = [dataclasses.replace(cost, kept=4, kept_by_consumer=2) for cost in plain]
        >>> chain = chain_of(plain, split, {1})
        >>> chain[1].kept, chain[0].kept_by_consumer, chain[1].kept_by_consumer
        (4, 2, 4)
    """
    splits = set(splits)
    chain = []
    for index in range(len(plain)):
        own = (split if index in splits else plain)[index]
        if index + 1 < len(plain):
            following = (split if index + 1 in splits else plain)[index]
            own = dataclasses.replace(own, kept_by_consumer=following.kept_by_consumer)
        chain.append(own)
    return chain


def may_split(plain, split):
    """The nodes whose split figures differ from their plain ones."""
    return [index for index, (a, b) in enumerate(zip(plain, split))
            if dataclasses.replace(a, kept_by_consumer=0)
            != dataclasses.replace(b, kept_by_consumer=0)]


def evaluate(plain, split, plan, held_gradients=False):
    """`recompute_plan.describe_plan` of `plan` (an `ExactPlan`) on its chain."""
    return recompute_plan.describe_plan(
        chain_of(plain, split, plan.splits), plan.checkpoints, held_gradients, plan.keeps,
        plan.nested, inside=set(plan.inside))


def least_recompute(plain, split, budget, held_gradients=False, deadline=None,
                    max_extra_flops=math.inf):
    """The plan with the least recomputation whose estimated peak is at
    most `budget`, or None when no plan meets it. `plain`: the chain with
    no node split; `split`: with every node that may be split split (equal
    to `plain` where a node may not). `deadline`: a `time.monotonic()` after
    which `SolveTimeout` is raised; `max_extra_flops`: plans recomputing more
    are not looked at (None is returned when every plan meeting the budget
    does)."""
    start = time.monotonic()
    labels = _Search(plain, split, held_gradients, budget, max_extra_flops, deadline,
                     "flops").run()
    if not labels:
        return None
    best = min(labels, key=lambda label: (label[1], label[2]))
    return _plan_of(best, time.monotonic() - start)


def smallest_peak_within(plain, split, max_extra_flops=math.inf, held_gradients=False,
                         deadline=None, known=None):
    """The plan with the smallest estimated peak among those recomputing at
    most `max_extra_flops` (every node's own recomputation included, as in
    `RecomputePlan.extra_flops`); None when none does. `known`: the peak of
    a plan of this space known to recompute no more (the planner's), which
    bounds the search.

    The smallest peak of all is searched for directly; under a cap, the
    least recomputation falls as the budget grows, so the smallest budget
    whose least recomputation is within the cap is found by bisection,
    each budget met lowered to the peak its plan reaches (to within
    `PEAK_TOLERANCE` of the peak)."""
    start = time.monotonic()
    labels = _Search(plain, split, held_gradients, math.inf, math.inf, deadline, "peak").run()
    if not labels:
        return None
    best = _plan_of(min(labels, key=lambda label: (label[2], label[1])), 0.0)
    if math.isfinite(max_extra_flops):
        cap = max_extra_flops * (1 + 1e-9)
        low = best.peak
        if best.extra_flops > cap:
            # Doing nothing recomputes only what the nodes recompute of
            # their own; a known plan, no more than the cap.
            best = least_recompute(plain, split, math.inf if known is None else known,
                                   held_gradients, deadline, cap)
            if best is None:
                return None
            while best.peak - low > PEAK_TOLERANCE * best.peak:
                middle = (low + best.peak) / 2
                found = least_recompute(plain, split, middle, held_gradients, deadline, cap)
                if found is not None:
                    best = found  # its peak is at most `middle`
                else:
                    low = middle
    return dataclasses.replace(best, seconds=time.monotonic() - start)


def _plan_of(label, seconds):
    found = {"split": set(), "checkpoint": set(), "keep": set(), "nested": set(),
             "inside": set()}
    for kind, index in _items(label[3]):
        if kind == "inner":  # a segment's own choices: a list of its own
            for inner_kind, inner_index in _items(index):
                found[inner_kind].add(inner_index)
        else:
            found[kind].add(index)
    return ExactPlan(
        splits=tuple(sorted(found["split"])),
        checkpoints=tuple(sorted(found["checkpoint"] | found["nested"])),
        keeps=tuple(sorted(found["keep"])), nested=tuple(sorted(found["nested"])),
        inside=tuple(sorted(found["inside"])), peak=label[2], extra_flops=label[1],
        seconds=seconds)


def _pareto(labels, second, third=None):
    """The labels no other is better than or equal to in figures 0,
    `second` and `third` (when given)."""
    labels = sorted(labels, key=lambda label: (label[0], label[second],
                                                label[third] if third else 0))
    kept = []
    if third is None:
        best = math.inf
        for label in labels:
            if label[second] < best:
                kept.append(label)
                best = label[second]
        return kept
    for label in labels:
        if not any(other[second] <= label[second] and other[third] <= label[third]
                   for other in kept):
            kept.append(label)
    return kept


class _Search:
    """The dynamic program. Outer labels `(kept, flops, peak, trail)` at
    each position, by state `(how the node before ran, whether it was
    split, a pending segment, a spent checkpoint)` (as in
    `recompute_plan._search`); a trail is a linked list of `(kind, index)`.
    """

    def __init__(self, plain, split, held_gradients, budget, cap, deadline, minimise):
        self.plain, self.split = plain, split
        self.budget, self.cap, self.deadline = budget, cap, deadline
        # What labels are compared on besides the bytes kept: the least
        # recomputation under a budget needs no peak (it is under the
        # budget), the smallest peak no recomputation.
        self.outer = 1 if minimise == "flops" else 2
        self.inner = (1, 2) if minimise == "flops" else (2, None)
        self.n = len(plain)
        self.after = recompute_plan._gradients_after(plain, held_gradients)
        splittable = set(may_split(plain, split))
        self.options = [(False, True) if index in splittable else (False,)
                        for index in range(self.n)]
        self.elements = [cost.elements for cost in plain]
        self.tail = [sum(self.elements[index + 1:]) for index in range(self.n)]

    # -- the figures of one node -------------------------------------------------------
    def cost(self, index, split):
        return (self.split if split else self.plain)[index]

    def local(self, index, split):
        cost = self.cost(index, split)
        return cost.kept + cost.kept_output + self.after[index] + cost.grads + cost.output

    def cut(self, index, previous, split_before, split_here):
        """Bytes kept at the cut before `index` run normally
        (`recompute_plan._cut_bytes`)."""
        if previous == _START:
            return 0.0
        by_consumer = self.cost(index - 1, split_here).kept_by_consumer
        if previous in (_NORMAL, _FIXED):
            return max(self.cost(index - 1, split_before).kept_output, by_consumer)
        return by_consumer

    def inner_cut(self, index, split_before, split_here):
        """The cut before `index` inside a segment (its node before ran there)."""
        return max(self.cost(index - 1, split_before).kept_output,
                   self.cost(index - 1, split_here).kept_by_consumer)

    def check_time(self, labels=1):
        """Count `labels` labels looked at against a `WorkLimit` deadline,
        or check a `time.monotonic()` one."""
        if isinstance(self.deadline, WorkLimit):
            self.deadline.spend(labels)
        elif self.deadline is not None and time.monotonic() > self.deadline:
            raise SolveTimeout("the exact recompute search ran past its deadline")

    # -- the search ----------------------------------------------------------------------
    def run(self):
        fronts = [dict() for _ in range(self.n + 1)]
        fronts[0][(_START, False, False, False)] = [(0.0, 0.0, 0.0, None)]
        for position in range(self.n):
            self.check_time(1 + sum(len(labels) for labels in (fronts[position] or {}).values()))
            front = fronts[position]
            fronts[position] = None
            if not front:
                continue
            least_kept = min(label[0] for labels in front.values() for label in labels)
            least_flops = min(label[1] for labels in front.values() for label in labels)
            ends = None  # the recomputed segments from here, alike for every state
            for (previous, split_before, pending, closed), labels in front.items():
                self.step_normal(fronts, position, previous, split_before, pending, closed,
                                 labels)
                may_start = not closed and (previous != _NORMAL
                                            or self.plain[position - 1].can_checkpoint)
                if may_start:
                    if ends is None:
                        ends = self.recomputed_ends(position, least_kept, least_flops)
                    self.step_segments(fronts, position, previous, split_before, pending,
                                       labels, ends, least_kept, least_flops)
            for key in fronts[position + 1]:
                fronts[position + 1][key] = _pareto(fronts[position + 1][key], self.outer)
        return [label for (_, _, pending, _), labels in fronts[self.n].items() if not pending
                for label in labels]

    def step_normal(self, fronts, position, previous, split_before, pending, closed, labels):
        fixed = self.plain[position].fixed
        for split in self.options[position]:
            cut = self.cut(position, previous, split_before, split)
            local = self.local(position, split)
            cost = self.cost(position, split)
            key = (_FIXED if fixed else _NORMAL, split, pending, closed)
            for kept, flops, peak, trail in labels:
                here = kept + cut
                new_peak = max(peak, here + local)
                new_flops = flops + cost.recompute_flops
                if new_peak <= self.budget and new_flops <= self.cap:
                    fronts[position + 1].setdefault(key, []).append((
                        here + cost.kept, new_flops, new_peak,
                        (("split", position), trail) if split else trail))

    def recomputed_ends(self, position, least_kept, least_flops):
        """`[(last, spent, inner labels)]`: every recomputed segment
        starting at `position` (each of its nodes split or not, nested
        inside its layer or not) that may end at `last`, and whether the
        executor would run it normally were it the last (`spent`)."""
        checkpoint = self.checkpoint(position)
        # Inner labels: (held, flops, local, split of the last node, trail,
        # whether a node is recomputed inside its layer).
        labels = [(0.0, 0.0, 0.0, None, None, False)]
        ends, largest = [], 0.0
        for last in range(position, self.n):
            self.check_time(1 + len(labels))
            if self.plain[last].fixed:
                break
            largest = max(largest, self.elements[last])
            labels = self.extend_recomputed(labels, position, last, checkpoint, least_kept,
                                            least_flops)
            if not labels:
                break  # a longer segment only holds more
            if self.plain[last].can_checkpoint:
                # One node alone is recomputed inside its layer already.
                ending = [label for label in labels if not (label[5] and last == position)]
                ends.append((last, self.tail[last] < largest, self.choices(ending)))
        return ends

    def choices(self, labels):
        """`{split of the last node: (locals, labels)}`: of the segments
        ending here, those a plan may take: by local peak ascending, each
        recomputing less than the ones before (the least recomputation
        under a budget takes the last one that fits), or the one with the
        least local peak (for the smallest peak)."""
        by_split = {}
        for label in sorted(labels, key=lambda label: (label[2], label[1])):
            locals_, chosen = by_split.setdefault(label[3], ([], []))
            if self.outer == 2:
                if not chosen:
                    locals_.append(label[2])
                    chosen.append(label)
            elif not chosen or label[1] < chosen[-1][1]:
                locals_.append(label[2])
                chosen.append(label)
        return by_split

    def checkpoint(self, position):
        return self.plain[position - 1].boundary if position > 0 else 0.0

    def step_segments(self, fronts, position, previous, split_before, pending, labels, ends,
                      least_kept, least_flops):
        """Every segment starting at `position`: recomputed (`ends`), or
        (only to settle a pending segment) a checkpoint spent on a run the
        executor runs normally."""
        checkpoint = self.checkpoint(position)
        if previous == _NORMAL:  # the run before ends at a kept node
            labels = [(kept, flops, peak, (("keep", position - 1), trail))
                      for kept, flops, peak, trail in labels]
        for last, spent, by_split in ends:
            for split, (locals_, options) in by_split.items():
                key = (_RECOMPUTED, split, spent, False)
                for kept, flops, peak, trail in labels:
                    # The segment recomputing least that fits the budget.
                    fits = bisect.bisect_right(locals_, self.budget - kept - 2 * checkpoint)
                    if not fits:
                        continue
                    _, extra, local, _, inner, deep = options[fits - 1]
                    new_peak = max(peak, kept + 2 * checkpoint + local)
                    if new_peak <= self.budget and flops + extra <= self.cap:
                        mark = ("nested" if deep else "checkpoint", last)
                        fronts[last + 1].setdefault(key, []).append((
                            kept + checkpoint, flops + extra, new_peak,
                            (mark, (("inner", inner), trail))))
        if not pending:
            return
        run = [(0.0, 0.0, 0.0, split_before, None, False)]
        largest = 0.0
        for last in range(position, self.n):
            self.check_time()
            if self.plain[last].fixed:
                break
            largest = max(largest, self.elements[last])
            run = self.extend_run(run, position, last, previous, least_kept, least_flops)
            if not run:
                return
            if not self.plain[last].can_checkpoint or not self.tail[last] < largest:
                continue
            for held, extra, local, split, inner, _ in run:
                key = (_NORMAL, split, False, True)
                for kept, flops, peak, trail in labels:
                    new_peak = max(peak, kept + local)
                    if new_peak <= self.budget and flops + extra <= self.cap:
                        fronts[last + 1].setdefault(key, []).append((
                            kept + held, flops + extra, new_peak,
                            (("checkpoint", last), (("inner", inner), trail))))

    def extend_recomputed(self, labels, position, last, checkpoint, least_kept, least_flops):
        """The recomputed segment's inner labels with node `last` added
        (`recompute_plan._segment_local_peak` / `_nested_local_peak`)."""
        extended = []
        for held, flops, local, split_before, inner, deep in labels:
            for split in self.options[last]:
                cost = self.cost(last, split)
                cut = self.inner_cut(last, split_before, split) if last > position else 0.0
                node = self.local(last, split)
                own = cost.recompute_flops
                choices = [False]
                if cost.kept > 0 and cost.can_checkpoint:
                    choices.append(True)
                for inside in choices:
                    if inside:  # its internals recomputed from a copy of its input
                        new = (held + cut, flops + 2 * cost.flops + own,
                               max(local, held + cut + cut + node))
                    else:
                        new = (held + cut + cost.kept, flops + cost.flops + own,
                               max(local, held + cut + node))
                    if (least_kept + 2 * checkpoint + new[2] > self.budget
                            or least_flops + new[1] > self.cap):
                        continue
                    mark = inner
                    if split:
                        mark = (("split", last), mark)
                    if inside:
                        mark = (("inside", last), mark)
                    extended.append((*new, split, mark, deep or inside))
        return _pareto_inner(extended, self.inner)

    def extend_run(self, labels, position, last, previous, least_kept, least_flops):
        """The inner labels of nodes `position..last` run normally."""
        extended = []
        for held, flops, local, split_before, inner, _ in labels:
            for split in self.options[last]:
                cost = self.cost(last, split)
                before = previous if last == position else _NORMAL
                here = held + self.cut(last, before, split_before, split)
                new = (here + cost.kept, flops + cost.recompute_flops,
                       max(local, here + self.local(last, split)))
                if least_kept + new[2] > self.budget or least_flops + new[1] > self.cap:
                    continue
                extended.append((*new, split, (("split", last), inner) if split else inner,
                                 False))
        return _pareto_inner(extended, self.inner)


def _pareto_inner(labels, dims):
    """Inner labels no other with the same last split beats in held bytes,
    flops and local peak (a segment with a node recomputed inside its layer
    is compared only with such segments: it may not end at its first node)."""
    by_split = {}
    for label in labels:
        by_split.setdefault((label[3], label[5]), []).append(label)
    return [label for group in by_split.values() for label in _pareto(group, *dims)]


def _items(link):
    while link is not None:
        yield link[0]
        link = link[1]
