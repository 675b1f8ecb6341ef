"""Cost of watching for new variables, and of one rebuild.

1. Steps per second of `fit` (graph mode) for a model that never grows:
   through `kip.PluginModel` (watch on: its step function looks for new
   variables after every trace) vs the same converted graph fitted directly
   (watch off: Keras's own train function), alternating runs in one
   process. Goal: ratio >= 0.98.
2. Time of one rebuild (a layer switched on between epochs) vs the initial
   conversion of the same model. Goal: ratio <= 2.

    python benchmarks/dynamic_variables.py
"""

import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_ipu_plugin as kip  # noqa: E402

STEPS, BATCH, ROUNDS = 200, 32, 5


class Growing(keras.Model):
    def __init__(self, width=64, depth=4):
        super().__init__()
        self.grow = False
        self.hidden = [keras.layers.Dense(width, activation="relu") for _ in range(depth)]
        self.extra = keras.layers.Dense(width)
        self.out = keras.layers.Dense(1)

    def call(self, x):
        for layer in self.hidden:
            x = layer(x)
        if self.grow:
            x = x + self.extra(x)
        return self.out(x)


def data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(STEPS * BATCH, 32)).astype("float32")
    return x, x[:, :1] * 2.0


def make_trainable(watch):
    keras.utils.set_random_seed(0)
    x, y = data()
    model = Growing()
    if watch:
        trained = kip.PluginModel(model)
    else:
        trained = kip.convert_to_functional(model, x[:BATCH])
    trained.compile(optimizer="adam", loss="mse")
    trained.fit(x[: 4 * BATCH], y[: 4 * BATCH], batch_size=BATCH, verbose=0)  # trace
    return trained


def steps_per_second(plugin):
    x, y = data()
    start = time.perf_counter()
    plugin.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    return STEPS / (time.perf_counter() - start)


def watch_cost():
    plugins = {"watch on": make_trainable(True), "watch off": make_trainable(False)}
    rates = {name: [] for name in plugins}
    for _ in range(ROUNDS):
        for name, plugin in plugins.items():
            rates[name].append(steps_per_second(plugin))
    on, off = statistics.median(rates["watch on"]), statistics.median(rates["watch off"])
    print(f"steps/s  watch on: {on:.0f}  watch off: {off:.0f}")
    ratio = on / off
    print(f"watch on / off: {ratio:.3f} (goal >= 0.98: {'met' if ratio >= 0.98 else 'NOT met'})")


def rebuild_cost():
    x, y = data()
    model = Growing()
    plugin = kip.PluginModel(model)
    plugin.compile(optimizer="adam", loss="mse")
    start = time.perf_counter()
    plugin.convert(x[:BATCH])
    convert_time = time.perf_counter() - start
    model.grow = True
    start = time.perf_counter()
    plugin._kip_session.rebuild("benchmark")
    rebuild_time = time.perf_counter() - start
    ratio = rebuild_time / convert_time
    print(f"initial conversion: {convert_time * 1000:.0f} ms  rebuild: {rebuild_time * 1000:.0f} ms")
    print(f"rebuild / conversion: {ratio:.2f} (goal <= 2: {'met' if ratio <= 2 else 'NOT met'})")


if __name__ == "__main__":
    watch_cost()
    rebuild_cost()
