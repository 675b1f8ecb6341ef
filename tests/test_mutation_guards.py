"""Behaviours whose breaking would be a silent wrong result, each guarded by a
test that fails when it breaks. Each has a mutation in
`tools/mutation.py` naming this file (tests/test_mutation_tool.py checks
that every mutation there still applies to the code).
"""

import numpy as np
import pytest
import tensorflow as tf

import keras
from keras import layers
from keras import ops

import keras_ipu_plugin as kip
from models import RegularizedTower  # tests/models.py
from keras_ipu_plugin.frontend.verify.equivalence import check_equivalent
from keras_ipu_plugin.passes import Chain
from keras_ipu_plugin.passes import Expand
from keras_ipu_plugin.passes import PipelineStages
from keras_ipu_plugin.planning import node_costs
from keras_ipu_plugin.planning import stage_timing
from keras_ipu_plugin.passes.infra.manager import graph_of

def _rand(*shape, seed=0):
    return np.random.RandomState(seed).normal(size=shape).astype("float32")


# -- Chain: a run computes one tensor from its first node's inputs ---------------
class SecondReader(keras.Model):
    """`up`'s output is read by gelu and by the residual add: no run from it."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.up = layers.Dense(8, name="up")
        self.down = layers.Dense(8, name="down")

    def call(self, x):
        h = self.up(x)
        return self.down(ops.gelu(h)) + h


class ReturnsTheMiddle(keras.Model):
    """`up`'s output is a model output and read by gelu alone."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.up = layers.Dense(8, name="up")

    def call(self, x):
        h = self.up(x)
        return h, ops.gelu(h)


def _graph(model, x):
    model(x)
    return kip.convert_to_functional(model, x).kip_graph


def test_a_chain_never_matches_a_node_whose_output_has_a_second_reader():
    graph = _graph(SecondReader(name="second"), _rand(4, 8))
    (up,) = [n for n in graph.nodes if n.name == "up"]
    assert len(up.outputs[0].users) == 2, "the test could not fail"
    assert Chain(layers.Dense, ops.gelu).matches(graph) == []
    # gelu's output has one reader, `down`: that run is found
    assert [[n.name for n in run] for run in Chain(ops.gelu, layers.Dense).matches(graph)] == [
        ["gelu", "down"]]


def test_a_chain_never_runs_through_a_model_output():
    graph = _graph(ReturnsTheMiddle(name="middle"), _rand(4, 8))
    (up,) = [n for n in graph.nodes if n.name == "up"]
    assert len(up.outputs[0].users) == 1, "the test could not fail"
    assert Chain(layers.Dense, ops.gelu).matches(graph) == []


# -- the planner counts bytes by dtype ----------------------------------------------
def _profiles(dtype):
    inputs = keras.Input((16,), dtype=dtype)
    hidden = layers.Dense(32, activation="tanh", dtype=dtype, name="hidden")(inputs)
    outputs = layers.Dense(4, dtype=dtype, name="out")(hidden)
    x = _rand(8, 16).astype(dtype)
    graph = graph_of(kip.convert_to_functional(keras.Model(inputs, outputs), x))
    return {p.node.name: p for p in node_costs.profile_nodes(graph, 8)}


def test_the_planner_counts_a_float16_tensor_at_two_bytes_an_element():
    half, single = _profiles("float16"), _profiles("float32")
    hidden = half["hidden"]
    assert hidden.output_bytes == 8 * 32 * 2
    assert hidden.weight_bytes == (16 * 32 + 32) * 2
    for name in ("hidden", "out"):
        for field in ("output_bytes", "weight_bytes", "grad_bytes", "kept_bytes"):
            assert getattr(half[name], field) * 2 == getattr(single[name], field), (name, field)
        assert half[name].kept_bytes > 0, name


# -- balance="time" keeps the split that measured best ------------------------------
class Uneven(keras.Model):
    """Six small layers then a large head (as tests/planning/test_planning_passes.py)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.blocks = [layers.Dense(8, name=f"d{i}") for i in range(6)]
        self.head = layers.Dense(8, name="head")

    def call(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def test_stages_balanced_by_time_keep_the_split_that_measured_best(monkeypatch):
    # Timed alone the head is the cost of the six small layers: blocks.0..5 |
    # head. Timed whole, the head stage is faster (3.0), so the re-plan
    # moves the cut; but that split measures far worse as a whole than the
    # first: the first is the one kept, with its measured costs.
    names = [f"blocks.{i}" for i in range(6)] + ["head"]  # node paths
    alone = dict(zip(names, [1.0] * 6 + [6.0]))
    first = [(0, 5), (6, 6)]
    timed = []

    def stage_times(graph, batch, partitions):
        timed.append([list(p) for p in partitions])
        assert [n.name for n in graph.nodes] == names
        return [[6.0, 3.0] if list(partition) == first else
                [sum(alone[n.name] for n in graph.nodes[a:b + 1]) + (100.0 if k == 0 else 0.0)
                 for k, (a, b) in enumerate(partition)]
                for partition in partitions]

    monkeypatch.setattr(node_costs, "time_nodes",
                        lambda graph, batch, profiles=None: [alone[n.name] for n in graph.nodes])
    monkeypatch.setattr(stage_timing, "time_stages", stage_times)
    x = _rand(16, 8)
    model = Uneven(name="uneven")
    model(x)
    passed = kip.apply_passes(kip.convert_to_functional(model, x),
                              [PipelineStages(num_stages=2, balance="time")])
    (plan,) = [p for p in passed.kip_report.plans if p.title.startswith("Pipeline stages")]
    compared = timed[-1]
    assert len(compared) >= 2 and first in compared, "no worse split met: the test could not fail"
    assert plan.figures["stages"] == [names[:6], ["head"]], plan.figures
    assert plan.figures["costs"] == [6.0, 3.0]


# -- an expanded block's output keeps its Keras mask --------------------------------
class PaddingEmbedding(layers.Layer):
    """Token plus position embeddings; `compute_mask` marks padding. Its
    inlined `call` ends in an add, which carries no mask."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.tokens = layers.Embedding(10, 4, name="tokens")
        self.positions = layers.Embedding(6, 4, name="positions")

    def call(self, ids):
        return self.tokens(ids) + self.positions(ops.arange(ops.shape(ids)[-1]))

    def compute_mask(self, ids, mask=None):
        return ops.not_equal(ids, 0)


class EmbeddingOut(keras.Model):
    """The expanded block's output is the model's output: only the mask it
    carries masks the loss."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.embedding = PaddingEmbedding(name="embedding")

    def call(self, ids):
        return self.embedding(ids)


def test_an_expanded_block_returned_by_the_model_keeps_its_keras_mask():
    ids = np.random.default_rng(0).integers(1, 10, size=(4, 6))
    ids[:, 4:] = 0
    model = EmbeddingOut(name="embedding_out")
    want = model(ids)
    passed = kip.apply_passes(kip.convert_to_functional(model, (ids,)), [Expand("all")])
    assert "PaddingEmbedding" not in [type(n.operation).__name__ for n in passed.kip_graph.nodes]
    got = passed(ids)
    np.testing.assert_allclose(got, want, atol=1e-6)
    assert getattr(got, "_keras_mask", None) is not None, "the output lost its mask"
    np.testing.assert_array_equal(np.asarray(got._keras_mask), np.asarray(want._keras_mask))
    # The loss Keras computes from the output is masked as in the original.
    target = np.ones((4, 6, 4), "float32")
    loss = keras.losses.MeanSquaredError()
    np.testing.assert_allclose(float(loss(target, got)), float(loss(target, want)), rtol=1e-6)


# -- PluginModel: an attribute the wrapped class defines is the wrapped model's ------
class GrowsOnAClassFlag(keras.Model):
    grow = False  # a class attribute: `vars(model)` does not hold it

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.base = layers.Dense(4, name="base")
        self.extra = layers.Dense(4, name="extra")

    def call(self, x):
        x = self.base(x)
        return x + self.extra(x) if self.grow else x


def test_an_attribute_the_wrapped_class_defines_is_set_on_the_wrapped_model():
    x = _rand(4, 3)
    model = GrowsOnAClassFlag(name="grows")
    model.grow = True
    grown = np.asarray(model(x))  # every variable exists
    del model.grow  # back to the class's value
    plugin = kip.PluginModel(model)
    plugin(x)
    assert "grow" not in vars(model) and "grow" not in vars(plugin)
    plugin.grow = True
    assert "grow" not in vars(plugin)
    assert vars(model)["grow"] is True
    np.testing.assert_allclose(np.asarray(model(x)), grown, atol=1e-6)


# -- verification: at least two rows, spread over the batch -------------------------
class Rows(keras.Model):
    """A Dense on each row."""

    def __init__(self, dense, **kwargs):
        super().__init__(**kwargs)
        self.dense = dense

    def call(self, x):
        return self.dense(x)


class MixesRows(Rows):
    """Wrong: every row gets the batch's mean row (right on one row alone)."""

    def call(self, x):
        return ops.broadcast_to(ops.mean(self.dense(x), axis=0, keepdims=True),
                                ops.shape(self.dense(x)))


class WrongOnLargeRows(Rows):
    """Wrong only on rows whose first feature is above 100."""

    def call(self, x):
        y = self.dense(x)
        return y + ops.cast(x[:, :1] > 100.0, y.dtype)


def _pair(cls, x):
    dense = layers.Dense(2, name="dense")
    original, wrong = Rows(dense, name="original"), cls(dense, name="wrong")
    original(x)
    wrong(x)
    return original, wrong


def test_verification_on_a_batch_of_8_compares_more_than_one_row():
    x = _rand(8, 3)
    original, wrong = _pair(MixesRows, x)
    with pytest.raises(kip.ConversionError, match="differs"):
        check_equivalent(original, wrong, x)


def test_verification_compares_rows_spread_over_the_batch_not_the_first_ones():
    x = _rand(8, 3)
    x[4:, 0] = 1000.0  # only the last half shows the difference
    original, wrong = _pair(WrongOnLargeRows, x)
    with pytest.raises(kip.ConversionError, match="differs"):
        check_equivalent(original, wrong, x)
    assert check_equivalent(original, wrong, x[:4]).rows == 2  # the first rows agree


# -- a traced block is replayed only for a call with the same pinned training -------
class DropoutBlock(layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = layers.Dense(16, name="dense")
        self.dropout = layers.Dropout(0.5, name="dropout")

    def call(self, x):
        return self.dropout(self.dense(x))


class PinnedAndFollowing(keras.Model):
    """Two blocks of one kind: the first called with `training=False`, the
    second following the model's `training`."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.pinned = DropoutBlock(name="pinned")
        self.following = DropoutBlock(name="following")

    def call(self, x):
        return ops.concatenate([self.pinned(x, training=False), self.following(x)], axis=-1)


def test_a_block_called_with_another_pinned_training_is_traced_not_replayed():
    x = np.abs(_rand(16, 8)) + 0.1
    model = PinnedAndFollowing(name="pinned_and_following")
    model(x)
    passed = kip.apply_passes(kip.convert_to_functional(model, x), [Expand()])
    dropouts = {n.name: n.training for n in passed.kip_graph.nodes
                if isinstance(n.operation, layers.Dropout)}
    assert dropouts["pinned.dropout"] is False and dropouts["following.dropout"] is not False, \
        dropouts
    inference = np.asarray(model(x, training=False))
    training = np.asarray(passed(x, training=True))
    # `fit` mode: the pinned block's dropout is off, the other's drops units.
    np.testing.assert_allclose(training[:, :16], inference[:, :16], atol=1e-6)
    assert (training[:, 16:] == 0).sum() > 0.2 * training[:, 16:].size


# -- a successful conversion leaves a sub-layer's Python counter as it was ----------
class CountsItsCalls(layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = layers.Dense(3, name="dense")
        self.calls = 0

    def call(self, x):
        self.calls += 1
        return self.dense(x)


class HoldsACounter(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.block = CountsItsCalls(name="block")
        self.head = layers.Dense(2, name="head")

    def call(self, x):
        return self.head(self.block(x))


@pytest.mark.parametrize("verify", [True, False])
def test_a_successful_conversion_leaves_a_sub_layers_python_counter_unchanged(verify):
    x = _rand(4, 5)
    model = HoldsACounter(name="holds")
    model(x)
    calls = model.block.calls
    assert calls > 0
    kip.convert_to_functional(model, x, verify=verify)
    assert model.block.calls == calls
    model(x)
    assert model.block.calls == calls + 1  # the user's own calls count


# -- losses added inside a recompute segment keep their value and gradient ----------
def test_losses_added_inside_a_recompute_segment_keep_their_value_and_gradient():
    from keras_ipu_plugin.passes import Recompute
    from keras_ipu_plugin.runtime.backends import get_backend
    from keras_ipu_plugin.runtime.effects import make_plan

    x = _rand(8, 8)
    model = RegularizedTower(depth=4, name="regularized")
    model(x)
    converted = kip.convert_to_functional(model, x)
    recomputed = kip.apply_passes(converted, [Recompute(["block_1", "block_3"])])
    segments = [[n.operation.name for n in s.nodes]
                for s in make_plan(recomputed, get_backend()) if s.recompute]
    assert any("block_0" in names or "block_2" in names for names in segments), segments

    def loss_and_gradients(net):
        @tf.function
        def step():
            with tf.GradientTape() as tape:
                prediction = net(x, training=True)
                regularization = tf.add_n(net.losses)
                loss = tf.reduce_mean(prediction ** 2) + regularization
            return regularization, tape.gradient(loss, model.trainable_variables)

        return step()

    expected_loss, expected = loss_and_gradients(converted)
    actual_loss, actual = loss_and_gradients(recomputed)
    np.testing.assert_allclose(actual_loss, expected_loss, rtol=1e-6)
    for variable, e, a in zip(model.trainable_variables, expected, actual):
        np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-6, err_msg=variable.path)
