"""Benchmark: steps per second of `fit` through the plugin versus plain Keras.

For two subclassed models built from custom layers,

- `mlp`: a small MLP (per-step framework overhead shows most), and
- `cnn`: a mid-size CNN on 32x32x3 images (Conv2D / BatchNormalization blocks
  as custom layers),

three variants are trained with `fit` in graph mode (`verbose=0`):

- `plain`:    the subclassed model itself,
- `model`:    `kip.PluginModel(model, passes=[kip.passes.Expand()])`,
- `callback`: the subclassed model with
              `callbacks=[kip.PluginCallback(passes=[kip.passes.Expand()])]`.

How it is timed, and why. Every round builds fresh models of all variants
(same seed) and warms each up with one `fit` epoch of STEPS batches of a
finite tf.data dataset (tracing; for the plugin variants, the conversion at
the first batch). Then it times the function `fit` calls once per step, the
model's `train_function`, for STEPS steps of each variant, the variants
taking turns step by step (the order rotating each step), with Python's
garbage collector paused. Per round this gives each variant's seconds per
step; the ratio printed is the median over rounds of the per-round ratios.

Two things made simpler designs unable to tell 3% apart on a shared 2-core
machine: timing whole epochs per variant in turn, the wall clock of one
200-step epoch swings by tens of percent between rounds; and one model
instance can run its (identical) compiled step several percent faster or
slower than another for the life of the process (an A/A pair of plain models
built once differed by up to 9% over every round). Step-by-step turns cancel
the first, fresh models every round randomise the second. What `fit` does
around `train_function` (callbacks, progress) is the same Keras code for
every variant, so it is left out of the timed region.

Two controls say how to read the ratios: `plain (copy)` is a second plain
model in the same rounds (its ratio to `plain` is this run's noise floor),
and the plugin's own per-step cost is timed directly: the PluginModel train
function is called with Keras's compiled step replaced by a stub, so only the
plugin's Python runs. The compiled steps themselves are the same graph (same
ops, same captured variables) for all variants.

Goal: PluginModel/plain >= 0.97 and PluginCallback/plain >= 0.97 (steps/s)
for both models. The goals are printed, not asserted.

Usage:
    python benchmarks/overhead.py                   # both models
    python benchmarks/overhead.py mlp --rounds 7 --steps 300
    python benchmarks/overhead.py --threads 1       # one TF thread
    python benchmarks/overhead.py --profile mlp:model  # cProfile one timed epoch
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
import tensorflow as tf  # noqa: E402

import keras_ipu_plugin as kip  # noqa: E402

GOAL = 0.97
VARIANTS = ("plain", "model", "callback", "plain_copy")
LABELS = {"plain": "plain", "model": "PluginModel", "callback": "PluginCallback",
          "plain_copy": "plain (copy)"}


# -- models --------------------------------------------------------------------
class DenseBlock(keras.layers.Layer):
    """Dense -> Dense with a residual connection."""

    def __init__(self, width, **kwargs):
        super().__init__(**kwargs)
        self.dense_1 = keras.layers.Dense(width, activation="relu")
        self.dense_2 = keras.layers.Dense(width)

    def call(self, x):
        return x + self.dense_2(self.dense_1(x))


class SmallMLP(keras.Model):
    def __init__(self, width=32, blocks=2, classes=10, **kwargs):
        super().__init__(**kwargs)
        self.stem = keras.layers.Dense(width, activation="relu")
        self.blocks = [DenseBlock(width, name=f"block_{i}") for i in range(blocks)]
        self.head = keras.layers.Dense(classes)

    def call(self, x, training=None):
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class ConvBlock(keras.layers.Layer):
    """Conv2D -> BatchNormalization -> ReLU, twice, then 2x2 max pooling."""

    def __init__(self, filters, **kwargs):
        super().__init__(**kwargs)
        self.conv_1 = keras.layers.Conv2D(filters, 3, padding="same", use_bias=False)
        self.norm_1 = keras.layers.BatchNormalization()
        self.conv_2 = keras.layers.Conv2D(filters, 3, padding="same", use_bias=False)
        self.norm_2 = keras.layers.BatchNormalization()
        self.pool = keras.layers.MaxPooling2D()

    def call(self, x, training=None):
        x = keras.activations.relu(self.norm_1(self.conv_1(x), training=training))
        x = keras.activations.relu(self.norm_2(self.conv_2(x), training=training))
        return self.pool(x)


class SmallCNN(keras.Model):
    def __init__(self, filters=(16, 32, 64), classes=10, **kwargs):
        super().__init__(**kwargs)
        self.blocks = [ConvBlock(f, name=f"conv_block_{i}") for i, f in enumerate(filters)]
        self.pool = keras.layers.GlobalAveragePooling2D()
        self.head = keras.layers.Dense(classes)

    def call(self, x, training=None):
        for block in self.blocks:
            x = block(x, training=training)
        return self.head(self.pool(x))


SPECS = {
    # name: (model class, input shape, batch size)
    "mlp": (SmallMLP, (32,), 32),
    "cnn": (SmallCNN, (32, 32, 3), 16),
}
# Default rounds: fresh models each round randomise a model instance's own
# speed; an MLP round is cheap, so it gets more.
ROUNDS = {"mlp": 11, "cnn": 7}


def make_dataset(name, steps):
    """A finite dataset of exactly `steps` batches: every epoch makes a new
    iterator, as with arrays, so per-epoch costs count in the timed epoch."""
    _, shape, batch = SPECS[name]
    rng = np.random.RandomState(0)
    n = batch * steps
    x = rng.normal(size=(n,) + shape).astype("float32")
    y = rng.randint(0, 10, size=(n,)).astype("int32")
    return (
        tf.data.Dataset.from_tensor_slices((x, y))
        .batch(batch, drop_remainder=True)
        .cache()
        .prefetch(tf.data.AUTOTUNE)
    )


def make_variant(name, variant):
    """A freshly built, compiled model and the callbacks `fit` gets."""
    keras.utils.set_random_seed(0)
    cls, shape, batch = SPECS[name]
    model = cls(name=f"{name}_{variant}")  # plain_copy: a second plain model
    model(np.zeros((batch,) + shape, "float32"))  # built
    callbacks = []
    if variant == "model":
        model = kip.PluginModel(model, passes=[kip.passes.Expand()])
    elif variant == "callback":
        callbacks.append(kip.PluginCallback(passes=[kip.passes.Expand()]))
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model, callbacks


# -- timing --------------------------------------------------------------------
class EpochTimer(keras.callbacks.Callback):
    """Wall time of each epoch (epoch hooks only: no per-step cost)."""

    def __init__(self, profile_epoch=None):
        super().__init__()
        self.times = []
        self.profile_epoch = profile_epoch
        self.profiler = None

    def on_epoch_begin(self, epoch, logs=None):
        gc.collect()
        if epoch == self.profile_epoch:
            self.profiler = cProfile.Profile()
            self.profiler.enable()
        self._start = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        self.times.append(time.perf_counter() - self._start)
        if epoch == self.profile_epoch:
            self.profiler.disable()


def measure(name, rounds, steps):
    """Per round and variant, seconds per step of `train_function` (see the
    module docstring); and the plugin's own Python seconds per step."""
    dataset = make_dataset(name, steps)
    results = {v: [] for v in VARIANTS}
    for r in range(rounds):
        order = VARIANTS[r % len(VARIANTS):] + VARIANTS[:r % len(VARIANTS)]
        built = {v: make_variant(name, v) for v in order}
        functions, iterators, warmups = {}, {}, {}
        for variant in order:
            model, callbacks = built[variant]
            warmups[variant], _ = timed_epochs(model, callbacks, dataset, epochs=1)
            functions[variant] = model.train_function
            iterators[variant] = iter(dataset.repeat())
            functions[variant](iterators[variant])  # the new iterator's first step
        # Outside the timed region: the plugin variants train through a
        # converted graph.
        assert built["model"][0].converted is not None
        assert built["callback"][1][0].converted is not None
        seconds = dict.fromkeys(order, 0.0)
        gc.collect()
        gc.disable()
        try:
            for step in range(steps):
                k = step % len(order)
                for variant in order[k:] + order[:k]:
                    start = time.perf_counter()
                    functions[variant](iterators[variant])
                    seconds[variant] += time.perf_counter() - start
        finally:
            gc.enable()
        for variant in order:
            results[variant].append({"step_s": seconds[variant] / steps,
                                     "warmup": warmups[variant][0]})
    return results, own_cost_per_step(built["model"][0], steps)


def timed_epochs(model, callbacks, dataset, epochs, profile=False):
    """`fit` for `epochs`: the seconds of each epoch, and the profiler of
    the last one when `profile`."""
    timer = EpochTimer(profile_epoch=epochs - 1 if profile else None)
    model.fit(dataset, epochs=epochs, verbose=0, shuffle=False,
              callbacks=callbacks + [timer])
    return timer.times, timer.profiler


def print_table(name, results, steps):
    rounds = len(results["plain"])

    def paired(variant):
        """Per-round steps/s ratios variant/plain."""
        return [p["step_s"] / v["step_s"] for p, v in zip(results["plain"], results[variant])]

    print(f"\n{name}: {steps} steps per variant and round, taking turns step by step; "
          f"{rounds} rounds of fresh models")
    print(f"{'variant':<16} {'steps/s':>8} {'ms/step':>8} {'ratio to plain':>15} "
          f"{'(min':>6} {'max)':>6} {'warm-up s':>10}")
    ratios = {}
    for v in VARIANTS:
        step_s = statistics.median(r["step_s"] for r in results[v])
        ratio = statistics.median(paired(v))
        ratios[v] = ratio
        print(f"{LABELS[v]:<16} {1 / step_s:8.1f} {1000 * step_s:8.3f} {ratio:15.3f} "
              f"{min(paired(v)):6.3f} {max(paired(v)):6.3f} "
              f"{statistics.median(r['warmup'] for r in results[v]):10.2f}")
    for v in ("model", "callback"):
        status = "met" if ratios[v] >= GOAL else "NOT met"
        print(f"  {LABELS[v]}/plain = {ratios[v]:.3f} (median of per-round steps/s ratios; "
              f"goal >= {GOAL}: {status})")
    print(f"  noise floor: plain (copy)/plain = {ratios['plain_copy']:.3f} (the same model "
          "twice; a plugin ratio this far from 1 is not the plugin)")
    return {v: ratios[v] for v in ("model", "callback")}


def own_cost_per_step(model, steps, repeats=5):
    """Seconds per step the plugin's train function spends outside Keras's
    compiled step: measured with the compiled step replaced by a stub, so
    only the plugin's Python runs (median of `repeats` runs of `steps`)."""
    step_function = model.train_function
    compiled, iterator = step_function.function, step_function._iterator
    logs = {"loss": 0.0}
    step_function.function = lambda source: logs
    try:
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            for _ in range(steps):
                step_function(iterator)
            times.append((time.perf_counter() - start) / steps)
    finally:
        step_function.function = compiled
    return statistics.median(times)


def profile(name, variant, steps):
    dataset = make_dataset(name, steps)
    model, callbacks = make_variant(name, variant)
    times, profiler = timed_epochs(model, callbacks, dataset, epochs=2, profile=True)
    print(f"{name}/{LABELS[variant]}: {steps / times[1]:.1f} steps/s under the profiler")
    stats = pstats.Stats(profiler).sort_stats("cumulative")
    stats.print_stats(35)
    stats.sort_stats("tottime").print_stats(20)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", metavar="MODEL",
                        help=f"models to run ({', '.join(SPECS)}; default all)")
    parser.add_argument("--rounds", type=int, default=None,
                        help=f"rounds per model (default {ROUNDS})")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--threads", type=int, default=0,
                        help="TensorFlow intra-/inter-op threads (0: TensorFlow's "
                             "default)")
    parser.add_argument("--profile", metavar="MODEL:VARIANT",
                        help=f"cProfile one timed epoch, e.g. mlp:model "
                             f"(variants: {', '.join(VARIANTS)})")
    args = parser.parse_args()
    unknown = [m for m in args.models if m not in SPECS]
    if unknown:
        parser.error(f"unknown model(s) {unknown}; choose from {list(SPECS)}")
    args.models = args.models or list(SPECS)
    if args.threads:
        tf.config.threading.set_intra_op_parallelism_threads(args.threads)
        tf.config.threading.set_inter_op_parallelism_threads(args.threads)

    if args.profile:
        name, variant = args.profile.split(":")
        profile(name, variant, args.steps)
        return

    start = time.perf_counter()
    load_before = os.getloadavg()[0]
    all_ratios = {}
    for name in args.models:
        results, own_cost = measure(name, args.rounds or ROUNDS[name], args.steps)
        all_ratios[name] = print_table(name, results, args.steps)
        plain_step = statistics.median(r["step_s"] for r in results["plain"])
        print(f"  plugin's own Python per step (outside the compiled step, which is the "
              f"same graph): {1e6 * own_cost:.1f} us = {100 * own_cost / plain_step:.2f}% of a "
              f"plain step -> ratio bound {plain_step / (plain_step + own_cost):.3f}")
    print(f"\nsummary (goal: steps/s ratio >= {GOAL}):")
    for name, ratios in all_ratios.items():
        cells = "   ".join(
            f"{LABELS[v]}/plain {r:.3f} ({'met' if r >= GOAL else 'NOT met'})"
            for v, r in ratios.items()
        )
        print(f"  {name}: {cells}")
    met = all(r >= GOAL for ratios in all_ratios.values() for r in ratios.values())
    print(f"all goals met: {'yes' if met else 'no'}   (total {time.perf_counter() - start:.0f} s; "
          f"load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after, "
          f"on {os.cpu_count()} CPUs)")


if __name__ == "__main__":
    main()
