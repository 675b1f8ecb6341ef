"""Common idioms of public Keras code that the symbolic trace must follow
exactly (ViT's patching-and-embedding layer).

- `ops.tile(token, (ops.shape(x)[0], 1, 1))`: the repeats hold the batch
  size, unknown (None) while tracing; the graph reads it when it runs.
- `table[None]`, `x[...]`, `table[1:]`: indexing with a bare new axis,
  Ellipsis or slice, which Keras's symbolic indexing rejects (it takes
  ints and tuples only), is recorded as the same index in a tuple.
- `tf.square(a - b)`, `tf.reduce_sum(x, -1)`, `tf.reshape(x, [tf.shape(x)[0],
  -1])`: TensorFlow functions on symbolic tensors (the Keras siamese
  example's DistanceLayer, Keras 2 code) are recorded as graph operations.

Each model is compared with the original at the conversion batch size and
at others, and after saving and loading.
"""

import numpy as np
import pytest
import tensorflow as tf

import keras
from keras import layers
from keras import ops

import keras_ipu_plugin as kip
from keras_ipu_plugin.passes import Expand
from keras_ipu_plugin.layers.tf_calls import TFFunction

from graph_checks import Wrapper, assert_equivalent, custom_layers_left  # tests/ is on sys.path
from graph_checks import expands_exactly_at_any_batch_size


def _rand(*shape, seed=0):
    return np.random.RandomState(seed).normal(size=shape).astype("float32")



class TiledClassToken(layers.Layer):
    """ViT (keras_hub's `ViTPatchingAndEmbedding`): a learned class token
    tiled to the batch size and put before the patches."""

    def build(self, shape):
        self.class_token = self.add_weight(
            shape=(1, 1, shape[-1]), initializer="random_normal", name="class_token")

    def call(self, x):
        token = ops.tile(self.class_token, (ops.shape(x)[0], 1, 1))
        return ops.concatenate([token, x], axis=1)


def test_a_token_tiled_to_the_batch_size_expands_to_a_graph_for_any_batch_size(tmp_path):
    passed = expands_exactly_at_any_batch_size(TiledClassToken(name="block"), tmp_path)
    assert any(type(n.operation).__name__ == "BatchSizedOperation"
               and type(n.operation.operation).__name__ == "Tile"
               for n in passed.kip_graph.nodes)


class BareIndexing(layers.Layer):
    """A position table given a batch axis with `table[None]`, a bias cut
    with `bias[1:]`, and `x[...]`: bare keys, not tuples."""

    def build(self, shape):
        self.table = self.add_weight(
            shape=(shape[1], shape[2]), initializer="random_normal", name="table")
        self.bias = self.add_weight(
            shape=(shape[2] + 1,), initializer="random_normal", name="bias")

    def call(self, x):
        return x[...] + self.table[None] + self.bias[1:]


def test_indexing_with_a_bare_new_axis_slice_or_ellipsis_expands_exactly(tmp_path):
    expands_exactly_at_any_batch_size(BareIndexing(name="block"), tmp_path)


def test_keras_rejects_bare_keys_again_after_a_trace(tmp_path):
    # Only the trace records bare keys as tuples: Keras after it is as it was.
    expands_exactly_at_any_batch_size(BareIndexing(name="block"), tmp_path)
    tensor = keras.KerasTensor((5, 8))
    with pytest.raises(ValueError, match="Unsupported key type"):
        tensor[None]
    with pytest.raises(TypeError):
        ops.tile(keras.KerasTensor((1, 8)), (None, 1))


# -- random draws ----------------------------------------------------------------
class Sampling(layers.Layer):
    """The Keras VAE example's sampling layer: noise of the batch size drawn
    from the layer's own seed generator at every call."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.seed_generator = keras.random.SeedGenerator(1337)

    def call(self, x):
        noise = keras.random.normal(shape=(ops.shape(x)[0], ops.shape(x)[1], 8),
                                    seed=self.seed_generator)
        return x + 0.5 * noise


class FixedNoise(layers.Layer):
    """Noise of a fixed shape (no batch size in it), drawn anew at each call."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.seed_generator = keras.random.SeedGenerator(7)

    def call(self, x):
        return x * keras.random.uniform((1, 1, 8), 0.5, 1.5, seed=self.seed_generator)


class TwoDraws(layers.Layer):
    """Two draws from one generator: their order is what gives each its numbers."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.seed_generator = keras.random.SeedGenerator(3)

    def call(self, x):
        first = keras.random.normal((1, 1, 8), seed=self.seed_generator)
        second = keras.random.normal((1, 1, 8), seed=self.seed_generator)
        return x * first - second


def _seed_states(model):
    return [v for v in model.non_trainable_variables if "seed_generator_state" in v.path]


def test_random_draws_expand_to_nodes_drawing_the_originals_numbers_at_any_batch_size(tmp_path):
    for block in (Sampling(name="block"), FixedNoise(name="block")):
        x = _rand(4, 5, 3)
        model = Wrapper(block, name="wrapper")
        model(x)
        states = _seed_states(model)
        assert states
        start = [np.array(s) for s in states]
        passed = kip.apply_passes(kip.convert_to_functional(model, x), [Expand()])
        # Converting and expanding drew nothing from the user's generator.
        for state, value in zip(states, start):
            np.testing.assert_array_equal(np.array(state), value)
        assert custom_layers_left(passed) == []
        assert passed.kip_report.opaque == {}, passed.kip_report.opaque
        assert any(type(n.operation).__name__ == "RandomDraw" for n in passed.kip_graph.nodes)
        # The passed model draws from the same generator: the same numbers,
        # new ones at each call (not one draw frozen into the graph).
        for batch in (4, 1, 7):
            other = _rand(batch, 5, 3, seed=batch)
            before = [np.array(s) for s in states]
            expected = np.array(model(other))
            for state, value in zip(states, before):
                state.assign(value)
            got = np.array(passed(other))
            np.testing.assert_allclose(got, expected, atol=1e-6)
            assert not np.allclose(np.array(passed(other)), got)


def test_two_draws_from_one_generator_stay_whole_and_say_why():
    x = _rand(4, 5, 3)
    model = Wrapper(TwoDraws(name="block"), name="wrapper")
    model(x)
    passed = kip.apply_passes(kip.convert_to_functional(model, x), [Expand()])
    assert custom_layers_left(passed) == ["block"]
    assert "order of the draws" in passed.kip_report.opaque["block"]


class NumpyRate(layers.Layer):
    """A drop-path rate taken from `np.linspace`: NumPy floats on both sides
    of the tensor, which TensorFlow converts to the tensor's float32 (Keras's
    symbolic ops would promote to float64, or NumPy raise on the left)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.keep = 1 - np.linspace(0, 0.1, 3)[1]

    def call(self, x):
        scale = np.linspace(1.0, 2.0, 8)  # float64, as TensorFlow converts it: float32
        return self.keep * x + x / self.keep - np.float64(0.5) ** x + scale * x - x * scale


def test_numpy_scalars_around_a_tensor_expand_computing_in_the_tensors_dtype(tmp_path):
    passed = expands_exactly_at_any_batch_size(NumpyRate(name="block"), tmp_path)
    assert {value.spec.dtype for node in passed.kip_graph.nodes
            for value in node.outputs} == {"float32"}
    assert passed(_rand(2, 5, 3)).dtype == "float32"
    with pytest.raises(ValueError, match="KerasTensor is symbolic"):
        np.float64(0.5) * keras.KerasTensor((None, 4))  # Keras as it was, after


class GrowsASeededHead(keras.Model):
    """A sub-layer first called (so built) while the model is traced, with a
    seeded initializer: its initial kernel is a `keras.random` draw too."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.grow = False
        self.base = layers.Dense(4, activation="tanh", name="base")
        self.extra = layers.Dense(
            4, kernel_initializer=keras.initializers.GlorotUniform(seed=3), name="extra")
        self.out = layers.Dense(1, name="out")

    def call(self, x):
        x = self.base(x)
        if self.grow:
            x = x + self.extra(x)
        return self.out(x)


def test_a_sub_layer_built_during_the_trace_draws_its_initial_weights_as_keras_does():
    # The initializer's draw was recorded as a graph node: the variable got
    # a symbolic initial value and the whole model stayed opaque.
    x = _rand(4, 3)
    model = GrowsASeededHead(name="grows")
    model(x)
    model.grow = True
    converted = kip.convert_to_functional(model, x)
    assert converted.kip_report.opaque == {}, converted.kip_report.opaque
    assert [n.name for n in converted.kip_graph.nodes] == ["base", "extra", "add", "out"]
    assert not any(type(n.operation).__name__ == "RandomDraw" for n in converted.kip_graph.nodes)
    assert model.extra.kernel.shape == (4, 4)
    np.testing.assert_allclose(converted(x), model(x), atol=1e-6)


class TensorFlowFunctions(layers.Layer):
    """Keras-2-style code: TensorFlow's elementwise, reduction, shape and
    list functions on symbolic tensors, with extra arguments (an `alpha`,
    a dtype, an axis) and the dynamic batch size from `tf.shape`."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = layers.Dense(8, name="dense")

    def call(self, x):
        h = tf.nn.leaky_relu(self.dense(x), alpha=0.3)
        distance = tf.reduce_sum(tf.square(h - x), axis=-1, keepdims=True)
        joined = tf.concat([tf.maximum(h, 0.1), tf.math.sigmoid(x) * distance], axis=-1)
        heads = tf.reshape(joined, [tf.shape(x)[0], -1, 2, 8])
        return tf.reshape(tf.cast(tf.cast(heads, "float64"), "float32"), [tf.shape(x)[0], -1, 16])


def test_tensorflow_functions_on_symbolic_tensors_expand_to_graph_operations(tmp_path):
    block = TensorFlowFunctions(name="block")
    passed = expands_exactly_at_any_batch_size(block, tmp_path)
    recorded = {node.operation.function for node in passed.kip_graph.nodes
                if isinstance(node.operation, TFFunction)}
    assert {"math.square", "math.reduce_sum", "nn.leaky_relu", "concat",
            "reshape", "shape", "cast"} <= recorded
    assert passed.kip_graph.node("block.dense").operation is block.dense


def test_tensorflow_rejects_symbolic_tensors_again_outside_a_trace(tmp_path):
    expands_exactly_at_any_batch_size(TensorFlowFunctions(name="block"), tmp_path)
    with pytest.raises(ValueError, match="KerasTensor cannot be used as input"):
        tf.square(keras.KerasTensor((None, 4)))


class TensorFlowRandom(layers.Layer):
    """A TensorFlow random function: never recorded (the graph would not
    keep its seed); the layer stays whole, saying which line did it."""

    def call(self, x):
        return x + tf.random.stateless_uniform(tf.shape(x), seed=(1, 2))


def test_a_tensorflow_random_function_leaves_its_layer_whole_saying_where():
    x = _rand(4, 5, 3)
    model = Wrapper(TensorFlowRandom(name="block"), name="wrapper")
    model(x)
    converted = kip.convert_to_functional(model, x)
    passed = kip.apply_passes(converted, [Expand()])
    assert passed.kip_graph.node("block").operation is model.block
    reason = passed.kip_report.opaque["block"]
    assert "TensorFlow function" in reason and "tf.random.stateless_uniform" in reason
    assert_equivalent(model, passed, x)


class TensorFlowMultiOutput(layers.Layer):
    """TensorFlow functions with several outputs (`tf.split`, `tf.nn.moments`)
    and with a weight among their inputs (`tf.nn.bias_add`, `tf.matmul`)."""

    def build(self, shape):
        self.kernel = self.add_weight(shape=(shape[-1], 8), name="kernel")
        self.bias = self.add_weight(shape=(8,), initializer="ones", name="bias")

    def call(self, x):
        h = tf.nn.bias_add(tf.matmul(x, self.kernel), self.bias)
        left, right = tf.split(h, 2, axis=-1)
        mean, variance = tf.nn.moments(h, axes=[-1], keepdims=True)
        return tf.concat([left * mean, right + variance], axis=-1)


def test_tensorflow_functions_with_several_outputs_or_weights_expand_and_train(tmp_path):
    block = TensorFlowMultiOutput(name="block")
    passed = expands_exactly_at_any_batch_size(block, tmp_path)
    recorded = {node.operation.function for node in passed.kip_graph.nodes
                if isinstance(node.operation, TFFunction)}
    assert {"split", "nn.moments", "nn.bias_add", "linalg.matmul"} <= recorded
    # The weights are graph reads, shared with the block, not constants.
    assert {id(v) for v in block.trainable_variables} <= {
        id(v) for v in passed.trainable_variables}


class ImagePatches(layers.Layer):
    """The keras.io ViT example's `Patches` + `PatchEncoder` in Keras 2
    style: `tf.image.extract_patches`, reshaped with `tf.shape`'s batch
    size, projected and added to a position embedding; and `tf.image.resize`."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.projection = layers.Dense(8, name="projection")
        self.position_embedding = layers.Embedding(4, 8, name="position_embedding")

    def call(self, images):
        images = tf.image.resize(images, [8, 8])
        patches = tf.image.extract_patches(images, sizes=[1, 4, 4, 1], strides=[1, 4, 4, 1],
                                           rates=[1, 1, 1, 1], padding="VALID")
        patches = tf.reshape(patches, [tf.shape(patches)[0], -1, patches.shape[-1]])
        return self.projection(patches) + self.position_embedding(tf.range(4))


class ImageClassifier(keras.Model):
    def __init__(self, block, **kwargs):
        super().__init__(**kwargs)
        self.block = block
        self.head = layers.Dense(2, name="head")

    def call(self, images):
        return self.head(self.block(images))


def test_tensorflow_image_functions_expand_to_graph_operations(tmp_path):
    x = _rand(2, 6, 6, 3)
    model = ImageClassifier(ImagePatches(name="block"), name="classifier")
    model(x)
    converted = kip.convert_to_functional(model, x)
    passed = kip.apply_passes(converted, [Expand()])
    assert custom_layers_left(passed) == [], passed.kip_report.opaque
    recorded = {node.operation.function for node in passed.kip_graph.nodes
                if isinstance(node.operation, TFFunction)}
    assert {"image.resize", "image.extract_patches"} <= recorded
    other = _rand(5, 6, 6, 3, seed=5)
    np.testing.assert_allclose(passed(other), model(other), atol=1e-5)
    path = str(tmp_path / "passed.keras")
    passed.save(path)
    np.testing.assert_allclose(keras.models.load_model(path)(other), model(other), atol=1e-5)


class ReturnsAnEmptyConstant(layers.Layer):
    """keras_hub's `DeiTEncoder`: returns `ops.empty((0, length, dim))` for
    the hidden states it was not asked to collect, beside its output."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = layers.Dense(8, name="dense")

    def call(self, x):
        length, dim = ops.shape(x)[1], ops.shape(x)[2]
        return self.dense(x), ops.empty((0, length, dim), dtype=x.dtype)


class TakesTheFirstOutput(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.embed = layers.Dense(8, name="embed")
        self.block = ReturnsAnEmptyConstant(name="block")
        self.head = layers.Dense(2, name="head")

    def call(self, x):
        hidden, _ = self.block(self.embed(x))
        return self.head(hidden)


def test_a_constant_returned_beside_the_outputs_is_held_in_the_graph():
    x = _rand(4, 5, 3)
    model = TakesTheFirstOutput(name="first_output")
    model(x)
    converted = kip.convert_to_functional(model, x)
    passed = kip.apply_passes(converted, [Expand()])
    assert custom_layers_left(passed) == [], passed.kip_report.opaque
    assert passed.kip_graph.node("block.dense").operation is model.block.dense
    assert_equivalent(model, passed, x)
    other = _rand(7, 5, 3, seed=7)
    np.testing.assert_allclose(passed(other), model(other), atol=1e-5)


class RankFromOps(layers.Layer):
    """keras_hub's RoFormer-v2 positional embedding: `ndim = ops.ndim(x)`,
    then Python on it (`ndim or max(axes) + 1`, `[None] * ndim`). On a
    TensorFlow tensor `ops.ndim` is a Python int; on a symbolic one, Keras
    gives a tensor, which Python cannot branch on."""

    def call(self, x):
        ndim = ops.ndim(x)
        ndim = ndim or 3
        index = [None] * (ndim - 1) + [slice(None)]
        return x + ops.arange(8, dtype=x.dtype)[tuple(index)]


def test_the_rank_of_a_symbolic_tensor_is_a_python_int_while_tracing(tmp_path):
    expands_exactly_at_any_batch_size(RankFromOps(name="block"), tmp_path)
    # Keras gives its symbolic tensor again outside a trace.
    assert isinstance(ops.ndim(keras.KerasTensor((None, 4))), keras.KerasTensor)
    from keras.src.ops.numpy import Ndim
    assert "symbolic_call" not in vars(Ndim)
