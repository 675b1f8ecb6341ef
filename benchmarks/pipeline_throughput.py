"""Throughput, overlap and peak memory of pipelined training.

Two stages on two devices, `PipelineStages(stages, microbatches=M,
devices=[...], schedule=...)` through `PluginModel.fit`, for M = 1, 2, 4, 8
and both schedules ("gpipe", "1f1b"):

- `mlp`: 8 GELU Dense layers of 1024 and a head, batch 1024 (M = 4: 256
  rows a microbatch), 4 layers a stage;
- `transformer`: the gallery's text transformer (`examples/text_transformer.py`)
  with 4 blocks of width 128, 64 tokens, batch 128 (`--text-batch`); the
  embedding and 2 blocks in stage 0, 2 blocks and the head in stage 1.
  At batch 32 a microbatch of M = 4 is 8 sequences: its ops are so small
  that their dispatch (and the gRPC copies of the proxy) costs as much as
  their arithmetic, and M = 4 measured 1.01-1.06x M = 1 (CPU time per
  step up 14-20 %); at 128 M = 4 spends less CPU than M = 1 and ran at
  1.33-1.42x (docs/benchmarks.md).

Devices (`--proxy`, on the CPU):

- `workers` (the default): two TensorFlow servers in this process, each a
  device with ONE thread running its ops (inter-op and intra-op pools of
  one), tensors between them over gRPC on localhost. A device runs one op at
  a time, as an accelerator's stream does: the proxy for two accelerators.
- `logical`: two logical CPU devices, intra-op pool of one, inter-op pool of
  two. TensorFlow gives every CPU device of a process the SAME inter-op
  pool (and one intra-op pool), so these are not two devices of one thread
  each: one stage runs two of its own ops at once where they are
  independent (a layer's input and weight gradients), and M = 1 already
  keeps both threads busy for part of its step. Measured for comparison.

With `--gpu` the stages go to two GPUs (two logical GPUs on one where there
is only one).

Timing: one process per model builds every configuration and runs them in
turn, ROUNDS rounds of STEPS steps each (the machine is shared: alternating
keeps every configuration under the same load). Per configuration: the
median over rounds of the step time, its throughput against M = 1 in the
same round, the CPU seconds the process spent per step, and the load
average of the machine at each round. The bubble is 1 - T(1) / (S * T(M))
(the fraction of the S devices' time idle, taking M = 1's step as the
work), against GPipe's bound (S - 1) / (M + S - 1).

Memory: each configuration in a process of its own (peaks are per process),
on two logical CPU devices (`TF_CPU_ALLOCATOR_USE_BFC=true`, as
benchmarks/recompute_memory.py does; the same graph as the workers run): the
step peak is what the steps added over what the allocator held before them.

Peers, what a Keras user would run instead, in the same run:

- plain Keras (`model.fit`, no plugin) on ONE of the proxy's devices,
  alternating with the pipelined configurations in the timing rounds: the
  throughput a second device buys through the pipeline;
- data parallelism, Keras's `tf.distribute.MirroredStrategy` over two
  devices, in a process of its own (with `--gpu`, the two GPUs). On the
  CPU it cannot use the `workers` proxy (MirroredStrategy refuses devices
  of other tasks in eager mode: "In-graph multi-worker training ... is not
  supported"), so it runs on two logical CPU devices sharing two threads:
  the same two threads as the pipeline's two devices, its all-reduce in
  memory where the pipeline's hand-overs cross gRPC. Its row says so.

`--trace MODEL M SCHEDULE`: one profiled step (tf.profiler; the allocator as
the timed children's), its ops grouped by pass (the step names them
`F<stage>_<m>`, `B<stage>_<m>`), each stage's time running ops, and the time
both stages run ops at once.

Goals: M = 4 at least 1.3x the throughput of M = 1; the 1F1B
peak below GPipe's at M = 8.

    python benchmarks/pipeline_throughput.py                  # both models
    python benchmarks/pipeline_throughput.py mlp --rounds 7 --proxy logical
    python benchmarks/pipeline_throughput.py --trace mlp 4 gpipe
"""

import argparse
import contextlib
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

STEPS, ROUNDS = 4, 5
COUNTS = (1, 2, 4, 8)
SCHEDULES = ("gpipe", "1f1b")
CHILD_ENV = {"TF_CPU_ALLOCATOR_USE_BFC": "true", "TF_CPP_MIN_LOG_LEVEL": "3"}
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
WIDTH, DEPTH, MLP_BATCH = 1024, 8, 1024
TEXT = dict(vocab=1000, length=64, dim=128, heads=4, classes=2, blocks=4)
TEXT_BATCH = 128
STAGE_COUNT = 2
KERAS = (0, "keras")  # the timing child's key for Keras alone on one device
PROXIES = {
    "workers": "two in-process TensorFlow servers, one thread each (a device runs one op "
               "at a time, as an accelerator's stream does; tensors between them over gRPC "
               "on localhost): a proxy for two accelerators, not two accelerators",
    "logical": "two logical CPU devices, intra-op 1, inter-op 2: both devices share the "
               "process's two inter-op threads, so a stage can run two of its ops at once "
               "and M=1 is already partly parallel; NOT a proxy for two accelerators",
}


# -- devices -------------------------------------------------------------------------
def configure(proxy, gpu):
    """Set TensorFlow's devices up (before it starts) and return
    `(devices, servers kept alive)`."""
    import tensorflow as tf

    if gpu:
        gpus = tf.config.list_physical_devices("GPU")
        if not gpus:
            raise SystemExit("--gpu: no GPU visible")
        if len(gpus) == 1:  # two logical GPUs on the one there is
            tf.config.set_logical_device_configuration(
                gpus[0], [tf.config.LogicalDeviceConfiguration(memory_limit=8192)] * 2)
        return ["/GPU:0", "/GPU:1"], []
    tf.config.threading.set_intra_op_parallelism_threads(1)
    if proxy == "logical":
        cpus = tf.config.list_physical_devices("CPU")
        tf.config.set_logical_device_configuration(
            cpus[0], [tf.config.LogicalDeviceConfiguration()] * 2)
        tf.config.threading.set_inter_op_parallelism_threads(2)
        return ["/CPU:0", "/CPU:1"], []
    # Each server's own pools run what is placed on it: one thread each.
    # The client (this process's eager context) runs only the input
    # pipeline and dispatch; its pool is one thread too (the servers' pools
    # are made from the client's settings when it connects).
    tf.config.threading.set_inter_op_parallelism_threads(1)
    spec = tf.train.ClusterSpec({"worker": [f"localhost:{_free_port()}" for _ in range(2)]})
    config = tf.compat.v1.ConfigProto(inter_op_parallelism_threads=1,
                                      intra_op_parallelism_threads=1)
    servers = [tf.distribute.Server(spec, job_name="worker", task_index=i, config=config)
               for i in range(2)]
    tf.config.experimental_connect_to_cluster(spec)
    return [f"/job:worker/replica:0/task:{i}/device:CPU:0" for i in range(2)], servers


def _free_port():
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


# -- models --------------------------------------------------------------------------
def _setup(model_name, keras, np, steps, text_batch):
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
        x = rng.random((MLP_BATCH * steps, WIDTH), dtype=np.float32)
        y = rng.random((MLP_BATCH * steps, 1), dtype=np.float32)
        return DeepMLP, stages, x, y, "mse", MLP_BATCH
    sys.path.insert(0, str(EXAMPLES))
    import text_transformer

    half = TEXT["blocks"] // 2
    stages = [["embedding"] + [f"blocks.{i}" for i in range(half)],
              [f"blocks.{i}" for i in range(half, TEXT["blocks"])] + ["pool", "head"]]
    x = rng.integers(1, TEXT["vocab"], size=(text_batch * steps, TEXT["length"]))
    y = rng.integers(0, 2, size=(text_batch * steps,))
    return (lambda: text_transformer.TextClassifier(**TEXT), stages, x.astype("int32"),
            y.astype("int32"), keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            text_batch)


def _fitted(model_name, count, schedule, devices, steps, text_batch):
    """A PluginModel for one configuration, traced and warmed up, and its
    data: `(model, x, y, batch)`."""
    import keras
    import numpy as np

    import keras_ipu_plugin as kip

    keras.utils.set_random_seed(0)
    build, stages, x, y, loss, batch = _setup(model_name, keras, np, steps, text_batch)
    passes = [kip.passes.PipelineStages(stages, microbatches=count, devices=devices,
                                        schedule=schedule)]
    model = kip.PluginModel(build(), passes=passes, verify=False)
    model.compile(optimizer="adam", loss=loss)
    model.fit(x[:batch], y[:batch], batch_size=batch, epochs=2, verbose=0)
    return model, x, y, batch


def _plain(model_name, steps, text_batch, strategy=None):
    """The same model trained by Keras alone (no plugin), under `strategy`
    when given, warmed up: `(model, x, y, batch)`."""
    import keras
    import numpy as np

    keras.utils.set_random_seed(0)
    build, _, x, y, loss, batch = _setup(model_name, keras, np, steps, text_batch)
    with strategy.scope() if strategy is not None else contextlib.nullcontext():
        model = build()
        model.compile(optimizer="adam", loss=loss)
    model.fit(x[:batch], y[:batch], batch_size=batch, epochs=2, verbose=0)
    return model, x, y, batch


def _timed_round(keras, runs, results):
    """One round: each of `runs` (key -> (model, x, y, batch)) fits one
    epoch; its median step time and CPU time per step join `results`."""
    for key, (model, x, y, batch) in runs.items():
        times = _step_times(keras)
        cpu = time.process_time()
        model.fit(x, y, batch_size=batch, epochs=1, verbose=0, shuffle=False,
                  callbacks=[times])
        results[key].append({"step_s": statistics.median(times.times),
                             "cpu_s": (time.process_time() - cpu) / len(times.times)})


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


def _weights_on(devices, servers):
    """Where the variables are made: on the first stage's device with the
    workers (as on a first GPU); the logical devices share memory."""
    import tensorflow as tf

    return tf.device(devices[0]) if servers else contextlib.nullcontext()


# -- children ------------------------------------------------------------------------
def timing_child(model_name, configs, steps, rounds, proxy, gpu, text_batch):
    import keras

    devices, servers = configure(proxy, gpu)
    runs = {}
    with _weights_on(devices, servers):
        for count, schedule in configs:
            runs[(count, schedule)] = _fitted(model_name, count, schedule, devices, steps,
                                              text_batch)
        # The peer: Keras alone, every op on the first device (made and run
        # in this scope, as the pipeline's weights are).
        runs[KERAS] = _plain(model_name, steps, text_batch)
        results = {key: [] for key in runs}
        loads = []
        for _ in range(rounds):
            _timed_round(keras, runs, results)
            loads.append(os.getloadavg()[0])
    print(json.dumps({"devices": devices, "loads": loads,
                      "keras": results.pop(KERAS),
                      "results": [[list(key), r] for key, r in results.items()]}))


def peers_child(model_name, steps, rounds, gpu, text_batch):
    """Keras's data parallelism (MirroredStrategy over two devices)
    against Keras alone on one of them, alternating in rounds."""
    import keras
    import tensorflow as tf

    devices, _ = configure("logical", gpu)
    with tf.device(devices[0]):
        runs = {"keras": _plain(model_name, steps, text_batch)}
    runs["mirrored"] = _plain(model_name, steps, text_batch,
                              tf.distribute.MirroredStrategy(devices))
    results = {key: [] for key in runs}
    for _ in range(rounds):
        _timed_round(keras, runs, results)
    print(json.dumps({"devices": devices, **results}))


def memory_child(model_name, count, schedule, steps, gpu, text_batch):
    import keras
    import tensorflow as tf

    devices, _ = configure("logical", gpu)
    model, x, y, batch = _fitted(model_name, count, schedule, devices, steps, text_batch)
    memory_device = devices[0].lstrip("/")
    held = tf.config.experimental.get_memory_info(memory_device)["current"]
    tf.config.experimental.reset_memory_stats(memory_device)
    model.fit(x, y, batch_size=batch, epochs=1, verbose=0, callbacks=[_step_times(keras)])
    peak = tf.config.experimental.get_memory_info(memory_device)["peak"] - held
    print(json.dumps({"step_peak": peak, "memory_device": memory_device}))


PASS = re.compile(r"(?:^|/)(F|B)(\d+)_(\d+)(?:_\d+)?/")


def trace_child(model_name, count, schedule, proxy, gpu, text_batch):
    """Profile one step; print each stage's op time and the time both
    stages run ops at once (ops of a pass: those in its name scope; a
    backward op is named after its forward op, under `gradient_tape/`)."""
    import tempfile

    import tensorflow as tf
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    devices, servers = configure(proxy, gpu)
    with _weights_on(devices, servers):
        model, x, y, batch = _fitted(model_name, count, schedule, devices, 1, text_batch)
        with tempfile.TemporaryDirectory() as logdir:
            tf.profiler.experimental.start(logdir)
            model.fit(x[:batch], y[:batch], batch_size=batch, epochs=1, verbose=0)
            tf.profiler.experimental.stop()
            space = xplane_pb2.XSpace()
            path = next(Path(logdir).rglob("*.xplane.pb"))
            space.ParseFromString(path.read_bytes())
    spans = {0: [], 1: []}
    passes = {}
    for plane in space.planes:
        if not plane.name.startswith("/host:CPU"):
            continue
        for line in plane.lines:
            for event in line.events:
                name = plane.event_metadata[event.metadata_id].name
                match = PASS.search(name)
                if not match:
                    continue
                kind = "B" if "gradient_tape/" in name[:match.start() + 1] else match.group(1)
                stage, micro = int(match.group(2)), int(match.group(3))
                start = line.timestamp_ns * 1000 + event.offset_ps
                spans.setdefault(stage, []).append((start, start + event.duration_ps))
                passes.setdefault((kind, stage, micro), []).append(
                    (start, start + event.duration_ps))
    first = min(s for v in spans.values() for s, _ in v)
    last = max(e for v in spans.values() for _, e in v)
    ms = 1e9
    print(f"one step of {model_name}, M={count}, {schedule}, on {proxy if not gpu else 'GPUs'}:")
    for key in sorted(passes, key=lambda k: min(s for s, _ in passes[k])):
        busy = _union(passes[key])
        start = min(s for s, _ in passes[key])
        print(f"  {key[0]}{key[1]}_{key[2]}: first op at {(start - first) / ms:8.1f} ms, "
              f"ops running {busy / ms:7.1f} ms")
    busy = [_union(spans[s]) for s in (0, 1)]
    both = _both(spans[0], spans[1])
    print(f"step {(last - first) / ms:.1f} ms; stage 0 runs ops {busy[0] / ms:.1f} ms, stage 1 "
          f"{busy[1] / ms:.1f} ms, both at once {both / ms:.1f} ms "
          f"({both / max(min(busy), 1):.0%} of the less busy stage's); load average "
          f"{os.getloadavg()[0]:.2f}")


def _union(intervals):
    total, end = 0, None
    for start, stop in sorted(intervals):
        if end is None or start > end:
            total += stop - start
            end = stop
        elif stop > end:
            total += stop - end
            end = stop
    return total


def _both(a, b):
    """The time at least one interval of `a` and one of `b` are open."""
    points = sorted([(s, 0, 1) for s, _ in a] + [(e, 0, -1) for _, e in a]
                    + [(s, 1, 1) for s, _ in b] + [(e, 1, -1) for _, e in b])
    open_, last, total = [0, 0], None, 0
    for t, side, step in points:
        if last is not None and open_[0] > 0 and open_[1] > 0:
            total += t - last
        open_[side] += step
        last = t
    return total


# -- the parent ----------------------------------------------------------------------
def _child(args, extra_env=None):
    command = [sys.executable, __file__] + args
    done = subprocess.run(command, capture_output=True, text=True,
                          env={**os.environ, **CHILD_ENV, **(extra_env or {})})
    if done.returncode != 0:
        raise RuntimeError(f"child {args} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def measured_bubble(speedup, stages=STAGE_COUNT):
    """The fraction of the devices' time idle: 1 - T(1) / (S * T(M)), where
    `speedup` is T(1) / T(M) (M = 1 runs the stages one after the other, so
    its step is the work of all of them)."""
    return 1 - speedup / stages


def report(model_name, timing, memory, proxy, gpu, steps, text_batch, peers=None):
    mib = 2 ** 20
    results = {tuple(key): rounds for key, rounds in timing["results"]}
    base = results[(1, "gpipe")]
    where = "two GPUs" if gpu else PROXIES[proxy]
    batch = MLP_BATCH if model_name == "mlp" else text_batch
    print(f"\n== {model_name} (batch {batch}): {STAGE_COUNT} stages on {where} ==")
    print(f"devices {timing['devices']}; {len(base)} rounds of {steps} steps, every "
          f"configuration in each round; load average (1 min) at each round: "
          f"{', '.join(f'{load:.2f}' for load in timing['loads'])} on {os.cpu_count()} CPUs")
    print("(step s: median over rounds; x M=1: median of the rounds' ratios; CPU s: the "
          "process's CPU time per step, all threads; step peak: TensorFlow's BFC allocator "
          "on two logical CPU devices, over what it held before the timed steps)")
    print(f"{'schedule':<9}{'M':>3}{'step s':>9}{'CPU s':>8}{'x M=1':>8}{'ideal x':>9}"
          f"{'bubble':>8}{'GPipe bound':>13}{'step peak MiB':>15}")
    speedups = {}
    for (count, schedule), rounds in sorted(results.items(), key=lambda kv: (kv[0][0] > 1, kv[0][1], kv[0][0])):
        if count == 1 and schedule != "gpipe":
            continue  # one order for one microbatch
        step = statistics.median(r["step_s"] for r in rounds)
        cpu = statistics.median(r["cpu_s"] for r in rounds)
        speedup = statistics.median(b["step_s"] / r["step_s"] for b, r in zip(base, rounds))
        speedups[(count, schedule)] = speedup
        ideal = STAGE_COUNT * count / (count + STAGE_COUNT - 1)
        bubble = measured_bubble(speedup)
        bound = (STAGE_COUNT - 1) / (count + STAGE_COUNT - 1)
        label = "both" if count == 1 else schedule
        peak = memory.get((count, schedule))
        peak = f"{peak['step_peak'] / mib:15.1f}" if peak else f"{'-':>15}"
        print(f"{label:<9}{count:>3}{step:>9.3f}{cpu:>8.3f}{speedup:>8.2f}{ideal:>9.2f}"
              f"{bubble:>8.2f}{bound:>13.2f}{peak}")
    for schedule in SCHEDULES:
        if (4, schedule) in speedups:
            speedup = speedups[(4, schedule)]
            print(f"goal {schedule} M=4 >= 1.3x the throughput of M=1: {speedup:.3f} "
                  f"({'met' if speedup >= 1.3 else 'NOT met'})")
    _report_peers(timing, peers, results, gpu)
    gpipe, one = memory.get((8, "gpipe")), memory.get((8, "1f1b"))
    if gpipe and one:
        print(f"goal 1F1B peak < GPipe peak at M=8: {one['step_peak'] / mib:.1f} vs "
              f"{gpipe['step_peak'] / mib:.1f} MiB "
              f"({'met' if one['step_peak'] < gpipe['step_peak'] else 'NOT met'})")
    # The benchmark's own process keeps one to two cores busy: more than
    # all of them is somebody else's load.
    if max(timing["loads"]) > (os.cpu_count() or 1):
        print("(the machine was loaded by other jobs during the run: the step times, and "
              "most of all the overlap, depend on free cores)")


def _report_peers(timing, peers, results, gpu):
    """What a Keras user would run instead, against the pipeline: Keras
    alone on one device (timed in the pipeline's rounds) and
    MirroredStrategy over two devices (`peers`, its own process), and which
    is fastest on two devices."""
    keras_alone = timing.get("keras")
    if not keras_alone:
        return
    median = statistics.median
    print("peers (what a Keras user would run instead): step s, and throughput against Keras "
          "alone on one device")
    alone = median(r["step_s"] for r in keras_alone)
    print(f"  {'Keras alone, one device of the same proxy':<58}{alone:>8.3f}{1.0:>7.2f}")
    best = None  # the pipeline's fastest configuration with microbatches, any M
    for (count, schedule), rounds in sorted(results.items()):
        step = median(r["step_s"] for r in rounds)
        if count > 1 and (best is None or step < best[0]):
            best = (step, f"the pipeline's M={count} {schedule}")
        if count not in (1, 4):
            continue
        ratio = median(k["step_s"] / r["step_s"] for k, r in zip(keras_alone, rounds))
        label = f"kip pipeline, 2 devices, M={count}" + ("" if count == 1 else f", {schedule}")
        print(f"  {label:<58}{step:>8.3f}{ratio:>7.2f}")
    if not peers:
        return
    mirrored = median(r["step_s"] for r in peers["mirrored"])
    its_alone = median(r["step_s"] for r in peers["keras"])
    ratio = median(k["step_s"] / r["step_s"] for k, r in zip(peers["keras"], peers["mirrored"]))
    print(f"  {'MirroredStrategy (data parallel), 2 devices':<58}{mirrored:>8.3f}{ratio:>7.2f}")
    if gpu:
        where, alone_note = "on the same two GPUs", ""
    else:
        where = ("on two logical CPU devices sharing two threads (MirroredStrategy refuses the "
                 "workers proxy's devices)")
        alone_note = ", which may run two ops at once on the two threads"
    print(f"    (its own process, {where}; its ratio is against Keras alone on one of "
          f"those devices, {its_alone:.3f} s a step{alone_note})")
    if best is not None:
        runs = sorted([(mirrored, "MirroredStrategy"), best])
        (fast, fast_name), (slow, slow_name) = runs
        print(f"fastest on two devices: {fast_name}, {fast:.3f} s a step "
              f"({slow / fast:.2f}x the throughput of {slow_name})")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("models", nargs="*", choices=["mlp", "transformer", []])
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument("--counts", type=int, nargs="+", default=list(COUNTS))
    parser.add_argument("--proxy", choices=sorted(PROXIES), default="workers")
    parser.add_argument("--gpu", action="store_true", help="two GPUs (or two logical on one)")
    parser.add_argument("--no-memory", action="store_true", help="timing only")
    parser.add_argument("--text-batch", type=int, default=TEXT_BATCH,
                        help=f"the transformer's batch (default {TEXT_BATCH})")
    parser.add_argument("--trace", nargs=3, metavar=("MODEL", "M", "SCHEDULE"))
    parser.add_argument("--timing-child", nargs=2, metavar=("MODEL", "CONFIGS"),
                        help=argparse.SUPPRESS)
    parser.add_argument("--memory-child", nargs=3, metavar=("MODEL", "M", "SCHEDULE"),
                        help=argparse.SUPPRESS)
    parser.add_argument("--peers-child", metavar="MODEL", help=argparse.SUPPRESS)
    parser.add_argument("--no-peers", action="store_true",
                        help="leave out the MirroredStrategy run (Keras alone stays)")
    args = parser.parse_args(argv)
    if args.trace:
        # The allocator the timed children run with (TensorFlow reads it when
        # it starts, after this): without it, in one profiled GPipe step,
        # three of stage 0's backward matmuls took 9 to 11 ms; with it, all
        # took 3 to 4 ms.
        os.environ.update(CHILD_ENV)
        model_name, count, schedule = args.trace
        return trace_child(model_name, int(count), schedule, args.proxy, args.gpu,
                           args.text_batch)
    if args.timing_child:
        model_name, configs = args.timing_child
        configs = [(int(c), s) for c, s in (item.split(":") for item in configs.split(","))]
        return timing_child(model_name, configs, args.steps, args.rounds, args.proxy, args.gpu,
                            args.text_batch)
    if args.peers_child:
        return peers_child(args.peers_child, args.steps, args.rounds, args.gpu, args.text_batch)
    if args.memory_child:
        model_name, count, schedule = args.memory_child
        return memory_child(model_name, int(count), schedule, args.steps, args.gpu,
                            args.text_batch)
    counts = sorted(set(args.counts) | {1})
    configs = [(c, s) for c in counts for s in (("gpipe",) if c == 1 else SCHEDULES)]
    flags = (["--steps", str(args.steps), "--proxy", args.proxy,
              "--text-batch", str(args.text_batch)] + (["--gpu"] if args.gpu else []))
    for model_name in args.models or ["mlp", "transformer"]:
        timing = _child(["--timing-child", model_name,
                         ",".join(f"{c}:{s}" for c, s in configs), "--rounds", str(args.rounds)]
                        + flags)
        memory = {} if args.no_memory else {
            (c, s): _child(["--memory-child", model_name, str(c), s] + flags)
            for c, s in configs if c in (1, 4, 8)}
        peers = None if args.no_peers else _child(
            ["--peers-child", model_name, "--rounds", str(args.rounds)] + flags)
        report(model_name, timing, memory, args.proxy, args.gpu, args.steps, args.text_batch,
               peers)


if __name__ == "__main__":
    main()
