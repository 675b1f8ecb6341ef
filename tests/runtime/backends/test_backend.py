"""Backends: portable recompute and outline take real effect.

The IPU backend is tested against a stand-in for Graphcore's SDK in
test_ipu_backend.py.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_ipu_plugin as kip
import models  # tests/models.py (tests/ is on sys.path under pytest)


class Tower(models.NormTower):
    def __init__(self, depth=12, width=32):
        super().__init__(depth=depth, width=width)


def _data(n=64, features=16):
    return models.regression_data(n, features)


class MaskedTower(models.MaskedTower):
    def __init__(self):
        super().__init__(depth=3)


MaskedBlock = models.MaskedAttentionBlock
Block = models.NormBlock



def _gradient_step(model, jit_compile=False):
    """A tf.function: the MSE loss's gradients w.r.t. `model`'s weights."""
    @tf.function(jit_compile=jit_compile)
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(x, training=True) - y) ** 2)
        return tape.gradient(loss, model.trainable_variables)

    return step


def _step_graph(model, features=16):
    """The traced graph of `_gradient_step(model)`."""
    return _gradient_step(model).get_concrete_function(
        tf.TensorSpec((None, features)), tf.TensorSpec((None, 1))).graph


def _gradients(model, x, y, jit_compile=False):
    return _gradient_step(model, jit_compile)(x, y)


@pytest.fixture
def tower():
    x, y = _data()
    model = Tower(depth=6)
    converted = kip.convert_to_functional(model, x)
    return model, converted, x, y


@pytest.mark.parametrize("jit_compile", [False, True], ids=["graph", "xla"])
def test_a_recomputed_segment_passing_a_mask_on_has_gradients(jit_compile):
    # A segment ending in an expanded block also hands its Keras mask (a
    # boolean tensor) to the next: its incoming "gradient" is boolean, and
    # the anchor tying the recomputation to the backward pass was taken
    # from it (the gallery transformer without dropout failed to train).
    from keras_ipu_plugin.runtime.backends import recompute_grad

    w = tf.Variable(np.random.default_rng(0).normal(size=(3, 3)).astype("float32"))

    def segment(x, kernel):
        return [x > 0.5, tf.tanh(x @ kernel)]

    def gradient_of(function):
        @tf.function(jit_compile=jit_compile)
        def step(x):
            with tf.GradientTape() as tape:
                tape.watch(x)
                mask, y = function(x, w.read_value())
                loss = tf.reduce_sum(tf.where(mask, y, 0.0) ** 2)
            return tape.gradient(loss, x)

        return step(tf.constant([[0.7, 0.2, 0.9], [0.6, 0.8, 0.1]]))

    np.testing.assert_allclose(gradient_of(recompute_grad(segment)), gradient_of(segment),
                               rtol=1e-6)


@pytest.mark.parametrize("jit_compile", [False, True])
def test_recompute_gradients_equal_in_graph_mode(tower, jit_compile):
    model, converted, x, y = tower
    recomputed = kip.apply_passes(converted, [kip.passes.Recompute(["block_1", "block_3"])])
    expected = _gradients(converted, x, y)
    actual = _gradients(recomputed, x, y, jit_compile=jit_compile)
    for e, a in zip(expected, actual):
        np.testing.assert_allclose(a, e, atol=1e-5)
    plan = recomputed.kip_interpreter().steps
    assert sum(s.recompute for s in plan) == 2


def test_last_segment_is_recomputed_only_when_the_layers_after_it_keep_more(tower):
    # Tower(depth=6): stem, block_0..block_5, head = Dense(1).
    model, converted, x, y = tower

    def plan(checkpoints):
        recomputed = kip.apply_passes(converted, [kip.passes.Recompute(checkpoints)])
        recomputed(x)  # makes the executor
        return recomputed.kip_interpreter().steps

    # After block_5 only the 1-wide head: recomputing block_2..block_5 would
    # not lower the peak (its activations are needed first in the backward).
    assert [s.recompute for s in plan(["block_1", "block_5"])] == [True, False, False]
    # After block_3 come two 32-wide blocks: the segment stays recomputed.
    assert [s.recompute for s in plan(["block_1", "block_3"])] == [True, True, False]


def test_recompute_really_recomputes_in_the_backward_pass(tower):
    model, converted, x, y = tower
    recomputed = kip.apply_passes(converted, [kip.passes.Recompute(["block_2"])])

    def forward_matmuls(m):
        graph = _step_graph(m)
        ops = [op.type for op in graph.get_operations()]
        for function in graph._functions.values():
            ops += [op.type for op in function.graph.get_operations()] if hasattr(function, "graph") else []
        return ops

    base, reco = forward_matmuls(converted), forward_matmuls(recomputed)
    # recompute_grad re-runs the segment in the gradient: more ops overall
    assert len(reco) > len(base)


def _variable_reads(model, variable):
    """ReadVariableOps of `variable` in a traced forward-and-gradient step."""
    graph = _step_graph(model)
    handles = [inner for outer, inner in graph.captures if outer is variable.value.handle]
    return sum(
        1 for op in graph.get_operations()
        if op.type == "ReadVariableOp" and any(i is h for h in handles for i in op.inputs)
    )


def test_recomputed_segment_reads_its_variables_only_in_the_forward_pass(tower):
    # Variables read again while recomputing in the backward pass could be
    # read after the optimizer updated them: Grappler's dependency
    # optimisation let that happen in about one step in five.
    model, converted, x, y = tower
    recomputed = kip.apply_passes(converted, [kip.passes.Recompute(["block_1"])])
    for variable in model.blocks[1].trainable_variables:
        assert _variable_reads(recomputed, variable) == _variable_reads(converted, variable) == 1


def test_recomputed_training_step_equals_plain_keras_step_every_time():
    # The symptom of the bug above, end to end: a ~1% wrong update in some
    # fresh traces (this test caught it in two runs of three; the read count
    # above is the deterministic check).
    x, y = _data(n=32)

    def one_step(passes):
        keras.utils.set_random_seed(21)
        model = Tower(depth=2, width=16)
        model(x[:2])
        before = [v.numpy().copy() for v in model.trainable_variables]
        trained = kip.PluginModel(model, passes=passes) if passes is not None else model
        trained.compile(optimizer="sgd", loss="mse")
        trained.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
        return [v.numpy() - b for v, b in zip(model.trainable_variables, before)]

    expected = one_step(None)
    for _ in range(10):
        actual = one_step([kip.passes.Recompute(["block_0", "block_1"])])
        for a, e in zip(actual, expected):
            np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-7)


class RegularizedBlock(keras.layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(16, activation="tanh",
                                        activity_regularizer=keras.regularizers.L2(0.1))

    def call(self, x):
        return x + self.dense(x)


class RegularizedNet(keras.Model):
    def __init__(self):
        super().__init__()
        self.block_0 = RegularizedBlock(name="block_0")
        self.block_1 = RegularizedBlock(name="block_1")
        self.head = keras.layers.Dense(1)

    def call(self, x):
        return self.head(self.block_1(self.block_0(x)))


def test_losses_added_inside_a_recomputed_segment_keep_value_and_gradient():
    x, y = _data(n=32)
    converted = kip.convert_to_functional(RegularizedNet(), x)
    recomputed = kip.apply_passes(converted, [kip.passes.Recompute(["block_0"])])

    def loss_and_gradients(model):
        @tf.function
        def step(x, y):
            with tf.GradientTape() as tape:
                prediction = model(x, training=True)
                regularization = tf.add_n(model.losses)
                loss = tf.reduce_mean((prediction - y) ** 2) + regularization
            return regularization, tape.gradient(loss, model.trainable_variables)

        return step(x, y)

    expected_loss, expected = loss_and_gradients(converted)
    actual_loss, actual = loss_and_gradients(recomputed)
    assert float(expected_loss) > 0
    np.testing.assert_allclose(actual_loss, expected_loss, rtol=1e-6)
    for a, e in zip(actual, expected):
        np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-6)


def test_recompute_fit_loss_equal_after_10_steps():
    x, y = _data(n=160)
    losses = []
    for recompute in (False, True):
        keras.utils.set_random_seed(3)
        model = Tower(depth=4)
        converted = kip.convert_to_functional(model, x[:16])
        if recompute:
            converted = kip.apply_passes(converted, [kip.passes.Recompute(["block_0", "block_2"])])
        converted.compile(optimizer="adam", loss="mse")
        history = converted.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
        losses.append(history.history["loss"][-1])
    assert losses[0] == pytest.approx(losses[1], abs=1e-5)


def test_recompute_under_mirrored_strategy(mirrored):
    x, y = _data()
    with mirrored.scope():
        model = Tower(depth=4)
        converted = kip.convert_to_functional(model, x)
        recomputed = kip.apply_passes(converted, [kip.passes.Recompute(["block_1"])])
        recomputed.compile(optimizer="sgd", loss="mse")
    before = [v.numpy().copy() for v in model.trainable_variables]
    recomputed.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert any(not np.array_equal(b, v.numpy()) for b, v in zip(before, model.trainable_variables))


def _op_count(model, features=16):
    return len(_step_graph(model, features).get_operations())


def test_outline_shares_one_body_and_keeps_results():
    x, y = _data()
    model = Tower(depth=12)
    converted = kip.convert_to_functional(model, x)
    outlined = kip.apply_passes(converted, [kip.passes.Outline(Block)])
    kip.frontend.verify.equivalence.check_equivalent(model, outlined, x)
    expected = _gradients(converted, x, y)
    actual = _gradients(outlined, x, y)
    for e, a in zip(expected, actual):
        np.testing.assert_allclose(a, e, atol=1e-5)
    plain, shared = _op_count(converted), _op_count(outlined)
    assert shared < plain / 2, (plain, shared)
    assert len(outlined.kip_interpreter().effects["outline"].bodies) == 1
    metrics = outlined.kip_report.metrics
    assert metrics["train graph ops with outlining"] < metrics["train graph ops without outlining"] / 2
    assert "train graph ops with outlining" in str(outlined.kip_report)


def test_pipeline_stages_exposed_and_placed():
    x, _ = _data()
    model = Tower(depth=2)
    converted = kip.convert_to_functional(model, x)
    staged = kip.apply_passes(converted, [kip.passes.PipelineStages([["block_0"], ["block_1"]])])
    assert staged.kip_stages["blocks.0"] == 0 and staged.kip_stages["blocks.1"] == 1
    assert staged.kip_stages["head"] == 1  # by path
    assert staged.kip_layer_stages["block_0"] == 0  # by Keras name, as backends assign them
    assert staged.kip_layer_stages[model.head.name] == 1
    staged.kip_stage_devices = ["/cpu:0", "/cpu:1"]
    np.testing.assert_allclose(staged(x), model(x), atol=1e-5)


def test_portable_backend_off_ipu():
    assert kip.backend() == "portable"
    assert kip.ipu_replacements() == []


def test_outline_passes_tensor_keyword_arguments_through():
    ids = np.random.default_rng(0).integers(1, 20, size=(4, 6))
    ids[:, 4:] = 0
    model = MaskedTower()
    converted = kip.convert_to_functional(model, ids)
    outlined = kip.apply_passes(converted, [kip.passes.Outline(MaskedBlock)])
    kip.frontend.verify.equivalence.check_equivalent(model, outlined, ids)
    # The three blocks share one body per training mode (attention dropout
    # reads it from the context): inference, training, and the mode `fit`
    # calls a model whose `call` takes no `training` in (verification runs
    # one such step).
    keys = list(outlined.kip_interpreter().effects["outline"].bodies)
    assert len(keys) == len({key[-1] for key in keys})
    assert {False, True} <= {key[-1] for key in keys} <= {False, True, None}
