"""Peak memory and step time of `fit` with and without `Recompute`.

A 48-layer, 1024-wide GELU MLP, batch 1024, 3 `fit` steps, each variant in
its own process (peak RSS is per process). Prints the peak RSS of each, the
growth over the RSS before `fit` (what activations add), and the ratios.
Goal: peak memory <= 0.65 of the baseline, step time <= 1.3x.

    python benchmarks/recompute_memory.py
"""

import json
import os
import subprocess
import sys
import time

DEPTH, WIDTH, BATCH, STEPS, EVERY = 48, 1024, 1024, 3, 6


def child(recompute):
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
    import resource

    import keras
    import numpy as np

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

    keras.utils.set_random_seed(0)
    x = np.random.rand(BATCH * STEPS, WIDTH).astype("float32")
    y = np.random.rand(BATCH * STEPS, 1).astype("float32")
    model = DeepMLP()
    converted = kip.convert_to_functional(model, x[:BATCH], verify=False)
    if recompute:
        targets = [f"h{i}" for i in range(EVERY - 1, DEPTH, EVERY)]
        converted = kip.apply_passes(converted, [kip.passes.Recompute(targets)])
    converted.compile(optimizer="sgd", loss="mse")
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    converted.fit(x[:BATCH], y[:BATCH], batch_size=BATCH, epochs=1, verbose=0)  # trace
    start = time.perf_counter()
    converted.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    step_time = (time.perf_counter() - start) / STEPS
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"peak_kb": peak, "before_kb": rss_before, "step_s": step_time}))


def run(recompute):
    out = subprocess.run(
        [sys.executable, __file__, "--child", "1" if recompute else "0"],
        check=True, capture_output=True, text=True,
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def main():
    base, reco = run(False), run(True)
    growth = lambda r: r["peak_kb"] - r["before_kb"]  # noqa: E731
    print(f"{'variant':<12}{'peak RSS MiB':>14}{'growth MiB':>12}{'step s':>10}")
    for name, r in (("baseline", base), ("recompute", reco)):
        print(f"{name:<12}{r['peak_kb'] / 1024:>14.0f}{growth(r) / 1024:>12.0f}{r['step_s']:>10.3f}")
    memory_ratio = reco["peak_kb"] / base["peak_kb"]
    growth_ratio = growth(reco) / max(growth(base), 1)
    time_ratio = reco["step_s"] / base["step_s"]
    print(f"peak memory ratio: {memory_ratio:.2f} (goal <= 0.65: {'met' if memory_ratio <= 0.65 else 'NOT met'})")
    print(f"activation growth ratio: {growth_ratio:.2f}")
    print(f"step time ratio: {time_ratio:.2f} (goal <= 1.3: {'met' if time_ratio <= 1.3 else 'NOT met'})")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        child(sys.argv[2] == "1")
    else:
        main()
