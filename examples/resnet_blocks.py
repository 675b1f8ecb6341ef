"""Image classification with custom residual blocks, through keras_ipu_plugin.

Runs on CPU in a few seconds on synthetic data:

    python examples/resnet_blocks.py

A small ResNet written the way people write one: a `ResidualBlock` custom
layer (Conv2D + BatchNormalization twice, a projection shortcut when the
shape changes) and a subclassed model that stacks them. The passes:

- `Expand()` inlines the blocks into their Keras layers;
- `Replace` swaps every Conv2D and Dense for the user's own subclasses
  (`FastConv2D`, `FastDense`, standing in for accelerator-optimised
  kernels), copying the trained weights into them, so the model computes
  exactly what it computed before.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_ipu_plugin as kip  # noqa: E402

SIZE, CHANNELS, CLASSES = 16, 3, 4


@keras.saving.register_keras_serializable(package="kip_examples.resnet_blocks")
class FastConv2D(keras.layers.Conv2D):
    """A user's Conv2D: same config and weights, its own kernel would go here."""

    def call(self, inputs):
        return super().call(inputs)


@keras.saving.register_keras_serializable(package="kip_examples.resnet_blocks")
class FastDense(keras.layers.Dense):
    """A user's Dense: same config and weights, its own kernel would go here."""

    def call(self, inputs, training=None):
        return super().call(inputs, training=training)


class ResidualBlock(keras.layers.Layer):
    def __init__(self, filters, strides=1, **kwargs):
        super().__init__(**kwargs)
        self.filters, self.strides = filters, strides
        self.conv_1 = keras.layers.Conv2D(filters, 3, strides=strides, padding="same",
                                          use_bias=False, name="conv_1")
        self.bn_1 = keras.layers.BatchNormalization(name="bn_1")
        self.conv_2 = keras.layers.Conv2D(filters, 3, padding="same", use_bias=False,
                                          name="conv_2")
        self.bn_2 = keras.layers.BatchNormalization(name="bn_2")
        self.shortcut = None
        self.shortcut_bn = None

    def build(self, input_shape):
        if self.strides != 1 or input_shape[-1] != self.filters:
            self.shortcut = keras.layers.Conv2D(self.filters, 1, strides=self.strides,
                                                use_bias=False, name="shortcut")
            self.shortcut_bn = keras.layers.BatchNormalization(name="shortcut_bn")

    def call(self, inputs, training=None):
        x = keras.ops.relu(self.bn_1(self.conv_1(inputs), training=training))
        x = self.bn_2(self.conv_2(x), training=training)
        shortcut = inputs
        if self.shortcut is not None:
            shortcut = self.shortcut_bn(self.shortcut(inputs), training=training)
        return keras.ops.relu(x + shortcut)

    def get_config(self):
        return {**super().get_config(), "filters": self.filters, "strides": self.strides}


class SmallResNet(keras.Model):
    def __init__(self, widths=(8, 16), classes=CLASSES, **kwargs):
        super().__init__(**kwargs)
        self.stem = keras.layers.Conv2D(widths[0], 3, padding="same", use_bias=False,
                                        name="stem")
        self.stem_bn = keras.layers.BatchNormalization(name="stem_bn")
        self.blocks = [
            ResidualBlock(width, strides=1 if i == 0 else 2, name=f"block_{i}")
            for i, width in enumerate(widths)
        ]
        self.pool = keras.layers.GlobalAveragePooling2D(name="pool")
        self.head = keras.layers.Dense(classes, name="head")

    def call(self, inputs, training=None):
        x = keras.ops.relu(self.stem_bn(self.stem(inputs), training=training))
        for block in self.blocks:
            x = block(x, training=training)
        return self.head(self.pool(x))


def build_model():
    return SmallResNet()


def make_data(samples=256, seed=0):
    """Noise images; the class is the quadrant holding a bright square."""
    rng = np.random.default_rng(seed)
    x = rng.normal(0.0, 0.3, size=(samples, SIZE, SIZE, CHANNELS)).astype("float32")
    y = rng.integers(0, CLASSES, size=samples)
    half = SIZE // 2
    for i, label in enumerate(y):
        row, col = divmod(int(label), 2)
        x[i, row * half + 2: row * half + 6, col * half + 2: col * half + 6] += 1.0
    return x, y.astype("int32")


def passes():
    return [
        kip.passes.Expand(),
        kip.passes.Replace({
            keras.layers.Conv2D: kip.passes.Replacement(FastConv2D, copy_weights=True),
            keras.layers.Dense: kip.passes.Replacement(FastDense, copy_weights=True),
        }),
    ]


def compile_model(model):
    model.compile(
        optimizer=keras.optimizers.Adam(1e-2),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )


def main():
    keras.utils.set_random_seed(0)
    x, y = make_data()
    model = kip.PluginModel(build_model(), passes=passes())
    compile_model(model)
    history = model.fit(x, y, batch_size=32, epochs=3, verbose=2)
    print(model.kip_report)
    print(f"backend: {kip.backend()}")
    print(f"final loss: {history.history['loss'][-1]:.4f}")
    return history


if __name__ == "__main__":
    main()
