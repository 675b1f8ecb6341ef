"""`kip.create_feature_extractor`: inner layers' outputs, after every pass.

The model's layers are named like their attributes, so the paths are the
same under either naming (Keras names or attribute paths).
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_ipu_plugin as kip
from keras_ipu_plugin.passes import Expand, Outline, PipelineStages, Recompute, Replace
from keras_ipu_plugin.passes import Replacement


class Block(keras.layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(8, activation="relu", name="dense")
        self.norm = keras.layers.LayerNormalization(name="norm")

    def call(self, x):
        return x + self.norm(self.dense(x))


class Inner(keras.layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.block = Block(name="block")
        self.proj = keras.layers.Dense(8, name="proj")

    def call(self, x):
        return self.proj(self.block(x))


class Net(keras.Model):
    def __init__(self):
        super().__init__(name="net")
        self.stem = keras.layers.Dense(8, name="stem")
        self.b1, self.b2 = Block(name="b1"), Block(name="b2")
        self.outer = Inner(name="outer")
        self.head = keras.layers.Dense(3, name="head")

    def call(self, x):
        return self.head(self.outer(self.b2(self.b1(self.stem(x)))))


X = np.random.default_rng(0).normal(size=(8, 5)).astype("float32")


def _references(model, x):
    """Each path's output computed by calling the layers themselves."""
    stem = model.stem(x)
    b1 = model.b1(stem)
    b2 = model.b2(b1)
    block = model.outer.block(b2)
    return {
        "stem": stem, "b1": b1, "b1.dense": model.b1.dense(stem),
        "b1.norm": model.b1.norm(model.b1.dense(stem)), "b2": b2,
        "outer": model.outer(b2), "outer.block": block,
        "outer.block.dense": model.outer.block.dense(b2), "head": model(x),
    }


TOP = ["stem", "b1", "b2", "outer", "head"]
INNER = ["b1", "b1.dense", "b1.norm", "outer.block", "outer.block.dense", "head"]
PASSES = {
    "converted": ([], TOP),
    "expand": ([Expand()], INNER),
    "replace": ([Expand(), Replace({"head": Replacement(keras.layers.Dense, copy_weights=True)})],
                INNER),
    "outline": ([Expand(), Outline(keras.layers.LayerNormalization)], INNER),
    "recompute_hand": ([Expand(), Recompute(keras.layers.LayerNormalization)], INNER),
    "recompute_blocks": ([Recompute(Block)], TOP),
    "recompute_auto": ([Expand(), Recompute(auto=True)], INNER),
    "pipeline": ([Expand(), PipelineStages(num_stages=2)], INNER),
    "pipeline_blocks": ([PipelineStages(num_stages=2)], TOP),
}


@pytest.fixture(scope="module")
def net():
    model = Net()
    return model, kip.convert_to_functional(model, X)


@pytest.mark.parametrize("kind", list(PASSES))
def test_features_equal_the_layers_own_outputs_after_each_pass(net, kind):
    model, converted = net
    passes, paths = PASSES[kind]
    passed = kip.apply_passes(converted, passes) if passes else converted
    features = kip.create_feature_extractor(passed, paths)
    outputs = features(X)
    assert sorted(outputs) == sorted(paths)
    references = _references(model, X)
    for path in paths:
        np.testing.assert_allclose(outputs[path], references[path], rtol=1e-5, atol=1e-6,
                                   err_msg=f"{kind}: {path}")
    # The same variables: the extractor trains nothing of its own.
    assert {id(v) for v in features.trainable_variables} <= {
        id(v) for v in model.trainable_variables} | {
        id(v) for v in passed.trainable_variables}


def test_outputs_can_be_renamed_and_only_needed_nodes_are_kept(net):
    _, converted = net
    features = kip.create_feature_extractor(converted, {"b1": "early"})
    assert list(features(X)) == ["early"]
    assert {layer.name for layer in features.layers} >= {"stem", "b1"}
    assert not {"b2", "outer", "head"} & {layer.name for layer in features.layers}


def test_gradients_of_the_head_with_respect_to_a_feature_map_as_grad_cam_takes_them(net):
    model, converted = net
    passed = kip.apply_passes(converted, [Expand()])
    features = kip.create_feature_extractor(passed, {"b2": "maps", "head": "logits"})
    with tf.GradientTape() as tape:
        out = features(X)
        score = tf.reduce_sum(out["logits"][:, 1])
    grads = tape.gradient(score, out["maps"])
    with tf.GradientTape() as tape:
        maps = model.b2(model.b1(model.stem(X)))
        tape.watch(maps)
        reference = tf.reduce_sum(model.head(model.outer(maps))[:, 1])
    np.testing.assert_allclose(grads, tape.gradient(reference, maps), rtol=1e-5, atol=1e-6)


def test_a_keras_layer_name_is_an_alias_of_its_node(net):
    model, converted = net
    features = kip.create_feature_extractor(converted, [model.head.name])
    np.testing.assert_allclose(features(X)[model.head.name], model(X), rtol=1e-5)


@pytest.mark.parametrize("return_nodes,match", [
    (["b3"], "no node or expanded block at path 'b3'.*nearest: b2"),
    ([], "names no node"),
    (42, "a list of node paths or a dict"),
    ({"b1": 3}, "strings"),
    ({"b1": "x", "b2": "x"}, "the same output name"),
])
def test_wrong_return_nodes_are_errors_naming_them(net, return_nodes, match):
    with pytest.raises(kip.PassError, match=match):
        kip.create_feature_extractor(net[1], return_nodes)


def test_a_subclassed_model_is_refused_with_the_way_to_convert_it(net):
    with pytest.raises(kip.PassError, match="convert_to_functional"):
        kip.create_feature_extractor(net[0], ["b1"])


@pytest.mark.parametrize("kind", ["converted", "recompute_blocks", "pipeline_blocks"])
def test_a_path_inside_a_kept_block_is_reached_by_expanding_only_the_blocks_on_the_way(net, kind):
    """As torchvision reaches any module: `outer.block.dense` lies two
    blocks deep in a model whose blocks are kept whole."""
    model, converted = net
    passes, _ = PASSES[kind]
    passed = kip.apply_passes(converted, passes) if passes else converted
    paths = ["b1.dense", "outer.block.dense", "b2"]
    features = kip.create_feature_extractor(passed, paths)
    references = _references(model, X)
    outputs = features(X)
    for path in paths:
        np.testing.assert_allclose(outputs[path], references[path], rtol=1e-5, atol=1e-6,
                                   err_msg=path)
    # Only the blocks on the way were expanded: `b2` is still one node.
    assert "b2" in {layer.name for layer in features.layers}
    assert "b2.dense" not in [node.name for node in features.kip_graph.nodes]
    assert [node.name for node in passed.kip_graph.nodes] == [
        node.name for node in (kip.apply_passes(converted, passes) if passes else converted
                               ).kip_graph.nodes]  # the model given is left as it was


def test_a_plugin_model_gives_its_converted_graph_once_it_has_seen_a_batch():
    keras.utils.set_random_seed(1)
    model = Net()
    plugin = kip.PluginModel(model)
    with pytest.raises(kip.PassError, match="has not seen a batch yet.*plugin\\(x\\)"):
        kip.create_feature_extractor(plugin, ["b1.dense"])
    plugin(X)
    features = kip.create_feature_extractor(plugin, ["b1.dense", "head"])
    references = _references(model, X)
    for path in ("b1.dense", "head"):
        np.testing.assert_allclose(features(X)[path], references[path], rtol=1e-5, atol=1e-6)


def test_the_grad_cam_example_runs_and_gives_one_map_per_image(capsys):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "examples" / "grad_cam.py"
    spec = importlib.util.spec_from_file_location("kip_example_grad_cam", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    heat = module.main()
    assert heat.shape == (4, 16, 16) and np.isfinite(heat).all() and heat.max() > 0
    assert "final loss:" in capsys.readouterr().out
