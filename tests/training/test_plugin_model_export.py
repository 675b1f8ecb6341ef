"""`PluginModel.export()` serves the converted graph once the wrapper has seen
a batch, with that batch's input signature (token ids stay int32), and TFLite
converts what it exported."""

import numpy as np
import pytest
import tensorflow as tf
import keras

import keras_ipu_plugin as kip


class TokenClassifier(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.embed = keras.layers.Embedding(50, 8)
        self.attention = keras.layers.MultiHeadAttention(num_heads=2, key_dim=4)
        self.pool = keras.layers.GlobalAveragePooling1D()
        self.head = keras.layers.Dense(3)

    def call(self, ids):
        h = self.embed(ids)
        h = h + self.attention(h, h)
        return self.head(self.pool(h))


def _tokens(batch=4, length=6):
    return np.random.default_rng(0).integers(0, 50, size=(batch, length)).astype("int32")


@pytest.mark.parametrize("first_use", ["call", "predict", "fit"])
def test_export_after_first_use_serves_what_the_model_computes(tmp_path, first_use):
    keras.utils.set_random_seed(0)
    ids = _tokens()
    plugin = kip.PluginModel(TokenClassifier())
    if first_use == "call":
        plugin(ids)
    elif first_use == "predict":
        plugin.predict(ids, verbose=0)
    else:
        plugin.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
        plugin.fit(ids, np.zeros(len(ids), "int32"), epochs=1, verbose=0)
    plugin.export(str(tmp_path / "served"), verbose=False)

    served = tf.saved_model.load(str(tmp_path / "served"))
    (spec,) = served.signatures["serving_default"].structured_input_signature[1].values()
    assert spec.dtype == tf.int32  # the converted graph's signature, not float32
    np.testing.assert_allclose(served.serve(ids).numpy(), plugin.predict(ids, verbose=0),
                               rtol=1e-6, atol=1e-6)

    tflite = tf.lite.TFLiteConverter.from_saved_model(str(tmp_path / "served")).convert()
    interpreter = tf.lite.Interpreter(model_content=tflite)
    ((key, signature),) = interpreter.get_signature_list().items()
    runner = interpreter.get_signature_runner(key)
    (output,) = runner(**{signature["inputs"][0]: ids}).values()
    np.testing.assert_allclose(output, plugin.predict(ids, verbose=0), atol=1e-5)


def test_export_before_any_batch_says_what_to_do(tmp_path):
    plugin = kip.PluginModel(TokenClassifier(), name="tokens_plugin")
    with pytest.raises(ValueError, match=r"`tokens_plugin` has not seen a batch.*before `export`"):
        plugin.export(str(tmp_path / "served"))
