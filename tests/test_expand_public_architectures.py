"""Expand on constructs of public architectures (issue 13, the corpus of
tests/zoo/): each test a small hand-written model with the one construct
a corpus model showed failing.
"""

import keras
import numpy as np
import tensorflow as tf

import keras_ipu_plugin as kip
from keras_ipu_plugin.passes import Expand
from keras_ipu_plugin.runtime.layer_kinds import is_expandable

layers = keras.layers


def _rng():
    return np.random.default_rng(0)


def _expand_all(model, x):
    converted = kip.convert_to_functional(model, (x,))
    return kip.apply_passes(converted, [Expand("all")])


def _classes(model):
    return [type(node.operation).__name__ for node in model.kip_graph.nodes]


def _gradients(model, x, variables):
    with tf.GradientTape() as tape:
        y = model(x)
        loss = tf.reduce_sum(y * tf.range(1.0, 1.0 + float(y.shape[-1])))
    return [np.asarray(g) for g in tape.gradient(loss, [v.value for v in variables])]


# -- built-in means exported by keras.layers ----------------------------------------
def test_layers_not_exported_by_keras_layers_are_expandable():
    from keras.src.applications.convnext import LayerScale

    class MyDense(layers.Dense):
        pass

    assert not is_expandable(layers.Dense(2))
    assert not is_expandable(layers.LayerNormalization())
    assert is_expandable(MyDense(2))  # a user's subclass is user code
    assert is_expandable(LayerScale(0.5, 3))  # model code shipped inside Keras


def test_a_keras_applications_layer_reading_its_own_weight_expands_with_equal_gradients():
    # ConvNeXt's LayerScale (`x * self.gamma`) lives in keras.src.applications,
    # not in keras.layers: it was left whole by Expand("all"), with no reason.
    from keras.src.applications.convnext import LayerScale

    inputs = keras.Input((4, 4, 3))
    scale = LayerScale(0.5, 3, name="scale")
    model = keras.Model(inputs, scale(layers.Conv2D(3, 1, name="conv")(inputs)))
    x = _rng().normal(size=(2, 4, 4, 3)).astype("float32")
    passed = _expand_all(model, x)
    assert "LayerScale" not in _classes(passed)
    assert "VariableRead" in _classes(passed)
    np.testing.assert_allclose(passed(x), model(x), atol=1e-6)
    for got, want in zip(_gradients(passed, x, model.trainable_variables),
                         _gradients(model, x, model.trainable_variables)):
        np.testing.assert_allclose(got, want, atol=1e-5)
