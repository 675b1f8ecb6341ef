"""The planning passes on real models: `Recompute(auto=True,
memory_budget=...)` and `PipelineStages(num_stages=N, balance=...)`.

They change where the executor recomputes and which stage a layer runs in,
never what the model computes: gradients equal the unplanned model's in
graph mode, under XLA and under MirroredStrategy. The plan is what runs (the
executor's segments are the planned ones), it lowers what a training step
keeps for the backward pass, its estimate tracks what TensorFlow keeps, and
it is shown as a table in the report, from Python, configs and the CLI.
"""

import sys
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_ipu_plugin as kip
from keras_ipu_plugin import _compat
from keras_ipu_plugin import cli
from keras_ipu_plugin.passes.infra.manager import graph_of
from keras_ipu_plugin.runtime.backends import get_backend
from keras_ipu_plugin.runtime.effects import make_plan
from keras_ipu_plugin.layers.layer_kinds import seed_states
from keras_ipu_plugin.passes import Expand
from keras_ipu_plugin.passes import PipelineStages
from keras_ipu_plugin.passes import Recompute
from keras_ipu_plugin.planning import node_costs
from keras_ipu_plugin.planning import stage_timing

layers = keras.layers
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
WIDTH, FEATURES, BATCH = 64, 16, 64
#: A budget the tower meets only with recomputed segments: its gelu Dense
#: layers, split (`activation_remat`), already bring it to 0.59x.
BUDGET = 0.45


class WideBlock(layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.up = layers.Dense(4 * WIDTH, activation="gelu", name="up")
        self.down = layers.Dense(WIDTH, name="down")

    def call(self, x):
        return x + self.down(self.up(x))


class WideTower(keras.Model):
    def __init__(self, depth=8, **kwargs):
        super().__init__(**kwargs)
        self.stem = layers.Dense(WIDTH, name="stem")
        self.blocks = [WideBlock(name=f"block_{i}") for i in range(depth)]
        self.head = layers.Dense(1, name="head")

    def call(self, x):
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _data(n=BATCH, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(n, FEATURES)).astype("float32"),
            rng.normal(size=(n, 1)).astype("float32"))


def _converted(model=None, n=BATCH):
    x, _ = _data(n)
    model = model or WideTower(name="tower")
    model(x[:2])
    return kip.convert_to_functional(model, x)


def _plan(passed, title):
    plans = [plan for plan in passed.kip_report.plans if plan.title.startswith(title)]
    assert len(plans) == 1, [plan.title for plan in passed.kip_report.plans]
    return plans[0]


def _executor_segments(model):
    """The recomputed segments the interpreter runs: (first, last) node paths."""
    return [(s.nodes[0].name, s.nodes[-1].name)
            for s in make_plan(model, get_backend()) if s.recompute]


def _gradients(model, x, y, jit_compile):
    @tf.function(jit_compile=jit_compile)
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(x, training=True) - y) ** 2)
        return tape.gradient(loss, model.trainable_variables)

    return [g.numpy() for g in step(x, y)]


def kept_for_backward(model, batch=BATCH, features=FEATURES):
    """Bytes of the float tensors a traced training step's forward pass
    keeps for its backward pass (see test_pass_guarded_behaviours.py)."""
    first_backward = []

    @tf.function(autograph=False)
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(x, training=True) - y) ** 2)
        first_backward.append(len(tf.compat.v1.get_default_graph().get_operations()))
        return tape.gradient(loss, model.trainable_variables)

    graph = step.get_concrete_function(
        tf.TensorSpec((batch, features)), tf.TensorSpec((batch, 1))).graph
    operations = graph.get_operations()
    forward = set(operations[:first_backward[0]])
    kept = {
        tensor.ref(): tensor
        for op in operations[first_backward[0]:] for tensor in op.inputs
        if tensor.op in forward and tensor.dtype.is_floating and tensor.op.type != "ReadVariableOp"
        and tensor.op.type != "Placeholder"
    }
    return sum(int(np.prod(t.shape.as_list())) * t.dtype.size for t in kept.values())


# -- Recompute(auto=True) -----------------------------------------------------------------
def test_auto_recompute_runs_the_segments_it_planned():
    converted = _converted()
    passed = kip.apply_passes(converted, [Expand(), Recompute(auto=True)])
    plan = _plan(passed, "Recompute plan")
    assert plan.figures["segments"], "the plan recomputes nothing: the test could not fail"
    assert _executor_segments(passed) == plan.figures["segments"]
    assert plan.figures["peak"] < 0.6 * plan.figures["baseline_peak"], plan.figures
    assert plan.figures["batch"] == BATCH
    assert 0 < plan.figures["extra_fraction"] <= 1.0
    text = str(passed.kip_report)
    assert "Recompute plan of 'tower'" in text and "estimated peak with the plan" in text
    assert passed.kip_report.touched("recompute") == (
        plan.figures["checkpoints"] + plan.figures["keeps"] + plan.figures["inside_notes"]
        + plan.figures["activation_remat"])


@pytest.mark.parametrize("jit_compile", [False, True], ids=["graph", "xla"])
@pytest.mark.parametrize("budget", [None, BUDGET], ids=["smallest_peak", "budget"])
def test_planned_recompute_gives_the_gradients_of_the_unplanned_model(jit_compile, budget):
    x, y = _data()
    converted = _converted()
    passed = kip.apply_passes(converted, [Expand(), Recompute(auto=True, memory_budget=budget)],
                              verify=False)
    assert _executor_segments(passed), "nothing recomputed: the test could not fail"
    expected = _gradients(converted, x, y, jit_compile)
    actual = _gradients(passed, x, y, jit_compile)
    for got, want in zip(actual, expected):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_planned_recompute_lowers_what_a_training_step_keeps_as_estimated():
    converted = _converted()
    smallest = kip.apply_passes(converted, [Expand(), Recompute(auto=True)])
    budget = kip.apply_passes(converted, [Expand(), Recompute(auto=True, memory_budget=0.7)])
    plain, at_budget, at_smallest = (kept_for_backward(m) for m in (converted, budget, smallest))
    assert at_smallest < at_budget < plain, (plain, at_budget, at_smallest)
    # What the plan estimates the forward pass keeps tracks what TensorFlow
    # keeps: the activations of the estimated peak without recomputation
    # (at the start of the backward pass, before any gradient) against the
    # measured bytes.
    estimate = _plan(smallest, "Recompute plan").figures["baseline_peak"]
    assert 0.75 * plain < estimate < 1.35 * plain, (estimate, plain)


def test_a_memory_budget_in_bytes_is_met_by_the_estimate():
    converted = _converted()
    baseline = _plan(kip.apply_passes(converted, [Expand(), Recompute(auto=True)]),
                     "Recompute plan").figures["baseline_peak"]
    budget = int(0.7 * baseline)
    passed = kip.apply_passes(converted, [Expand(), Recompute(auto=True, memory_budget=budget)])
    figures = _plan(passed, "Recompute plan").figures
    assert figures["budget"] == budget and figures["peak"] <= budget
    assert "of the estimated peak)" not in str(passed.kip_report)  # bytes, not a fraction


class WideKernel(keras.Model):
    """One large kernel on few rows: the optimizer's update of it holds
    more than the step's activations."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.wide = layers.Dense(1024, activation="gelu", name="wide")
        self.head = layers.Dense(1, name="head")

    def call(self, x):
        return self.head(self.wide(x))


def test_the_estimate_counts_the_optimizer_update_and_prefetched_batches():
    """The plan's estimated peak (and so what a byte budget buys) includes
    what every training step holds beside its activations: an optimizer
    update's temporaries of the largest variable and the prefetched input
    batches; a budget below them cannot be met."""
    from keras_ipu_plugin.planning import graph_planning

    rows, features = 4, 512
    x = np.random.default_rng(0).normal(size=(rows, features)).astype("float32")
    model = WideKernel(name="wide_kernel")
    model(x)
    converted = kip.convert_to_functional(model, x)
    passed = kip.apply_passes(converted, [Recompute(auto=True)])
    figures = _plan(passed, "Recompute plan").figures
    kernel = features * 1024 * 4
    overhead = (graph_planning.UPDATE_TEMPORARIES * kernel
                + graph_planning.PREFETCHED_BATCHES * rows * features * 4)
    assert figures["peak"] >= overhead and figures["baseline_peak"] >= overhead
    covers = dict(_plan(passed, "Recompute plan").rows)["the estimate covers"]
    assert "optimizer update's temporaries" in covers and "prefetched input batches" in covers
    with pytest.raises(kip.PassError, match="cannot be met"):
        kip.apply_passes(converted, [Recompute(auto=True, memory_budget=int(0.9 * overhead))])


def test_an_unmeetable_budget_is_a_pass_error_with_the_smallest_estimate():
    converted = _converted()
    before = [v.numpy() for v in converted.weights]
    with pytest.raises(kip.PassError, match=r"memory budget 0\.0 MiB.*cannot be met.*smallest "
                                            r"estimated peak any checkpoint plan reaches is "
                                            r"[0-9.]+ MiB \(without recomputation [0-9.]+ MiB\)"):
        kip.apply_passes(converted, [Expand(), Recompute(auto=True, memory_budget=1)])
    for value, variable in zip(before, converted.weights):
        np.testing.assert_array_equal(value, variable.numpy())


class StatefulBlock(layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.up = layers.Dense(4 * WIDTH, activation="gelu", name="up")
        self.bn = layers.BatchNormalization(name="bn")
        self.drop = layers.Dropout(0.2, name="drop")
        self.down = layers.Dense(WIDTH, name="down")

    def call(self, x, training=None):
        return x + self.down(self.drop(self.bn(self.up(x), training=training), training=training))


class StatefulTower(WideTower):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.blocks = [StatefulBlock(name=f"block_{i}") for i in range(6)]


def test_layers_with_forward_state_stay_outside_planned_segments():
    # BatchNormalization's statistics would be updated twice; a Dropout's
    # seed is replayed (the segment reads it once), so it may sit inside.
    passed = kip.apply_passes(_converted(StatefulTower(name="tower")),
                              [Expand(), Recompute(auto=True)])
    segments = [s for s in make_plan(passed, get_backend()) if s.recompute]
    assert segments, "nothing recomputed: the test could not fail"
    for segment in segments:
        for node in segment.nodes:
            seeds = {id(v) for v in seed_states(node.operation)} if isinstance(
                node.operation, keras.layers.Layer) else set()
            state = [v for v in getattr(node.operation, "non_trainable_variables", [])
                     if id(v) not in seeds]
            assert not state, node.operation.name
    never = dict(_plan(passed, "Recompute plan").rows)["never recomputed (forward state)"]
    assert "blocks.0.bn" in never and "blocks.0.drop" not in never


def test_planning_without_a_known_batch_is_a_clear_error():
    inputs = keras.Input((FEATURES,))
    model = keras.Model(inputs, layers.Dense(1)(layers.Dense(WIDTH)(inputs)))
    with pytest.raises(kip.PassError, match="first batch.*convert_to_functional"):
        kip.apply_passes(model, [Recompute(auto=True)])


@pytest.mark.parametrize("budget", [None, BUDGET], ids=["smallest_peak", "budget"])
def test_planning_under_mirrored_strategy_uses_the_per_replica_batch_and_trains_alike(
        mirrored, budget):
    x, y = _data(4 * BATCH)

    def train(passes):
        keras.utils.set_random_seed(3)
        with mirrored.scope():
            model = WideTower(name="tower")
            model(x[:2])
            trained = kip.PluginModel(model, passes=passes) if passes is not None else model
            trained.compile(optimizer="sgd", loss="mse")
        history = trained.fit(x, y, batch_size=2 * BATCH, epochs=2, shuffle=False, verbose=0)
        return history.history["loss"], trained

    expected, _ = train(None)
    actual, trained = train([Expand(), Recompute(auto=True, memory_budget=budget)])
    np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-6)
    figures = _plan(trained.converted, "Recompute plan").figures
    assert figures["batch"] == BATCH  # 2 * BATCH rows over 2 replicas
    assert _executor_segments(trained.converted) == figures["segments"] != []


# -- PipelineStages(num_stages=N) --------------------------------------------------------
class Uneven(keras.Model):
    """Dense layers of very different sizes: a parameter split is not a
    layer-count split."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.stack = [layers.Dense(units, activation="relu", name=f"d{i}")
                      for i, units in enumerate([256, 16, 16, 16, 256, 16])]
        self.head = layers.Dense(1, name="head")

    def call(self, x):
        for layer in self.stack:
            x = layer(x)
        return self.head(x)


def test_stages_balanced_by_params_minimise_the_largest_stage():
    passed = kip.apply_passes(_converted(Uneven(name="uneven")), [PipelineStages(num_stages=3)])
    figures = _plan(passed, "Pipeline stages").figures
    names = [f"stack.{i}" for i in range(6)] + ["head"]  # by attribute path
    params = [passed.kip_layer(name).count_params() for name in names]
    assert [name for stage in figures["stages"] for name in stage] == names
    assert figures["costs"] == [sum(params[names.index(n)] for n in stage)
                                for stage in figures["stages"]]
    smallest = min(
        max(sum(params[:a]), sum(params[a:b]), sum(params[b:]))
        for a in range(1, 6) for b in range(a + 1, 7))
    assert max(figures["costs"]) == smallest
    # not the layer-count split a user might write
    assert max(figures["costs"]) < max(sum(params[:2]), sum(params[2:4]), sum(params[4:]))
    # kip_stages is keyed by node path, kip_layer_stages by Keras layer name.
    assert passed.kip_stages == {name: index for index, names in enumerate(figures["stages"])
                                 for name in names}
    assert passed.kip_layer_stages == {passed.kip_layer_paths[name]: index
                                       for index, names in enumerate(figures["stages"])
                                       for name in names}
    assert "imbalance" in str(passed.kip_report)


def test_stages_balanced_by_time_follow_the_measured_times(monkeypatch):
    # Times are measured (noisy); here they are given, to check the plan
    # follows them rather than the parameters.
    names = [f"stack.{i}" for i in range(6)] + ["head"]  # by attribute path
    given = dict(zip(names, [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 6.0]))
    monkeypatch.setattr(node_costs, "time_nodes",
                        lambda graph, batch, profiles=None: [given[n.name] for n in graph.nodes])
    # Whole stages timed as the sums of their nodes: the plan stands.
    monkeypatch.setattr(stage_timing, "time_stages", lambda graph, batch, partitions: [
        [sum(given[n.name] for n in graph.nodes[first:last + 1]) for first, last in partition]
        for partition in partitions])
    passed = kip.apply_passes(_converted(Uneven(name="uneven")),
                              [PipelineStages(num_stages=2, balance="time")])
    figures = _plan(passed, "Pipeline stages").figures
    assert figures["stages"] == [names[:6], ["head"]]
    assert figures["imbalance"] == 1.0


def test_stages_balanced_by_time_are_replanned_on_whole_stage_times(monkeypatch):
    # Nodes timed alone do not add up to their stage (fused ops, per-call
    # costs): on the gallery ResNet a split balanced on node times measured
    # 1.25 largest / mean for 2 stages. Here the first four nodes run four
    # times faster together than alone; the plan moves the cut to balance
    # the stages as they run.
    names = [f"stack.{i}" for i in range(6)] + ["head"]  # by attribute path
    alone = dict(zip(names, [1.0] * 7))
    together = dict(zip(names, [0.25] * 4 + [1.0] * 3))
    monkeypatch.setattr(node_costs, "time_nodes",
                        lambda graph, batch, profiles=None: [alone[n.name] for n in graph.nodes])
    timed = []

    def stage_times(graph, batch, partitions):
        timed.append(partitions)
        return [[sum(together[n.name] for n in graph.nodes[first:last + 1])
                 for first, last in partition] for partition in partitions]

    monkeypatch.setattr(stage_timing, "time_stages", stage_times)
    passed = kip.apply_passes(_converted(Uneven(name="uneven")),
                              [PipelineStages(num_stages=2, balance="time")])
    figures = _plan(passed, "Pipeline stages").figures
    # On node times alone: stack.0..3 | stack.4..head (4 against 3); as they
    # run: 1.0 against 3.0. Re-planned: stack.0..4 | stack.5, head (2.0 against 2.0).
    assert figures["stages"] == [names[:5], names[5:]], figures
    assert figures["costs"] == [2.0, 2.0] and figures["imbalance"] == 1.0
    assert timed, "whole stages were never timed"
    assert "whole stages timed" in str(passed.kip_report)


def test_whole_stage_times_are_measured_for_each_stage():
    passed = kip.apply_passes(_converted(Uneven(name="uneven")), [Expand()], verify=False)
    graph = graph_of(passed)
    last = len(graph.nodes) - 1
    before = [v.numpy().copy() for v in passed.weights]
    halves, whole = stage_timing.time_stages(graph, BATCH, [[(0, 2), (3, last)], [(0, last)]])
    assert len(halves) == 2 and len(whole) == 1
    assert all(seconds > 0 for seconds in halves + whole), (halves, whole)
    # random weights come in as arguments: the model's are neither read nor written
    for variable, value in zip(passed.weights, before):
        np.testing.assert_array_equal(variable.numpy(), value)


def test_node_times_are_measured_and_a_heavier_node_takes_longer():
    x = np.random.default_rng(0).normal(size=(256, 512)).astype("float32")
    inputs = keras.Input((512,))
    light = layers.Dense(4, name="light")(inputs)
    heavy = layers.Dense(2048, name="heavy")(layers.Dense(2048, name="wide")(inputs))
    model = keras.Model(inputs, [light, heavy])
    converted = kip.convert_to_functional(model, x)
    graph = graph_of(converted)
    times = dict(zip([n.name for n in graph.nodes], node_costs.time_nodes(graph, 256)))
    assert all(t is not None and t >= 0 for t in times.values()), times
    # 2048x2048 against 512x4 multiply-adds per row: a thousand times more work
    assert times["heavy"] > 10 * times["light"], times


def test_node_times_are_taken_in_interleaved_rounds(monkeypatch):
    # Timed one node after the other, a node that ran while the machine was
    # busy came out slower than its neighbours; in rounds, every node runs
    # once between two runs of any node, so a busy spell hits them alike.
    x = np.random.default_rng(0).normal(size=(8, 16)).astype("float32")
    inputs = keras.Input((16,))
    hidden = layers.Dense(8, name="a")(inputs)
    model = keras.Model(inputs, layers.Dense(4, name="c")(layers.Dense(6, name="b")(hidden)))
    graph = graph_of(kip.convert_to_functional(model, x))
    calls, trace = [], node_costs._trace

    def logged_trace(node, batch):
        traced = trace(node, batch)
        function = traced.function

        def logged(*arguments):
            calls.append(node.name)
            return function(*arguments)

        traced.function = logged
        return traced

    monkeypatch.setattr(node_costs, "_trace", logged_trace)
    times = node_costs.time_nodes(graph, 8, repeats=3)
    assert all(t is not None for t in times)
    names = [node.name for node in graph.nodes]
    assert len(names) >= 3 and set(calls) == set(names)
    # after each node's first run, the runs go round the nodes in turn
    rounds = calls[len(names):]
    assert len(rounds) >= 3 * len(names)
    assert rounds == names * (len(rounds) // len(names)), calls


def test_stages_balanced_by_activations_use_the_bytes_kept_for_backward():
    passed = kip.apply_passes(_converted(Uneven(name="uneven")),
                              [PipelineStages(num_stages=2, balance="activations")])
    figures = _plan(passed, "Pipeline stages").figures
    assert len(figures["stages"]) == 2 and all(figures["costs"])
    assert "MiB" in str(passed.kip_report)


@pytest.mark.parametrize("jit_compile", [False, True], ids=["graph", "xla"])
def test_planned_stages_on_devices_give_the_gradients_of_the_unplanned_model(jit_compile):
    x, y = _data()
    converted = _converted()
    passed = kip.apply_passes(converted, [Expand(), PipelineStages(num_stages=2, balance="time")],
                              verify=False)
    passed.kip_stage_devices = ["/cpu:0", "/cpu:1"]
    assert set(passed.kip_stages.values()) == {0, 1}
    expected = _gradients(converted, x, y, jit_compile)
    actual = _gradients(passed, x, y, jit_compile)
    for got, want in zip(actual, expected):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("balance", ["activations", "time"])
def test_planned_stages_under_mirrored_strategy_train_alike(mirrored, balance):
    x, y = _data(BATCH)

    def train(passes):
        keras.utils.set_random_seed(4)
        with mirrored.scope():
            model = WideTower(name="tower")
            model(x[:2])
            trained = kip.PluginModel(model, passes=passes) if passes is not None else model
            trained.compile(optimizer="sgd", loss="mse")
        history = trained.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
        return history.history["loss"], trained

    expected, _ = train(None)
    actual, trained = train([Expand(), PipelineStages(num_stages=3, balance=balance)])
    np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-6)
    assert set(trained.converted.kip_stages.values()) == {0, 1, 2}


def test_too_many_stages_is_a_clear_error():
    with pytest.raises(kip.PassError, match="cannot cut .* into 40 stages"):
        kip.apply_passes(_converted(Uneven(name="uneven")), [PipelineStages(num_stages=40)])


# -- configs, the CLI, the order the executor runs -----------------------------------------
def test_planning_passes_from_a_yaml_config(tmp_path):
    config = tmp_path / "passes.yaml"
    config.write_text("expand: all\n"
                      "recompute: {auto: true, memory_budget: 0.45}\n"
                      "pipeline_stages: {num_stages: 2, balance: time}\n")
    passes = kip.passes_from_config(config)
    assert passes[1] == Recompute(auto=True, memory_budget=0.45)
    assert passes[2] == PipelineStages(num_stages=2, balance="time")
    passed = kip.apply_passes(_converted(), passes)
    text = str(passed.kip_report)
    assert "Recompute plan of 'tower'" in text and "(0.45 of the estimated peak)" in text
    assert "Pipeline stages of 'tower' (balance='time')" in text
    assert set(passed.kip_stages.values()) == {0, 1} and _executor_segments(passed)


@pytest.mark.parametrize("value, message, path", [
    ({"auto": True, "budget": 0.5}, "unknown key", "recompute.budget"),
    ({"auto": True, "memory_budget": 1.5}, "fraction.*in \\(0, 1\\]", "recompute.memory_budget"),
    ({"memory_budget": 0.5}, "needs auto=True", "recompute.memory_budget"),
    ({"auto": True, "memory_budget": 0}, "positive number", "recompute.memory_budget"),
    ({"auto": True, "memory_budget": "half"}, "bytes", "recompute.memory_budget"),
    ({"auto": True, "memory_budget": float("nan")}, "nan is not a number", "recompute.memory_budget"),
    ({"auto": True, "memory_budget": float("inf")}, "inf is not a number", "recompute.memory_budget"),
    ({"auto": "yes"}, "True or False", "recompute.auto"),
    ({"auto": True, "targets": ["a"]}, "not both", "recompute.auto"),
])
def test_a_wrong_recompute_config_names_the_value_at_fault(value, message, path):
    # The README promises the path of the value at fault, not the pass's.
    with pytest.raises(kip.ConfigError, match=message) as raised:
        kip.passes_from_config({"recompute": value})
    assert raised.value.path == path
    with pytest.raises(kip.ConfigError, match=message) as raised:
        kip.passes_from_config([{"expand": "all"}, {"recompute": value}])
    assert raised.value.path == "1." + path


@pytest.mark.parametrize("value, message, path", [
    ({"num_stages": 0}, "positive int", "pipeline_stages.num_stages"),
    ({"num_stages": 2.0}, "positive int", "pipeline_stages.num_stages"),
    ({"num_stages": 2, "balance": "flops"}, "balance is one of", "pipeline_stages.balance"),
    ({"stages": [["a"]], "balance": "time"}, "balances num_stages", "pipeline_stages.balance"),
    ({"num_stages": 2, "stages": [["a"]]}, "not both", "pipeline_stages.num_stages"),
])
def test_a_wrong_pipeline_stages_config_names_the_value_at_fault(value, message, path):
    with pytest.raises(kip.ConfigError, match=message) as raised:
        kip.passes_from_config({"pipeline_stages": value})
    assert raised.value.path == path


@pytest.mark.parametrize("text", [".nan", ".inf", "-.inf", ".NaN", ".Inf"])
def test_a_non_finite_yaml_memory_budget_is_a_config_error(tmp_path, text):
    # Before: ValueError (int(nan)) or OverflowError (int(inf)) from the message itself.
    config = tmp_path / "passes.yaml"
    config.write_text(f"recompute: {{auto: true, memory_budget: {text}}}\n")
    with pytest.raises(kip.ConfigError, match="is not a number of bytes") as raised:
        kip.passes_from_config(config)
    assert raised.value.path == "recompute.memory_budget"


@pytest.mark.parametrize("budget", [float("nan"), float("inf"), -float("inf"), np.float64("nan")])
def test_a_non_finite_memory_budget_is_a_pass_error_naming_it(budget):
    with pytest.raises(kip.PassError, match="memory_budget=.*is not a number of bytes") as raised:
        Recompute(auto=True, memory_budget=budget)
    assert raised.value.field == "memory_budget"


def test_inspect_prints_the_plans(tmp_path, capsys):
    config = tmp_path / "passes.yaml"
    config.write_text("expand: all\nrecompute: {auto: true}\n"
                      "pipeline_stages: {num_stages: 2, balance: params}\n")
    target = f"{EXAMPLES / 'resnet_blocks.py'}:SmallResNet"
    argv = ["inspect", target, "--data-shape", "16,16,3", "--batch-size", "8",
            "--passes", str(config)]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "Recompute plan of" in out and "estimated peak without recompute" in out
    assert "Pipeline stages of" in out and "largest / mean" in out


@pytest.mark.parametrize("example, shape", [("text_transformer", (8, 12)),
                                            ("resnet_blocks", (8, 16, 16, 3))])
def test_the_planned_order_is_the_order_the_rebuilt_model_runs(example, shape):
    sys.path.insert(0, str(EXAMPLES))
    try:
        module = __import__(example)
    finally:
        sys.path.remove(str(EXAMPLES))
    rng = np.random.default_rng(0)
    if example == "text_transformer":
        x = rng.integers(1, 50, size=shape).astype("int32")
    else:
        x = rng.normal(size=shape).astype("float32")
    passed = kip.apply_passes(kip.convert_to_functional(module.build_model(), x),
                              [Expand(), Recompute(auto=True)])
    # The planner plans the graph's nodes in their order, which is the order
    # the interpreter runs them in, segments and all.
    ran = [node for step in passed.kip_interpreter().steps
           for node in getattr(step, "nodes", [step])]
    assert ran == list(passed.kip_graph.nodes)
    ends = [step.nodes[-1].name for step in passed.kip_interpreter().steps
            if getattr(step, "recompute", False)]
    assert set(ends) <= set(_plan(passed, "Recompute plan").figures["checkpoints"])


def test_the_backward_working_memory_of_attention_is_counted():
    # An attention layer's backward holds gradients of its (batch, heads,
    # query, key) scores; left out of the estimate, the planned segments on
    # the gallery transformer measured 1.5x their estimate and the plan
    # held more than the hand plan.
    batch, length, dim, heads = 8, 32, 16, 4
    inputs = keras.Input((length, dim))
    outputs = layers.MultiHeadAttention(heads, dim // heads, name="attention")(inputs, inputs)
    x = np.random.default_rng(0).normal(size=(batch, length, dim)).astype("float32")
    graph = graph_of(kip.convert_to_functional(keras.Model(inputs, outputs), x))
    (profile,) = [p for p in node_costs.profile_nodes(graph, batch)
                  if p.node.name == "attention"]
    scores = batch * heads * length * length * 4
    assert profile.backward_bytes >= scores, (profile.backward_bytes, scores)
