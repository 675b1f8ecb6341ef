"""The executor is an interpreter over kip's graph: a pass
whose annotation does something when the model runs is one file, the pass
and its `RunEffect`; the effect reads the annotation from the nodes.

Each test defines its pass and effect here, as a user's own file would, and
restores both registries after it.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_ipu_plugin as kip
from keras_ipu_plugin.passes.infra import base
from keras_ipu_plugin.runtime import interpreter as interpreter_lib
from keras_ipu_plugin.runtime.backends import get_backend
from keras_ipu_plugin.runtime.interpreter import Interpreter
from keras_ipu_plugin.runtime.rebuild import rebuild
from keras_ipu_plugin.runtime.interpreter import graph_of


@pytest.fixture
def registries(monkeypatch):
    """The pass and run-effect registries, restored after the test."""
    monkeypatch.setattr(base, "_PASSES", dict(base._PASSES))
    monkeypatch.setattr(interpreter_lib, "_EFFECTS", dict(interpreter_lib._EFFECTS))


def _model():
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(8, activation="relu", name="hidden")(inputs)
    outputs = keras.layers.Dense(2, name="head")(hidden)
    return keras.Model(inputs, outputs)


def _x():
    return np.random.default_rng(0).normal(size=(6, 4)).astype("float32")


def define_scale_outputs():
    """A complete pass with a run-time effect, in one place: the pass marks
    the layers it is given; its effect multiplies their outputs when the
    model runs."""

    @kip.passes.register_pass("test_scale_outputs")
    class ScaleOutputs(kip.passes.Pass):
        step = "scale_outputs"
        claim = kip.passes.RUNS  # it changes what the model computes

        def __init__(self, layer, factor=2.0):
            self.layer = layer
            self.factor = factor

        def run(self, graph, report):
            graph = graph.copy()
            for node in graph.nodes:
                if node.name == self.layer:
                    node.annotations["scale_outputs"] = self.factor
                    report.add(self.step, node.name, "scaled", str(self.factor))
            return graph

        def get_config(self):
            return {"layer": self.layer, "factor": self.factor}

    @kip.passes.register_run_effect
    class ScaleOutputsEffect(kip.passes.RunEffect):
        name = "test_scale_outputs"
        keys = ("scale_outputs",)

        def call(self, node, run, args, kwargs, proceed):
            outputs = proceed(args, kwargs)
            return outputs * node.annotations["scale_outputs"]

    return ScaleOutputs


def test_a_new_run_time_pass_in_one_file_takes_effect_when_the_model_runs(registries, tmp_path):
    ScaleOutputs = define_scale_outputs()
    model, x = _model(), _x()
    converted = kip.convert_to_functional(model, x)
    assert "test_scale_outputs" not in converted.kip_interpreter().effects
    passed = kip.apply_passes(converted, [ScaleOutputs("head", 3.0)])
    assert "test_scale_outputs" in passed.kip_interpreter().effects
    np.testing.assert_allclose(passed(x), 3.0 * model(x), rtol=1e-5, atol=1e-6)
    # compiled too, and in training mode
    np.testing.assert_allclose(tf.function(lambda x: passed(x, training=True))(x),
                               3.0 * model(x), rtol=1e-5, atol=1e-6)
    # a layer before another: the scaled hidden layer is what the head reads
    hidden = kip.apply_passes(converted, [ScaleOutputs("hidden", 2.0)])
    inner = keras.Model(model.inputs, model.get_layer("hidden").output)
    expected = model.get_layer("head")(2.0 * inner(x))
    np.testing.assert_allclose(hidden(x), expected, rtol=1e-5, atol=1e-6)
    # the annotation is saved with the model, and the loaded model runs the effect
    path = tmp_path / "scaled.keras"
    passed.save(path)
    loaded = keras.models.load_model(path)
    np.testing.assert_allclose(loaded(x), 3.0 * model(x), rtol=1e-5, atol=1e-6)
    # and the pass is usable from configs with no other edit
    assert kip.passes_from_config([{"test_scale_outputs": {"layer": "head"}}]) == [
        ScaleOutputs("head")]


def test_without_its_effect_the_annotation_changes_nothing(registries):
    ScaleOutputs = define_scale_outputs()
    interpreter_lib.unregister_run_effect("test_scale_outputs")
    model, x = _model(), _x()
    passed = kip.apply_passes(kip.convert_to_functional(model, x), [ScaleOutputs("head")])
    assert not passed.kip_interpreter().effects
    np.testing.assert_allclose(passed(x), model(x), rtol=1e-5, atol=1e-6)


def test_run_node_sees_every_node_of_kips_graph_with_its_annotations(registries):
    seen = []

    @kip.passes.register_run_effect
    class Watch(kip.passes.RunEffect):
        name = "test_watch"
        keys = ("watch",)

        def run_node(self, node, run, proceed):
            seen.append((node.name, dict(node.annotations), run.training))
            return proceed(run)

    model, x = _model(), _x()
    converted = kip.convert_to_functional(model, x)
    graph = converted.kip_graph.copy()
    for node in graph.nodes:
        if node.is_layer:
            node.annotations["watch"] = node.name
    watched = rebuild(graph)
    watched(x, training=False)
    seen[:] = [entry for entry in seen if entry[1]]  # layers: a keras.ops node carries none
    assert seen == [("hidden", {"watch": "hidden"}, False), ("head", {"watch": "head"}, False)]
    # it runs with the built-in effects: Recompute's segments still hold the nodes
    recomputed = kip.apply_passes(watched, [kip.passes.Recompute(["hidden"])])
    seen.clear()  # (apply_passes ran it to verify it)
    np.testing.assert_allclose(recomputed(x, training=True), model(x), rtol=1e-5, atol=1e-6)
    assert [name for name, notes, _ in seen if notes] == ["hidden", "head"]
    segments = recomputed.kip_interpreter().steps
    assert [node.name for segment in segments for node in segment.nodes][-2:] == ["hidden", "head"]
    assert segments[0].nodes[-1].annotations.get("recompute")


def test_an_interpreter_subclass_overrides_one_step():
    """As torch.fx's `Interpreter.call_module`: one method runs each operation."""
    model, x = _model(), _x()
    converted = kip.convert_to_functional(model, x)

    class Doubling(Interpreter):
        def call_operation(self, node, args, kwargs):
            outputs = super().call_operation(node, args, kwargs)
            return 2.0 * outputs if node.is_layer else outputs

    interpreter = Doubling(graph_of(converted), get_backend(), owner=converted)
    inner = keras.Model(model.inputs, model.get_layer("hidden").output)
    expected = 2.0 * model.get_layer("head")(2.0 * inner(x))
    np.testing.assert_allclose(interpreter.run([x])[0], expected, rtol=1e-5, atol=1e-6)


def test_the_graph_to_run_holds_pinned_training_and_annotations_on_its_nodes(tmp_path):
    """The graph a model runs is the one the passes produced, and a loaded
    model's, read back from the file, holds the same `training` and
    annotations on the same node paths."""
    class Frozen(keras.Model):
        def __init__(self):
            super().__init__()
            self.norm = keras.layers.BatchNormalization(name="norm")
            self.head = keras.layers.Dense(2, name="head")
            self.drop = keras.layers.Dropout(0.5, name="drop")

        def call(self, x, training=None):
            return self.drop(self.head(self.norm(x, training=False)), training=training)

    x = _x()
    converted = kip.convert_to_functional(Frozen(), x)
    passed = kip.apply_passes(converted, [kip.passes.Recompute(["norm"])])
    assert graph_of(passed) is passed.kip_graph
    passed.save(tmp_path / "frozen.keras")
    loaded = keras.models.load_model(tmp_path / "frozen.keras")
    assert loaded.kip_graph is None
    for graph in (graph_of(passed), graph_of(loaded)):
        by_name = {node.name: node for node in graph.nodes}
        assert by_name["norm"].training is False
        assert by_name["norm"].annotations == {"recompute": True}
        assert by_name["head"].annotations == {}
        assert by_name["drop"].training == "follow"
        assert {name: node.training for name, node in by_name.items()
                if node.training in (True, False)} == passed.kip_pinned_training


def test_register_run_effect_refuses_what_it_cannot_run(registries):
    with pytest.raises(TypeError, match="RunEffect subclass"):
        kip.passes.register_run_effect(object)

    class Nameless(kip.passes.RunEffect):
        keys = ("x",)

    with pytest.raises(TypeError, match="name"):
        kip.passes.register_run_effect(Nameless)

    class Keyless(kip.passes.RunEffect):
        name = "test_keyless"

    with pytest.raises(TypeError, match="keys"):
        kip.passes.register_run_effect(Keyless)
    assert {"recompute", "outline", "stages"} <= set(interpreter_lib.registered_run_effects())


def test_stage_placement_puts_each_layer_on_its_stages_device():
    """The stage effect places a layer's ops on `kip_stage_devices[stage]`
    (read from the ops of a traced call; on CPU the result is the same
    wherever they run, so only the placement can show it)."""
    model, x = _model(), _x()
    converted = kip.convert_to_functional(model, x)
    staged = kip.apply_passes(converted, [kip.passes.PipelineStages([["hidden"], ["head"]])])
    assert staged.kip_stages["hidden"] == 0 and staged.kip_stages["head"] == 1
    staged.kip_stage_devices = ["/cpu:0", "/cpu:1"]

    @tf.function(autograph=False)
    def call(x):
        return staged(x)

    graph = call.get_concrete_function(tf.TensorSpec((None, 4), "float32")).graph
    devices = {}
    for op in graph.get_operations():
        for layer in ("hidden", "head"):
            if f"/{layer}" in op.name and op.type == "MatMul":
                devices[layer] = op.device
    assert devices["hidden"].endswith("CPU:0") and devices["head"].endswith("CPU:1"), devices


def test_a_layer_with_forward_state_never_sits_in_a_recomputed_segment():
    """A BatchNormalization's moving statistics would be updated by each
    recomputation: it runs in a segment of its own, between recomputed ones."""
    from keras_ipu_plugin.runtime.effects import make_plan

    inputs = keras.Input((4,))
    h = keras.layers.Dense(8, name="a")(inputs)
    h = keras.layers.BatchNormalization(name="norm")(h)
    h = keras.layers.Dense(8, name="b")(h)
    outputs = keras.layers.Dense(8, name="c")(h)
    model, x = keras.Model(inputs, outputs), _x()
    passed = kip.apply_passes(kip.convert_to_functional(model, x),
                              [kip.passes.Recompute(["b"])])
    segments = make_plan(passed, get_backend())
    recomputed = [[node.name for node in s.nodes] for s in segments if s.recompute]
    assert recomputed and all("norm" not in names for names in recomputed), recomputed
    assert ["norm"] in [[node.name for node in s.nodes] for s in segments]


# A Dropout called by a block but owned by nothing of the model (as a
# module-level augmentation is); remade for each twin from the same seed.
_NOT_OWNED = {}


class BlockCallingAnUnownedDropout(keras.layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(16, activation="tanh")

    def call(self, x, training=None):
        return _NOT_OWNED["dropout"](self.dense(x), training=training)


class NetWithUnownedDropout(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.block = BlockCallingAnUnownedDropout()
        self.middle = keras.layers.Dense(16, activation="relu")
        self.head = keras.layers.Dense(1)

    def call(self, x, training=None):
        return self.head(self.middle(self.block(x, training=training)))


def _train_with_unowned_dropout(passes):
    keras.utils.set_random_seed(5)
    _NOT_OWNED["dropout"] = keras.layers.Dropout(0.5)
    model = NetWithUnownedDropout()
    x = np.random.default_rng(1).normal(size=(16, 4)).astype("float32")
    y = np.random.default_rng(2).normal(size=(16, 1)).astype("float32")
    model(x[:2])
    fitter = model if passes is None else kip.PluginModel(model, passes=passes)
    fitter.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    keras.utils.set_random_seed(6)
    fitter.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    values = [np.asarray(v) for v in model.variables]
    return values, np.asarray(_NOT_OWNED["dropout"].seed_generator.state)


def test_a_recomputed_block_drawing_from_a_layer_it_does_not_own_trains_as_plain_keras():
    """A block whose `call` draws from a random layer the model calls but
    does not own (its seed generator is no variable of the block) in a
    Recompute segment: every draw advances that layer's seed as in plain
    Keras, once per step, and the weights are plain Keras's (the segment
    runs without recomputation: a recomputation could not be handed the
    seed it drew from)."""
    plain, plain_seed = _train_with_unowned_dropout(None)
    values, seed = _train_with_unowned_dropout([kip.passes.Recompute(["block"])])
    np.testing.assert_array_equal(seed, plain_seed)
    assert len(values) == len(plain)
    for expected, actual in zip(plain, values):
        np.testing.assert_allclose(actual, expected, rtol=1e-6, atol=1e-7)
