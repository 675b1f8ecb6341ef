"""Quickstart: train a subclassed model through keras_ipu_plugin.

Runs on CPU in a few seconds on synthetic data:

    python examples/quickstart.py

It wraps a subclassed model (custom residual blocks) in `kip.PluginModel`,
which converts it to a functional graph at the first batch, expands the
custom blocks into their Keras layers, puts a recomputation checkpoint after
each block, trains, and prints what the conversion and the passes did.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_ipu_plugin as kip  # noqa: E402


class ResidualBlock(keras.layers.Layer):
    def __init__(self, width, **kwargs):
        super().__init__(**kwargs)
        self.width = width
        self.dense = keras.layers.Dense(width, activation="gelu")
        self.norm = keras.layers.LayerNormalization()
        self.dropout = keras.layers.Dropout(0.1)

    def call(self, x, training=None):
        return x + self.dropout(self.norm(self.dense(x)), training=training)

    def get_config(self):
        return {**super().get_config(), "width": self.width}


class Regressor(keras.Model):
    def __init__(self, width=64, depth=4, **kwargs):
        super().__init__(**kwargs)
        self.stem = keras.layers.Dense(width)
        self.blocks = [ResidualBlock(width, name=f"block_{i}") for i in range(depth)]
        self.head = keras.layers.Dense(1)

    def call(self, x, training=None):
        x = self.stem(x)
        for block in self.blocks:
            x = block(x, training=training)
        return self.head(x)


def synthetic_data(samples=2048, features=16, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(samples, features)).astype("float32")
    w = rng.normal(size=(features, 1)).astype("float32")
    y = np.tanh(x @ w) + 0.05 * rng.normal(size=(samples, 1)).astype("float32")
    return x, y


def main():
    keras.utils.set_random_seed(0)
    x, y = synthetic_data()
    model = kip.PluginModel(
        Regressor(),
        passes=[
            kip.passes.Expand(),
            # a recomputation checkpoint after each block's normalization
            kip.passes.Recompute(keras.layers.LayerNormalization),
        ],
    )
    model.compile(optimizer="adam", loss="mse")
    history = model.fit(x, y, batch_size=64, epochs=3, verbose=2)
    print(model.kip_report)
    print(f"backend: {kip.backend()}")
    print(f"final loss: {history.history['loss'][-1]:.4f}")


if __name__ == "__main__":
    main()
