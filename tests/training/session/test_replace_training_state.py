"""Training goes on as if nothing had happened: for layers a Replace pass
made, across save / load (with the optimizer's state), across a rebuild for
new variables, across a conversion for a new input shape, and when `fit`
built the optimizer before a callback converted; for a model that grew a
layer, across save / load.

Each test trains a twin the same way without the interruption (or without
Replace: `Replacement(..., copy_weights=True)` of a Dense computes the same)
and compares weights, with Adam, so that the optimizer's moments matter.
"""

import warnings

import keras
import numpy as np
import pytest

import keras_ipu_plugin as kip
from keras_ipu_plugin.training.session.new_variables import OptimizingFacade
from keras_ipu_plugin.training.session.new_variables import extend_optimizer
from keras_ipu_plugin.training.session.new_variables import hand_over_optimizer_state

from models import GrowAt, GrowingModel  # tests/models.py


@keras.saving.register_keras_serializable("kip_test_replace_state")
class ThreeDense(keras.Model):
    """Three layers of the same shapes: the replaced one in the middle, so
    that optimizer state loaded in the wrong order would not fail loudly."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.first = keras.layers.Dense(4, activation="tanh", name="first")
        self.middle = keras.layers.Dense(4, activation="tanh", name="middle")
        self.last = keras.layers.Dense(4, name="last")

    def call(self, x):
        return self.last(self.middle(self.first(x)))


@keras.saving.register_keras_serializable("kip_test_replace_state")
class FastDense(keras.layers.Dense):
    """A stand-in for an accelerator-optimised Dense."""


def _replace_middle():
    return [kip.passes.Replace({"middle": kip.passes.Replacement(FastDense, copy_weights=True)})]


def _data(n=32, features=4, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, features)).astype("float32")
    return x, np.tanh(x @ rng.normal(size=(features, 4))).astype("float32")


def _plugin(weights=None, passes=None):
    model = ThreeDense()
    model(np.zeros((1, 4), "float32"))
    if weights is not None:
        model.set_weights(weights)
    plugin = kip.PluginModel(model, passes=_replace_middle() if passes is None else passes)
    plugin.compile(optimizer=keras.optimizers.Adam(0.05), loss="mse")
    return plugin


def _by_path(variables):
    return {v.path: np.array(v.numpy()) for v in variables}


def _assert_same_weights(actual, expected, atol=1e-6):
    """Variable by variable, in order (paths differ between instances)."""
    actual, expected = list(actual), list(expected)
    assert [v.name for v in actual] == [v.name for v in expected]
    for mine, theirs in zip(actual, expected):
        np.testing.assert_allclose(mine.numpy(), theirs.numpy(), atol=atol, err_msg=theirs.path)


@pytest.mark.parametrize("run_eagerly", [False, True])
def test_saved_and_loaded_plugin_with_replace_trains_on_as_if_never_saved(tmp_path, run_eagerly):
    """After `load_model` the optimizer is built over the wrapped model's
    layers and given their saved state; the conversion at the next `fit`
    replaces `middle` again: its replacement must take over the loaded
    moments (it failed with Keras's "Unknown variable: middle/kernel"), and
    the state saved for `middle` must not load into its neighbour."""
    x, y = _data()
    initial = ThreeDense()
    initial(x[:1])
    weights = initial.get_weights()

    saved = _plugin(weights)
    saved.compile(optimizer=keras.optimizers.Adam(0.05), loss="mse", run_eagerly=run_eagerly)
    saved.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    saved.save(tmp_path / "plugin.keras")
    loaded = keras.models.load_model(tmp_path / "plugin.keras")
    loaded.compile(optimizer=loaded.optimizer, loss="mse", run_eagerly=run_eagerly)
    loaded.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)

    twin = _plugin(weights)
    twin.compile(optimizer=keras.optimizers.Adam(0.05), loss="mse", run_eagerly=run_eagerly)
    twin.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    twin.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)

    assert int(loaded.optimizer.iterations.numpy()) == int(twin.optimizer.iterations.numpy()) == 12
    _assert_same_weights(loaded.trainable_variables, twin.trainable_variables)
    np.testing.assert_allclose(loaded.predict(x, verbose=0), twin.predict(x, verbose=0), atol=1e-6)
    # the replacement is what trains; the layer it replaced left the optimizer
    (old, new), = loaded._replaced_pairs()
    known = {id(v) for v in loaded.optimizer._trainable_variables}
    assert all(id(v) in known for v in new.trainable_variables)
    assert not any(id(v) in known for v in old.trainable_variables)
    assert "optimizer state handed over" in str(loaded.kip_report)


@keras.saving.register_keras_serializable("kip_test_replace_state")
class GrowsInTheMiddle(keras.Model):
    """Grows a layer between two of its own shapes when `grow` is set."""

    def __init__(self, grow=False, **kwargs):
        super().__init__(**kwargs)
        self.grow = grow
        self.base = keras.layers.Dense(4, activation="tanh", name="base")
        self.extra = keras.layers.Dense(4, name="extra")
        self.top = keras.layers.Dense(4, name="top")

    def call(self, x):
        x = self.base(x)
        if self.grow:
            x = x + self.extra(x)
        return self.top(x)

    def get_config(self):
        return {"grow": self.grow, **super().get_config()}


def test_grown_model_saved_and_loaded_trains_on_as_if_never_saved(tmp_path):
    """The optimizer extended for a layer grown mid-training holds it last;
    loaded, it is built over the model's variables in the model's order
    (the grown layer in the middle) and given the saved state by position:
    saved in that order, each layer gets its own moments back (the grown
    layer's went to its neighbour of the same shapes)."""
    x, y = _data()

    def grown():
        keras.utils.set_random_seed(2)
        plugin = kip.PluginModel(GrowsInTheMiddle())
        plugin.compile(optimizer=keras.optimizers.Adam(0.05), loss="mse")
        plugin.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
        plugin.wrapped.grow = True
        plugin.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
        return plugin

    saved = grown()
    state = [id(v) for v in saved.optimizer.variables]
    saved.save(tmp_path / "grown.keras")
    assert [id(v) for v in saved.optimizer.variables] == state  # reordered for saving only
    loaded = keras.models.load_model(tmp_path / "grown.keras")
    loaded.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    twin = grown()
    twin.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    _assert_same_weights(loaded.wrapped.weights, twin.wrapped.weights)


def test_optimizer_state_is_saved_in_the_wrapped_models_order(tmp_path):
    """The optimizer of a plugin that replaced its middle layer is built
    over the replacement where `middle` stood: saved, its state loads into
    a fresh copy of the wrapped model's optimizer variable by variable."""
    x, y = _data()
    plugin = _plugin()
    plugin.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    (old, new), = plugin._replaced_pairs()
    model = plugin.wrapped
    expected = [model.first.kernel, model.first.bias, new.kernel, new.bias,
                model.last.kernel, model.last.bias]
    assert [id(v) for v in plugin.optimizer._trainable_variables] == [id(v) for v in expected]


def test_optimizer_meets_replaced_variables_of_the_same_count():
    """An optimizer applied to as many variables as it knows, one of them
    new (a layer swapped for another), learns the new one (eagerly) instead
    of failing in Keras: it is counted by identity, not by number."""
    a, b = keras.Variable(np.ones(2, "float32")), keras.Variable(np.ones(2, "float32"))
    c = keras.Variable(np.ones(2, "float32"))
    optimizer = keras.optimizers.SGD(0.5)
    optimizer.build([a, b])
    facade = OptimizingFacade(optimizer)
    facade.apply([np.ones(2, "float32")] * 2, [a, c])
    np.testing.assert_allclose(c.numpy(), [0.5, 0.5])
    assert any(v is c for v in optimizer._trainable_variables)


def test_extend_optimizer_without_per_variable_state_keeps_its_own_variables():
    """An SGD without momentum over two variables holds two variables of
    its own (iterations, learning rate): not a per-variable list to extend."""
    a, b, c = (keras.Variable(np.ones(2, "float32")) for _ in range(3))
    optimizer = keras.optimizers.SGD(0.5)
    optimizer.build([a, b])
    optimizer.apply([np.ones(2, "float32")] * 2, [a, b])
    assert extend_optimizer(optimizer, [c]) == [c]
    assert int(optimizer.iterations.numpy()) == 1
    assert [v.name for v in optimizer.variables] == ["iteration", "learning_rate"]


def test_recompiled_plugin_model_trains():
    """A second `compile` (to change `run_eagerly`, or the loss of a loaded
    model) sets some attributes to what they were: they are still the
    wrapper's, as after the first (`fit` failed in TensorFlow's iterator)."""
    x, y = _data()
    plugin = _plugin(passes=[])
    plugin.compile(optimizer=keras.optimizers.Adam(0.05), loss="mse")
    history = plugin.fit(x, y, batch_size=8, epochs=1, verbose=0).history
    assert np.isfinite(history["loss"][0])


def test_hand_over_keeps_the_moments_of_the_replaced_variables():
    dense = keras.layers.Dense(2, name="old")
    dense.build((None, 3))
    optimizer = keras.optimizers.Adam()
    optimizer.build(dense.trainable_variables)
    optimizer.apply([np.ones((3, 2), "float32"), np.ones(2, "float32")], dense.trainable_variables)
    moments = [np.array(m.numpy()) for m in optimizer._momentums]
    new = FastDense(2, name="new")
    new.build((None, 3))
    handed = hand_over_optimizer_state(optimizer, [(dense, new)])
    assert [(o.path, n.path) for o, n in handed] == [
        ("old/kernel", "new/kernel"), ("old/bias", "new/bias")]
    assert optimizer._trainable_variables == [new.kernel, new.bias]
    for kept, moment in zip(moments, optimizer._momentums):
        np.testing.assert_array_equal(kept, moment.numpy())
    optimizer.apply([np.ones((3, 2), "float32"), np.ones(2, "float32")], new.trainable_variables)
    assert int(optimizer.iterations.numpy()) == 2


def _grow_data(n=96):
    rng = np.random.default_rng(1)
    x = rng.normal(size=(n, 3)).astype("float32")
    return x, np.sin(x.sum(axis=1, keepdims=True)).astype("float32")


def _grown(passes, run_eagerly=False):
    keras.utils.set_random_seed(5)
    model = GrowingModel()
    plugin = kip.PluginModel(model, passes=passes)
    plugin.compile(optimizer=keras.optimizers.Adam(0.02), loss="mse", run_eagerly=run_eagerly)
    x, y = _grow_data()
    plugin.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    replacements = [new for _, new in plugin._replaced_pairs()]
    plugin.fit(x, y, batch_size=16, epochs=3, initial_epoch=1, shuffle=False, verbose=0,
               callbacks=[GrowAt(model, 2)])
    return plugin, replacements


@pytest.mark.parametrize("run_eagerly", [False, True])
def test_rebuild_with_replace_keeps_trained_replacements_and_their_optimizer_state(run_eagerly):
    """A rebuild (a head grown between epochs) runs the passes again: the
    replacement layers made before must be the ones used again, with their
    trained weights and Adam moments, not new ones copied from the layers
    they replaced (untrained since) with fresh optimizer state."""
    replace = [kip.passes.Replace(
        {keras.layers.Dense: kip.passes.Replacement(FastDense, copy_weights=True)})]
    plugin, before = _grown(replace, run_eagerly)
    twin, _ = _grown([], run_eagerly)
    assert plugin._kip_session.rebuilds == 1
    after = {id(new) for _, new in plugin._replaced_pairs()}
    assert all(id(layer) in after for layer in before)  # the grown head's is new
    assert len(after) == len(before) + 1
    known = {id(v) for v in plugin.optimizer._trainable_variables}
    assert all(id(v) in known for v in plugin.trainable_variables)
    np.testing.assert_allclose(plugin.predict(_grow_data()[0], verbose=0),
                               twin.predict(_grow_data()[0], verbose=0), atol=1e-5)
    layers = [id(layer) for layer in plugin.wrapped.layers]
    for old, new in plugin._replaced_pairs():
        twin_layer = twin.wrapped.layers[layers.index(id(old))]
        _assert_same_weights(new.weights, twin_layer.weights, atol=1e-5)


class Sequences(keras.Model):
    """Dense on the last axis of a sequence of any length."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.inner = keras.layers.Dense(4, activation="tanh", name="inner")
        self.head = keras.layers.Dense(1, name="head")

    def call(self, x):
        return self.head(self.inner(x))


def test_a_conversion_for_a_new_input_shape_runs_the_trained_replacements():
    """A sequence of another length is converted anew, its passes run
    again: it must run the replacements trained so far, not new ones copied
    from the layers they replaced (which stopped training when replaced)."""
    rng = np.random.default_rng(2)
    short = rng.normal(size=(16, 5, 3)).astype("float32")
    targets = rng.normal(size=(16, 5, 1)).astype("float32")
    longer = rng.normal(size=(4, 9, 3)).astype("float32")

    def trained(passes):
        keras.utils.set_random_seed(11)
        plugin = kip.PluginModel(Sequences(), passes=passes)
        plugin.compile(optimizer=keras.optimizers.Adam(0.05), loss="mse")
        plugin.fit(short, targets, batch_size=8, epochs=3, shuffle=False, verbose=0)
        return plugin

    plugin = trained([kip.passes.Replace(
        {keras.layers.Dense: kip.passes.Replacement(FastDense, copy_weights=True)})])
    twin = trained([])
    own = _by_path(plugin.wrapped.weights)
    prediction = plugin.predict(longer, verbose=0)
    assert len(plugin._kip_session.conversions) == 2  # a new input shape
    assert len(plugin._replaced_pairs()) == 2  # the same replacements in both
    np.testing.assert_allclose(prediction, twin.predict(longer, verbose=0), atol=1e-5)
    # verified with the trained weights copied back for the occasion only:
    # the wrapped model's own layers are as they were
    for path, value in _by_path(plugin.wrapped.weights).items():
        np.testing.assert_array_equal(value, own[path], err_msg=path)


@pytest.mark.parametrize("run_eagerly", [False, True])
def test_callback_with_replace_trains_the_optimizer_fit_built(run_eagerly):
    """`fit` builds the optimizer over the model's own layers before the
    callback converts and replaces one: the replacement takes over its
    state, and training equals plain Keras training."""
    x, y = _data()

    def model_():
        keras.utils.set_random_seed(3)
        model = ThreeDense()
        model.compile(optimizer=keras.optimizers.Adam(0.05), loss="mse", run_eagerly=run_eagerly)
        return model

    plain = model_()
    plain.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    model = model_()
    callback = kip.PluginCallback(passes=_replace_middle())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0, callbacks=[callback])
    np.testing.assert_allclose(callback.converted(x), plain(x), atol=1e-5)
    # the replaced layer is not among what the step differentiates
    assert not [w for w in caught if "Gradients do not exist" in str(w.message)]
