"""`Replace` reaches every matching layer it can and names the rest.

Inside Keras's own layers holding layers (an RNN's custom cell and the
LayerNormalization it holds, Bidirectional, TimeDistributed) it builds a
new holder from the config around the new layers, weights copied, and the
model trains as plain Keras does; a layer inside a block that cannot be
expanded, or a holder that cannot be rebuilt (a cell with no config), is a
"not reached" row of the report with why, never silently left;
`strict=True` makes it an error."""

import keras
import numpy as np
import pytest
from keras import layers
from keras import ops

import keras_ipu_plugin as kip
from keras_ipu_plugin.passes import Replace
from keras_ipu_plugin.passes import Replacement


class NormedCell(layers.Layer):
    def __init__(self, units, **kwargs):
        super().__init__(**kwargs)
        self.units = units
        self.state_size = units
        self.dense = layers.Dense(units)
        self.norm = layers.LayerNormalization()

    def build(self, input_shape):
        self.dense.build((input_shape[0], input_shape[-1] + self.units))
        self.norm.build((input_shape[0], self.units))

    def call(self, inputs, states):
        h = self.norm(self.dense(ops.concatenate([inputs, states[0]], axis=-1)))
        return h, [h]


class WithRnn(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.rnn = layers.RNN(NormedCell(4))
        self.norm = layers.LayerNormalization()
        self.head = layers.Dense(2)

    def call(self, x):
        return self.head(self.norm(self.rnn(x)))


class Branchy(layers.Layer):
    """Kept whole: a Python `if` on a tensor's value."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.norm = layers.LayerNormalization()

    def call(self, x):
        if float(ops.sum(x)) > 1e9:
            return x
        return self.norm(x)


class WithBranchy(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.stem = layers.Dense(4)
        self.branchy = Branchy()
        self.norm = layers.LayerNormalization()

    def call(self, x):
        return self.norm(self.branchy(self.stem(x)))


@keras.saving.register_keras_serializable(package="test_replace_reach")
class MyNorm(layers.LayerNormalization):
    """The replacement: a subclass adding nothing (the weights copy over)."""


def _replace(strict=False):
    return Replace({layers.LayerNormalization: Replacement(MyNorm, copy_weights=True)},
                   strict=strict)


@pytest.mark.parametrize("model_class, shape, unreached", [
    (WithRnn, (3, 5, 2), "rnn"),
    (WithBranchy, (3, 4), "branchy"),
])
def test_the_layers_in_reach_are_replaced_and_the_rest_named(model_class, shape, unreached):
    keras.utils.set_random_seed(0)
    model = model_class()
    x = np.random.default_rng(0).normal(size=shape).astype("float32")
    passed = kip.apply_passes(kip.convert_to_functional(model, x), [_replace()])
    assert isinstance(passed.kip_graph.node("norm").operation, MyNorm)
    rows = [row for row in passed.kip_report.entries if row.action == "not reached"]
    assert [row.layer for row in rows] == [unreached]
    assert "class LayerNormalization inside it stays as it is" in rows[0].detail
    np.testing.assert_allclose(passed(x), model(x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("model_class, shape, named", [
    (WithRnn, (3, 5, 2), r"`rnn` \(a new RNN cannot be built from the config of `rnn`"),
    (WithBranchy, (3, 4), r"`branchy` \(`call` fails when run on symbolic tensors"),
])
def test_strict_makes_a_layer_not_reached_an_error_naming_it(model_class, shape, named):
    x = np.random.default_rng(0).normal(size=shape).astype("float32")
    converted = kip.convert_to_functional(model_class(), x)
    with pytest.raises(kip.PassError, match="replace \\(strict\\): class LayerNormalization is not "
                                            "reached inside " + named):
        kip.apply_passes(converted, [_replace(strict=True)])


def test_strict_round_trips_through_the_saved_config():
    again = Replace.from_config(_replace(strict=True).get_config())
    assert again == _replace(strict=True) and again != _replace()
    with pytest.raises(kip.PassError, match="strict is True or False"):
        Replace({layers.Dense: Replacement(layers.Dense)}, strict="yes")


@keras.saving.register_keras_serializable(package="test_replace_reach")
class SavedNormedCell(NormedCell):
    """The cell with the config Keras needs to build another one."""

    def get_config(self):
        return dict(super().get_config(), units=self.units)


@keras.saving.register_keras_serializable(package="test_replace_reach")
class MyDense(layers.Dense):
    """A replacement Dense adding nothing."""


@keras.saving.register_keras_serializable(package="test_replace_reach")
class MyLSTM(layers.LSTM):
    """A replacement LSTM adding nothing."""


class Wrapped(keras.Model):
    """A custom cell under `keras.layers.RNN`, a Bidirectional LSTM and a
    TimeDistributed Dense, around a LayerNormalization and a Dense."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.rnn = layers.RNN(SavedNormedCell(4), return_sequences=True)
        self.bi = layers.Bidirectional(layers.LSTM(3, return_sequences=True))
        self.td = layers.TimeDistributed(layers.Dense(3))
        self.norm = layers.LayerNormalization()
        self.head = layers.Dense(2)

    def call(self, x):
        return self.head(self.norm(self.td(self.bi(self.rnn(x))))[:, -1])


def _copy_in_order(old, new):
    for source, variable in zip(old.weights, new.weights, strict=True):
        variable.assign(source)


WRAPPED_REPLACEMENTS = {
    "norm": ({layers.LayerNormalization: Replacement(MyNorm, copy_weights=True)},
             {"rnn": MyNorm, "norm": MyNorm}),
    "dense": ({layers.Dense: Replacement(MyDense, copy_weights=True)},
              {"rnn": MyDense, "td": MyDense, "head": MyDense}),
    "lstm": ({layers.LSTM: Replacement(MyLSTM, copy_weights_fn=_copy_in_order)},
             {"bi": MyLSTM}),
    "path": ({"rnn.cell.norm": Replacement(MyNorm, copy_weights=True)}, {"rnn": MyNorm}),
}


def _held(layer):
    """The layers a holder holds, one attribute down too."""
    found = []
    for role in ("cell", "layer", "forward_layer", "backward_layer"):
        inner = getattr(layer, role, None)
        if isinstance(inner, layers.Layer):
            found.append(inner)
            found.extend(v for v in vars(inner).values() if isinstance(v, layers.Layer))
    return found


def _wrapped_data():
    rng = np.random.default_rng(0)
    return (rng.normal(size=(8, 5, 2)).astype("float32"),
            rng.normal(size=(8, 2)).astype("float32"))


@pytest.mark.parametrize("which", sorted(WRAPPED_REPLACEMENTS))
def test_replace_reaches_inside_rnn_cells_and_wrappers(which):
    """Every matching layer is replaced, inside holders too (a new holder
    around the new layer; the user's holder keeps its own), none is left
    "not reached", and the outputs are the original's."""
    mapping, expected = WRAPPED_REPLACEMENTS[which]
    keras.utils.set_random_seed(0)
    model = Wrapped()
    x, _ = _wrapped_data()
    before = [type(layer) for layer in model._flatten_layers()]
    passed = kip.apply_passes(kip.convert_to_functional(model, x),
                              [Replace(mapping, strict=True)])
    report = passed.kip_report
    assert not [row for row in report.entries if row.action == "not reached"]
    for path, new_class in expected.items():
        operation = passed.kip_graph.node(path).operation
        assert operation is not getattr(model, path)
        if isinstance(operation, new_class):
            continue
        assert any(isinstance(inner, new_class) for inner in _held(operation)), path
    assert [type(layer) for layer in model._flatten_layers()] == before  # the user's unchanged
    np.testing.assert_allclose(passed(x), model(x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("which", ["norm", "lstm"])
def test_replaced_inside_holders_trains_as_plain_keras(which):
    """`PluginModel` with the Replace trains to the losses plain Keras has
    (the new layers start from copied weights)."""
    mapping, _ = WRAPPED_REPLACEMENTS[which]
    x, y = _wrapped_data()
    losses = {}
    for how in ("plain", "plugin"):
        keras.utils.set_random_seed(0)
        model = Wrapped()
        model(x)
        trainee = model if how == "plain" else kip.PluginModel(
            model, passes=[Replace(mapping, strict=True)])
        trainee.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        losses[how] = trainee.fit(x, y, batch_size=4, epochs=3, shuffle=False,
                                  verbose=0).history["loss"]
    assert losses["plain"][0] != losses["plain"][-1]
    np.testing.assert_allclose(losses["plugin"], losses["plain"], rtol=1e-5)


def test_a_cell_with_a_replaced_attribute_refuses_to_be_saved(tmp_path):
    """The cell's config cannot say its LayerNormalization is a MyNorm: the
    passed model refuses to be saved (it would load the original class)
    rather than load another computation."""
    keras.utils.set_random_seed(0)
    model = Wrapped()
    x, _ = _wrapped_data()
    mapping, _ = WRAPPED_REPLACEMENTS["path"]
    passed = kip.apply_passes(kip.convert_to_functional(model, x), [Replace(mapping)])
    with pytest.raises(ValueError, match=r"`rnn.cell` holds `norm` replaced by MyNorm"):
        passed.save(str(tmp_path / "m.keras"))
    passed.save_weights(str(tmp_path / "m.weights.h5"))


@keras.saving.register_keras_serializable(package="test_replace_reach")
class DeepNormedCell(SavedNormedCell):
    """A LayerNormalization as an attribute, and another one deeper, in a block."""

    def __init__(self, units, **kwargs):
        super().__init__(units, **kwargs)
        self.block = keras.Sequential([layers.LayerNormalization()])

    def build(self, input_shape):
        super().build(input_shape)
        self.block.build((input_shape[0], self.units))

    def call(self, inputs, states):
        h, _ = super().call(inputs, states)
        h = self.block(h)
        return h, [h]


class WithDeepCell(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.rnn = layers.RNN(DeepNormedCell(4))
        self.norm = layers.LayerNormalization()

    def call(self, x):
        return self.norm(self.rnn(x))


def test_a_cell_with_a_target_deeper_than_an_attribute_is_not_partly_replaced():
    """Replace cannot reach the cell's deeper LayerNormalization: it leaves
    the whole RNN as it is (not the one norm it could reach) and names it,
    with why; the norm outside is replaced."""
    keras.utils.set_random_seed(0)
    model = WithDeepCell()
    x = np.random.default_rng(0).normal(size=(3, 5, 2)).astype("float32")
    passed = kip.apply_passes(kip.convert_to_functional(model, x), [_replace()])
    assert passed.kip_graph.node("rnn").operation is model.rnn
    assert isinstance(passed.kip_graph.node("norm").operation, MyNorm)
    rows = [row for row in passed.kip_report.entries if row.action == "not reached"]
    assert [row.layer for row in rows] == ["rnn"]
    assert "is deeper inside `rnn`" in rows[0].detail
    with pytest.raises(kip.PassError, match="is deeper inside `rnn`"):
        kip.apply_passes(kip.convert_to_functional(model, x), [_replace(strict=True)])
