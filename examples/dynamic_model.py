"""A model whose `call` branches on its input's value, through keras_ipu_plugin.

Runs on CPU in a few seconds on synthetic data:

    python examples/dynamic_model.py

The model of the "support dynamically added variables" discussion (ElasticDL),
ported to Keras 3: `call` takes a Python `if` on a tensor value, so which
layers run — and which variables exist — depends on the data. Eagerly, a
first batch down the `return x` branch creates 2 variables; a batch down the
other branch creates 2 more.

Such a `call` cannot be traced on symbolic inputs, so the plugin keeps the
model as one opaque node that runs the original code (the report says so and
why). In graph mode that code runs through AutoGraph (the `if` becomes a
`tf.cond`), so `fit` needs no `run_eagerly`.

The script trains in two phases, as the discussion's users would meet it:
1. plain Keras, eagerly, on data that only ever takes the `return x`
   branch: the optimizer is built for the 2 variables that exist;
2. through `kip.PluginCallback`, in graph mode, on mixed data: conversion
   builds the other branch's layer, the optimizer meets its 2 new variables,
   and the plugin extends the optimizer (keeping the state of the first 2)
   and retraces the step before it runs. Plain Keras stops here with
   "Unknown variable ... This optimizer can only be called for the
   variables it was originally built with".
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_ipu_plugin as kip  # noqa: E402


class TestModel(keras.Model):
    """The discussion's model, as written there (Keras 3 port)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense_layer = keras.layers.Dense(1)
        self.layer1 = keras.layers.Dense(1)
        self.layer2 = keras.layers.Dense(1)

    def call(self, inputs):
        x = self.dense_layer(inputs)
        if inputs[0] > 0.1:
            return x
        else:
            return self.layer1(x)


def build_model():
    return TestModel()


def make_data(samples=256, seed=0):
    """Batches of 8 whose first value sends `call` down one branch or the
    other (alternately); the target is 3x + 1."""
    rng = np.random.default_rng(seed)
    x = rng.uniform(0.0, 0.2, size=(samples, 1)).astype("float32")
    x[::8, 0] = np.where(np.arange(samples // 8) % 2 == 0, 0.15, 0.05)
    return x, (3 * x + 1).astype("float32")


def passes():
    return []  # an opaque model has no graph inside to transform


def compile_model(model):
    model.compile(optimizer=keras.optimizers.Adam(0.05), loss=keras.losses.MeanSquaredError())


def main():
    keras.utils.set_random_seed(0)
    model = build_model()
    # As in the discussion: the variables depend on the data seen.
    model(np.full((1, 1), 0.2, "float32"))
    print("variable number is", len(model.trainable_variables), "after data 1")

    # Phase 1: plain Keras, eagerly, only the `return x` branch.
    x_high = np.full((64, 1), 0.15, "float32")
    model.compile(optimizer=keras.optimizers.Adam(0.05), loss="mse", run_eagerly=True)
    model.fit(x_high, 3 * x_high + 1, batch_size=8, epochs=1, verbose=0)
    print("optimizer built for", len(model.optimizer._trainable_variables), "variables")

    # Phase 2: mixed data, graph mode, through the plugin.
    x, y = make_data()
    model.compile(optimizer=model.optimizer, loss="mse")
    callback = kip.PluginCallback(passes=passes())
    history = model.fit(x, y, batch_size=8, epochs=3, shuffle=False, verbose=2,
                        callbacks=[callback])
    print("variable number is", len(model.trainable_variables), "after training")
    print(callback.kip_report)
    print(f"backend: {kip.backend()}")
    print(f"final loss: {history.history['loss'][-1]:.4f}")
    return history


if __name__ == "__main__":
    main()
