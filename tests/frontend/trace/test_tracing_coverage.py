"""Tests for what the tracer captures of real-world Keras code.

- Variables a layer reads in its own `call` are graph nodes (`VariableRead`):
  traced, expanded, trained like the original, never frozen.
- Tensors a model holds, and sub-layers called on tensors made inside
  `call`, are graph nodes (`HeldConstant`) rather than frozen results.
- Optional (None) and keyword tensor arguments trace and expand.
- Views of user layers behave like the layers.
- Code that uses the batch size traces to a graph that runs at any batch
  size, or stays whole with a report line that says what to do.

Each model is compared with the original (outputs and gradients, and
weights after SGD steps with verification off, where a frozen weight would
show) rather than with hard-coded values.
"""

import numpy as np
import pytest
import tensorflow as tf

import keras
from keras import layers
from keras import ops

import keras_ipu_plugin as kip
from keras_ipu_plugin.passes import Expand

from graph_checks import assert_equivalent, custom_layers_left, fully_traced  # tests/ is on sys.path


# -- helpers -------------------------------------------------------------------
def _rand(*shape, seed=0):
    return np.random.RandomState(seed).normal(size=shape).astype("float32")



def expand_all(model, converted, x):
    passed = kip.apply_passes(converted, [Expand()])
    assert custom_layers_left(passed) == []
    assert passed.kip_report.opaque == {}, passed.kip_report.opaque
    assert_equivalent(model, passed, x)
    return passed


def twin(make, x):
    """Two models from `make()` with equal weights, both built on `x`."""
    first, second = make(), make()
    first(x)
    second(x)
    second.set_weights(first.get_weights())
    return first, second


def sgd_steps(model, x, y, steps=3):
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    for _ in range(steps):
        model.train_on_batch(x, y)


def assert_trains_like_keras(make, x, **convert_kwargs):
    """With verification off (nothing to catch a frozen weight), SGD steps
    through the converted model move every variable exactly as plain Keras
    moves its twin's."""
    plain, mine = twin(make, x)
    y = np.asarray(keras.tree.flatten(plain(x))[0]) * 0.0 + 1.0
    converted = kip.convert_to_functional(mine, x, verify=False, **convert_kwargs)
    sgd_steps(plain, x, y)
    before = [np.array(v) for v in mine.trainable_variables]
    sgd_steps(converted, x, y)
    for variable, start, expected in zip(
        mine.trainable_variables, before, plain.trainable_variables, strict=True
    ):
        assert not np.array_equal(np.array(variable), start), f"{variable.path} never moved"
        np.testing.assert_allclose(
            np.array(variable), np.array(expected), rtol=1e-5, atol=1e-6,
            err_msg=variable.path,
        )
    return converted


def outputs_and_gradients(model, x, variables):
    with tf.GradientTape() as tape:
        outputs = model(x)
        scalar = tf.reduce_sum(tf.cast(outputs, "float32") * _rand(*outputs.shape[1:], seed=5))
    return outputs, tape.gradient(scalar, [v.value for v in variables])


def is_a(node, class_name):
    # By name: these tests also run against a library without the class.
    return type(node.operation).__name__ == class_name


def reads_of(model):
    return [node for node in model.kip_graph.nodes if is_a(node, "VariableRead")]


# -- 1. variables read in `call` -----------------------------------------------
class LayerScale(layers.Layer):
    """ConvNeXt's LayerScale: a Dense sub-layer times the layer's own weight."""

    def __init__(self, units, **kwargs):
        super().__init__(**kwargs)
        self.units = units
        self.dense = layers.Dense(units, name="dense")
        self.norm = layers.LayerNormalization(name="norm")

    def build(self, shape):
        self.gamma = self.add_weight(
            shape=(self.units,), initializer=keras.initializers.Constant(0.5), name="gamma"
        )

    def call(self, x):
        return self.norm(self.dense(x)) * self.gamma


class ScaledModel(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.block = LayerScale(6, name="block")
        self.head = layers.Dense(2, name="head")

    def call(self, x):
        return self.head(self.block(x))


def test_layer_reading_its_own_weight_expands_into_a_variable_read():
    model, x = ScaledModel(name="scaled"), _rand(4, 5)
    model(x)
    converted = kip.convert_to_functional(model, x)
    fully_traced(converted)
    passed = expand_all(model, converted, x)
    [read] = reads_of(passed)
    assert read.name == "block.gamma"
    assert read.operation.variable is model.block.gamma  # the same object
    # Tracked exactly once: the optimizer sees it, and only once.
    ids = [id(v) for v in passed.trainable_variables]
    assert ids.count(id(model.block.gamma)) == 1
    assert len(ids) == len(set(ids)) == len(model.trainable_variables)


def test_replace_reaches_the_sub_layers_of_a_layer_that_owns_a_weight():
    model, x = ScaledModel(name="scaled"), _rand(4, 5)
    model(x)
    converted = kip.convert_to_functional(model, x)
    passed = kip.apply_passes(converted, [Expand(), kip.passes.Replace({
        layers.LayerNormalization: kip.passes.Replacement(
            layers.LayerNormalization, copy_weights=True)})])
    node = passed.kip_graph.node("block.norm")
    assert isinstance(node.operation, layers.LayerNormalization)
    assert node.operation is not model.block.norm
    kip.frontend.verify.equivalence.check_equivalent(model, passed, x, gradients=False)


class Temperature(keras.Model):
    """A learned temperature: `logits / exp(log_temp)`, the weight read by
    the model's own `call`. Converting it once froze `log_temp`."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.logits = layers.Dense(3, name="logits")
        self.log_temp = self.add_weight(
            shape=(), initializer=keras.initializers.Constant(0.3), name="log_temp"
        )

    def call(self, x):
        return self.logits(x) / ops.exp(self.log_temp)


def test_model_reading_a_temperature_trains_it_like_keras_without_verification():
    x = _rand(6, 4)
    converted = assert_trains_like_keras(lambda: Temperature(name="temperature"), x)
    fully_traced(converted)
    assert [n.name for n in reads_of(converted)] == ["log_temp"]


class LatentArray(keras.Model):
    """Perceiver's latent array: variables kept in a list, read in `call`."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.encode = layers.Dense(4, name="encode")
        self.latents = [
            self.add_weight(shape=(3, 4), initializer="random_normal", name=f"latent_{i}")
            for i in range(2)
        ]

    def call(self, x):
        scores = ops.matmul(self.encode(x), ops.transpose(self.latents[0]))
        return ops.matmul(ops.softmax(scores), self.latents[1])


def test_latent_arrays_in_a_list_are_read_in_the_graph_and_train_like_keras():
    x = _rand(5, 6)
    model = LatentArray(name="latent")
    model(x)
    converted = kip.convert_to_functional(model, x)
    fully_traced(converted)
    assert {n.name for n in reads_of(converted)} == {"latents_0", "latents_1"}
    assert_equivalent(model, converted, x)
    assert_trains_like_keras(lambda: LatentArray(name="latent"), x)


class ClassToken(keras.Model):
    """ViT: a CLS token broadcast to the batch, a position table sliced to
    the sequence length, both the model's own weights."""

    def __init__(self, dim=8, **kwargs):
        super().__init__(**kwargs)
        self.dim = dim
        self.patches = layers.Dense(dim, name="patches")
        self.cls = self.add_weight(shape=(1, 1, dim), initializer="random_normal", name="cls")
        self.position_embeddings = self.add_weight(
            shape=(16, dim), initializer="random_normal", name="position_embeddings"
        )
        self.norm = layers.LayerNormalization(name="norm")
        self.head = layers.Dense(2, name="head")

    def call(self, x):
        h = self.patches(x)
        cls = ops.broadcast_to(self.cls, (ops.shape(h)[0], 1, self.dim))
        h = ops.concatenate([cls, h], axis=1)
        h = h + ops.slice(self.position_embeddings, (0, 0), (ops.shape(h)[1], self.dim))
        h = self.norm(h)
        return self.head(h[:, 0] + ops.mean(h[:, 1:], axis=1))


def test_cls_token_and_position_table_trace_and_run_at_any_batch_size():
    x = _rand(4, 5, 3)
    model = ClassToken(name="vit")
    model(x)
    converted = kip.convert_to_functional(model, x)
    fully_traced(converted)
    assert {n.name for n in reads_of(converted)} == {"cls", "position_embeddings"}
    other = _rand(7, 5, 3, seed=1)  # a batch of another size
    np.testing.assert_allclose(converted(other), model(other), atol=1e-5)
    assert_trains_like_keras(lambda: ClassToken(name="vit"), x)


class Counter(layers.Layer):
    """Counts its calls in a variable: forward state, a write node since
    (it once stayed opaque)."""

    def build(self, shape):
        self.calls = self.add_weight(shape=(), dtype="int32", initializer="zeros",
                                     trainable=False, name="calls")
        self.scale = self.add_weight(shape=(shape[-1],), initializer="ones", name="scale")

    def call(self, x):
        self.calls.assign_add(1)
        return x * self.scale


class ReadsInPython(layers.Layer):
    """Reads its weight's value in Python: cannot be a graph of layers."""

    def build(self, shape):
        self.scale = self.add_weight(shape=(), initializer="ones", name="scale")

    def call(self, x):
        if self.scale.numpy() > 0:
            return x * self.scale
        return x


class ReadsThroughWeights(layers.Layer):
    """Reaches its weight through `self.trainable_weights`, not an
    attribute: the read is eager, and would be frozen if traced."""

    def build(self, shape):
        self.scale = self.add_weight(shape=(shape[-1],), initializer="ones", name="scale")

    def call(self, x):
        return x * ops.exp(self.trainable_weights[0])


@pytest.mark.parametrize("layer_class, reason", [
    (ReadsInPython, "numpy"),
    (ReadsThroughWeights, "frozen"),
])
def test_a_variable_the_graph_cannot_read_keeps_the_layer_opaque_never_frozen(
    layer_class, reason
):
    class Wrapper(keras.Model):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.odd = layer_class(name="odd")
            self.head = layers.Dense(2, name="head")

        def call(self, x):
            return self.head(self.odd(x))

    x = _rand(4, 3)
    model = Wrapper(name="wrapper")
    model(x)
    passed = kip.apply_passes(kip.convert_to_functional(model, x), [Expand()])
    node = passed.kip_graph.node("odd")
    assert node.operation is model.odd
    assert reason in node.opaque_reason
    assert_equivalent(model, passed, x)


def test_a_layer_counting_its_calls_expands_with_the_count_as_a_write_node():
    class Wrapper(keras.Model):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.odd = Counter(name="odd")
            self.head = layers.Dense(2, name="head")

        def call(self, x):
            return self.head(self.odd(x))

    x = _rand(4, 3)
    model = Wrapper(name="wrapper")
    model(x)
    passed = kip.apply_passes(kip.convert_to_functional(model, x), [Expand()])
    assert passed.kip_report.opaque == {}
    assert type(passed.kip_graph.node("odd.calls.assign_add").operation).__name__ == \
        "VariableWrite"
    before = int(model.odd.calls.numpy())
    passed(x)
    assert int(model.odd.calls.numpy()) == before + 1
    assert_equivalent(model, passed, x)


def test_a_model_reading_a_weight_outside_the_graph_is_opaque_and_still_trains():
    class Reader(keras.Model):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.inner = ReadsThroughWeights(name="inner")
            self.head = layers.Dense(2, name="head")

        def build(self, shape):
            self.inner.build(shape)
            self.head.build(shape)

        def call(self, x):
            # the model reads the sub-layer's weight itself
            return self.head(x) * ops.exp(self.inner.trainable_weights[0][0])

    converted = assert_trains_like_keras(lambda: Reader(name="reader"), _rand(4, 3))
    assert "frozen" in converted.kip_report.opaque["reader"]


# -- held tensors and sub-layers called on concrete tensors ---------------------
class GraphAttention(layers.Layer):
    """Message passing over an edge list given as an input."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = layers.Dense(4, name="dense")

    def call(self, inputs):
        features, edges = inputs
        messages = ops.take(self.dense(features), edges[:, 1], axis=0)
        return ops.segment_sum(messages, edges[:, 0], num_segments=5)


class NodeClassifier(keras.Model):
    """A graph model keeping its node features and edge list as tensors;
    `call` takes the indices of the nodes to classify."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.features = tf.constant(_rand(5, 3, seed=3))
        self.edges = tf.constant([[0, 1], [1, 2], [2, 3], [3, 4], [4, 0], [0, 2]])
        self.attention = GraphAttention(name="attention")
        self.out = layers.Dense(2, name="out")

    def call(self, indices):
        hidden = self.attention([self.features, self.edges])
        return self.out(ops.take(hidden, indices[:, 0], axis=0))


def test_layers_called_on_held_tensors_stay_in_the_graph_and_train():
    x = np.array([[0], [3], [2], [4]], "int32")
    model = NodeClassifier(name="gnn")
    model(x)
    converted = kip.convert_to_functional(model, x)
    fully_traced(converted)
    held = [n for n in converted.kip_graph.nodes if is_a(n, "HeldConstant")]
    assert len(held) == 2
    assert converted.kip_graph.node("attention").operation is model.attention
    expand_all(model, converted, x)
    assert_trains_like_keras(lambda: NodeClassifier(name="gnn"), x)


class TokenAndPosition(layers.Layer):
    """The Keras text-classification example's embedding: the position
    lookup is called on `ops.arange`, a concrete tensor."""

    def __init__(self, maxlen, vocab, dim, **kwargs):
        super().__init__(**kwargs)
        self.token_emb = layers.Embedding(vocab, dim, name="token_emb")
        self.pos_emb = layers.Embedding(maxlen, dim, name="pos_emb")

    def call(self, x):
        positions = self.pos_emb(ops.arange(0, ops.shape(x)[-1], 1))
        return self.token_emb(x) + positions


class PositionsInModel(keras.Model):
    """The same lookup, in the model's own `call` (the whole-model trace)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.token_emb = layers.Embedding(20, 4, name="token_emb")
        self.pos_emb = layers.Embedding(6, 4, name="pos_emb")
        self.embed = TokenAndPosition(6, 20, 4, name="embed")
        self.head = layers.Dense(2, name="head")

    def call(self, x):
        positions = self.pos_emb(ops.arange(ops.shape(x)[1]))
        h = self.token_emb(x) + positions + self.embed(x)
        return self.head(ops.mean(h, axis=1))


def test_sub_layer_called_on_a_concrete_tensor_in_call_is_a_graph_node():
    x = np.random.RandomState(0).randint(0, 20, size=(3, 6))
    model = PositionsInModel(name="positions")
    model(x)
    converted = kip.convert_to_functional(model, x)
    fully_traced(converted)
    lookup = converted.kip_graph.node("pos_emb")
    assert lookup.operation is model.pos_emb
    assert is_a(lookup.args[0].producer, "HeldConstant")
    passed = expand_all(model, converted, x)
    assert passed.kip_graph.node("embed.pos_emb").operation is model.embed.pos_emb
    assert_trains_like_keras(lambda: PositionsInModel(name="positions"), x)


def test_converted_model_with_reads_saves_and_loads(tmp_path):
    x = _rand(4, 5, 3)
    model = ClassToken(name="vit")
    model(x)
    converted = kip.convert_to_functional(model, x)
    path = str(tmp_path / "vit.keras")
    converted.save(path)
    loaded = keras.models.load_model(path)
    other = _rand(6, 5, 3, seed=2)
    np.testing.assert_allclose(loaded(other), model(other), atol=1e-5)
    assert len(loaded.trainable_variables) == len(model.trainable_variables)


def test_variable_reads_follow_the_mixed_precision_policy():
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy("mixed_float16")
    try:
        x = _rand(4, 5, 3)
        model = ClassToken(name="vit")
        model(x)
        converted = kip.convert_to_functional(model, x)
        fully_traced(converted)
        assert len(reads_of(converted)) == 2
        for node in reads_of(converted):
            assert node.operation.dtype_policy.name == "mixed_float16"
            assert node.outputs[0].spec.dtype == "float16"
        expected, expected_grads = outputs_and_gradients(model, x, model.trainable_variables)
        actual, actual_grads = outputs_and_gradients(converted, x, model.trainable_variables)
        assert actual.dtype == expected.dtype == "float16"
        np.testing.assert_allclose(np.array(actual), np.array(expected), atol=1e-3)
        for variable, a, b in zip(model.trainable_variables, expected_grads, actual_grads,
                                  strict=True):
            assert a is not None and b is not None, variable.path
            np.testing.assert_allclose(np.array(b), np.array(a), atol=1e-3,
                                       err_msg=variable.path)
    finally:
        keras.config.set_dtype_policy(previous)


# -- 2. optional and keyword tensor arguments ----------------------------------
class CachedAttention(layers.MultiHeadAttention):
    """keras_hub's CachedMultiHeadAttention in small: `call` gains `cache`
    arguments that `MultiHeadAttention.compute_output_spec` does not take."""

    def call(self, query, value, key=None, attention_mask=None, cache=None,
             cache_update_index=None, training=None):
        if cache is not None:
            raise NotImplementedError("generation is not traced here")
        return super().call(query, value, key=key, attention_mask=attention_mask,
                            training=training)


class Decoder(layers.Layer):
    """keras_hub's TransformerDecoder signature: optional tensors that
    default to None, passed by keyword."""

    def __init__(self, dim, **kwargs):
        super().__init__(**kwargs)
        self.self_attention = CachedAttention(2, dim // 2, name="self_attention")
        self.cross_attention = CachedAttention(2, dim // 2, name="cross_attention")
        self.norm = layers.LayerNormalization(name="norm")

    def call(self, decoder_sequence, encoder_sequence=None, decoder_padding_mask=None,
             decoder_attention_mask=None, self_attention_cache=None,
             self_attention_cache_update_index=None, training=None):
        mask = decoder_attention_mask
        if decoder_padding_mask is not None:
            padding = ops.expand_dims(decoder_padding_mask, axis=1)
            mask = padding if mask is None else ops.logical_and(mask, padding)
        x = decoder_sequence + self.self_attention(
            decoder_sequence, decoder_sequence, attention_mask=mask,
            cache=self_attention_cache, cache_update_index=self_attention_cache_update_index,
            training=training,
        )
        if encoder_sequence is not None:
            x = x + self.cross_attention(x, encoder_sequence, training=training)
        return self.norm(x)


class Seq2Seq(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.embed = layers.Dense(8, name="embed")
        self.encoder = Decoder(8, name="encoder")
        self.decoder = Decoder(8, name="decoder")
        self.head = layers.Dense(2, name="head")

    def call(self, inputs):
        source = self.embed(inputs["source"])
        target = self.embed(inputs["target"])
        encoded = self.encoder(source)  # every optional argument None
        decoded = self.decoder(
            target, encoder_sequence=encoded,
            decoder_padding_mask=inputs["target_mask"] > 0,
            decoder_attention_mask=inputs["attention"] > 0,
        )
        return self.head(decoded)


def seq2seq_batch(batch, seed=0):
    r = np.random.RandomState(seed)
    return {
        "source": r.normal(size=(batch, 5, 3)).astype("float32"),
        "target": r.normal(size=(batch, 4, 3)).astype("float32"),
        "target_mask": (r.uniform(size=(batch, 4)) > 0.2).astype("int32"),
        "attention": np.tril(np.ones((4, 4), "int32"))[None].repeat(batch, axis=0),
    }


def test_optional_and_keyword_tensor_arguments_trace_and_expand():
    x = seq2seq_batch(4)
    model = Seq2Seq(name="seq2seq")
    model(x)
    converted = kip.convert_to_functional(model, x)
    fully_traced(converted)
    passed = expand_all(model, converted, x)
    names = [n.name for n in passed.kip_graph.nodes]
    assert "decoder.cross_attention" not in names  # inlined into its parts
    assert any(name.startswith("decoder.cross_attention.") for name in names)
    other = seq2seq_batch(6, seed=1)
    np.testing.assert_allclose(passed(other), model(other), atol=1e-5)


class HubBlocks(keras.Model):
    """keras_hub's own encoder and decoder blocks in a subclassed model."""

    def __init__(self, causal, **kwargs):
        super().__init__(**kwargs)
        import keras_hub

        self.causal = causal
        self.encoder = keras_hub.layers.TransformerEncoder(16, 2, name="encoder")
        self.decoder = keras_hub.layers.TransformerDecoder(16, 2, name="decoder")
        self.head = layers.Dense(2, name="head")

    def call(self, inputs):
        encoded = self.encoder(inputs["source"], padding_mask=inputs["source_mask"] > 0)
        decoded = self.decoder(
            inputs["target"], encoded, decoder_padding_mask=inputs["target_mask"] > 0,
            use_causal_mask=self.causal,
        )
        return self.head(decoded)


def hub_batch(batch, seed=0):
    r = np.random.RandomState(seed)
    return {
        "source": r.normal(size=(batch, 5, 8)).astype("float32"),
        "source_mask": np.ones((batch, 5), "int32"),
        "target": r.normal(size=(batch, 4, 8)).astype("float32"),
        "target_mask": (r.uniform(size=(batch, 4)) > 0.2).astype("int32"),
    }


@pytest.mark.parametrize("causal, static_batch", [(False, False), (True, True)])
def test_keras_hub_encoder_and_decoder_blocks_expand_into_keras_layers(causal, static_batch):
    x = hub_batch(4)
    model = HubBlocks(causal, name="hub_blocks")
    model(x)
    converted = kip.convert_to_functional(model, x, static_batch=static_batch)
    fully_traced(converted)
    passed = expand_all(model, converted, x)
    assert not any(n.name in ("encoder", "decoder") for n in passed.kip_graph.nodes)
    if not static_batch:
        other = hub_batch(7, seed=1)
        np.testing.assert_allclose(passed(other), model(other), atol=1e-5)


# -- 3. views behave like the layers -------------------------------------------
class ConfiguredBlock(layers.Layer):
    """Reads its config through `__getattr__`, its sizes and weight through
    properties over private attributes, and calls a helper method."""

    def __init__(self, **config):
        super().__init__(name=config.pop("name", None))
        self._config = dict(config)
        self.proj = layers.Dense(config["units"], name="proj")

    def __getattr__(self, name):
        config = self.__dict__.get("_config", {})
        if name in config:
            return config[name]
        return super().__getattr__(name)

    def build(self, shape):
        self._repeats = 2
        self._scale = self.add_weight(shape=(self.units,), initializer="ones", name="scale")

    @property
    def width(self):
        return self.units * self._repeats

    @property
    def scale(self):
        return self._scale * 1.5

    def _tile(self, x):
        return ops.tile(x, (1, self.width // self.units))

    def call(self, x):
        if self.use_scale:
            x = self.proj(x) * self.scale
        return self._tile(x)


class Configured(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.block = ConfiguredBlock(units=3, use_scale=True, name="block")
        self.head = layers.Dense(2, name="head")

    def call(self, x):
        return self.head(self.block(x))


def test_properties_getattr_and_methods_of_a_layer_work_when_it_is_traced():
    x = _rand(4, 5)
    model = Configured(name="configured")
    model(x)
    converted = kip.convert_to_functional(model, x)
    fully_traced(converted)
    passed = expand_all(model, converted, x)
    assert [n.name for n in reads_of(passed)] == ["block._scale"]


def tiny_llama():
    import keras_hub

    return keras_hub.models.LlamaBackbone(
        vocabulary_size=50, num_layers=2, num_query_heads=2, num_key_value_heads=1,
        hidden_dim=16, intermediate_dim=32,
    )


class BackboneHead(keras.Model):
    """A keras_hub backbone with a head, as fine-tuning code writes it."""

    def __init__(self, backbone, **kwargs):
        super().__init__(**kwargs)
        self.backbone = backbone
        self.head = layers.Dense(2, name="head")

    def call(self, inputs):
        outputs = self.backbone(inputs)
        if isinstance(outputs, dict):  # an encoder-decoder backbone
            outputs = outputs["decoder_sequence_output"] + ops.mean(
                outputs["encoder_sequence_output"], axis=1, keepdims=True)
        return self.head(outputs)


def token_batch(batch, seed=0):
    r = np.random.RandomState(seed)
    return {"token_ids": r.randint(0, 50, size=(batch, 8)),
            "padding_mask": np.ones((batch, 8), "int32")}


def test_outline_of_a_layer_whose_get_config_fails_outlines_it_alone():
    """keras_hub 0.32's LlamaTransformerDecoder.get_config reads an attribute
    it never sets: the Outline key cannot compare it with another layer."""
    import keras_hub
    from keras_hub.src.models.llama.llama_decoder import LlamaTransformerDecoder

    x = token_batch(4)
    model = BackboneHead(tiny_llama(), name="llama")
    model(x)
    converted = kip.convert_to_functional(model, x)
    fully_traced(converted)
    # One level: the decoder blocks become nodes of the graph.
    passed = kip.apply_passes(converted, [
        Expand(keras_hub.models.LlamaBackbone), kip.passes.Outline(LlamaTransformerDecoder)])
    entries = [e for e in passed.kip_report.entries if e.step == "outline"]
    assert [e.action for e in entries] == ["outlined alone"] * 2
    assert "rope_scaling_factor" in entries[0].detail
    assert_equivalent(model, passed, x)
    other = token_batch(7, seed=1)
    np.testing.assert_allclose(passed(other), model(other), atol=1e-5)


# -- 4. blocks that compute with the batch size --------------------------------
class SplitHeads(layers.Layer):
    """The Keras examples' attention: `reshape(x, (batch_size, -1, heads,
    depth))` with `batch_size = ops.shape(x)[0]`, None while tracing."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.proj = layers.Dense(8, name="proj")

    def call(self, x):
        batch_size = ops.shape(x)[0]
        heads = ops.reshape(self.proj(x), (batch_size, -1, 2, 4))
        heads = ops.transpose(heads, (0, 2, 1, 3))
        return ops.reshape(ops.transpose(heads, (0, 2, 1, 3)), (batch_size, -1, 8))


class CausalMask(layers.Layer):
    """keras_hub's decoders: a concrete causal mask broadcast to the batch
    size, which the symbolic trace does not know."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.attention = layers.MultiHeadAttention(2, 4, name="attention")

    def call(self, x):
        length = ops.shape(x)[1]
        mask = ops.expand_dims(ops.tril(ops.ones((length, length), "int32")), 0)
        mask = ops.broadcast_to(mask, (ops.shape(x)[0], length, length))
        return self.attention(x, x, attention_mask=mask)


class BatchModel(keras.Model):
    def __init__(self, block, **kwargs):
        super().__init__(**kwargs)
        self.embed = layers.Dense(8, name="embed")
        self.block = block
        self.head = layers.Dense(2, name="head")

    def call(self, x):
        return self.head(self.block(self.embed(x)))


@pytest.mark.parametrize("block", [SplitHeads, CausalMask])
def test_a_block_using_the_batch_size_expands_to_a_graph_for_any_batch_size(block):
    x = _rand(4, 5, 3)
    model = BatchModel(block(name="block"), name="batch_model")
    model(x)
    converted = kip.convert_to_functional(model, x)
    fully_traced(converted)
    passed = expand_all(model, converted, x)
    assert any(type(n.operation).__name__ == "BatchSizedOperation"
               for n in passed.kip_graph.nodes)
    for batch in (1, 7):
        other = _rand(batch, 5, 3, seed=batch)
        np.testing.assert_allclose(passed(other), model(other), atol=1e-5)


class CausalGatedFeedForward(layers.Layer):
    """keras_hub's Gemma decoder block: a causal mask broadcast to the batch
    size (traced at two batch sizes) and a gated feed-forward of
    `EinsumDense(output_shape=(None, f))`, whose own output shape leaves
    the sequence length unknown although its input knows it."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.attention = layers.MultiHeadAttention(2, 4, name="attention")
        self.gate = layers.EinsumDense("btd,df->btf", output_shape=(None, 6), name="gate")

    def call(self, x):
        length = ops.shape(x)[1]
        mask = ops.expand_dims(ops.tril(ops.ones((length, length), "int32")), 0)
        mask = ops.broadcast_to(mask, (ops.shape(x)[0], length, length))
        return self.gate(self.attention(x, x, attention_mask=mask))


def test_a_batch_sized_block_with_an_einsum_dense_of_unknown_length_expands():
    x = _rand(4, 5, 3)
    model = BatchModel(CausalGatedFeedForward(name="block"), name="gated")
    model(x)
    converted = kip.convert_to_functional(model, x)
    passed = expand_all(model, converted, x)
    assert passed.kip_graph.node("block.gate").operation is model.block.gate
    for batch in (1, 7):
        other = _rand(batch, 5, 3, seed=batch)
        np.testing.assert_allclose(passed(other), model(other), atol=1e-5)


class GroupedQueries(layers.Layer):
    """keras_hub's Gemma attention: queries from an `EinsumDense` whose
    `output_shape=(None, heads, dim)` leaves the sequence length out of its
    own output shape, then reshaped to a shape built from `ops.shape(q)`.
    Only the batch size may be unknown there."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.query = layers.EinsumDense("btd,dnh->btnh", output_shape=(None, 2, 4), name="query")

    def call(self, x):
        q = self.query(x)
        shape = ops.shape(q)
        q = ops.reshape(q, (*shape[:-2], 1, 2, shape[-1]))
        return ops.reshape(ops.sum(q, axis=2), (shape[0], shape[1], 8))


def test_a_block_reshaping_to_the_shape_of_an_einsum_dense_output_expands():
    x = _rand(4, 5, 3)
    model = BatchModel(GroupedQueries(name="block"), name="grouped")
    model(x)
    converted = kip.convert_to_functional(model, x)
    passed = expand_all(model, converted, x)
    for batch in (1, 7):
        other = _rand(batch, 5, 3, seed=batch)
        np.testing.assert_allclose(passed(other), model(other), atol=1e-5)


class HeadsThenPositions(layers.Layer):
    """keras_hub's T5 attention: heads reshaped to `(batch_size, -1, ...)`,
    then a position table as long as the heads' sequence. While tracing,
    the batch size is unknown, so is that `-1`, and `ops.arange` cannot
    take it: the call is traced at two batch sizes, one of them 1."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.proj = layers.Dense(8, name="proj")

    def call(self, x):
        heads = ops.reshape(self.proj(x), (ops.shape(x)[0], -1, 2, 4))
        positions = ops.cast(ops.arange(ops.shape(heads)[1]), heads.dtype)
        return ops.reshape(heads + positions[None, :, None, None], (ops.shape(x)[0], -1, 8))


def test_a_reshape_to_the_batch_size_traced_at_two_batch_sizes_follows_any_batch(tmp_path):
    # The reshape traced at batch size 1 must not stay a reshape to 1: it
    # did when Keras copied (and saved) the operation from its constructor
    # arguments, and the block was left whole.
    x = _rand(4, 5, 3)
    model = BatchModel(HeadsThenPositions(name="block"), name="heads_then_positions")
    model(x)
    converted = kip.convert_to_functional(model, x)
    passed = expand_all(model, converted, x)
    assert "block" not in passed.kip_report.opaque
    assert passed.kip_graph.node("block.proj").operation is model.block.proj
    path = str(tmp_path / "heads.keras")
    passed.save(path)
    loaded = keras.models.load_model(path)
    for batch in (1, 3, 7):
        other = _rand(batch, 5, 3, seed=batch)
        np.testing.assert_allclose(passed(other), model(other), atol=1e-5)
        np.testing.assert_allclose(loaded(other), model(other), atol=1e-5)


class RepeatedTable(layers.Layer):
    """keras_hub's DeBERTa-v3 `RelativeEmbedding`: a table repeated to the
    batch size with `ops.repeat(table, repeats=ops.shape(x)[0], axis=0)`,
    whose `repeats` is a single dimension, not a shape."""

    def build(self, shape):
        self.table = self.add_weight(shape=(1, 5, shape[-1]), name="table")

    def call(self, x):
        table = ops.repeat(ops.convert_to_tensor(self.table), repeats=ops.shape(x)[0], axis=0)
        return x + table


def test_a_table_repeated_to_the_batch_size_expands_to_a_graph_for_any_batch(tmp_path):
    x = _rand(4, 5, 3)
    model = BatchModel(RepeatedTable(name="block"), name="repeated_table")
    model(x)
    converted = kip.convert_to_functional(model, x)
    passed = expand_all(model, converted, x)
    assert "block" not in passed.kip_report.opaque, passed.kip_report.opaque
    assert any(type(n.operation).__name__ == "BatchSizedOperation"
               for n in passed.kip_graph.nodes)
    path = str(tmp_path / "repeated.keras")
    passed.save(path)
    loaded = keras.models.load_model(path)
    for batch in (1, 3, 7):
        other = _rand(batch, 5, 3, seed=batch)
        np.testing.assert_allclose(passed(other), model(other), atol=1e-5)
        np.testing.assert_allclose(loaded(other), model(other), atol=1e-5)


class SliceToTheBatch(layers.Layer):
    """keras_hub's XLNet `_rel_shift`: `ops.slice(x, [0, 1, 0], [batch, ...])`,
    whose start indices are a list of ints passed on positionally."""

    def call(self, x):
        return ops.slice(x, [0, 1, 0], [ops.shape(x)[0], 3, ops.shape(x)[2]])


def test_a_slice_to_the_batch_size_expands_to_a_graph_for_any_batch(tmp_path):
    x = _rand(4, 5, 3)
    model = BatchModel(SliceToTheBatch(name="block"), name="slice_to_the_batch")
    model(x)
    converted = kip.convert_to_functional(model, x)
    passed = expand_all(model, converted, x)
    assert "block" not in passed.kip_report.opaque, passed.kip_report.opaque
    path = str(tmp_path / "sliced.keras")
    passed.save(path)
    loaded = keras.models.load_model(path)
    for batch in (1, 3, 7):
        other = _rand(batch, 5, 3, seed=batch)
        np.testing.assert_allclose(passed(other), model(other), atol=1e-5)
        np.testing.assert_allclose(loaded(other), model(other), atol=1e-5)


class PerPositionWindows(layers.Layer):
    """keras_hub's Swin `window_partition` / `window_reverse`: rows of
    `batch * windows` (`ops.reshape(x, (batch * 5, 8))`) and the batch size
    recovered as `ops.shape(windows)[0] // 5`; both fail on the unknown
    batch size, and the first is a multiple of it, not the batch size."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.proj = layers.Dense(8, name="proj")

    def call(self, x):
        batch = ops.shape(x)[0]
        windows = self.proj(ops.reshape(x, (batch * 5, 8)))
        return ops.reshape(windows, (ops.shape(windows)[0] // 5, 5, 8))


@pytest.mark.parametrize("block", ["PerPositionWindows", "MergedBatch"])
def test_a_block_computing_with_a_multiple_of_the_batch_size_expands_for_any_batch(
        block, tmp_path):
    x = _rand(4, 5, 3)
    model = BatchModel(globals()[block](name="block"), name="windows")
    model(x)
    converted = kip.convert_to_functional(model, x)
    passed = expand_all(model, converted, x)
    assert "block" not in passed.kip_report.opaque, passed.kip_report.opaque
    path = str(tmp_path / "windows.keras")
    passed.save(path)
    loaded = keras.models.load_model(path)
    for batch in (1, 3, 7):
        other = _rand(batch, 5, 3, seed=batch)
        np.testing.assert_allclose(passed(other), model(other), atol=1e-5)
        np.testing.assert_allclose(loaded(other), model(other), atol=1e-5)


class SameShape(layers.Layer):
    """A base layer stating one output of its input's shape (keras_hub's
    `RotaryEmbedding`)."""

    def call(self, x):
        return x

    def compute_output_shape(self, input_shape):
        return input_shape


class RotatesTwo(SameShape):
    """keras_hub's `ESMRotaryEmbedding`: `call(q, k)` returns two tensors,
    while the `compute_output_shape` it inherits states one."""

    def call(self, q, k):
        return q * 2.0, k - 1.0


class HeadsThenTwoOutputs(layers.Layer):
    """ESM's attention: heads reshaped to `ops.shape(x)[0]` (so the trace
    checks each node's shapes at other batch sizes), then the two-output
    rotary layer."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.rotary = RotatesTwo(name="rotary")

    def call(self, x):
        heads = ops.reshape(x, (ops.shape(x)[0], 5, 2, 4))
        q, k = self.rotary(heads, heads + 1.0)
        return ops.reshape(q * k, (ops.shape(x)[0], 5, 8))


def test_a_sub_layer_returning_more_outputs_than_its_inherited_shape_states_expands():
    # The replay of the shapes at other batch sizes asked the inherited
    # `compute_output_shape`, got one output for two, and Expand crashed
    # with a bare KeyError.
    x = _rand(4, 5, 3)
    model = BatchModel(HeadsThenTwoOutputs(name="block"), name="two_outputs")
    model(x)
    converted = kip.convert_to_functional(model, x)
    passed = expand_all(model, converted, x)
    assert "block" not in passed.kip_report.opaque, passed.kip_report.opaque
    for batch in (1, 7):
        other = _rand(batch, 5, 3, seed=batch)
        np.testing.assert_allclose(passed(other), model(other), atol=1e-5)


class BatchIndexFromEnd(layers.Layer):
    """Embeds each example's distance from the batch's end: a range that
    starts from the batch size, which no graph makes from it (a range from
    0 expands: tests/frontend/batch/test_batch_ranges.py)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.index = layers.Embedding(16, 8, name="index")

    def call(self, x):
        return x + ops.expand_dims(
            self.index(ops.arange(ops.shape(x)[0] - 1, -1, -1)), 1)


class MergedBatch(layers.Layer):
    """Broadcasts its bias to `ops.shape(y)[0]` where `y` merged the batch
    and the sequence: that unknown dimension is not the batch size but 5
    times it, which the graph holds as such (`BatchMultiple`)."""

    def build(self, shape):
        self.bias = self.add_weight(shape=(shape[-1],), initializer="ones", name="bias")

    def call(self, x):
        merged = ops.reshape(x, (-1, ops.shape(x)[-1]))
        bias = ops.broadcast_to(self.bias, (ops.shape(merged)[0], ops.shape(x)[-1]))
        return ops.reshape(merged + bias, (-1,) + tuple(ops.shape(x)[1:]))


class BatchPlusOne(layers.Layer):
    """Broadcasts its bias to `ops.shape(y)[0]` where `y` is the batch with
    one more row: neither the batch size nor a multiple of it."""

    def build(self, shape):
        self.bias = self.add_weight(shape=(shape[-1],), initializer="ones", name="bias")

    def call(self, x):
        extended = ops.concatenate([x, x[:1]], axis=0)
        bias = ops.broadcast_to(self.bias, (ops.shape(extended)[0],) + tuple(ops.shape(x)[1:]))
        return (extended + bias)[1:]


def test_a_block_computing_with_the_batch_size_plus_one_expands_for_any_batch_size():
    """A size that is the batch size plus a constant is followed
    (it stayed whole before, as `BatchIndexFromEnd` still does)."""
    x = _rand(4, 5, 3)
    model = BatchModel(BatchPlusOne(name="block"), name="batch_model")
    model(x)
    converted = kip.convert_to_functional(model, x)
    passed = kip.apply_passes(converted, [Expand()])
    assert "block" not in passed.kip_report.opaque, passed.kip_report.opaque
    assert not any(node.operation is model.block for node in passed.kip_graph.nodes)
    assert_equivalent(model, passed, x)
    for batch in (2, 7):
        other = _rand(batch, 5, 3, seed=batch)
        np.testing.assert_allclose(passed(other), model(other), atol=1e-5)


@pytest.mark.parametrize("block", [BatchIndexFromEnd])
def test_a_block_the_graph_cannot_follow_at_any_batch_size_stays_whole_and_says_why(block):
    x = _rand(4, 5, 3)
    model = BatchModel(block(name="block"), name="batch_model")
    model(x)
    converted = kip.convert_to_functional(model, x)
    passed = kip.apply_passes(converted, [Expand()])
    assert passed.kip_graph.node("block").operation is model.block
    assert "static_batch=True" in passed.kip_report.opaque["block"]
    assert_equivalent(model, passed, x)
    for batch in (2, 7):
        other = _rand(batch, 5, 3, seed=batch)
        np.testing.assert_allclose(passed(other), model(other), atol=1e-5)


def tiny_backbone(name):
    import keras_hub

    if name == "llama":
        return tiny_llama()
    size = dict(vocabulary_size=50, num_layers=2, num_heads=2, hidden_dim=16,
                intermediate_dim=32, max_sequence_length=16)
    if name == "gpt2":
        return keras_hub.models.GPT2Backbone(**size)
    return keras_hub.models.BartBackbone(**size)


def backbone_batch(name, batch, seed=0):
    if name != "bart":
        return token_batch(batch, seed)
    r = np.random.RandomState(seed)
    return {
        "encoder_token_ids": r.randint(0, 50, size=(batch, 8)),
        "encoder_padding_mask": np.ones((batch, 8), "int32"),
        "decoder_token_ids": r.randint(0, 50, size=(batch, 6)),
        "decoder_padding_mask": np.ones((batch, 6), "int32"),
    }


@pytest.mark.parametrize("name, static_batch", [
    ("gpt2", False), ("bart", False), ("llama", False), ("gpt2", True),
])
def test_keras_hub_decoders_expand_fully_and_run_at_other_batch_sizes(name, static_batch):
    x = backbone_batch(name, 4)
    model = BackboneHead(tiny_backbone(name), name=f"{name}_head")
    model(x)
    converted = kip.convert_to_functional(model, x, static_batch=static_batch)
    fully_traced(converted)
    passed = expand_all(model, converted, x)
    if not static_batch:
        other = backbone_batch(name, 7, seed=1)
        np.testing.assert_allclose(passed(other), model(other), atol=1e-5)


class Rotate(layers.Layer):
    """A position rotation applied to both queries and keys (as keras_hub's
    RotaryEmbedding is): one sub-layer called twice in one `call`."""

    def call(self, x):
        half = ops.shape(x)[-1] // 2
        return ops.concatenate([-x[..., half:], x[..., :half]], axis=-1) + x


class QueryKey(layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.query = layers.Dense(4, name="query")
        self.key = layers.Dense(4, name="key")
        self.rotate = Rotate(name="rotate")

    def call(self, x):
        q, k = self.rotate(self.query(x)), self.rotate(self.key(x))
        return ops.softmax(ops.einsum("bqd,bkd->bqk", q, k))


def test_a_sub_layer_called_twice_in_one_call_expands_at_both_call_sites():
    x = _rand(3, 5, 4)
    model = BatchModel(QueryKey(name="block"), name="twice")
    model(x)
    passed = expand_all(model, kip.convert_to_functional(model, x), x)
    names = [n.name for n in passed.kip_graph.nodes]
    assert len(names) == len(set(names))
    assert any(n.startswith("block.rotate.") for n in names)
    assert any(n.startswith("block.rotate_1.") for n in names)


def test_a_graph_made_for_any_batch_size_saves_and_loads(tmp_path):
    x = _rand(4, 5, 3)
    model = BatchModel(CausalMask(name="block"), name="causal")
    model(x)
    passed = kip.apply_passes(kip.convert_to_functional(model, x), [Expand()])
    path = str(tmp_path / "causal.keras")
    passed.save(path)
    loaded = keras.models.load_model(path)
    other = _rand(6, 5, 3, seed=3)
    np.testing.assert_allclose(loaded(other), model(other), atol=1e-5)
