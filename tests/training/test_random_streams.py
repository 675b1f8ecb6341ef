"""Training through kip draws the same random numbers, in the same order, as
plain Keras: augmentation layers the model calls but does not own (keras.io's
Perceiver keeps its `data_augmentation` Sequential at module level), Dropout
inside functional and Sequential sub-models built in `build()`, and a model
whose `call` takes no `training` (so `fit` calls it as `model(x)`, and each
layer falls back to its own default: RandomFlip draws, Dropout does not).

Each test trains plain Keras and kip from one seed and compares every
variable of the model (trainable and non-trainable) and the seed-generator
states of the layers the model does not own.
"""

import keras
import numpy as np
import pytest
from keras import layers

import keras_ipu_plugin as kip

# The augmentation the model calls without owning it (a module-level object
# in the example); remade for each twin from the same seed.
_UNOWNED = {}


def _sub_model(width):
    inputs = keras.Input((width,))
    hidden = layers.Dense(width, activation="relu")(inputs)
    return keras.Model(inputs, layers.Dropout(0.3)(hidden), name="block")


class Classifier(keras.Model):
    """Perceiver's shape: sub-models made in `build`, an unowned
    augmentation called first, `call` without `training`."""

    def build(self, input_shape):
        self.flatten = layers.Flatten()
        self.project = layers.Dense(8)
        self.block = _sub_model(8)
        self.head = keras.Sequential([layers.Dense(8), layers.Dropout(0.2), layers.Dense(3)],
                                     name="head")
        super().build(input_shape)

    def call(self, images):
        images = _UNOWNED["augment"](images)
        return self.head(self.block(self.project(self.flatten(images))))


class TrainingClassifier(Classifier):
    """The same, with a `call` that takes `training` and passes it on."""

    def call(self, images, training=None):
        images = _UNOWNED["augment"](images, training=training)
        hidden = self.block(self.project(self.flatten(images)), training=training)
        return self.head(hidden, training=training)


def _twin(model_class):
    keras.utils.set_random_seed(11)
    _UNOWNED["augment"] = keras.Sequential(
        [layers.RandomFlip("horizontal"), layers.RandomZoom(0.2)], name="augment")
    return model_class(name="classifier"), _UNOWNED["augment"]


def _data():
    rng = np.random.RandomState(0)
    return rng.rand(24, 6, 6, 3).astype("float32"), rng.randint(0, 3, 24)


def _compile_kwargs():
    return {"optimizer": keras.optimizers.Adam(1e-2),
            "loss": keras.losses.SparseCategoricalCrossentropy(from_logits=True)}


def _fit(model_class, how):
    model, augment = _twin(model_class)
    x, y = _data()
    fitter, callbacks = model, []
    if how == "plugin_model":
        fitter = kip.PluginModel(model)
    elif how == "plugin_callback":
        callbacks = [kip.PluginCallback()]
    fitter.compile(**_compile_kwargs())
    history = fitter.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0,
                         callbacks=callbacks)
    values = {v.path: np.asarray(v) for v in model.variables}
    values.update({f"augment/{v.path}": np.asarray(v) for v in augment.variables})
    return history.history["loss"], values


@pytest.mark.parametrize("model_class", [Classifier, TrainingClassifier])
@pytest.mark.parametrize("how", ["plugin_model", "plugin_callback"])
def test_random_layers_draw_as_in_plain_keras(model_class, how):
    """Losses, every variable and the unowned augmentation's seed states
    equal plain Keras after two epochs of training."""
    plain_losses, plain = _fit(model_class, None)
    losses, values = _fit(model_class, how)
    np.testing.assert_allclose(losses, plain_losses, rtol=1e-5)
    assert len(values) == len(plain)  # the same variables, in the same order
    for (name, expected), actual in zip(plain.items(), values.values()):
        np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-6, err_msg=name)


def test_conversion_draws_nothing_from_unowned_layers():
    """Converting consumes no draw plain Keras would not: the seed states of
    an augmentation the model calls but does not own are as they were."""
    model, augment = _twin(Classifier)
    x, _ = _data()
    before = [np.asarray(v) for v in augment.variables]
    kip.convert_to_functional(model, x)
    after = [np.asarray(v) for v in augment.variables]
    assert len(after) == 2  # the two random layers' seed states
    for a, b in zip(before + [None] * (len(after) - len(before)), after):
        if a is not None:
            np.testing.assert_array_equal(a, b)
