"""The exact recompute search (`planning/exact_plan.py`): the optimum of
the planner's cost model over plans that choose per node whether a Dense
recomputes its activation and whether a node of a nested segment is
recomputed inside its layer. Users see it as the optimum the planner's
plans are measured against; these tests check it against brute force, and
that the planner's own plans are never better than it."""

import dataclasses
import itertools
import math
import random

import pytest

from keras_ipu_plugin.planning import exact_plan
from keras_ipu_plugin.planning import recompute_plan
from keras_ipu_plugin.planning.recompute_plan import NodeCost


def _random_chains(rng, n):
    """(plain, split): the chain with no node split and with every node
    that may split split (keeping less of itself, recomputing a little,
    and possibly keeping another amount of the node before it)."""
    plain = [
        NodeCost(
            f"n{i}", kept=rng.choice([0, 1, 3, 5, 8]), kept_output=rng.choice([0, 0, 2, 4]),
            kept_by_consumer=rng.choice([0, 2, 4]), boundary=rng.choice([1, 2, 4, 6]),
            flops=rng.choice([0, 1, 2, 5]), grads=rng.choice([0, 1, 3]),
            output=rng.choice([1, 2, 4]), elements=rng.choice([0, 1, 2, 4, 8]),
            fixed=rng.random() < 0.1, can_checkpoint=rng.random() < 0.85)
        for i in range(n)
    ]
    splits = [i for i in range(n) if rng.random() < 0.5]
    split = list(plain)
    for i in splits:
        split[i] = dataclasses.replace(
            plain[i], kept=max(0, plain[i].kept - rng.choice([1, 2, 3])),
            kept_output=rng.choice([0, 2]), output=plain[i].output + rng.choice([0, 1]),
            recompute_flops=rng.choice([0.25, 0.5]))
    for i in splits:  # what the next node keeps of this one, if it is split
        if i > 0:
            split[i - 1] = dataclasses.replace(split[i - 1],
                                               kept_by_consumer=rng.choice([0, 2, 4]))
    return plain, split


def _every_plan(plain, split, held=False):
    """(peak, extra flops) of every plan of the larger space."""
    n = len(plain)
    splittable = exact_plan.may_split(plain, split)
    candidates = [i for i, c in enumerate(plain) if c.can_checkpoint and not c.fixed]
    plans = []
    for count in range(len(splittable) + 1):
        for splits in itertools.combinations(splittable, count):
            chain = exact_plan.chain_of(plain, split, splits)
            for kinds in itertools.product(("none", "checkpoint", "nested", "keep"),
                                           repeat=len(candidates)):
                chosen = {kind: [i for i, k in zip(candidates, kinds) if k == kind]
                          for kind in ("checkpoint", "nested", "keep")}
                checkpoints = chosen["checkpoint"] + chosen["nested"]
                segments = recompute_plan.segments_of(chain, checkpoints, chosen["keep"],
                                                      chosen["nested"])
                eligible = [i for first, last, again, deep in segments if again and deep
                            for i in range(first, last + 1)
                            if chain[i].kept > 0 and chain[i].can_checkpoint]
                for size in range(len(eligible) + 1):
                    for inside in itertools.combinations(eligible, size):
                        plan = recompute_plan.describe_plan(
                            chain, checkpoints, held, chosen["keep"], chosen["nested"],
                            inside=set(inside))
                        plans.append((plan.peak, plan.extra_flops))
    assert n == 0 or plans
    return plans


@pytest.mark.parametrize("seed", range(3))
def test_the_exact_search_finds_what_brute_force_finds(seed):
    rng = random.Random(seed)
    for _ in range(25):
        plain, split = _random_chains(rng, rng.randint(1, 4))
        plans = _every_plan(plain, split)
        smallest = min(peak for peak, _ in plans)
        best = exact_plan.smallest_peak_within(plain, split)
        assert best.peak == pytest.approx(smallest)
        # its figures are those of its plan on its chain
        described = exact_plan.evaluate(plain, split, best)
        assert described.peak == pytest.approx(best.peak)
        assert described.extra_flops == pytest.approx(best.extra_flops)
        for budget in sorted({peak for peak, _ in plans}) + [smallest - 0.5]:
            feasible = [flops for peak, flops in plans if peak <= budget]
            found = exact_plan.least_recompute(plain, split, budget)
            if not feasible:
                assert found is None
                continue
            assert found.extra_flops == pytest.approx(min(feasible))
            assert exact_plan.evaluate(plain, split, found).peak <= budget + 1e-9
        for cap in sorted({flops for _, flops in plans}):
            within = min(peak for peak, flops in plans if flops <= cap + 1e-9)
            assert exact_plan.smallest_peak_within(plain, split, cap).peak == pytest.approx(
                within)


def _heuristic_splits(plain, split):
    """The planner's choice: split where the node keeps less so."""
    return [i for i in exact_plan.may_split(plain, split)
            if split[i].kept + split[i].kept_output < plain[i].kept + plain[i].kept_output]


@pytest.mark.parametrize("seed", range(4))
def test_the_planner_is_never_better_than_the_optimum(seed):
    rng = random.Random(100 + seed)
    for _ in range(40):
        plain, split = _random_chains(rng, rng.randint(2, 9))
        chain = exact_plan.chain_of(plain, split, _heuristic_splits(plain, split))
        planned = recompute_plan.plan_smallest_peak(chain, max_extra_forwards=None)
        optimum = exact_plan.smallest_peak_within(plain, split, planned.extra_flops)
        assert optimum.peak <= planned.peak + 1e-9
        budget = 0.5 * (planned.peak + planned.baseline_peak)
        heuristic = recompute_plan.plan_for_budget(chain, budget)
        least = exact_plan.least_recompute(plain, split, budget)
        assert least.extra_flops <= heuristic.extra_flops + 1e-9


def test_a_nested_segment_may_recompute_only_some_of_its_nodes_inside():
    # Three heavy layers in a segment: nesting the last one only adds the
    # copy of its input (its internals are needed at once anyway), so
    # nesting the first two holds less than nesting all three, for less
    # recomputation, and the exact search finds at least as good a plan.
    plain = [NodeCost(name, kept=12, kept_by_consumer=4, boundary=4, flops=5, output=4,
                      elements=8) for name in "abc"] + [NodeCost("head", elements=100)]
    every = recompute_plan.describe_plan(plain, [2], nested=[2])
    some = recompute_plan.describe_plan(plain, [2], nested=[2], inside={0, 1})
    assert some.inside == (0, 1) and every.inside == (0, 1, 2)
    assert some.peak < every.peak and some.extra_flops < every.extra_flops
    found = exact_plan.least_recompute(plain, plain, some.peak)
    assert found.peak <= some.peak and found.extra_flops <= some.extra_flops


def test_a_deadline_in_the_past_stops_the_search():
    plain = [NodeCost(f"h{i}", kept=12, kept_by_consumer=4, boundary=4, flops=1, output=4,
                      elements=1024) for i in range(30)]
    with pytest.raises(exact_plan.SolveTimeout):
        exact_plan.smallest_peak_within(plain, plain, deadline=0.0)
    assert math.isfinite(exact_plan.smallest_peak_within(plain, plain, 12).peak)
