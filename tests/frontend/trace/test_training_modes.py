"""Layers whose `call` branches on `training` in Python.

Stochastic depth as keras.io's CCT writes it (`StochasticDepth`: in
training, a per-sample mask drawn from the layer's seed generator; in
inference, `return x`), a layer whose two modes call different sub-layers,
one nested in another block, and a layer whose `training=None` is a third
computation. Each becomes one `ModeSwitch` node holding the graph of each
mode: it converts fully traced, `Expand("all")` reaches inside both modes,
verification checks every mode (and catches a wrong mode planted in a
switch), `PluginModel(passes=[Expand("all")])` trains 3 steps to the
weights of plain Keras on an identical twin, and the passed model saves
and loads.
"""

import json

import keras
import numpy as np
import pytest

import keras_ipu_plugin as kip
from keras_ipu_plugin.frontend.verify.equivalence import check_equivalent
from keras_ipu_plugin.passes import Expand
from keras_ipu_plugin.passes import Outline
from keras_ipu_plugin.passes import PipelineStages
from keras_ipu_plugin.passes import Recompute
from keras_ipu_plugin.passes import Replace
from keras_ipu_plugin.passes import Replacement
from keras_ipu_plugin.runtime.mode_switch import ModeSwitch

from graph_checks import all_nodes, outputs_in_every_mode

layers, ops = keras.layers, keras.ops
WIDTH = 8


class StochasticDepth(layers.Layer):
    """keras.io's CCT example (examples/vision/cct.py), as written there."""

    def __init__(self, drop_prop, **kwargs):
        super().__init__(**kwargs)
        self.drop_prob = drop_prop
        self.seed_generator = keras.random.SeedGenerator(1337)

    def call(self, x, training=None):
        if training:
            keep_prob = 1 - self.drop_prob
            shape = (ops.shape(x)[0],) + (1,) * (len(x.shape) - 1)
            random_tensor = keep_prob + keras.random.uniform(shape, 0, 1, seed=self.seed_generator)
            random_tensor = ops.floor(random_tensor)
            return (x / keep_prob) * random_tensor
        return x


class TwoWays(layers.Layer):
    """Calls another sub-layer in each mode (and one in both)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.train_path = layers.Dense(WIDTH, name="train_path")
        self.infer_path = layers.Dense(WIDTH, name="infer_path")
        self.norm = layers.LayerNormalization(name="norm")

    def call(self, x, training=False):
        if training:
            return self.norm(self.train_path(x))
        return self.norm(self.infer_path(x)) * 0.5


class NoneIsItsOwnMode(layers.Layer):
    """`training=None` computes a third thing (Keras hands `call` None
    when no mode is given or set by an outer call)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = layers.Dense(WIDTH, name="dense")

    def call(self, x, training=None):
        if training is None:
            return self.dense(x) + 1.0
        if training:
            return self.dense(x) * 2.0
        return self.dense(x)


class ResidualBlock(layers.Layer):
    """A block that does not branch, holding layers that do."""

    def __init__(self, drop, **kwargs):
        super().__init__(**kwargs)
        self.dense = layers.Dense(WIDTH, activation="tanh", name="dense")
        self.two = TwoWays(name="two")
        self.drop_path = StochasticDepth(drop, name="drop_path")

    def call(self, x, training=None):
        h = self.two(self.dense(x), training=training)
        return x + self.drop_path(h, training=training)


class CCTLike(keras.Model):
    """Residual branches dropped by stochastic depth, as in CCT."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.stem = layers.Dense(WIDTH, name="stem")
        self.attention = layers.Dense(WIDTH, activation="relu", name="attention")
        self.depth_1 = StochasticDepth(0.3)
        self.mlp = keras.Sequential([layers.Dense(WIDTH, activation="gelu"), layers.Dropout(0.2),
                                     layers.Dense(WIDTH)])
        self.depth_2 = StochasticDepth(0.3)
        self.head = layers.Dense(1, name="head")

    def call(self, x, training=None):
        x = self.stem(x)
        x = x + self.depth_1(self.attention(x), training=training)
        x = x + self.depth_2(self.mlp(x, training=training), training=training)
        return self.head(x)


class TwoWaysNet(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.stem = layers.Dense(WIDTH, name="stem")
        self.two = TwoWays(name="two")
        self.head = layers.Dense(1, name="head")

    def call(self, x, training=None):
        return self.head(self.two(self.stem(x), training=training))


class NestedNet(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.stem = layers.Dense(WIDTH, name="stem")
        self.blocks = [ResidualBlock(0.4, name=f"block_{i}") for i in range(2)]
        self.head = layers.Dense(1, name="head")

    def call(self, x, training=None):
        x = self.stem(x)
        for block in self.blocks:
            x = block(x, training=training)
        return self.head(x)


class DefaultNet(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.stem = layers.Dense(WIDTH, name="stem")
        self.odd = NoneIsItsOwnMode(name="odd")
        self.head = layers.Dense(1, name="head")

    def call(self, x, training=None):
        return self.head(self.odd(self.stem(x), training=training))


class BranchingModel(keras.Model):
    """The model's own `call` branches on `training`."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.stem = layers.Dense(WIDTH, name="stem")
        self.noise = StochasticDepth(0.5)
        self.head = layers.Dense(1, name="head")

    def call(self, x, training=None):
        x = self.stem(x)
        if training:
            x = self.noise(x, training=training) + 1.0
        return self.head(x)


MODELS = {
    "stochastic_depth": CCTLike,
    "two_ways": TwoWaysNet,
    "nested": NestedNet,
    "none_default": DefaultNet,
    "model_branches": BranchingModel,
}


def _data(rows=24, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(rows, 4)).astype("float32"),
            rng.normal(size=(rows, 1)).astype("float32"))


def _built(name, seed=3):
    keras.utils.set_random_seed(seed)
    model = MODELS[name]()
    model(_data()[0][:2])
    return model


def _switches(graph):
    found = []
    for node in graph.nodes:
        if isinstance(node.operation, ModeSwitch):
            found.append(node)
            for branch in node.operation.branch_graphs.values():
                found.extend(_switches(branch))
    return found


@pytest.mark.parametrize("name", sorted(MODELS))
def test_converts_traced_and_expands_inside_both_modes(name):
    model = _built(name)
    x, _ = _data()
    converted = kip.convert_to_functional(model, x)
    assert not [n.name for n in converted.kip_graph.nodes if n.opaque_reason]
    expanded = kip.apply_passes(converted, [Expand("all")])
    graph = expanded.kip_graph
    switches = _switches(graph)
    assert switches, "a layer branching on training became no ModeSwitch"
    assert not [n.name for n in all_nodes(graph) if n.opaque_reason]
    for switch in switches:
        branches = switch.operation.branch_graphs
        assert {"training", "inference"} <= set(branches)
        for branch in branches.values():
            branch.lint()
            # Expand reached inside: no custom layer is left in any mode.
            assert not [n.name for n in branch.nodes if type(n.operation) in (
                StochasticDepth, TwoWays, NoneIsItsOwnMode, ResidualBlock)]
    outputs_in_every_mode(model, expanded, x)
    assert "training=True" in str(expanded.kip_report)


def test_both_modes_hold_the_layers_each_calls():
    model = _built("two_ways")
    expanded = kip.apply_passes(kip.convert_to_functional(model, _data()[0]), [Expand("all")])
    (switch,) = _switches(expanded.kip_graph)
    assert switch.name == "two"
    names = {mode: [n.name for n in graph.nodes]
             for mode, graph in switch.operation.branch_graphs.items()}
    assert names["training"] == ["two.train_path", "two.norm"]
    assert names["inference"] == ["two.infer_path", "two.norm", "two.multiply"]
    # TwoWays' signature says training=False: None runs the inference graph.
    assert switch.operation.none_means == "inference"
    # One set of weights: the shared norm is one layer in both modes.
    layers_in = {mode: {id(n.operation) for n in graph.nodes}
                 for mode, graph in switch.operation.branch_graphs.items()}
    assert id(model.two.norm) in layers_in["training"] & layers_in["inference"]
    assert len(expanded.trainable_variables) == len(model.trainable_variables)
    # Layers inside the modes are found by path.
    assert expanded.kip_layer("two.train_path") is model.two.train_path
    assert expanded.kip_layer("two.infer_path") is model.two.infer_path
    with pytest.raises(TypeError, match="Python True / False / None"):
        switch.operation.mode_for(keras.ops.convert_to_tensor(True))


def test_none_that_computes_a_third_thing_is_a_mode_of_its_own():
    model = _built("none_default")
    expanded = kip.apply_passes(kip.convert_to_functional(model, _data()[0]), [Expand("all")])
    (switch,) = _switches(expanded.kip_graph)
    assert switch.operation.none_means == "default"
    assert set(switch.operation.branch_graphs) == {"training", "inference", "default"}
    assert "training=None" in str(expanded.kip_report)


def test_stochastic_depth_draws_only_in_training_as_keras_does():
    model = _built("stochastic_depth")
    x, _ = _data()
    expanded = kip.apply_passes(kip.convert_to_functional(model, x), [Expand("all")])
    seed = model.depth_1.seed_generator.state
    before = seed.numpy()
    expanded(x, training=False)
    expanded(x)
    np.testing.assert_array_equal(seed.numpy(), before)
    expanded(x, training=True)
    assert not np.array_equal(seed.numpy(), before)


@pytest.mark.parametrize("name", ["stochastic_depth", "two_ways"])
def test_verification_catches_a_wrong_mode(name):
    model = _built(name)
    x, _ = _data()
    expanded = kip.apply_passes(kip.convert_to_functional(model, x), [Expand("all")])
    switch_node = _switches(expanded.kip_graph)[0]
    switch = switch_node.operation
    # Planted: the training mode computes the inference graph.
    wrong = switch.with_branch_graphs({"training": switch.branch_graphs["inference"],
                                       "inference": switch.branch_graphs["inference"]})
    graph = expanded.kip_graph.copy()
    graph.node(switch_node.name).operation = wrong
    from keras_ipu_plugin.runtime.rebuild import rebuild

    planted = rebuild(graph)
    with pytest.raises(kip.ConversionError, match="training=True"):
        check_equivalent(model, planted, x)


TRAINED_PASSES = {
    "expand": lambda: [Expand("all")],
    # A checkpoint after the switch whose training mode draws: the
    # recomputation must draw the very same mask.
    "recompute_switch": lambda: [Expand("all"), Recompute(["depth_1", "depth_2"])],
    "recompute_inside": lambda: [Recompute(["blocks.0.two.norm", "blocks.1.drop_path"])],
    "recompute_auto": lambda: [Expand("all"), Recompute(auto=True)],
}


@pytest.mark.parametrize("name, passes", [
    *[(name, "expand") for name in sorted(MODELS)],
    ("stochastic_depth", "recompute_switch"), ("nested", "recompute_inside"),
    ("nested", "recompute_auto"),
])
def test_plugin_model_with_expand_trains_as_plain_keras(name, passes):
    x, y = _data(24)
    weights = {}
    for how in ("plain", "plugin"):
        model = _built(name, seed=11)
        trained = model
        if how == "plugin":
            trained = kip.PluginModel(model, passes=TRAINED_PASSES[passes]())
            trained.convert(x[:8])
            assert _switches(trained.converted.kip_graph)
        trained.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
        keras.utils.set_random_seed(7)
        trained.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
        # By position: Keras's names of a second build are numbered.
        weights[how] = [(v.path, v.numpy()) for v in model.weights]
    assert len(weights["plain"]) == len(weights["plugin"])
    for (path, value), (_, actual) in zip(weights["plain"], weights["plugin"]):
        np.testing.assert_allclose(actual, value, rtol=0, atol=1e-5, err_msg=f"{name}: {path}")
    first = _built(name, seed=11)
    moved = any(not np.allclose(v.numpy(), value) for v, (_, value) in
                zip(first.weights, weights["plain"]) if v.trainable)
    assert moved, "training moved no weight: the comparison shows nothing"


@pytest.mark.parametrize("name", ["stochastic_depth", "two_ways", "none_default"])
def test_save_and_load_keep_every_mode(name, tmp_path):
    model = _built(name)
    x, _ = _data()
    expanded = kip.apply_passes(kip.convert_to_functional(model, x), [Expand("all")])
    path = str(tmp_path / "m.keras")
    expanded.save(path)
    loaded = keras.models.load_model(path)
    assert len(loaded.trainable_variables) == len(model.trainable_variables)
    # Keras makes a Dropout's unseeded generator anew at loading (plain
    # Keras models too): the seeds are set as the original's to compare.
    assert len(loaded.non_trainable_variables) == len(model.non_trainable_variables)
    for mine, theirs in zip(loaded.non_trainable_variables, model.non_trainable_variables):
        mine.assign(theirs)
    outputs_in_every_mode(model, loaded, x)
    # A loaded switch's modes are read back as graphs passes reach into.
    again = kip.apply_passes(loaded, [Expand("all")], verify=False)
    assert _switches(again.kip_graph)


def test_replace_reaches_inside_both_modes_with_one_new_layer():
    model = _built("nested")
    x, _ = _data()
    converted = kip.convert_to_functional(model, x)

    class MyNorm(layers.LayerNormalization):
        pass

    passed = kip.apply_passes(converted, [Replace(
        {layers.LayerNormalization: Replacement(MyNorm, copy_weights=True)})])
    switches = [s for s in _switches(passed.kip_graph) if s.name.endswith(".two")]
    assert len(switches) == 2
    for switch in switches:
        norms = {mode: [n.operation for n in graph.nodes if isinstance(n.operation, MyNorm)]
                 for mode, graph in switch.operation.branch_graphs.items()}
        assert norms["training"] and norms["inference"]
        assert norms["training"][0] is norms["inference"][0]
    outputs_in_every_mode(model, passed, x)


def test_recompute_inside_a_mode():
    model = _built("nested")
    x, _ = _data()
    passed = kip.apply_passes(kip.convert_to_functional(model, x),
                              [Recompute(["blocks.0.two.norm"])])
    marked = [n.name for n in all_nodes(passed.kip_graph) if n.annotations.get("recompute")]
    assert "blocks.0.two.norm" in marked
    (switch,) = [s for s in _switches(passed.kip_graph) if s.name == "blocks.0.two"]
    assert switch.operation.body.kip_annotations  # the mode's graph runs the checkpoint
    outputs_in_every_mode(model, passed, x)


def test_outline_reaches_inside_and_pipeline_stages_by_target_says_it_cannot():
    model = _built("two_ways")
    x, _ = _data()
    expanded = kip.apply_passes(kip.convert_to_functional(model, x), [Expand("all")])
    outlined = kip.apply_passes(expanded, [Outline(layers.Dense)])
    marked = [n.name for n in all_nodes(outlined.kip_graph) if "outline" in n.annotations]
    assert {"stem", "head", "two.train_path", "two.infer_path"} <= set(marked)
    outputs_in_every_mode(model, outlined, x)
    with pytest.raises(kip.PassError, match=r"inside `two`.*does not reach into the modes"):
        kip.apply_passes(expanded, [PipelineStages([["stem"], ["two.train_path"]])])


def test_a_loaded_switch_refuses_a_body_of_another_module(tmp_path):
    model = _built("two_ways")
    x, _ = _data()
    expanded = kip.apply_passes(kip.convert_to_functional(model, x), [Expand("all")])
    (node,) = _switches(expanded.kip_graph)
    # As a file holds it (JSON), a fresh copy each time (Keras's loading
    # consumes the nested configs it reads).
    text = json.dumps(node.operation.get_config())

    def saved(**changes):
        return dict(json.loads(text), **changes)

    ModeSwitch.from_config(saved())  # the untouched config loads
    with pytest.raises(kip.LoadError, match="ModeSwitch `two`: body"):
        ModeSwitch.from_config(saved(body=dict(saved()["body"], module="os")))
    with pytest.raises(kip.LoadError, match="outputs"):
        ModeSwitch.from_config(saved(outputs={"training": [0], "inference": [7]}))
    with pytest.raises(kip.LoadError, match="outputs"):
        ModeSwitch.from_config(saved(outputs={"training": ["0"], "inference": [0]}))
    with pytest.raises(kip.LoadError, match="none_means"):
        ModeSwitch.from_config(saved(none_means="sometimes"))


class SharedDropPath(keras.Model):
    """One stochastic depth layer at two call sites (one seed generator)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.stem = layers.Dense(WIDTH, name="stem")
        self.drop_path = StochasticDepth(0.3)
        self.head = layers.Dense(1, name="head")

    def call(self, x, training=None):
        x = self.stem(x)
        x = x + self.drop_path(x, training=training)
        x = x + self.drop_path(x, training=training)
        return self.head(x)


def test_saving_refuses_a_seed_generator_two_switches_share(tmp_path):
    keras.utils.set_random_seed(3)
    model = SharedDropPath()
    x, _ = _data()
    model(x[:2])
    expanded = kip.apply_passes(kip.convert_to_functional(model, x), [Expand("all")])
    assert len(_switches(expanded.kip_graph)) == 2
    outputs_in_every_mode(model, expanded, x)  # in memory: one generator, as in Keras
    with pytest.raises(ValueError, match="seed_generator.*used by the modes of `drop_path"):
        expanded.save(str(tmp_path / "m.keras"))


def _public_drop_path(which):
    """Stochastic depth as public libraries write it: keras_hub 0.32's
    `DropPath` (Swin, `if self.drop_prob == 0.0 or not training: return x`)
    and keras.applications' ConvNeXt `StochasticDepth` (unseeded: Keras's
    global generator)."""
    if which == "keras_hub":
        module = pytest.importorskip("keras_hub.src.models.swin_transformer.swin_transformer_layers")
        return module.DropPath(0.3, seed=5)
    module = pytest.importorskip("keras.src.applications.convnext")
    return module.StochasticDepth(0.3)


class PublicDropPathNet(keras.Model):
    def __init__(self, drop, **kwargs):
        super().__init__(**kwargs)
        self.stem = layers.Dense(WIDTH, name="stem")
        self.drop = drop
        self.head = layers.Dense(1, name="head")

    def call(self, x, training=None):
        x = self.stem(x)
        return self.head(x + self.drop(x, training=training))


@pytest.mark.parametrize("which", ["keras_hub", "convnext"])
def test_public_drop_path_layers_expand_and_train_as_plain_keras(which):
    x, y = _data(24)
    weights = {}
    for how in ("plain", "plugin"):
        keras.utils.set_random_seed(11)
        model = PublicDropPathNet(_public_drop_path(which))
        model(x[:2])
        trained = model
        if how == "plugin":
            trained = kip.PluginModel(model, passes=[Expand("all")])
            trained.convert(x[:8])
            assert [n.name for n in _switches(trained.converted.kip_graph)] == ["drop"]
            assert not trained.converted.kip_report.opaque
        trained.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
        keras.utils.set_random_seed(7)
        trained.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
        weights[how] = [v.numpy() for v in model.trainable_weights]
    for expected, actual in zip(weights["plain"], weights["plugin"]):
        np.testing.assert_allclose(actual, expected, rtol=0, atol=1e-5)


# -- a `call` returning another output structure in each mode ---------------------


@keras.saving.register_keras_serializable(package="kip_tests")
class TopKRetrieval(keras.Model):
    """A recommender in the way of keras-rs's sequential retrieval models:
    in training it returns the sequence embedding the loss reads; in
    inference it adds top-k `"predictions"` over the item embeddings."""

    ITEMS, K = 20, 3

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.item_embedding = layers.Embedding(self.ITEMS, WIDTH, name="item_embedding")
        self.encoder = keras.Sequential(
            [layers.Dense(WIDTH, activation="relu"), layers.Dense(WIDTH)], name="encoder")

    def call(self, inputs, training=False):
        embedding = self.encoder(ops.mean(self.item_embedding(inputs["item_ids"]), axis=1))
        outputs = {"item_sequence_embedding": embedding}
        if not training:
            scores = ops.matmul(embedding, ops.transpose(self.item_embedding.embeddings))
            outputs["predictions"] = ops.top_k(scores, self.K)[1]
        return outputs


class HoldsRetrieval(keras.Model):
    """The retrieval model as a sub-layer, its outputs passed on."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.retrieval = TopKRetrieval(name="retrieval")
        self.project = layers.Dense(WIDTH, name="project")

    def call(self, inputs, training=None):
        outputs = self.retrieval(inputs, training=training)
        return dict(outputs, item_sequence_embedding=self.project(
            outputs["item_sequence_embedding"]))


RETRIEVAL_MODELS = {"top_level": TopKRetrieval, "sub_layer": HoldsRetrieval}
TRAINING_KEYS = ["item_sequence_embedding"]
INFERENCE_KEYS = ["item_sequence_embedding", "predictions"]


def _retrieval_data(rows=24):
    rng = np.random.default_rng(4)
    x = {"item_ids": rng.integers(0, TopKRetrieval.ITEMS, size=(rows, 5)).astype("int32")}
    y = {"item_sequence_embedding": rng.normal(size=(rows, WIDTH)).astype("float32")}
    return x, y


def _retrieval(name, seed=5):
    keras.utils.set_random_seed(seed)
    model = RETRIEVAL_MODELS[name]()
    model(_retrieval_data()[0])
    return model


@pytest.mark.parametrize("name", sorted(RETRIEVAL_MODELS))
def test_a_model_returning_another_structure_in_training_returns_each_modes(name):
    """The converted model returns what the original returns in each mode
    (training: the embedding alone; inference and `training=None`: the
    top-k predictions too), and the report's reason says so."""
    model = _retrieval(name)
    x, _ = _retrieval_data()
    converted = kip.convert_to_functional(model, x)
    (node,) = converted.kip_graph.nodes
    assert node.opaque_reason and "returns another structure in training" in node.opaque_reason
    assert "each mode's structure" in node.opaque_reason
    for training, keys in ((True, TRAINING_KEYS), (False, INFERENCE_KEYS),
                           (None, INFERENCE_KEYS)):
        mine, theirs = converted(x, training=training), model(x, training=training)
        assert sorted(mine) == sorted(theirs) == keys, training
        for key in keys:
            np.testing.assert_allclose(mine[key], theirs[key], atol=1e-6)


def _trained_retrieval(name, how):
    """Weights after 3 steps of `fit` one way, and the predictions after."""
    x, y = _retrieval_data()
    model = _retrieval(name, seed=9)
    callbacks, trainee = [], model
    if how == "plugin_model":
        trainee = kip.PluginModel(model)
    elif how == "callback":
        callbacks = [kip.PluginCallback()]
    if how == "scope":
        with kip.scope():
            model.compile(optimizer=keras.optimizers.Adam(0.01),
                          loss={"item_sequence_embedding": "mse"})
    else:
        trainee.compile(optimizer=keras.optimizers.Adam(0.01),
                        loss={"item_sequence_embedding": "mse"})
    keras.utils.set_random_seed(2)
    history = trainee.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0,
                          callbacks=callbacks)
    predicted = trainee.predict(x, batch_size=8, verbose=0)
    return [v.numpy() for v in model.weights], history.history["loss"], predicted


@pytest.mark.parametrize("name", sorted(RETRIEVAL_MODELS))
@pytest.mark.parametrize("how", ["plugin_model", "callback", "scope"])
def test_a_model_returning_another_structure_in_training_trains_as_plain_keras(name, how):
    """Every entry point trains it (the loss on the training structure) to
    the weights plain Keras reaches, and predicts the inference structure."""
    expected, expected_loss, expected_predicted = _trained_retrieval(name, "plain")
    weights, loss, predicted = _trained_retrieval(name, how)
    first = [v.numpy() for v in _retrieval(name, seed=9).weights]
    assert any(not np.allclose(a, b) for a, b in zip(first, expected)), "nothing trained"
    for actual, value in zip(weights, expected):
        np.testing.assert_allclose(actual, value, atol=1e-5)
    np.testing.assert_allclose(loss, expected_loss, rtol=1e-5)
    assert sorted(predicted) == sorted(expected_predicted) == INFERENCE_KEYS
    np.testing.assert_array_equal(predicted["predictions"], expected_predicted["predictions"])


class BatchSizedTrainingOutputs(TopKRetrieval):
    """Returns another structure in training, computed there with NumPy
    from the batch size (`np.zeros((e.shape[0], d))`), which no function
    traced with the batch size unknown can run; `branches_on_values`: its
    `call` also branches on a tensor's value in Python (so tracing says
    only that, not how the modes' structures differ)."""

    def __init__(self, branches_on_values=False, unknown_mode=False, **kwargs):
        super().__init__(**kwargs)
        self.branches_on_values = branches_on_values
        self.unknown_mode = unknown_mode

    def call(self, inputs, training=None):
        embedding = self.encoder(ops.mean(self.item_embedding(inputs["item_ids"]), axis=1))
        if self.branches_on_values and ops.max(embedding) > 1e6:
            embedding = embedding * 0.5
        if (training is None) if self.unknown_mode else training:
            zeros = np.zeros((embedding.shape[0], WIDTH), "float32")
            embedding = embedding + zeros
        if training:
            return {"item_sequence_embedding": embedding}
        scores = ops.matmul(embedding, ops.transpose(self.item_embedding.embeddings))
        return {"item_sequence_embedding": embedding,
                "predictions": ops.top_k(scores, self.K)[1]}


def _batch_sized_training_outputs(seed=5, **kwargs):
    keras.utils.set_random_seed(seed)
    model = BatchSizedTrainingOutputs(**kwargs)
    model(_retrieval_data()[0], training=False)
    return model


#: {case: (the model's configuration, the `training` value whose `call` fails traced
#: with the batch size unknown)}
UNTRACEABLE_MODES = {
    "training": ({}, True),
    "training, and `call` branching on a tensor's value": ({"branches_on_values": True}, True),
    "no mode given": ({"unknown_mode": True}, None),
}


@pytest.mark.parametrize("case", sorted(UNTRACEABLE_MODES))
def test_a_model_whose_training_structure_cannot_be_held_is_refused_up_front(case):
    """A model returning another structure in training, whose training
    mode (or the mode `training=None` runs) cannot run with the batch size
    unknown, is refused by conversion and by `PluginModel` before any step,
    saying how the modes differ, what fails and what to do, and leaving
    the model's weights as they were; never converted with one structure
    for a training it cannot run."""
    config, failing = UNTRACEABLE_MODES[case]
    model = _batch_sized_training_outputs(**config)
    x, y = _retrieval_data()
    with pytest.raises(kip.ConversionError) as refused:
        kip.convert_to_functional(model, x)
    message = str(refused.value)
    assert "returns another structure in training" in message, message
    assert "'predictions'" in message, message
    assert "could not train" in message and "static_batch=True" in message, message
    assert "cannot be interpreted as an integer" in message, message
    assert "it trains" not in message and "still trains" not in message, message
    assert f"under training={failing} fails" in message, message
    if not config:
        assert "test_training_modes.py" in message, message  # where `call` branches
    before = [v.numpy() for v in model.weights]
    trainee = kip.PluginModel(model)
    trainee.compile(optimizer=keras.optimizers.Adam(0.01),
                    loss={"item_sequence_embedding": "mse"})
    with pytest.raises(kip.ConversionError, match="could not train"):
        trainee.fit(x, y, batch_size=8, epochs=1, verbose=0)
    for value, variable in zip(before, model.weights):
        np.testing.assert_array_equal(variable.numpy(), value)


def test_a_model_whose_training_needs_the_batch_size_trains_with_static_batch():
    """What the refusal says to do works: with `static_batch=True` the
    training mode is traced at the batch's size, and `PluginModel` trains
    the model to the weights plain Keras reaches on the same batches."""
    import tensorflow as tf

    x, y = _retrieval_data()
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(8, drop_remainder=True)
    weights = {}
    for how in ("plain", "plugin"):
        model = _batch_sized_training_outputs(seed=9)
        trainee = kip.PluginModel(model, static_batch=True) if how == "plugin" else model
        trainee.compile(optimizer=keras.optimizers.Adam(0.01),
                        loss={"item_sequence_embedding": "mse"})
        keras.utils.set_random_seed(2)
        trainee.fit(data, epochs=1, verbose=0)
        weights[how] = [v.numpy() for v in model.weights]
    first = [v.numpy() for v in _batch_sized_training_outputs(seed=9).weights]
    assert any(not np.allclose(a, b) for a, b in zip(first, weights["plain"])), "nothing trained"
    for actual, expected in zip(weights["plugin"], weights["plain"]):
        np.testing.assert_allclose(actual, expected, atol=1e-5)


def test_a_model_returning_another_structure_in_training_saves_and_loads(tmp_path):
    """The converted model's modes survive `save` / `load_model`."""
    model = _retrieval("top_level")
    x, _ = _retrieval_data()
    converted = kip.convert_to_functional(model, x)
    path = str(tmp_path / "retrieval.keras")
    converted.save(path)
    loaded = keras.models.load_model(path)
    assert sorted(loaded(x, training=True)) == TRAINING_KEYS
    assert sorted(loaded(x)) == INFERENCE_KEYS
    np.testing.assert_array_equal(loaded(x)["predictions"], model(x)["predictions"])
    # Passes on the loaded model keep each mode's structure.
    (node,) = converted.kip_graph.nodes
    passed = kip.apply_passes(loaded, [Recompute([node.name])])
    assert sorted(passed(x, training=True)) == TRAINING_KEYS
    assert sorted(passed(x)) == INFERENCE_KEYS
