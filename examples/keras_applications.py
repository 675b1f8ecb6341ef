"""A `keras.applications` model through Expand + Replace, with outputs equal
before and after.

Runs on CPU in under a minute on synthetic data (most of it is TensorFlow
building the train step of a ~160-layer graph, as for plain Keras):

    python examples/keras_applications.py

`keras.applications.MobileNetV3Small` (random weights, 32x32 inputs, 10
classes) is a functional model; `kip.convert_to_functional` accepts it and
re-wires it over the same layers. The passes:

- `Expand()` has nothing custom to inline in a functional model of built-in
  layers (it is there to show that it is harmless);
- `Replace` swaps every Conv2D (the depthwise ones too) for the user's own
  subclasses, copying the weights, and the model's outputs are checked equal
  before and after on a batch.

`kip.PluginModel` does the conversion and passes (here explicitly, with
`convert`, to compare outputs before training) and then trains the passed
graph for two short epochs.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_ipu_plugin as kip  # noqa: E402

SIZE, CLASSES = 32, 10


@keras.saving.register_keras_serializable(package="kip_examples.keras_applications")
class FastConv2D(keras.layers.Conv2D):
    """A user's Conv2D: same config and weights, its own kernel would go here."""

    def call(self, inputs):
        return super().call(inputs)


@keras.saving.register_keras_serializable(package="kip_examples.keras_applications")
class FastDepthwiseConv2D(keras.layers.DepthwiseConv2D):
    """A user's DepthwiseConv2D: same config and weights."""

    def call(self, inputs):
        return super().call(inputs)


def build_model():
    return keras.applications.MobileNetV3Small(
        input_shape=(SIZE, SIZE, 3), weights=None, include_top=True, classes=CLASSES,
        classifier_activation=None,
    )


def make_data(samples=128, seed=0):
    """Images in [0, 255] (the model rescales them itself); the class is
    the brightest of ten 3x3-pixel patches."""
    rng = np.random.default_rng(seed)
    x = rng.uniform(0, 128, size=(samples, SIZE, SIZE, 3)).astype("float32")
    y = rng.integers(0, CLASSES, size=samples)
    for i, label in enumerate(y):
        row, col = divmod(int(label), 5)
        x[i, 4 + 8 * row: 12 + 8 * row, 2 + 6 * col: 6 + 6 * col] += 127.0
    return x, y.astype("int32")


def passes():
    return [
        kip.passes.Expand(),
        kip.passes.Replace({
            keras.layers.DepthwiseConv2D: kip.passes.Replacement(
                FastDepthwiseConv2D, copy_weights=True),
            keras.layers.Conv2D: kip.passes.Replacement(FastConv2D, copy_weights=True),
        }),
    ]


def compile_model(model):
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )


def main():
    keras.utils.set_random_seed(0)
    x, y = make_data()
    model = build_model()
    plugin = kip.PluginModel(model, passes=passes())
    passed = plugin.convert(x[:8])  # convert + Expand + Replace now, not at fit

    before = model(x[:16], training=False)   # the keras.applications model
    after = passed(x[:16], training=False)   # converted, Conv2D layers replaced
    difference = float(np.max(np.abs(np.asarray(before) - np.asarray(after))))
    # The report has a `convert` row per layer (~200 here): print the rest.
    report = passed.kip_report
    traced = report.touched("convert")
    print(kip.Report([e for e in report.entries if e.step != "convert"],
                     dict(report.opaque), dict(report.metrics)))
    print(f"convert: {len(traced)} nodes traced; opaque: {len(report.opaque)}")
    replaced = sum(type(l) in (FastConv2D, FastDepthwiseConv2D) for l in passed.layers)
    print(f"layers replaced: {replaced}; max output difference before/after: {difference:.2e}")
    assert difference < 1e-4, difference

    # The replaced layers own new variables: training updates those (the
    # original model's Conv2D weights stay as they were).
    compile_model(plugin)
    history = plugin.fit(x, y, batch_size=32, epochs=2, verbose=2)
    print(f"backend: {kip.backend()}")
    print(f"final loss: {history.history['loss'][-1]:.4f}")
    return history


if __name__ == "__main__":
    main()
