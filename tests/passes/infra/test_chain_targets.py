"""`kip.passes.Chain`: a target matching runs of nodes, layers and
`keras.ops` / TensorFlow calls alike ("Dense followed by a
`keras.ops.gelu` call"), usable by every pass that takes targets, saved with
the passes and written in configs."""

import numpy as np
import pytest
import tensorflow as tf

import keras
from keras import layers
from keras import ops

import keras_ipu_plugin as kip
from keras_ipu_plugin.passes import Chain
from keras_ipu_plugin.passes import Expand
from keras_ipu_plugin.passes import Outline
from keras_ipu_plugin.passes import Recompute
from keras_ipu_plugin.passes import Replace
from keras_ipu_plugin.passes import Replacement


@keras.saving.register_keras_serializable("test_chain_targets")
class FeedForward(layers.Layer):
    """Dense -> gelu -> Dense, plus the input: one Dense -> gelu run. The
    second Dense's output is read twice (the residual), so no run follows it."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.up = layers.Dense(16, name="up")
        self.down = layers.Dense(8, name="down")

    def call(self, x):
        return x + self.down(ops.gelu(self.up(x)))


@keras.saving.register_keras_serializable("test_chain_targets")
class Net(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.embed = layers.Dense(8, name="embed")
        self.blocks = [FeedForward(name=f"block_{i}") for i in range(2)]
        self.head = layers.Dense(2, name="head")

    def call(self, x):
        h = self.embed(x)
        skip = h
        for block in self.blocks:
            h = block(h)
        return self.head(tf.nn.relu(h + skip))


@keras.saving.register_keras_serializable("test_chain_targets")
class DenseGelu(layers.Dense):
    """A fused Dense + gelu, as an accelerator library provides one."""

    def call(self, x):
        return ops.gelu(super().call(x))


@keras.saving.register_keras_serializable("test_chain_targets")
class DenseRelu(layers.Dense):
    def call(self, x):
        return ops.relu(super().call(x))


def _net():
    x = np.random.RandomState(0).normal(size=(4, 8)).astype("float32")
    model = Net(name="net")
    model(x)
    return model, x


def _expanded(model, x):
    converted = kip.convert_to_functional(model, x)
    return kip.apply_passes(converted, [Expand()], verify=False)


def test_a_chain_matches_layers_followed_by_keras_ops_and_tensorflow_calls():
    model, x = _net()
    graph = _expanded(model, x).kip_graph
    runs = Chain(layers.Dense, ops.gelu).matches(graph)
    assert [[n.name for n in run] for run in runs] == [
        ["blocks.0.up", "blocks.0.gelu"], ["blocks.1.up", "blocks.1.gelu"]]
    (run,) = Chain(ops.add, tf.nn.relu).matches(graph)
    assert [type(n.operation).__name__ for n in run] == ["Add", "TFFunction"]
    assert Chain("blocks.1.up", ops.gelu, layers.Dense).matches(graph)[0][-1].name == "blocks.1.down"


def test_a_chain_does_not_match_through_a_tensor_read_twice():
    # `embed`'s output feeds blocks.0 and the skip connection: a run from it
    # would not compute one tensor from its first node's inputs.
    model, x = _net()
    graph = _expanded(model, x).kip_graph
    assert [run[0].name for run in Chain(layers.Dense, layers.Dense).matches(graph)] == []
    assert [[n.name for n in run] for run in Chain(ops.gelu, layers.Dense).matches(graph)] == [
        ["blocks.0.gelu", "blocks.0.down"], ["blocks.1.gelu", "blocks.1.down"]]


def test_replace_a_chain_by_a_fused_layer_keeps_outputs_and_erases_the_run():
    model, x = _net()
    converted = kip.convert_to_functional(model, x)
    passed = kip.apply_passes(converted, [
        Replace({Chain(layers.Dense, ops.gelu): Replacement(DenseGelu, copy_weights=True)})])
    names = [node.name for node in passed.kip_graph.nodes]
    assert "blocks.0.gelu" not in names and "blocks.1.gelu" not in names
    fused = passed.kip_layer("blocks.0.up")
    assert isinstance(fused, DenseGelu)
    np.testing.assert_array_equal(fused.kernel.numpy(), model.blocks[0].up.kernel.numpy())
    np.testing.assert_allclose(passed(x), model(x), atol=1e-5)
    passed.kip_graph.lint()


def test_replacing_a_chain_by_a_layer_computing_something_else_is_refused():
    model, x = _net()
    converted = kip.convert_to_functional(model, x)
    with pytest.raises(kip.PassError, match="blocks.0.up.*differs from the original"):
        kip.apply_passes(converted, [
            Replace({Chain(layers.Dense, ops.gelu): Replacement(DenseRelu, copy_weights=True)})])


def test_a_chain_starting_with_an_operation_cannot_be_replaced_by_a_layer():
    model, x = _net()
    converted = kip.convert_to_functional(model, x)
    with pytest.raises(kip.PassError, match="blocks.0.gelu.*not a layer"):
        kip.apply_passes(converted, [
            Replace({Chain(ops.gelu, layers.Dense): Replacement(layers.Dense, copy_weights=True)})])


def test_recompute_and_outline_treat_each_chain_match_as_one_unit():
    model, x = _net()
    converted = kip.convert_to_functional(model, x)
    passed = kip.apply_passes(converted, [
        Expand(), Outline(Chain(layers.Dense, ops.gelu)),
        Recompute(Chain(layers.Dense, ops.gelu))])  # verified: gradients equal
    graph = passed.kip_graph
    assert [n.name for n in graph.nodes if n.annotations.get("recompute")] == [
        "blocks.0.gelu", "blocks.1.gelu"]
    assert [n.name for n in graph.nodes if "outline" in n.annotations] == [
        "blocks.0.up", "blocks.1.up"]
    assert "end of chain match `blocks.0.up..blocks.0.gelu`" in str(passed.kip_report)


def test_a_chain_matching_nothing_is_an_error_naming_it():
    model, x = _net()
    converted = kip.convert_to_functional(model, x)
    with pytest.raises(kip.PassError, match=r"chain Dense -> keras.ops.softmax"):
        kip.apply_passes(converted, [Recompute(Chain(layers.Dense, ops.softmax))])


def test_a_chain_step_must_be_a_layer_or_a_function_and_expand_takes_none():
    with pytest.raises(kip.PassError, match="chain step"):
        Chain(layers.Dense, 3)
    with pytest.raises(kip.PassError, match="two steps or more"):
        Chain(layers.Dense)
    with pytest.raises(kip.PassError, match="not a Chain"):
        Expand(Chain(layers.Dense, ops.gelu))


def test_chain_targets_round_trip_through_configs_and_saved_models(tmp_path):
    chain = Chain(layers.Dense, ops.gelu, "head", tf.nn.relu)
    recompute = Recompute(chain)
    assert Recompute.from_config(recompute.get_config()) == recompute
    replace = Replace({Chain(layers.Dense, ops.gelu): Replacement(DenseGelu, copy_weights=True)})
    assert Replace.from_config(replace.get_config()) == replace
    passes = kip.passes_from_config(
        {"recompute": [{"chain": ["Dense", {"op": "gelu"}]}, {"chain": [{"op": "add"},
                                                                        {"tf": "nn.relu"}]}]})
    assert passes == [Recompute([Chain(layers.Dense, ops.gelu), Chain(ops.add, tf.nn.relu)])]

    model, x = _net()
    plugin = kip.PluginModel(model, passes=[replace])
    plugin.compile(optimizer="sgd", loss="mse")
    plugin.fit(x, np.zeros((4, 2), "float32"), epochs=1, verbose=0)
    path = str(tmp_path / "chain.keras")
    plugin.save(path)
    loaded = keras.models.load_model(path)
    np.testing.assert_allclose(loaded(x), plugin(x), atol=1e-6)


def test_a_config_chain_with_an_unknown_function_names_its_path():
    with pytest.raises(kip.ConfigError, match=r"recompute\.0\.chain\.1: .*no_such_op"):
        kip.passes_from_config({"recompute": [{"chain": ["Dense", {"op": "no_such_op"}]}]})
