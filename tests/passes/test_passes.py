"""Tests of the graph passes, their configs and the report.

The models are small subclassed models defined here, each exercising one
thing the passes must get right: custom residual blocks with
BatchNormalization, three levels of nested custom layers, a transformer-ish
block (MultiHeadAttention, LayerNormalization, Dropout), dict inputs with
several outputs, one custom layer called at two call sites, and a sub-layer
called with a hard-coded `training=False`.
"""

import json
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_ipu_plugin as kip
from keras_ipu_plugin.runtime.rebuild import rebuild
import models as zoo  # tests/models.py (tests/ is on sys.path under pytest)
from keras_ipu_plugin.passes import Expand
from keras_ipu_plugin.passes import Outline
from keras_ipu_plugin.passes import PipelineStages
from keras_ipu_plugin.passes import Recompute
from keras_ipu_plugin.passes import Replace
from keras_ipu_plugin.passes import Replacement

layers = keras.layers


# -- models --------------------------------------------------------------------
class ResBlock(layers.Layer):
    """conv -> BN -> relu -> conv -> BN, plus the input, relu."""

    def __init__(self, filters, **kwargs):
        super().__init__(**kwargs)
        self.filters = filters
        self.conv1 = layers.Conv2D(filters, 3, padding="same", name="conv1")
        self.bn1 = layers.BatchNormalization(name="bn1")
        self.conv2 = layers.Conv2D(filters, 3, padding="same", name="conv2")
        self.bn2 = layers.BatchNormalization(name="bn2")
        self.add = layers.Add(name="add")

    def call(self, x, training=None):
        h = keras.activations.relu(self.bn1(self.conv1(x), training=training))
        h = self.bn2(self.conv2(h), training=training)
        return keras.activations.relu(self.add([x, h]))

    def get_config(self):
        return {**super().get_config(), "filters": self.filters}


class CNN(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.stem = layers.Conv2D(4, 3, padding="same", name="stem")
        self.block_1 = ResBlock(4, name="block_1")
        self.block_2 = ResBlock(4, name="block_2")
        self.pool = layers.GlobalAveragePooling2D(name="pool")
        self.head = layers.Dense(3, name="head")

    def call(self, x, training=None):
        x = self.stem(x)
        x = self.block_1(x, training=training)
        x = self.block_2(x, training=training)
        return self.head(self.pool(x))


class Level3(layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = layers.Dense(5, activation="tanh", name="dense")

    def call(self, x):
        return self.dense(x) * 2.0


class Level2(layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.inner = Level3(name="l3")
        self.norm = layers.LayerNormalization(name="norm")

    def call(self, x):
        return self.norm(self.inner(x))


class Level1(layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.inner = Level2(name="l2")
        self.proj = layers.Dense(5, name="proj")

    def call(self, x):
        return self.proj(x) + self.inner(x)


class Nested(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.l1 = Level1(name="l1")
        self.head = layers.Dense(2, name="head")

    def call(self, x):
        return self.head(self.l1(x))


class EncoderBlock(layers.Layer):
    def __init__(self, dim=8, heads=2, rate=0.5, **kwargs):
        super().__init__(**kwargs)
        self.attention = layers.MultiHeadAttention(heads, dim // heads, name="mha")
        self.norm_1 = layers.LayerNormalization(name="norm_1")
        self.ffn_1 = layers.Dense(2 * dim, activation="relu", name="ffn_1")
        self.ffn_2 = layers.Dense(dim, name="ffn_2")
        self.dropout = layers.Dropout(rate, name="dropout")
        self.norm_2 = layers.LayerNormalization(name="norm_2")

    def call(self, x, training=None):
        x = self.norm_1(x + self.attention(x, x, training=training))
        h = self.dropout(self.ffn_2(self.ffn_1(x)), training=training)
        return self.norm_2(x + h)


class Transformer(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.encoder = EncoderBlock(name="encoder")
        self.pool = layers.GlobalAveragePooling1D(name="pool")
        self.head = layers.Dense(2, name="head")

    def call(self, x, training=None):
        return self.head(self.pool(self.encoder(x, training=training)))


class Tower(layers.Layer):
    def __init__(self, units, **kwargs):
        super().__init__(**kwargs)
        self.dense = layers.Dense(units, activation="relu", name="dense")
        self.out = layers.Dense(1, name="out")

    def call(self, x):
        return self.out(self.dense(x))


class DictModel(keras.Model):
    """Inputs {"a", "b"}; outputs {"score", "aux"}."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.tower_a = Tower(4, name="tower_a")
        self.tower_b = Tower(3, name="tower_b")
        self.aux = layers.Dense(2, name="aux")

    def call(self, inputs):
        a, b = inputs["a"], inputs["b"]
        score = self.tower_a(a) + self.tower_b(b)
        return {"score": score, "aux": self.aux(keras.ops.concatenate([a, b], -1))}


class SharedModel(keras.Model):
    """One custom layer object called at two call sites."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.shared = Tower(4, name="shared")
        self.mix = layers.Dense(3, name="mix")

    def call(self, x):
        return self.shared(x) + self.shared(self.mix(x))


class FrozenNormBlock(layers.Layer):
    """A BatchNormalization called with a hard-coded training=False."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = layers.Dense(4, name="dense")
        self.bn = layers.BatchNormalization(name="bn")

    def call(self, x, training=None):
        return self.bn(self.dense(x), training=False)


class FrozenModel(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.block = FrozenNormBlock(name="block")
        self.head = layers.Dense(1, name="head")

    def call(self, x, training=None):
        return self.head(self.block(x, training=training))


class MyDense(layers.Dense):
    """A user subclass of Dense (a stand-in for an accelerator-tuned one)."""


class NoSuchUse(layers.Layer):
    """A layer class that no test model uses."""


def _rand(*shape, seed=0):
    return np.random.RandomState(seed).normal(size=shape).astype("float32")


def make_cnn():
    return CNN(name="cnn"), _rand(2, 6, 6, 3)


def make_nested():
    return Nested(name="nested"), _rand(3, 4)


def make_transformer():
    return Transformer(name="transformer"), _rand(2, 5, 8)


def make_dict():
    return DictModel(name="dict_model"), {"a": _rand(3, 4, seed=1), "b": _rand(3, 2, seed=2)}


def make_shared():
    return SharedModel(name="shared_model"), _rand(3, 3)


def make_frozen():
    return FrozenModel(name="frozen"), _rand(8, 3)


MODELS = {
    "cnn": make_cnn,
    "nested": make_nested,
    "transformer": make_transformer,
    "dict": make_dict,
    "shared": make_shared,
    "frozen": make_frozen,
}


def converted(make):
    """(original, converted, x) with the original built by one call."""
    model, x = make()
    model(x)
    return model, kip.convert_to_functional(model, x), x


def expanded(make, extra=()):
    model, conv, x = converted(make)
    return model, kip.apply_passes(conv, [Expand(), *extra]), x


def node_names(model):
    return [node.name for node in model.kip_graph.nodes]


def layer_nodes(model):
    return [node for node in model.kip_graph.nodes if node.is_layer]


def graph_signature(model):
    """Names, operation classes and annotations of a passed model's graph."""
    return [
        (node.name, type(node.operation).__name__, node.annotations)
        for node in model.kip_graph.nodes
    ]


def outputs_of(model, x, training=False):
    return [np.asarray(t) for t in keras.tree.flatten(model(x, training=training))]


def assert_same_outputs(a, b, x, atol=1e-6):
    for left, right in zip(outputs_of(a, x), outputs_of(b, x), strict=True):
        np.testing.assert_allclose(left, right, atol=atol)


# -- Expand --------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(MODELS))
def test_expand_all_leaves_builtin_layers_same_results_same_variables(name):
    model, passed, x = expanded(MODELS[name])
    nodes = layer_nodes(passed)
    assert nodes
    for node in nodes:
        assert type(node.operation).__module__.startswith("keras."), node
    for layer in passed.layers:  # the Keras model agrees with its graph
        if isinstance(layer, kip.LayerAlias):  # a taken name: same layer, new name
            layer = layer.layer
        if not isinstance(layer, layers.InputLayer):
            assert type(layer).__module__.startswith("keras."), layer
    kip.frontend.verify.equivalence.check_equivalent(model, passed, x)  # outputs and gradients
    assert {id(v) for v in passed.weights} == {id(v) for v in model.weights}
    assert len(passed.weights) == len(model.weights)


def test_expand_names_nodes_parent_child_at_every_depth():
    model, passed, _ = expanded(make_nested)
    names = node_names(passed)
    assert "l1.inner.inner.dense" in names
    assert "l1.inner.norm" in names
    assert "l1.proj" in names
    assert "head" in names
    assert not any(n in names for n in ("l1", "l1.inner", "l1.inner.inner"))
    # The user's layer keeps its own name in the Keras model (it is free);
    # its path finds it.
    assert passed.kip_graph.node("l1.inner.inner.dense").operation.name == "dense"
    assert passed.kip_layer("l1.inner.inner.dense") is passed.kip_graph.node("l1.inner.inner.dense").operation
    assert "dense" in [layer.name for layer in passed.layers]


def test_expand_same_sublayer_names_in_two_blocks_stay_distinct():
    model, passed, x = expanded(make_cnn)
    names = node_names(passed)
    assert {"block_1.conv1", "block_2.conv1", "block_1.bn2", "block_2.bn2"} <= set(names)
    # the user's layers keep their names; the second `conv1` is aliased
    assert model.block_1.conv1.name == model.block_2.conv1.name == "conv1"
    aliases = [layer for layer in passed.layers if isinstance(layer, kip.LayerAlias)]
    assert any(alias.layer is model.block_2.conv1 and alias.name == "block_2.conv1"
               for alias in aliases)
    assert passed.kip_graph.node("block_1.conv1").operation is model.block_1.conv1
    assert passed.kip_graph.node("block_2.conv1").operation is model.block_2.conv1
    # Expanding the same model again gives the same names, not doubled ones.
    again = kip.apply_passes(kip.convert_to_functional(model, x), [Expand()])
    assert node_names(again) == names


def test_expanded_layers_keep_their_own_keras_names_unless_taken(tmp_path):
    model, passed, x = expanded(make_cnn)
    by_name = {layer.name: layer for layer in passed.layers}
    # block_1's sub-layers are the first to hold their names: called as
    # they are, no alias (an alias per layer made conversion slow).
    for name in ("conv1", "bn1", "conv2", "bn2", "add"):
        assert by_name[name] is getattr(model.block_1, name)
    # block_2's are the same names, taken: aliases named after their paths.
    aliases = {layer.name: layer.layer for layer in passed.layers
               if isinstance(layer, kip.LayerAlias)}
    assert aliases == {f"block_2.{name}": getattr(model.block_2, name)
                       for name in ("conv1", "bn1", "conv2", "bn2", "add")}
    # The path is the node's name, and finds the layer either way; a block
    # Expand inlined is found by its path too.
    assert passed.kip_layer("block_1.conv1") is model.block_1.conv1
    assert passed.kip_layer("block_2.conv1") is model.block_2.conv1
    assert passed.kip_layer("block_2") is model.block_2
    with pytest.raises(ValueError, match="no layer at path 'block_3.conv1'"):
        passed.kip_layer("block_3.conv1")
    # ... and in the saved model.
    passed.save(tmp_path / "passed.keras")
    loaded = keras.models.load_model(tmp_path / "passed.keras")
    for path in ("block_1.conv1", "block_2.bn2", "head"):
        assert loaded.kip_layer(path).name == passed.kip_layer(path).name
        np.testing.assert_array_equal(
            loaded.kip_layer(path).get_weights()[0], passed.kip_layer(path).get_weights()[0])


class WithSubModels(keras.Model):
    """A Sequential and a functional model (holding a custom layer) inside."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.seq = keras.Sequential(
            [layers.Dense(4, name="d1"), layers.Dropout(0.5, name="drop"),
             layers.Dense(3, name="d2")], name="seq")
        inputs = keras.Input((3,))
        outputs = layers.Dense(2, name="out")(Tower(3, name="tower")(inputs))
        self.func = keras.Model(inputs, outputs, name="func")

    def call(self, x, training=None):
        return self.func(self.seq(x, training=training))


def test_expand_inlines_nested_sequential_and_functional_models():
    model, x = WithSubModels(name="outer"), _rand(3, 5)
    model(x)
    passed = kip.apply_passes(kip.convert_to_functional(model, x), [Expand()])
    names = node_names(passed)
    # `tower` is the name Keras gives a `Tower` (its counter name), so the
    # path numbers it by its place in `func.layers` instead: stable across
    # builds, where Keras's next one is `tower_1`.
    for name in ("seq.d1", "seq.drop", "seq.d2", "func.1.dense", "func.1.out",
                 "func.out"):
        assert name in names
    assert passed.kip_graph.node("seq.drop").training == kip.ir.graph.FOLLOW
    for node in layer_nodes(passed):
        assert not isinstance(node.operation, keras.Model)
    kip.frontend.verify.equivalence.check_equivalent(model, passed, x)


def test_passes_apply_to_hand_written_functional_and_sequential_models():
    inputs = keras.Input((6, 6, 3))
    outputs = layers.Dense(2, name="dense")(
        layers.GlobalAveragePooling2D(name="gap")(ResBlock(3, name="rb")(inputs)))
    functional = keras.Model(inputs, outputs)
    x = _rand(2, 6, 6, 3)
    passed = kip.apply_passes(functional, [Expand(), Recompute("rb.add")])
    assert "rb.conv1" in node_names(passed)
    assert passed.kip_graph.node("rb.add").annotations == {"recompute": True}
    # The model keys them by Keras layer name: `rb.add` kept its own, `add`.
    assert passed.kip_layer_paths["rb.add"] == "add"
    assert passed.kip_annotations["add"] == {"recompute": True}
    kip.frontend.verify.equivalence.check_equivalent(functional, passed, x)
    sequential = keras.Sequential([keras.Input((5,)), layers.Dense(3), Tower(2, name="tw")])
    passed = kip.apply_passes(sequential, [Expand()])
    assert node_names(passed)[-2:] == ["tw.dense", "tw.out"]
    kip.frontend.verify.equivalence.check_equivalent(sequential, passed, _rand(3, 5))


def test_expand_one_target_expands_one_level_only():
    model, conv, x = converted(make_nested)
    passed = kip.apply_passes(conv, [Expand("l1")])
    names = node_names(passed)
    assert "l1.inner" in names and "l1.proj" in names
    assert isinstance(passed.kip_graph.node("l1.inner").operation, Level2)
    assert kip.apply_passes(conv, [Expand("l1")]).kip_report.touched("expand") == ["l1"]
    kip.frontend.verify.equivalence.check_equivalent(model, passed, x)


def test_shared_custom_layer_stays_shared():
    model, passed, x = expanded(make_shared)
    # Node paths are unique: the second call site is numbered.
    dense_nodes = [n for n in passed.kip_graph.nodes if n.name in ("shared.dense", "shared_1.dense")]
    out_nodes = [n for n in passed.kip_graph.nodes if n.name in ("shared.out", "shared_1.out")]
    assert len(dense_nodes) == 2 and len(out_nodes) == 2
    assert dense_nodes[0].operation is dense_nodes[1].operation is model.shared.dense
    assert out_nodes[0].operation is out_nodes[1].operation is model.shared.out
    assert len(passed.weights) == len(model.weights) == 6
    # Training the passed model trains the one shared kernel.
    before = np.array(model.shared.dense.kernel)
    passed.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    passed.fit(x, np.ones((3, 1), "float32"), epochs=1, verbose=0)
    assert not np.allclose(before, np.array(model.shared.dense.kernel))
    kip.frontend.verify.equivalence.check_equivalent(model, passed, x)


def test_training_passes_through_expanded_dropout():
    model, passed, x = expanded(make_transformer)
    dropout = passed.kip_graph.node("encoder.dropout")
    assert isinstance(dropout.operation, layers.Dropout)
    inference = outputs_of(passed, x, training=False)[0]
    np.testing.assert_allclose(inference, outputs_of(passed, x, training=False)[0])
    np.testing.assert_allclose(inference, outputs_of(model, x, training=False)[0], atol=1e-5)
    training = outputs_of(passed, x, training=True)[0]
    assert not np.allclose(training, inference, atol=1e-4)  # dropout active


class ImplicitDropout(layers.Layer):
    """`call` takes no `training`; its Dropout reads it from the call context."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = layers.Dense(8, name="dense")
        self.dropout = layers.Dropout(0.5, name="dropout")

    def call(self, x):
        return self.dropout(self.dense(x))


class PlainBlock(layers.Layer):
    """Only layers that ignore `training`: traced once."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = layers.Dense(8, name="dense")
        self.norm = layers.LayerNormalization(name="norm")

    def call(self, x):
        return self.norm(self.dense(x))


class ImplicitModel(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.plain = PlainBlock(name="plain")
        self.noisy = ImplicitDropout(name="noisy")

    def call(self, x):
        return self.noisy(self.plain(x))


def test_training_reaches_layers_that_read_it_from_the_context():
    model, x = ImplicitModel(name="implicit"), _rand(4, 8)
    model(x)
    passed = kip.apply_passes(kip.convert_to_functional(model, x), [Expand()])
    graph = passed.kip_graph
    assert graph.node("noisy.dropout").training == kip.ir.graph.FOLLOW
    assert graph.node("plain.dense").training is None
    assert passed.kip_pinned_training == {}
    inference = outputs_of(passed, x, training=False)[0]
    np.testing.assert_allclose(inference, outputs_of(model, x, training=False)[0], atol=1e-6)
    training = outputs_of(passed, x, training=True)[0]
    assert np.mean(training == 0) > 0.2  # dropout zeroed about half
    assert not np.allclose(training, inference)


def test_training_passes_through_expanded_batch_normalization():
    model, passed, x = expanded(make_cnn)
    assert passed.kip_graph.node("block_1.bn1").training == kip.ir.graph.FOLLOW
    in_training = outputs_of(passed, x, training=True)[0]
    np.testing.assert_allclose(in_training, outputs_of(model, x, training=True)[0], atol=1e-5)
    assert not np.allclose(in_training, outputs_of(passed, x, training=False)[0], atol=1e-3)


def test_pinned_training_false_survives_expand():
    model, passed, x = expanded(make_frozen)
    assert passed.kip_graph.node("block.bn").training is False
    mean = np.array(model.block.bn.moving_mean)
    np.testing.assert_allclose(
        outputs_of(passed, x, training=True)[0], outputs_of(passed, x, training=False)[0],
        atol=1e-6,
    )
    passed.compile(optimizer="sgd", loss="mse")
    passed.fit(x, np.ones((8, 1), "float32"), epochs=1, verbose=0)
    np.testing.assert_allclose(np.array(model.block.bn.moving_mean), mean)


def test_expand_does_not_change_the_converted_model():
    model, conv, x = converted(make_cnn)
    before = node_names(conv)
    passed = kip.apply_passes(conv, [Expand()])
    assert node_names(conv) == before == ["stem", "block_1", "block_2", "pool", "head"]
    assert passed is not conv
    assert_same_outputs(conv, passed, x)


class TrainingBranch(layers.Layer):
    """`call` branches on `training` in Python: Expand makes it one
    `ModeSwitch` node holding the graph of each mode."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.train_path = layers.Dense(3, name="train_path")
        self.infer_path = layers.Dense(3, name="infer_path")

    def call(self, x, training=None):
        if training:
            return self.train_path(x) + 0.0 * self.infer_path(x)
        return self.infer_path(x) + 0.0 * self.train_path(x)


class OwnWeight(layers.Layer):
    """Uses its own variable directly in `call` and updates another there
    (a call counter: forward state, a write node of the graph since issue
    22; the read alone is traced, see test_tracing_coverage.py)."""

    def build(self, shape):
        self.scale = self.add_weight(shape=(shape[-1],), initializer="ones", name="scale")
        self.calls = self.add_weight(shape=(), dtype="int32", initializer="zeros",
                                     trainable=False, name="calls")

    def call(self, x):
        self.calls.assign_add(1)
        return x * self.scale


class WithOpaqueParts(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.branch = TrainingBranch(name="branch")
        self.scaled = OwnWeight(name="scaled")
        self.head = layers.Dense(1, name="head")

    def call(self, x, training=None):
        return self.head(self.scaled(self.branch(x, training=training)))


def test_training_branches_and_counters_expand_and_follow_training():
    model, x = WithOpaqueParts(name="parts"), _rand(2, 3)
    model(x)
    conv = kip.convert_to_functional(model, x)
    passed = kip.apply_passes(conv, [Expand()])
    graph = passed.kip_graph
    # Branching on `training` is held as one node of both modes, and the
    # counter's write is a node of the graph: nothing stays whole.
    assert isinstance(graph.node("branch").operation, kip.ModeSwitch)
    assert not graph.node("branch").opaque_reason
    assert graph.node("scaled.calls.assign_add").operation.variable is model.scaled.calls
    assert set(passed.kip_report.opaque) == set()
    # The expanded parts still follow `training` and share their variables.
    kip.frontend.verify.equivalence.check_equivalent(model, passed, x)
    for training in (True, False):
        np.testing.assert_allclose(
            outputs_of(passed, x, training)[0], outputs_of(model, x, training)[0], atol=1e-6
        )


class BranchOfAnotherShape(layers.Layer):
    """Its two modes return tensors of other shapes: no one node can stand
    for both."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = layers.Dense(3, name="dense")

    def call(self, x, training=None):
        if training:
            return self.dense(x)
        return keras.ops.concatenate([self.dense(x), x], axis=-1)


class WithShapeBranch(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.branch = BranchOfAnotherShape(name="branch")

    def call(self, x, training=None):
        return keras.ops.sum(self.branch(x, training=training), axis=-1, keepdims=True)


def test_a_layer_branching_on_training_stays_whole_naming_the_line_that_branches():
    # The reason listed the operations called in one mode only, not the
    # line of the user's code to look at (keras_hub's DropPath in Swin / MiT).
    # Most such layers become a ModeSwitch now; one whose modes return
    # other shapes still stays whole.
    import inspect

    model, x = WithShapeBranch(name="parts"), _rand(2, 3)
    model(x)
    passed = kip.apply_passes(kip.convert_to_functional(model, x), [Expand()])
    reason = passed.kip_report.opaque["branch"]
    assert "(None, 3)" in reason and "(None, 6)" in reason, reason
    source, first = inspect.getsourcelines(BranchOfAnotherShape.call)
    line = first + next(i for i, text in enumerate(source) if "if training:" in text)
    assert f"test_passes.py:{line}: if training:" in reason, reason
    assert "runs whole" in reason


class PositionAdd(layers.Layer):
    """Adds a learned position embedding looked up with constant position
    ids: traced, that lookup runs eagerly and would be frozen into the graph."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.positions = layers.Embedding(5, 8, name="positions")

    def call(self, x):
        return x + self.positions(keras.ops.arange(5))


class PositionModel(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.pos = PositionAdd(name="pos")
        self.head = layers.Dense(1, name="head")

    def call(self, x):
        return self.head(self.pos(x))


def test_layer_that_would_freeze_its_weights_expands_with_the_lookup_in_the_graph():
    # Was: kept whole (opaque). The lookup on constant ids is now a node
    # called on a HeldConstant node, so the table is read when the graph runs.
    model, x = PositionModel(name="positional"), _rand(2, 5, 8)
    model(x)
    passed = kip.apply_passes(kip.convert_to_functional(model, x), [Expand()])
    node = passed.kip_graph.node("pos.positions")
    assert node.operation is model.pos.positions
    assert type(node.args[0].producer.operation).__name__ == "HeldConstant"
    assert passed.kip_report.opaque == {}
    kip.frontend.verify.equivalence.check_equivalent(model, passed, x)  # the gradient reaches the table
    model.pos.positions.embeddings.assign(np.ones((5, 8), "float32"))
    assert_same_outputs(model, passed, x, atol=1e-5)  # and new weights are used


# -- Replace -------------------------------------------------------------------
def test_replace_dense_by_subclass_with_copied_weights_is_equivalent():
    model, conv, x = converted(make_transformer)
    old = {id(layer) for layer in conv.layers}
    passed = kip.apply_passes(
        conv, [Expand(), Replace({layers.Dense: Replacement(MyDense, copy_weights=True)})]
    )
    replaced = [n for n in passed.kip_graph.nodes if isinstance(n.operation, MyDense)]
    assert {n.name for n in replaced} == {"encoder.ffn_1", "encoder.ffn_2", "head"}
    for node in replaced:
        assert id(node.operation) not in old
    assert passed.kip_graph.node("encoder.norm_1").operation is model.encoder.norm_1
    kip.frontend.verify.equivalence.check_equivalent(model, passed, x, gradients=False)
    assert len(passed.kip_report.touched("replace")) == 3


def test_replace_without_copying_weights_gives_new_weights():
    model, conv, x = converted(make_nested)
    passed = kip.apply_passes(conv, [Replace({"head": Replacement(MyDense)})])
    assert isinstance(passed.kip_graph.node("head").operation, MyDense)
    with pytest.raises(kip.ConversionError):
        kip.frontend.verify.equivalence.check_equivalent(model, passed, x, gradients=False)


def test_replace_params_merge_into_the_old_config():
    model, conv, x = converted(make_nested)
    passed = kip.apply_passes(
        conv, [Replace({"head": Replacement(MyDense, params={"name": "fast"}, copy_weights=True)})]
    )
    new = passed.kip_graph.node("head").operation
    assert isinstance(new, MyDense)
    config = new.get_config()
    assert config["name"] == "fast"
    assert config["units"] == model.head.units == 2
    assert config["use_bias"] is True
    assert new.name == "fast" and "fast" in [layer.name for layer in passed.layers]
    kip.frontend.verify.equivalence.check_equivalent(model, passed, x, gradients=False)


def test_replace_params_that_change_the_layer_are_applied():
    _, conv, _ = converted(make_nested)
    passed = kip.apply_passes(
        conv, [Replace({"head": Replacement(MyDense, params={"use_bias": False})})]
    )
    new = passed.kip_graph.node("head").operation
    assert new.use_bias is False and new.bias is None


def test_replace_name_param_on_several_layers_keeps_names_unique():
    model, conv, x = converted(make_dict)
    passed = kip.apply_passes(
        conv,
        [Expand(), Replace({layers.Dense: Replacement(MyDense, params={"name": "fast"},
                                                     copy_weights=True)})],
    )
    names = [layer.name for layer in passed.layers]
    assert len(names) == len(set(names))
    assert "fast" in names
    kip.frontend.verify.equivalence.check_equivalent(model, passed, x, gradients=False)


class DoublingDense(layers.Dense):
    """Not equivalent to Dense: the check after copying weights must see it."""

    def call(self, inputs, training=None):
        return 2.0 * super().call(inputs)


def test_replace_checks_an_equivalent_replacement_numerically():
    _, conv, _ = converted(make_nested)
    with pytest.raises(kip.PassError, match="not equivalent"):
        kip.apply_passes(conv, [Replace({"head": Replacement(DoublingDense, copy_weights=True)})])
    # With params that change the layer, a difference is expected, not an error.
    passed = kip.apply_passes(conv, [Replace({"head": Replacement(
        DoublingDense, params={"activation": "relu"}, copy_weights=True)})])
    assert "max output difference" in str(passed.kip_report)


def test_replace_unknown_param_is_rejected_by_name():
    with pytest.raises(kip.PassError, match="unitz"):
        Replacement(MyDense, params={"unitz": 3})


def test_replace_finds_target_inside_unexpanded_custom_layer():
    model, conv, x = converted(make_nested)
    passed = kip.apply_passes(
        conv, [Replace({"dense": Replacement(MyDense, copy_weights=True)})]
    )
    node = passed.kip_graph.node("l1.inner.inner.dense")
    assert isinstance(node.operation, MyDense)
    # Only the containers on the way were expanded; others stay whole.
    assert isinstance(passed.kip_graph.node("l1.inner.norm").operation, layers.LayerNormalization)
    report = passed.kip_report
    expanded_by_replace = [
        e.layer for e in report.entries if e.step == "replace" and e.action == "expanded"
    ]
    assert expanded_by_replace == ["l1", "l1.inner", "l1.inner.inner"]
    assert "l1.inner.inner.dense" in report.touched("replace")
    kip.frontend.verify.equivalence.check_equivalent(model, passed, x, gradients=False)


def test_replace_keeps_shared_layers_shared():
    _, conv, x = converted(make_shared)
    passed = kip.apply_passes(
        conv, [Expand(), Replace({"shared.dense": Replacement(MyDense, copy_weights=True)})]
    )
    # A name reaches every call site of the layer it names (the second one's
    # path is numbered): replacing one site only would un-share the layer.
    nodes = [n for n in passed.kip_graph.nodes if n.name in ("shared.dense", "shared_1.dense")]
    assert len(nodes) == 2
    assert isinstance(nodes[0].operation, MyDense)
    assert nodes[0].operation is nodes[1].operation
    assert_same_outputs(conv, passed, x, atol=1e-5)


def test_replace_without_default_copier_needs_copy_weights_fn():
    class MyAdd(layers.Add):
        pass

    calls = []
    model, conv, x = converted(make_cnn)
    with pytest.raises(kip.PassError, match="copy_weights_fn"):
        kip.apply_passes(
            conv, [Expand(), Replace({layers.GlobalAveragePooling2D: Replacement(
                layers.GlobalAveragePooling2D, copy_weights=True)})]
        )
    passed = kip.apply_passes(
        conv, [Expand(), Replace({layers.Add: Replacement(
            MyAdd, copy_weights_fn=lambda old, new: calls.append((old, new)))})]
    )
    adds = {id(model.block_1.add), id(model.block_2.add)}
    assert len(calls) == 2 and {id(old) for old, _ in calls} == adds
    assert_same_outputs(conv, passed, x, atol=1e-5)


# -- annotations ------------------------------------------------------------------
ANNOTATING = [
    Outline(layers.BatchNormalization, unique_sharding=True),
    Recompute(["block_1.add", "block_2.add"]),
    PipelineStages([["stem", "block_1.add"], ["block_2.conv1"], ["head"]]),
]


def test_annotations_are_recorded_in_the_graph_and_the_model():
    model, passed, x = expanded(make_cnn, ANNOTATING)
    graph = passed.kip_graph
    assert graph.node("block_1.bn1").annotations["outline"] == {"unique_sharding": True}
    assert "outline" not in graph.node("block_1.conv1").annotations
    assert graph.node("block_1.add").annotations["recompute"] is True
    assert "recompute" not in graph.node("block_1.conv2").annotations
    stages = {n.name: n.annotations["stage"] for n in graph.nodes}
    assert stages["stem"] == 0 and stages["block_1.add"] == 0
    assert stages["block_2.conv1"] == 1 and stages["block_2.add"] == 1
    assert stages["pool"] == 1 and stages["head"] == 2
    # The model keys them by Keras layer name: block_1's layers kept their
    # own names, block_2's are called through aliases named by path.
    assert passed.kip_annotations["add"] == {"recompute": True, "stage": 0}
    assert passed.kip_annotations["block_2.bn2"] == {
        "outline": {"unique_sharding": True}, "stage": 1}
    kip.frontend.verify.equivalence.check_equivalent(model, passed, x)


def test_annotations_are_in_the_report():
    _, passed, _ = expanded(make_cnn, ANNOTATING)
    report = passed.kip_report
    assert report.touched("recompute") == ["block_1.add", "block_2.add"]
    assert "block_1.bn1" in report.touched("outline")
    text = str(report)
    for word in ("recompute", "checkpoint after", "outline", "unique_sharding=True",
                 "pipeline_stages", "stage 2"):
        assert word in text, word


def test_annotations_survive_rebuild_and_another_apply():
    _, passed, x = expanded(make_cnn, ANNOTATING)
    rebuilt = rebuild(passed.kip_graph)
    assert rebuilt.kip_annotations == passed.kip_annotations
    again = kip.apply_passes(passed, [])
    assert graph_signature(again) == graph_signature(passed)
    assert again.kip_annotations == passed.kip_annotations
    assert_same_outputs(passed, again, x)


def test_annotations_survive_save_and_load(tmp_path):
    model, passed, x = expanded(make_cnn, ANNOTATING)
    path = str(tmp_path / "x.keras")
    passed.save(path)
    loaded = keras.models.load_model(path)
    assert isinstance(loaded, kip.KipFunctional)
    assert loaded.kip_annotations == passed.kip_annotations
    assert_same_outputs(passed, loaded, x, atol=1e-6)
    assert_same_outputs(model, loaded, x, atol=1e-5)
    # A loaded model (no graph kept) is read back with its annotations.
    again = kip.apply_passes(loaded, [])
    assert again.kip_graph.node("block_1.add").annotations == {"recompute": True, "stage": 0}


def test_pipeline_stages_must_follow_the_data_flow():
    _, conv, _ = converted(make_cnn)
    with pytest.raises(kip.PassError, match="`head` is in stage 0.*`pool`, in stage 1"):
        kip.apply_passes(conv, [PipelineStages([["head"], ["block_1"]])])
    with pytest.raises(kip.PassError, match="stem"):
        kip.apply_passes(conv, [PipelineStages([["stem"], ["stem"]])])


# -- targets -------------------------------------------------------------------
@pytest.mark.parametrize(
    "make_pass, name",
    [
        (lambda: Expand("nope"), "nope"),
        (lambda: Recompute(["block_1", "nope"]), "nope"),
        (lambda: Outline(NoSuchUse), "NoSuchUse"),
        (lambda: PipelineStages([["stem"], ["nope"]]), "nope"),
        (lambda: Replace({"nope": Replacement(MyDense)}), "nope"),
        (lambda: Replace({NoSuchUse: Replacement(MyDense)}), "NoSuchUse"),
    ],
)
def test_target_matching_nothing_is_an_error_naming_it(make_pass, name):
    _, conv, _ = converted(make_cnn)
    with pytest.raises(kip.PassError, match=name):
        kip.apply_passes(conv, [make_pass()])


def test_targets_by_name_class_subclass_and_all():
    _, conv, _ = converted(make_cnn)
    by_name = kip.apply_passes(conv, [Recompute("block_2")])
    assert by_name.kip_report.touched("recompute") == ["block_2"]
    by_class = kip.apply_passes(conv, [Recompute(ResBlock)])
    assert by_class.kip_report.touched("recompute") == ["block_1", "block_2"]
    by_base = kip.apply_passes(conv, [Recompute(layers.Layer)])
    assert by_base.kip_report.touched("recompute") == ["stem", "block_1", "block_2", "pool", "head"]
    by_all = kip.apply_passes(conv, [Expand(), Recompute("all")])
    touched = by_all.kip_report.touched("recompute")
    assert touched == [n.name for n in layer_nodes(by_all)]
    assert "block_1.re_lu" not in touched  # keras.ops operations are not layers
    # A subclass matches its base class target.
    _, conv2, _ = converted(make_nested)
    mine = kip.apply_passes(conv2, [Replace({"head": Replacement(MyDense)}),
                                    Recompute(layers.Dense)])
    assert "head" in mine.kip_report.touched("recompute")


def test_a_target_by_original_layer_name_finds_expanded_layers():
    _, passed, _ = expanded(make_cnn, [Recompute("conv2")])
    assert passed.kip_report.touched("recompute") == ["block_1.conv2", "block_2.conv2"]


def test_invalid_targets_and_passes_are_rejected():
    with pytest.raises(kip.PassError):
        Recompute(3)
    with pytest.raises(kip.PassError):
        Replace({"x": MyDense})
    with pytest.raises(kip.PassError):
        Replacement(int)
    _, conv, _ = converted(make_nested)
    with pytest.raises(kip.PassError, match="passes\\[0\\]"):
        kip.apply_passes(conv, ["expand"])
    with pytest.raises(kip.PassError, match="functional"):
        kip.apply_passes(Nested(), [Expand()])


# -- configs ---------------------------------------------------------------------
YAML_CONFIG = """
expand: all
replace:
  Dense: {class: MyDense, params: {name: fast}, copy_weights: true}
outline: {targets: [BatchNormalization], kwargs: {unique_sharding: true}}
recompute: [block_1.add, block_2.add]
pipeline_stages: [[stem, block_1.add], [block_2.conv1], [fast]]
"""


@pytest.fixture
def registry(monkeypatch):
    """A clean layer registry, with MyDense registered, for one test."""
    monkeypatch.setattr(kip.passes.infra.layer_class_names, "_registry", {})
    kip.register_layer(MyDense)
    return kip.passes.infra.layer_class_names._registry


def python_passes():
    return [
        Expand(),
        Replace({layers.Dense: Replacement(MyDense, params={"name": "fast"}, copy_weights=True)}),
        Outline(layers.BatchNormalization, unique_sharding=True),
        Recompute(["block_1.add", "block_2.add"]),
        PipelineStages([["stem", "block_1.add"], ["block_2.conv1"], ["fast"]]),
    ]


def test_config_from_dict_json_and_yaml_files(tmp_path, registry):
    import yaml

    as_dict = yaml.safe_load(YAML_CONFIG)
    yaml_path = tmp_path / "passes.yaml"
    yaml_path.write_text(YAML_CONFIG)
    json_path = tmp_path / "passes.json"
    json_path.write_text(json.dumps(as_dict))
    expected = python_passes()
    assert kip.passes_from_config(as_dict) == expected
    assert kip.passes_from_config(str(yaml_path)) == expected
    assert kip.passes_from_config(json_path) == expected  # a PathLike too
    assert kip.passes_from_config({"expand": "all"}) != [Expand("block_1")]


def test_yaml_config_and_python_passes_give_identical_graphs(tmp_path, registry):
    path = tmp_path / "passes.yml"
    path.write_text(YAML_CONFIG)
    _, conv, x = converted(make_cnn)
    from_yaml = kip.apply_passes(conv, kip.passes_from_config(path))
    _, conv2, _ = converted(make_cnn)
    from_python = kip.apply_passes(conv2, python_passes())
    assert graph_signature(from_yaml) == graph_signature(from_python)
    assert isinstance(from_yaml.kip_graph.node("head").operation, MyDense)
    assert from_yaml.kip_graph.node("head").annotations["stage"] == 2
    # apply_passes accepts the config directly, too.
    direct = kip.apply_passes(conv, str(path))
    assert graph_signature(direct) == graph_signature(from_yaml)
    assert_same_outputs(from_yaml, direct, x)


@pytest.mark.parametrize(
    "config, path",
    [
        ({"expnd": "all"}, "expnd"),
        ({"replace": {"Dense": {"class": "NoSuchLayerClass"}}}, "replace.Dense.class"),
        ({"replace": {"Dense": {"class": "Dense", "params": {"unitz": 3}}}},
         "replace.Dense.params.unitz"),
        ({"replace": {"Dense": {"class": "Dense", "copy_weights": "yes"}}},
         "replace.Dense.copy_weights"),
        ({"replace": {"Dense": {"class": "Dense", "colour": "red"}}}, "replace.Dense.colour"),
        ({"replace": {"Dense": {"params": {}}}}, "replace.Dense.class"),
        ({"replace": {"Dense": {"class": "Dense", "params": [1]}}}, "replace.Dense.params"),
        ({"replace": {"Dense": "MyDense"}}, "replace.Dense"),
        ({"replace": ["Dense"]}, "replace"),
        ({"recompute": 3}, "recompute"),
        ({"recompute": []}, "recompute"),
        ({"recompute": ["block_1", 7]}, "recompute.1"),
        ({"expand": {"all": True}}, "expand"),
        ({"outline": {"targets": ["Conv2D"], "kwarg": {}}}, "outline.kwarg"),
        ({"outline": {"kwargs": {}}}, "outline.targets"),
        ({"outline": {"targets": ["Conv2D"], "kwargs": {1: 2}}}, "outline.kwargs.1"),
        ({"pipeline_stages": "stem"}, "pipeline_stages"),
        ({"pipeline_stages": [["stem"], 5]}, "pipeline_stages.1"),
        ({"replace": {"Dense": {"class": "collections:OrderedDict"}}}, "replace.Dense.class"),
        ({"replace": {"mod.x:Thing": {"class": "Dense"}}}, "replace.mod.x:Thing"),
    ],
)
def test_config_errors_name_their_path(config, path):
    with pytest.raises(kip.ConfigError) as caught:
        kip.passes_from_config(config)
    assert caught.value.path == path
    assert path in str(caught.value)


def test_config_that_is_not_a_mapping_is_rejected(tmp_path):
    for not_a_mapping in (3, ["expand"]):
        with pytest.raises(kip.ConfigError) as caught:
            kip.passes_from_config(not_a_mapping)
        assert "mapping" in str(caught.value)
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(kip.ConfigError, match="bad.json"):
        kip.passes_from_config(bad)
    with pytest.raises(kip.ConfigError, match="missing.yaml"):
        kip.passes_from_config(tmp_path / "missing.yaml")


def test_import_path_needs_allow_imports(tmp_path, monkeypatch):
    module = tmp_path / "kip_test_user_layers.py"
    module.write_text(
        "import keras\n"
        "IMPORTED = []\n"
        "IMPORTED.append(1)\n"
        "class UserDense(keras.layers.Dense):\n"
        "    pass\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "kip_test_user_layers", raising=False)
    config = {"replace": {"Dense": {"class": "kip_test_user_layers:UserDense"}}}
    with pytest.raises(kip.ConfigError) as caught:
        kip.passes_from_config(config)
    assert caught.value.path == "replace.Dense.class"
    assert "allow_imports" in str(caught.value)
    assert "kip_test_user_layers" not in sys.modules  # nothing was imported
    (replace,) = kip.passes_from_config(config, allow_imports=True)
    user_dense = sys.modules["kip_test_user_layers"].UserDense
    assert replace.mapping[layers.Dense].new_class is user_dense
    with pytest.raises(kip.ConfigError) as caught:
        kip.passes_from_config(
            {"replace": {"Dense": {"class": "kip_test_user_layers:Missing"}}},
            allow_imports=True,
        )
    assert caught.value.path == "replace.Dense.class"
    assert "cannot import 'kip_test_user_layers:Missing'" in str(caught.value)


def test_yaml_python_tags_fail_safely(tmp_path):
    marker = tmp_path / "constructed"

    class Boom:
        def __init__(self, *args, **kwargs):
            marker.write_text("constructed")

        def __setstate__(self, state):
            marker.write_text("constructed")

    sys.modules[__name__].Boom = Boom
    try:
        for text in (
            f"expand: !!python/object:{__name__}.Boom {{a: 1}}\n",
            f"expand: !!python/object/apply:{__name__}.Boom [1]\n",
            f"expand: !!python/object/new:{__name__}.Boom [1]\n",
            f"expand: !!python/name:{__name__}.Boom\n",
        ):
            path = tmp_path / "evil.yaml"
            path.write_text(text)
            with pytest.raises(kip.ConfigError):
                kip.passes_from_config(path)
            assert not marker.exists(), text
    finally:
        del sys.modules[__name__].Boom


def test_register_layer_makes_a_class_nameable(monkeypatch):
    monkeypatch.setattr(kip.passes.infra.layer_class_names, "_registry", {})
    config = {"replace": {"Dense": {"class": "MyDense", "params": {"units": 2}}}}
    with pytest.raises(kip.ConfigError) as caught:
        kip.passes_from_config(config)
    assert caught.value.path == "replace.Dense.class"
    assert kip.register_layer(MyDense) is MyDense
    (replace,) = kip.passes_from_config(config)
    assert replace.mapping[layers.Dense].new_class is MyDense
    assert replace.mapping[layers.Dense].params == {"units": 2}
    # Registered under another name, and usable as a target.
    kip.register_layer(MyDense, name="Turbo")
    (recompute,) = kip.passes_from_config({"recompute": ["Turbo", "block_1"]})
    assert recompute.targets == (MyDense, "block_1")
    with pytest.raises(TypeError):
        kip.register_layer(int)


def test_passes_on_a_loaded_model_with_dict_inputs(tmp_path):
    model, passed, x = expanded(make_dict, [Recompute("tower_a.out")])
    path = str(tmp_path / "dict.keras")
    passed.save(path)
    loaded = keras.models.load_model(path)
    again = kip.apply_passes(loaded, [Recompute("tower_b.out")])
    graph = again.kip_graph
    assert graph.node("tower_a.out").annotations == {"recompute": True}
    assert graph.node("tower_b.out").annotations == {"recompute": True}
    assert set(again(x)) == {"score", "aux"}
    assert_same_outputs(model, again, x, atol=1e-5)


class StaleStatistics(layers.Layer):
    """Reads a BatchNormalization's moving mean through an eager call."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.bn = layers.BatchNormalization(center=False, scale=False, name="bn")

    def call(self, x):
        offset = self.bn(keras.ops.ones((1, 4)), training=False)
        return x + offset


def test_a_constant_from_non_trainable_weights_is_not_frozen_either():
    model, x = keras.Sequential([keras.Input((4,)), StaleStatistics(name="stale")]), _rand(2, 4)
    model(x)
    passed = kip.apply_passes(model, [Expand()])
    # Was: kept whole. The eager call is now a node on a HeldConstant.
    assert passed.kip_graph.node("stale.bn").operation is model.layers[0].bn
    model.layers[0].bn.moving_mean.assign(np.full((4,), 3.0, "float32"))
    assert_same_outputs(model, passed, x, atol=1e-5)


def test_expand_and_replace_under_mirrored_strategy(mirrored):
    with mirrored.scope():
        model, x = PositionModel(name="positional"), _rand(2, 5, 8)
        model(x)
        conv = kip.convert_to_functional(model, x)
    passed = kip.apply_passes(conv, [Expand(), Replace({"head": Replacement(
        MyDense, copy_weights=True)})])
    # Was: `pos` kept whole; its lookup on constant ids is now a node.
    assert passed.kip_graph.node("pos.positions").operation is model.pos.positions
    new = passed.kip_graph.node("head").operation
    assert isinstance(new, MyDense)
    assert isinstance(new.kernel.value, tf.distribute.DistributedValues)
    assert_same_outputs(model, passed, x, atol=1e-5)


def test_summary_shows_nodes_annotations_and_the_report():
    model, passed, _ = expanded(make_cnn, ANNOTATING)
    lines = []
    kip.summary(passed, print_fn=lambda text, **_: lines.append(text))
    text = "\n".join(lines)
    assert "Total params" in text  # Keras's own summary first
    assert "block_1.add" in text and "recompute=True" in text and "stage=" in text
    assert "keras_ipu_plugin report" in text


def test_graph_consumers_follow_the_data_flow():
    _, conv, _ = converted(make_cnn)
    graph = conv.kip_graph
    stem = graph.node("stem")
    assert [node.name for node in graph.consumers(stem)] == ["block_1"]
    assert graph.consumers(graph.nodes[-1]) == []


class CountingBlock(layers.Layer):
    calls = 0

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = layers.Dense(3)

    def call(self, x):
        CountingBlock.calls += 1
        return self.dense(x)


class NoTrainingModel(keras.Model):
    def __init__(self):
        super().__init__()
        self.block = CountingBlock()

    def call(self, x):
        return self.block(x)


class TrainingModel(NoTrainingModel):
    def call(self, x, training=None):
        return self.block(x, training=training)


@pytest.mark.parametrize("model_class, traces", [(NoTrainingModel, 1), (TrainingModel, 2)])
def test_call_that_never_names_training_is_traced_once(model_class, traces):
    model = model_class()
    x = _rand(2, 3)
    model(x)
    CountingBlock.calls = 0
    kip.convert_to_functional(model, x, verify=False)
    # one symbolic run of the block per trace: a built model is traced
    # without an eager call first
    assert CountingBlock.calls == traces


def test_nested_expansion_wires_every_fresh_conversion_correctly():
    """Regression: Expand mapped replaced outputs by `id()`, and the outputs
    of an expanded node nested in another die once expanded, so a later
    Value could reuse such an id and be rewired to the wrong tensor (about
    one conversion in twenty of this model came out wrong)."""
    for _ in range(40):
        model, x = zoo.make_nested()
        model(x)
        passed = kip.apply_passes(kip.convert_to_functional(model, x), [kip.passes.Expand()])
        np.testing.assert_allclose(np.asarray(passed(x)), np.asarray(model(x)), atol=1e-5)


class ConfiglessNorm(keras.layers.Layer):
    """keras_hub's Gemma `RMSNormalization`: no `get_config`, and built with
    `dtype=<a DTypePolicy>`, for which Keras cannot write one either."""

    def __init__(self, epsilon=1e-6, **kwargs):
        super().__init__(**kwargs)
        self.epsilon = epsilon

    def build(self, shape):
        self.scale = self.add_weight(shape=(shape[-1],), initializer="ones", name="scale")

    def call(self, x):
        variance = keras.ops.mean(keras.ops.square(x), axis=-1, keepdims=True)
        return x * keras.ops.rsqrt(variance + self.epsilon) * self.scale


class ScaledNormNet(keras.Model):
    """Gemma's embedding scale `x * ops.cast(sqrt(d), x.dtype)` (which Keras
    calls sparse) before a configless norm."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.embed = keras.layers.Dense(4, name="embed")
        self.norm = ConfiglessNorm(epsilon=0.25, dtype=keras.DTypePolicy("float32"), name="norm")

    def call(self, x):
        x = self.embed(x)
        return self.norm(x * keras.ops.cast(2.0, x.dtype))


def _copy_in_order(old, new):
    for source, target in zip(old.weights, new.weights):
        target.assign(source)


def test_a_tensor_scaled_by_a_constant_is_not_recorded_as_sparse():
    x = np.random.RandomState(0).normal(size=(3, 5)).astype("float32")
    model = ScaledNormNet()
    model(x)
    converted = kip.convert_to_functional(model, x)
    assert not any(value.spec.sparse for node in converted.kip_graph.nodes
                   for value in node.outputs)


def test_replace_reads_a_configless_layers_arguments_from_its_attributes():
    x = np.random.RandomState(0).normal(size=(3, 5)).astype("float32")
    model = ScaledNormNet()
    model(x)
    model.norm.scale.assign([0.5, 1.0, 1.5, 2.0])
    Faster = type("FasterNorm", (ConfiglessNorm,), {})
    passed = kip.apply_passes(kip.convert_to_functional(model, x), [
        Replace({ConfiglessNorm: Replacement(Faster, copy_weights_fn=_copy_in_order)})])
    new = passed.kip_graph.node("norm").operation
    assert type(new) is Faster and new.epsilon == 0.25
    np.testing.assert_allclose(passed(x), model(x), atol=1e-6)
    assert any("read from its attributes" in entry.detail for entry in passed.kip_report.entries)


class ArgumentNotKept(ConfiglessNorm):
    def __init__(self, center=True, **kwargs):
        super().__init__(**kwargs)


def test_replace_of_a_configless_layer_missing_an_argument_says_which():
    x = np.random.RandomState(0).normal(size=(3, 5)).astype("float32")
    inputs = keras.Input((5,))
    outputs = ArgumentNotKept(dtype=keras.DTypePolicy("float32"), name="norm")(inputs)
    model = keras.Model(inputs, outputs)
    with pytest.raises(kip.PassError, match="`center`"):
        kip.apply_passes(kip.convert_to_functional(model, x), [
            Replace({ArgumentNotKept: Replacement(ArgumentNotKept, copy_weights_fn=_copy_in_order)})])
