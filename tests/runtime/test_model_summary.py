"""`summary()` of a converted or passed model: node paths, the class each
node really calls, Keras's totals; no alias noise."""

import keras
import numpy as np

import keras_ipu_plugin as kip


class Block(keras.layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.conv = keras.layers.Dense(6, name="conv")  # the same name in both blocks

    def call(self, x):
        return x + self.conv(x)


class Net(keras.Model):
    def __init__(self):
        super().__init__(name="net")
        self.block1, self.block2 = Block(), Block()
        self.head = keras.layers.Dense(2)

    def call(self, x):
        return self.head(self.block2(self.block1(x)))


X = np.random.default_rng(0).random((4, 6)).astype("float32")


def _summary(model, **kwargs):
    lines = []
    model.summary(print_fn=lines.append, **kwargs)
    return "\n".join(lines)


def test_an_expanded_model_is_summarized_by_path_with_the_real_classes():
    converted = kip.convert_to_functional(Net(), X)
    passed = kip.apply_passes(converted, [kip.passes.Expand()])
    assert any(isinstance(layer, kip.LayerAlias) for layer in passed.layers)  # the case
    text = _summary(passed)
    assert "block1.conv (Dense)" in text and "block2.conv (Dense)" in text
    assert "LayerAlias" not in text
    assert f"Total params: {passed.count_params():,}" in text
    assert f"Trainable params: {passed.count_params():,}" in text


def test_a_shared_layer_is_counted_once_and_an_opaque_node_says_so():
    class Twice(keras.Model):
        def __init__(self):
            super().__init__()
            self.shared = keras.layers.Dense(6)

        def call(self, x):
            return self.shared(self.shared(x))

    converted = kip.convert_to_functional(Twice(), X)
    text = _summary(converted)
    assert "(shared)" in text and f"Total params: {converted.count_params():,}" in text


def test_keras_layout_options_and_a_loaded_model_get_keras_own_summary(tmp_path):
    converted = kip.convert_to_functional(Net(), X)
    passed = kip.apply_passes(converted, [kip.passes.Expand()])
    assert "LayerAlias" in _summary(passed, expand_nested=True)  # Keras's, as asked
    passed.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras")
    assert "Total params" in _summary(loaded)
