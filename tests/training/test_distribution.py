"""MirroredStrategy on two logical CPU devices, end to end."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_ipu_plugin as kip


class Block(keras.layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(16, activation="tanh")
        self.norm = keras.layers.LayerNormalization()

    def call(self, x):
        return x + self.norm(self.dense(x))


class Net(keras.Model):
    def __init__(self):
        super().__init__()
        self.stem = keras.layers.Dense(16)
        self.block_a = Block(name="block_a")
        self.block_b = Block(name="block_b")
        self.head = keras.layers.Dense(1)

    def call(self, x):
        return self.head(self.block_b(self.block_a(self.stem(x))))


class FastDense(keras.layers.Dense):
    pass


def _data(n=128):
    rng = np.random.default_rng(2)
    x = rng.normal(size=(n, 8)).astype("float32")
    return x, np.sin(x.sum(axis=1, keepdims=True)).astype("float32")


PASSES = {
    "plain": [],
    "expand_replace": [
        kip.passes.Expand(),
        kip.passes.Replace({keras.layers.Dense: kip.passes.Replacement(FastDense, copy_weights=True)}),
    ],
    "recompute": [kip.passes.Recompute(["block_a", "block_b"])],
}


def _train(strategy, passes, entry):
    keras.utils.set_random_seed(21)
    x, y = _data()
    with strategy.scope():
        model = Net()
        model(x[:2])
        if entry == "plugin_model":
            trained = kip.PluginModel(model, passes=passes)
            trained.compile(optimizer="sgd", loss="mse")
            callbacks = []
        else:
            model.compile(optimizer="sgd", loss="mse")
            trained, callbacks = model, [kip.PluginCallback(passes=passes)]
    history = trained.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0,
                          callbacks=callbacks)
    return history.history["loss"], trained


@pytest.mark.parametrize("passes", sorted(PASSES))
def test_mirrored_loss_equals_single_device(mirrored, passes):
    single, _ = _train(tf.distribute.get_strategy(), PASSES[passes], "plugin_model")
    double, trained = _train(mirrored, PASSES[passes], "plugin_model")
    np.testing.assert_allclose(double, single, atol=1e-5)
    for variable in trained.trainable_variables:
        assert isinstance(variable.value, tf.distribute.DistributedValues), variable.path


def test_mirrored_callback_and_scope(mirrored):
    single, _ = _train(tf.distribute.get_strategy(), [kip.passes.Expand()], "callback")
    double, _ = _train(mirrored, [kip.passes.Expand()], "callback")
    np.testing.assert_allclose(double, single, atol=1e-5)

    keras.utils.set_random_seed(21)
    x, y = _data()
    with kip.scope(mirrored, passes=[kip.passes.Expand()]):
        model = Net()
        model(x[:2])
        model.compile(optimizer="sgd", loss="mse")
    scoped = model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0).history["loss"]
    np.testing.assert_allclose(scoped, single, atol=1e-5)


def test_outline_under_mirrored(mirrored):
    x, y = _data()
    with mirrored.scope():
        model = Net()
        model(x[:2])
        trained = kip.PluginModel(model, passes=[kip.passes.Outline(Block)])
        trained.compile(optimizer="sgd", loss="mse")
    before = [v.numpy().copy() for v in model.trainable_variables]
    trained.fit(x, y, batch_size=32, epochs=1, verbose=0)
    assert all(not np.array_equal(b, v.numpy()) for b, v in zip(before, model.trainable_variables))


def test_model_built_outside_the_strategy_is_a_clear_error(mirrored):
    x, y = _data()
    model = Net()
    model(x[:2])  # variables created outside the strategy
    before = [v.numpy().copy() for v in model.weights]
    with mirrored.scope():
        plugin = kip.PluginModel(model)
        plugin.compile(optimizer="sgd", loss="mse")
    with pytest.raises(kip.ConversionError, match="outside the MirroredStrategy"):
        plugin.fit(x, y, batch_size=32, epochs=1, verbose=0)
    for b, v in zip(before, model.weights):
        np.testing.assert_array_equal(b, v.numpy())


def test_distributed_dataset_converts_with_the_per_replica_batch(mirrored):
    x, y = _data(n=64)
    with mirrored.scope():
        model = Net()
        model(x[:2])
        dataset = mirrored.experimental_distribute_dataset(
            tf.data.Dataset.from_tensor_slices((x, y)).batch(64))
        converted = kip.convert_to_functional(model, dataset, static_batch=True)
    assert converted.inputs[0].shape == (32, 8)


def test_static_batch_not_divisible_by_replicas(mirrored):
    x, _ = _data(n=63)
    with mirrored.scope():
        model = Net()
        model(x[:2])
        with pytest.raises(kip.InputDataError, match="not divisible"):
            kip.convert_to_functional(model, x, static_batch=True)


def _trained_without_a_strategy(entry):
    x, y = _data()
    model = Net()
    model(x[:2])
    if entry == "plugin_model":
        trained, callbacks = kip.PluginModel(model, passes=[kip.passes.Expand()]), []
    else:
        trained, callbacks = model, [kip.PluginCallback(passes=[kip.passes.Expand()])]
    trained.compile(optimizer="sgd", loss="mse")
    trained.fit(x, y, batch_size=32, epochs=1, verbose=0, callbacks=callbacks)
    return model, trained, callbacks


@pytest.mark.parametrize("entry", ["plugin_model", "callback"])
def test_a_model_trained_without_a_strategy_then_fitted_under_mirrored_is_a_clear_error(
        mirrored, entry):
    """A model built and trained under the default strategy, then compiled
    and fitted inside a MirroredStrategy scope, is refused before any step,
    naming the strategy it was built under and what to do (plain Keras fails
    in the step with a bare AssertionError); its weights are unchanged."""
    x, y = _data()
    model, trained, callbacks = _trained_without_a_strategy(entry)
    before = [v.numpy().copy() for v in model.weights]
    with mirrored.scope():
        trained.compile(optimizer="sgd", loss="mse")
        with pytest.raises(kip.ConversionError) as raised:
            trained.fit(x, y, batch_size=32, epochs=1, verbose=0, callbacks=callbacks)
    message = str(raised.value)
    assert f"of model `{model.name}`" in message
    assert "outside the MirroredStrategy" in message
    assert "under the default strategy" in message
    assert "strategy.scope()" in message and "re-create it" in message
    assert int(trained.optimizer.iterations.numpy()) == 0  # no step ran
    for b, v in zip(before, model.weights):
        np.testing.assert_array_equal(b, v.numpy())


def test_a_model_compiled_under_mirrored_then_fitted_outside_is_a_clear_error(mirrored):
    """Compiled inside a MirroredStrategy scope (its optimizer made there) but
    fitted outside it, under the default strategy the model was built under:
    refused before any step, naming the optimizer and both strategies."""
    x, y = _data()
    model = Net()
    model(x[:2])
    plugin = kip.PluginModel(model)
    with mirrored.scope():
        plugin.compile(optimizer="sgd", loss="mse")
    with pytest.raises(kip.ConversionError) as raised:
        plugin.fit(x, y, batch_size=32, epochs=1, verbose=0)
    message = str(raised.value)
    assert "of optimizer" in message
    assert "outside the default strategy" in message and "under the MirroredStrategy" in message
    assert int(plugin.optimizer.iterations.numpy()) == 0
