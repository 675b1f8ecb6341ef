"""Peak memory and step time of `fit` with and without `Recompute`.

A 48-layer, 1024-wide GELU MLP, batch 1024, each variant in its own process
(peak RSS is per process): `baseline` (no checkpoints), `recompute` (the
plugin's Recompute every 6 layers) and `hand-written` (the same segments
written by hand with `tf.recompute_grad`, the reference the goal was set
against). After a traced warm-up step, each process times STEPS single
steps and reports their median; the variants alternate over ROUNDS rounds
and the median over rounds is printed, because one step's wall clock on a
shared 2-core machine swings by tens of percent. Prints the peak RSS of
each, the growth over the RSS before `fit` (what activations add), and the
ratios. Goal: peak memory <= 0.65 of the baseline, step time <= 1.3x.

    python benchmarks/recompute_memory.py
"""

import json
import os
import subprocess
import sys
import time

DEPTH, WIDTH, BATCH, STEPS, EVERY, ROUNDS = 48, 1024, 1024, 5, 6, 2
VARIANTS = ("baseline", "recompute", "hand-written")


def child(variant):
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
    import resource

    import statistics

    import keras
    import numpy as np
    import tensorflow as tf

    import keras_ipu_plugin as kip

    class DeepMLP(keras.Model):
        def __init__(self):
            super().__init__()
            self.hidden = [keras.layers.Dense(WIDTH, activation="gelu", name=f"h{i}")
                           for i in range(DEPTH)]
            self.head = keras.layers.Dense(1)

        def call(self, x):
            for layer in self.hidden:
                x = layer(x)
            return self.head(x)

    class HandCheckpointedMLP(DeepMLP):
        def call(self, x):
            for start in range(0, DEPTH, EVERY):
                def segment(x, layers=self.hidden[start:start + EVERY]):
                    for layer in layers:
                        x = layer(x)
                    return x

                x = tf.recompute_grad(segment)(x)
            return self.head(x)

    class StepTimes(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.times = []

        def on_train_batch_begin(self, batch, logs=None):
            self.start = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            self.times.append(time.perf_counter() - self.start)

    keras.utils.set_random_seed(0)
    x = np.random.rand(BATCH * STEPS, WIDTH).astype("float32")
    y = np.random.rand(BATCH * STEPS, 1).astype("float32")
    if variant == "hand-written":
        model = HandCheckpointedMLP()
    else:
        model = kip.convert_to_functional(DeepMLP(), x[:BATCH], verify=False)
        if variant == "recompute":
            targets = [f"h{i}" for i in range(EVERY - 1, DEPTH, EVERY)]
            model = kip.apply_passes(model, [kip.passes.Recompute(targets)])
    model.compile(optimizer="sgd", loss="mse")
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    model.fit(x[:BATCH], y[:BATCH], batch_size=BATCH, epochs=1, verbose=0)  # trace
    times = StepTimes()
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, callbacks=[times])
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"peak_kb": peak, "before_kb": rss_before,
                      "step_s": statistics.median(times.times)}))


def run(variant):
    out = subprocess.run(
        [sys.executable, __file__, "--child", variant],
        check=True, capture_output=True, text=True,
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def main():
    import statistics

    runs = {variant: [] for variant in VARIANTS}
    for _ in range(ROUNDS):
        for variant in VARIANTS:
            runs[variant].append(run(variant))
    result = {
        variant: {
            "peak_kb": max(r["peak_kb"] for r in rs),
            "before_kb": min(r["before_kb"] for r in rs),
            "step_s": statistics.median(r["step_s"] for r in rs),
        }
        for variant, rs in runs.items()
    }
    base = result["baseline"]
    growth = lambda r: r["peak_kb"] - r["before_kb"]  # noqa: E731
    print(f"{'variant':<14}{'peak RSS MiB':>14}{'growth MiB':>12}{'step s':>10}")
    for name, r in result.items():
        print(f"{name:<14}{r['peak_kb'] / 1024:>14.0f}{growth(r) / 1024:>12.0f}{r['step_s']:>10.3f}")
    for name in ("recompute", "hand-written"):
        r = result[name]
        memory_ratio = r["peak_kb"] / base["peak_kb"]
        time_ratio = r["step_s"] / base["step_s"]
        goal = name == "recompute"
        print(f"{name}: peak memory ratio {memory_ratio:.2f}"
              + (f" (goal <= 0.65: {'met' if memory_ratio <= 0.65 else 'NOT met'})" if goal else "")
              + f", activation growth ratio {growth(r) / max(growth(base), 1):.2f}"
              + f", step time ratio {time_ratio:.2f}"
              + (f" (goal <= 1.3: {'met' if time_ratio <= 1.3 else 'NOT met'})" if goal else ""))


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        child(sys.argv[2])
    else:
        main()
