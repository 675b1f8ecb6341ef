"""Training integration: PluginModel, PluginCallback and kip.scope."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_ipu_plugin as kip
import models as zoo  # tests/models.py (tests/ is on sys.path under pytest)


@keras.saving.register_keras_serializable(package="kip_tests")
class Net(keras.Model):
    def __init__(self, width=16, **kwargs):
        super().__init__(**kwargs)
        self.width = width
        self.hidden = keras.layers.Dense(width, activation="relu")
        self.norm = keras.layers.LayerNormalization()
        self.out = keras.layers.Dense(1)

    def call(self, x, training=None):
        return self.out(self.norm(self.hidden(x)))

    def get_config(self):
        return {"width": self.width, **super().get_config()}


class WideAndDeep(keras.Model):
    """Two parts, two optimizers, a custom train_step (the premade-model RFC)."""

    def __init__(self):
        super().__init__()
        self.linear = keras.layers.Dense(1, name="linear")
        self.deep_hidden = keras.layers.Dense(8, activation="relu", name="deep_hidden")
        self.deep_out = keras.layers.Dense(1, name="deep_out")
        self.linear_optimizer = keras.optimizers.SGD(0.05)
        self.deep_optimizer = keras.optimizers.Adam(0.01)
        self.running_mean = keras.Variable(0.0, trainable=False, name="running_mean")

    def call(self, x):
        return self.linear(x) + self.deep_out(self.deep_hidden(x))

    def train_step(self, data):
        x, y = data
        linear_vars = self.linear.trainable_variables
        deep_vars = self.deep_hidden.trainable_variables + self.deep_out.trainable_variables
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((self(x, training=True) - y) ** 2)
        grads = tape.gradient(loss, linear_vars + deep_vars)
        self.linear_optimizer.apply_gradients(zip(grads[: len(linear_vars)], linear_vars))
        self.deep_optimizer.apply_gradients(zip(grads[len(linear_vars):], deep_vars))
        # a part trained without any gradient: a running statistic
        self.running_mean.assign(0.9 * self.running_mean + 0.1 * tf.reduce_mean(y))
        return {"loss": loss}


def _data(n=64, features=8, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, features)).astype("float32"), rng.normal(size=(n, 1)).astype("float32")


def _losses(make, fit_kwargs, run_eagerly=False, epochs=3, data=None):
    keras.utils.set_random_seed(7)
    x, y = data or _data()
    model, callbacks = make()
    model.compile(optimizer="adam", loss="mse", run_eagerly=run_eagerly)
    history = model.fit(x, y, batch_size=16, epochs=epochs, shuffle=False, verbose=0,
                        callbacks=callbacks, **fit_kwargs)
    return history.history["loss"], model


def _plain():
    return Net(), []


@pytest.mark.parametrize("run_eagerly", [False, True])
def test_plugin_model_matches_plain_keras(run_eagerly):
    expected, _ = _losses(_plain, {}, run_eagerly)
    actual, model = _losses(lambda: (kip.PluginModel(Net(), passes=[kip.passes.Expand()]), []), {}, run_eagerly)
    np.testing.assert_allclose(actual, expected, atol=1e-5)
    assert isinstance(model.converted, kip.KipFunctional)
    assert "convert" in str(model.kip_report)


@pytest.mark.parametrize("run_eagerly", [False, True])
def test_callback_matches_plain_keras(run_eagerly):
    expected, _ = _losses(_plain, {}, run_eagerly)
    callback = kip.PluginCallback(passes=[kip.passes.Expand(), kip.passes.Outline(keras.layers.Dense)])
    actual, model = _losses(lambda: (Net(), [callback]), {}, run_eagerly)
    np.testing.assert_allclose(actual, expected, atol=1e-5)
    assert callback.converted is not None
    assert {v.path for v in callback.converted.weights} == {v.path for v in model.weights}


def test_callback_with_dataset_does_not_skip_a_batch():
    x, y = _data()
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
    keras.utils.set_random_seed(7)
    plain = Net()
    plain.compile(optimizer="sgd", loss="mse")
    expected = plain.fit(dataset, epochs=2, verbose=0).history["loss"]
    keras.utils.set_random_seed(7)
    model = Net()
    model.compile(optimizer="sgd", loss="mse")
    actual = model.fit(dataset, epochs=2, verbose=0, callbacks=[kip.PluginCallback()]).history["loss"]
    np.testing.assert_allclose(actual, expected, atol=1e-5)
    assert int(model.optimizer.iterations.numpy()) == 8


class _Batches(keras.utils.PyDataset):
    def __init__(self, x, y, batch):
        super().__init__()
        self.x, self.y, self.batch = x, y, batch

    def __len__(self):
        return len(self.x) // self.batch

    def __getitem__(self, index):
        rows = slice(index * self.batch, (index + 1) * self.batch)
        return self.x[rows], self.y[rows]


def _dict_data(n=48):
    rng = np.random.RandomState(3)
    x = {"features": rng.normal(size=(n, 5)).astype("float32"),
         "tokens": rng.randint(0, 10, size=(n, 7)).astype("int64")}
    y = {"score": rng.normal(size=(n, 1)).astype("float32"),
         "label": rng.normal(size=(n, 3)).astype("float32")}
    return x, y


@pytest.mark.parametrize("source", ["py_dataset", "dict_arrays"])
def test_callback_takes_the_first_batch_of_any_source_without_skipping_it(source):
    def train(callbacks):
        keras.utils.set_random_seed(7)
        if source == "py_dataset":
            model, (x, y) = Net(), _data()
            data = {"x": _Batches(x, y, 16)}
        else:
            model, (x, y) = zoo.DictModel(), _dict_data()
            data = {"x": x, "y": y, "batch_size": 16, "shuffle": False}
        model.compile(optimizer="sgd", loss="mse")
        history = model.fit(**data, epochs=2, verbose=0, callbacks=callbacks)
        return history.history["loss"], model

    expected, _ = train([])
    callback = kip.PluginCallback(passes=[kip.passes.Expand()])
    actual, model = train([callback])
    np.testing.assert_allclose(actual, expected, atol=1e-5)
    assert callback.converted is not None
    assert int(model.optimizer.iterations.numpy()) == 2 * (64 if source == "py_dataset" else 48) // 16


def test_scope_matches_plain_keras():
    expected, _ = _losses(_plain, {})
    keras.utils.set_random_seed(7)
    x, y = _data()
    with kip.scope(passes=[kip.passes.Expand()]):
        model = Net()
        model.compile(optimizer="adam", loss="mse")
    other = Net()
    other.compile(optimizer="adam", loss="mse")  # compiled outside: untouched
    actual = model.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0).history["loss"]
    np.testing.assert_allclose(actual, expected, atol=1e-5)
    assert kip.scope_report(model) is not None
    assert kip.scope_report(other) is None and other.train_function is None


def test_custom_train_step_with_two_optimizers_trains_both_parts():
    x, y = _data()
    wrapped = WideAndDeep()
    model = kip.PluginModel(wrapped)
    model.compile(loss="mse")
    model(x[:4])
    linear_before = wrapped.linear.kernel.numpy().copy()
    deep_before = wrapped.deep_out.kernel.numpy().copy()
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert not np.array_equal(linear_before, wrapped.linear.kernel.numpy())
    assert not np.array_equal(deep_before, wrapped.deep_out.kernel.numpy())
    assert int(wrapped.linear_optimizer.iterations.numpy()) == 4
    assert int(wrapped.deep_optimizer.iterations.numpy()) == 4
    assert float(wrapped.running_mean.numpy()) != 0.0
    assert model.converted is not None


def test_weights_interchange_both_ways(tmp_path):
    x, y = _data()
    model = kip.PluginModel(Net())
    model.compile(optimizer="adam", loss="mse")
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    model.save_weights(tmp_path / "wrapper.weights.h5")
    fresh = Net()
    fresh(x[:2])
    fresh.load_weights(tmp_path / "wrapper.weights.h5")
    np.testing.assert_allclose(fresh(x), model(x), atol=1e-6)

    original = Net()
    original(x[:2])
    original.save_weights(tmp_path / "original.weights.h5")
    wrapper = kip.PluginModel(Net())
    wrapper(x[:2])
    wrapper.load_weights(tmp_path / "original.weights.h5")
    np.testing.assert_allclose(wrapper(x), original(x), atol=1e-6)


def test_save_and_load_model(tmp_path):
    x, y = _data()
    model = kip.PluginModel(Net(), passes={"expand": "all"})
    model.compile(optimizer="adam", loss="mse")
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    model.save(tmp_path / "plugin.keras")
    loaded = keras.models.load_model(tmp_path / "plugin.keras")
    np.testing.assert_allclose(loaded.predict(x, verbose=0), model.predict(x, verbose=0), atol=1e-6)
    # The optimizer state came back too: training on continues identically.
    assert int(loaded.optimizer.iterations.numpy()) == int(model.optimizer.iterations.numpy()) == 4
    for fitted in (model, loaded):
        fitted.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False)
    for expected, actual in zip(model.get_weights(), loaded.get_weights()):
        np.testing.assert_allclose(actual, expected, atol=1e-6)


def test_checkpoint_and_early_stopping_callbacks(tmp_path):
    x, y = _data()
    model = kip.PluginModel(Net())
    model.compile(optimizer="adam", loss="mse")
    path = tmp_path / "best.weights.h5"
    model.fit(x, y, validation_data=(x, y), batch_size=16, epochs=3, verbose=0, callbacks=[
        keras.callbacks.ModelCheckpoint(path, save_weights_only=True),
        keras.callbacks.EarlyStopping(patience=1),
    ])
    fresh = Net()
    fresh(x[:2])
    fresh.load_weights(path)
    np.testing.assert_allclose(fresh(x), model(x), atol=1e-6)


class _Interrupt(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        if epoch == 2:
            raise RuntimeError("interrupted")


def test_backup_and_restore_resumes_to_the_same_weights(tmp_path):
    x, y = _data()

    def fresh_model():
        keras.utils.set_random_seed(11)
        model = kip.PluginModel(Net())
        model.compile(optimizer="adam", loss="mse")
        return model

    reference = fresh_model()
    reference.fit(x, y, batch_size=16, epochs=4, shuffle=False, verbose=0)

    backup = keras.callbacks.BackupAndRestore(str(tmp_path / "backup"))
    interrupted = fresh_model()
    with pytest.raises(RuntimeError):
        interrupted.fit(x, y, batch_size=16, epochs=4, shuffle=False, verbose=0,
                        callbacks=[backup, _Interrupt()])
    resumed = fresh_model()
    resumed.fit(x, y, batch_size=16, epochs=4, shuffle=False, verbose=0, callbacks=[backup])
    for expected, actual in zip(reference.weights, resumed.weights):
        np.testing.assert_allclose(actual.numpy(), expected.numpy(), atol=1e-5)


def test_errors_before_any_training_step():
    x, y = _data()
    with pytest.raises(kip.PassError, match="not a kip pass"):
        kip.PluginModel(Net(), passes=["expand"])
    with pytest.raises(kip.PassError, match="must be a kip pass, a list of them"):
        kip.PluginCallback(passes=42)
    never_compiled = kip.PluginModel(Net())
    with pytest.raises(ValueError, match="compile"):
        never_compiled.fit(x, y, verbose=0)

    net = Net()
    net(x[:2])
    before = [v.numpy().copy() for v in net.weights]
    model = kip.PluginModel(net, passes={"recompute": ["no_such_layer"]})
    model.compile(optimizer="adam", loss="mse")
    with pytest.raises(kip.PassError, match="no_such_layer"):
        model.fit(x, y, verbose=0)
    for b, v in zip(before, net.weights):
        np.testing.assert_array_equal(b, v.numpy())
    assert int(model.optimizer.iterations.numpy()) == 0


class TrackedLossModel(keras.Model):
    """The keras.io custom-train_step pattern: its own tracker in `metrics`,
    and a helper method that runs the forward pass."""

    def __init__(self):
        super().__init__()
        self.hidden = keras.layers.Dense(8, activation="relu")
        self.out = keras.layers.Dense(1)
        self.loss_tracker = keras.metrics.Mean(name="loss")

    def call(self, x):
        return self.out(self.hidden(x))

    @property
    def metrics(self):
        return [self.loss_tracker]

    def squared_error(self, x, y):
        return tf.reduce_mean((self(x, training=True) - y) ** 2)

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = self.squared_error(x, y)
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
        self.loss_tracker.update_state(loss)
        return {"loss": self.loss_tracker.result()}


class CountingDense(keras.layers.Dense):
    calls = 0

    def call(self, inputs, training=None):
        CountingDense.calls += 1
        return super().call(inputs)


def test_custom_metrics_property_and_helper_methods_are_honoured():
    x, y = _data()
    keras.utils.set_random_seed(3)
    plain = TrackedLossModel()
    plain.compile(optimizer="sgd")
    expected = plain.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0).history["loss"]

    keras.utils.set_random_seed(3)
    CountingDense.calls = 0
    plugin = kip.PluginModel(TrackedLossModel(), passes=[kip.passes.Replace(
        {keras.layers.Dense: kip.passes.Replacement(CountingDense, copy_weights=True)})])
    plugin.compile(optimizer="sgd")
    plugin.convert(x[:16])
    CountingDense.calls = 0  # Replace itself called the new layers
    actual = plugin.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0).history["loss"]
    np.testing.assert_allclose(actual, expected, atol=1e-5)
    # the helper's `self(x)` ran the converted graph, whose Dense layers
    # are the replacements (counted while the train step is traced)
    assert CountingDense.calls > 0


class WideDense(keras.layers.Dense):
    """A stand-in for an accelerator-optimised Dense."""


def test_replaced_layers_train_save_and_load_in_the_wrapped_layout(tmp_path):
    x, y = _data()
    model = Net()
    plugin = kip.PluginModel(model, passes=[kip.passes.Replace(
        {keras.layers.Dense: kip.passes.Replacement(WideDense, copy_weights=True)})])
    plugin.compile(optimizer="adam", loss="mse")
    plugin.convert(x[:16])
    replaced = {id(v) for old, _ in plugin.converted.kip_replaced for v in old.weights}
    assert replaced and not replaced & {id(v) for v in plugin.trainable_variables}
    plugin.fit(x, y, batch_size=16, epochs=2, verbose=0)
    plugin.save_weights(tmp_path / "plugin.weights.h5")
    fresh = Net()
    fresh(x[:2])
    fresh.load_weights(tmp_path / "plugin.weights.h5")
    np.testing.assert_allclose(fresh(x), plugin(x), atol=1e-5)

    again = kip.PluginModel(Net(), passes=[kip.passes.Replace(
        {keras.layers.Dense: kip.passes.Replacement(WideDense, copy_weights=True)})])
    again.compile(optimizer="adam", loss="mse")
    again.convert(x[:16])
    again.load_weights(tmp_path / "plugin.weights.h5")
    np.testing.assert_allclose(again(x), plugin(x), atol=1e-5)



class TracedShapes(keras.layers.Layer):
    """Passes its input on; records the shape of each graph (not eager, not
    symbolic-Keras) tensor it is called on: the shapes a compiled step is
    traced with."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.traced = []

    def call(self, x):
        if tf.is_tensor(x) and not isinstance(x, keras.KerasTensor) and not tf.executing_eagerly():
            self.traced.append(tuple(x.shape))
        return x


class AttentionPooled(keras.Model):
    """Self-attention, then attention pooling (a softmax over the sequence
    of a Dense(1)), as CCT's: the pooling's bias and the attention's key
    bias shift softmax inputs uniformly, so their gradients are zero but
    for rounding, which Adam turns into steps. Training equals plain Keras
    only if every step computes exactly what plain Keras's step computes."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.shapes = TracedShapes()
        self.embed = keras.layers.Dense(8, activation="gelu")
        self.attention = keras.layers.MultiHeadAttention(2, 4)
        self.score = keras.layers.Dense(1)
        self.logits = keras.layers.Dense(3)

    def call(self, x):
        x = self.embed(self.shapes(x))
        x = x + self.attention(x, x)
        weights = keras.ops.softmax(self.score(x), axis=1)
        pooled = keras.ops.squeeze(keras.ops.matmul(keras.ops.transpose(weights, (0, 2, 1)), x), 1)
        return self.logits(pooled)


def _attention_pooled_fit(how):
    rng = np.random.RandomState(0)
    x = rng.rand(12, 6, 5).astype("float32")
    y = keras.utils.to_categorical(rng.randint(0, 3, size=(12,)), 3)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(4)
    keras.utils.set_random_seed(3)
    model = AttentionPooled()
    model(x[:4])
    model.shapes.traced.clear()  # building traced it in a scratch graph
    trainee, callbacks = model, []
    if how == "plugin_model":
        trainee = kip.PluginModel(model)
    elif how == "plugin_callback":
        callbacks = [kip.PluginCallback()]
    trainee.compile(optimizer=keras.optimizers.Adam(1e-3),
                    loss=keras.losses.CategoricalCrossentropy(from_logits=True))
    history = trainee.fit(dataset, epochs=1, verbose=0, shuffle=False, callbacks=callbacks)
    return history.history["loss"], [np.array(v.numpy()) for v in model.weights], model.shapes.traced


@pytest.mark.parametrize("how", ["plugin_model", "plugin_callback"])
def test_the_first_compiled_step_is_traced_with_the_shapes_fit_gives(how):
    # Traced with the first batch's static shapes, the step's graph is
    # optimised otherwise than plain Keras's and rounds otherwise (a CCT's
    # pooling bias then trained differently).
    expected_loss, expected, expected_shapes = _attention_pooled_fit("plain")
    loss, actual, shapes = _attention_pooled_fit(how)
    assert set(expected_shapes) == {(None, 6, 5)}, expected_shapes
    assert set(shapes) == {(None, 6, 5)}, shapes
    assert loss == expected_loss
    for e, a in zip(expected, actual):
        np.testing.assert_array_equal(a, e)
