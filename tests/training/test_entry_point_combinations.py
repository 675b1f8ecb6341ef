"""Entry points used together, and the entry points' own options.

A `PluginModel` compiled inside `kip.scope()` (the README's IPU training
block) or fitted with a `PluginCallback` is the plugin already: it trains as
it does alone, with one conversion. A model compiled inside the scope and
given a callback converts once too. Passes or settings that would be
silently dropped by such a combination are an error naming both.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_ipu_plugin as kip
from keras_ipu_plugin.training.session import step_functions
from keras_ipu_plugin.training.session import session as steps_module


class Block(keras.layers.Layer):
    """A layer of the user's: what `Expand` inlines."""

    def __init__(self, units, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(units, activation="relu")

    def call(self, x):
        return self.dense(x)


class Regressor(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.hidden = Block(8)
        self.out = keras.layers.Dense(1)

    def call(self, x):
        return self.out(self.hidden(x))


def _data(n=64):
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, 3)).astype("float32"), rng.normal(size=(n, 1)).astype("float32")


@pytest.fixture
def conversions(monkeypatch):
    """How many conversions the entry points make (every one goes through
    `steps.convert_call`)."""
    made = []
    convert_call = steps_module.convert_call

    def counting(callee, *args, **kwargs):
        made.append(callee.name)
        return convert_call(callee, *args, **kwargs)

    monkeypatch.setattr(steps_module, "convert_call", counting)
    return made


def _fresh_model():
    keras.utils.set_random_seed(7)
    model = Regressor(name="regressor")
    model(_data()[0][:1])
    return model


def _train(how, passes=()):
    """Train a fresh `Regressor` one way; return (weights, what was used)."""
    x, y = _data()
    model = _fresh_model()
    callbacks = []
    used = {}
    if how == "plugin":
        trainee = kip.PluginModel(model, passes=passes)
        trainee.compile(optimizer="adam", loss="mse")
    elif how == "plugin_in_scope":
        with kip.scope(passes=passes):
            trainee = kip.PluginModel(model, passes=passes)
            trainee.compile(optimizer="adam", loss="mse")
    elif how == "plugin_with_callback":
        trainee = kip.PluginModel(model, passes=passes)
        trainee.compile(optimizer="adam", loss="mse")
        callbacks = [kip.PluginCallback()]
    elif how == "plugin_in_scope_with_callback":
        with kip.scope():
            trainee = kip.PluginModel(model, passes=passes)
            trainee.compile(optimizer="adam", loss="mse")
        callbacks = [kip.PluginCallback(passes=passes)]
    else:
        raise ValueError(how)
    keras.utils.set_random_seed(11)
    trainee.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False, callbacks=callbacks)
    used["trainee"] = trainee
    used["callbacks"] = callbacks
    return [w.copy() for w in model.get_weights()], used


@pytest.mark.parametrize(
    "how", ["plugin_in_scope", "plugin_with_callback", "plugin_in_scope_with_callback"])
def test_plugin_model_with_scope_or_callback_trains_as_it_does_alone(how, conversions):
    alone, _ = _train("plugin")
    assert conversions == ["regressor"]
    conversions.clear()

    weights, used = _train(how)  # recursed ~1000 frames deep before
    assert conversions == ["regressor"]  # one conversion, the wrapper's own
    for mine, theirs in zip(weights, alone):
        np.testing.assert_array_equal(mine, theirs)
    plugin = used["trainee"]
    for callback in used["callbacks"]:
        assert callback.kip_report is plugin.kip_report is not None
        assert callback.converted is plugin.converted
    if "scope" in how:
        assert kip.scope_report(plugin) is plugin.kip_report


def test_plugin_model_with_passes_inside_a_scope_with_the_same_passes(conversions):
    """The README's IPU block gives the scope and the wrapper the same passes
    (distinct objects): the wrapper runs them, once."""
    x, y = _data()
    with kip.scope(passes=[kip.passes.Expand("all")]):
        plugin = kip.PluginModel(_fresh_model(), passes=[kip.passes.Expand("all")])
        plugin.compile(optimizer="sgd", loss="mse")
    plugin.fit(x, y, batch_size=16, verbose=0)
    assert conversions == ["regressor"]
    assert kip.scope_report(plugin) is plugin.kip_report
    assert [e.layer for e in plugin.kip_report.entries if e.step == "expand"] == ["hidden"]


def test_callback_with_other_passes_than_the_plugin_model_is_refused():
    x, y = _data()
    plugin = kip.PluginModel(_fresh_model())
    plugin.compile(optimizer="sgd", loss="mse")
    before = [w.copy() for w in plugin.wrapped.get_weights()]
    callback = kip.PluginCallback(passes=[kip.passes.Expand("all")])
    refused = r"PluginCallback was given passes \[Expand\].*PluginModel `regressor_plugin`"
    with pytest.raises(ValueError, match=refused):
        plugin.fit(x, y, batch_size=16, verbose=0, callbacks=[callback])
    for mine, theirs in zip(plugin.wrapped.get_weights(), before):
        np.testing.assert_array_equal(mine, theirs)  # refused before any step


def test_callback_with_a_setting_other_than_the_plugin_models_is_refused():
    x, y = _data()
    plugin = kip.PluginModel(_fresh_model())
    plugin.compile(optimizer="sgd", loss="mse")
    with pytest.raises(ValueError, match=r"verify=False \(it has True\)"):
        plugin.fit(x, y, batch_size=16, verbose=0, callbacks=[kip.PluginCallback(verify=False)])


def test_scope_with_other_passes_than_the_plugin_model_is_refused():
    with pytest.raises(ValueError, match=r"kip.scope was given passes \[Expand\]"):
        with kip.scope(passes=[kip.passes.Expand("all")]):
            plugin = kip.PluginModel(_fresh_model())
            plugin.compile(optimizer="sgd", loss="mse")


def test_model_compiled_inside_the_scope_and_given_a_callback_converts_once(conversions):
    x, y = _data()
    model = _fresh_model()
    with kip.scope():
        model.compile(optimizer="adam", loss="mse")
    model.evaluate(x, y, batch_size=16, verbose=0)  # the scope's conversion
    callback = kip.PluginCallback()
    model.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False, callbacks=[callback])
    assert conversions == ["regressor"]  # a second, the callback's own, before
    assert callback.kip_report is kip.scope_report(model) is not None

    # ... and trains as with the scope alone.
    twin = _fresh_model()
    with kip.scope():
        twin.compile(optimizer="adam", loss="mse")
    twin.evaluate(x, y, batch_size=16, verbose=0)
    twin.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False)
    for mine, theirs in zip(model.get_weights(), twin.get_weights()):
        np.testing.assert_array_equal(mine, theirs)


class OwnCompile(Regressor):
    """A model with its own `compile` (as a GAN or a distiller has)."""

    def compile(self, scale=1.0, **kwargs):
        super().compile(**kwargs)
        self.scale = scale


def test_a_model_compiled_by_its_plugin_model_inside_the_scope_trains_through_the_wrapper():
    x, y = _data()
    keras.utils.set_random_seed(7)
    wrapped = OwnCompile(name="own")
    wrapped(x[:1])
    with kip.scope():
        plugin = kip.PluginModel(wrapped)
        plugin.compile(optimizer="sgd", loss="mse", scale=2.0)
    # Compiled inside the scope by the wrapper's `compile`: not plugged in
    # by itself (a second session around a model the wrapper trains).
    assert not isinstance(vars(wrapped).get("train_function"), step_functions.StepFunction)
    assert kip.scope_report(wrapped) is None
    plugin.fit(x, y, batch_size=16, verbose=0)
    assert kip.scope_report(plugin) is plugin.kip_report is not None


# -- static_batch=True through PluginModel and PluginCallback -----------------

BATCH = 16


class ConstantBatch(keras.Model):
    """Reshapes to a batch size written as a constant (as keras.io's Switch
    Transformer does): traced with the batch left open, it cannot convert."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(4)
        self.out = keras.layers.Dense(1)

    def call(self, x):
        h = keras.ops.reshape(self.dense(x), (BATCH, 2, 2))
        return self.out(keras.ops.reshape(h, (BATCH, 4)))


def _train_constant_batch(how):
    x, y = _data()
    keras.utils.set_random_seed(7)
    model = ConstantBatch(name="constant_batch")
    model(x[:BATCH])
    trainee, callbacks = model, []
    if how == "plugin":
        trainee = kip.PluginModel(model, static_batch=True)
    elif how == "callback":
        callbacks = [kip.PluginCallback(static_batch=True)]
    trainee.compile(optimizer="adam", loss="mse")
    keras.utils.set_random_seed(11)
    # Every batch is whole (64 rows in 16s), so verification runs on the
    # whole batch of the static shape.
    trainee.fit(x, y, batch_size=BATCH, epochs=2, verbose=0, shuffle=False, callbacks=callbacks)
    if how == "plugin":
        return model.get_weights(), trainee.converted
    return model.get_weights(), callbacks[0].converted if callbacks else None


@pytest.mark.parametrize("how", ["plugin", "callback"])
def test_static_batch_trains_a_model_reshaping_to_a_constant_batch_size(how):
    plain, _ = _train_constant_batch("keras")
    weights, converted = _train_constant_batch(how)
    assert [tuple(t.shape) for t in converted.inputs] == [(BATCH, 3)]  # passed to conversion
    for mine, theirs in zip(weights, plain):
        np.testing.assert_allclose(mine, theirs, rtol=1e-6, atol=1e-7)


def test_plugin_model_saves_and_loads_its_static_batch(tmp_path):
    x, y = _data()
    plugin = kip.PluginModel(ConstantBatch(name="constant_batch"), static_batch=True)
    plugin.compile(optimizer="sgd", loss="mse")
    plugin.fit(x, y, batch_size=BATCH, verbose=0)
    plugin.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(
        tmp_path / "m.keras", custom_objects={"ConstantBatch": ConstantBatch})
    assert loaded.get_config()["static_batch"] is True
    np.testing.assert_allclose(loaded.predict(x, batch_size=BATCH, verbose=0),
                               plugin.predict(x, batch_size=BATCH, verbose=0), atol=1e-6)
    assert [tuple(t.shape) for t in loaded.converted.inputs] == [(BATCH, 3)]


# -- HDF5: refused with the way to save, never a file load_model cannot read --


def _converted_and_plugin():
    x, y = _data()
    converted = kip.convert_to_functional(_fresh_model(), x[:16])
    plugin = kip.PluginModel(_fresh_model())
    plugin.compile(optimizer="sgd", loss="mse")
    plugin.fit(x, y, batch_size=16, verbose=0)
    return {"converted": converted, "plugin": plugin}


@pytest.fixture(scope="module")
def saved_models():
    return _converted_and_plugin()


@pytest.mark.parametrize("which", ["converted", "plugin"])
@pytest.mark.parametrize("name", ["m.h5", "m.hdf5"])
def test_saving_as_hdf5_is_refused_with_a_pointer_to_keras_files(
        saved_models, which, name, tmp_path):
    model = saved_models[which]
    with pytest.raises(ValueError, match=r"HDF5.*\.keras"):
        model.save(tmp_path / name)  # wrote a file load_model could not read, before
    assert not (tmp_path / name).exists()
    with pytest.raises(ValueError, match=r"HDF5.*\.keras"):
        keras.saving.save_model(model, str(tmp_path / ("direct_" + name)))


@pytest.mark.parametrize("which", ["converted", "plugin"])
def test_keras_files_and_hdf5_weights_still_save_and_load(saved_models, which, tmp_path):
    model = saved_models[which]
    x, _ = _data()
    model.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras", custom_objects={
        "Regressor": Regressor, "Block": Block})
    np.testing.assert_allclose(loaded.predict(x[:16], verbose=0), model.predict(x[:16], verbose=0),
                               atol=1e-6)
    model.save_weights(tmp_path / "m.weights.h5")
    model.load_weights(tmp_path / "m.weights.h5")
    # A directory save (zipped=False) is Keras's own format, not HDF5.
    model.save(tmp_path / "dir.h5", zipped=False)


# -- a train step asking Keras's compute_loss for the compiled loss -----------


class SpeechTransformer(keras.Model):
    """keras.io/examples/audio/transformer_asr's training pattern, small: a
    dict batch, `self([source, target[:, :-1]])`, and the loss from
    `compute_loss(x=..., y=..., y_pred=..., sample_weight=...)` in its own
    train and test steps, tracked by its own metric."""

    def __init__(self, classes=10, **kwargs):
        super().__init__(**kwargs)
        self.classes = classes
        self.encoder = keras.layers.Dense(8, activation="relu")
        self.embed = keras.layers.Embedding(classes, 8)
        self.decoder = keras.layers.Dense(8, activation="relu")
        self.classifier = keras.layers.Dense(classes)
        self.loss_metric = keras.metrics.Mean(name="loss")

    @property
    def metrics(self):
        return [self.loss_metric]

    def call(self, inputs):
        source, target = inputs
        memory = keras.ops.mean(self.encoder(source), axis=1, keepdims=True)
        return self.classifier(self.decoder(self.embed(target) + memory))

    def _loss(self, batch):
        source, target = batch["source"], batch["target"]
        dec_input, dec_target = target[:, :-1], target[:, 1:]
        preds = self([source, dec_input])
        one_hot = tf.one_hot(dec_target, depth=self.classes)
        mask = tf.math.logical_not(tf.math.equal(dec_target, 0))
        return self.compute_loss(x=[source, dec_input], y=one_hot, y_pred=preds, sample_weight=mask)

    def train_step(self, batch):
        with tf.GradientTape() as tape:
            loss = self._loss(batch)
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
        self.loss_metric.update_state(loss)
        return {"loss": self.loss_metric.result()}

    def test_step(self, batch):
        self.loss_metric.update_state(self._loss(batch))
        return {"loss": self.loss_metric.result()}


def _speech_data(n=32):
    rng = np.random.default_rng(6)
    source = rng.normal(size=(n, 6, 5)).astype("float32")
    target = rng.integers(1, 10, size=(n, 7)).astype("int32")
    for row in range(n):
        target[row, 7 - row % 3:] = 0  # padding
    return tf.data.Dataset.from_tensor_slices({"source": source, "target": target}).batch(8)


def _train_speech(how):
    keras.utils.set_random_seed(4)
    model = SpeechTransformer(name="speech")
    compile_kwargs = dict(optimizer="adam", loss=keras.losses.CategoricalCrossentropy(
        from_logits=True, label_smoothing=0.1))
    callbacks = []
    if how == "keras":
        trainee = model
        trainee.compile(**compile_kwargs)
    elif how == "callback":
        trainee = model
        trainee.compile(**compile_kwargs)
        callbacks = [kip.PluginCallback()]
    elif how == "scope":
        with kip.scope():
            model.compile(**compile_kwargs)
        trainee = model
    elif how in ("plugin", "plugin_with_callback"):
        trainee = kip.PluginModel(model)
        trainee.compile(**compile_kwargs)
        callbacks = [kip.PluginCallback()] if how == "plugin_with_callback" else []
    elif how == "plugin_in_scope":
        with kip.scope():
            trainee = kip.PluginModel(model)
            trainee.compile(**compile_kwargs)
    data = _speech_data()
    history = trainee.fit(data, validation_data=data, epochs=2, verbose=0, callbacks=callbacks)
    return history.history, model.get_weights(), trainee


@pytest.fixture(scope="module")
def plain_speech():
    expected, plain, _ = _train_speech("keras")
    return expected, plain


@pytest.mark.parametrize(
    "how", ["plugin", "callback", "scope", "plugin_in_scope", "plugin_with_callback"])
def test_step_calling_compute_loss_trains_equal_to_plain_keras(how, plain_speech):
    expected, plain = plain_speech
    history, weights, trainee = _train_speech(how)
    assert history.keys() == expected.keys() == {"loss", "val_loss"}
    for key in expected:
        np.testing.assert_allclose(history[key], expected[key], rtol=1e-6)
    for mine, theirs in zip(weights, plain):
        np.testing.assert_allclose(mine, theirs, rtol=1e-5, atol=1e-7)
    if isinstance(trainee, kip.PluginModel):
        assert [tuple(t.shape) for t in trainee.converted.inputs] == [(None, 6, 5), (None, 6)]
