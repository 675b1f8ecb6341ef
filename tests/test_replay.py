"""Each kind of block is traced once and replayed over the others
(`frontend/replay.py`), and blocks that differ are never replayed from
each other."""

import keras
import numpy as np

import keras_ipu_plugin as kip
from keras_ipu_plugin.frontend.replay import layer_signature
from keras_ipu_plugin.passes import Expand

layers = keras.layers


class CountingBlock(layers.Layer):
    calls = 0

    def __init__(self, width=4, twice=False, activation="relu", **kwargs):
        super().__init__(**kwargs)
        self.twice = twice
        self.dense = layers.Dense(width, activation=activation)
        self.norm = layers.LayerNormalization()
        self.add = layers.Add()

    def call(self, x):
        CountingBlock.calls += 1
        h = self.norm(self.dense(x))
        if self.twice:  # Python control flow on a plain attribute
            h = self.norm(self.dense(h))
        return self.add([x, h])


class Stack(keras.Model):
    def __init__(self, blocks, **kwargs):
        super().__init__(**kwargs)
        self.blocks = blocks

    def call(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def _built(blocks):
    x = np.random.default_rng(0).normal(size=(3, 4)).astype("float32")
    model = Stack(blocks)
    model(x)
    return model, x


def test_expand_traces_each_kind_of_block_once():
    model, x = _built([CountingBlock(name=f"block_{i}") for i in range(6)])
    CountingBlock.calls = 0
    converted = kip.convert_to_functional(model, x, verify=False)
    at_conversion = CountingBlock.calls
    passed = kip.apply_passes(converted, [Expand()], verify=False)
    at_expansion = CountingBlock.calls - at_conversion
    # Once per kind (per training mode traced), not once per block.
    assert at_conversion <= 2 and at_expansion <= 2, (at_conversion, at_expansion)
    # ... and each block's nodes call its own layers.
    for i, block in enumerate(model.blocks):
        assert passed.kip_graph.node(f"blocks.{i}.dense").operation is block.dense
    kip.frontend.verify.check_equivalent(model, passed, x)


def test_blocks_that_differ_are_not_replayed_from_each_other():
    blocks = [CountingBlock(name="plain"), CountingBlock(twice=True, name="twice"),
              CountingBlock(activation="tanh", name="tanh"), CountingBlock(name="plain_2")]
    model, x = _built(blocks)
    signatures = [layer_signature(block) for block in blocks]
    assert signatures[0] == signatures[3]
    assert len({signatures[0], signatures[1], signatures[2]}) == 3
    passed = kip.apply_passes(kip.convert_to_functional(model, x), [Expand()])
    names = [node.name for node in passed.kip_graph.nodes]
    # By attribute path: blocks.1 is `twice`, blocks.0 is `plain`.
    assert sum(name.startswith("blocks.1.") for name in names) == 5  # dense, norm twice, add
    assert sum(name.startswith("blocks.0.") for name in names) == 3
    kip.frontend.verify.check_equivalent(model, passed, x)


class Table:
    """An object of the user's: what `call` reads of it cannot be compared."""


def test_a_block_holding_an_unknown_object_has_no_signature():
    block = CountingBlock(name="block")
    _built([block])
    block.table = Table()  # not plain data: the trace cannot be told equal
    assert layer_signature(block) is None
    assert layer_signature(CountingBlock(name="unbuilt")) is None


class DenseBlock(layers.Layer):
    """Its Dense's output carries the Keras mask of the block's input (Keras
    sets it on the Dense's output), so the block's output does too."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = layers.Dense(6, activation="tanh", name="dense")

    def call(self, x):
        return self.dense(x)


class MaskedMean(layers.Layer):
    """Averages the steps its Keras mask keeps (a custom layer: expanded
    too, its `call` must be handed the mask)."""

    def call(self, x, mask=None):
        if mask is None:
            return keras.ops.mean(x, axis=1)
        weights = keras.ops.expand_dims(keras.ops.cast(mask, x.dtype), -1)
        return keras.ops.sum(x * weights, axis=1) / keras.ops.sum(weights, axis=1)


class MaskedStack(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.embed = layers.Embedding(20, 6, mask_zero=True)
        self.blocks = [DenseBlock(name=f"block_{i}") for i in range(3)]
        self.pool = MaskedMean(name="mean")

    def call(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.pool(x)


def test_blocks_given_a_keras_mask_keep_it_when_expanded():
    # A replayed block's values carried no Keras mask: the custom mean
    # after the last block, expanded, was handed none and averaged the
    # padding too, a silently different output.
    ids = np.random.default_rng(0).integers(1, 20, size=(4, 7))
    ids[:, 4:] = 0
    model = MaskedStack(name="masked")
    model(ids)
    passed = kip.apply_passes(kip.convert_to_functional(model, ids), [Expand()])
    assert [n.name for n in passed.kip_graph.nodes if n.name.startswith("blocks.")] == [
        "blocks.0.dense", "blocks.1.dense", "blocks.2.dense"]
    np.testing.assert_allclose(passed(ids), model(ids), atol=1e-6)


class ScaleBlock(layers.Layer):
    """A weight of its own (held as an attribute), and a Dense."""

    def __init__(self, size, dtype="float32", **kwargs):
        super().__init__(**kwargs)
        self.scale = self.add_weight(shape=(size,), initializer="ones", dtype=dtype)
        self.dense = layers.Dense(size)

    def call(self, x):
        return self.dense(x) + keras.ops.cast(keras.ops.sum(self.scale), x.dtype)


def test_blocks_whose_weights_differ_in_shape_or_dtype_have_other_signatures():
    # Signatures read the shapes and dtypes Keras stores on its variables
    # (the public properties cost too much per weight); blocks with other
    # weights must still tell apart.
    same, other = ScaleBlock(4), ScaleBlock(4)
    wider, in_float64 = ScaleBlock(5), ScaleBlock(4, dtype="float64")
    narrow_input = ScaleBlock(4)
    for block in (same, other, wider, in_float64):
        block(np.zeros((1, 4), "float32"))
    narrow_input(np.zeros((1, 2), "float32"))  # a kernel of another shape
    signatures = [layer_signature(b) for b in (same, other, wider, in_float64, narrow_input)]
    assert None not in signatures and signatures[0] == signatures[1]
    assert len(set(signatures[1:])) == 4
