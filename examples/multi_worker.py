"""Train a subclassed model through the plugin with MultiWorkerMirroredStrategy.

    python examples/multi_worker.py            # two workers on 127.0.0.1

This script starts two worker processes on this machine, each with a
`TF_CONFIG` naming both; they train one model together, in lockstep, through
`kip.PluginModel`, and only the chief (worker 0) writes the checkpoint.

Across real machines, run the same worker command on each machine with
`TF_CONFIG` listing every machine's `host:port` and that machine's own
index, e.g. on the second of two machines:

    TF_CONFIG='{"cluster": {"worker": ["10.0.0.1:12345", "10.0.0.2:12345"]},
                "task": {"type": "worker", "index": 1}}' \\
        python examples/multi_worker.py --worker

Keras 3 (checked with 3.15) cannot `fit` under MultiWorkerMirroredStrategy on
its own (its first symbolic build and its metric reduction fail);
`kip.PluginModel` trains there because its training path avoids both.
"""

import argparse
import json
import os
import socket
import subprocess
import sys
import time

EPOCHS, GLOBAL_BATCH, SAMPLES = 2, 32, 256


def make_data():
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.normal(size=(SAMPLES, 8)).astype("float32")
    y = np.sin(x.sum(axis=1, keepdims=True)).astype("float32")
    return x, y


def build_model():
    import keras

    class Regressor(keras.Model):
        def __init__(self):
            super().__init__()
            self.hidden = keras.layers.Dense(16, activation="tanh")
            self.norm = keras.layers.LayerNormalization()
            self.out = keras.layers.Dense(1)

        def call(self, x):
            return self.out(self.norm(self.hidden(x)))

    keras.utils.set_random_seed(0)
    return Regressor()


def train(strategy, out_dir=None, is_chief=True, index=0, entry="plugin_model"):
    """Train under `strategy` through `entry` ("plugin_model" or "callback");
    return the losses and the trained model."""
    import tensorflow as tf

    import keras_ipu_plugin as kip

    x, y = make_data()
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    dataset = dataset.with_options(options)
    if entry == "scope_error":
        # kip.scope cannot serve here (docs/reference.md, "Distribution"): it says so up front.
        try:
            with kip.scope(strategy):
                pass
        except ValueError as error:
            print(f"kip.scope refused: {error}", flush=True)
            return [float("nan")], None
        raise RuntimeError("kip.scope accepted MultiWorkerMirroredStrategy")
    if entry == "plugin_model":
        with strategy.scope():
            model = build_model()
            model(x[:2])
            plugin = kip.PluginModel(model, passes=[kip.passes.Expand()])
            plugin.compile(optimizer="sgd", loss="mse")
        history = plugin.fit(dataset, epochs=EPOCHS, verbose=0)
    else:
        # Created outside the scope: Keras's own fit would otherwise fail in
        # its first symbolic build under MultiWorkerMirroredStrategy.
        plugin = build_model()
        with strategy.scope():
            plugin(x[:2])
            plugin.compile(optimizer="sgd", loss="mse")
            history = plugin.fit(dataset, epochs=EPOCHS, verbose=0, callbacks=[
                kip.PluginCallback(passes=[kip.passes.Expand()])])
    if out_dir:
        if is_chief:
            plugin.save_weights(os.path.join(out_dir, "chief.weights.h5"))
        with open(os.path.join(out_dir, f"worker{index}.json"), "w") as handle:
            json.dump({"loss": history.history["loss"],
                       "weights": [w.tolist() for w in plugin.get_weights()]}, handle)
    return history.history["loss"], plugin


def worker_main(out_dir, entry):
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import tensorflow as tf

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    loss, _ = train(strategy, out_dir, is_chief=index == 0, index=index, entry=entry)
    print(f"worker {index} final loss: {loss[-1]:.5f}", flush=True)


def free_ports(count):
    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def launch(out_dir, workers=2, timeout=240, entry="plugin_model"):
    """Start `workers` processes on 127.0.0.1 and wait; on any failure or
    timeout every process is killed. Returns their outputs."""
    os.makedirs(out_dir, exist_ok=True)
    ports = free_ports(workers)
    cluster = {"worker": [f"127.0.0.1:{p}" for p in ports]}
    processes = []
    try:
        for index in range(workers):
            env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", TF_CONFIG=json.dumps(
                {"cluster": cluster, "task": {"type": "worker", "index": index}}))
            processes.append(subprocess.Popen(
                [sys.executable, __file__, "--worker", "--out", out_dir, "--entry", entry],
                env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        deadline = time.monotonic() + timeout
        outputs = []
        for process in processes:
            out, _ = process.communicate(timeout=max(1, deadline - time.monotonic()))
            if process.returncode != 0:
                raise RuntimeError(f"worker failed ({process.returncode}):\n{out[-3000:]}")
            outputs.append(out)
        return outputs
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()


def main():
    import tempfile

    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--out", default=None)
    parser.add_argument("--entry", choices=["plugin_model", "callback", "scope_error"],
                        default="plugin_model")
    args = parser.parse_args()
    if args.worker:
        worker_main(args.out, args.entry)
        return
    out_dir = args.out or tempfile.mkdtemp(prefix="kip_multi_worker_")
    for output in launch(out_dir, entry=args.entry):
        print(output.strip().splitlines()[-1])
    print(f"chief checkpoint: {os.path.join(out_dir, 'chief.weights.h5')}")


if __name__ == "__main__":
    main()
