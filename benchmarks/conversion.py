"""Benchmark: convert + expand-all versus Keras's own `clone_model`.

For N custom residual blocks (each: Dense -> LayerNormalization -> Dense,
plus the block's input), in two styles: joined by an `Add` layer, and by
`x + h` (a `keras.ops` call, as people write it), time on an already built
subclassed model

    kip.convert_to_functional(model, x, verify=False)
    kip.apply_passes(converted, [kip.passes.Expand()], verify=False)

against `keras.models.clone_model(functional, clone_function=lambda l: l)` on
the equivalent hand-written functional model (the same replay of a graph over
existing layers that Keras does itself), alternating in the same run (the
machine's load changes both alike). Verification is left out of both: it
runs the model, and is measured by `benchmarks/verification_cost.py`.

It prints, for each style, from the medians of `--repeats` runs (5 by
default: at N = 50 a run takes 0.07-0.2 s, and with medians of 3 the
scaling ratio moved by more than its goal's margin between runs):

- kip / clone at each N; goal <= 1.5 at 200 and 500 blocks;
- kip(500) / kip(50); goal <= 11 (linear: 10 times the blocks);
- one dynamic rebuild / the first conversion of a `PluginModel` with
  `Expand()` (a layer switched on after the first batch, at the largest
  N up to 200); goal <= 1.

What makes that possible: an expanded layer keeps its own name in the
Keras model unless it is taken (API.md; a `LayerAlias` per inlined layer
cost about 1.3x a whole `clone_model` on its own); each kind of block is
traced once and replayed over the others (`frontend/replay.py`), at
conversion (its output shapes) and at expansion (its sub-graph, whatever
its nodes: layers, `keras.ops` calls, TensorFlow functions, reads,
constants, random draws), its signature read from the variables' stored
shapes and dtypes (its own only: sub-layers sign theirs) and kept
constructor configs; the undo
snapshot of the model's state (`frontend/state.py`) keeps its ~150
containers per block in a few flat lists (an object per container made
Python's cyclic collector run a full collection, ~1 s, inside every
convert + Expand of 500 blocks: that was the superlinear part); Expand
finds each node's position from the last one (`Graph._position`; a
search from the start made it quadratic); and rebuilt KerasTensors are
named without Keras's regular expressions.

Measured (2-core machine shared with other jobs, so +-0.2 on a ratio
between runs): before those changes 1.90 at 200 and 3.95 at 500,
time(500)/time(50) 6-27 (the full collection came and went); after, in
six runs, 0.94-1.56 at 200 (1.14-1.53 in the three at load 2-3) and
1.27-1.41 at 500, time(500)/time(50) 6.4-10.9. The rebuild ratio is
0.90-1.03: a rebuild converts the model again and applies the passes
again, the same work as the first conversion (nothing from the earlier
conversion may be reused: the model changed). In CPU time
(`time.process_time`, less noisy) convert + Expand of 200 blocks is about
1.3x clone_model: about 0.09 s of 0.29 s is the trace (Keras's own
`Layer.__call__` of each block), 0.07 s the two undo snapshots, 0.08 s
the two rebuilds (Keras's `Functional` construction included; clone_model
builds one too).

Both styles (`x + h` blocks were not replayed, Expand traced all
of them, 5.2-6.6x clone_model at 200): in two runs at load 6-9 on the 2
cores, Add layer 1.03-1.21 at 200 and 0.95-1.15 at 500, x + h 1.31-1.35
at 200 and 1.35-1.43 at 500 (in CPU time 1.32-1.43 at 500); time(500) /
time(50) 3.4-11.2 and 7.0-11.9, as noisy as clone_model's own (11.4-12.3
in the same runs): at that load the scaling goal is met or missed by the
machine, not the code. The x + h blocks cost more than the Add ones per
block: their `keras.ops` node is a new operation per block.

Usage:
    python benchmarks/conversion.py            # N = 50, 200, 500
    python benchmarks/conversion.py 10 100     # other sizes
    python benchmarks/conversion.py --profile 500
"""

import argparse
import cProfile
import gc
import os
import pstats
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_ipu_plugin as kip  # noqa: E402

WIDTH = 16
SIZES = (50, 200, 500)
RATIO_GOAL = 1.5
SCALING_GOAL = 11.0
REBUILD_GOAL = 1.0


class Block(keras.layers.Layer):
    """Dense -> LayerNormalization -> Dense, plus the input (an `Add` layer)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense_1 = keras.layers.Dense(WIDTH, activation="relu")
        self.norm = keras.layers.LayerNormalization()
        self.dense_2 = keras.layers.Dense(WIDTH)
        self.add = keras.layers.Add()

    def call(self, x):
        return self.add([x, self.dense_2(self.norm(self.dense_1(x)))])


class OpsBlock(keras.layers.Layer):
    """The same block as people write it: the residual joined by `x + h`
    (a `keras.ops` call, recorded as an operation node, not a layer)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense_1 = keras.layers.Dense(WIDTH, activation="relu")
        self.norm = keras.layers.LayerNormalization()
        self.dense_2 = keras.layers.Dense(WIDTH)

    def call(self, x):
        return x + self.dense_2(self.norm(self.dense_1(x)))


#: The block styles measured: {name: (block class, its functional join)}.
STYLES = {
    "Add layer": (Block, lambda x, h: keras.layers.Add()([x, h])),
    "x + h": (OpsBlock, lambda x, h: x + h),
}


class Stack(keras.Model):
    def __init__(self, n, block=Block, **kwargs):
        super().__init__(**kwargs)
        self.blocks = [block(name=f"block_{i}") for i in range(n)]

    def call(self, x):
        for block in self.blocks:
            x = block(x)
        return x


class GrowingStack(Stack):
    """A `Stack` whose `extra` layer is switched on after the first batch:
    its variables are new to the converted model, which a dynamic rebuild
    takes in. (A layer assigned to a model already built is refused by
    Keras, so it exists, unbuilt, from the start.)"""

    def __init__(self, n, **kwargs):
        super().__init__(n, **kwargs)
        self.extra = keras.layers.Dense(WIDTH, name="extra")
        self.grown = False

    def build(self, input_shape):
        # The blocks build at their first call; `extra` stays unbuilt until
        # it is switched on (Keras's default `build` would warn about it).
        pass

    def call(self, x):
        x = super().call(x)
        return x + self.extra(x) if self.grown else x


def functional_stack(n, join=STYLES["Add layer"][1]):
    """The same network written as a functional model."""
    inputs = keras.Input((WIDTH,))
    x = inputs
    for _ in range(n):
        h = keras.layers.Dense(WIDTH, activation="relu")(x)
        h = keras.layers.LayerNormalization()(h)
        h = keras.layers.Dense(WIDTH)(h)
        x = join(x, h)
    return keras.Model(inputs, x)


def timed(fn):
    gc.collect()
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def kip_convert_and_expand(model, x):
    converted = kip.convert_to_functional(model, x, verify=False)
    return kip.apply_passes(converted, [kip.passes.Expand()], verify=False)


def measure(n, repeats, style="Add layer"):
    """Median seconds over `repeats` alternating runs of one block `style`:
    (kip total, its convert, its expand, clone)."""
    block, join = STYLES[style]
    x = np.random.RandomState(0).normal(size=(4, WIDTH)).astype("float32")
    model = Stack(n, block=block, name=f"stack_{n}")
    model(x)  # built
    functional = functional_stack(n, join)
    functional(x)
    kip_times, clone_times = [], []
    for _ in range(repeats):
        convert_time, converted = timed(
            lambda: kip.convert_to_functional(model, x, verify=False))
        expand_time, passed = timed(
            lambda: kip.apply_passes(converted, [kip.passes.Expand()], verify=False))
        kip_times.append((convert_time + expand_time, convert_time, expand_time))
        clone_time, _ = timed(
            lambda: keras.models.clone_model(functional, clone_function=lambda layer: layer))
        clone_times.append(clone_time)
    # A sanity check outside the timed region: the result is the full graph.
    assert len([n_ for n_ in passed.kip_graph.nodes if n_.is_layer]) == (
        4 if block is Block else 3) * n
    np.testing.assert_allclose(np.asarray(passed(x)), np.asarray(model(x)), atol=1e-5)
    kip_time = statistics.median(t[0] for t in kip_times)
    convert_time, expand_time = next(t[1:] for t in kip_times if t[0] == kip_time)
    return kip_time, convert_time, expand_time, statistics.median(clone_times)


def rebuild_ratio(n, repeats):
    """Median of (one dynamic rebuild / the first conversion) of a
    `PluginModel(Stack(n), passes=[Expand()])`: a layer added after the
    first batch brings new variables."""
    ratios = []
    x = np.random.RandomState(0).normal(size=(4, WIDTH)).astype("float32")
    for _ in range(repeats):
        model = GrowingStack(n)
        model(x)
        plugin = kip.PluginModel(model, passes=[kip.passes.Expand()], verify=False)
        convert_time, _ = timed(lambda: plugin.convert(x))
        model.grown = True
        model.extra(x)  # the new variables exist, as a step would make them
        rebuild_time, _ = timed(lambda: plugin._kip_session.rebuild("benchmark"))
        ratios.append(rebuild_time / convert_time)
    return statistics.median(ratios)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sizes", nargs="*", type=int, default=list(SIZES))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--style", choices=list(STYLES), action="append",
                        help="the block styles to measure (default: all)")
    parser.add_argument("--profile", action="store_true",
                        help="cProfile the kip side at the largest N")
    parser.add_argument("--no-rebuild", action="store_true",
                        help="leave out the dynamic rebuild measurement")
    args = parser.parse_args()
    styles = args.style or list(STYLES)

    if args.profile:
        n = max(args.sizes)
        x = np.zeros((4, WIDTH), "float32")
        model = Stack(n, block=STYLES[styles[0]][0])
        model(x)
        kip_convert_and_expand(model, x)  # warm
        profiler = cProfile.Profile()
        profiler.runcall(kip_convert_and_expand, model, x)
        pstats.Stats(profiler).sort_stats("cumulative").print_stats(40)
        return

    measure(5, 1)  # warm up TensorFlow / Keras
    measure(5, 1, "x + h")
    verdicts = []
    for style in styles:
        rows = {}
        print(f"\nblocks joined by {style}")
        print(f"{'N':>6} {'kip s':>9} {'clone s':>9} {'ratio':>7}   "
              f"{'(convert s':>10} {'expand s)':>10}")
        for n in args.sizes:
            kip_time, convert_time, expand_time, clone_time = measure(n, args.repeats, style)
            rows[n] = (kip_time, clone_time)
            print(f"{n:>6} {kip_time:9.3f} {clone_time:9.3f} {kip_time / clone_time:7.2f}   "
                  f"{convert_time:10.3f} {expand_time:10.3f}", flush=True)
        ratios = {n: k / c for n, (k, c) in rows.items()}
        judged = {n: r for n, r in ratios.items() if n >= 200} or ratios
        met = all(r <= RATIO_GOAL for r in judged.values())
        verdicts.append(met)
        print(f"{style}: kip / clone: "
              f"{', '.join(f'{r:.2f} at N={n}' for n, r in ratios.items())}; "
              f"goal <= {RATIO_GOAL} at N >= 200: {'met' if met else 'NOT met'}")
        if 50 in rows and 500 in rows:
            scaling = rows[500][0] / rows[50][0]
            verdicts.append(scaling <= SCALING_GOAL)
            print(f"{style}: time(500) / time(50): {scaling:.1f}; goal <= {SCALING_GOAL:g}: "
                  f"{'met' if scaling <= SCALING_GOAL else 'NOT met'}")
    if not args.no_rebuild:
        n = max([size for size in args.sizes if size <= 200] or [min(args.sizes)])
        ratio = rebuild_ratio(n, args.repeats)
        verdicts.append(ratio <= REBUILD_GOAL)
        print(f"\ndynamic rebuild / first conversion (N={n}): {ratio:.2f}; "
              f"goal <= {REBUILD_GOAL:g}: {'met' if ratio <= REBUILD_GOAL else 'NOT met'}")
    print(f"\nall goals: {'met' if all(verdicts) else 'NOT met'}")


if __name__ == "__main__":
    main()
