"""Targets as users write them: a class's name is the class, in Python as
in configs, and a target matching nothing names what is near it."""

import keras
import numpy as np
import pytest

import keras_ipu_plugin as kip


class Block(keras.layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(8)
        self.norm = keras.layers.LayerNormalization()

    def call(self, x):
        return x + self.norm(self.dense(x))


class Net(keras.Model):
    def __init__(self):
        super().__init__()
        self.stem, self.block, self.head = keras.layers.Dense(8), Block(), keras.layers.Dense(1)

    def call(self, x):
        return self.head(self.block(self.stem(x)))


X = np.random.default_rng(1).random((8, 4)).astype("float32")


@pytest.fixture(scope="module")
def converted():
    return kip.convert_to_functional(Net(), X)


def _recomputed(passed):
    return {name for name, notes in passed.kip_annotations.items() if notes.get("recompute")}


@pytest.mark.parametrize("target", ["LayerNormalization", ["LayerNormalization"]])
def test_a_class_name_string_matches_the_class_as_the_class_does(converted, target):
    by_name = kip.apply_passes(converted, [kip.passes.Recompute(target)])
    by_class = kip.apply_passes(converted, [kip.passes.Recompute(keras.layers.LayerNormalization)])
    assert _recomputed(by_name) == _recomputed(by_class) != set()
    from_config = kip.apply_passes(converted, kip.passes_from_config(
        {"recompute": "LayerNormalization"}))
    assert _recomputed(from_config) == _recomputed(by_class)


def test_a_class_name_target_saves_as_the_class():
    one = kip.passes.Recompute("LayerNormalization")
    assert one.targets == (keras.layers.LayerNormalization,)
    assert one.get_config()["targets"] == [{"class": "LayerNormalization"}]


def test_a_saved_layer_name_stays_a_name_even_when_it_spells_a_class():
    from keras_ipu_plugin.passes.infra.base import deserialize_pass

    loaded = deserialize_pass({"pass": "recompute", "config": {"targets": ["Dense"]}})
    assert loaded.targets == ("Dense",) and isinstance(loaded.targets[0], str)


def test_an_unknown_target_names_the_nearest_paths_and_classes(converted):
    with pytest.raises(kip.PassError) as raised:
        kip.apply_passes(converted, [kip.passes.Recompute("LayerNormalisation")])
    message = str(raised.value)
    assert "nearest" in message and "class LayerNormalization" in message, message
    with pytest.raises(kip.PassError) as raised:
        kip.apply_passes(converted, [kip.passes.Recompute("block.nrom")])
    assert "block.norm" in str(raised.value), str(raised.value)  # a nested layer's path


def test_an_unknown_target_far_from_everything_lists_layers_and_classes(converted):
    with pytest.raises(kip.PassError, match="layers: .*; classes: .*Dense"):
        kip.apply_passes(converted, [kip.passes.Recompute("zzzzzzzz")])
