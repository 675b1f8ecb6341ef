"""Peak memory and step time of `fit` with planned, hand-placed and no recomputation.

Models:
- `mlp`: a 48-layer, 1024-wide GELU MLP, batch 1024;
- `transformer`: the gallery's text transformer (`examples/text_transformer.py`)
  at a size where activations matter: 4 blocks, width 256, 4 heads, 128
  tokens, batch 32. Its attention and Dropout layers carry forward state (a
  seed), which the executor never recomputes;
- `transformer-nodrop`: the same without dropout (no forward state), to show
  what the planner does when every layer may be recomputed.

Variants, each in its own process (peak memory is per process):
- `baseline`: no recomputation;
- `hand`: today's hand plan, `Recompute` by layer name (the MLP every 6
  layers; the transformer as the gallery example does, after each block's
  last LayerNormalization);
- `hand-written` (MLP only): the same segments as `hand` written with
  `tf.recompute_grad`, the reference the first goal was set against;
- `auto`: `Recompute(auto=True)`, the smallest estimated peak;
- `budget`: `Recompute(auto=True, memory_budget=0.5)`, half the estimated
  peak without recomputation.

Each process traces `fit` on one batch and runs a warm-up step; then it
reads what TensorFlow's allocator holds (weights, optimizer state, data),
resets its peak (`tf.config.experimental.reset_memory_stats`), times STEPS
single steps and reads the peak again (`get_memory_info`): "step peak" is
what the training steps added on top (activations, gradients, temporaries),
the quantity the plan estimates. On the CPU the processes run with
TensorFlow's BFC allocator (`TF_CPU_ALLOCATOR_USE_BFC=true`), which keeps
these counts as it does on a GPU; on a GPU (when one is visible) they are
bytes of device memory. The process's resident peak is printed beside it,
but it is no measure of the plan: it includes tracing the step, and memory
the allocator freed is not given back, so it never falls.

The variants of a model alternate over ROUNDS rounds; the median over rounds
is printed (one step on a shared 2-core machine swings by tens of percent).
Goals: auto step peak <= 0.6x baseline at <= 1.35x step time and
<= the hand plan's; with the budget, the measured step peak within 15% of
the budget.

    python benchmarks/recompute_memory.py                 # all models
    python benchmarks/recompute_memory.py mlp --rounds 3
"""

import argparse
import json
import os
import statistics
import subprocess
import sys

# Children run this file by path: the repository's package, installed or not.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import time
from pathlib import Path

STEPS, ROUNDS = 4, 2
#: TensorFlow's BFC allocator on the CPU too: it counts the bytes in use
#: and their peak (`get_memory_info`), as on a GPU (see the module docstring).
CHILD_ENV = {"TF_CPU_ALLOCATOR_USE_BFC": "true"}
MODELS = {
    "mlp": ("baseline", "hand", "hand-written", "auto", "budget"),
    "transformer": ("baseline", "hand", "auto", "budget"),
    "transformer-nodrop": ("baseline", "hand", "auto", "budget"),
}
DEPTH, WIDTH, MLP_BATCH, EVERY = 48, 1024, 1024, 6
TEXT = dict(vocab=1000, length=128, dim=256, heads=4, classes=2, blocks=4)
TEXT_BATCH = 32
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


# -- the child: one model, one variant -------------------------------------------------
def child(model_name, variant):
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
    import gc

    import keras
    import numpy as np
    import tensorflow as tf

    import keras_ipu_plugin as kip

    keras.utils.set_random_seed(0)
    build, passes, x, y, loss = _setup(model_name, variant, keras, np, tf, kip)
    model = build()
    plan = None
    if variant != "hand-written":
        model = kip.convert_to_functional(model, x[: len(x) // STEPS], verify=False)
        if passes:
            try:
                model = kip.apply_passes(model, passes, verify=False)
            except kip.PassError as error:
                # A budget no plan meets is refused with the smallest
                # reachable estimate: a result to print, not a crash that
                # loses the other variants' figures.
                print(json.dumps({"refused": str(error)}))
                return
            plan = _plan_figures(model)
    model.compile(optimizer="sgd", loss=loss)
    batch = len(x) // STEPS
    device = "GPU:0" if tf.config.list_logical_devices("GPU") else "CPU:0"
    model.fit(x[:batch], y[:batch], batch_size=batch, epochs=2, verbose=0)  # trace, warm up
    gc.collect()
    # What TensorFlow's allocator holds now (weights, optimizer state, data)
    # and its peak over the timed steps: the step peak is what the training
    # steps added on top, the quantity the plan estimates.
    held = tf.config.experimental.get_memory_info(device)["current"]
    tf.config.experimental.reset_memory_stats(device)
    times = StepTimes(keras)
    model.fit(x, y, batch_size=batch, epochs=1, verbose=0, callbacks=[times])
    result = {
        "step_peak": tf.config.experimental.get_memory_info(device)["peak"] - held,
        "process_peak": _status("VmHWM") * 1024,
        "step_s": statistics.median(times.times),
        "plan": plan,
        "device": device,
    }
    print(json.dumps(result))


def _setup(model_name, variant, keras, np, tf, kip):
    """(build, passes, x, y, loss) of a model and variant."""
    rng = np.random.default_rng(0)
    if model_name == "mlp":
        x = rng.random((MLP_BATCH * STEPS, WIDTH), dtype=np.float32)
        y = rng.random((MLP_BATCH * STEPS, 1), dtype=np.float32)
        hand = [kip.passes.Recompute([f"h{i}" for i in range(EVERY - 1, DEPTH, EVERY)])]
        builders = _mlp_classes(keras, tf)
        build = builders[1] if variant == "hand-written" else builders[0]
        loss = "mse"
    else:
        sys.path.insert(0, str(EXAMPLES))
        import text_transformer

        x = rng.integers(1, TEXT["vocab"], size=(TEXT_BATCH * STEPS, TEXT["length"]))
        x = x.astype("int32")
        y = rng.integers(0, 2, size=(TEXT_BATCH * STEPS,)).astype("int32")
        rate = 0.0 if model_name == "transformer-nodrop" else None
        build = _text_builder(text_transformer, keras, rate)
        hand = [kip.passes.Expand(),
                kip.passes.Recompute([f"block_{i}.norm_2" for i in range(TEXT["blocks"])])]
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    passes = {
        "baseline": [],
        "hand": hand,
        "hand-written": [],
        "auto": [kip.passes.Expand(), kip.passes.Recompute(auto=True)],
        "budget": [kip.passes.Expand(), kip.passes.Recompute(auto=True, memory_budget=0.5)],
    }[variant]
    return build, passes, x, y, loss


def _mlp_classes(keras, tf):
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

    class HandCheckpointedMLP(DeepMLP):
        def call(self, x):
            for start in range(0, DEPTH, EVERY):
                def segment(x, layers=self.hidden[start:start + EVERY]):
                    for layer in layers:
                        x = layer(x)
                    return x

                x = tf.recompute_grad(segment)(x)
            return self.head(x)

    return DeepMLP, HandCheckpointedMLP


def _text_builder(text_transformer, keras, rate):
    """The gallery's TextClassifier; with `rate=0.0` its blocks and head
    drop nothing (no Dropout seed: no forward state)."""
    if rate is None:
        return lambda: text_transformer.TextClassifier(**TEXT)

    class NoDropoutTextClassifier(text_transformer.TextClassifier):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.blocks = [text_transformer.TransformerBlock(
                TEXT["dim"], TEXT["heads"], TEXT["dim"] * 2, rate=rate, name=f"block_{i}")
                for i in range(TEXT["blocks"])]
            self.dropout = keras.layers.Dropout(rate)

    return lambda: NoDropoutTextClassifier(**TEXT)


def _plan_figures(model):
    for plan in model.kip_report.plans:
        if plan.title.startswith("Recompute plan"):
            keep = ("peak", "baseline_peak", "budget", "extra_fraction", "checkpoints",
                    "peak_if_gradients_held")
            return {key: plan.figures[key] for key in keep}
    return None


class StepTimes:
    def __new__(cls, keras):
        class Times(keras.callbacks.Callback):
            def __init__(self):
                super().__init__()
                self.times = []

            def on_train_batch_begin(self, batch, logs=None):
                self.start = time.perf_counter()

            def on_train_batch_end(self, batch, logs=None):
                self.times.append(time.perf_counter() - self.start)

        return Times()


def _status(field):
    """A `/proc/self/status` figure in KiB (VmRSS: now, VmHWM: the peak)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


# -- the parent: alternate the variants, print side by side ---------------------------
def run(model_name, variant):
    done = subprocess.run(
        [sys.executable, __file__, "--child", model_name, variant],
        capture_output=True, text=True, env={**os.environ, **CHILD_ENV},
    )
    if done.returncode != 0:  # show why the child failed, not only that it did
        raise RuntimeError(f"child {model_name} / {variant} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def summarise(runs):
    refused = [r["refused"] for r in runs if "refused" in r]
    if refused:
        return {"refused": refused[0]}

    def median(key):
        values = [r[key] for r in runs if r.get(key) is not None]
        return statistics.median(values) if values else None

    return {"step_peak": median("step_peak"), "process_peak": median("process_peak"),
            "step_s": median("step_s"), "device": runs[-1]["device"],
            "plan": runs[-1]["plan"]}


def report(model_name, result):
    mib = 2 ** 20
    base = result["baseline"]
    print(f"\n== {model_name} ==")
    header = (f"{'variant':<14}{'step peak MiB':>15}{'x base':>8}{'process MiB':>13}"
              f"{'step s':>9}{'x base':>8}{'est. MiB':>10}{'est./meas.':>11}")
    print(f"(step peak: TensorFlow's allocator on {base['device']}, over what it held "
          "before the timed steps; process: the resident peak)")
    print(header)
    for name, r in result.items():
        if "refused" in r:
            continue
        plan = r["plan"] or {}
        estimate = plan.get("peak")
        line = (f"{name:<14}{r['step_peak'] / mib:>15.0f}{r['step_peak'] / base['step_peak']:>8.2f}"
                f"{r['process_peak'] / mib:>13.0f}{r['step_s']:>9.3f}"
                f"{r['step_s'] / base['step_s']:>8.2f}"
                + (f"{estimate / mib:>10.0f}{estimate / r['step_peak']:>11.2f}" if estimate
                   else f"{'':>10}{'':>11}"))
        print(line)
    some_plan = next((r["plan"] for r in result.values() if r.get("plan")), None)
    if some_plan:
        print(f"estimated step peak without recomputation: "
              f"{some_plan['baseline_peak'] / mib:.0f} MiB "
              f"(measured: {base['step_peak'] / mib:.0f} MiB)")
    auto, budget = result.get("auto"), result.get("budget")
    measure = "step_peak"
    if auto:
        memory = auto[measure] / base[measure]
        step = auto["step_s"] / base["step_s"]
        hand = result["hand"][measure] if "hand" in result else float("nan")
        print(f"auto: checkpoints {', '.join(auto['plan']['checkpoints']) or 'none'}; "
              f"estimated extra compute {auto['plan']['extra_fraction']:.2f} forward passes")
        print(f"goal auto <= 0.6x baseline memory: {memory:.2f} "
              f"({'met' if memory <= 0.6 else 'NOT met'}); <= 1.35x step time: {step:.2f} "
              f"({'met' if step <= 1.35 else 'NOT met'}); <= the hand plan's memory: "
              f"{auto[measure] / mib:.0f} vs {hand / mib:.0f} MiB "
              f"({'met' if auto[measure] <= hand else 'NOT met'})")
        # The auto plan is the smallest estimated peak: no plan goes lower,
        # so when it misses the goal the goal is out of reach (layers with
        # forward state stay outside segments), not a worse plan.
        bound = auto["plan"]["peak"] / auto["plan"]["baseline_peak"]
        print(f"lower bound: no checkpoint plan is estimated below {bound:.2f}x the estimate "
              f"without recomputation ({auto['plan']['peak'] / mib:.0f} of "
              f"{auto['plan']['baseline_peak'] / mib:.0f} MiB); with every weight gradient "
              f"held (global clipping, accumulation) the plan's estimate is "
              f"{auto['plan']['peak_if_gradients_held'] / mib:.0f} MiB")
    if budget and "refused" in budget:
        print(f"budget 0.5: refused by the pass (goal not reachable): "
              f"{budget['refused'].split(' The estimate covers')[0]}")
    elif budget:
        target = budget["plan"]["budget"]
        off = budget[measure] / target - 1
        print(f"budget: {target / mib:.0f} MiB (0.5 of the estimate); plan's estimate "
              f"{budget['plan']['peak'] / mib:.0f} MiB; measured {budget[measure] / mib:.0f} MiB "
              f"({off:+.0%}; goal within 15%: {'met' if abs(off) <= 0.15 else 'NOT met'})")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("models", nargs="*", choices=[*MODELS, []])
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument("--variants", nargs="+", help="only these variants (baseline always)")
    args = parser.parse_args(argv)
    for model_name in args.models or list(MODELS):
        variants = [v for v in MODELS[model_name]
                    if not args.variants or v == "baseline" or v in args.variants]
        runs = {variant: [] for variant in variants}
        for _ in range(args.rounds):
            for variant in variants:
                runs[variant].append(run(model_name, variant))
        report(model_name, {variant: summarise(rs) for variant, rs in runs.items()})


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3])
    else:
        main()
