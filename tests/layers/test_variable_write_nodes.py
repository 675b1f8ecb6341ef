"""Variable writes in `call` are graph nodes.

keras.io's PixelCNN (https://keras.io/examples/generative/pixelcnn/) masks
its kernel on every call, `self.conv.kernel.assign(self.conv.kernel *
self.mask)`, and then calls the conv; an EMA shadow or running statistic is
`self.shadow.assign(decay * self.shadow + (1 - decay) * stat)`; a counter
`self.count.assign_add(1)`. These layers were kept whole. The write is now
a `VariableWrite` node, ordered by data dependencies (`AfterWrites`), so
Expand reaches inside, Recompute keeps the write out of recomputed
segments, and training equals plain Keras.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_ipu_plugin as kip
from keras_ipu_plugin.passes import Expand
from keras_ipu_plugin.passes import Recompute
from keras_ipu_plugin.layers.state import AfterWrites
from keras_ipu_plugin.layers.state import VariableWrite
from models import DecaysAfterUse
from models import PixelCNN
from models import PixelConvLayer

layers, ops = keras.layers, keras.ops


class ShadowAndCount(layers.Layer):
    """An EMA shadow of its conv's mean output (as keras.io's VQ-VAE-EMA
    style codebooks keep theirs) and a step counter, both written in `call`."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.conv = layers.Conv2D(2, 3, padding="same")

    def build(self, shape):
        self.conv.build(shape)
        self.shadow = self.add_weight(shape=(2,), initializer="zeros", trainable=False,
                                      name="shadow")
        self.count = self.add_weight(shape=(), initializer="zeros", trainable=False,
                                     name="count")

    def call(self, x):
        y = self.conv(x)
        self.shadow.assign(0.9 * self.shadow + 0.1 * ops.mean(y, axis=(0, 1, 2)))
        self.count.assign_add(1.0)
        return y + self.shadow  # reads the shadow after its write


class EMAModel(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.block = ShadowAndCount(name="block")
        self.head = layers.Conv2D(1, 1, name="head")

    def call(self, x):
        return self.head(self.block(x))


def _images(n=24):
    rng = np.random.RandomState(0)
    return rng.rand(n, 6, 6, 1).astype("float32"), rng.rand(n, 6, 6, 1).astype("float32")


def _built(cls):
    keras.utils.set_random_seed(3)
    model = cls(name=cls.__name__.lower())
    model(_images(2)[0])
    return model


def _weights(model):
    return {f"{i}:{v.name}": v.numpy() for i, v in enumerate(model.weights)}


def _fit(model, x, y):
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)  # 3 steps


def _assert_same_weights(actual, expected):
    assert actual.keys() == expected.keys()
    for path, value in expected.items():
        np.testing.assert_allclose(actual[path], value, rtol=1e-5, atol=1e-6,
                                   err_msg=f"weight {path} differs from plain Keras")


def _kinds(graph):
    return {node.name: type(node.operation).__name__ for node in graph.nodes}


def test_pixel_cnn_expands_with_its_kernel_writes_as_nodes_ordered_before_the_conv():
    model = _built(PixelCNN)
    passed = kip.apply_passes(kip.convert_to_functional(model, _images(8)[0]), [Expand("all")])
    assert passed.kip_report.opaque == {}
    graph = passed.kip_graph
    kinds = _kinds(graph)
    write = graph.node("first.conv.kernel.assign")
    assert kinds["first.conv.kernel"] == "VariableRead"
    assert write.operation.variable is model.first.conv.kernel
    assert write.operation.method == "assign"
    # the write's value is the read times the mask; the conv runs on its
    # input passed through an AfterWrites node on the write
    conv = graph.node("first.conv")
    gate = conv.args[0].producer
    assert isinstance(gate.operation, AfterWrites)
    assert write.outputs[0] in gate.input_values
    value = write.args[0].producer
    assert graph.node("first.conv.kernel").outputs[0] in value.input_values


@pytest.mark.parametrize("passes", [
    lambda: [Expand("all")],
    lambda: [Recompute(auto=True)],
    lambda: [Expand("all"), Recompute(auto=True)],
], ids=["expand", "recompute_auto", "expand_recompute_auto"])
@pytest.mark.parametrize("cls", [PixelCNN, EMAModel], ids=["pixel_cnn", "ema_counter"])
def test_plugin_model_trains_three_adam_steps_as_plain_keras(cls, passes):
    x, y = _images()
    plain = _built(cls)
    _fit(plain, x, y)
    model = _built(cls)
    plugin = kip.PluginModel(model, passes=passes())
    _fit(plugin, x, y)
    assert plugin.kip_report.opaque == {}
    _assert_same_weights(_weights(model), _weights(plain))
    if cls is EMAModel:
        # one call built it, then three steps
        assert float(model.block.count.numpy()) == float(plain.block.count.numpy()) == 4.0
        assert any(isinstance(node.operation, VariableWrite)
                   for node in plugin.converted.kip_graph.nodes) == (
            isinstance(passes()[0], Expand))


def test_the_written_value_is_seen_by_later_reads_and_writes_come_once_per_call():
    x = _images(8)[0]
    model = _built(EMAModel)
    passed = kip.apply_passes(kip.convert_to_functional(model, x), [Expand("all")])
    graph = passed.kip_graph
    assert _kinds(graph)["block.shadow.assign"] == "VariableWrite"
    assert _kinds(graph)["block.count.assign_add"] == "VariableWrite"
    # `y + self.shadow` adds the write's output, not the read before it
    add = graph.node("block.add_1")
    assert graph.node("block.shadow.assign").outputs[0] in add.input_values
    # the counter nothing reads is still before the output
    for training in (False, True):
        before = float(model.block.count.numpy())
        expected_shadow = 0.9 * model.block.shadow.numpy() + 0.1 * np.mean(
            model.block.conv(x).numpy(), axis=(0, 1, 2))
        passed(x, training=training)
        assert float(model.block.count.numpy()) == before + 1
        np.testing.assert_allclose(model.block.shadow.numpy(), expected_shadow, rtol=1e-5)


class ReadThenWrite(layers.Layer):
    """Uses its scale, then overwrites it with a value that does not depend
    on the read, then uses it again: the first use must see the old value."""

    def build(self, shape):
        self.scale = self.add_weight(shape=(shape[-1],), initializer="ones", name="scale")
        self.step = self.add_weight(shape=(), initializer="zeros", trainable=False, name="step")

    def call(self, x):
        before = x * self.scale
        self.scale.assign(ops.ones_like(self.scale) * 2.0)
        return before + x * self.scale


class Holder(keras.Model):
    def __init__(self, block, **kwargs):
        super().__init__(**kwargs)
        self.block = block
        self.head = layers.Dense(1)

    def call(self, x):
        return self.head(self.block(x))


@pytest.mark.parametrize("block", [ReadThenWrite, DecaysAfterUse])
def test_a_write_after_a_read_comes_after_it(block):
    x = np.random.RandomState(1).rand(8, 4).astype("float32")
    model = Holder(block(name="block"), name="holder")
    model(x)
    passed = kip.apply_passes(kip.convert_to_functional(model, x), [Expand("all")])
    assert passed.kip_report.opaque == {}
    graph = passed.kip_graph
    write = next(n for n in graph.nodes if isinstance(n.operation, VariableWrite))
    earlier = graph.node("block.scale" if block is ReadThenWrite else "block.dense")
    assert earlier.outputs[0] in write.kwargs["after"]
    twin = Holder(block(name="block"), name="holder")
    twin(x)
    twin.set_weights(model.get_weights())
    for _ in range(2):  # each call writes; the second sees the first's write
        np.testing.assert_allclose(passed(x), twin(x), rtol=1e-5, atol=1e-6)
        for a, b in zip(model.weights, twin.weights):
            np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-6, err_msg=a.path)


class CountsInATFVariable(layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = layers.Dense(3)
        self.calls = tf.Variable(0.0, trainable=False)

    def call(self, x):
        self.calls.assign_add(1.0)
        return self.dense(x)


GLOBAL_STEP = keras.Variable(0.0, trainable=False, name="global_step")


class CountsInAGlobal(layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = layers.Dense(3)

    def call(self, x):
        GLOBAL_STEP.assign_add(1.0)
        return self.dense(x)


class RemembersTheBatch(layers.Layer):
    def build(self, shape):
        self.last = self.add_weight(shape=(8, shape[-1]), initializer="zeros",
                                    trainable=False, name="last")

    def call(self, x):
        self.last.assign(x)
        return x * 2.0


class CountsWhenPositive(layers.Layer):
    def build(self, shape):
        self.count = self.add_weight(shape=(), initializer="zeros", trainable=False,
                                     name="count")

    def call(self, x):
        ops.cond(ops.mean(x) > 0, lambda: self.count.assign_add(1.0), lambda: self.count)
        return x * 2.0


class ResetsToAnEagerTensor(layers.Layer):
    """Writes a tensor computed eagerly while traced (here a fixed one; a
    `tf.random.uniform((4,))` would be a new draw each call, which a graph
    holding the traced value would lose)."""

    def build(self, shape):
        self.noise = self.add_weight(shape=(4,), initializer="zeros", trainable=False,
                                     name="noise")

    def call(self, x):
        self.noise.assign(tf.fill((4,), 0.5))
        return x + self.noise


@pytest.mark.parametrize("block, expected", [
    (CountsInATFVariable, ["`counter.calls` (`assign_add`)", "self.add_weight"]),
    (CountsInAGlobal, ["not held by the layer", "`assign", "self.add_weight"]),
    (RemembersTheBatch, ["`holder/counter/last` (`assign`)", "shape (None, 4)",
                         "static_batch=True"]),
    (CountsWhenPositive, ["`holder/counter/count` (`assign_add`)", "inside a branch",
                          "ops.where"]),
    (ResetsToAnEagerTensor, ["`holder/counter/noise` (`assign`)", "outside the graph",
                     "seed generator"]),
], ids=["tf_variable", "unowned", "batch_sized_value", "under_cond", "eager_value"])
def test_a_write_that_cannot_be_recorded_keeps_the_layer_whole_naming_it(block, expected):
    x = np.random.RandomState(1).rand(8, 4).astype("float32")
    model = Holder(block(name="counter"), name="holder")
    model(x)
    passed = kip.apply_passes(kip.convert_to_functional(model, x), [Expand("all")])
    reason = passed.kip_report.opaque.get("block", "")
    assert reason, passed.kip_report.opaque
    for part in expected:
        assert part in reason, reason
    assert passed.kip_graph.node("block").operation is model.block


@pytest.mark.parametrize("cls", [PixelCNN, EMAModel], ids=["pixel_cnn", "ema_counter"])
def test_saved_and_loaded_the_written_variable_is_one_variable_and_trains_the_same(cls, tmp_path):
    x, y = _images()
    model = _built(cls)
    passed = kip.apply_passes(kip.convert_to_functional(model, x[:8]), [Expand("all")])
    passed.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras")
    assert len(loaded.weights) == len(passed.weights)
    for layer in loaded.layers:
        if isinstance(layer, VariableWrite):
            holders = [other for other in loaded.layers if other is not layer and any(
                v is layer.variable for v in other.weights)]
            assert holders, layer.name  # the conv's kernel / the read's variable
    np.testing.assert_allclose(loaded(x), passed(x), rtol=1e-5)
    _fit(passed, x, y)
    _fit(loaded, x, y)
    for a, b in zip(passed.weights, loaded.weights):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-6, err_msg=a.path)


@kip.passes.register_pass("test_lose_the_write")
class LosesTheWrite(kip.passes.Pass):
    """A wrong pass, made for this test: the conv of `first` reads its input
    without the write before it, and the write node is erased."""

    step = "lose_the_write"

    def run(self, graph, report):
        graph = graph.copy()
        for node in list(graph.nodes):
            if isinstance(node.operation, AfterWrites):
                graph.replace_all_uses_with(node.outputs[0], node.args[0])
                graph.erase_node(node)
        for node in list(graph.nodes):
            if isinstance(node.operation, VariableWrite) and not node.outputs[0].users:
                graph.erase_node(node)
        return graph

    def get_config(self):
        return {}


def test_verification_catches_a_lost_write():
    x = _images(8)[0]
    model = _built(PixelCNN)
    # kernels that the masks change: the first write shows
    for block in (model.first, model.second):
        block.conv.kernel.assign(np.ones(block.conv.kernel.shape, "float32"))
    before = _weights(model)
    expanded = kip.apply_passes(kip.convert_to_functional(model, x), [Expand("all")])
    with pytest.raises(kip.PassError, match="conv2d[^`]*/kernel`"):
        kip.apply_passes(expanded, [LosesTheWrite()])
    _assert_same_weights(_weights(model), before)


def test_recompute_never_puts_a_write_in_a_recomputed_segment():
    from keras_ipu_plugin.runtime.backends import get_backend
    from keras_ipu_plugin.runtime.effects import make_plan

    x = _images(8)[0]
    model = _built(PixelCNN)
    targets = ["first.conv.kernel.assign", "first.conv", "second.conv"]
    passed = kip.apply_passes(kip.convert_to_functional(model, x),
                              [Expand("all"), Recompute(targets)])
    for segment in make_plan(passed, get_backend()):
        if segment.recompute:
            assert not any(isinstance(node.operation, VariableWrite) for node in segment.nodes)
    assert any(segment.recompute for segment in make_plan(passed, get_backend()))


def test_outlining_an_expanded_writing_block_keeps_its_writes():
    """Outline on the blocks marks their layers, the write nodes too; an
    outlined body runs in a stateless scope, so a write node runs as itself."""
    x, y = _images()
    plain = _built(PixelCNN)
    _fit(plain, x, y)
    model = _built(PixelCNN)
    passed = kip.apply_passes(kip.convert_to_functional(model, x[:8]),
                              [Expand("all"), kip.passes.Outline([PixelConvLayer])])
    assert "outline" in passed.kip_graph.node("first.conv.kernel.assign").annotations
    _fit(passed, x, y)
    _assert_same_weights(_weights(model), _weights(plain))


class TiedEmbedding(keras.Model):
    """Scores tokens against its embedding table (tied weights, as GPT-2's
    head does): a read of a Keras sub-layer's variable from `call`."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.embedding = layers.Embedding(10, 4)
        self.dense = layers.Dense(4)

    def call(self, tokens):
        h = self.dense(self.embedding(tokens))
        return ops.matmul(h, ops.transpose(self.embedding.embeddings))


def test_a_sub_layers_variable_read_in_call_is_a_read_node_saved_as_one_variable(tmp_path):
    tokens = np.random.RandomState(0).randint(0, 10, (8, 5))
    keras.utils.set_random_seed(1)
    model = TiedEmbedding()
    model(tokens)
    converted = kip.convert_to_functional(model, tokens)
    assert converted.kip_report.opaque == {}
    read = converted.kip_graph.node("embedding.embeddings").operation
    assert read.variable is model.embedding.embeddings
    converted.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras")
    assert len(loaded.weights) == len(converted.weights) == 3
    target = np.random.RandomState(1).rand(8, 5, 10).astype("float32")
    for one in (converted, loaded):
        one.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
        one.fit(tokens, target, batch_size=4, epochs=1, shuffle=False, verbose=0)
    for a, b in zip(converted.weights, loaded.weights):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-6, err_msg=a.path)
