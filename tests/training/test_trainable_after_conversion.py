"""`trainable` changed after a first `fit`.

Keras keeps a model's train function until `compile` drops it: after
`model.block.trainable = False`, a second `fit` without re-compiling runs the
step traced in the first, which still trains the block (Keras's docstring of
`Layer.trainable` says to re-compile); after re-compiling the block stays
frozen. A second `fit` through a new `PluginCallback` traced a new step and
froze the block, ending 4e-3 from plain Keras. Every entry point now trains
as plain Keras does, both ways.
"""

import keras
import numpy as np
import pytest

import keras_ipu_plugin as kip
from keras_ipu_plugin.training.session.step_functions import StepFunction

layers = keras.layers


class Block(layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = layers.Dense(8, activation="tanh")
        self.norm = layers.BatchNormalization()

    def call(self, x):
        return x + self.norm(self.dense(x))


class Net(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.stem = layers.Dense(8)
        self.block = Block()
        self.head = layers.Dense(1)

    def call(self, x):
        return self.head(self.block(self.stem(x)))


def _data():
    rng = np.random.RandomState(0)
    return rng.rand(48, 4).astype("float32"), rng.rand(48, 1).astype("float32")


def _compile(trained, entry):
    if entry == "scope":
        with kip.scope():
            trained.compile(optimizer="adam", loss="mse")
    else:
        trained.compile(optimizer="adam", loss="mse")


def _train(entry, recompile):
    """Weights after fit, `block.trainable = False`, (re-compile,) fit."""
    x, y = _data()
    keras.utils.set_random_seed(1)
    model = Net()
    model(x[:2])
    trained = kip.PluginModel(model) if entry == "plugin_model" else model
    _compile(trained, entry)

    def fit():
        callbacks = [kip.PluginCallback()] if entry == "callback" else []
        trained.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0,
                    callbacks=callbacks)

    fit()
    model.block.trainable = False
    if recompile:
        _compile(trained, entry)
    fit()
    if entry == "plugin_model":  # the plugin trained it
        assert trained.converted is not None
    elif entry != "plain":
        assert isinstance(model.train_function, StepFunction)
    return [v.numpy() for v in model.weights]


@pytest.mark.parametrize("recompile", [False, True], ids=["same_compile", "recompiled"])
@pytest.mark.parametrize("entry", ["plugin_model", "callback", "scope"])
def test_a_layer_frozen_between_fits_trains_as_plain_keras(entry, recompile):
    expected = _train("plain", recompile)
    actual = _train(entry, recompile)
    for index, (a, e) in enumerate(zip(actual, expected)):
        np.testing.assert_allclose(a, e, rtol=0, atol=1e-6,
                                   err_msg=f"{entry}: weight {index} differs from plain Keras")
