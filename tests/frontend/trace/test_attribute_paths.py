"""Node paths are attribute paths: the chain of attribute
names from the model to the layer, as torch.fx names modules (`stem`,
`blocks.0.dense`; lists and tuples by index, dicts by key). Keras's own
names come from a process-wide counter, so the same class built twice gets
other names; its paths are the same, and a config written from the first
run's report applies to the second. Keras's names stay accepted as aliases
where they name no path."""

import numpy as np
import pytest

import keras
from keras import layers
from keras import ops

import keras_ipu_plugin as kip
from keras_ipu_plugin.frontend.trace.attribute_paths import attribute_paths
from keras_ipu_plugin.passes import Expand
from keras_ipu_plugin.passes import Recompute
from keras_ipu_plugin.passes.infra.patterns import names_a_path


class Block(layers.Layer):
    """Auto-named sub-layers: Keras calls them `dense_7` the second time."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = layers.Dense(8)
        self.norm = layers.LayerNormalization()

    def call(self, x):
        return x + self.norm(self.dense(x))


class Wrapper(layers.Layer):
    """A block nested in a layer, and a keras.ops call of its own."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.block = Block()

    def call(self, x):
        return ops.relu(self.block(x))


class Net(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.stem = layers.Dense(8)
        self.blocks = [Block() for _ in range(2)]
        self.heads = {"a/b": layers.Dense(8), "main": layers.Dense(8)}
        self.nested = Wrapper()
        self.shared = layers.Dense(8)
        self.out = layers.Dense(2)

    def call(self, x):
        h = self.stem(x)
        for block in self.blocks:
            h = block(h)
        h = ops.add(self.heads["a/b"](h), self.heads["main"](h))  # a top-level keras.ops call
        h = self.nested(h)
        h = self.shared(self.shared(h))  # one layer, two call sites
        return self.out(h)


X = np.random.default_rng(0).normal(size=(4, 8)).astype("float32")

CONVERTED_PATHS = ["stem", "blocks.0", "blocks.1", "heads.a_b", "heads.main", "add",
                   "nested", "shared", "shared_1", "out"]
EXPANDED_PATHS = [
    "stem", "blocks.0.dense", "blocks.0.norm", "blocks.0.add",
    "blocks.1.dense", "blocks.1.norm", "blocks.1.add", "heads.a_b", "heads.main", "add",
    "nested.block.dense", "nested.block.norm", "nested.block.add", "nested.relu",
    "shared", "shared_1", "out",
]


def _build():
    model = Net()
    model(X)
    return model, kip.convert_to_functional(model, X)


def _names(model):
    return [node.name for node in model.kip_graph.nodes]


def _reported(report):
    """The layers a report names, less the model's own (Keras-named) entries."""
    return sorted({entry.layer for entry in report.entries} - {"net", "net_functional"}
                  - {f"net_1{suffix}" for suffix in ("", "_functional")})


def test_the_same_class_built_twice_gives_the_same_paths():
    first, first_converted = _build()
    second, second_converted = _build()
    # Keras's names moved on with its counter; the paths did not.
    assert first.blocks[0].dense.name != second.blocks[0].dense.name
    assert first.stem.name != second.stem.name
    assert _names(first_converted) == _names(second_converted) == CONVERTED_PATHS
    first_passed = kip.apply_passes(first_converted, [Expand()])
    second_passed = kip.apply_passes(second_converted, [Expand()])
    assert _names(first_passed) == _names(second_passed) == EXPANDED_PATHS
    assert sorted(first_passed.kip_layer_paths) == sorted(second_passed.kip_layer_paths)
    assert _reported(first_passed.kip_report) == _reported(second_passed.kip_report)
    # Each path is its own build's layer.
    for model, passed in ((first, first_passed), (second, second_passed)):
        assert passed.kip_graph.node("blocks.1.dense").operation is model.blocks[1].dense
        assert passed.kip_graph.node("heads.a_b").operation is model.heads["a/b"]
        assert passed.kip_graph.node("shared_1").operation is model.shared
    np.testing.assert_allclose(second_passed(X), second(X), atol=1e-5)


def test_a_config_written_from_the_first_runs_report_applies_to_the_second():
    _, first_converted = _build()
    first_passed = kip.apply_passes(first_converted, [Expand()])
    # What a user copies from the first run: the paths of the report and graph.
    dense_paths = [n.name for n in first_passed.kip_graph.nodes
                   if isinstance(n.operation, layers.Dense) and n.name.startswith("blocks.")]
    assert dense_paths == ["blocks.0.dense", "blocks.1.dense"]
    assert {"blocks.1", "nested", "nested.block"} <= set(first_passed.kip_report.touched("expand"))
    config = {"expand": "all", "recompute": ["blocks.1.dense", "nested.block.norm"]}

    marked = []
    for _ in range(2):
        model, converted = _build()
        passed = kip.apply_passes(converted, kip.passes_from_config(config))
        recomputed = [n for n in passed.kip_graph.nodes if n.annotations.get("recompute")]
        assert [n.operation for n in recomputed] == [model.blocks[1].dense, model.nested.block.norm]
        marked.append(([n.name for n in recomputed], passed.kip_report.touched("recompute")))
    assert marked[0] == marked[1] == (["blocks.1.dense", "nested.block.norm"],) * 2


def test_kip_layer_takes_an_attribute_path_or_a_keras_name():
    model, converted = _build()
    assert converted.kip_layer("blocks.1") is model.blocks[1]
    assert converted.kip_layer("heads.a_b") is model.heads["a/b"]
    assert converted.kip_layer(model.blocks[1].name) is model.blocks[1]  # alias
    passed = kip.apply_passes(converted, [Expand()])
    assert passed.kip_layer("blocks.1.dense") is model.blocks[1].dense
    assert passed.kip_layer("nested.block.norm") is model.nested.block.norm
    assert passed.kip_layer(model.blocks[1].dense.name) is model.blocks[1].dense  # alias
    # An expanded block, by its path and by its Keras name.
    assert passed.kip_layer("nested.block") is model.nested.block
    assert passed.kip_layer(model.blocks[1].name) is model.blocks[1]
    with pytest.raises(ValueError, match="no layer at path 'blocks.9'"):
        passed.kip_layer("blocks.9")


def test_a_keras_layer_name_is_still_a_target():
    model, converted = _build()
    before = kip.apply_passes(converted, [Recompute([model.blocks[1].name])])
    assert [n.name for n in before.kip_graph.nodes if n.annotations.get("recompute")] == [
        "blocks.1"]
    after = kip.apply_passes(converted, [Expand(), Recompute([model.blocks[1].dense.name])])
    assert [n.name for n in after.kip_graph.nodes if n.annotations.get("recompute")] == [
        "blocks.1.dense"]
    # Reached inside a block not expanded, by its Keras name.
    reached = kip.apply_passes(converted, [Recompute([model.nested.block.norm.name])])
    assert [n.operation for n in reached.kip_graph.nodes if n.annotations.get("recompute")] == [
        model.nested.block.norm]


class Clash(keras.Model):
    """`embed` is named `dense` by its user; `self.dense` is named `proj`;
    `head` is auto-named (`dense` too, the first Dense of a fresh session)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.embed = layers.Dense(8, name="dense")
        self.dense = layers.Dense(8, name="proj")
        self.head = layers.Dense(2)

    def call(self, x):
        return self.head(self.dense(self.embed(x)))


def test_a_target_that_is_a_path_never_matches_another_layer_by_its_keras_name():
    # "dense" is the path of `self.dense`; it is also the Keras name of
    # `embed` (and here of `head`). Matched by both, a config copied from the
    # report recomputed three layers in this build and one in the next.
    x = np.ones((4, 3), "float32")
    model = Clash()
    model(x)
    assert model.embed.name == "dense"
    converted = kip.convert_to_functional(model, x)
    assert _names(converted) == ["embed", "dense", "head"]
    passed = kip.apply_passes(converted, [Recompute(["dense"])])
    assert [n.operation for n in passed.kip_graph.nodes if n.annotations.get("recompute")] == [
        model.dense]
    assert passed.kip_report.touched("recompute") == ["dense"]
    assert converted.kip_layer("dense") is model.dense
    # A Keras name that is no path is an alias still.
    aliased = kip.apply_passes(converted, [Recompute(["proj"])])
    assert [n.name for n in aliased.kip_graph.nodes if n.annotations.get("recompute")] == ["dense"]
    chain = kip.passes.Chain("dense", layers.Dense)
    assert [[n.name for n in run] for run in chain.matches(converted.kip_graph)] == [
        ["dense", "head"]]


def test_a_dict_key_that_is_not_an_identifier_becomes_a_path_part():
    paths = attribute_paths(_build()[0])
    assert {path for path in paths.values() if path.startswith("heads.")} == {
        "heads.a_b", "heads.main"}
    for path in paths.values():  # every part a Keras name accepts (no `/`), no empty part
        assert all(part and part.replace("_", "a").isalnum() for part in path.split("."))
    model, converted = _build()
    passed = kip.apply_passes(converted, [Recompute(["heads.a_b"])])
    assert [n.operation for n in passed.kip_graph.nodes if n.annotations.get("recompute")] == [
        model.heads["a/b"]]


def test_a_target_matching_nothing_suggests_paths_inside_blocks_not_expanded():
    # The suggestions are paths a target may name (`blocks.0.dense`), never
    # a Keras name after a path (`blocks.0.dense_1`) that matches nothing.
    model, converted = _build()
    with pytest.raises(kip.PassError, match=r"nearest: ") as raised:
        kip.apply_passes(converted, [Recompute(["blocks.0.dens"])])
    suggested = str(raised.value).split("nearest: ")[1].split(")")[0].split(", ")
    assert "blocks.0.dense" in suggested
    assert all(names_a_path(converted.kip_graph, path) for path in suggested), suggested


class Positions(layers.Layer):
    """Its position Embedding is called on a constant (`arange`), which the
    trace holds in a node named after that Embedding."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.pos = layers.Embedding(6, 4)

    def call(self, x):
        return x + self.pos(ops.arange(6))


class PositionNet(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.positions = Positions()

    def call(self, x):
        return self.positions(x)


def test_a_constant_a_layer_is_called_on_is_named_after_its_attribute():
    x = np.ones((2, 6, 4), "float32")
    names = []
    for _ in range(2):
        model = PositionNet()
        model(x)
        passed = kip.apply_passes(kip.convert_to_functional(model, x), [Expand()])
        names.append(_names(passed))
    assert names[0] == names[1]
    assert "positions.pos_input" in names[0], names[0]


def test_a_path_inside_blocks_not_expanded_reaches_its_layer():
    model, converted = _build()
    passed = kip.apply_passes(converted, [Recompute(["nested.block.norm"])])
    assert [n.name for n in passed.kip_graph.nodes if n.annotations.get("recompute")] == [
        "nested.block.norm"]
    assert passed.kip_graph.node("nested.block.norm").operation is model.nested.block.norm
    assert "blocks.0" in _names(passed)  # only the layers on the way were expanded


class WithUnnamedSubModels(keras.Model):
    """Layers Keras names inside a nested Sequential and functional model,
    beside layers the code names (`"score"`)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.bottom_mlp = keras.Sequential([layers.Dense(8, activation="relu"), layers.Dense(4)])
        inputs = keras.Input((4,))
        outputs = layers.Dense(3, name="score")(layers.Dense(5)(inputs))
        self.top = keras.Model(inputs, outputs)
        self.head = layers.Dense(1)

    def call(self, x):
        return self.head(self.top(self.bottom_mlp(x)))


def _expanded_paths(model_class, x):
    converted = kip.convert_to_functional(model_class(), x)
    passed = kip.apply_passes(converted, [Expand("all")])
    return [node.name for node in passed.kip_graph.nodes]


def test_layers_keras_names_in_nested_sub_models_are_named_by_position():
    """`bottom_mlp.dense` became `bottom_mlp.dense_8` on the next build: a
    sub-model's layer Keras named is named by its place in `layers` (as
    torch.fx names a Sequential's children), one its code named by that name."""
    x = np.ones((4, 6), "float32")
    first = _expanded_paths(WithUnnamedSubModels, x)
    assert {"bottom_mlp.0", "bottom_mlp.1", "top.1", "top.score"} <= set(first)
    assert _expanded_paths(WithUnnamedSubModels, x) == first


class Branchy(keras.Model):
    """Traced as one opaque node (a Python `if` on a tensor's value)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = layers.Dense(2)

    def call(self, x):
        if float(ops.sum(x)) > 0:
            return self.dense(x)
        return self.dense(-x)


def test_a_whole_model_opaque_node_is_named_by_its_class_in_every_build():
    x = np.ones((2, 3), "float32")
    names = [[node.name for node in kip.convert_to_functional(Branchy(), x).kip_graph.nodes]
             for _ in range(2)]
    assert names[0] == names[1] == ["branchy_opaque"]


def test_a_sequential_given_as_it_is_names_keras_named_layers_by_class_in_every_build():
    """A GAN's generator converted on its own: `dense_1` in one build was
    `dense_8` in the next, as Keras's counter moved on in between."""
    x = np.ones((2, 3), "float32")

    def names():
        model = keras.Sequential([keras.Input((3,)), layers.Dense(4), layers.Dense(2, name="out")])
        return [node.name for node in kip.convert_to_functional(model, x).kip_graph.nodes]

    first = names()
    for _ in range(5):
        layers.Dense(2)  # Keras's counter moves on between the builds
    assert names() == first
    assert "out" in first and "dense" in first
