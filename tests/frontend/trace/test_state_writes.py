"""A `call` that writes a variable keeps its write.

keras.io's PixelCNN masks its kernel on every call
(`self.conv.kernel.assign(self.conv.kernel * self.mask)`, then
`self.conv(inputs)`). Tracing runs that assign once, eagerly, and the graph
of the layer's sub-layers holds only the Conv2D: `Expand("all")` lost the
write, verification passed (the kernel was already masked on the first
batch), and three training steps later the weights differed from plain
Keras. A layer whose `call` writes a variable was then kept whole, with the
reason, and verification compares the variables a call changes. Now
the write is a graph node (`VariableWrite`, see
tests/layers/test_variable_write_nodes.py): the PixelCNN expands and still trains
as plain Keras.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_ipu_plugin as kip
from keras_ipu_plugin.passes import Expand
from keras_ipu_plugin.passes import Recompute
from models import DecaysAfterUse
from models import PixelCNN

layers, ops = keras.layers, keras.ops


def _images(n=24):
    rng = np.random.RandomState(0)
    return rng.rand(n, 6, 6, 1).astype("float32"), rng.rand(n, 6, 6, 1).astype("float32")


def _pixel_cnn():
    keras.utils.set_random_seed(3)
    model = PixelCNN(name="pixel_cnn")
    model(_images(2)[0])
    return model


def _weights(model):
    # By position: a second model of the class has other layer names.
    return {f"{i}:{v.name}": v.numpy() for i, v in enumerate(model.weights)}


def _plain_weights(x, y, steps=3):
    model = _pixel_cnn()
    model.compile(optimizer=keras.optimizers.SGD(0.5), loss="mse")
    model.fit(x, y, batch_size=len(x) // steps, epochs=1, shuffle=False, verbose=0)
    return _weights(model)


def _assert_same_weights(actual, expected):
    assert actual.keys() == expected.keys()
    for path, value in expected.items():
        np.testing.assert_allclose(actual[path], value, rtol=0, atol=1e-6,
                                   err_msg=f"weight {path} differs from plain Keras")


def test_pixel_cnn_expanded_trains_as_plain_keras_with_its_writes_as_nodes():
    x, y = _images()
    expected = _plain_weights(x, y)
    model = _pixel_cnn()
    converted = kip.convert_to_functional(model, x[:8])
    passed = kip.apply_passes(converted, [Expand("all")])
    assert passed.kip_report.opaque == {}
    for name in ("first", "second"):
        write = passed.kip_graph.node(f"{name}.conv.kernel.assign").operation
        assert write.variable is getattr(model, name).conv.kernel
    passed.compile(optimizer=keras.optimizers.SGD(0.5), loss="mse")
    passed.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    _assert_same_weights(_weights(model), expected)


def test_pixel_cnn_through_plugin_model_with_expand_trains_as_plain_keras():
    x, y = _images()
    expected = _plain_weights(x, y)
    model = _pixel_cnn()
    plugin = kip.PluginModel(model, passes=[Expand("all")])
    plugin.compile(optimizer=keras.optimizers.SGD(0.5), loss="mse")
    plugin.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    assert plugin.kip_report.opaque == {}
    _assert_same_weights(_weights(model), expected)


class CountsInATFVariable(layers.Layer):
    """Counts its calls in a raw `tf.Variable` it holds."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = layers.Dense(3)
        self.calls = tf.Variable(0.0, trainable=False)

    def call(self, x):
        self.calls.assign_add(1.0)
        return self.dense(x)


class WritesFromItsInputs(layers.Layer):
    """Writes a sub-layer's variable with a value computed from the inputs."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = layers.Dense(3)

    def call(self, x):
        y = self.dense(x)
        self.dense.bias.assign(ops.add(self.dense.bias, 0.0 * ops.mean(y, axis=0)))
        return y


class Holder(keras.Model):
    def __init__(self, block, **kwargs):
        super().__init__(**kwargs)
        self.block = block
        self.head = layers.Dense(1)

    def call(self, x):
        return self.head(self.block(x))


def test_a_write_computed_from_the_inputs_is_a_node_of_the_graph():
    x = np.random.RandomState(1).rand(8, 4).astype("float32")
    model = Holder(WritesFromItsInputs(name="counter"), name="holder")
    model(x)
    passed = kip.apply_passes(kip.convert_to_functional(model, x), [Expand("all")])
    assert passed.kip_report.opaque == {}
    assert passed.kip_graph.node("block.dense.bias.assign").operation.variable is \
        model.block.dense.bias


@pytest.mark.parametrize("block, expected", [
    (CountsInATFVariable, ["`counter.calls` (`assign_add`)"]),
], ids=["tf_variable"])
def test_a_write_the_graph_would_lose_keeps_the_layer_whole_naming_the_variable(block, expected):
    x = np.random.RandomState(1).rand(8, 4).astype("float32")
    model = Holder(block(name="counter"), name="holder")
    model(x)
    passed = kip.apply_passes(kip.convert_to_functional(model, x), [Expand("all")])
    reason = passed.kip_report.opaque.get("block", "")  # by its attribute path
    assert "writes the variable" in reason, passed.kip_report.opaque
    for part in expected:
        assert part in reason, reason
    if block is CountsInATFVariable:
        before = float(model.block.calls.numpy())
        passed(x)
        assert float(model.block.calls.numpy()) == before + 1


# -- verification compares what a call writes ---------------------------------------
class CountsInASubLayer(layers.Layer):
    """Counts its calls in a non-trainable variable of a sub-layer."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = layers.Dense(3)

    def build(self, shape):
        self.dense.build(shape)
        self.tally = layers.Layer(name="tally")
        self.tally.count = self.tally.add_weight(
            shape=(), initializer="zeros", trainable=False, name="count")

    def call(self, x):
        self.tally.count.assign_add(1.0)
        return self.dense(x)


@kip.passes.register_pass("test_drop_writes")
class DropsTheWrite(kip.passes.Pass):
    """A wrong pass, made for this test: runs the block's Dense in place of
    the block, so the block's write is gone."""

    step = "drop_writes"

    def run(self, graph, report):
        graph = graph.copy()
        node = graph.node("block")
        node.operation = node.operation.dense
        return graph

    def get_config(self):
        return {}


@pytest.mark.parametrize("block, variable", [
    (DecaysAfterUse, "holder/block/dense/kernel"),
    (CountsInASubLayer, "tally/count"),
], ids=["trainable", "non_trainable"])
def test_verification_refuses_a_pass_that_drops_a_write_naming_the_variable(block, variable):
    x = np.random.RandomState(2).rand(8, 4).astype("float32")
    model = Holder(block(name="block"), name="holder")
    model(x)
    converted = kip.convert_to_functional(model, x)
    assert "block" not in converted.kip_report.opaque  # the block is a node: it keeps its write
    before = _weights(model)
    with pytest.raises(kip.PassError, match=f"writes variable `[^`]*{variable}`"):
        kip.apply_passes(converted, [DropsTheWrite()])
    # Verifying put back what the runs wrote, the kernel included.
    _assert_same_weights(_weights(model), before)
    passed = kip.apply_passes(converted, [DropsTheWrite()], verify=False)
    assert passed is not None


def test_verification_compares_the_value_a_call_writes():
    """Both models write the variable, but not the same value: refused,
    naming it."""
    x = np.random.RandomState(2).rand(8, 4).astype("float32")
    model = Holder(DecaysAfterUse(name="block"), name="holder")
    model(x)
    converted = kip.convert_to_functional(model, x)

    @kip.passes.register_pass("test_decay_more")
    class DecaysMore(DropsTheWrite):
        def run(self, graph, report):
            graph = graph.copy()
            node = graph.node("block")
            node.operation = DecaysMoreAfterUse(node.operation)
            return graph

    with pytest.raises(kip.PassError, match=r"variable `holder/block/dense/kernel` \(layer `holder/block/dense`\) after the call differs"):
        kip.apply_passes(converted, [DecaysMore()])


class DecaysMoreAfterUse(layers.Layer):
    def __init__(self, block, **kwargs):
        super().__init__(name="block", **kwargs)
        self.block = block

    def call(self, x):
        y = self.block.dense(x)
        self.block.dense.kernel.assign(self.block.dense.kernel * 0.25)
        return y


class SetsItsBiasFromItsInputs(layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = layers.Dense(3)

    def call(self, x):
        y = self.dense(x)
        self.dense.bias.assign(ops.mean(y, axis=0))
        return self.dense(x)


def test_a_call_writing_a_trainable_variable_from_its_inputs_verifies_from_the_same_state():
    """Each run starts from the same trainable values: a block writing a
    bias from its inputs is verified (it was refused as "nondeterministic"),
    and verifying leaves the bias as it was."""
    x = np.random.RandomState(2).rand(8, 4).astype("float32")
    model = Holder(SetsItsBiasFromItsInputs(name="block"), name="holder")
    model(x)
    before = _weights(model)
    converted = kip.convert_to_functional(model, x)
    assert "written by the call compared" in str(converted.kip_report)
    _assert_same_weights(_weights(model), before)


# -- Recompute -----------------------------------------------------------------------
@pytest.mark.parametrize("passes", [
    lambda: [Recompute(["first", "second"])],
    lambda: [Expand("all"), Recompute(["first", "second"])],
], ids=["recompute", "expand_recompute"])
def test_pixel_cnn_recomputed_trains_as_plain_keras(passes):
    """Recompute was refused with a gradient mismatch naming no cause: the
    masking layers ran inside a segment's stateless scope, whose write never
    reached the kernel and whose conv was differentiated through the mask.
    A layer seen writing runs outside segments, as BatchNormalization does."""
    x, y = _images()
    expected = _plain_weights(x, y)
    model = _pixel_cnn()
    passed = kip.apply_passes(kip.convert_to_functional(model, x[:8]), passes())
    passed.compile(optimizer=keras.optimizers.SGD(0.5), loss="mse")
    passed.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    _assert_same_weights(_weights(model), expected)


class UnseenMaskedDense(layers.Layer):
    """Masks its Dense's kernel on every call, as PixelCNN's layer does; used
    only in a functional model, whose layers no trace runs."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = layers.Dense(3)

    def build(self, shape):
        self.dense.build(shape)
        self.mask = np.tril(np.ones((shape[-1], 3), "float32"))

    def call(self, x):
        self.dense.kernel.assign(self.dense.kernel * self.mask)
        return self.dense(x)


def test_recompute_of_a_layer_writing_a_variable_names_the_write():
    inputs = keras.Input((4,))
    hidden = UnseenMaskedDense(name="masked")(inputs)
    model = keras.Model(inputs, layers.Dense(1, name="head")(layers.Dense(5, name="mid")(hidden)))
    with pytest.raises(kip.PassError, match="`masked` writes variable `[^`]*masked/dense/kernel`"):
        kip.apply_passes(model, [Recompute(["masked", "mid"])])
