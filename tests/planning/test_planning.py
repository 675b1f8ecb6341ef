"""The pure planners: recomputation checkpoints by dynamic
programming over a chain of node costs, pipeline stages by a min-max
contiguous partition. Each is checked against brute force on small inputs."""

import itertools
import math
import random

import pytest

from keras_ipu_plugin.planning import recompute_plan
from keras_ipu_plugin.planning import stage_balance
from keras_ipu_plugin.planning.recompute_plan import NodeCost


def _random_chain(rng, n):
    return [
        NodeCost(
            f"n{i}", kept=rng.choice([0, 1, 2, 3, 5, 8]), kept_output=rng.choice([0, 0, 2, 4]),
            kept_by_consumer=rng.choice([0, 2, 4]), boundary=rng.choice([1, 2, 4, 6]),
            flops=rng.choice([0, 1, 2, 5]), grads=rng.choice([0, 1, 3]),
            output=rng.choice([1, 2, 4]), weights=rng.choice([0, 1, 3]),
            elements=rng.choice([0, 1, 2, 4, 8]), fixed=rng.random() < 0.15, can_checkpoint=rng.random() < 0.85,
        )
        for i in range(n)
    ]


def _every_plan(costs, held):
    """(peak, recomputed flops) of every plan: each node that may carry a
    note runs on (none), ends a segment (checkpoint), ends a nested segment
    (nested) or ends a run of kept nodes (keep)."""
    candidates = [i for i, c in enumerate(costs) if c.can_checkpoint and not c.fixed]
    plans = []
    for kinds in itertools.product(("none", "checkpoint", "nested", "keep"),
                                   repeat=len(candidates)):
        chosen = {kind: [i for i, k in zip(candidates, kinds) if k == kind]
                  for kind in ("checkpoint", "nested", "keep")}
        plan = recompute_plan.describe_plan(
            costs, chosen["checkpoint"] + chosen["nested"], held_gradients=held,
            keeps=chosen["keep"], nested=chosen["nested"])
        plans.append((plan.peak, plan.extra_flops))
    return plans


@pytest.mark.parametrize("held", [False, True], ids=["gradients_freed", "gradients_held"])
@pytest.mark.parametrize("seed", range(3))
def test_recompute_dynamic_program_finds_what_brute_force_finds(seed, held):
    rng = random.Random(seed)
    for _ in range(60):
        costs = _random_chain(rng, rng.randint(1, 6))
        plans = _every_plan(costs, held)
        smallest = min(peak for peak, _ in plans)
        assert recompute_plan.smallest_peak(costs, held) == pytest.approx(smallest)
        for budget in sorted({peak for peak, _ in plans}) + [smallest - 0.5]:
            feasible = [flops for peak, flops in plans if peak <= budget]
            if not feasible:
                with pytest.raises(recompute_plan.UnmeetableBudget) as raised:
                    recompute_plan.plan_for_budget(costs, budget, held)
                assert raised.value.smallest == pytest.approx(smallest)
                continue
            plan = recompute_plan.plan_for_budget(costs, budget, held)
            assert plan.peak <= budget
            assert plan.extra_flops == pytest.approx(min(feasible))
            # The plan's figures are those of its notes as the executor runs them.
            assert recompute_plan.estimate_peak(
                costs, plan.checkpoints, held, plan.keeps, plan.nested) == pytest.approx(plan.peak)


def _gelu_mlp(depth=48):
    """The costs `planning.recompute_costs` gives the benchmark's 48-layer,
    1024-wide GELU MLP at batch 1024, in MiB: each layer keeps 12 MiB of
    intermediates and its 4 MiB input; its kernel and gradient are 4 MiB."""
    return [NodeCost(f"h{i}", kept=12, kept_by_consumer=4, boundary=4, flops=1, grads=4,
                     output=4, weights=4, elements=1024) for i in range(depth)]


def _every(k, depth=48):
    return list(range(k - 1, depth - 1, k))


def test_weight_gradients_applied_as_produced_do_not_make_a_checkpoint_per_layer_best():
    # Measured step peaks of that MLP (benchmarks/recompute_memory.py, CPU,
    # BFC counts): a checkpoint every layer 240 MiB, every 2-4 layers 164,
    # every 6 184, every 8 216. Counting every later weight gradient as held
    # made every layer look best (the plan measured 240 MiB, above the hand
    # plan's 184).
    costs = _gelu_mlp()
    peaks = {k: recompute_plan.estimate_peak(costs, _every(k)) for k in (1, 2, 3, 4, 6, 8)}
    assert min(peaks, key=peaks.get) in (2, 3, 4), peaks
    assert peaks[1] > peaks[6] > peaks[3] and peaks[8] > peaks[6], peaks
    plan = recompute_plan.plan_smallest_peak(costs)
    assert 8 <= len(plan.checkpoints) <= 24, plan.checkpoints
    assert plan.peak <= peaks[3]


def test_held_gradients_count_every_later_gradient():
    costs = _gelu_mlp(8)
    freed = recompute_plan.estimate_peak(costs)
    # At the first layer's backward the 7 later layers' gradients are held.
    assert recompute_plan.estimate_peak(costs, (), held_gradients=True) == freed
    everywhere = _every(1, 8)
    assert (recompute_plan.estimate_peak(costs, everywhere, held_gradients=True)
            > recompute_plan.estimate_peak(costs, everywhere))


def test_a_recomputed_segment_counts_the_copy_of_its_inputs_not_of_its_weights():
    # recompute_grad runs the recomputation on a copy of the segment's
    # inputs (tied to the incoming gradients); its weights, read once in
    # the forward pass, are passed on uncopied (copied, they measured
    # 10 MiB over the plan on a block of six Dense(768)).
    light = [NodeCost(f"h{i}", kept=12, kept_by_consumer=4, boundary=4, output=4,
                      elements=1024) for i in range(12)]
    heavy = [NodeCost(f"h{i}", kept=12, kept_by_consumer=4, boundary=4, output=4,
                      weights=4, elements=1024) for i in range(12)]
    checkpoints = [1, 7]  # recomputed: h0..h1 and h2..h7 (6 layers), then h8..h11
    # At h7's backward: the checkpoint h1's output (4) and its copy (4),
    # h2..h6's activations (5 x 16), h7's own (12) and its output's size (4).
    assert recompute_plan.estimate_peak(light, checkpoints) == 4 + 4 + 5 * 16 + 12 + 4
    # ... and no copies of the segment's six kernels.
    assert (recompute_plan.estimate_peak(heavy, checkpoints)
            == recompute_plan.estimate_peak(light, checkpoints))


def _uniform_chain(n, grads=0.0):
    return [NodeCost(f"h{i}", kept=8, boundary=4, kept_by_consumer=4, flops=1, grads=grads,
                     output=4, elements=1024) for i in range(n)]


def test_smallest_peak_of_a_uniform_chain_checkpoints_about_every_sqrt_n_layers():
    costs = _uniform_chain(36)
    plan = recompute_plan.plan_smallest_peak(costs)
    baseline = recompute_plan.estimate_peak(costs)
    # O(sqrt n) memory: checkpoints and one segment's activations (segments
    # shorten where more checkpoints are kept before them; with the copy
    # of its input each recomputation holds, 13 checkpoints here)
    assert plan.peak < 0.3 * baseline, (plan.peak, baseline)
    assert math.sqrt(36) / 2 <= len(plan.checkpoints) <= 2.5 * math.sqrt(36), plan.checkpoints
    # at most one extra forward pass
    assert plan.extra_flops <= plan.forward_flops


def test_a_budget_buys_the_least_recomputation_that_meets_it():
    costs = _uniform_chain(24)
    baseline = recompute_plan.estimate_peak(costs)
    loose = recompute_plan.plan_for_budget(costs, 0.8 * baseline)
    tight = recompute_plan.plan_for_budget(costs, 0.4 * baseline)
    assert loose.peak <= 0.8 * baseline and tight.peak <= 0.4 * baseline
    assert 0 < loose.extra_flops < tight.extra_flops
    assert recompute_plan.plan_for_budget(costs, baseline).extra_flops == 0


def test_an_unmeetable_budget_says_the_smallest_peak():
    costs = _uniform_chain(12, grads=10)
    smallest = recompute_plan.smallest_peak(costs)
    with pytest.raises(recompute_plan.UnmeetableBudget) as raised:
        recompute_plan.plan_for_budget(costs, 0.99 * smallest)
    assert raised.value.smallest == pytest.approx(smallest)
    assert raised.value.baseline == pytest.approx(recompute_plan.estimate_peak(costs))


def test_nodes_with_forward_state_are_never_in_a_recomputed_segment():
    costs = _uniform_chain(12)
    costs[5] = NodeCost("bn", kept=8, boundary=4, kept_by_consumer=4, flops=1, output=4,
                        elements=1024, fixed=True)
    plan = recompute_plan.plan_smallest_peak(costs)
    assert plan.segments
    assert all(not first <= 5 <= last for first, last in plan.segments), plan.segments


def test_segments_follow_the_executor_last_segment_rule():
    # A recomputed segment followed by nodes smaller than its largest output
    # runs normally when it is the last one (runtime/effects.py: _keep_last_segment).
    costs = _uniform_chain(4)
    costs[3] = NodeCost("head", elements=1)
    assert recompute_plan.segments_of(costs, [2]) == [(0, 2, False, False),
                                                      (3, 3, False, False)]
    costs[3] = NodeCost("head", elements=5000)
    assert recompute_plan.segments_of(costs, [2]) == [(0, 2, True, False), (3, 3, False, False)]


def test_checkpoints_only_where_a_segment_may_end():
    costs = [NodeCost(f"h{i}", kept=8, boundary=4, kept_by_consumer=4, flops=1, output=4,
                      elements=1024, can_checkpoint=i % 3 == 2) for i in range(12)]
    plan = recompute_plan.plan_smallest_peak(costs)
    assert plan.checkpoints and all(i % 3 == 2 for i in plan.checkpoints)


# -- stages ----------------------------------------------------------------------------
def test_stage_partition_minimises_the_largest_stage_like_brute_force():
    rng = random.Random(0)
    for _ in range(1500):
        n = rng.randint(1, 9)
        stages = rng.randint(1, n)
        costs = [rng.choice([0, 1, 2, 3, 7]) for _ in range(n)]
        allowed = {i for i in range(n - 1) if rng.random() < 0.8}
        best = None
        for cuts in itertools.combinations(sorted(allowed), stages - 1):
            bounds = [-1, *cuts, n - 1]
            largest = max(sum(costs[bounds[k] + 1:bounds[k + 1] + 1]) for k in range(stages))
            best = largest if best is None else min(best, largest)
        if best is None:
            with pytest.raises(stage_balance.CannotPartition):
                stage_balance.balanced_partition(costs, stages, allowed)
            continue
        partition = stage_balance.balanced_partition(costs, stages, allowed)
        assert len(partition) == stages and partition[0][0] == 0 and partition[-1][1] == n - 1
        assert all(a[1] + 1 == b[0] for a, b in zip(partition, partition[1:]))
        assert all(first <= last for first, last in partition)
        assert all(last in allowed for _, last in partition[:-1])
        assert max(stage_balance.stage_sums(costs, partition)) == best


def test_among_equal_largest_stages_the_more_even_partition_is_taken():
    # The largest stage is the 10 however the ones are cut; a stage is not
    # left nearly empty: (10, 2, 2), not (10, 1, 3) or (10, 3, 1).
    costs = [10, 1, 1, 1, 1]
    partition = stage_balance.balanced_partition(costs, 3)
    assert stage_balance.stage_sums(costs, partition) == [10, 2, 2]


def test_imbalance_is_largest_over_mean():
    assert stage_balance.imbalance([2, 2, 2]) == 1.0
    assert stage_balance.imbalance([3, 1]) == 1.5


# -- the plan space: keep / inside / checkpoint per node ------------------
def _dense_gelu_chain(n, internal=12, output=4):
    """Layers whose internal tensors (pre-activation, gelu's intermediates)
    are three times their output, as a Dense(gelu) keeps."""
    return [NodeCost(f"h{i}", kept=internal, kept_by_consumer=output, boundary=output,
                     flops=1, output=output, elements=1024) for i in range(n)]


def test_a_segment_may_follow_kept_nodes_which_end_their_run():
    # Light layers, costly to recompute, before heavy ones: under a budget
    # the least recomputation keeps the light layers and recomputes
    # heavy ones only (before, a segment could only start the chain or
    # follow a layer with forward state).
    light = [NodeCost(f"l{i}", kept=1, kept_by_consumer=1, boundary=1, flops=10, output=1,
                      elements=1024) for i in range(6)]
    costs = light + _dense_gelu_chain(6)
    plan = recompute_plan.plan_for_budget(costs, 0.5 * recompute_plan.estimate_peak(costs))
    assert plan.keeps == (5,), plan
    assert all(plan.kind(i) == "keep" for i in range(6))
    # the kept node ends its run: the executor's segments are the plan's
    segments = recompute_plan.segments_of(costs, plan.checkpoints, plan.keeps, plan.nested)
    assert tuple((f, l) for f, l, again, _ in segments if again) == plan.segments
    first_recomputed = min(first for first, _ in plan.segments)
    assert plan.kind(first_recomputed - 1) == "keep"
    # without the keep note, the run before would be folded into the segment
    folded = recompute_plan.segments_of(costs, plan.checkpoints)
    assert any(first < first_recomputed <= last for first, last, again, _ in folded if again)


def test_recomputing_each_layer_inside_itself_is_in_the_plan_space():
    # What RematScope("larger_than") does: every layer alone, outputs kept.
    costs = _dense_gelu_chain(8)
    every = list(range(8))
    plan = recompute_plan.describe_plan(costs, every)
    # (the last runs normally: nothing follows it)
    assert [plan.kind(i) for i in range(8)] == ["inside"] * 7 + ["keep"], plan
    # at most one layer's internals live at once: at the last layer's
    # backward, the 7 outputs before it, its internals and its gradient
    assert plan.peak == 7 * 4 + 12 + 4


def test_a_nested_segment_keeps_only_outputs_and_costs_a_second_recomputation():
    costs = _dense_gelu_chain(12) + [NodeCost("head", elements=5000)]
    plain = recompute_plan.describe_plan(costs, [5, 11])
    nested = recompute_plan.describe_plan(costs, [5, 11], nested=[5, 11])
    # a segment's backward: 5 layers' outputs and internals (16 each)
    # plainly, their outputs (4 each) and one layer's internals nested
    assert plain.peak - nested.peak == 5 * 12 - 4
    assert nested.extra_flops == plain.extra_flops + 12
    assert set(nested.inside) == set(range(12))
    assert nested.kind(3) == "inside" and plain.kind(3) == "checkpoint"


def test_without_a_budget_the_plan_recomputes_at_most_one_forward_pass():
    costs = _dense_gelu_chain(24)
    capped = recompute_plan.plan_smallest_peak(costs)
    free = recompute_plan.plan_smallest_peak(costs, max_extra_forwards=None)
    assert capped.extra_flops <= capped.forward_flops
    # nesting reaches lower, at more recomputation
    assert free.peak < capped.peak and free.extra_flops > capped.forward_flops
    assert free.nested


def test_what_each_node_recomputes_of_its_own_counts_in_every_plan_and_in_the_cap():
    # A split Dense recomputes its activation whatever the plan: the plan's
    # extra compute includes it, and the cap of one extra forward pass
    # leaves that much less for segments.
    import dataclasses

    plain = _dense_gelu_chain(24)
    own = 0.2 * plain[0].flops
    split = [dataclasses.replace(cost, recompute_flops=own) for cost in plain]
    nothing = recompute_plan.describe_plan(split, ())
    assert nothing.extra_flops == pytest.approx(24 * own)
    capped = recompute_plan.plan_smallest_peak(split)
    assert capped.extra_flops <= capped.forward_flops * (1 + 1e-9)
    assert capped.extra_flops >= 24 * own
    # ... which binds: without the nodes' own recomputation the plan's
    # segments spend more than the cap leaves them
    assert recompute_plan.plan_smallest_peak(plain).extra_flops > 24 - 24 * own
