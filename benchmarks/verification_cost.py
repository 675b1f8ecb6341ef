"""What verification costs, against one training step on the same batch.

Before verification ran on a subset of rows, on a BERT-like backbone (8 layers, hidden 512, sequence 256,
batch 16) verification took 3.65 s and lifted peak memory to 6.4 GB, while
training peaked at 2.6 GB. The goal: verification costs no more than one
training step on the same batch, in time and in peak memory.

The model is a subclassed classifier around keras_hub's `BertBackbone`
(built from its constructor: no download). Each variant runs in its own
process, because peak memory is per process (`ru_maxrss`; on a GPU,
`tf.config.experimental.get_memory_info`'s peak):

- `verify`: convert with `verify=False`, then time `check_equivalent` as
  `convert_to_functional(verify=True)` runs it (a few rows of the batch):
  outputs, gradients, and one training-mode forward step compared over
  every variable it writes;
- `verify-whole`: the same on the whole batch (`rows=None`), roughly what
  verification cost before;
- `train`: convert, compile with Adam, one traced step, then STEPS timed
  steps (their median is "one training step"; the traced first step, what
  a user waits for at the start of `fit`, is shown too).

Each process reports its peak and the peak before the measured part (model
built and converted), so the growth is what the measured part added. The
variants alternate over ROUNDS rounds; medians over rounds are printed,
then the two ratios. Goal: both <= 1.

    python benchmarks/verification_cost.py            # the full size
    python benchmarks/verification_cost.py --small    # a 2-layer, 128-wide quick look
"""

import json
import os
import statistics
import subprocess
import sys

# Children run this file by path: the repository's package, installed or not.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import time

FULL = dict(layers=8, hidden=512, heads=8, sequence=256, batch=16, vocabulary=30522)
SMALL = dict(layers=2, hidden=128, heads=2, sequence=64, batch=16, vocabulary=1000)
STEPS = 3
ROUNDS = int(os.environ.get("ROUNDS", 2))
VARIANTS = ("verify", "verify-whole", "train")


def child(variant, size):
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
    import resource

    import keras
    import keras_hub
    import numpy as np
    import tensorflow as tf

    import keras_ipu_plugin as kip

    gpu = bool(tf.config.list_physical_devices("GPU"))

    def peak_bytes():
        if gpu:
            return tf.config.experimental.get_memory_info("GPU:0")["peak"]
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    class Classifier(keras.Model):
        def __init__(self):
            super().__init__()
            self.backbone = keras_hub.models.BertBackbone(
                vocabulary_size=size["vocabulary"], num_layers=size["layers"],
                num_heads=size["heads"], hidden_dim=size["hidden"],
                intermediate_dim=4 * size["hidden"],
                max_sequence_length=size["sequence"])
            self.head = keras.layers.Dense(2)

        def call(self, inputs):
            return self.head(self.backbone(inputs)["pooled_output"])

    keras.utils.set_random_seed(0)
    rng = np.random.RandomState(0)
    shape = (size["batch"], size["sequence"])
    x = {
        "token_ids": rng.randint(0, size["vocabulary"], shape).astype("int32"),
        "segment_ids": np.zeros(shape, "int32"),
        "padding_mask": np.ones(shape, "int32"),
    }
    y = rng.randint(0, 2, size["batch"]).astype("int32")
    model = Classifier()
    converted = kip.convert_to_functional(model, x, verify=False)
    before = peak_bytes()
    if variant.startswith("verify"):
        tensors = {k: tf.constant(v) for k, v in x.items()}
        rows = "auto" if variant == "verify" else None
        start = time.perf_counter()
        result = kip.frontend.verify.equivalence.check_equivalent(model, converted, tensors, rows=rows)
        seconds = time.perf_counter() - start
        detail = result.describe()
    else:
        converted.compile(optimizer="adam",
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        start = time.perf_counter()
        converted.train_on_batch(x, y)  # traces the step
        detail = f"first step (traced) {time.perf_counter() - start:.3f} s"
        times = []
        for _ in range(STEPS):
            start = time.perf_counter()
            converted.train_on_batch(x, y)
            times.append(time.perf_counter() - start)
        seconds = statistics.median(times)
        detail += f", jit_compile={converted.jit_compile}"
    print(json.dumps({"before": before, "peak": peak_bytes(), "seconds": seconds,
                      "detail": detail, "device": "GPU" if gpu else "CPU"}))


def run(variant, size_name):
    done = subprocess.run(
        [sys.executable, __file__, "--child", variant, size_name],
        capture_output=True, text=True,
    )
    if done.returncode != 0:  # show why the child failed, not only that it did
        raise RuntimeError(f"child {variant} / {size_name} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(size_name):
    runs = {variant: [] for variant in VARIANTS}
    for _ in range(ROUNDS):
        for variant in VARIANTS:
            runs[variant].append(run(variant, size_name))
    median = lambda rs, key: statistics.median(r[key] for r in rs)  # noqa: E731
    result = {
        variant: {
            "peak": median(rs, "peak"), "before": median(rs, "before"),
            "seconds": median(rs, "seconds"), "detail": rs[-1]["detail"],
            "device": rs[-1]["device"],
        }
        for variant, rs in runs.items()
    }
    mib = 1024 * 1024
    print(f"model: BertBackbone {SIZES[size_name]} in a subclassed classifier, "
          f"on {result['train']['device']}")
    print(f"{'variant':<14}{'seconds':>9}{'peak MiB':>10}{'growth MiB':>12}  detail")
    for name, r in result.items():
        print(f"{name:<14}{r['seconds']:>9.3f}{r['peak'] / mib:>10.0f}"
              f"{(r['peak'] - r['before']) / mib:>12.0f}  {r['detail']}")
    verify, whole, train = result["verify"], result["verify-whole"], result["train"]
    print(f"verification time / one train step:        "
          f"{verify['seconds'] / train['seconds']:.2f} (whole batch: "
          f"{whole['seconds'] / train['seconds']:.2f})")
    print(f"verification peak / training peak:         "
          f"{verify['peak'] / train['peak']:.2f} (whole batch: "
          f"{whole['peak'] / train['peak']:.2f})")
    growth = lambda r: max(r["peak"] - r["before"], 1)  # noqa: E731
    print(f"verification growth / training growth:     "
          f"{growth(verify) / growth(train):.2f} (whole batch: "
          f"{growth(whole) / growth(train):.2f})")


SIZES = {"full": FULL, "small": SMALL}

if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], SIZES[sys.argv[3]])
    else:
        main("small" if "--small" in sys.argv else "full")
