"""`kip.to_keras` writes kip's own node kinds (a layer's weight read, a fixed
tensor, a batch-sized `keras.ops` call, a TensorFlow function) with Keras's
classes, so that the file of an expanded model using them loads in a process
without keras_ipu_plugin or the user's code, computing equal outputs; what it
cannot write exactly stays named in the error."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras import ops
from test_to_keras import outputs_loaded_by_keras_alone  # tests/passes/, beside this file

import keras_ipu_plugin as kip
from keras_ipu_plugin.passes.plain_keras_nodes import TF_AS_KERAS_OPS


def _expanded(model, x):
    converted = kip.convert_to_functional(model, (x,))
    return kip.apply_passes(converted, [kip.passes.Expand("all")])


def _kinds(passed):
    return {type(node.operation).__name__ for node in passed.kip_graph.nodes}


class Tokens(keras.layers.Layer):
    """A ViT-style head: a class token broadcast and tiled to the batch, a
    position table, a scale, a frozen offset and a frozen integer index
    (Swin's relative positions) read in `call`, a position embedding of
    `ops.arange`, and batch-sized reshapes (with and without a -1)."""

    def build(self, shape):
        self.cls = self.add_weight(shape=(1, 1, 8), initializer="random_normal", name="cls")
        self.pos = self.add_weight(shape=(5, 8), initializer="random_normal", name="pos")
        self.scale = self.add_weight(shape=(), initializer="random_normal", name="scale")
        self.offset = self.add_weight(shape=(8,), initializer="random_normal", name="offset",
                                      trainable=False)
        self.index = self.add_weight(shape=(5,), initializer="ones", dtype="int32",
                                     name="index", trainable=False)
        self.index.assign(np.array([3, 1, 4, 1, 5], "int32"))
        self.pos_emb = keras.layers.Embedding(5, 8)

    def call(self, x):
        batch = ops.shape(x)[0]
        h = ops.concatenate([ops.broadcast_to(self.cls, (batch, 1, 8)), x], axis=1)
        h = h + self.pos * self.scale + self.offset + self.pos_emb(ops.arange(5))
        h = h * ops.expand_dims(ops.cast(self.index, "float32"), -1)
        h = ops.concatenate([ops.tile(self.cls, (batch, 1, 1)), h], axis=1)
        h = ops.reshape(h, (batch * 2, -1))
        return ops.reshape(ops.reshape(h, (batch, -1, 16)), (batch, 48))


class Head(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.tokens = Tokens()
        self.dense = keras.layers.Dense(3)

    def call(self, x):
        return self.dense(self.tokens(x))


X = np.random.default_rng(0).normal(size=(3, 4, 8)).astype("float32")


def test_weight_reads_fixed_tensors_and_batch_sized_ops_load_without_kip_with_equal_outputs(
        tmp_path):
    keras.utils.set_random_seed(0)
    model = Head()
    passed = _expanded(model, X)
    assert {"VariableRead", "HeldConstant", "BatchSizedOperation"} <= _kinds(passed)
    plain = kip.to_keras(passed)
    assert all(type(layer).__module__.startswith("keras.") for layer in plain.layers)
    for batch in (X, X[:1], np.concatenate([X, X])):  # any batch size, not only the traced one
        np.testing.assert_array_equal(plain(batch), model(batch))
    loaded = outputs_loaded_by_keras_alone(plain, X, tmp_path)
    np.testing.assert_array_equal(np.asarray(loaded["y"][0], "float32"), model(X))
    # The file holds each weight's values (a read's as `(rows, columns)`),
    # trainable as in the user's model: the frozen offset stays frozen.
    tokens = model.tokens
    saved = {weight.path.split("/")[0]: (np.asarray(value, "float32"), trainable)
             for weight, value, trainable in zip(plain.weights, loaded["weights"],
                                                 loaded["trainable"])}
    for name, variable, rows in (("tokens.cls", tokens.cls, 1), ("tokens.pos", tokens.pos, 5),
                                 ("tokens.scale", tokens.scale, 1),
                                 ("tokens.offset", tokens.offset, 1),
                                 ("tokens.index", tokens.index, 1)):
        values, trainable = saved[name]
        np.testing.assert_array_equal(values, np.reshape(variable.numpy(), (rows, -1)))
        assert plain.get_layer(name).weights[0].dtype == variable.dtype
        assert trainable == variable.trainable


def test_a_weight_read_trains_as_the_users_weight():
    """The gradient reaching a read's Embedding is the user's weight's."""
    keras.utils.set_random_seed(0)
    model = Head()
    plain = kip.to_keras(_expanded(model, X))
    with tf.GradientTape(persistent=True) as tape:
        ours, theirs = ops.sum(model(X) ** 2), ops.sum(plain(X) ** 2)
    by_path = {weight.path.split("/")[0]: weight for weight in plain.trainable_weights}
    np.testing.assert_allclose(
        # A lookup's gradient comes as IndexedSlices.
        np.reshape(tf.convert_to_tensor(tape.gradient(theirs, by_path["tokens.cls"])), (1, 1, 8)),
        tape.gradient(ours, model.tokens.cls), rtol=1e-6, atol=1e-6)
    assert "tokens.offset" not in by_path


class Scaled(keras.layers.Layer):
    def build(self, shape):
        self.scale = self.add_weight(shape=(shape[-1],), initializer="random_normal")

    def call(self, x):
        return ops.cast(x, self.compute_dtype) * self.scale


def test_a_mixed_precision_read_keeps_its_dtypes(tmp_path):
    """A float32 weight read under mixed_float16 is float16, stored float32."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8,))
    model = keras.Model(inputs, Scaled(dtype="mixed_float16")(inputs))
    x = X[:, 0]
    plain = kip.to_keras(_expanded(model, x))
    assert plain.weights[0].dtype == "float32"
    np.testing.assert_array_equal(plain(x), model(x))
    loaded = outputs_loaded_by_keras_alone(plain, x, tmp_path)
    assert loaded["dtypes"] == ["float16"]
    np.testing.assert_array_equal(np.asarray(loaded["y"][0], "float16"), model(x))


class TiedHead(keras.layers.Layer):
    """Logits from the token embedding's own matrix (tied weights)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.embed = keras.layers.Embedding(10, 8)

    def call(self, tokens):
        return ops.matmul(self.embed(tokens), ops.transpose(self.embed.embeddings))


def test_a_weight_another_layer_holds_is_named_not_untied():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,), dtype="int32")
    model = keras.Model(inputs, TiedHead(name="tied")(inputs))
    tokens = np.arange(8, dtype="int32").reshape(2, 4)
    with pytest.raises(kip.PassError, match=r"`tied\.[\w.]*` \(VariableRead: reads the weight "
                       r"`[\w/]*embeddings` that `tied.embed` also holds.*train apart"):
        kip.to_keras(_expanded(model, tokens))


class Unwritable(keras.layers.Layer):
    def call(self, x):
        repeated = ops.repeat(x, ops.shape(x)[0], axis=1)  # sized by the batch, not at axis 0
        return repeated, tf.math.cumsum(x, axis=-1)


def test_what_keras_cannot_write_exactly_is_named():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4, 8))
    model = keras.Model(inputs, Unwritable(name="odd")(inputs))
    with pytest.raises(kip.PassError) as raised:
        kip.to_keras(_expanded(model, X))
    message = str(raised.value)
    assert "`odd.repeat` (BatchSizedOperation: sizes `Repeat`'s repeats by the batch)" in message
    assert "`odd.tf_cumsum` (TFFunction: calls `tf.math.cumsum`, which has no exact " in message


class Widened(keras.layers.Layer):
    def call(self, x):
        return tf.math.multiply(x, np.array(2.0))  # TensorFlow: float32; keras.ops: float64


def test_a_keras_form_of_another_dtype_is_refused_naming_the_node():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8,))
    model = keras.Model(inputs, Widened(name="widened")(inputs))
    with pytest.raises(kip.PassError, match=r"`widened.tf_multiply` \(TFFunction\) written with "
                       r"Keras's classes gives dtype float64 where the graph has float32"):
        kip.to_keras(_expanded(model, X[:, 0]))


class EveryTableEntry(keras.layers.Layer):
    """Calls each TensorFlow function of `TF_AS_KERAS_OPS` once."""

    def call(self, image):  # (batch, 5, 6, 2)
        x = ops.reshape(image, (ops.shape(image)[0], 60)) * 0.5
        positive = x * x + 0.5
        results = [
            tf.math.square(x), tf.math.exp(x), tf.math.log(positive), tf.math.sqrt(positive),
            tf.math.sin(x), tf.math.cos(x), tf.math.tanh(x), tf.math.negative(x),
            tf.math.sigmoid(x), tf.nn.relu(x),
            tf.cast(tf.math.logical_not(x > 0), "float32"),
            tf.cast(tf.math.logical_and(x > 0, x < 0.3), "float32"),
            tf.cast(tf.math.logical_or(x > 0.3, x < -0.3), "int32"),
            tf.math.add(x, 1.5), tf.math.subtract(x, positive), tf.math.multiply(x, positive),
            tf.math.maximum(x, 0.1), tf.math.minimum(x, positive),
            tf.concat([x, positive], axis=-1), tf.reshape(x, [-1, 6, 10]),
            tf.transpose(tf.reshape(x, [-1, 6, 10]), [0, 2, 1]), tf.expand_dims(x, 1),
            tf.stop_gradient(x), tf.nn.softmax(x), tf.nn.softmax(x, axis=0),
            tf.image.crop_to_bounding_box(image, 1, 2, 3, 2),
            tf.image.pad_to_bounding_box(image, 1, 0, 7, 8),
            tf.image.extract_patches(image, [1, 2, 3, 1], [1, 2, 3, 1], [1, 1, 1, 1], "VALID"),
        ]
        return results


def test_every_table_entry_loads_without_kip_with_equal_outputs(tmp_path):
    """Each TensorFlow function of the table is written with its keras.ops
    form; the file loads without kip and computes the very same values."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((5, 6, 2))
    model = keras.Model(inputs, EveryTableEntry(name="table")(inputs))
    image = np.random.default_rng(1).normal(size=(3, 5, 6, 2)).astype("float32")
    image[0, 0, 0, 0], image[1, 2, 3, 1] = np.inf, np.nan  # moved, never multiplied
    passed = _expanded(model, image)
    recorded = {node.operation.function for node in passed.kip_graph.nodes
                if type(node.operation).__name__ == "TFFunction"}
    assert recorded == set(TF_AS_KERAS_OPS)
    plain = kip.to_keras(passed)
    expected = [np.asarray(y) for y in model(image)]
    for got, want in zip(plain(image), expected):
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(got, want)
    loaded = outputs_loaded_by_keras_alone(plain, image, tmp_path)
    assert loaded["dtypes"] == [str(y.dtype) for y in expected]
    for got, want in zip(loaded["y"], expected):
        np.testing.assert_array_equal(np.asarray(got, want.dtype), want)
