"""`Replace` reaches every matching layer it can and names the rest: a
layer inside a block that cannot be expanded, or inside Keras's own layers
holding layers (an RNN's cell), is a "not reached" row of the report with
why, never silently left; `strict=True` makes it an error."""

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
    (WithRnn, (3, 5, 2), r"`rnn` \(`rnn` is a RNN, one of Keras's own layers holding layers"),
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
