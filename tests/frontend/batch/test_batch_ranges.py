"""A range over the batch: `ops.arange(ops.shape(x)[0])` where the batch
size is None while tracing.

keras_hub's Gemma 3 offsets each example's indices into the flattened
batch by `ops.arange(batch_size) * seq_length`; keras.io-style code embeds
each example's position in the batch. The range is a concrete constant in
each trace at a trial batch size, and such a layer stayed whole. A
constant that counts along the batch (`start + i * step` at row `i`, the
same start and step at every batch size, confirmed by traces at larger
sizes) is now made in the graph from the batch size when it runs, so
Expand reaches inside and the graph is right at any batch size.

A constant computed from the batch size otherwise (a range counting down
from it, one that wraps, `ops.eye(batch)`) keeps the layer whole, the
reason naming the line of `call` and what one graph cannot follow; never
a graph that holds the trial batch's values.
"""

import numpy as np
import pytest

import keras
from keras import layers
from keras import ops

import keras_ipu_plugin as kip
from keras_ipu_plugin.passes import Expand

from graph_checks import assert_equivalent  # tests/ is on sys.path
from models import BlockBetweenDense as Net  # tests/models.py

DIM = 6  # the width `Net` gives its block


def _rand(*shape, seed=0):
    return np.random.RandomState(seed).normal(size=shape).astype("float32")


class BatchIndex(layers.Layer):
    """Embeds each example's position in the batch."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.index = layers.Embedding(16, DIM, name="index")

    def call(self, x):
        return x + self.index(ops.arange(ops.shape(x)[0]))


class FlatOffsets(layers.Layer):
    """Gemma 3's interleaving, small: each example's first feature read
    from the flattened batch at `ops.arange(batch) * width`."""

    def call(self, x):
        batch, width = ops.shape(x)
        flat = ops.reshape(x, (-1,))
        firsts = ops.take(flat, ops.multiply(ops.arange(batch, dtype="int32"), width), axis=0)
        return x * ops.expand_dims(firsts, -1)


class FloatRange(layers.Layer):
    """A float range from 0.5 by 0.1 along the batch, added to each row."""

    def call(self, x):
        rows = ops.arange(ops.shape(x)[0], dtype="float32")
        return x + ops.expand_dims((rows + 5.0) * 0.1, -1)


def _expanded(block, x):
    model = Net(block)
    model(x)
    converted = kip.convert_to_functional(model, x)
    return model, kip.apply_passes(converted, [Expand("all")])


@pytest.mark.parametrize("block", [BatchIndex, FlatOffsets, FloatRange])
def test_a_range_over_the_batch_expands_and_follows_any_batch_size(block, tmp_path):
    """The layer expands to Keras operations only, and the graph equals the
    original (outputs and gradients) at batch sizes it was never traced at,
    before and after saving."""
    x = _rand(4, 5)
    model, passed = _expanded(block(name="block"), x)
    assert passed.kip_report.opaque == {}, passed.kip_report.opaque
    assert not any(node.operation is model.block for node in passed.kip_graph.nodes)
    assert_equivalent(model, passed, x)
    for batch in (1, 5, 11):
        other = _rand(batch, 5, seed=batch)
        np.testing.assert_allclose(passed(other), model(other), atol=1e-5)
    path = str(tmp_path / "ranged.keras")
    passed.save(path)
    loaded = keras.models.load_model(path)
    other = _rand(9, 5, seed=9)
    np.testing.assert_allclose(loaded(other), model(other), atol=1e-5)


def test_keras_hub_gemma3_interleaving_expands_without_static_batch():
    """keras_hub's `Gemma3InterleaveEmbeddings` (its offsets are
    `ops.arange(batch_size) * seq_length`) expands with the batch size
    unknown, and the graph follows any batch size."""
    module = pytest.importorskip("keras_hub.src.models.gemma3.gemma3_layers")
    seq, dim, tokens = 8, 4, 2

    class ImageAndText(keras.Model):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.text = layers.Embedding(20, dim, name="text")
            self.image = layers.Dense(tokens * dim, name="image")
            self.interleave = module.Gemma3InterleaveEmbeddings(tokens, name="interleave")
            self.head = layers.Dense(1, name="head")

        def call(self, inputs):
            images = ops.reshape(self.image(inputs["image"]), (-1, tokens, dim))
            return self.head(self.interleave(images, self.text(inputs["ids"]),
                                             inputs["vision_indices"]))

    def data(batch):
        rng = np.random.RandomState(batch)
        return {"ids": rng.randint(0, 20, (batch, seq)).astype("int32"),
                "image": rng.rand(batch, 3).astype("float32"),
                "vision_indices": np.tile(np.array([[2, 3]], "int32"), (batch, 1))}

    model = ImageAndText(name="image_and_text")
    x = data(2)
    model(x)
    passed = kip.apply_passes(kip.convert_to_functional(model, x), [Expand("all")])
    assert passed.kip_report.opaque == {}, passed.kip_report.opaque
    assert not any(node.operation is model.interleave for node in passed.kip_graph.nodes)
    for batch in (3, 6):
        np.testing.assert_allclose(passed(data(batch)), model(data(batch)), atol=1e-5)


class CountsDown(layers.Layer):
    """Reverses the batch: a range that starts from the batch size."""

    def call(self, x):
        return ops.take(x, ops.arange(ops.shape(x)[0] - 1, -1, -1), axis=0)


class Wraps(layers.Layer):
    """A range that wraps after three rows: the trial traces (1 and 3
    rows) see it count; larger ones do not."""

    def call(self, x):
        return x + ops.expand_dims(ops.cast(ops.arange(ops.shape(x)[0]) % 3, x.dtype), -1)


class BatchSquare(layers.Layer):
    """Mixes the examples with the identity of the batch's size: two
    batch dimensions."""

    def call(self, x):
        return ops.matmul(ops.eye(ops.shape(x)[0]), x) * 2.0


@pytest.mark.parametrize("block", [CountsDown, Wraps, BatchSquare])
def test_a_constant_the_graph_cannot_compute_from_the_batch_size_keeps_the_layer_whole(block):
    """The layer stays whole, the reason naming the line of `call` and
    saying that the constant computed from the batch size is no range one
    graph can make; the graph is right at other batch sizes."""
    x = _rand(4, 5)
    model, passed = _expanded(block(name="block"), x)
    reason = passed.kip_report.opaque["block"]
    assert "test_batch_ranges.py:" in reason, reason
    assert "computed from the batch size" in reason, reason
    assert passed.kip_graph.node("block").operation is model.block
    for batch in (2, 7):
        other = _rand(batch, 5, seed=batch)
        np.testing.assert_allclose(passed(other), model(other), atol=1e-5)
