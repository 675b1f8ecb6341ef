"""The idioms of public code that once stayed whole or failed:

- TensorFlow functions not recorded before: `tf.range(tf.shape(x)[-1])`
  (keras.io's NER transformer), `tf.stop_gradient` (VQ-VAE's
  straight-through estimator), `tf.einsum` (the Switch Transformer, DDPM's
  attention; its inputs are var-positional, recorded through TensorFlow's
  fallback dispatch), and DDPM's `TimeEmbedding`, whose product with a
  concrete `tf.Tensor` Keras marks sparse; no reason a layer stays whole
  for is TensorFlow's or Keras's message alone;
- arithmetic on the batch size: a multiple of it plus a constant
  (`batch + 1`, `batch - 1`) is followed, confirmed by a third trace; what
  is not (`batch * batch`) and a batch written as a constant
  (`ops.reshape(x, (4, 6))`) stay whole saying what to write (`batch // 2`
  is followed at multiples of 2: tests/frontend/batch/test_batch_divisions.py);
- unseeded TensorFlow draws (`tf.random.normal(shape)`): verification
  replays the original's draws in the converted run and puts TensorFlow's
  global random state back, so the model converts and trains; the draw
  is a `TFRandomDraw` graph node (drawing at each run as the original
  does), so the drawing layer expands;
- a layer with the name of a model input (keras.io's GRN/VSN `Embedding`
  "education"): conversion, Expand, Replace and saving keep both.
"""

import numpy as np
import pytest
import tensorflow as tf

import keras
from keras import layers
from keras import ops

import keras_ipu_plugin as kip
from keras_ipu_plugin import _compat
from keras_ipu_plugin.frontend.verify.runs import taped_stateful_draws
from keras_ipu_plugin.errors import LoadError
from keras_ipu_plugin.passes import Expand
from keras_ipu_plugin.passes import Replace
from keras_ipu_plugin.passes import Replacement
from keras_ipu_plugin.layers.keras_ops.batch_sized import BatchSizedOperation
from keras_ipu_plugin.layers.tf_calls import TFFunction
from keras_ipu_plugin.layers.tf_calls import TFRandomDraw

from graph_checks import assert_equivalent  # tests/ is on sys.path
from graph_checks import expands_exactly_at_any_batch_size
from models import BlockBetweenDense as Net  # tests/models.py


def _rand(*shape, seed=0):
    return np.random.RandomState(seed).normal(size=shape).astype("float32")


def _functions(passed):
    return sorted({node.operation.function for node in passed.kip_graph.nodes
                   if isinstance(node.operation, TFFunction)})




def _converted(block, x):
    model = Net(block, name="net")
    model(x)
    return model, kip.convert_to_functional(model, x)


# -- TensorFlow functions ------------------------------------------------------
class PositionsFromRange(layers.Layer):
    """keras.io's NER `TokenAndPositionEmbedding`: positions from
    `tf.range` of a size `tf.shape` computes in the graph."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.pos_emb = layers.Embedding(input_dim=5, output_dim=8)

    def call(self, x):
        maxlen = tf.shape(x)[1]
        positions = tf.range(start=0, limit=maxlen, delta=1)
        return x + self.pos_emb(positions) + tf.cast(tf.range(tf.shape(x)[-1]), x.dtype)


class PositionsFromIntRange(layers.Layer):
    """The same with the length as a Python int: `tf.range` makes a
    concrete tensor, which the position embedding is called on."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.maxlen = 5
        self.pos_emb = layers.Embedding(input_dim=5, output_dim=8)

    def call(self, x):
        return x + self.pos_emb(tf.range(start=0, limit=self.maxlen, delta=1))


def test_tf_range_of_a_size_computed_in_the_graph_expands_exactly(tmp_path):
    passed = expands_exactly_at_any_batch_size(PositionsFromRange(name="block"), tmp_path)
    assert "range" in _functions(passed)


def test_tf_range_of_a_python_int_expands_exactly(tmp_path):
    expands_exactly_at_any_batch_size(PositionsFromIntRange(name="block"), tmp_path)


class StraightThrough(layers.Layer):
    """VQ-VAE's straight-through estimator: the forward pass rounds, the
    gradient is the identity's; the losses hold one side fixed."""

    def build(self, shape):
        self.codebook = self.add_weight(shape=(shape[-1],), initializer="ones", name="codebook")

    def call(self, x):
        quantized = tf.round(x * self.codebook)
        commitment = tf.reduce_mean((tf.stop_gradient(quantized) - x) ** 2, axis=-1, keepdims=True)
        return x + tf.stop_gradient(quantized - x) + commitment + quantized


def test_tf_stop_gradient_expands_with_the_gradients_it_stops(tmp_path):
    passed = expands_exactly_at_any_batch_size(StraightThrough(name="block"), tmp_path)
    assert "stop_gradient" in _functions(passed)


class Einsums(layers.Layer):
    """`tf.einsum` with two and three operands (the Switch Transformer's
    dispatch, DDPM's attention), a spaced equation among them."""

    def build(self, shape):
        self.w = self.add_weight(shape=(shape[-1], 4), name="w")
        self.v = self.add_weight(shape=(4, shape[-1]), name="v")

    def call(self, x):
        two = tf.einsum("bsd, de->bse", x, self.w)
        three = tf.einsum("bsd,de,ef->bsf", x, self.w, self.v)
        scores = tf.einsum("bsd,btd->bst", x, x)
        return three + tf.einsum("bst,btd->bsd", tf.nn.softmax(scores), x) + tf.reduce_sum(two)


def test_tf_einsum_expands_to_graph_operations(tmp_path):
    passed = expands_exactly_at_any_batch_size(Einsums(name="block"), tmp_path)
    assert _functions(passed).count("linalg.einsum") == 1
    einsums = [n for n in passed.kip_graph.nodes
               if isinstance(n.operation, TFFunction) and n.operation.function == "linalg.einsum"]
    assert len(einsums) >= 4


def test_tf_einsum_is_tensorflows_own_outside_a_trace(tmp_path):
    expands_exactly_at_any_batch_size(Einsums(name="block"), tmp_path)  # registered
    a, b = tf.ones((2, 3)), tf.ones((3, 4))
    np.testing.assert_allclose(tf.einsum("ij,jk->ik", a, b), np.full((2, 4), 3.0))
    with pytest.raises((TypeError, ValueError), match="KerasTensor"):
        tf.einsum("ij,jk->ik", keras.KerasTensor((2, 3)), b)


class TimeEmbedding(layers.Layer):
    """DDPM's sinusoidal time embedding: a concrete `tf.Tensor` it holds
    times the symbolic time steps, which Keras marks sparse."""

    def __init__(self, dim, **kwargs):
        super().__init__(**kwargs)
        half_dim = dim // 2
        self.emb = tf.exp(tf.range(half_dim, dtype=tf.float32) * -(np.log(10000) / (half_dim - 1)))

    def call(self, inputs):
        inputs = tf.cast(inputs, dtype=tf.float32)
        emb = inputs[:, None] * self.emb[None, :]
        return tf.concat([tf.sin(emb), tf.cos(emb)], axis=-1)


class TimeNet(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.time = TimeEmbedding(8)
        self.head = layers.Dense(3)

    def call(self, t):
        return self.head(self.time(t))


def test_ddpm_time_embedding_expands_although_keras_marks_its_product_sparse(tmp_path):
    t = np.arange(6, dtype="int64")
    model = TimeNet(name="time_net")
    model(t)
    converted = kip.convert_to_functional(model, t)
    passed = kip.apply_passes(converted, [Expand("all")])
    assert passed.kip_report.opaque == {}, passed.kip_report.opaque
    assert not [n for n in passed.kip_graph.nodes if isinstance(n.operation, TimeEmbedding)]
    assert {"math.sin", "math.cos", "concat"} <= set(_functions(passed))
    for batch in (1, 9):
        other = np.arange(batch, dtype="int64") * 7
        np.testing.assert_allclose(passed(other), model(other), atol=1e-5)
    path = str(tmp_path / "time.keras")
    passed.save(path)
    np.testing.assert_allclose(keras.models.load_model(path)(t), model(t), atol=1e-5)


class AddsALossInABranch(layers.Layer):
    """`add_loss` inside `ops.cond` (an `add_loss` in `call` itself is a
    graph node: tests/layers/test_added_losses.py)."""

    def call(self, x):
        def adding():
            self.add_loss(tf.reduce_mean(tf.stop_gradient(x) ** 2))
            return x * 2.0

        return ops.cond(ops.mean(x) > -100.0, adding, lambda: x * 2.0)


class ShapeAsList(layers.Layer):
    """TensorFlow's `x.shape.as_list()`, which a Keras symbolic tensor (a
    tuple shape) has not; runs in a graph, so the layer stays whole."""

    def call(self, x):
        return x * float(x.shape.as_list()[-1])


@pytest.mark.parametrize("block, expected", [
    (AddsALossInABranch, "adds a loss (`self.add_loss(...)`) inside a branch"),
    (ShapeAsList, "fails when run on symbolic tensors"),
])
def test_a_layer_kept_whole_says_what_happened_and_what_to_write(block, expected):
    x = _rand(4, 3)
    model, converted = _converted(block(name="block"), x)
    passed = kip.apply_passes(converted, [Expand("all")])
    reasons = {**converted.kip_report.opaque, **passed.kip_report.opaque}
    assert reasons, "the layer was expected to stay whole"
    for reason in reasons.values():
        assert expected in reason, reason
        # What to write instead, not only Keras's or TensorFlow's words.
        assert "expand" in reason and ("write" in reason or "return the loss" in reason), reason
        assert not reason.startswith(("TypeError", "ValueError", "AttributeError")), reason
    assert_equivalent(model, passed, x)


# -- arithmetic on the batch size ----------------------------------------------
class PlusOne(layers.Layer):
    """A constant of the batch size plus one row, and a slice of the batch
    minus one: sizes no multiple of the batch size alone."""

    def call(self, x):
        b = ops.shape(x)[0]
        padded = ops.concatenate([ops.ones((b + 1, 6)), x], axis=0)
        shifted = ops.slice(x, [1, 0], [b - 1, 6]) - ops.slice(x, [0, 0], [b - 1, 6])
        return x + ops.mean(padded, axis=0) + ops.sum(shifted, axis=0, keepdims=True) * 0.5


def test_a_multiple_of_the_batch_size_plus_a_constant_is_followed_at_any_batch_size(tmp_path):
    x = _rand(4, 6)
    model, converted = _converted(PlusOne(name="block"), x)
    passed = kip.apply_passes(converted, [Expand("all")])
    assert passed.kip_report.opaque == {}, passed.kip_report.opaque
    offsets = [n.operation.offsets for n in passed.kip_graph.nodes
               if isinstance(n.operation, BatchSizedOperation) and n.operation.offsets]
    assert offsets, "the sizes `b + 1` and `b - 1` are held as offsets"
    assert_equivalent(model, passed, x)
    for batch in (2, 3, 7):
        other = _rand(batch, 6, seed=batch)
        np.testing.assert_allclose(passed(other), model(other), atol=1e-5)
    path = str(tmp_path / "plus_one.keras")
    passed.save(path)
    other = _rand(5, 6, seed=5)
    np.testing.assert_allclose(keras.models.load_model(path)(other), model(other), atol=1e-5)


class Squared(layers.Layer):
    """`batch * batch` rows: a line through its sizes at two batch sizes
    (1 and 9 at 1 and 3) that a third (4 at 2) does not follow."""

    def call(self, x):
        b = ops.shape(x)[0]
        return x + ops.mean(ops.concatenate([ops.zeros((b * b, 6)), x], axis=0), axis=0)


class FixedBatch(layers.Layer):
    """The Switch Transformer's reshape to a batch written as a constant."""

    def call(self, x):
        return ops.reshape(x, (4, 6)) * 2.0


@pytest.mark.parametrize("block, expected", [
    (Squared, "batch size 2"),
    (FixedBatch, "holds the batch size 4 as a constant"),
])
def test_batch_arithmetic_that_cannot_be_followed_stays_whole_saying_what_to_write(block, expected):
    x = _rand(4, 6)
    model, converted = _converted(block(name="block"), x)
    passed = kip.apply_passes(converted, [Expand("all")])
    reason = passed.kip_report.opaque.get("block")
    assert reason is not None and expected in reason, passed.kip_report.opaque
    assert "static_batch=True" in reason
    assert passed.kip_graph.node("block").operation is model.block
    assert_equivalent(model, passed, x)
    for batch in (2, 3):  # the graph runs where, and fails where, the model does
        other = _rand(batch, 6, seed=batch)
        try:
            expected_output = model(other)
        except Exception:  # noqa: BLE001 - the model itself fails there
            with pytest.raises(Exception):
                passed(other)
        else:
            np.testing.assert_allclose(passed(other), expected_output, atol=1e-5)


def test_a_fixed_batch_reshape_names_the_dimension_to_write():
    x = _rand(4, 6)
    _, converted = _converted(FixedBatch(name="block"), x)
    reason = kip.apply_passes(converted, [Expand("all")]).kip_report.opaque["block"]
    assert "`ops.reshape(x, (-1, 6))`" in reason and "ops.shape(x)[0]" in reason


class RoutedTokens(layers.Layer):
    """Mixtral's expert routing (keras_hub): the tokens flattened to
    `(batch * tokens, dim)`, the batch size got back as
    `ops.shape(flat)[0] // tokens`."""

    def call(self, x):
        flat = ops.reshape(x, (-1, ops.shape(x)[-1]))
        batch = ops.shape(flat)[0] // ops.shape(x)[1]
        return ops.reshape(flat * 2.0, (batch, -1, ops.shape(x)[-1]))


class RoutedTokensInTensorFlow(layers.Layer):
    def call(self, x):
        flat = tf.reshape(x, [-1, tf.shape(x)[-1]])
        batch = tf.shape(flat)[0] // tf.shape(x)[1]
        return tf.reshape(flat * 2.0, [batch, -1, tf.shape(x)[-1]])


@pytest.mark.parametrize("block", [RoutedTokens, RoutedTokensInTensorFlow])
def test_a_multiple_of_the_batch_divided_back_is_followed_at_any_batch_size(block, tmp_path):
    """`ops.shape(x)[0] // k` where x has `batch * k`
    rows is the batch size at every batch size (`ops.shape(x)[0] // k` of
    the batch itself is followed at multiples of k: tests/frontend/batch/test_batch_divisions.py)."""
    expands_exactly_at_any_batch_size(block(name="block"), tmp_path)


@pytest.mark.parametrize("offsets, match", [
    ({"shape": "1"}, "offsets.shape"),
    ({"shape": [1.5, 0]}, "offsets.shape"),
    ({"other": [1, 0]}, "offsets.other"),
    ([1, 0], "offsets"),
])
def test_a_saved_offset_that_is_not_ints_for_an_attribute_is_refused(offsets, match):
    layer = BatchSizedOperation(_compat.broadcast_to_operation((None, 6)), ["shape"],
                                offsets={"shape": [1, 0]}, name="broadcast")
    config = layer.get_config()
    assert config["offsets"] == {"shape": [1, 0]}
    assert BatchSizedOperation.from_config(config).offsets == {"shape": [1, 0]}
    with pytest.raises(LoadError, match=match):
        BatchSizedOperation.from_config({**config, "offsets": offsets})


# -- unseeded TensorFlow draws -------------------------------------------------
class UnseededSampling(layers.Layer):
    """keras.io's VAE `Sampling` with TensorFlow's draw and no seed."""

    def call(self, inputs):
        z_mean, z_log_var = inputs
        batch = tf.shape(z_mean)[0]
        dim = tf.shape(z_mean)[1]
        epsilon = tf.random.normal(shape=(batch, dim))
        return z_mean + tf.exp(0.5 * z_log_var) * epsilon


class Encoder(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.mean = layers.Dense(2, name="mean")
        self.log_var = layers.Dense(2, name="log_var", bias_initializer="ones")
        self.sampling = UnseededSampling(name="sampling")
        self.head = layers.Dense(3, name="head")

    def call(self, x):
        return self.head(self.sampling([self.mean(x), self.log_var(x)]))


def _encoder(x):
    keras.utils.set_random_seed(3)
    model = Encoder(name="encoder")
    model(x)
    return model


def test_an_unseeded_tensorflow_draw_is_a_graph_node_that_draws_as_the_original():
    """`tf.random.normal(shape=(batch, dim))` is a `TFRandomDraw` node: the
    layer expands, and the graph draws afresh at every call, from the
    distribution the original draws from."""
    x = _rand(8, 3)
    model = _encoder(x)
    converted = kip.convert_to_functional(model, x)  # refused before: "two runs differ"
    passed = kip.apply_passes(converted, [Expand("all")])
    assert passed.kip_report.opaque == {}
    draws = [node for node in passed.kip_graph.nodes if isinstance(node.operation, TFRandomDraw)]
    assert [node.name for node in draws] == ["sampling.tf_normal"]
    assert draws[0].operation.function == "random.normal"
    # The draws are the original's: the same statistics over a large batch
    # (z = mean + exp(log_var / 2) * eps, eps ~ N(0, 1)).
    large = _rand(4096, 3, seed=1)
    expected, actual = np.asarray(model(large)), np.asarray(passed(large))
    np.testing.assert_allclose(actual.mean(axis=0), expected.mean(axis=0), atol=0.15)
    np.testing.assert_allclose(actual.std(axis=0), expected.std(axis=0), rtol=0.1)
    assert not np.allclose(actual, expected), "two runs draw other numbers"
    assert not np.allclose(passed(large), actual), "each call draws anew"


class SeededNoise(layers.Layer):
    """Noise with an op-level seed, its shape a symbolic tensor."""

    def call(self, x):
        return x + tf.random.uniform(tf.shape(x), minval=-1.0, maxval=1.0, seed=7)


def test_a_tensorflow_draw_with_an_op_seed_draws_the_originals_numbers_in_a_tf_function():
    """In a `tf.function` (as `fit` runs it) a draw with an op-level seed
    gives the same numbers in the original and in the graph: the node makes
    the original's call, seed included."""
    x = _rand(6, 4)
    inputs = keras.Input((4,))
    model = keras.Model(inputs, SeededNoise(name="noise")(layers.Dense(4, name="d")(inputs)))
    passed = kip.apply_passes(kip.convert_to_functional(model, x), [Expand("all")])
    assert passed.kip_report.opaque == {}
    (draw,) = [n for n in passed.kip_graph.nodes if isinstance(n.operation, TFRandomDraw)]
    assert draw.operation.function == "random.uniform"
    tf.random.set_seed(11)
    expected = tf.function(lambda t: model(t))(x)
    tf.random.set_seed(11)
    np.testing.assert_allclose(tf.function(lambda t: passed(t))(x), expected, rtol=1e-6)


class NoiseOfTheInputsShape(layers.Layer):
    """`tf.random.uniform(x.shape)`: the batch size None while traced."""

    def call(self, x):
        return x + tf.random.uniform(x.shape, minval=0.0, maxval=1e-3)


def test_a_tensorflow_draw_of_a_shape_with_the_batch_as_none_takes_the_graph_s_batch(tmp_path):
    x = _rand(6, 6)
    model, converted = _converted(NoiseOfTheInputsShape(name="block"), x)
    passed = kip.apply_passes(converted, [Expand("all")])
    assert passed.kip_report.opaque == {}, passed.kip_report.opaque
    (draw,) = [n for n in passed.kip_graph.nodes if isinstance(n.operation, TFRandomDraw)]
    assert draw.kwargs.get("batch_of") is not None
    path = str(tmp_path / "noise.keras")
    passed.save(path)
    loaded = keras.models.load_model(path, custom_objects={"Net": Net})
    for batch in (1, 5):
        other = _rand(batch, 6, seed=batch)
        for graph in (passed, loaded):  # the noise is below 1e-3 in every row
            np.testing.assert_allclose(graph(other), model(other), atol=1e-2)


def test_a_tensorflow_draw_node_is_never_recomputed_and_saves_by_its_table_name(tmp_path):
    from keras_ipu_plugin.runtime.effects import has_forward_state

    draw = TFRandomDraw("random.normal", name="tf_normal")
    assert has_forward_state(draw), "a recomputation would draw other numbers"
    assert TFRandomDraw.from_config(draw.get_config()).function == "random.normal"
    for refused in ("math.square", "io.write_file", "random.set_seed", "random.stateless_normal"):
        with pytest.raises(LoadError, match="refusing"):
            TFRandomDraw.from_config({"function": refused, "name": "evil"})
    x = _rand(8, 3)
    passed = kip.apply_passes(kip.convert_to_functional(_encoder(x), x), [Expand("all")])
    passed.save(tmp_path / "drawing.keras")
    loaded = keras.models.load_model(tmp_path / "drawing.keras")
    assert any(isinstance(layer, TFRandomDraw) for layer in loaded.operations)
    assert loaded(x).shape == (8, 3)


def test_a_model_drawing_unseeded_with_tensorflow_trains_through_plugin_model():
    """Plain Keras and the plugin draw other numbers: what is compared is
    that training runs its 3 steps, reaches every weight, and ends near
    plain Keras's loss (the draws' spread, not their values, decides it)."""
    x, y = _rand(16, 3), _rand(16, 3, seed=2)

    def fit(wrap):
        model = _encoder(x)
        before = [np.array(v) for v in model.trainable_variables]
        trainee = kip.PluginModel(model, passes=[Expand("all")]) if wrap else model
        trainee.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
        history = trainee.fit(x, y, batch_size=8, epochs=3, verbose=0, shuffle=False)
        moved = [not np.allclose(a, np.array(v)) for a, v in zip(before, model.trainable_variables)]
        return history.history["loss"], moved, trainee

    plain_losses, plain_moved, _ = fit(False)
    losses, moved, wrapper = fit(True)
    assert wrapper.kip_report is not None
    assert all(moved) and all(plain_moved)
    assert all(np.isfinite(losses))
    assert losses[-1] == pytest.approx(plain_losses[-1], rel=0.5)


def test_verification_puts_back_tensorflows_global_random_state():
    x = _rand(8, 3)
    model = _encoder(x)
    tf.random.set_seed(5)
    expected = tf.random.normal((3,))
    generator = tf.random.get_global_generator()
    state = generator.state.numpy().copy()
    tf.random.set_seed(5)
    kip.convert_to_functional(model, x)
    np.testing.assert_array_equal(tf.random.normal((3,)), expected)
    np.testing.assert_array_equal(generator.state.numpy(), state)


def test_a_draw_tape_replays_in_order_and_draws_afresh_when_asked_for_another_draw():
    with taped_stateful_draws() as tape:
        tape.record()
        a, b = tf.random.normal((2, 3)), tf.random.uniform((4,))
        tape.replay()
        np.testing.assert_array_equal(tf.random.normal((2, 3)), a)
        np.testing.assert_array_equal(tf.random.uniform((4,)), b)
        tape.replay()
        other = tf.random.normal((5,))  # another shape than the recorded draw
        assert other.shape == (5,) and tape.mismatches == 1
    assert tf.random.normal((2, 3)).shape == (2, 3)  # TensorFlow's own again


# -- names the user's model already uses -----------------------------------------
class Encoding(layers.Layer):
    """The GRN/VSN example's encoding: an `Embedding` named after its
    feature, as the model's input is, and a LayerNormalization."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.embeddings = {"education": layers.Embedding(4, 3, name="education")}
        self.age = layers.Dense(3, name="age")
        self.norm = layers.LayerNormalization(name="norm")

    def call(self, inputs):
        return self.norm(self.embeddings["education"](inputs["education"])
                         + self.age(ops.expand_dims(inputs["age"], -1)))


@keras.saving.register_keras_serializable(package="kip_tests_public_idioms")
class MyNorm(layers.LayerNormalization):
    pass


def test_layers_named_like_the_model_inputs_convert_expand_replace_and_save(tmp_path):
    inputs = {"education": layers.Input(shape=(), dtype="int32", name="education"),
              "age": layers.Input(shape=(), name="age")}
    model = keras.Model(inputs, layers.Dense(1, name="head")(Encoding(name="encoding")(inputs)))
    x = {"education": np.array([0, 1, 2, 3], "int32"), "age": _rand(4)}
    converted = kip.convert_to_functional(model, x)
    passed = kip.apply_passes(converted, [Expand("all")])
    replaced = kip.apply_passes(converted, [
        Expand("all"), Replace({layers.LayerNormalization: Replacement(MyNorm, copy_weights=True)})])
    for result in (converted, passed, replaced):
        names = [layer.name for layer in result.layers]
        assert len(names) == len(set(names)), names
        assert {"education", "age"} <= set(names)
    assert_equivalent(model, converted, x)
    assert_equivalent(model, passed, x)
    np.testing.assert_allclose(replaced(x), model(x), atol=1e-5)  # new norms: new weights
    assert passed.kip_layer("encoding.embeddings.education") is model.layers[2].embeddings["education"]
    assert any(isinstance(layer, MyNorm) for layer in replaced.layers)
    path = str(tmp_path / "grn.keras")
    replaced.save(path)
    np.testing.assert_allclose(keras.models.load_model(path)(x), replaced(x), atol=1e-6)


# -- idioms of keras.io's augmentation, stochastic depth and attention ----------
class StochasticDepthOfTheTFShapesLength(layers.Layer):
    """keras.io's CCT / ConvNeXt `StochasticDepth` as written for Keras 2:
    the noise's shape from `len(tf.shape(x))`, drawn with `tf.random`."""

    def __init__(self, drop_prob, **kwargs):
        super().__init__(**kwargs)
        self.drop_prob = drop_prob

    def call(self, x, training=None):
        if training:
            keep_prob = 1 - self.drop_prob
            shape = (tf.shape(x)[0],) + (1,) * (len(tf.shape(x)) - 1)
            random_tensor = tf.floor(keep_prob + tf.random.uniform(shape, 0, 1))
            return (x / keep_prob) * random_tensor
        return x


def test_the_length_of_tf_shape_is_the_rank_and_stochastic_depth_expands(tmp_path):
    """`len(tf.shape(x))` is the rank while tracing, as TensorFlow gives it
    for an eager tensor: the layer expands, each mode a graph, and in
    training drops whole rows as the original does (kept rows scaled by
    1 / keep_prob)."""
    passed = expands_exactly_at_any_batch_size(
        StochasticDepthOfTheTFShapesLength(0.5, name="block"), tmp_path)
    assert any(isinstance(node.operation, kip.ModeSwitch) for node in passed.kip_graph.nodes)
    x = _rand(64, 5, 3, seed=3)
    inference = np.asarray(passed(x, training=False))
    trained = np.asarray(passed(x, training=True))
    bias = np.asarray(passed.get_layer("head").bias)  # the head of a dropped row
    dropped = [np.allclose(row, bias, atol=1e-5) for row in trained]
    kept = [np.allclose(row, 2 * i - bias, atol=1e-4) for row, i in zip(trained, inference)]
    assert all(d or k for d, k in zip(dropped, kept))
    assert 0 < sum(dropped) < len(dropped), "rows are dropped at random, not all or none"
    # Outside a trace a KerasTensor still has no len().
    with pytest.raises(TypeError):
        len(keras.KerasTensor((None, 4)))


class ImageAugmentation(layers.Layer):
    """keras.io-style preprocessing written with `tf.image`: crops, flips,
    rotations, pads and colour conversions, each a deterministic function
    of the image."""

    def call(self, images):
        y = tf.image.crop_to_bounding_box(images, 1, 1, 4, 4)
        y = tf.image.flip_up_down(tf.image.flip_left_right(y))
        y = tf.image.rgb_to_grayscale(y) + tf.image.rgb_to_yuv(y)
        y = tf.image.rot90(tf.image.per_image_standardization(y))
        y = tf.image.pad_to_bounding_box(y, 1, 1, 6, 6)
        return tf.image.resize_with_crop_or_pad(tf.image.central_crop(y, 0.5), 5, 5)


class AugmentThenClassify(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.embed = layers.Dense(3, name="embed")
        self.augment = ImageAugmentation(name="augment")
        self.head = layers.Dense(2, name="head")

    def call(self, images):
        return self.head(self.augment(self.embed(images)))


def test_tf_image_computations_are_recorded_and_expand_exactly(tmp_path):
    """`tf.image`'s deterministic computations are recorded functions of
    the table (saved by name): the layer using them expands, equal at
    other batch sizes and after saving and loading."""
    x = _rand(4, 6, 6, 3)
    model = AugmentThenClassify(name="classifier")
    model(x)
    passed = kip.apply_passes(kip.convert_to_functional(model, x), [Expand("all")])
    assert passed.kip_report.opaque == {}, passed.kip_report.opaque
    assert {"image.crop_to_bounding_box", "image.flip_left_right", "image.rot90",
            "image.pad_to_bounding_box", "image.central_crop",
            "image.per_image_standardization"} <= set(_functions(passed))
    assert_equivalent(model, passed, x)
    other = _rand(7, 6, 6, 3, seed=7)
    np.testing.assert_allclose(passed(other), model(other), atol=1e-5)
    passed.save(tmp_path / "augment.keras")
    loaded = keras.models.load_model(tmp_path / "augment.keras")
    np.testing.assert_allclose(loaded(other), model(other), atol=1e-5)


def test_tf_image_draws_and_glimpses_are_never_recorded_functions():
    from keras_ipu_plugin.layers import tf_calls as table

    for path in ("image.random_flip_left_right", "image.stateless_random_crop",
                 "image.extract_glimpse", "image.encode_png", "image.draw_bounding_boxes"):
        with pytest.raises(LoadError, match="refusing"):
            table.function_at(path, "block.evil")


class BiasedAttention(layers.MultiHeadAttention):
    """A `MultiHeadAttention` with a learned per-head bias on its scores,
    added in an override of the private `_compute_attention` (as public
    relative-position and ALiBi variants do)."""

    def build(self, query_shape, value_shape, key_shape=None):
        super().build(query_shape, value_shape, key_shape)
        self.score_bias = self.add_weight(
            shape=(self._num_heads, 1, 1), initializer="random_normal", name="score_bias")

    def _compute_attention(self, query, key, value, attention_mask=None, training=None,
                           return_attention_scores=False):
        query = ops.multiply(query, 1.0 / float(self._key_dim) ** 0.5)
        scores = ops.einsum(self._dot_product_equation, key, query) + self.score_bias
        scores = self._masked_softmax(scores, attention_mask)
        return ops.einsum(self._combine_equation, scores, value), scores


class SelfAttentionModel(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.embed = layers.Dense(8, name="embed")
        self.attention = BiasedAttention(num_heads=2, key_dim=4, name="attention")
        self.head = layers.Dense(2, name="head")

    def call(self, x):
        h = self.embed(x)
        return self.head(self.attention(h, h))


def test_a_weight_used_in_an_overridden_private_attention_method_expands():
    """Keras's `call` reaching the user's `_compute_attention` is traced
    inline, the user's weight read as a graph node: the attention expands
    (it stayed whole, its reason blaming a variable not held as an
    attribute) and trains its bias."""
    x = _rand(4, 5, 3)
    model = SelfAttentionModel(name="attending")
    model(x)
    passed = kip.apply_passes(kip.convert_to_functional(model, x), [Expand("all")])
    assert passed.kip_report.opaque == {}, passed.kip_report.opaque
    assert not any(isinstance(node.operation, BiasedAttention) for node in passed.kip_graph.nodes)
    assert any(node.operation is model.attention._query_dense for node in passed.kip_graph.nodes)
    assert_equivalent(model, passed, x)
    other = _rand(7, 5, 3, seed=7)
    np.testing.assert_allclose(passed(other), model(other), atol=1e-5)


class WeightReadEagerly(layers.Layer):
    """Holds its weight in a list beside a non-weight, which the trace does
    not read through: `ops.exp` of it runs eagerly, and the projection is
    called on that concrete tensor."""

    def build(self, shape):
        scale = self.add_weight(shape=(shape[-1],), initializer="ones", name="scale")
        self.params = [scale, "per-feature scale"]
        self.project = layers.Dense(shape[-1], name="project")

    def call(self, x):
        bias = self.project(ops.expand_dims(ops.exp(self.params[0]), 0))  # line read eagerly
        return x + bias


def test_a_weight_read_eagerly_keeps_its_layer_whole_naming_the_weight_and_the_line():
    """The reason a layer stays whole is true (the weight is held, but read
    eagerly) and located: it names the weight and the user's line."""
    x = _rand(4, 3)
    model = Net(WeightReadEagerly(name="block"), name="net")
    model(x)
    passed = kip.apply_passes(kip.convert_to_functional(model, x), [Expand("all")])
    reason = passed.kip_report.opaque["block"]
    assert "scale`" in reason, reason
    assert "test_public_code_idioms.py:" in reason and "line read eagerly" in reason, reason
    assert "not held as an attribute" not in reason
    np.testing.assert_allclose(passed(x), model(x), atol=1e-5)
