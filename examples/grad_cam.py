"""Grad-CAM on a subclassed CNN: inner feature maps through the plugin.

    python examples/grad_cam.py

A subclassed model has no `layer.output` to build a feature model from
(its layers were called in Python, not on a graph). Converted, it is a
graph: `kip.create_feature_extractor` returns a model sharing its layers
whose outputs are the last convolution block's feature maps and the logits,
after any pass (here Expand and recomputation checkpoints). Grad-CAM
weights each feature map by the mean gradient of a class score with
respect to it (Selvaraju et al., 2017). Synthetic data, a few seconds on CPU.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import keras_ipu_plugin as kip  # noqa: E402


class ConvBlock(keras.layers.Layer):
    def __init__(self, filters, **kwargs):
        super().__init__(**kwargs)
        self.conv = keras.layers.Conv2D(filters, 3, padding="same", name="conv")
        self.norm = keras.layers.BatchNormalization(name="norm")

    def call(self, x, training=None):
        return keras.ops.relu(self.norm(self.conv(x), training=training))


class SmallCNN(keras.Model):
    def __init__(self, classes=3, **kwargs):
        super().__init__(**kwargs)
        self.block1 = ConvBlock(8, name="block1")
        self.block2 = ConvBlock(16, name="block2")
        self.pool = keras.layers.GlobalAveragePooling2D(name="pool")
        self.head = keras.layers.Dense(classes, name="head")

    def call(self, x, training=None):
        return self.head(self.pool(self.block2(self.block1(x, training=training),
                                               training=training)))


def make_data(samples=64, size=16, classes=3, seed=0):
    """Images whose class is the quadrant holding a bright square."""
    rng = np.random.default_rng(seed)
    x = rng.normal(0.0, 0.1, size=(samples, size, size, 1)).astype("float32")
    y = rng.integers(0, classes, size=samples)
    half = size // 2
    for image, label in zip(x, y):
        row, col = divmod(int(label), 2)
        image[row * half:(row + 1) * half, col * half:(col + 1) * half] += 1.0
    return x, y


def grad_cam(features, images, class_index):
    """Heat maps (batch, height, width) of `class_index` from a feature
    extractor with outputs `maps` and `logits`."""
    with tf.GradientTape() as tape:
        out = features(images, training=False)
        score = tf.reduce_sum(out["logits"][:, class_index])
    grads = tape.gradient(score, out["maps"])
    weights = tf.reduce_mean(grads, axis=(1, 2), keepdims=True)
    return tf.nn.relu(tf.reduce_sum(weights * out["maps"], axis=-1)).numpy()


def main():
    x, y = make_data()
    model = SmallCNN()
    converted = kip.convert_to_functional(model, x[:16])
    passed = kip.apply_passes(converted, [kip.passes.Expand(),
                                          kip.passes.Recompute("block1")])
    passed.compile(optimizer="adam",
                   loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    history = passed.fit(x, y, batch_size=16, epochs=10, verbose=0)
    print(passed.kip_report)
    # `block2` is an expanded block: its path stands for its output.
    features = kip.create_feature_extractor(passed, {"block2": "maps", "head": "logits"})
    heat = grad_cam(features, x[:4], class_index=int(y[0]))
    peak = tuple(int(i) for i in np.unravel_index(int(np.argmax(heat[0])), heat[0].shape))
    print(f"Grad-CAM maps: {heat.shape}, peak of the first at {peak} (class {int(y[0])})")
    print(f"final loss: {history.history['loss'][-1]:.4f}")
    return heat


if __name__ == "__main__":
    main()
