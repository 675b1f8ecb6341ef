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
`tf.cond`), so `fit` needs no `run_eagerly`. The branch the first batch did
not take is built at conversion, before the optimizer is built, so all 4
variables train from the first step; variables created later still would
make the plugin rebuild the graph and extend the optimizer
(`rebuild_on_new_variables=True`, the default).
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
    x, y = make_data()
    plugin = kip.PluginModel(model, passes=passes())
    compile_model(plugin)
    history = plugin.fit(x, y, batch_size=8, epochs=3, shuffle=False, verbose=2)
    print("variable number is", len(model.trainable_variables), "after training")
    print(plugin.kip_report)
    print(f"backend: {kip.backend()}")
    print(f"final loss: {history.history['loss'][-1]:.4f}")
    return history


if __name__ == "__main__":
    main()
