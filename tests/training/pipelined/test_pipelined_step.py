"""Pipelined training: `PipelineStages(microbatches=M, devices,
schedule)` on the portable backend.

Two stages on the two logical CPU devices of `conftest.py`, M = 4: three
Adam steps end with the weights of unpipelined training (1e-5 relative),
in graph mode and under XLA, through PluginModel, PluginCallback and
kip.scope, with Recompute; each stage's forward and backward ops sit on its
device; what is not supported is refused with errors naming it.
"""

import importlib.util
import re
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_ipu_plugin as kip
from keras_ipu_plugin.passes import PipelineStages
from keras_ipu_plugin.passes import Recompute
from keras_ipu_plugin.training.pipelined.step import pipelined_train_step
from keras_ipu_plugin.training.pipelined.step import schedule_order
from tests.models import RegularizedTower

DEVICES = ["/CPU:0", "/CPU:1"]
STAGES = [["blocks.0", "blocks.1"], ["blocks.2", "head"]]
RTOL = 1e-5
EXAMPLES = Path(__file__).resolve().parents[3] / "examples"


class Tower(keras.Model):
    """Four tanh Dense blocks and a head, with weight and activity
    regularizers (Keras's own, whose losses are means over the batch)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.blocks = [
            keras.layers.Dense(16, activation="tanh", name=f"block_{i}",
                               kernel_regularizer=keras.regularizers.L2(1e-3),
                               activity_regularizer=(keras.regularizers.L1(1e-3)
                                                     if i == 1 else None))
            for i in range(3)]
        self.head = keras.layers.Dense(3, name="head")

    def call(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class OwnStep(Tower):
    def train_step(self, data):
        return super().train_step(data)


class BNTower(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(8, name="dense")
        self.norm = keras.layers.BatchNormalization(name="norm")
        self.head = keras.layers.Dense(3, name="head")

    def call(self, x, training=None):
        return self.head(self.norm(self.dense(x), training=training))


def _data(samples=48, features=8, classes=3):
    rng = np.random.default_rng(3)
    x = rng.normal(size=(samples, features)).astype("float32")
    y = rng.integers(0, classes, samples).astype("int32")
    return x, y


def _compile(model, jit=False, loss=None):
    model.compile(optimizer=keras.optimizers.Adam(1e-2),
                  loss=loss or keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"], jit_compile=jit)


def _train(entry, passes, jit=False, build=Tower, data=None, batch_size=16, **fit):
    """`(weights of the user's model after 3 steps, fit's history)`."""
    keras.utils.set_random_seed(11)
    x, y = data if data is not None else _data()
    fit = dict(dict(batch_size=batch_size, epochs=1, verbose=0, shuffle=False), **fit)
    if entry == "model":
        user = build()
        model = kip.PluginModel(user, passes=passes)
        _compile(model, jit)
        history = model.fit(x, y, **fit)
    elif entry == "callback":
        user = build()
        _compile(user, jit)
        history = user.fit(x, y, callbacks=[kip.PluginCallback(passes=passes)], **fit)
    else:
        with kip.scope(passes=passes):
            user = build()
            _compile(user, jit)
        history = user.fit(x, y, **fit)
    return [v.numpy() for v in user.weights], history.history


#: A weight that both runs leave within this of zero was never moved by a
#: real gradient (Adam moves a weight by ~lr = 1e-2 a step): the attention
#: key bias, which softmax ignores, takes Adam steps of rounding noise
#: (gradients of 1e-12), which any change in the order of the sums changes.
NOISE = 1e-4


def _assert_same_weights(expected, got):
    """Equal within 1e-5 relative (of each value, or of the model's largest
    weight near zero), but weights that are rounding noise in both runs."""
    assert len(expected) == len(got)
    scale = max(float(np.max(np.abs(a))) for a in expected if a.size)
    for a, b in zip(expected, got):
        if a.size and max(np.max(np.abs(a)), np.max(np.abs(b))) < NOISE:
            continue
        np.testing.assert_allclose(b, a, rtol=RTOL, atol=RTOL * scale)


def _pipelined(schedule="gpipe", microbatches=4, **kwargs):
    return PipelineStages(STAGES, microbatches=microbatches, devices=DEVICES,
                          schedule=schedule, **kwargs)


# -- equal to unpipelined training -----------------------------------------------------

@pytest.mark.parametrize("entry,jit,schedule", [
    ("model", False, "gpipe"),
    ("model", False, "1f1b"), ("model", True, "1f1b"),
    ("callback", False, "gpipe"), ("callback", True, "1f1b"),
    ("scope", False, "1f1b"), ("scope", True, "gpipe"),
])
def test_three_adam_steps_equal_unpipelined(entry, jit, schedule):
    expected, plain = _train(entry, [PipelineStages(STAGES)], jit)
    got, pipelined = _train(entry, [_pipelined(schedule)], jit)
    _assert_same_weights(expected, got)
    # The metrics are the whole batch's: the loss (weighted by microbatch
    # shares) and the accuracy over every row.
    np.testing.assert_allclose(pipelined["loss"], plain["loss"], rtol=1e-5)
    assert pipelined["accuracy"] == plain["accuracy"]


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pipelined_with_recompute_equals_unpipelined(jit, schedule):
    # The checkpoint after blocks.0 splits stage 0; the one after blocks.2
    # closes a segment of stage 1: recomputation per stage and microbatch.
    recompute = Recompute(["blocks.0", "blocks.2"])
    expected, _ = _train("model", [recompute, PipelineStages(STAGES)], jit)
    got, _ = _train("model", [recompute, _pipelined(schedule)], jit)
    _assert_same_weights(expected, got)


def test_sample_and_class_weights_are_those_of_the_whole_batch():
    x, y = _data()
    weights = np.random.default_rng(5).uniform(0.1, 2.0, size=len(x)).astype("float32")
    for fit in (dict(sample_weight=weights), dict(class_weight={0: 0.3, 1: 1.0, 2: 2.5})):
        expected, _ = _train("model", [PipelineStages(STAGES)], **fit)
        got, _ = _train("model", [_pipelined()], **fit)
        _assert_same_weights(expected, got)


def test_planned_stages_and_microbatches_of_two():
    passes = [PipelineStages(num_stages=2)]
    expected, _ = _train("model", passes)
    got, _ = _train("model", [PipelineStages(num_stages=2, microbatches=2, devices=DEVICES)])
    _assert_same_weights(expected, got)


def test_stages_on_the_current_device_are_gradient_accumulation():
    expected, _ = _train("model", [PipelineStages(STAGES)])
    got, _ = _train("model", [PipelineStages(STAGES, microbatches=4)])
    _assert_same_weights(expected, got)


def _example(name):
    spec = importlib.util.spec_from_file_location(f"kip_pipe_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _text_classifier_without_dropout(module):
    """The gallery transformer with dropout rates 0 (each microbatch would
    draw its own mask: equal in distribution, not in value)."""
    def build():
        model = module.TextClassifier()
        model.blocks = [module.TransformerBlock(module.DIM, module.HEADS, module.DIM * 2,
                                                rate=0.0, name=f"block_{i}")
                        for i in range(module.BLOCKS)]
        model.dropout = keras.layers.Dropout(0.0)
        return model
    return build


@pytest.mark.parametrize("name,jit", [("text_transformer", False), ("seq2seq", True)])
def test_gallery_models_train_pipelined_as_unpipelined(name, jit):
    module = _example(name)
    build = (_text_classifier_without_dropout(module) if name == "text_transformer"
             else module.build_model)
    x, y = module.make_data(samples=64)
    if name == "text_transformer":
        passes = module.passes() + [PipelineStages(num_stages=2)]
        pipelined = module.passes() + [PipelineStages(num_stages=2, microbatches=4,
                                                       devices=DEVICES)]
    else:
        stages = module.passes()[-1].stages
        passes = module.passes()
        pipelined = module.passes()[:-1] + [PipelineStages(stages, microbatches=4,
                                                            devices=DEVICES, schedule="1f1b")]
    expected, _ = _train("model", passes, jit, build=build, data=(x, y), batch_size=16,
                         steps_per_epoch=3)
    got, _ = _train("model", pipelined, jit, build=build, data=(x, y), batch_size=16,
                    steps_per_epoch=3)
    _assert_same_weights(expected, got)


# -- placement -------------------------------------------------------------------------

def _traced_step(passes, build=Tower):
    """The FuncGraph of the pipelined train step of a fitted PluginModel."""
    x, y = _data(16)
    model = kip.PluginModel(build(), passes=passes)
    _compile(model)
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    session = model._kip_session
    step = pipelined_train_step(session, keras.Model.train_step)
    proxy = session.step_self()
    function = tf.function(lambda x, y: step(proxy, (x, y)), autograph=False)  # as Keras
    return function.get_concrete_function(
        tf.TensorSpec([None, 8]), tf.TensorSpec([None], tf.int32)).graph


LAYER_DEVICES = {"block_0": "CPU:0", "block_1": "CPU:0", "block_2": "CPU:1", "head": "CPU:1"}
COMPUTE = ("MatMul", "BiasAdd", "Tanh", "TanhGrad", "BiasAddGrad")


def _compute_ops(graph):
    """`(layer, backward?, op)` for the compute ops of each layer: forward
    ops in the pass's and the layer's name scopes (`F0_1/block_0/MatMul`:
    stage 0's forward of microbatch 1), backward ops in the tape's
    (`gradient_tape/F0_1/block_0/...`)."""
    found = []
    for op in graph.get_operations():
        match = re.match(r"(gradient_tape/)?(?:[FB]\d+_\d+/)?(block_\d|head)(_\d+)?/", op.name)
        if match and op.type in COMPUTE:
            found.append((match.group(2), bool(match.group(1)), op))
    return found


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_each_stage_runs_its_forward_and_backward_on_its_device(schedule):
    graph = _traced_step([_pipelined(schedule)])
    seen = {(layer, backward): 0 for layer in LAYER_DEVICES for backward in (False, True)}
    for layer, backward, op in _compute_ops(graph):
        assert op.device.endswith(LAYER_DEVICES[layer]), (op.name, op.device)
        seen[(layer, backward)] += 1
    # Every layer has forward and backward ops for each of the 4 microbatches.
    assert all(count >= 4 for count in seen.values()), seen


def test_recomputed_segments_run_on_their_stage_device():
    graph = _traced_step([Recompute(["blocks.0"]), _pipelined()])
    ops = _compute_ops(graph)
    for layer, _, op in ops:
        assert op.device.endswith(LAYER_DEVICES[layer]), (op.name, op.device)
    # block_0's segment runs forward once per microbatch and again in its
    # backward pass (recomputed there, on its stage's device).
    forward = [op for layer, backward, op in ops if layer == "block_0" and not backward
               and op.type == "MatMul"]
    assert len(forward) == 8, [op.name for op in forward]
    checkpoints = [op for op in graph.get_operations()
                   if op.type == "IdentityN" and not op.name.startswith("adam/")]
    assert len(checkpoints) == 4 and all(op.device.endswith("CPU:0") for op in checkpoints)


def test_each_stage_reads_its_weights_once_a_step_onto_its_device():
    # Read once a step (scope `W<stage>`), on the stage's device, and used by
    # every microbatch's forward and backward: no pass reads a variable, so
    # a weight crosses from the device holding it once, not once per
    # microbatch (the loss's regularizers and the optimizer read their own).
    graph = _traced_step([_pipelined()])
    ops = graph.get_operations()
    in_passes = [op.name for op in ops if op.type == "ReadVariableOp"
                 and re.match(r"(gradient_tape/)?[FB]\d+_\d+/", op.name)]
    assert not in_passes
    copies = [op for op in ops if re.fullmatch(r"W\d/Identity(_\d+)?", op.name)]
    # Stage 0: block_0, block_1; stage 1: block_2, head; a kernel and a bias each.
    assert sorted(op.name[1] for op in copies) == ["0"] * 4 + ["1"] * 4
    for op in copies:
        assert op.device.endswith(DEVICES[int(op.name[1])].lstrip("/")), (op.name, op.device)
        assert op.inputs[0].op.type == "ReadVariableOp"


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_stage_hands_each_microbatch_over_before_its_next_pass(schedule):
    # Stage 0's forward output of microbatch m is copied onto stage 1's
    # device by an op of its own (`F0_<m>_to_1`), and stage 1's input
    # gradient onto stage 0's (`B1_<m>_to_0`); the stage's next pass waits
    # on that copy. (Left to TensorFlow, a device of one thread sent its
    # outputs only once it had nothing else to run.)
    graph = _traced_step([_pipelined(schedule)])
    ops = graph.get_operations()
    waiting_on = {}
    for op in ops:
        for control in op.control_inputs:
            waiting_on.setdefault(control.name, []).append(op.name)
    for m in range(4):
        forward = graph.get_operation_by_name(f"F0_{m}_to_1/Identity")
        backward = graph.get_operation_by_name(f"B1_{m}/B1_{m}_to_0/Identity")
        assert forward.device.endswith("CPU:1") and backward.device.endswith("CPU:0")
        if m < 3:
            assert any(name.startswith(f"F0_{m + 1}/") for name in waiting_on[forward.name])
            assert any(f"F1_{m + 1}/" in name or name.startswith(f"B1_{m + 1}/")
                       for name in waiting_on[backward.name])
    # The model's inputs get no gradient: block_0's backward is its weight
    # gradient alone (one MatMul a microbatch, none for the input).
    input_side = [op.name for op in ops if op.type == "MatMul"
                  and re.match(r"gradient_tape/F0_\d/block_0(_\d+)?/", op.name)]
    assert len(input_side) == 4, input_side


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_stage_adds_in_its_weight_gradients_before_its_next_backward(schedule):
    # Microbatch m's weight gradients are added to the sums (AddV2 in scope
    # B<s>_<m>) before the stage's backward of m + 1 makes its own: else
    # TensorFlow may hold every microbatch's gradients at once.
    graph = _traced_step([_pipelined(schedule)])
    ops = graph.get_operations()
    for s in (0, 1):
        for m in (1, 2):
            sums = {op.name for op in ops if op.type == "AddV2"
                    and op.name.startswith(f"B{s}_{m}/")}
            assert sums, (s, m)
            waiting = [op.name for op in ops if f"F{s}_{m + 1}/" in op.name
                       and op.name.startswith("gradient_tape/")
                       and sums & {c.name for c in op.control_inputs}]
            assert waiting, (s, m)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_stage_sends_its_final_sums_after_its_last_hand_over(schedule):
    # Stage 1's weight-gradient sums go to the variables' device (CPU:0 here)
    # for the optimizer only once its last input gradient has reached stage
    # 0, so that their copies do not delay that hand-over.
    graph = _traced_step([_pipelined(schedule)])
    held = [op for op in graph.get_operations()
            if op.name.startswith("B1_3/sums_after_hand_over/") and op.type == "Identity"]
    # block_2 and head: a kernel and a bias each (stage 0 hands nothing back).
    assert len(held) == 4, [op.name for op in held]
    for op in held:
        assert [c.name for c in op.control_inputs] == ["B1_3/B1_3_to_0/Identity"]
        assert op.device.endswith("CPU:1")
    assert not [op for op in graph.get_operations() if "B0_3/sums_after" in op.name]


# -- schedules -------------------------------------------------------------------------

@pytest.mark.parametrize("stages,count", [(2, 4), (3, 8), (4, 2)])
def test_1f1b_keeps_at_most_s_microbatches_alive_per_stage(stages, count):
    for schedule in ("gpipe", "1f1b"):
        order = schedule_order(stages, count, schedule)
        assert sorted(order) == sorted(
            [(k, s, m) for k in "FB" for s in range(stages) for m in range(count)])
        for s in range(stages):
            alive, peak = 0, 0
            for kind, stage, _ in order:
                if stage == s:
                    alive += 1 if kind == "F" else -1
                    peak = max(peak, alive)
            if schedule == "1f1b":
                assert peak <= min(stages - s, count)
            else:
                assert peak == count  # every forward before the first backward


# -- reports and configs ---------------------------------------------------------------

def test_report_names_layers_that_see_a_microbatch():
    x, y = _data(16)
    model = kip.PluginModel(BNTower(), passes=[
        PipelineStages([["dense"], ["norm", "head"]], microbatches=2, devices=DEVICES)])
    _compat_loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model.compile("adam", _compat_loss)
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    text = str(model.kip_report)
    assert "sees a microbatch" in text and "BatchNormalization" in text
    assert "stage 1 on /CPU:1" in text


def test_report_says_gradient_accumulation_without_devices():
    if tf.config.list_logical_devices("GPU"):
        pytest.skip("GPUs visible: the stages go to them")
    x, y = _data(16)
    model = kip.PluginModel(Tower(), passes=[PipelineStages(STAGES, microbatches=4)])
    _compile(model)
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert "gradient accumulation" in str(model.kip_report)


# -- XLA -------------------------------------------------------------------------------

def _fitted_step(passes, jit="auto", entry="model"):
    """`(the session, its pipelined step)` after one epoch through `entry`."""
    x, y = _data(16)
    if entry == "model":
        model = kip.PluginModel(Tower(), passes=passes)
        _compile(model, jit)
        model.fit(x, y, batch_size=16, epochs=1, verbose=0)
        session = model._kip_session
    else:
        model = Tower()
        _compile(model, jit)
        callback = kip.PluginCallback(passes=passes)
        model.fit(x, y, batch_size=16, epochs=1, verbose=0, callbacks=[callback])
        session = model.train_function.session
    return session, pipelined_train_step(session, keras.Model.train_step)


def test_auto_jit_compile_leaves_stages_on_several_devices_in_graph_mode(monkeypatch):
    # Keras's jit_compile="auto" picks XLA wherever there is a GPU, and XLA
    # compiles the step into one cluster on one device: on a GPU machine the
    # stages would silently share one. This machine has none, so what auto
    # resolves to is made that of a GPU machine.
    from keras_ipu_plugin import _compat

    session, step = _fitted_step([_pipelined()])
    assert session.jit_compile_asked == "auto"
    assert step.jit_compile(compiled=True, asked="auto") is False
    assert "train step in graph mode" in str(session.converted.kip_report)
    # Not seen (PluginCallback, kip.scope): a True that auto gives too is auto ...
    monkeypatch.setattr(_compat, "auto_jit_compile", lambda model: True)
    assert step.jit_compile(compiled=True, asked=None) is False
    # ... and one auto would not give was asked for: kept, with a warning.
    monkeypatch.setattr(_compat, "auto_jit_compile", lambda model: False)
    with pytest.warns(UserWarning, match=r"will not run on /CPU:0, /CPU:1"):
        assert step.jit_compile(compiled=True, asked=None) is True
    assert step.jit_compile(compiled=False, asked="auto") is False


def test_explicit_jit_compile_is_kept_with_a_warning():
    with pytest.warns(UserWarning, match="jit_compile=True. XLA compiles the train step"):
        session, step = _fitted_step([_pipelined()], jit=True)
    assert session.jit_compile_asked is True
    assert "train step under XLA" in str(session.converted.kip_report)
    with pytest.warns(UserWarning, match="jit_compile=True"):
        assert step.jit_compile(compiled=True, asked=None) is True  # on a CPU-only machine


def test_stages_on_one_device_keep_xla_without_a_word():
    session, step = _fitted_step([PipelineStages(STAGES, microbatches=4, devices=["/CPU:0"])],
                                 jit=True, entry="callback")
    assert session.jit_compile_asked is None
    assert step.jit_compile(compiled=True, asked=None) is True
    assert "XLA" not in str(session.converted.kip_report)


def test_the_step_function_can_differ_from_the_model_in_jit_compile():
    # A numpy_function cannot be compiled by XLA: the function made with
    # jit_compile=False runs it although the model is compiled with XLA, and
    # the model keeps its setting.
    from keras_ipu_plugin import _compat

    model = Tower()
    _compile(model, jit=True)

    def step(data):
        return tf.numpy_function(lambda a: a * 2, [data], tf.float32)

    data = tf.data.Dataset.from_tensors(tf.ones([2])).repeat()
    graph = _compat.make_step_function(model, step, jit_compile=False)
    np.testing.assert_allclose(graph(iter(data)), [2.0, 2.0])
    assert model.jit_compile is True
    with pytest.raises(Exception, match="numpy_function|PyFunc|unsupported"):
        _compat.make_step_function(model, step)(iter(data))


def test_settings_round_trip_through_configs():
    stages = _pipelined("1f1b", microbatches=8)
    again = PipelineStages.from_config(stages.get_config())
    assert again.pipeline_settings == (8, tuple(DEVICES), "1f1b")
    [read] = kip.passes_from_config({"pipeline_stages": {
        "num_stages": 2, "microbatches": 4, "devices": DEVICES, "schedule": "gpipe"}})
    assert read.pipeline_settings == (4, tuple(DEVICES), "gpipe")


@pytest.mark.parametrize("kwargs,field", [
    (dict(microbatches=0), "microbatches"), (dict(microbatches=True), "microbatches"),
    (dict(devices=[]), "devices"), (dict(devices="/CPU:0"), "devices"),
    (dict(schedule="interleaved"), "schedule"),
])
def test_bad_settings_are_refused(kwargs, field):
    with pytest.raises(kip.PassError) as error:
        PipelineStages(STAGES, **kwargs)
    assert error.value.field == field


# -- refusals --------------------------------------------------------------------------

def test_a_custom_train_step_is_refused():
    x, y = _data(16)
    model = kip.PluginModel(OwnStep(), passes=[_pipelined()])
    _compile(model)
    with pytest.raises(ValueError, match="overrides `train_step`"):
        model.fit(x, y, batch_size=16, epochs=1, verbose=0)


def test_several_replicas_are_refused(mirrored):
    x, y = _data(16)
    with kip.scope(mirrored, passes=[_pipelined()]):
        model = Tower()
        _compile(model)
    with pytest.raises(ValueError, match="2 replicas"):
        model.fit(x, y, batch_size=16, epochs=1, verbose=0)


def test_a_layer_adding_its_own_loss_is_refused():
    x = np.random.default_rng(0).normal(size=(16, 8)).astype("float32")
    y = np.zeros((16, 1), "float32")
    model = kip.PluginModel(RegularizedTower(depth=2), passes=[
        PipelineStages([["blocks.0"], ["blocks.1", "head"]], microbatches=2, devices=DEVICES)])
    model.compile("adam", "mse")
    with pytest.raises(ValueError, match=r"layer `block_0` of stage 0 adds a loss"):
        model.fit(x, y, batch_size=16, epochs=1, verbose=0)


def test_a_loss_that_is_not_a_mean_over_the_batch_is_refused():
    x, y = _data(16)
    model = kip.PluginModel(Tower(), passes=[_pipelined()])
    _compile(model, loss=keras.losses.SparseCategoricalCrossentropy(
        from_logits=True, reduction="sum"))
    with pytest.raises(ValueError, match="reduction='sum'"):
        model.fit(x, y, batch_size=16, epochs=1, verbose=0)


def test_devices_disagreeing_with_kip_stage_devices_are_refused():
    from keras_ipu_plugin.runtime.pipeline import stage_devices

    assert stage_devices(None, DEVICES, 3) == ["/CPU:0", "/CPU:1", "/CPU:0"]
    assert stage_devices(None, None, 1) == [None]
    with pytest.raises(ValueError, match="different devices"):
        stage_devices(["/CPU:1", "/CPU:0"], DEVICES, 2)


@pytest.mark.parametrize("entry", ["model", "callback", "scope"])
def test_stage_devices_this_process_does_not_have_are_an_error_naming_them(entry):
    """Soft placement would run the stages elsewhere while the report said
    "stage 0 on /GPU:0": a device the process lacks is refused by name."""
    stages = PipelineStages(STAGES, microbatches=2, devices=["/CPU:0", "/GPU:5"])
    with pytest.raises(kip.PassError, match=r"'/GPU:5', which this process does not have"):
        _train(entry, [stages])


def test_kip_stage_devices_this_process_does_not_have_are_an_error_naming_them():
    x, _ = _data()
    converted = kip.convert_to_functional(Tower(), x[:16])
    staged = kip.apply_passes(converted, [PipelineStages(STAGES)])
    staged.kip_stage_devices = ["/CPU:0", "/device:GPU:3"]
    with pytest.raises(ValueError, match=r"'/device:GPU:3', which this process does not have"):
        staged(x[:16])


# -- passes after PipelineStages ------------------------------------------------------

class TwoSubModels(keras.Model):
    """Two functional sub-models (one Dense each) and a head: PipelineStages
    can put each in its own stage, and Expand then opens them."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.first = _one_dense_model("first", 8)
        self.second = _one_dense_model("second", 8)
        self.head = keras.layers.Dense(3, name="head")

    def call(self, x):
        return self.head(self.second(self.first(x)))


def _one_dense_model(name, width):
    inputs = keras.Input((width,))
    return keras.Model(inputs, keras.layers.Dense(width, name=f"{name}_dense")(inputs),
                       name=name)


@pytest.mark.parametrize("later", ["expand", "outline"])
def test_a_block_expanded_after_pipeline_stages_keeps_its_stage(later):
    """Expand (or Outline, which expands to reach its targets) run after
    PipelineStages opens a staged block: its layers stay in the block's stage,
    and the pipelined model trains as the unpipelined one."""
    x, y = _data(16)
    keras.utils.set_random_seed(5)
    model = TwoSubModels()
    model(x[:16])
    converted = kip.convert_to_functional(model, x[:16])
    after = ([kip.passes.Expand("all")] if later == "expand"
             else [kip.passes.Expand("all"), kip.passes.Outline(keras.layers.Dense)])
    staged = kip.apply_passes(converted, [PipelineStages([["first"], ["second", "head"]],
                                                         microbatches=2), *after])
    stages = staged.kip_layer_stages
    assert stages["first_dense"] == 0
    assert stages["second_dense"] == 1 and stages["head"] == 1

    def train(passes):
        keras.utils.set_random_seed(5)
        user = TwoSubModels()
        user(x[:16])
        trained = kip.PluginModel(user, passes=passes) if passes else user
        _compile(trained)
        trained.fit(x, y, batch_size=16, epochs=1, verbose=0)
        return [v.numpy() for v in user.weights]

    _assert_same_weights(train(None), train([PipelineStages([["first"], ["second", "head"]],
                                                            microbatches=2), *after]))


class _StagesBackwards(kip.passes.Pass):
    """A pass of the user's own that puts the first layer in a later stage
    than the layer reading it."""

    step = "stages_backwards"

    def run(self, graph, report):
        for node in graph.nodes:
            if node.name == "blocks.0":
                node.annotations["stage"] = 1
        return graph


def test_a_pass_leaving_stages_against_the_data_flow_is_refused_by_name():
    """A later pass that leaves a layer in an earlier stage than a layer it
    reads is a PassError naming the pass and both layers, at apply_passes,
    not a plain error at the first training step."""
    x, _ = _data()
    converted = kip.convert_to_functional(Tower(), x[:16])
    with pytest.raises(kip.PassError, match=(
            r"after pass _StagesBackwards: layer `blocks.1` is in pipeline stage 0 but "
            r"reads the output of `blocks.0`, in stage 1")):
        kip.apply_passes(converted, [PipelineStages(STAGES), _StagesBackwards()])
