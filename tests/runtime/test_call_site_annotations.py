"""A layer called at two places is two nodes of the graph that runs, and a
checkpoint or a pipeline stage is put on one call site, not on the layer:
the interpreter runs the graph the passes produced (`model.kip_graph`), a
saved model keeps each site's annotations by node path, and training is
what plain Keras trains."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_ipu_plugin as kip
from keras_ipu_plugin.runtime import interpreter as interpreter_lib
from keras_ipu_plugin.runtime.backends import get_backend
from keras_ipu_plugin.runtime.interpreter import graph_of
from keras_ipu_plugin.runtime.pipeline import StagedModel
from keras_ipu_plugin.runtime.rebuild import rebuild

WIDTH = 16


class TwoSites(keras.Model):
    """`shared` is called twice, with layers of its own between its calls."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.stem = keras.layers.Dense(WIDTH, name="stem")
        self.shared = keras.layers.Dense(WIDTH, activation="tanh", name="shared")
        self.own = [keras.layers.Dense(WIDTH, activation="tanh", name=f"own_{i}")
                    for i in range(4)]
        self.head = keras.layers.Dense(1, name="head")

    def call(self, x):
        x = self.shared(self.stem(x))
        x = self.own[1](self.own[0](x))
        x = self.shared(x)
        return self.head(self.own[3](self.own[2](x)))


def _data():
    rng = np.random.default_rng(3)
    return (rng.normal(size=(32, 4)).astype("float32"),
            rng.normal(size=(32, 1)).astype("float32"))


def _twins():
    """Two equal models: one trained by plain Keras, one through kip."""
    x, _ = _data()
    keras.utils.set_random_seed(7)
    plain = TwoSites(name="plain")
    plain(x[:2])
    mine = TwoSites(name="mine")
    mine(x[:2])
    mine.set_weights(plain.get_weights())
    return plain, mine


def _fit(model):
    x, y = _data()
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    return [w.numpy() for w in model.weights]


def _assert_trains_as_keras(plain, trained):
    for ours, theirs in zip(trained, _fit(plain)):
        np.testing.assert_allclose(ours, theirs, rtol=2e-5, atol=2e-6)


@pytest.fixture
def runs(monkeypatch):
    """`{node path: times run}` of every node the interpreter runs, the
    recomputations of the backward pass included."""
    monkeypatch.setattr(interpreter_lib, "_EFFECTS", dict(interpreter_lib._EFFECTS))
    counts = {}

    @interpreter_lib.register_run_effect
    class CountRuns(interpreter_lib.RunEffect):
        name = "test_count_runs"
        keys = ("test_count_runs",)
        order = 1000

        def active(self):
            return True

        def applies(self, node):
            return True

        def run_node(self, node, run, proceed):
            counts[node.name] = counts.get(node.name, 0) + 1
            return proceed(run)

    return counts


def test_a_checkpoint_on_one_call_site_of_a_shared_layer_recomputes_that_site_only(
        runs, tmp_path):
    plain, mine = _twins()
    x, y = _data()
    converted = kip.convert_to_functional(mine, x)
    graph = converted.kip_graph.copy()
    assert [node.name for node in graph.nodes if node.operation is mine.shared] == [
        "shared", "shared_1"]
    graph.node("shared").annotations["recompute"] = True
    model = rebuild(graph, name="checkpointed")
    assert graph_of(model) is graph  # the graph that runs is the one annotated

    # the plan: one recomputed segment, ending at the first call site
    steps = model.kip_interpreter().steps
    recomputed = [[node.name for node in step.nodes] for step in steps if step.recompute]
    assert recomputed == [["stem", "shared"]]

    # the run: the first site runs again in the backward pass, the second does not
    runs.clear()
    with tf.GradientTape() as tape:  # eager, as fit's first step
        loss = keras.ops.mean(model(x[:8], training=True))
    tape.gradient(loss, model.trainable_variables)
    assert runs["shared"] == 2 and runs["stem"] == 2
    assert runs["shared_1"] == 1 and runs["own.0"] == 1

    # saved and loaded, the checkpoint is still on that site only
    model.save(tmp_path / "checkpointed.keras")
    loaded = keras.models.load_model(tmp_path / "checkpointed.keras")
    notes = {node.name: node.annotations for node in graph_of(loaded).nodes
             if node.name.startswith("shared")}
    assert notes == {"shared": {"recompute": True}, "shared_1": {}}
    np.testing.assert_allclose(loaded(x), model(x), rtol=1e-6, atol=1e-6)

    _assert_trains_as_keras(plain, _fit(model))


def test_pipeline_stages_put_the_two_call_sites_of_one_layer_in_different_stages(tmp_path):
    plain, mine = _twins()
    x, _ = _data()
    converted = kip.convert_to_functional(mine, x)
    # by parameters (the shared layer's counted once) the balanced cut falls
    # between the two calls of `shared`
    staged = kip.apply_passes(converted, [kip.passes.PipelineStages(num_stages=2)])
    assert staged.kip_stages["shared"] == 0 and staged.kip_stages["shared_1"] == 1
    parts = StagedModel(staged, get_backend()).stages
    names = [[node.name for segment in stage.segments for node in segment.nodes]
             for stage in parts]
    assert "shared" in names[0] and "shared_1" in names[1]

    staged.save(tmp_path / "staged.keras")
    loaded = keras.models.load_model(tmp_path / "staged.keras")
    assert loaded.kip_stages == staged.kip_stages

    # every node runs in its stage's scope (the devices make the effect run)
    staged.kip_stage_devices = ["/cpu:0", "/cpu:0"]
    assert "stages" in staged.kip_interpreter().effects
    _assert_trains_as_keras(plain, _fit(staged))
