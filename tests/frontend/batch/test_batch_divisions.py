"""Batch arithmetic that divides the batch size:
`ops.shape(x)[0] // k`, as keras_hub's Swin `WindowAttention` divides its
`batch * windows` rows by the windows, and a layer that halves the batch.

At the trial batch sizes (1 and 3) `b // k` is 0, so such a layer stayed
whole, or (`ops.zeros((b // 4, d))`: 0 rows at both sizes) passed for a
fixed size. A probe trace notes what an input's leading size is divided
by, and the layer is traced at multiples of it: the graph follows the
batch at every multiple, and refuses other batch sizes with the reason,
where the original's floor division is no longer what the traces showed.
A `call` branching on `training` in Python whose trace needs two batch
sizes (Mixtral's MoE block adds its loss in training) is one switch of
both modes' generalized graphs.
"""

import numpy as np
import pytest

import keras
from keras import layers
from keras import ops

import keras_ipu_plugin as kip
from keras_ipu_plugin.errors import LoadError
from keras_ipu_plugin.layers.keras_ops.batch_sized import BatchSizedOperation
from keras_ipu_plugin.passes import Expand
from keras_ipu_plugin.runtime.mode_switch import ModeSwitch

from graph_checks import assert_equivalent  # tests/ is on sys.path
from models import BlockBetweenDense as Net  # tests/models.py

WINDOWS, TOKENS, DIM = 4, 3, 6


def _rand(*shape, seed=0):
    return np.random.RandomState(seed).normal(size=shape).astype("float32")


def _expanded(model, x):
    model(x)
    converted = kip.convert_to_functional(model, x)
    passed = kip.apply_passes(converted, [Expand("all")])
    assert passed.kip_report.opaque == {}, passed.kip_report.opaque
    left = [node.name for node in passed.kip_graph.nodes
            if isinstance(node.operation, keras.layers.Layer)
            and not type(node.operation).__module__.startswith(("keras.", "keras_ipu_plugin."))]
    assert left == []
    return passed


def _divisors(model):
    """(operation, divisors) of each BatchSizedOperation dividing the batch."""
    return sorted(
        (type(layer.operation).__name__, str(layer.divisors)) for layer in model.layers
        if isinstance(layer, BatchSizedOperation) and layer.divisors)


# -- Swin's windowed attention --------------------------------------------------
class WindowAttention(layers.Layer):
    """keras_hub's Swin `WindowAttention`, small: rows of `batch * windows`
    windows, and a mask per window added after
    `ops.reshape(attn, (B_ // num_win, num_win, n, n))`."""

    def build(self, input_shape):
        self.qkv = layers.Dense(3 * DIM, name="qkv")
        self.proj = layers.Dense(DIM, name="proj")
        mask = np.triu(np.full((TOKENS, TOKENS), -1e4, "float32"), 1)
        self.mask = np.stack([mask * (w % 2) for w in range(WINDOWS)])

    def call(self, x):
        batch_windows, n, c = ops.shape(x)[0], ops.shape(x)[1], ops.shape(x)[2]
        q, k, v = ops.split(self.qkv(x), 3, axis=-1)
        attn = ops.matmul(q, ops.transpose(k, (0, 2, 1)))
        num_win = ops.shape(self.mask)[0]
        attn = ops.reshape(attn, (batch_windows // num_win, num_win, n, n))
        attn = ops.reshape(attn + self.mask[None], (-1, n, n))
        return self.proj(ops.reshape(ops.matmul(ops.softmax(attn), v), (batch_windows, n, c)))


class Windowed(keras.Model):
    """The windows made with a reshape to `(-1, tokens, dim)` (Swin's
    `window_partition`), so the attention's rows are always a multiple of
    the windows."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.embed = layers.Dense(DIM, name="embed")
        self.attention = WindowAttention(name="attention")
        self.head = layers.Dense(2, name="head")

    def call(self, x):
        windows = ops.reshape(self.embed(x), (-1, TOKENS, DIM))
        out = self.attention(windows)
        return self.head(ops.reshape(out, (-1, WINDOWS * TOKENS, DIM)))


def test_windowed_attention_dividing_its_rows_by_the_windows_expands_at_any_batch_size(
        tmp_path):
    x = _rand(2, WINDOWS * TOKENS, 5)
    model = Windowed(name="windowed")
    passed = _expanded(model, x)
    assert ("Reshape", "{'newshape': [4, 1, 1, 1]}") in _divisors(passed)
    assert_equivalent(model, passed, x)
    for batch in (1, 3, 5):
        other = _rand(batch, WINDOWS * TOKENS, 5, seed=batch)
        np.testing.assert_allclose(passed(other), model(other), atol=1e-5)
    path = str(tmp_path / "windowed.keras")
    passed.save(path)
    loaded = keras.models.load_model(path)
    assert _divisors(loaded) == _divisors(passed)
    other = _rand(3, WINDOWS * TOKENS, 5, seed=7)
    np.testing.assert_allclose(loaded(other), model(other), atol=1e-5)


def test_swin_window_attention_of_keras_hub_expands():
    """The survey's model (tools/survey_models.py "SwinTransformer"): the
    shifted block's attention, which takes a mask per window."""
    keras_hub = pytest.importorskip("keras_hub")
    from keras_hub.src.models.swin_transformer.swin_transformer_layers import (
        WindowAttention as HubWindowAttention)

    class HubWindows(keras.Model):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.attention = HubWindowAttention(dim=4, num_heads=2, window_size=2,
                                                name="attention")
            self.mask = np.where(np.eye(4, dtype=bool)[None].repeat(WINDOWS, 0), 0.0,
                                 -100.0).astype("float32")

        def call(self, x):
            windows = ops.reshape(x, (-1, 4, 4))
            return ops.reshape(self.attention(windows, mask=self.mask), (-1, WINDOWS * 4, 4))

    x = _rand(2, WINDOWS * 4, 4)
    model = HubWindows(name="hub_windows")
    passed = _expanded(model, x)
    assert _divisors(passed), "the division by the windows is followed"
    for batch in (1, 3):
        other = _rand(batch, WINDOWS * 4, 4, seed=batch)
        np.testing.assert_allclose(passed(other), model(other), atol=1e-5)
    assert keras_hub is not None


def test_repeated_window_blocks_replayed_keep_their_divisors():
    """A second block like the first is made from its trace (`replay.py`):
    it divides the batch as the first does."""

    class TwoBlocks(Windowed):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.attention_2 = WindowAttention(name="attention_2")

        def call(self, x):
            windows = ops.reshape(self.embed(x), (-1, TOKENS, DIM))
            out = self.attention_2(self.attention(windows))
            return self.head(ops.reshape(out, (-1, WINDOWS * TOKENS, DIM)))

    x = _rand(2, WINDOWS * TOKENS, 5)
    model = TwoBlocks(name="two_blocks")
    passed = _expanded(model, x)
    names = [node.name for node in passed.kip_graph.nodes
             if isinstance(node.operation, BatchSizedOperation) and node.operation.divisors]
    assert any(name.startswith("attention.") for name in names), names
    assert any(name.startswith("attention_2.") for name in names), names
    other = _rand(3, WINDOWS * TOKENS, 5, seed=3)
    np.testing.assert_allclose(passed(other), model(other), atol=1e-5)


# -- a layer dividing the batch itself -----------------------------------------
class Halved(layers.Layer):
    """Two rows made one: `ops.reshape(x, (b // 2, 2 * d))`."""

    def call(self, x):
        b = ops.shape(x)[0]
        pairs = ops.reshape(x, (b // 2, 2 * DIM))
        return ops.reshape(pairs * ops.flip(pairs, axis=1), (-1, DIM))


def test_a_layer_halving_the_batch_follows_every_even_batch_and_refuses_odd_ones(tmp_path):
    x = _rand(4, 5)
    model = Net(Halved(name="block"), name="net")
    passed = _expanded(model, x)
    assert _divisors(passed)
    assert_equivalent(model, passed, x)
    for batch in (2, 6, 10):
        other = _rand(batch, 5, seed=batch)
        np.testing.assert_allclose(passed(other), model(other), atol=1e-5)
    with pytest.raises(Exception):
        model(_rand(3, 5))  # the model itself cannot halve 3 rows
    with pytest.raises(ValueError, match="no multiple of 2"):
        passed(_rand(3, 5))
    path = str(tmp_path / "halved.keras")
    passed.save(path)
    loaded = keras.models.load_model(path)
    np.testing.assert_allclose(loaded(_rand(8, 5, seed=8)), model(_rand(8, 5, seed=8)),
                               atol=1e-5)
    with pytest.raises(ValueError, match="no multiple of 2"):
        loaded(_rand(5, 5))


class WholeQuarters(layers.Layer):
    """The rows of whole quarters of the batch: `b // 4 * 4`, which is the
    batch size at every multiple of 4 and not at 5 (4 rows)."""

    def call(self, x):
        keep = ops.shape(x)[0] // 4 * 4
        return ops.slice(x, (0, 0), (keep, DIM)) * 2.0


class QuarterOfZeros(layers.Layer):
    """`ops.zeros((b // 4, d))` rows appended: 0 rows at both trial sizes,
    which passed for a fixed size (and gave 0 rows at every batch)."""

    def call(self, x):
        b = ops.shape(x)[0]
        rows = ops.concatenate([x, ops.zeros((b // 4, DIM))], axis=0)
        return x + ops.mean(rows, axis=0, keepdims=True)


@pytest.mark.parametrize("block", [WholeQuarters, QuarterOfZeros])
def test_a_floor_division_of_the_batch_is_refused_where_it_is_not_exact(block):
    """Never a silent wrong result: at a batch size that is no multiple of
    the divisor the original floors, and the graph, which knows only the
    multiples it was traced at, raises saying so."""
    x = _rand(8, 5)
    model = Net(block(name="block"), name="net")
    passed = _expanded(model, x)
    assert_equivalent(model, passed, x)
    for batch in (4, 12):
        other = _rand(batch, 5, seed=batch)
        np.testing.assert_allclose(passed(other), model(other), atol=1e-5)
    odd = _rand(5, 5, seed=5)
    model(odd)  # the original runs, flooring
    with pytest.raises(ValueError, match="no multiple of 4.*static_batch=True"):
        passed(odd)


def test_a_division_the_traces_at_multiples_cannot_follow_stays_whole_with_the_reason():
    """`(b // 2) ** 2` rows: at multiples of 2 no fraction of the batch size
    plus a constant that the third trace agrees on."""

    class OddHalf(layers.Layer):
        def call(self, x):
            half = ops.shape(x)[0] // 2
            rows = ops.broadcast_to(x[:1], (half * half, DIM))
            return x + ops.sum(rows, axis=0, keepdims=True)

    x = _rand(4, 5)
    model = Net(OddHalf(name="block"), name="net")
    model(x)
    converted = kip.convert_to_functional(model, x)
    passed = kip.apply_passes(converted, [Expand("all")])
    reason = passed.kip_report.opaque.get("block")
    assert reason is not None and "multiples of 2" in reason, passed.kip_report.opaque
    assert "static_batch=True" in reason
    assert passed.kip_graph.node("block").operation is model.block


def test_a_division_by_more_than_is_traced_at_stays_whole_saying_so():
    """Past `LARGEST_DIVISOR` the traces would be of batches that many times
    larger; at the trial sizes the division is 0."""
    from keras_ipu_plugin.frontend.batch.divisions import LARGEST_DIVISOR

    class Blocks(layers.Layer):
        def call(self, x):
            b = ops.shape(x)[0]
            return ops.reshape(ops.reshape(x, (b // 512, 512 * DIM)), (-1, DIM)) * 2.0

    assert LARGEST_DIVISOR < 512
    x = _rand(512, 5)
    model = Net(Blocks(name="block"), name="net")
    model(x)
    passed = kip.apply_passes(kip.convert_to_functional(model, x), [Expand("all")])
    reason = passed.kip_report.opaque.get("block")
    assert reason is not None and "divides the batch size by 512" in reason, reason
    assert passed.kip_graph.node("block").operation is model.block


def test_a_division_at_batch_sizes_known_only_when_the_graph_runs_is_checked_then():
    """In a `tf.function` of an unknown batch size the check is TensorFlow's."""
    import tensorflow as tf

    x = _rand(4, 5)
    model = Net(Halved(name="block"), name="net")
    passed = _expanded(model, x)
    run = tf.function(lambda t: passed(t),
                      input_signature=[tf.TensorSpec((None, 5), tf.float32)])
    np.testing.assert_allclose(run(_rand(6, 5, seed=6)), model(_rand(6, 5, seed=6)), atol=1e-5)
    with pytest.raises(tf.errors.InvalidArgumentError, match="no multiple of 2"):
        run(_rand(3, 5))


def test_a_probe_notes_only_divisions_the_batch_needs_to_be_exact():
    """`(b * 8) // 8`, as Keras works out a reshape's -1, needs nothing."""
    from keras_ipu_plugin.frontend.batch.divisions import _TracedSize

    noted = []
    b = _TracedSize(3, noted)
    assert (b * 8) // 8 == 3 and (2 * b + 1) // 1 == 7 and noted == []
    assert b // 4 == 0 and (b * 2) // 8 == 0 and divmod(b + 2, 3) == (1, 2)
    assert noted == [4, 4, 3]
    assert isinstance(b * 2, _TracedSize) and not isinstance(b * b, _TracedSize)


@pytest.mark.parametrize("divisors, match", [
    ({"shape": 0}, "divisors.shape"),
    ({"shape": [2, "1"]}, "divisors.shape"),
    ({"other": [2, 1]}, "divisors.other"),
    ([2, 1], "divisors"),
])
def test_a_saved_divisor_that_is_not_positive_ints_for_an_attribute_is_refused(divisors, match):
    from keras_ipu_plugin import _compat

    layer = BatchSizedOperation(_compat.broadcast_to_operation((None, 6)), ["shape"],
                                divisors={"shape": [2, 1]}, name="broadcast")
    config = layer.get_config()
    assert config["divisors"] == {"shape": [2, 1]}
    assert BatchSizedOperation.from_config(config).divisors == {"shape": [2, 1]}
    with pytest.raises(LoadError, match=match):
        BatchSizedOperation.from_config({**config, "divisors": divisors})


# -- a switch traced at two batch sizes -------------------------------------------
class RoutedWithLoss(layers.Layer):
    """Mixtral's MoE block (keras_hub): the batch size recovered from the
    flattened tokens (`ops.shape(flat)[0] // seq_len`, which fails on the
    unknown batch) in training only, where a loss is added."""

    def build(self, input_shape):
        self.router = layers.Dense(2, name="router")

    def call(self, x, training=None):
        seq_len = ops.shape(x)[1]
        flat = ops.reshape(x, (-1, DIM))
        logits = self.router(flat)
        out = ops.reshape(flat * ops.sum(ops.softmax(logits), axis=-1, keepdims=True),
                          ops.shape(x))
        if training:
            batch = ops.shape(logits)[0] // seq_len
            per_example = ops.reshape(logits, (batch, seq_len, 2))
            self.add_loss(0.1 * ops.mean(ops.square(per_example)))
        return out


class Tokens(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.embed = layers.Dense(DIM, name="embed")
        self.block = RoutedWithLoss(name="block")
        self.head = layers.Dense(2, name="head")

    def call(self, x, training=None):
        return self.head(self.block(self.embed(x), training=training))


def test_a_call_branching_on_training_traced_at_two_batch_sizes_is_one_switch():
    x = _rand(2, 3, 5)
    model = Tokens(name="tokens")
    passed = _expanded(model, x)
    switches = [node for node in passed.kip_graph.nodes
                if isinstance(node.operation, ModeSwitch)]
    assert [node.name for node in switches] == ["block"]
    for batch in (1, 4):
        other = _rand(batch, 3, 5, seed=batch)
        np.testing.assert_allclose(passed(other), model(other), atol=1e-5)
        np.testing.assert_allclose(passed(other, training=True), model(other, training=True),
                                   atol=1e-5)
        np.testing.assert_allclose(sum(passed.losses), sum(model.losses), atol=1e-6)


@pytest.mark.parametrize("build, shape", [
    (lambda: Windowed(name="windowed"), (WINDOWS * TOKENS, 5)),
    (lambda: Tokens(name="tokens"), (3, 5)),
])
def test_plugin_model_with_expand_trains_as_plain_keras(build, shape):
    """3 steps of `PluginModel(passes=[Expand("all")])` equal plain Keras
    (the windows divided in the graph; the loss added in training only)."""
    x = _rand(12, *shape, seed=1)
    y = _rand(12, *shape[:-1], 2, seed=2)
    weights = {}
    for how in ("plain", "plugin"):
        keras.utils.set_random_seed(11)
        model = build()
        model(x[:4])
        trained = model
        if how == "plugin":
            trained = kip.PluginModel(model, passes=[Expand("all")])
            trained.convert(x[:4])
            assert trained.converted.kip_report.opaque == {}
        trained.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
        trained.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
        weights[how] = [v.numpy() for v in model.weights]
    keras.utils.set_random_seed(11)
    first = build()
    first(x[:4])
    assert any(not np.allclose(v.numpy(), w) for v, w in zip(first.weights, weights["plain"]))
    for value, actual in zip(weights["plain"], weights["plugin"]):
        np.testing.assert_allclose(actual, value, rtol=0, atol=1e-5)
