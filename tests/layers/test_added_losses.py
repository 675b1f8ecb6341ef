"""Losses a layer's `call` adds (`self.add_loss(...)`) as graph nodes.

keras.io's VQ-VAE quantizer and the Switch Transformer's router add a loss
in `call`. Traced, the loss is an `AddedLoss` node (`layers/state.py`,
`frontend/trace/trace_views.py`): the layer expands, the graph's model holds the same
loss after a call as the original (`model.losses`), verification compares
those losses and their gradients, and training adds them as plain Keras
does: `fit` of the graph's model itself, `PluginModel`, `PluginCallback`,
with Expand and Recompute, and a `train_step` reading a sub-model's
`losses`. A loss the graph cannot hold keeps the layer whole, saying why.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras import layers
from keras import ops

import keras_ipu_plugin as kip
from keras_ipu_plugin.errors import ConversionError
from keras_ipu_plugin.frontend.verify.equivalence import check_equivalent
from keras_ipu_plugin.passes import Expand
from keras_ipu_plugin.passes import Recompute
from keras_ipu_plugin.layers.state import AddedLoss

from graph_checks import all_nodes


def _rand(*shape, seed=0):
    return np.random.RandomState(seed).normal(size=shape).astype("float32")


class Commitment(layers.Layer):
    """VQ-VAE's pattern: a loss on the inputs and a sub-layer's output, one
    side held fixed, added in `call`."""

    def __init__(self, beta=0.25, **kwargs):
        super().__init__(**kwargs)
        self.beta = beta
        self.project = layers.Dense(4, name="project")

    def call(self, x):
        h = self.project(x)
        self.add_loss(self.beta * ops.mean((ops.stop_gradient(h) - x) ** 2)
                      + ops.mean((h - ops.stop_gradient(x)) ** 2))
        return x + ops.stop_gradient(h - x)


class Net(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.embed = layers.Dense(4, name="embed")
        self.commitment = Commitment(name="commitment")
        self.head = layers.Dense(1, name="head")

    def call(self, x):
        return self.head(self.commitment(self.embed(x)))


def _net(x, seed=1):
    keras.utils.set_random_seed(seed)
    model = Net(name="net")
    model(x)
    return model


def _loss_values(model):
    return [float(loss) for loss in model.losses]


def test_an_added_loss_is_a_graph_node_and_the_graph_holds_the_originals_loss():
    x = _rand(8, 4)
    model = _net(x)
    passed = kip.apply_passes(kip.convert_to_functional(model, x), [Expand("all")])
    assert passed.kip_report.opaque == {}
    added = [node for node in passed.kip_graph.nodes if isinstance(node.operation, AddedLoss)]
    assert [node.name for node in added] == ["commitment.add_loss"]
    model(x)
    expected = _loss_values(model)
    passed(x)
    passed(x)  # a second call replaces the first call's loss, as in Keras
    assert len(expected) == 1
    np.testing.assert_allclose(_loss_values(passed), expected, rtol=1e-6)


def test_blocks_of_one_kind_each_add_their_own_loss():
    """Blocks traced once and replayed over the others (`replay.py`) must
    not share one loss node: each block's loss is its own."""

    class Blocks(keras.Model):
        def __init__(self):
            super().__init__()
            self.blocks = [Commitment(name=f"c{i}") for i in range(3)]
            self.head = layers.Dense(1)

        def call(self, x):
            for block in self.blocks:
                x = block(x)
            return self.head(x)

    x = _rand(8, 4)
    model = Blocks()
    model(x)
    passed = kip.apply_passes(kip.convert_to_functional(model, x), [Expand("all")])
    assert [node.name for node in passed.kip_graph.nodes if isinstance(node.operation, AddedLoss)
            ] == ["blocks.0.add_loss", "blocks.1.add_loss", "blocks.2.add_loss"]
    model(x)
    passed(x)
    np.testing.assert_allclose(_loss_values(passed), _loss_values(model), rtol=1e-6)


def test_a_loss_added_in_the_model_s_own_call_is_a_node_of_the_converted_graph():
    class AddsItsOwn(keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = layers.Dense(3)

        def call(self, x):
            y = self.dense(x)
            self.add_loss(0.1 * ops.sum(y ** 2))
            return y

    x = _rand(6, 3)
    model = AddsItsOwn()
    model(x)
    converted = kip.convert_to_functional(model, x)
    assert any(isinstance(node.operation, AddedLoss) for node in converted.kip_graph.nodes)
    model(x)
    converted(x)
    np.testing.assert_allclose(_loss_values(converted), _loss_values(model), rtol=1e-6)


def _fit(how, x, y, steps_per_epoch=2):
    model = _net(x)
    trainee, callbacks = model, []
    if how == "plugin_model":
        trainee = kip.PluginModel(model, passes=[Expand("all")])
    elif how == "plugin_recompute":
        trainee = kip.PluginModel(model, passes=[Expand("all"), Recompute(layers.Dense)])
    elif how == "plugin_callback":
        callbacks = [kip.PluginCallback(passes=[Expand("all")])]
    elif how == "converted":
        trainee = kip.apply_passes(kip.convert_to_functional(model, x), [Expand("all")])
    trainee.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    history = trainee.fit(x, y, batch_size=len(x) // steps_per_epoch, epochs=2, verbose=0,
                          shuffle=False, callbacks=callbacks)
    return history.history["loss"], [np.array(v) for v in model.trainable_variables]


@pytest.mark.parametrize("how", ["converted", "plugin_model", "plugin_callback",
                                 "plugin_recompute"])
def test_training_with_an_added_loss_equals_plain_keras(how):
    x, y = _rand(16, 4), _rand(16, 1, seed=2)
    plain_losses, plain_weights = _fit("plain", x, y)
    losses, weights = _fit(how, x, y)
    np.testing.assert_allclose(losses, plain_losses, rtol=1e-5)
    for expected, actual in zip(plain_weights, weights):
        np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-6)


class Trainer(keras.Model):
    """VQ-VAE's `VQVAETrainer`: a `train_step` adding a sub-model's
    `losses` to its own loss."""

    def __init__(self, x, **kwargs):
        super().__init__(**kwargs)
        inputs = keras.Input(x.shape[1:])
        self.inner = keras.Model(inputs, Net(name="net")(inputs), name="inner")

    def call(self, x):
        return self.inner(x)

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            prediction = self.inner(x)
            total = ops.mean((prediction - y) ** 2) + sum(self.inner.losses)
        variables = self.inner.trainable_variables
        self.optimizer.apply_gradients(zip(tape.gradient(total, variables), variables))
        # read again after the backward pass (VQ-VAE's trainer logs them so),
        # which a recomputed segment's second run must leave as they were
        return {"loss": total, "added": sum(self.inner.losses)}


@pytest.mark.parametrize("recompute", [False, True], ids=["expand", "expand_recompute"])
def test_a_train_step_reading_a_sub_model_s_losses_trains_as_plain_keras(recompute):
    x, y = _rand(16, 4), _rand(16, 1, seed=2)
    passes = [Expand("all")] + ([Recompute(layers.Dense)] if recompute else [])

    def fit(wrap):
        keras.utils.set_random_seed(3)
        model = Trainer(x, name="trainer")
        model(x)
        trainee = kip.PluginModel(model, passes=passes) if wrap else model
        trainee.compile(optimizer=keras.optimizers.SGD(0.1))
        history = trainee.fit(x, y, batch_size=8, epochs=2, verbose=0, shuffle=False)
        return ([history.history["loss"], history.history["added"]],
                [np.array(v) for v in model.trainable_variables])

    (plain_losses, plain_weights), (losses, weights) = fit(False), fit(True)
    np.testing.assert_allclose(losses, plain_losses, rtol=1e-5)
    for expected, actual in zip(plain_weights, weights):
        np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-6)


def test_a_saved_graph_with_an_added_loss_loads_and_adds_it(tmp_path):
    x = _rand(8, 4)
    model = _net(x)
    passed = kip.apply_passes(kip.convert_to_functional(model, x), [Expand("all")])
    passed.save(tmp_path / "losses.keras")
    loaded = keras.models.load_model(tmp_path / "losses.keras", custom_objects={"Net": Net})
    passed(x)
    loaded(x)
    np.testing.assert_allclose(_loss_values(loaded), _loss_values(passed), rtol=1e-6)


def test_verification_compares_the_losses_the_call_adds():
    x = _rand(8, 4)
    model = _net(x)

    class NoLoss(keras.Model):
        def __init__(self, net):
            super().__init__()
            self.net = net

        def call(self, x):  # the outputs of `net`, without its loss
            h = self.net.embed(x)
            h = h + ops.stop_gradient(self.net.commitment.project(h) - h)
            return self.net.head(h)

    with pytest.raises(ConversionError, match="adds losses in its call"):
        check_equivalent(model, NoLoss(model), x)

    class OtherLoss(NoLoss):
        def call(self, x):
            self.add_loss(ops.sum(x) * 0 + 1.0)
            return super().call(x)

    with pytest.raises(ConversionError, match="losses the call adds"):
        check_equivalent(model, OtherLoss(model), x)


class LossInABranch(layers.Layer):
    def call(self, x):
        return ops.cond(ops.mean(x) > 0, lambda: self._adding(x), lambda: x)

    def _adding(self, x):
        self.add_loss(ops.mean(x ** 2))
        return x * 2.0


def test_a_loss_added_inside_a_branch_keeps_the_layer_whole_saying_what_to_write():
    x = np.abs(_rand(8, 4)) + 0.1
    inputs = keras.Input((4,))
    model = keras.Model(inputs, layers.Dense(1)(LossInABranch(name="branch")(inputs)))
    passed = kip.apply_passes(kip.convert_to_functional(model, x), [Expand("all")])
    reason = passed.kip_report.opaque["branch"]
    assert "inside a branch or a loop" in reason and "ops.where" in reason


class LossInTraining(layers.Layer):
    """A router's auxiliary loss, added in training only (`if training:`)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.route = layers.Dense(4, name="route")

    def call(self, x, training=None):
        logits = self.route(x)
        if training:
            self.add_loss(0.01 * ops.mean(ops.softmax(logits) ** 2))
        return x * ops.softmax(logits)


def test_a_loss_added_in_training_only_is_held_by_the_training_mode():
    x, y = _rand(16, 4), _rand(16, 4, seed=2)

    def fit(wrap):
        keras.utils.set_random_seed(5)
        inputs = keras.Input((4,))
        model = keras.Model(inputs, LossInTraining(name="router")(layers.Dense(4)(inputs)))
        trainee = kip.PluginModel(model, passes=[Expand("all")]) if wrap else model
        trainee.compile(optimizer=keras.optimizers.SGD(0.5), loss="mse")
        history = trainee.fit(x, y, batch_size=8, epochs=2, verbose=0, shuffle=False)
        return history.history["loss"], [np.array(v) for v in model.trainable_variables], trainee

    (plain_losses, plain_weights, _), (losses, weights, plugin) = fit(False), fit(True)
    assert plugin.kip_report.opaque == {}
    np.testing.assert_allclose(losses, plain_losses, rtol=1e-5)
    for expected, actual in zip(plain_weights, weights):
        np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-6)
    converted = plugin.converted
    converted(x, training=True)
    assert len(converted.losses) == 1
    converted(x, training=False)  # the inference mode adds none, as the original
    assert converted.losses == []


# -- the Switch Transformer written as its reason says -----------------------------
def _switch_written_with_minus_one():
    """keras.io's Switch Transformer `Switch` (tests/zoo/switch_transformer.py)
    with its token reshape written as `-1`, as the reason it stays whole
    says to write: its router adds a loss, draws noise in training with
    `tf.random.uniform(router_logits.shape)` (the batch size None while
    traced) and dispatches with `tf.einsum`; all of it expands."""
    from zoo import switch_transformer as zoo

    class Switch(zoo.Switch):
        def call(self, inputs):
            batch_size = tf.shape(inputs)[0]
            num_tokens_per_example = tf.shape(inputs)[1]
            inputs = tf.reshape(inputs, [-1, self.embed_dim])
            dispatch_tensor, combine_tensor = self.router(inputs)
            expert_inputs = tf.einsum("ab,acd->cdb", inputs, dispatch_tensor)
            expert_inputs = tf.reshape(
                expert_inputs, [self.num_experts, self.expert_capacity, self.embed_dim])
            expert_outputs = tf.stack(
                [expert(part) for expert, part in
                 zip(self.experts, tf.unstack(expert_inputs, axis=0))], axis=1)
            combined = tf.einsum("abc,xba->xc", expert_outputs, combine_tensor)
            return tf.reshape(combined, [batch_size, num_tokens_per_example, self.embed_dim])

    keras.utils.set_random_seed(7)
    switch = Switch(zoo.EXPERTS, zoo.EMBED, zoo.NUM_TOKENS_PER_BATCH, name="switch")
    inputs = keras.Input((zoo.TOKENS, zoo.EMBED))
    outputs = layers.Dense(2)(layers.GlobalAveragePooling1D()(switch(inputs)))
    return keras.Model(inputs, outputs, name="switch_model")


def test_the_switch_transformer_written_with_minus_one_expands_and_trains_as_plain_keras():
    x = _rand(4, 4, 8)
    y = np.random.RandomState(3).randint(0, 2, size=(4,)).astype("int32")
    model = _switch_written_with_minus_one()
    passed = kip.apply_passes(kip.convert_to_functional(model, x), [Expand("all")])
    assert passed.kip_report.opaque == {}, passed.kip_report.opaque
    kinds = {type(node.operation).__name__ for node in all_nodes(passed.kip_graph)}
    assert {"AddedLoss", "TFRandomDraw"} <= kinds

    def fit(wrap):
        trained = _switch_written_with_minus_one()
        trainee = kip.PluginModel(trained, passes=[Expand("all")]) if wrap else trained
        trainee.compile(optimizer=keras.optimizers.SGD(0.1),
                        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        keras.utils.set_random_seed(11)
        history = trainee.fit(x, y, batch_size=4, epochs=3, verbose=0, shuffle=False)
        return history.history["loss"], [np.array(v) for v in trained.trainable_variables]

    (plain_losses, plain_weights), (losses, weights) = fit(False), fit(True)
    np.testing.assert_allclose(losses, plain_losses, rtol=1e-5)
    for expected, actual in zip(plain_weights, weights):
        np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-6)
