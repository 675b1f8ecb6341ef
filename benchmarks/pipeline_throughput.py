"""Throughput, overlap and peak memory of pipelined training (issue 25).

Two stages on two devices, `PipelineStages(stages, microbatches=M,
devices=[...], schedule=...)` through `PluginModel.fit`, for M = 1, 2, 4, 8
and both schedules ("gpipe", "1f1b"):

- `mlp`: 8 GELU Dense layers of 1024 and a head, batch 256, 4 layers a stage;
- `transformer`: the gallery's text transformer (`examples/text_transformer.py`)
  with 4 blocks of width 128, 64 tokens, batch 32; the embedding and 2
  blocks in stage 0, 2 blocks and the head in stage 1.

Devices: by default two logical CPU devices, TensorFlow's intra-op pool at one
thread and its inter-op pool at two, so each stage's op runs on one thread
and the two stages' ops can run at once: a proxy for two accelerators, not
two accelerators (they share the memory, the caches and, here, a machine
other people's jobs load too). With `--gpu` the stages go to two GPUs (two
logical GPUs on one where there is only one).

Each configuration runs in its own process (peak memory is per process):
`fit` traces and warms up on one batch, then the allocator's peak is reset
and STEPS steps are timed (median). Memory is TensorFlow's BFC allocator
(`TF_CPU_ALLOCATOR_USE_BFC=true` on the CPU, as benchmarks/recompute_memory.py
does): the step peak is what the steps added over what it held before them
(weights, optimizer state, data).

Printed per configuration: the step time, the throughput against M = 1 (the
same stages, run one after the other), the measured bubble, 1 - T(1) / (S *
T(M)) (the fraction of the S devices' time idle, taking M = 1's step as the
work), against GPipe's bound (S - 1) / (M + S - 1), and the step peak.
Goals (issue 25): M = 4 at least 1.3x the throughput of M = 1; the 1F1B
peak below GPipe's at M = 8.

    python benchmarks/pipeline_throughput.py                  # both models
    python benchmarks/pipeline_throughput.py mlp --steps 4 --rounds 2
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

STEPS, ROUNDS = 5, 1
COUNTS = (1, 2, 4, 8)
SCHEDULES = ("gpipe", "1f1b")
CHILD_ENV = {"TF_CPU_ALLOCATOR_USE_BFC": "true", "TF_CPP_MIN_LOG_LEVEL": "3"}
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
WIDTH, DEPTH, MLP_BATCH = 1024, 8, 256
TEXT = dict(vocab=1000, length=64, dim=128, heads=4, classes=2, blocks=4)
TEXT_BATCH = 32
STAGE_COUNT = 2


def child(model_name, count, schedule, steps, gpu):
    import tensorflow as tf

    if gpu:
        devices = _gpu_devices(tf)
    else:
        cpus = tf.config.list_physical_devices("CPU")
        tf.config.set_logical_device_configuration(
            cpus[0], [tf.config.LogicalDeviceConfiguration()] * 2)
        tf.config.threading.set_intra_op_parallelism_threads(1)
        tf.config.threading.set_inter_op_parallelism_threads(2)
        devices = ["/CPU:0", "/CPU:1"]
    import keras
    import numpy as np

    import keras_ipu_plugin as kip

    keras.utils.set_random_seed(0)
    build, stages, x, y, loss = _setup(model_name, keras, np)
    passes = [kip.passes.PipelineStages(stages, microbatches=count, devices=devices,
                                        schedule=schedule)]
    model = kip.PluginModel(build(), passes=passes, verify=False)
    model.compile(optimizer="adam", loss=loss)
    batch = len(x) // steps
    model.fit(x[:batch], y[:batch], batch_size=batch, epochs=2, verbose=0)  # trace, warm up
    memory_device = devices[0].lstrip("/")
    held = tf.config.experimental.get_memory_info(memory_device)["current"]
    tf.config.experimental.reset_memory_stats(memory_device)
    times = _step_times(keras)
    model.fit(x, y, batch_size=batch, epochs=1, verbose=0, callbacks=[times])
    peak = tf.config.experimental.get_memory_info(memory_device)["peak"] - held
    print(json.dumps({"step_s": statistics.median(times.times), "step_peak": peak,
                      "devices": devices, "memory_device": memory_device}))


def _gpu_devices(tf):
    gpus = tf.config.list_physical_devices("GPU")
    if not gpus:
        raise SystemExit("--gpu: no GPU visible")
    if len(gpus) == 1:  # two logical GPUs on the one there is
        tf.config.set_logical_device_configuration(
            gpus[0], [tf.config.LogicalDeviceConfiguration(memory_limit=8192)] * 2)
    return ["/GPU:0", "/GPU:1"]


def _setup(model_name, keras, np):
    rng = np.random.default_rng(0)
    if model_name == "mlp":
        class DeepMLP(keras.Model):
            def __init__(self):
                super().__init__()
                self.hidden = [keras.layers.Dense(WIDTH, activation="gelu", name=f"h{i}")
                               for i in range(DEPTH)]
                self.head = keras.layers.Dense(1, name="head")

            def call(self, x):
                for layer in self.hidden:
                    x = layer(x)
                return self.head(x)

        half = DEPTH // 2
        stages = [[f"hidden.{i}" for i in range(half)],
                  [f"hidden.{i}" for i in range(half, DEPTH)] + ["head"]]
        x = rng.random((MLP_BATCH * STEPS_RUN[0], WIDTH), dtype=np.float32)
        y = rng.random((MLP_BATCH * STEPS_RUN[0], 1), dtype=np.float32)
        return DeepMLP, stages, x, y, "mse"
    sys.path.insert(0, str(EXAMPLES))
    import text_transformer

    half = TEXT["blocks"] // 2
    stages = [["embedding"] + [f"blocks.{i}" for i in range(half)],
              [f"blocks.{i}" for i in range(half, TEXT["blocks"])] + ["pool", "head"]]
    x = rng.integers(1, TEXT["vocab"], size=(TEXT_BATCH * STEPS_RUN[0], TEXT["length"]))
    y = rng.integers(0, 2, size=(TEXT_BATCH * STEPS_RUN[0],))
    return (lambda: text_transformer.TextClassifier(**TEXT), stages, x.astype("int32"),
            y.astype("int32"), keras.losses.SparseCategoricalCrossentropy(from_logits=True))


STEPS_RUN = [STEPS]


def _step_times(keras):
    class Times(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.times = []

        def on_train_batch_begin(self, batch, logs=None):
            self.start = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            self.times.append(time.perf_counter() - self.start)

    return Times()


# -- the parent ----------------------------------------------------------------------
def run(model_name, count, schedule, steps, gpu):
    command = [sys.executable, __file__, "--child", model_name, str(count), schedule,
               "--steps", str(steps)] + (["--gpu"] if gpu else [])
    done = subprocess.run(command, capture_output=True, text=True,
                          env={**os.environ, **CHILD_ENV})
    if done.returncode != 0:
        raise RuntimeError(f"child {model_name} M={count} {schedule} failed:\n"
                           f"{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def report(model_name, results, gpu):
    mib = 2 ** 20
    base = results[(1, "gpipe")]
    where = ("two GPUs" if gpu else
             "two logical CPU devices, one intra-op thread each (a proxy for two "
             "accelerators, not two accelerators)")
    print(f"\n== {model_name}: {STAGE_COUNT} stages on {where} ==")
    print(f"(step peak: TensorFlow's BFC allocator on {base['memory_device']}, over what it "
          "held before the timed steps; the logical CPU devices share one allocator)")
    print(f"{'schedule':<9}{'M':>3}{'step s':>9}{'x M=1':>8}{'ideal x':>9}"
          f"{'bubble':>8}{'GPipe bound':>13}{'step peak MiB':>15}")
    for (count, schedule), r in sorted(results.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        if count == 1 and schedule != "gpipe":
            continue  # one order for one microbatch
        speedup = base["step_s"] / r["step_s"]
        ideal = STAGE_COUNT * count / (count + STAGE_COUNT - 1)
        bubble = 1 - base["step_s"] / (STAGE_COUNT * r["step_s"])
        bound = (STAGE_COUNT - 1) / (count + STAGE_COUNT - 1)
        label = "both" if count == 1 else schedule
        print(f"{label:<9}{count:>3}{r['step_s']:>9.3f}{speedup:>8.2f}{ideal:>9.2f}"
              f"{bubble:>8.2f}{bound:>13.2f}{r['step_peak'] / mib:>15.1f}")
    for schedule in SCHEDULES:
        four = results.get((4, schedule))
        if four:
            speedup = base["step_s"] / four["step_s"]
            print(f"goal {schedule} M=4 >= 1.3x the throughput of M=1: {speedup:.2f} "
                  f"({'met' if speedup >= 1.3 else 'NOT met'})")
    gpipe, one = results.get((8, "gpipe")), results.get((8, "1f1b"))
    if gpipe and one:
        print(f"goal 1F1B peak < GPipe peak at M=8: {one['step_peak'] / mib:.1f} vs "
              f"{gpipe['step_peak'] / mib:.1f} MiB "
              f"({'met' if one['step_peak'] < gpipe['step_peak'] else 'NOT met'})")
    print("(the machine is shared with other engineers' jobs: step times swing by tens of "
          "percent between runs; more --rounds give medians)")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("models", nargs="*", choices=["mlp", "transformer", []])
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument("--counts", type=int, nargs="+", default=list(COUNTS))
    parser.add_argument("--gpu", action="store_true", help="two GPUs (or two logical on one)")
    parser.add_argument("--child", nargs=3, metavar=("MODEL", "M", "SCHEDULE"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    STEPS_RUN[0] = args.steps
    if args.child:
        model_name, count, schedule = args.child
        return child(model_name, int(count), schedule, args.steps, args.gpu)
    counts = sorted(set(args.counts) | {1})
    for model_name in args.models or ["mlp", "transformer"]:
        runs = {}
        for _ in range(args.rounds):
            for count in counts:
                for schedule in (("gpipe",) if count == 1 else SCHEDULES):
                    runs.setdefault((count, schedule), []).append(
                        run(model_name, count, schedule, args.steps, args.gpu))
        results = {key: {"step_s": statistics.median(r["step_s"] for r in rs),
                         "step_peak": statistics.median(r["step_peak"] for r in rs),
                         "memory_device": rs[-1]["memory_device"]}
                   for key, rs in runs.items()}
        report(model_name, results, args.gpu)


if __name__ == "__main__":
    main()
