"""Expand on constructs of public architectures: each test a small hand-written model with the one construct
a corpus model showed failing.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_ipu_plugin as kip
from keras import ops
from keras_ipu_plugin.passes import Expand
from keras_ipu_plugin.layers.layer_kinds import is_expandable

layers = keras.layers


def _rng():
    return np.random.default_rng(0)


def _expand_all(model, x):
    converted = kip.convert_to_functional(model, (x,))
    return kip.apply_passes(converted, [Expand("all")])


def _classes(model):
    return [type(node.operation).__name__ for node in model.kip_graph.nodes]


def _gradients(model, x, variables):
    with tf.GradientTape() as tape:
        y = model(x)
        loss = tf.reduce_sum(y * tf.range(1.0, 1.0 + float(y.shape[-1])))
    return [np.asarray(tf.convert_to_tensor(g))
            for g in tape.gradient(loss, [v.value for v in variables])]


# -- built-in means exported by keras.layers ----------------------------------------
def test_layers_not_exported_by_keras_layers_are_expandable():
    from keras.src.applications.convnext import LayerScale

    class MyDense(layers.Dense):
        pass

    assert not is_expandable(layers.Dense(2))
    assert not is_expandable(layers.LayerNormalization())
    assert is_expandable(MyDense(2))  # a user's subclass is user code
    assert is_expandable(LayerScale(0.5, 3))  # model code shipped inside Keras


def test_a_keras_applications_layer_reading_its_own_weight_expands_with_equal_gradients():
    # ConvNeXt's LayerScale (`x * self.gamma`) lives in keras.src.applications,
    # not in keras.layers: it was left whole by Expand("all"), with no reason.
    from keras.src.applications.convnext import LayerScale

    inputs = keras.Input((4, 4, 3))
    scale = LayerScale(0.5, 3, name="scale")
    model = keras.Model(inputs, scale(layers.Conv2D(3, 1, name="conv")(inputs)))
    x = _rng().normal(size=(2, 4, 4, 3)).astype("float32")
    passed = _expand_all(model, x)
    assert "LayerScale" not in _classes(passed)
    assert "VariableRead" in _classes(passed)
    np.testing.assert_allclose(passed(x), model(x), atol=1e-6)
    for got, want in zip(_gradients(passed, x, model.trainable_variables),
                         _gradients(model, x, model.trainable_variables)):
        np.testing.assert_allclose(got, want, atol=1e-5)


# -- a sub-layer returning None among its outputs ---------------------------------
class AttentionWithCache(layers.Layer):
    """Returns `(output, cache)`, the cache None when none is given (as
    keras_hub's T5MultiHeadAttention does)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = layers.Dense(4, name="dense")

    def call(self, x, cache=None):
        output = self.dense(x)
        if cache is not None:
            cache = cache + output
        return output, cache


class CacheBlock(layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.attention = AttentionWithCache(name="attention")
        self.norm = layers.LayerNormalization(name="norm")

    def call(self, x):
        y, cache = self.attention(x)
        return self.norm(x + y)


class CacheNet(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.block = CacheBlock(name="block")
        self.head = layers.Dense(3, name="head")

    def call(self, x):
        return self.head(self.block(x))


def test_a_block_whose_sub_layer_returns_none_among_its_outputs_expands():
    # T5's transformer layer calls an attention returning (output, None):
    # Keras's node rejects a None output, so the layer could not be
    # expanded, and Replace could not reach the norms inside it.
    x = _rng().normal(size=(2, 5, 4)).astype("float32")
    model = CacheNet(name="cache_net")
    model(x)
    converted = kip.convert_to_functional(model, (x,))
    one_level = kip.apply_passes(converted, [Expand("block")])
    node = one_level.kip_graph.node("block.attention")
    assert node.output_structure == (0, None)
    np.testing.assert_allclose(one_level(x), model(x), atol=1e-6)
    everything = kip.apply_passes(converted, [Expand("all")])
    assert {"CacheBlock", "AttentionWithCache"}.isdisjoint(_classes(everything))
    np.testing.assert_allclose(everything(x), model(x), atol=1e-6)
    for got, want in zip(_gradients(one_level, x, model.trainable_variables),
                         _gradients(model, x, model.trainable_variables)):
        np.testing.assert_allclose(got, want, atol=1e-5)


def test_a_sub_layer_returning_none_keeps_its_own_name_when_free(tmp_path):
    # Expanded layers keep their own Keras names unless taken; the alias a
    # None-returning call goes through was named after its path instead.
    x = _rng().normal(size=(2, 5, 4)).astype("float32")
    model = CacheNet(name="cache_net")
    model(x)
    passed = kip.apply_passes(kip.convert_to_functional(model, (x,)), [Expand("block")])
    alias = passed.get_layer("attention")
    assert isinstance(alias, kip.LayerAlias) and alias.tensor_outputs_only
    assert alias.layer is model.block.attention
    assert passed.kip_layer("block.attention") is model.block.attention
    np.testing.assert_allclose(passed(x), model(x), atol=1e-6)
    path = str(tmp_path / "passed.keras")
    passed.save(path)
    loaded = keras.models.load_model(path, custom_objects={
        "AttentionWithCache": AttentionWithCache, "CacheBlock": CacheBlock, "CacheNet": CacheNet})
    np.testing.assert_allclose(loaded(x), model(x), atol=1e-6)


# -- Replace of a layer whose config Keras cannot generate ----------------------------
class ScaleNorm(layers.Layer):
    """As keras_hub's T5LayerNorm: no `get_config`, made with a dtype
    policy object (which Keras cannot put in a generated config)."""

    def __init__(self, epsilon=1e-6, **kwargs):
        super().__init__(**kwargs)
        self.epsilon = epsilon

    def build(self, input_shape):
        self.weight = self.add_weight(shape=(input_shape[-1],), initializer="ones", name="weight")

    def call(self, x):
        variance = keras.ops.mean(keras.ops.square(x), axis=-1, keepdims=True)
        return self.weight * x * keras.ops.rsqrt(variance + self.epsilon)


class NormBlock(layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = layers.Dense(4, name="dense")
        self.norm = ScaleNorm(0.5, dtype=self.dtype_policy, name="norm")

    def call(self, x):
        return self.norm(self.dense(x))


class NewScaleNorm(ScaleNorm):
    pass


def test_replace_makes_a_layer_whose_config_keras_cannot_generate_from_its_attributes():
    x = _rng().normal(size=(2, 4)).astype("float32")
    inputs = keras.Input((4,))
    block = NormBlock(name="block")
    model = keras.Model(inputs, block(inputs))
    block.norm.weight.assign([1.0, 2.0, 3.0, 4.0])

    def copy(old, new):
        new.weight.assign(old.weight)

    replace = kip.passes.Replace({ScaleNorm: kip.passes.Replacement(NewScaleNorm, copy_weights_fn=copy)})
    passed = kip.apply_passes(kip.convert_to_functional(model, (x,)), [replace])
    new = [node.operation for node in passed.kip_graph.nodes if isinstance(node.operation, NewScaleNorm)]
    assert len(new) == 1 and new[0].epsilon == 0.5
    np.testing.assert_allclose(passed(x), model(x), atol=1e-6)


# -- Keras masks across expanded layers --------------------------------------------
class PaddingEmbedding(layers.Layer):
    """Token plus position embeddings; `compute_mask` marks padding (as the
    Keras translation example's PositionalEmbedding)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.tokens = layers.Embedding(10, 4, name="tokens")
        self.positions = layers.Embedding(6, 4, name="positions")

    def call(self, ids):
        return self.tokens(ids) + self.positions(keras.ops.arange(keras.ops.shape(ids)[-1]))

    def compute_mask(self, ids, mask=None):
        return keras.ops.not_equal(ids, 0)


class MaskedAttention(layers.Layer):
    """Turns the mask Keras hands its `call` into an attention mask."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.attention = layers.MultiHeadAttention(num_heads=2, key_dim=4, name="attention")
        self.norm = layers.LayerNormalization(name="norm")
        self.supports_masking = True

    def call(self, x, mask=None):
        attention_mask = None if mask is None else keras.ops.cast(mask[:, None, :], "int32")
        return self.norm(x + self.attention(x, x, attention_mask=attention_mask))


class MaskedNet(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.embedding = PaddingEmbedding(name="embedding")
        self.block = MaskedAttention(name="block")
        self.head = layers.Dense(3, name="head")

    def call(self, ids):
        return self.head(self.block(self.embedding(ids)))


def test_expanded_layers_receive_and_attach_the_masks_keras_passes_between_layers():
    # Expanded, the embedding's `compute_mask` was lost and the block's
    # `call` was traced with mask=None: padding was attended to, and the
    # expanded model's outputs were silently off.
    ids = _rng().integers(1, 10, size=(4, 6))
    ids[:, 4:] = 0
    model = MaskedNet(name="masked")
    want = model(ids)
    passed = _expand_all(model, ids)
    assert {"PaddingEmbedding", "MaskedAttention"}.isdisjoint(_classes(passed))
    got = passed(ids)
    np.testing.assert_allclose(got, want, atol=1e-5)
    # the output carries the mask (a loss would be masked with it) as before
    np.testing.assert_array_equal(np.asarray(got._keras_mask), np.asarray(want._keras_mask))
    for got_g, want_g in zip(_gradients(passed, ids, model.trainable_variables),
                             _gradients(model, ids, model.trainable_variables)):
        np.testing.assert_allclose(got_g, want_g, atol=1e-5)


# -- layers that stay whole say what blocks them ---------------------------------------
class TensorFlowDistance(layers.Layer):
    """Computes with a TensorFlow function that is not recorded as a graph
    operation, a random one (the siamese example's `tf.square` is recorded:
    test_tracing_idioms)."""

    def call(self, a, b):
        return keras.ops.sum(a - b + tf.random.stateless_normal(tf.shape(a), (1, 2)), -1)


class DataSizedSum(layers.Layer):
    """Sums into as many segments as the data says (as the Keras GAT
    example's `num_segments=ops.max(edges[:, 0]) + 1`)."""

    def call(self, values, segments):
        return keras.ops.segment_sum(values, segments, num_segments=keras.ops.max(segments) + 1)


def _reason_left(model, x, cls):
    passed = _expand_all(model, x)
    nodes = [node for node in passed.kip_graph.nodes
             if isinstance(getattr(node.operation, "layer", node.operation), cls)]
    assert len(nodes) == 1
    return nodes[0].opaque_reason or passed.kip_report.opaque[nodes[0].name]


def test_a_layer_computing_with_tensorflow_functions_stays_whole_with_the_line_to_rewrite():
    a, b = keras.Input((3,)), keras.Input((3,))
    model = keras.Model([a, b], TensorFlowDistance(name="distance")(a, b))
    x = [_rng().normal(size=(2, 3)).astype("float32") for _ in range(2)]
    reason = _reason_left(model, x, TensorFlowDistance)
    assert "TensorFlow function" in reason and "tf.random.stateless_normal(tf.shape(a), (1, 2))" in reason
    assert "keras.ops" in reason


def test_a_layer_sized_by_tensor_values_expands_to_keras_own_operation():
    """A size only the data knows (`num_segments=ops.max(segments) + 1`)
    stayed whole; it is now a `TensorSizedOperation` node, so the layer
    expands and the graph follows the data's size at every call."""
    values, segments = keras.Input((), batch_size=5), keras.Input((), batch_size=5, dtype="int32")
    model = keras.Model([values, segments], DataSizedSum(name="sum")(values, segments))
    x = [np.arange(5, dtype="float32"), np.array([0, 0, 1, 1, 2], "int32")]
    passed = _expand_all(model, x)
    assert "DataSizedSum" not in _classes(passed)
    assert "TensorSizedOperation" in _classes(passed)
    more_segments = [np.arange(5, dtype="float32"), np.array([0, 1, 2, 3, 3], "int32")]
    np.testing.assert_allclose(passed(more_segments), model(more_segments))
    assert np.asarray(passed(more_segments)).shape == (4,)


class CacheFirstAttention(layers.Layer):
    """Returns `(cache, output)`, the cache None: a None before the tensor."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = layers.Dense(4, name="dense")

    def call(self, x):
        return None, self.dense(x)


class BatchSizedCacheBlock(layers.Layer):
    """Uses the batch size (so the trace replays the block's shapes at other
    batch sizes) around a sub-layer returning None among its outputs."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.attention = CacheFirstAttention(name="attention")
        self.norm = layers.LayerNormalization(name="norm")

    def call(self, x):
        _, y = self.attention(x)
        ones = keras.ops.ones((keras.ops.shape(x)[0], 1, 4))
        return self.norm(x + y * ones)


def test_a_batch_sized_block_around_a_sub_layer_returning_none_first_expands():
    # The shape replay at other batch sizes met the None leaf (T5's decoder):
    # `'NoneType' object has no attribute 'shape'`, or shapes paired with
    # the wrong outputs.
    x = _rng().normal(size=(2, 5, 4)).astype("float32")
    inputs = keras.Input((5, 4))
    block = BatchSizedCacheBlock(name="block")
    model = keras.Model(inputs, block(inputs))
    passed = kip.apply_passes(model, [Expand("all")])
    assert {"BatchSizedCacheBlock", "CacheFirstAttention"}.isdisjoint(_classes(passed))
    for batch in (2, 3):
        other = _rng().normal(size=(batch, 5, 4)).astype("float32")
        np.testing.assert_allclose(passed(other), model(other), atol=1e-6)


# -- keras_hub's XLNet: a two-stream encoder -------------------------------------------
class TwoStreamAttention(layers.MultiHeadAttention):
    """keras_hub's XLNet `TwoStreamRelativeAttention`: a `MultiHeadAttention`
    subclass with a `call` of its own (`content_stream=`, ...), so the
    `compute_output_spec` it inherits refuses its arguments; its queries
    come from an `EinsumDense(output_shape=(None, heads, dim))`, whose spec
    leaves the sequence length unknown, and `call` computes with that
    length (`_rel_shift`'s `ops.shape(x)[1] - 1`)."""

    def build(self, shape):
        self.stream_query = layers.EinsumDense(
            "btd,dnh->btnh", output_shape=(None, 2, 2), name="stream_query")
        self.stream_query.build(shape)
        self.built = True

    def call(self, content_stream, query_stream=None):
        query = self.stream_query(content_stream)
        length = ops.shape(query)[1]
        shifted = ops.reshape(query, (-1, length * 4))[:, : (length - 1) * 4]
        content = ops.reshape(ops.pad(shifted, [[0, 0], [0, 4]]), (-1, length, 4))
        return content, None if query_stream is None else query_stream + content


class TwoStreamEncoder(layers.Layer):
    """keras_hub's `XLNetEncoder`: returns `(content, query)`, the query
    None when no query stream is given, while its `compute_output_shape`
    states two outputs, so a functional model has a second output that
    its `call` returns as None (and that the model never reads)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.attention = TwoStreamAttention(num_heads=2, key_dim=2, name="attention")
        self.norm = layers.LayerNormalization(name="norm")

    def call(self, content, query=None):
        content_out, query_out = self.attention(content_stream=content, query_stream=query)
        content_out = self.norm(content + content_out)
        if query_out is None:
            return content_out, None
        return content_out, self.norm(query + query_out)

    def compute_output_shape(self, content_shape, query_shape=None):
        return content_shape, content_shape


def _two_stream_model():
    inputs = keras.Input((5, 4))
    content, _ = TwoStreamEncoder(name="encoder")(inputs)
    return keras.Model(inputs, layers.Dense(3, name="head")(content), name="xlnet_like")


def test_an_attention_subclass_with_its_own_call_signature_expands_inside_its_block():
    # The block calling it stayed whole: `MultiHeadAttention.compute_output_spec()
    # got an unexpected keyword argument 'content_stream'`.
    x = _rng().normal(size=(2, 5, 4)).astype("float32")
    model = _two_stream_model()
    passed = _expand_all(model, x)
    assert {"TwoStreamEncoder", "TwoStreamAttention"}.isdisjoint(_classes(passed)), \
        passed.kip_report.opaque
    for batch in (2, 3):
        other = _rng().normal(size=(batch, 5, 4)).astype("float32")
        np.testing.assert_allclose(passed(other), model(other), atol=1e-5)
    for got, want in zip(_gradients(passed, x, model.trainable_variables),
                         _gradients(model, x, model.trainable_variables)):
        np.testing.assert_allclose(got, want, atol=1e-5)


def test_a_layer_output_returned_as_none_and_never_read_expands():
    # The encoder's node has two outputs; its `call` returns one tensor and
    # None: "`call` traced to 1 outputs but the layer produced 2".
    x = _rng().normal(size=(2, 5, 4)).astype("float32")
    model = _two_stream_model()
    passed = kip.apply_passes(kip.convert_to_functional(model, (x,)), [Expand("encoder")])
    assert "TwoStreamEncoder" not in _classes(passed), passed.kip_report.opaque
    np.testing.assert_allclose(passed(x), model(x), atol=1e-5)


def test_a_layer_output_returned_as_none_but_read_stays_whole_saying_so():
    inputs = keras.Input((5, 4))
    content, query = TwoStreamEncoder(name="encoder")(inputs)
    model = keras.Model(inputs, layers.Add(name="add")([content, query]))
    x = _rng().normal(size=(2, 5, 4)).astype("float32")
    converted = kip.convert_to_functional(model, (x,), verify=False)
    passed = kip.apply_passes(converted, [Expand("encoder")], verify=False)
    reason = passed.kip_report.opaque["encoder"]
    assert "returns None as output 1" in reason and "`add` reads it" in reason


# -- keras_hub's DINOv2 embedding: its own output spec takes no `training` ----------
class OwnSpecEmbedding(layers.Layer):
    """keras_hub's `DINOV2Embedding`: `call(inputs, training=None)` and a
    `compute_output_spec(inputs)` of its own, without `training`."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = layers.Dense(8, name="dense")
        self.dropout = layers.Dropout(0.5, name="dropout")

    def call(self, inputs, training=None):
        return self.dropout(self.dense(inputs), training=training)

    def compute_output_spec(self, inputs):
        return keras.KerasTensor(inputs.shape[:-1] + (8,), dtype=self.compute_dtype)


class OwnSpecNet(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.embedding = OwnSpecEmbedding(name="embedding")
        self.head = layers.Dense(2, name="head")

    def call(self, x, training=None):
        return self.head(self.embedding(x))


def test_a_layer_whose_own_output_spec_takes_no_training_argument_traces():
    # Traced under a training mode, Keras handed the layer's own
    # `compute_output_spec` a `training` argument it does not take, and the
    # whole model stayed one opaque node.
    x = _rng().normal(size=(2, 5, 4)).astype("float32")
    model = OwnSpecNet(name="own_spec")
    model(x)
    passed = _expand_all(model, x)
    assert passed.kip_report.opaque == {}, passed.kip_report.opaque
    assert {"OwnSpecNet", "OwnSpecEmbedding"}.isdisjoint(_classes(passed))
    np.testing.assert_allclose(passed(x), model(x), atol=1e-6)
    for got, want in zip(_gradients(passed, x, model.trainable_variables),
                         _gradients(model, x, model.trainable_variables)):
        np.testing.assert_allclose(got, want, atol=1e-5)


class _GraphConv(layers.Layer):
    """Graph convolution as keras.io's GNN examples call it: node features
    in a tuple with the graph's edges and weights, NumPy arrays the model holds."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = layers.Dense(4)

    def call(self, inputs):
        x, edges, weights = inputs
        messages = ops.take(self.dense(x), edges[:, 1], axis=0) * ops.expand_dims(weights, -1)
        return ops.segment_sum(messages, edges[:, 0], num_segments=6)


class _GraphNet(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.edges = np.array([[0, 1], [1, 2], [2, 3], [3, 4], [4, 5], [5, 0]], "int32")
        self.edge_weights = np.linspace(0.5, 1.0, 6).astype("float32")
        self.conv1 = _GraphConv()
        self.head = layers.Dense(2)

    def call(self, x):
        return self.head(self.conv1((x, self.edges, self.edge_weights)))


def test_a_layer_called_on_a_tuple_mixing_a_tensor_and_arrays_expands():
    """Keras refuses a symbolic nest mixing tensors and arrays; `__call__`
    turns the arrays into tensors first, and Expand reads the call as it does."""
    keras.utils.set_random_seed(0)
    model = _GraphNet()
    x = np.random.default_rng(0).normal(size=(6, 3)).astype("float32")
    passed = kip.apply_passes(kip.convert_to_functional(model, x), [Expand("all")])
    names = [node.name for node in passed.kip_graph.nodes]
    assert "conv1.dense" in names and "conv1" not in names
    np.testing.assert_allclose(passed(x), model(x), rtol=1e-6, atol=1e-6)


class _FastDense(layers.Dense):
    """A stand-in for an accelerator's Dense, for Replace."""


class GraphConvLayer(_GraphConv):
    """`_GraphConv` under a class name Keras's `fit` takes: a layer named
    `_graph_conv` is a root scope name TensorFlow refuses in a function."""


class GNNNodeClassifier(_GraphNet):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.conv1 = GraphConvLayer(name="graph_conv")


_MIXED_CALL_PASSES = {
    "replace_inside": lambda: [kip.passes.Replace(
        {"conv1.dense": kip.passes.Replacement(_FastDense, copy_weights=True)}, strict=True)],
    "replace_class": lambda: [kip.passes.Replace(
        {layers.Dense: kip.passes.Replacement(_FastDense, copy_weights=True)}, strict=True)],
    "outline": lambda: [kip.passes.Outline(["conv1"])],
    "expand_outline": lambda: [Expand("all"), kip.passes.Outline(["conv1.dense", "head"])],
    "recompute": lambda: [kip.passes.Recompute(["conv1"])],
    "recompute_inside": lambda: [kip.passes.Recompute(["conv1.dense"])],
    "recompute_auto": lambda: [kip.passes.Recompute(auto=True)],
    "stages": lambda: [kip.passes.PipelineStages(["head"])],
    "stages_counted": lambda: [Expand("all"), kip.passes.PipelineStages(num_stages=2)],
}


@pytest.mark.parametrize("passes", sorted(_MIXED_CALL_PASSES))
def test_every_pass_runs_on_a_layer_called_on_a_tuple_mixing_a_tensor_and_arrays(passes):
    """Replace, Outline, Recompute and PipelineStages on the graph network
    (a layer of a class named `_GraphConv`, called on node features with the
    model's NumPy edges): the passed model computes the original's outputs
    and gradients, and `fit` trains it to plain Keras's weights."""
    x = np.random.default_rng(0).normal(size=(6, 3)).astype("float32")
    y = np.random.default_rng(1).normal(size=(6, 2)).astype("float32")
    keras.utils.set_random_seed(0)
    model = _GraphNet()
    passed = kip.apply_passes(kip.convert_to_functional(model, x), _MIXED_CALL_PASSES[passes]())
    if passes.startswith("replace"):
        assert any(isinstance(node.operation, _FastDense) for node in passed.kip_graph.nodes)
        assert "not reached" not in str(passed.kip_report)
    np.testing.assert_allclose(passed(x), model(x), rtol=1e-6, atol=1e-6)
    for got, want in zip(_gradients(passed, x, passed.trainable_variables),
                         _gradients(model, x, model.trainable_variables)):
        np.testing.assert_allclose(got, want, atol=1e-5)
    weights = {}
    for how in ("plain", "plugin"):
        keras.utils.set_random_seed(0)
        fresh = GNNNodeClassifier()
        fresh(x)
        trainee = fresh if how == "plain" else kip.PluginModel(
            fresh, passes=_MIXED_CALL_PASSES[passes]())
        trainee.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        trainee.fit(x, y, batch_size=6, epochs=3, shuffle=False, verbose=0)
        weights[how] = [v.numpy() for v in fresh.trainable_variables]
    if not passes.startswith("replace"):  # Replace trains the new layers' copies
        for got, want in zip(weights["plugin"], weights["plain"]):
            np.testing.assert_allclose(got, want, atol=1e-5)


@pytest.mark.parametrize("passes", [["conv1"], ["conv1.dense", "head"]])
def test_outline_runs_layers_whose_names_start_with_an_underscore(passes):
    """An outlined body is traced in a function of its own, where a layer's
    name scope would be a root scope: a layer of a class `_GraphConv`
    (`__graph_conv`) runs outlined, and the report's op count is made."""
    keras.utils.set_random_seed(0)
    model = _GraphNet()
    x = np.random.default_rng(0).normal(size=(6, 3)).astype("float32")
    before = [Expand("all")] if "." in passes[0] else []
    passed = kip.apply_passes(kip.convert_to_functional(model, x),
                              before + [kip.passes.Outline(passes)])
    np.testing.assert_allclose(passed(x), model(x), rtol=1e-6, atol=1e-6)
    assert "train graph ops with outlining" in passed.kip_report.metrics
