"""Dynamically created variables: rebuild, extend optimizer state, checkpoint."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_ipu_plugin as kip
from keras_ipu_plugin.training.session.new_variables import NewVariablesError
from keras_ipu_plugin.training.session.new_variables import extend_optimizer

import models as zoo
from models import GrowAt, GrowingModel  # tests/models.py (tests/ is on sys.path under pytest)


# The model of the dynamically-added-variables discussion (Keras 3 port).
BranchModel = zoo.DynamicBranchModel



def _mixed_batches(n=64):
    """Batches whose first sample sends the discussion model down either branch."""
    rng = np.random.default_rng(0)
    x = rng.uniform(0.0, 0.2, size=(n, 1)).astype("float32")
    x[::8, 0] = np.where(np.arange(n // 8) % 2 == 0, 0.15, 0.05)
    return x, (3 * x + 1).astype("float32")


def _grow_data(n=96):
    rng = np.random.default_rng(1)
    x = rng.normal(size=(n, 3)).astype("float32")
    return x, np.sin(x.sum(axis=1, keepdims=True)).astype("float32")


def _snapshot(variables):
    return {v.path: v.numpy().copy() for v in variables}


@pytest.mark.parametrize("run_eagerly", [False, True])
def test_branch_model_trains_through_plugin_model(run_eagerly):
    x, y = _mixed_batches()
    model = BranchModel()
    plugin = kip.PluginModel(model)
    plugin.compile(optimizer="adam", loss="mse", run_eagerly=run_eagerly)
    plugin.convert(x[:8])
    initial = _snapshot(model.trainable_variables)
    plugin.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    assert set(initial) == {v.path for v in model.dense_layer.weights + model.layer1.weights}
    for variable in model.trainable_variables:
        assert not np.array_equal(initial[variable.path], variable.numpy()), variable.path
    assert model.name in plugin.kip_report.opaque


@pytest.mark.parametrize("run_eagerly", [False, True])
def test_callback_extends_an_already_built_optimizer(run_eagerly):
    """fit builds the optimizer before on_train_begin, with the branch the
    first call took; conversion builds the other branch's layer: the
    optimizer gains state for it without losing any."""
    x, y = _mixed_batches()
    model = BranchModel()
    model(x[:1] + 0.5)  # takes the `return x` branch: layer1 is not built
    assert not model.layer1.built
    model.compile(optimizer="adam", loss="mse", run_eagerly=run_eagerly)
    callback = kip.PluginCallback()
    model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0, callbacks=[callback])
    assert model.layer1.built
    known = {id(v) for v in model.optimizer._trainable_variables}
    assert all(id(v) in known for v in model.trainable_variables)
    assert int(model.optimizer.iterations.numpy()) == 16
    initial = model.layer1.kernel.numpy()  # trained from here on: changes
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0, callbacks=[callback])
    assert not np.array_equal(initial, model.layer1.kernel.numpy())


def test_callback_extends_the_optimizer_keras_built_under_a_strategy(mirrored):
    """Under a strategy `fit` builds the optimizer before `on_train_begin`;
    the head grown at epoch 2 is added to it inside the replicas' trace."""
    x, y = _grow_data()
    with mirrored.scope():
        model = GrowingModel()
        model(x[:1])
        model.compile(optimizer="adam", loss="mse")
    callback = kip.PluginCallback()
    model.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0,
              callbacks=[callback, GrowAt(model, 2)])
    report = str(callback.kip_report)
    assert "optimizer extended" in report and "rebuild" in report
    known = {id(v) for v in model.optimizer._trainable_variables}
    assert all(id(v) in known for v in model.trainable_variables)
    for variable in model.extra.weights:
        assert isinstance(variable.value, tf.distribute.DistributedValues), variable.path


def _trained_then_grown():
    """A model trained plainly (its optimizer built without `extra`), then
    switched to grow: the next fit meets variables the optimizer lacks."""
    x, y = _grow_data()
    model = GrowingModel()
    model.compile(optimizer="adam", loss="mse")
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    model.grow = True
    return model, x, y


@pytest.mark.parametrize("run_eagerly", [False, True])
def test_rebuild_disabled_names_the_new_variables(run_eagerly):
    model, x, y = _trained_then_grown()
    model.compile(optimizer=model.optimizer, loss="mse", run_eagerly=run_eagerly)
    callback = kip.PluginCallback(rebuild_on_new_variables=False)
    with pytest.raises(NewVariablesError) as error:
        model.fit(x, y, batch_size=16, epochs=1, verbose=0, callbacks=[callback])
    message = str(error.value)
    assert model.extra.kernel.path in message and "rebuild_on_new_variables=True" in message


@pytest.mark.parametrize("run_eagerly", [False, True])
def test_new_variables_get_their_update_in_the_step_that_meets_them(run_eagerly):
    model, x, y = _trained_then_grown()
    optimizer = model.optimizer
    iterations = int(optimizer.iterations.numpy())
    model.compile(optimizer=optimizer, loss="mse", run_eagerly=run_eagerly)
    callback = kip.PluginCallback()
    initial = _snapshot(model.extra.weights) if model.extra.built else None
    model.fit(x[:16], y[:16], batch_size=16, epochs=1, verbose=0, callbacks=[callback])
    assert initial is None  # built by the conversion, then trained in its one step
    assert int(optimizer.iterations.numpy()) == iterations + 1
    fresh = keras.layers.Dense(4, kernel_initializer=keras.initializers.GlorotUniform(seed=3))
    fresh.build((None, 4))
    assert not np.array_equal(fresh.kernel.numpy(), model.extra.kernel.numpy())


def _train_growing(plugin_entry, run_eagerly, grown_from_start=False, epochs=3):
    keras.utils.set_random_seed(5)
    x, y = _grow_data()
    model = GrowingModel()
    if grown_from_start:
        model.grow = True
        model(x[:1])
        model.grow = False
    else:
        model(x[:1])
    callbacks = [GrowAt(model, 2)]
    if plugin_entry == "callback":
        model.compile(optimizer="adam", loss="mse", run_eagerly=run_eagerly)
        callbacks.append(kip.PluginCallback())
        trained = model
    elif plugin_entry == "plugin_model":
        trained = kip.PluginModel(model)
        trained.compile(optimizer="adam", loss="mse", run_eagerly=run_eagerly)
    else:
        model.compile(optimizer="adam", loss="mse", run_eagerly=True)
        trained = model
    history = trained.fit(x, y, batch_size=16, epochs=epochs, shuffle=False, verbose=0,
                          callbacks=callbacks)
    return model, trained, history


@pytest.mark.parametrize("entry", ["plugin_model", "callback"])
@pytest.mark.parametrize("run_eagerly", [False, True])
def test_growing_model_equals_a_model_grown_from_the_start(entry, run_eagerly):
    reference, reference_trained, _ = _train_growing("plain", True, grown_from_start=True)
    model, trained, _ = _train_growing(entry, run_eagerly)
    assert model.extra.built
    assert len(model.trainable_variables) == len(reference.trainable_variables)
    for mine, variable in zip(model.trainable_variables, reference.trainable_variables):
        np.testing.assert_allclose(mine.numpy(), variable.numpy(), atol=1e-5, err_msg=variable.path)
    optimizer = trained.optimizer
    assert int(optimizer.iterations.numpy()) == int(reference_trained.optimizer.iterations.numpy())
    ref_state = sorted(np.abs(v.numpy()).sum() for v in reference_trained.optimizer.variables)
    my_state = sorted(np.abs(v.numpy()).sum() for v in optimizer.variables)
    np.testing.assert_allclose(my_state, ref_state, rtol=1e-4, atol=1e-6)


def test_traces_once_per_variable_set_change():
    keras.utils.set_random_seed(5)
    x, y = _grow_data(n=320)
    model = GrowingModel()
    model(x[:1])
    plugin = kip.PluginModel(model)
    plugin.compile(optimizer="adam", loss="mse")
    plugin.fit(x, y, batch_size=16, epochs=4, shuffle=False, verbose=0,
               callbacks=[GrowAt(model, 2)])
    session = plugin._kip_session
    assert session.rebuilds == 1
    # 80 steps: a trace per step would show here; one per change plus
    # Keras's own first-batch and iterator traces does not.
    assert session.traces <= 2 * (1 + session.rebuilds) + 1, session.traces


def test_new_variables_are_mirrored(mirrored):
    x, y = _grow_data()
    with mirrored.scope():
        model = GrowingModel()
        model(x[:1])
        plugin = kip.PluginModel(model)
        plugin.compile(optimizer="adam", loss="mse")
    plugin.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0,
               callbacks=[GrowAt(model, 2)])
    for variable in model.extra.weights:
        assert isinstance(variable.value, tf.distribute.DistributedValues), variable.path
    slots = {id(v) for v in plugin.optimizer.variables}
    assert len(slots) == len(plugin.optimizer.variables)


def test_checkpoint_after_growth_restores_into_a_fresh_model(tmp_path):
    model, trained, _ = _train_growing("plugin_model", False)
    x, _ = _grow_data()
    trained.save_weights(tmp_path / "grown.weights.h5")
    fresh = GrowingModel()
    fresh.grow = True  # take the grown branch once so its variables exist
    fresh_plugin = kip.PluginModel(fresh)
    fresh_plugin(x[:2])
    fresh_plugin.load_weights(tmp_path / "grown.weights.h5")
    np.testing.assert_allclose(fresh_plugin(x), trained(x), atol=1e-6)

    trained.converted.save(tmp_path / "grown.keras")  # the rebuilt graph
    loaded = keras.models.load_model(tmp_path / "grown.keras")
    assert any(layer.name == "extra" for layer in loaded.layers)
    np.testing.assert_allclose(loaded(x), trained(x), atol=1e-6)


def test_branch_no_longer_taken_keeps_its_state():
    keras.utils.set_random_seed(5)
    x, y = _grow_data()
    model = GrowingModel()
    model(x[:1])
    plugin = kip.PluginModel(model)
    plugin.compile(optimizer="adam", loss="mse")

    class Shrink(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            model.grow = epoch == 1

    plugin.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0, callbacks=[Shrink()])
    grown = _snapshot(model.extra.weights)
    assert model.extra.built
    plugin.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    after = _snapshot(model.extra.weights)
    for path, value in grown.items():
        np.testing.assert_array_equal(after[path], value)


@pytest.mark.parametrize("name", [
    "SGD", "Adam", "AdamW", "RMSprop", "Adagrad", "Adadelta", "Adamax", "Nadam",
    "Ftrl", "Lion", "Lamb", "Adafactor",
])
def test_extend_optimizer_keeps_old_state_exactly(name):
    options = {"SGD": {"momentum": 0.9}, "RMSprop": {"momentum": 0.5, "centered": True}}
    optimizer = getattr(keras.optimizers, name)(**options.get(name, {}), use_ema=True)
    old = [keras.Variable(np.ones((3, 2), "float32"), name="old_kernel"),
           keras.Variable(np.ones((2,), "float32"), name="old_bias")]
    optimizer.build(old)
    for step in range(3):
        optimizer.apply([tf.fill(v.shape, 0.1 * (step + 1)) for v in old], old)
    before = [v.numpy().copy() for v in optimizer.variables]
    iterations = int(optimizer.iterations.numpy())
    new = [keras.Variable(np.ones((4,), "float32"), name="new_bias")]
    extend_optimizer(optimizer, new)
    after = optimizer.variables
    assert len(after) > len(before)
    assert int(optimizer.iterations.numpy()) == iterations
    old_slots = [v for v in after if "new_bias" not in v.path]
    assert len(old_slots) == len(before)
    for expected, actual in zip(before, old_slots):
        np.testing.assert_array_equal(actual.numpy(), expected)
    optimizer.apply([tf.fill(v.shape, 0.1) for v in old + new], old + new)
    assert not np.array_equal(new[0].numpy(), np.ones((4,), "float32"))


def test_optimizer_applied_to_a_subset_of_known_variables_is_not_extended():
    """A train step that applies an optimizer to some of the variables it was
    built with (one part of a model) must not be taken for new variables."""
    x, y = _grow_data()

    class PartTrained(GrowingModel):
        def train_step(self, data):
            inputs, targets = data
            part = self.out.trainable_variables
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean((self(inputs, training=True) - targets) ** 2)
            self.optimizer.apply_gradients(zip(tape.gradient(loss, part), part))
            return {"loss": loss}

    model = PartTrained()
    model(x[:1])
    model.compile(optimizer="sgd", loss="mse")
    model.optimizer.build(model.trainable_variables)
    callback = kip.PluginCallback()
    model.fit(x, y, batch_size=16, epochs=1, verbose=0, callbacks=[callback])
    assert "optimizer extended" not in str(callback.kip_report)


class TwoOptimizerGrowing(GrowingModel):
    """A custom train_step with two optimizers: `out` by one, the rest
    (including the head grown at epoch 2) by the other."""

    def __init__(self):
        super().__init__()
        self.head_optimizer = keras.optimizers.SGD(0.05)
        self.body_optimizer = keras.optimizers.Adam(0.01)

    def train_step(self, data):
        x, y = data
        head = self.out.trainable_variables
        body = [v for v in self.trainable_variables if all(v is not h for h in head)]
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((self(x, training=True) - y) ** 2)
        grads = tape.gradient(loss, head + body)
        self.head_optimizer.apply_gradients(zip(grads[: len(head)], head))
        self.body_optimizer.apply_gradients(
            [(g, v) for g, v in zip(grads[len(head):], body) if g is not None])
        return {"loss": loss}


@pytest.mark.parametrize("run_eagerly", [False, True])
def test_two_optimizers_each_learn_only_their_new_variables(run_eagerly):
    keras.utils.set_random_seed(5)
    x, y = _grow_data()
    model = TwoOptimizerGrowing()
    model(x[:1])
    plugin = kip.PluginModel(model)
    plugin.compile(loss="mse", run_eagerly=run_eagerly)
    plugin.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    body_before = {v.path: v.numpy().copy() for v in model.body_optimizer.variables}
    head_iterations = int(model.head_optimizer.iterations.numpy())
    model.grow = True
    plugin.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    body_known = {id(v) for v in model.body_optimizer._trainable_variables}
    head_known = {id(v) for v in model.head_optimizer._trainable_variables}
    assert all(id(v) in body_known for v in model.extra.trainable_variables)
    assert not any(id(v) in head_known for v in model.extra.trainable_variables)
    assert int(model.head_optimizer.iterations.numpy()) == head_iterations + 6
    # the body optimizer's state for the old variables carried over: its
    # iteration count continued, and every old slot still exists
    after = {v.path for v in model.body_optimizer.variables}
    assert set(body_before) <= after
    assert int(model.body_optimizer.iterations.numpy()) == head_iterations + 6
