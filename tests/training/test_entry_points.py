"""The training entry points never give a silently different result.

PluginModel, PluginCallback, kip.scope and the converted model itself: a
later batch of another dtype kind, an explicit `mask=`, a user's error in a
later step, an attribute set on the wrapper. Each either does what the
original model does or raises an error that says why.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_ipu_plugin as kip
from keras_ipu_plugin.training.session.new_variables import NewVariablesError
from keras_ipu_plugin.training.session.new_variables import VariableWatch
from keras_ipu_plugin.ir.graph import dtype_kind


class Regressor(keras.Model):
    def __init__(self):
        super().__init__()
        self.hidden = keras.layers.Dense(8, activation="relu")
        self.out = keras.layers.Dense(1)

    def call(self, x):
        return self.out(self.hidden(x))


def _int_and_float_batches(n=32):
    rng = np.random.default_rng(0)
    ints = rng.integers(0, 5, size=(n, 3)).astype("int32")
    floats = (ints + rng.uniform(0.2, 0.8, size=ints.shape)).astype("float32")
    return ints, floats, rng.normal(size=(n, 1)).astype("float32")


# -- 12.3: a later batch of another dtype kind is refused, never cast ---------


def test_dtype_kinds():
    assert [dtype_kind(d) for d in ("uint8", "int64", "float16", "bfloat16", "float64")] == [
        "int", "int", "float", "float", "float"]
    assert dtype_kind(tf.string) == dtype_kind(np.array(["a"]).dtype) == "string"
    assert dtype_kind(np.array([b"a"]).dtype) == "string"
    assert dtype_kind("bool") == "bool"


def _assert_names_both_dtypes(error):
    message = str(error.value)
    assert "`input`" in message and "int32" in message and "float32" in message


def test_converted_model_refuses_a_float_batch_for_an_int_input():
    ints, floats, _ = _int_and_float_batches()
    model = Regressor()
    converted = kip.convert_to_functional(model, ints)
    with pytest.raises(kip.InputDataError) as error:
        converted(floats)
    _assert_names_both_dtypes(error)
    np.testing.assert_allclose(converted(ints), model(ints), atol=1e-6)


def test_converted_model_refuses_a_bool_or_int_batch_for_a_float_input():
    ints, floats, _ = _int_and_float_batches()
    converted = kip.convert_to_functional(Regressor(), floats)
    with pytest.raises(kip.InputDataError, match="bool"):
        converted(ints > 2)
    with pytest.raises(kip.InputDataError, match="int32"):
        converted(ints)


def test_float64_data_for_a_float32_input_is_cast_as_keras_does():
    _, floats, _ = _int_and_float_batches()
    model = Regressor()
    converted = kip.convert_to_functional(model, floats)
    np.testing.assert_allclose(converted(floats.astype("float64")), model(floats), atol=1e-6)


@pytest.mark.parametrize("method", ["fit", "evaluate", "predict", "call"])
def test_plugin_model_refuses_a_float_batch_after_an_int_first_batch(method):
    ints, floats, y = _int_and_float_batches()
    plugin = kip.PluginModel(Regressor())
    plugin.compile(optimizer="sgd", loss="mse")
    plugin.fit(ints, y, batch_size=8, epochs=1, verbose=0)
    weights = [w.numpy().copy() for w in plugin.weights]
    with pytest.raises(kip.InputDataError) as error:
        if method == "call":
            plugin(floats)
        elif method == "predict":
            plugin.predict(floats, verbose=0)
        else:
            getattr(plugin, method)(floats, y, batch_size=8, verbose=0)
    _assert_names_both_dtypes(error)
    for before, after in zip(weights, plugin.weights):
        np.testing.assert_array_equal(before, after.numpy())


def test_callback_refuses_a_float_fit_after_an_int_fit():
    ints, floats, y = _int_and_float_batches()
    model = Regressor()
    model.compile(optimizer="sgd", loss="mse")
    callback = kip.PluginCallback()
    model.fit(ints, y, batch_size=8, epochs=1, verbose=0, callbacks=[callback])
    with pytest.raises(kip.InputDataError) as error:
        model.fit(floats, y, batch_size=8, epochs=1, verbose=0, callbacks=[callback])
    _assert_names_both_dtypes(error)


# -- 12.4: an explicit mask is honoured as the original does, or refused --------


class MaskedSum(keras.Model):
    """`call` takes `mask` and uses it in its own way."""

    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(4)

    def call(self, x, mask=None):
        y = self.dense(x)
        if mask is not None:
            y = y * keras.ops.expand_dims(keras.ops.cast(mask, y.dtype), -1)
        return keras.ops.sum(y, axis=1)


class NoMask(keras.Model):
    """`call` takes no `mask`: the original model rejects one."""

    def __init__(self):
        super().__init__()
        self.lstm = keras.layers.LSTM(4)

    def call(self, x):
        return self.lstm(x)


def _sequences(n=6, steps=5):
    rng = np.random.default_rng(2)
    x = rng.normal(size=(n, steps, 3)).astype("float32")
    mask = rng.uniform(size=(n, steps)) > 0.4
    mask[:, 0] = True
    return x, mask


def test_mask_the_graph_was_not_traced_with_is_refused():
    x, mask = _sequences()
    model = MaskedSum()
    converted = kip.convert_to_functional(model, x)
    with pytest.raises(TypeError, match="mask"):
        converted(x, mask=mask)
    np.testing.assert_allclose(converted(x), model(x), atol=1e-6)


def test_mask_is_refused_where_the_original_call_takes_none():
    x, mask = _sequences()
    model = NoMask()
    with pytest.raises(TypeError):
        model(x, mask=mask)  # the original's own behaviour
    converted = kip.convert_to_functional(model, x)
    with pytest.raises(TypeError, match="takes no `mask`"):
        converted(x, mask=mask)


def test_masks_the_inputs_carry_reach_the_graph_as_they_reach_the_original():
    """Nested after an Embedding with `mask_zero`, Keras hands the converted
    model the mask its input carries; the original's LSTM reads it from the
    input just the same."""
    tokens = np.array([[3, 4, 0, 0], [5, 0, 0, 0], [1, 2, 3, 4]], "int32")
    embedding = keras.layers.Embedding(8, 3, mask_zero=True)
    original = NoMask()
    original(embedding(tokens))
    converted = kip.convert_to_functional(original, np.asarray(embedding(tokens)))
    expected = original(embedding(tokens))
    np.testing.assert_allclose(converted(embedding(tokens)), expected, atol=1e-6)
    unmasked = original(np.asarray(embedding(tokens)))
    assert not np.allclose(unmasked, expected, atol=1e-3)  # the mask mattered


def test_mask_refusal_survives_passes_and_saving(tmp_path):
    x, mask = _sequences()
    converted = kip.convert_to_functional(MaskedSum(), x)
    passed = kip.apply_passes(converted, [kip.passes.Expand()])
    with pytest.raises(TypeError, match="mask"):
        passed(x, mask=mask)
    converted.save(tmp_path / "masked.keras")
    loaded = keras.models.load_model(tmp_path / "masked.keras")
    with pytest.raises(TypeError, match="mask"):
        loaded(x, mask=mask)


def test_functional_models_keep_keras_mask_semantics():
    x, mask = _sequences()
    inputs = keras.Input((5, 3))
    functional = keras.Model(inputs, keras.layers.LSTM(4)(inputs))
    converted = kip.convert_to_functional(functional, x)
    np.testing.assert_allclose(converted(x, mask=mask), functional(x, mask=mask), atol=1e-6)


# -- 12.7: the user's own error comes through, unchanged ------------------------


class UserLabelError(ValueError):
    pass


class FailsLater(keras.Model):
    """Dynamic (`if` on a tensor value: kept opaque, its `call` runs every
    eager step) and raising the user's own error once `fail_now` is set. The
    message happens to contain the words TensorFlow uses for variables
    created on a later trace."""

    MESSAGE = "labels must be set before the first call of a singleton head"

    def __init__(self):
        super().__init__()
        self.positive = keras.layers.Dense(1)
        self.negative = keras.layers.Dense(1)
        self.fail_now = False

    def call(self, x):
        if self.fail_now:
            raise UserLabelError(self.MESSAGE)
        if tf.reduce_sum(x) > 0:
            return self.positive(x)
        return self.negative(x)


class SetAtBatch(keras.callbacks.Callback):
    def __init__(self, target, name, value, batch=None, epoch=None):
        super().__init__()
        self.target, self.name, self.value = target, name, value
        self.batch, self.epoch = batch, epoch

    def on_train_batch_begin(self, batch, logs=None):
        if batch == self.batch:
            setattr(self.target, self.name, self.value)

    def on_epoch_begin(self, epoch, logs=None):
        if epoch == self.epoch:
            setattr(self.target, self.name, self.value)


@pytest.mark.parametrize("entry", ["plugin_model", "callback"])
def test_users_error_at_step_5_comes_through_unchanged(entry):
    _, floats, y = _int_and_float_batches(64)
    model = FailsLater()
    fail = SetAtBatch(model, "fail_now", True, batch=4)
    if entry == "plugin_model":
        trained, callbacks = kip.PluginModel(model), [fail]
    else:
        trained, callbacks = model, [fail, kip.PluginCallback()]
    trained.compile(optimizer="sgd", loss="mse", run_eagerly=True)
    with pytest.raises(UserLabelError) as error:
        trained.fit(floats, y, batch_size=8, epochs=1, verbose=0, callbacks=callbacks)
    assert type(error.value) is UserLabelError
    assert FailsLater.MESSAGE in str(error.value)
    assert "first batch" not in str(error.value)
    assert int(trained.optimizer.iterations.numpy()) == 4  # steps 1-4 ran


def test_users_error_in_a_later_trace_comes_through_unchanged():
    """Graph mode: a second `fit` on batches of another static shape traces
    the step again, and the dynamic model's `call` (run by AutoGraph in the
    trace) raises the user's error there."""
    _, floats, y = _int_and_float_batches(64)
    model = FailsLater()
    plugin = kip.PluginModel(model)
    plugin.compile(optimizer="sgd", loss="mse")
    by = lambda size: tf.data.Dataset.from_tensor_slices((floats, y)).batch(size, drop_remainder=True)
    plugin.fit(by(16), epochs=1, verbose=0)
    model.fail_now = True
    with pytest.raises(UserLabelError) as error:
        plugin.fit(by(8), epochs=1, verbose=0)
    assert FailsLater.MESSAGE in str(error.value) and "first batch" not in str(error.value)


def test_watch_notes_a_variable_creation_refused_on_a_later_trace():
    """What the step function's check rests on: a `tf.function` refuses a
    variable created on a later trace than its first, inside the watch."""
    watch = VariableWatch()
    layers = [keras.layers.Dense(2), keras.layers.Dense(3)]

    @tf.function
    def step(x, index):
        with watch.watching():
            return layers[index](x)

    step(tf.ones((2, 2)), 0)
    assert watch.changed and not watch.refused
    watch.take()
    with pytest.raises(ValueError):
        step(tf.ones((2, 2)), 1)
    assert watch.refused
    watch.take()
    assert not watch.refused


def test_branch_switched_with_rebuilds_off_is_an_error_not_a_stale_graph():
    """With `rebuild_on_new_variables=False` the switched branch cannot run
    through the old graph: an error naming the new variables, at every fit
    (not only the first after the switch)."""
    x, y = _grow_data()
    model = GrowingModel()
    model(x[:1])
    model.compile(optimizer="adam", loss="mse")
    callback = kip.PluginCallback(rebuild_on_new_variables=False)
    with pytest.raises(NewVariablesError, match="extra"):
        model.fit(x, y, batch_size=16, epochs=3, verbose=0, callbacks=[
            SetAtBatch(model, "grow", True, epoch=2), callback])
    with pytest.raises(NewVariablesError, match="extra"):
        model.fit(x, y, batch_size=16, epochs=1, verbose=0, callbacks=[callback])


# -- 12.9: an attribute set on the wrapper reaches the wrapped model ------------


class GrowingModel(keras.Model):
    """Grows a head when `grow` is switched on between epochs."""

    def __init__(self):
        super().__init__()
        self.grow = False
        self.base = keras.layers.Dense(4, activation="tanh")
        self.extra = keras.layers.Dense(
            4, kernel_initializer=keras.initializers.GlorotUniform(seed=3), name="extra")
        self.out = keras.layers.Dense(1)

    def call(self, x):
        x = self.base(x)
        if self.grow:
            x = x + self.extra(x)
        return self.out(x)


def _grow_data(n=96):
    rng = np.random.default_rng(1)
    x = rng.normal(size=(n, 3)).astype("float32")
    return x, np.sin(x.sum(axis=1, keepdims=True)).astype("float32")


def _train_grown(switch_on_wrapper):
    keras.utils.set_random_seed(5)
    x, y = _grow_data()
    model = GrowingModel()
    model.grow = True
    model(x[:1])  # every variable exists from the start, in the same order
    model.grow = False
    if switch_on_wrapper is None:  # the plain-Keras reference
        trained, target = model, model
        model.compile(optimizer="adam", loss="mse", run_eagerly=True)
    else:
        trained = kip.PluginModel(model)
        target = trained
        trained.compile(optimizer="adam", loss="mse", run_eagerly=switch_on_wrapper == "eager")
    trained.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0,
                callbacks=[SetAtBatch(target, "grow", True, epoch=1)])
    return model, trained


@pytest.mark.parametrize("mode", ["graph", "eager"])
def test_attribute_set_on_the_wrapper_switches_the_wrapped_models_branch(mode):
    reference, _ = _train_grown(None)
    model, plugin = _train_grown(mode)
    assert model.grow is True and plugin.grow is True
    assert "grow" not in vars(plugin)
    assert plugin.kip_report is not None and "rebuild" in str(plugin.kip_report)
    for mine, expected in zip(model.trainable_variables, reference.trainable_variables):
        np.testing.assert_allclose(mine.numpy(), expected.numpy(), atol=1e-5, err_msg=mine.path)


def test_keras_attributes_of_the_wrapper_stay_the_wrappers():
    """`compile` / `fit` set `optimizer` and `history` on the model they run
    on: on the wrapper, never on a wrapped model that has its own."""
    x, y = _grow_data()
    model = GrowingModel()
    model.compile(optimizer="sgd", loss="mse")
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    own_optimizer, own_history = model.optimizer, model.history
    plugin = kip.PluginModel(model)
    plugin.compile(optimizer="adam", loss="mse")
    plugin.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert model.optimizer is own_optimizer and model.history is own_history
    assert isinstance(plugin.optimizer, keras.optimizers.Adam)
    plugin.width_note = "mine"  # a name the wrapped model does not have
    assert vars(plugin)["width_note"] == "mine" and not hasattr(model, "width_note")


# -- one pass object where a list of passes goes ---------------------------------


class WithBlock(keras.Model):
    def __init__(self):
        super().__init__()
        self.block = keras.Sequential([keras.layers.Dense(8, activation="relu")])
        self.out = keras.layers.Dense(1)

    def call(self, x):
        return self.out(self.block(x))


def _trained_with(entry, passes):
    """(the passes' report rows, the trained weights) of one epoch through
    `entry` given `passes`."""
    _, floats, y = _int_and_float_batches(16)
    keras.utils.set_random_seed(0)
    model = WithBlock()
    if entry == "apply_passes":
        passed = kip.apply_passes(kip.convert_to_functional(model, floats), passes)
        trained, report = passed, lambda: passed.kip_report
    elif entry == "PluginModel":
        trained = kip.PluginModel(model, passes=passes)
        report = lambda: trained.kip_report  # noqa: E731
    elif entry == "PluginCallback":
        callback = kip.PluginCallback(passes=passes)
        trained, report = model, lambda: callback.kip_report
    else:
        with kip.scope(passes=passes):
            model.compile(optimizer="sgd", loss="mse")
        trained, report = model, lambda: kip.scope_report(model)
    if entry != "scope":
        trained.compile(optimizer="sgd", loss="mse")
    callbacks = [callback] if entry == "PluginCallback" else []
    trained.fit(floats, y, batch_size=8, epochs=1, verbose=0, shuffle=False, callbacks=callbacks)
    rows = [(e.step, e.layer, e.action) for e in report().entries if e.step == "expand"]
    return rows, [w.numpy() for w in model.weights]


@pytest.mark.parametrize("entry", ["apply_passes", "PluginModel", "PluginCallback", "scope"])
def test_one_pass_object_is_the_list_of_it_in_every_entry_point(entry):
    """`passes=Expand("all")` does exactly what `passes=[Expand("all")]`
    does, as Keras's `fit` takes one callback for the list of it."""
    single_rows, single_weights = _trained_with(entry, kip.passes.Expand("all"))
    listed_rows, listed_weights = _trained_with(entry, [kip.passes.Expand("all")])
    assert single_rows and single_rows == listed_rows  # Expand ran, the same way
    for single, listed in zip(single_weights, listed_weights, strict=True):
        np.testing.assert_array_equal(single, listed)


@pytest.mark.parametrize("passes, message", [
    (kip.passes.Expand, r"`passes` must be a kip pass.*the class Expand itself: make the pass, "
                        r"Expand\(\.\.\.\)"),
    ([kip.passes.Recompute], r"passes\[0\] is the class Recompute itself: make the pass"),
    (None, r"`passes` must be a kip pass, a list of them.*got a NoneType"),
])
def test_a_pass_class_or_other_object_for_passes_is_a_clear_error(passes, message):
    model = WithBlock()
    for make in (lambda: kip.PluginModel(model, passes=passes),
                 lambda: kip.PluginCallback(passes=passes),
                 lambda: kip.apply_passes(kip.convert_to_functional(model, np.ones((2, 3))),
                                          passes)):
        with pytest.raises(kip.PassError, match=message):
            make()
    with pytest.raises(kip.PassError, match=message):
        with kip.scope(passes=passes):
            pass
