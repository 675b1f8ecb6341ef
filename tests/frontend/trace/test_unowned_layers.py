"""A model that calls a layer it does not own.

keras.io's Perceiver calls a module-level `data_augmentation` Sequential
(random flips and zooms) inside `call`: the augmentation is no sub-layer of
the model, so its seed generators are not the model's variables. Through
`PluginModel` and `PluginCallback` it must train as plain Keras does: the
augmentation active in training (following `training`), drawing from its own
seed generators, which conversion and verification leave where they were.
"""

import keras
import numpy as np
import pytest

import keras_ipu_plugin as kip

layers = keras.layers

data_augmentation = keras.Sequential(
    [layers.RandomFlip("horizontal"), layers.RandomZoom(height_factor=0.2, width_factor=0.2)],
    name="data_augmentation",
)


class Augmenting(keras.Model):
    """Augments with the module-level Sequential, as the Perceiver does."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.conv = layers.Conv2D(4, 3, activation="relu")
        self.pool = layers.GlobalAveragePooling2D()
        self.dropout = layers.Dropout(0.2)
        self.head = layers.Dense(3)

    def call(self, inputs):
        return self.head(self.dropout(self.pool(self.conv(data_augmentation(inputs)))))


def _data():
    rng = np.random.RandomState(0)
    return rng.rand(32, 8, 8, 1).astype("float32"), rng.randint(0, 3, size=(32,))


def _seed_states():
    return [layer.generator.state for layer in data_augmentation.layers]


START = [np.array([11, 0]), np.array([23, 0])]


def _train(entry, verify):
    """Loss, weights and the augmentation's seed states after one epoch."""
    x, y = _data()
    for state, start in zip(_seed_states(), START):
        state.assign(start.astype(state.dtype))
    keras.utils.set_random_seed(4)
    model = Augmenting(name="augmenting")
    trained, callbacks = model, []
    if entry == "plugin_model":
        trained = kip.PluginModel(model, verify=verify)
    elif entry == "callback":
        callbacks = [kip.PluginCallback(verify=verify)]
    trained.compile(optimizer="adam",
                    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    history = trained.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=callbacks)
    return (history.history["loss"][-1], [v.numpy() for v in model.weights],
            [s.numpy() for s in _seed_states()])


@pytest.mark.parametrize("verify", [True, False], ids=["verified", "not_verified"])
@pytest.mark.parametrize("entry", ["plugin_model", "callback"])
def test_a_module_level_augmentation_trains_as_plain_keras(entry, verify):
    loss, weights, seeds = _train("plain", verify)
    # Plain Keras drew from the augmentation: its seeds moved, once per step.
    assert all(not np.array_equal(s, start) for s, start in zip(seeds, START))
    actual_loss, actual_weights, actual_seeds = _train(entry, verify)
    assert actual_loss == pytest.approx(loss, rel=1e-6)
    for index, (a, e) in enumerate(zip(actual_weights, weights)):
        np.testing.assert_allclose(a, e, rtol=0, atol=1e-6, err_msg=f"weight {index}")
    for a, e in zip(actual_seeds, seeds):
        np.testing.assert_array_equal(a, e)
