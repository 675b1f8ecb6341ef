"""The passes keep what plain Keras does with `training`, weights, state and
losses.

Provenance: each of these was broken on purpose in a copy of the library
(`tools/mutation.py`) and the whole suite still passed. Each test here
fails when its behaviour breaks:

- a `training=False` pinned by the code is honoured by the executor (a
  frozen BatchNormalization keeps its statistics with Recompute, Outline and
  pipeline stages);
- `Replace(copy_weights=True)` copies every weight, bias and moving
  statistics included (tested on trained, not freshly initialised, layers);
- BatchNormalization and Dropout between recompute checkpoints update their
  state and draw their masks exactly as plain Keras;
- Outline never shares a body between layers of different configs;
- Recompute lowers the activations a training step keeps for the backward
  pass;
- a block called with a pinned `training` passes it to the sub-layers that
  follow it, through Expand;
- a model whose own `call` branches on `training` converts to one ModeSwitch
  node that behaves like the model in both modes and trains like it;
- losses added inside outlined layers (activity regularizers, `add_loss`)
  keep their value and gradient, and an outlined body traced in training is
  not reused in inference (both were lost by the `stateless_call` body).
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_ipu_plugin as kip
from models import RegularizedBlock  # tests/models.py
from models import RegularizedTower
from keras_ipu_plugin.runtime import backends
from keras_ipu_plugin.passes import Expand
from keras_ipu_plugin.passes import Outline
from keras_ipu_plugin.passes import PipelineStages
from keras_ipu_plugin.passes import Recompute
from keras_ipu_plugin.passes import Replace
from keras_ipu_plugin.passes import Replacement

layers = keras.layers


def _rand(*shape, seed=0):
    return np.random.default_rng(seed).normal(size=shape).astype("float32")


def _numpy(variables):
    return [np.array(v.numpy()) for v in variables]


# -- a pinned training=False is honoured by the executor ----------------------
class FrozenNormBlock(layers.Layer):
    """A BatchNormalization called with a hard-coded `training=False`."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = layers.Dense(4, name="dense")
        self.bn = layers.BatchNormalization(name="bn")

    def call(self, x, training=None):
        return self.bn(self.dense(x), training=False)


class FrozenNet(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.stem = layers.Dense(4, name="stem")
        self.block = FrozenNormBlock(name="block")
        self.head = layers.Dense(1, name="head")

    def call(self, x, training=None):
        return self.head(self.block(self.stem(x), training=training))


FROZEN_PASSES = {
    "recompute": [Expand(), Recompute(["stem"])],
    "outline": [Expand(), Outline(layers.BatchNormalization)],
    "stages": [Expand(), PipelineStages([["stem"], ["block.bn", "head"]])],
}


@pytest.mark.parametrize("pass_name", sorted(FROZEN_PASSES))
def test_frozen_batch_normalization_keeps_its_statistics_under_each_executor_pass(pass_name):
    x, y = _rand(16, 3), _rand(16, 1, seed=1)
    model = FrozenNet(name="frozen")
    model(x)
    bn = model.block.bn
    # Statistics away from their initial 0 / 1, so that any update shows.
    bn.moving_mean.assign(np.full(4, 0.5, "float32"))
    bn.moving_variance.assign(np.full(4, 2.0, "float32"))
    statistics = _numpy(bn.non_trainable_variables)
    kernel = model.stem.kernel.numpy().copy()
    plugin = kip.PluginModel(model, passes=FROZEN_PASSES[pass_name])
    plugin.convert(x)
    converted = plugin.converted
    if pass_name == "stages":
        converted.kip_stage_devices = ["/cpu:0", "/cpu:1"]
    assert converted.kip_interpreter().effects  # the pass's effect runs with the model
    assert converted.kip_graph.node("block.bn").training is False
    plugin.compile(optimizer="sgd", loss="mse")
    plugin.fit(x, y, batch_size=8, epochs=2, verbose=0)
    assert not np.allclose(model.stem.kernel.numpy(), kernel)  # it did train
    for before, after in zip(statistics, _numpy(bn.non_trainable_variables)):
        np.testing.assert_array_equal(after, before)


# -- Replace copies every weight ----------------------------------------------
class TunedDense(layers.Dense):
    """A stand-in for an accelerator-specific Dense."""


class TunedBatchNormalization(layers.BatchNormalization):
    """A stand-in for an accelerator-specific BatchNormalization."""


class NormNet(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = layers.Dense(6, name="dense")
        self.bn = layers.BatchNormalization(name="bn")
        self.head = layers.Dense(2, name="head")

    def call(self, x, training=None):
        return self.head(keras.activations.relu(self.bn(self.dense(x), training=training)))


def test_replace_copies_trained_bias_and_moving_statistics():
    x, y = _rand(32, 5), _rand(32, 2, seed=1)
    model = NormNet(name="norm_net")
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    model.fit(x + 3.0, y, batch_size=8, epochs=2, verbose=0)  # shifted: moving mean moves
    bn = model.bn
    # A bias right before a BatchNormalization gets no gradient: as loaded
    # from a checkpoint trained otherwise.
    model.dense.bias.assign(_rand(6, seed=2))
    # Trained weights: biases, beta and moving statistics far from their
    # initial constants (a copier skipping any of them cannot go unseen).
    for variable, initial in [(model.dense.bias, 0.0), (model.head.bias, 0.0),
                              (bn.beta, 0.0), (bn.moving_mean, 0.0), (bn.moving_variance, 1.0)]:
        assert np.max(np.abs(variable.numpy() - initial)) > 1e-2, variable.path
    converted = kip.convert_to_functional(model, x)
    passed = kip.apply_passes(converted, [Replace({
        layers.Dense: Replacement(TunedDense, copy_weights=True),
        layers.BatchNormalization: Replacement(TunedBatchNormalization, copy_weights=True),
    })])
    pairs = dict((old.name, new) for old, new in passed.kip_replaced)
    assert set(pairs) == {"dense", "bn", "head"}
    for old in (model.dense, model.bn, model.head):
        new = pairs[old.name]
        assert [v.name for v in new.weights] == [v.name for v in old.weights]
        for source, copy in zip(old.weights, new.weights):
            np.testing.assert_array_equal(copy.numpy(), source.numpy(), err_msg=source.path)
    np.testing.assert_allclose(passed(x, training=False), model(x, training=False), atol=1e-6)


# -- BatchNormalization and Dropout between recompute checkpoints ------------
class NoisyBlock(layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = layers.Dense(16, activation="tanh", name="dense")
        self.bn = layers.BatchNormalization(name="bn")
        self.dropout = layers.Dropout(0.5, name="dropout")
        self.out = layers.Dense(16, name="out")

    def call(self, x, training=None):
        h = self.dropout(self.bn(self.dense(x), training=training), training=training)
        return x + self.out(h)


class NoisyNet(keras.Model):
    def __init__(self, block=None, **kwargs):
        super().__init__(**kwargs)
        self.stem = layers.Dense(16, name="stem")
        self.blocks = [(block or NoisyBlock)(name=f"block_{i}") for i in range(3)]
        self.head = layers.Dense(1, name="head")

    def call(self, x, training=None):
        x = self.stem(x)
        for block in self.blocks:
            x = block(x, training=training)
        return self.head(x)


# Checkpoints after each block's output layer: the BatchNormalization and
# Dropout of blocks 1 and 2 lie between two checkpoints.
NOISY_PASSES = [Expand(), Recompute(["blocks.0.out", "blocks.1.out", "blocks.2.out"])]


def _noisy_twin():
    keras.utils.set_random_seed(11)
    model = NoisyNet(name="noisy")
    model(_rand(2, 8))
    return model


def test_batch_normalization_and_dropout_between_checkpoints_train_as_plain_keras():
    x, y = _rand(32, 8), _rand(32, 1, seed=1)
    results = []
    for passes in (None, NOISY_PASSES):
        model = _noisy_twin()
        trained = model if passes is None else kip.PluginModel(model, passes=passes)
        # A rate at which training converges: at 0.05 the loss grew fivefold
        # in two epochs, amplifying the last-bit differences of a gradient
        # summed in another order (the recomputed residual) past any tolerance.
        trained.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
        trained.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
        results.append((model, _numpy(model.weights)))
        if passes is not None:
            segments = trained.converted.kip_interpreter().steps
            assert sum(s.recompute for s in segments) >= 2
    (plain, expected), (recomputed, actual) = results
    moving_mean = [v.path for v in plain.weights].index(plain.blocks[1].bn.moving_mean.path)
    assert np.min(np.abs(expected[moving_mean])) > 1e-4  # the statistics moved
    for variable, e, a in zip(plain.weights, expected, actual):
        np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-6, err_msg=variable.path)


def test_dropout_between_checkpoints_draws_one_mask_for_forward_and_recompute():
    # The gradient of one training step equals plain Keras's with the same
    # seeds: a mask drawn anew when the segment is recomputed would give
    # another gradient.
    x, y = _rand(16, 8), _rand(16, 1, seed=1)
    model = _noisy_twin()
    converted = kip.convert_to_functional(model, x)
    passed = kip.apply_passes(converted, NOISY_PASSES)
    state = _numpy(model.non_trainable_variables)

    def gradients(net):
        for variable, value in zip(model.non_trainable_variables, state):
            variable.assign(value)

        @tf.function
        def step():
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean((net(x, training=True) - y) ** 2)
            return tape.gradient(loss, model.trainable_variables)

        return step()

    expected, actual = gradients(model), gradients(passed)
    segments = passed.kip_interpreter().steps
    assert any(s.recompute for s in segments)
    for variable, e, a in zip(model.trainable_variables, expected, actual):
        np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-6, err_msg=variable.path)


class DropBlock(layers.Layer):
    """Dense -> Dropout -> Dense: the Dropout's only state is its seed."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = layers.Dense(16, activation="tanh", name="dense")
        self.dropout = layers.Dropout(0.5, name="dropout")
        self.out = layers.Dense(16, name="out")

    def call(self, x, training=None):
        return x + self.out(self.dropout(self.dense(x), training=training))


def _drop_twin():
    keras.utils.set_random_seed(12)
    model = NoisyNet(DropBlock, name="drop_net")
    model(_rand(2, 8))
    return model


DROP_PASSES = [Expand(), Recompute(["blocks.0.out", "blocks.1.out", "blocks.2.out"])]


@pytest.mark.parametrize("jit_compile", [False, True])
def test_a_dropout_inside_a_recomputed_segment_trains_as_plain_keras(jit_compile):
    # The Dropout sits inside the segment (its seed is its only state): the
    # segment reads the seed once, the recomputation draws the same mask and
    # the seed advances once per step, as in plain Keras.
    x, y = _rand(32, 8), _rand(32, 1, seed=1)
    results = []
    for passes in (None, DROP_PASSES):
        model = _drop_twin()
        trained = model if passes is None else kip.PluginModel(model, passes=passes)
        trained.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse",
                        jit_compile=jit_compile)
        history = trained.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
        results.append((model, _numpy(model.weights), history.history["loss"]))
        if passes is not None:
            segments = trained.converted.kip_interpreter().steps
            dropouts = [s for s in segments if s.recompute
                        and any("dropout" in n.operation.name for n in s.nodes)]
            assert len(dropouts) >= 2, [[n.operation.name for n in s.nodes] for s in segments]
    (plain, expected, plain_loss), (_, actual, loss) = results
    np.testing.assert_allclose(loss, plain_loss, rtol=1e-5)
    for variable, e, a in zip(plain.weights, expected, actual):  # seed states included
        np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-6, err_msg=variable.path)


# -- Outline shares bodies only between equal configs -------------------------
class MixedDenseNet(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.relu = layers.Dense(8, activation="relu", name="relu")
        self.tanh = layers.Dense(8, activation="tanh", name="tanh")
        self.tanh_2 = layers.Dense(8, activation="tanh", name="tanh_2")
        self.no_bias = layers.Dense(8, activation="tanh", use_bias=False, name="no_bias")
        self.head = layers.Dense(1, name="head")

    def call(self, x):
        return self.head(self.no_bias(self.tanh_2(self.tanh(self.relu(x)))))


def test_outline_shares_bodies_only_between_layers_of_equal_config():
    x = _rand(8, 8)
    model = MixedDenseNet(name="mixed_dense")
    model(x)
    converted = kip.convert_to_functional(model, x)
    outlined = kip.apply_passes(converted, [Outline(layers.Dense)])
    np.testing.assert_allclose(outlined(x), model(x), atol=1e-6)
    bodies = outlined.kip_interpreter().effects["outline"].bodies
    # relu | tanh + tanh_2 | no_bias | head (another width)
    assert len(bodies) == 4
    kip.frontend.verify.equivalence.check_equivalent(model, outlined, x)


# -- Recompute lowers what a training step keeps for the backward pass --------
class WideBlock(layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.up = layers.Dense(128, activation="gelu", name="up")
        self.down = layers.Dense(32, name="down")

    def call(self, x):
        return x + self.down(self.up(x))


class WideTower(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.stem = layers.Dense(32, name="stem")
        self.blocks = [WideBlock(name=f"block_{i}") for i in range(6)]
        self.head = layers.Dense(1, name="head")

    def call(self, x):
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def kept_for_backward(model, batch=64, features=16):
    """Elements of the forward pass's tensors that the backward pass reads,
    in a traced training step: what stays in memory between the two.

    Deterministic (the graph, not a measurement): ops are recorded in
    creation order, so the ops made by `tape.gradient` come after the last
    forward op; a forward tensor that one of them reads is kept alive until
    the backward pass reaches it. Weights count the same with and without
    recomputation; activations are what recomputation drops.
    """
    first_backward = []

    @tf.function(autograph=False)
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(x, training=True) - y) ** 2)
        first_backward.append(len(tf.compat.v1.get_default_graph().get_operations()))
        return tape.gradient(loss, model.trainable_variables)

    graph = step.get_concrete_function(
        tf.TensorSpec((batch, features)), tf.TensorSpec((batch, 1))
    ).graph
    operations = graph.get_operations()
    forward = set(operations[: first_backward[0]])
    kept = {
        tensor.ref(): tensor
        for op in operations[first_backward[0]:]
        for tensor in op.inputs
        if tensor.op in forward and tensor.dtype.is_floating
    }
    return sum(int(np.prod(t.shape.as_list())) for t in kept.values())


def test_recompute_lowers_the_activations_kept_for_the_backward_pass():
    x = _rand(64, 16)
    model = WideTower(name="wide")
    model(x)
    converted = kip.convert_to_functional(model, x)
    recomputed = kip.apply_passes(
        converted, [Recompute(["block_1", "block_3", "block_5"])]
    )
    plain, checkpointed = kept_for_backward(converted), kept_for_backward(recomputed)
    # Each block keeps its 128-wide hidden activation (and its input) without
    # recomputation; between checkpoints only the segment inputs stay.
    assert checkpointed < 0.5 * plain, (plain, checkpointed)


def test_kept_activations_measure_sees_no_saving_without_checkpointing(monkeypatch):
    # The measure itself can tell: with segments run plainly it finds no
    # saving (so the test above fails when recomputation is disabled).
    x = _rand(64, 16)
    model = WideTower(name="wide")
    model(x)
    converted = kip.convert_to_functional(model, x)
    monkeypatch.setattr(backends.PortableBackend, "checkpoint_segment",
                        lambda self, fn, anchored=None: fn)
    recomputed = kip.apply_passes(
        converted, [Recompute(["block_1", "block_3", "block_5"])]
    )
    assert kept_for_backward(recomputed) >= kept_for_backward(converted)


# -- a pinned training reaches the sub-layers that follow it, through Expand --
class FollowingBlock(layers.Layer):
    """Its BatchNormalization follows the block's own `training`."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = layers.Dense(4, name="dense")
        self.bn = layers.BatchNormalization(name="bn")

    def call(self, x, training=None):
        return self.bn(self.dense(x), training=training)


class PinsItsBlock(keras.Model):
    """Calls a whole block in inference mode (a frozen feature extractor)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.block = FollowingBlock(name="block")
        self.head = layers.Dense(1, name="head")

    def call(self, x, training=None):
        return self.head(self.block(x, training=False))


@pytest.mark.parametrize("passes", [[Expand()], [Expand(), Recompute(["block.dense"])]],
                         ids=["expand", "expand_and_recompute"])
def test_block_pinned_to_inference_keeps_its_sub_layers_in_inference_after_expand(passes):
    x, y = _rand(16, 3) + 2.0, _rand(16, 1, seed=1)
    model = PinsItsBlock(name="pins")
    model(x)
    bn = model.block.bn
    statistics = _numpy(bn.non_trainable_variables)
    plugin = kip.PluginModel(model, passes=passes)
    plugin.convert(x)
    graph = plugin.converted.kip_graph
    assert graph.node("block.bn").training is False
    np.testing.assert_allclose(
        plugin.converted(x, training=True), model(x, training=False), atol=1e-6
    )
    plugin.compile(optimizer="sgd", loss="mse")
    plugin.fit(x, y, batch_size=8, epochs=1, verbose=0)
    for before, after in zip(statistics, _numpy(bn.non_trainable_variables)):
        np.testing.assert_array_equal(after, before)


# -- a model whose own call branches on training -----------------------------
class BranchingModel(keras.Model):
    """`if training:` in the model's own `call` (a Python branch)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = layers.Dense(8, name="dense")
        self.dropout = layers.Dropout(0.5, name="dropout")
        self.head = layers.Dense(1, name="head")

    def call(self, x, training=None):
        x = self.dense(x)
        if training:
            x = self.dropout(x)
        return self.head(x)


def _branching_twin():
    keras.utils.set_random_seed(7)
    model = BranchingModel(name="branching")
    model(_rand(2, 4))
    return model


def test_model_branching_on_training_converts_to_one_node_holding_both_modes():
    # A model whose own `call` branches on `training` in Python is one
    # `ModeSwitch` node holding the graph of each mode.
    x = _rand(16, 4)
    model = _branching_twin()
    converted = kip.convert_to_functional(model, x)
    nodes = converted.kip_graph.nodes
    assert len(nodes) == 1 and isinstance(nodes[0].operation, kip.ModeSwitch)
    assert not nodes[0].opaque_reason and not converted.kip_report.opaque
    branches = nodes[0].operation.branch_graphs
    assert [n.name for n in branches["training"].nodes] == ["dense", "dropout", "head"]
    assert [n.name for n in branches["inference"].nodes] == ["dense", "head"]
    np.testing.assert_allclose(converted(x, training=False), model(x, training=False))
    seed = model.dropout.seed_generator.state
    start = seed.numpy()
    expected = model(x, training=True)
    seed.assign(start)
    actual = converted(x, training=True)
    np.testing.assert_allclose(actual, expected, atol=1e-6)
    assert not np.allclose(actual, converted(x, training=False), atol=1e-3)  # dropout ran


def test_model_branching_on_training_trains_through_the_plugin_as_plain_keras():
    x, y = _rand(32, 4), _rand(32, 1, seed=1)
    results = []
    for wrap in (False, True):
        model = _branching_twin()
        trained = kip.PluginModel(model) if wrap else model
        trained.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
        trained.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
        results.append(_numpy(model.trainable_variables))
    for e, a in zip(*results):
        np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-6)


# -- losses added inside an outlined layer ------------------------------------
def test_losses_added_inside_outlined_layers_keep_their_value_and_gradient():
    x = _rand(8, 8)
    model = RegularizedTower(depth=3, name="regularized")
    model(x)
    converted = kip.convert_to_functional(model, x)
    outlined = kip.apply_passes(converted, [Outline(RegularizedBlock)])

    def loss_and_gradients(net):
        @tf.function
        def step():
            with tf.GradientTape() as tape:
                prediction = net(x, training=True)
                regularization = tf.add_n(net.losses)
                loss = tf.reduce_mean(prediction ** 2) + regularization
            return regularization, tape.gradient(loss, model.trainable_variables)

        return step()

    expected_loss, expected = loss_and_gradients(converted)
    actual_loss, actual = loss_and_gradients(outlined)
    assert len(outlined.kip_interpreter().effects["outline"].bodies) == 1
    np.testing.assert_allclose(actual_loss, expected_loss, rtol=1e-6)
    for variable, e, a in zip(model.trainable_variables, expected, actual):
        np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-6, err_msg=variable.path)


# -- an outlined body follows the training mode --------------------------------
class ContextDropoutBlock(layers.Layer):
    """`call` takes no `training`: its Dropout reads it from the context."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = layers.Dense(8, name="dense")
        self.dropout = layers.Dropout(0.5, name="dropout")

    def call(self, x):
        return x + self.dropout(self.dense(x))


class ContextDropoutTower(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.blocks = [ContextDropoutBlock(name=f"block_{i}") for i in range(2)]
        self.head = layers.Dense(1, name="head")

    def call(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def test_outlined_body_traced_in_training_is_not_reused_in_inference():
    x = _rand(16, 8)
    model = ContextDropoutTower(name="context_dropout")
    model(x)
    converted = kip.convert_to_functional(model, x)
    outlined = kip.apply_passes(converted, [Outline(ContextDropoutBlock)])
    in_training = outlined(x, training=True)  # traces the shared body first
    assert not np.allclose(in_training, model(x, training=False), atol=1e-4)
    np.testing.assert_allclose(outlined(x, training=False), model(x, training=False), atol=1e-6)
