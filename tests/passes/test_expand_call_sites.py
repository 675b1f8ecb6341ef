"""Expand returns a model that runs: layers called
through a `LayerAlias` keep their own mask handling, and a sub-model shared
between call sites expands at each of them.
"""

import keras
import numpy as np

import keras_ipu_plugin as kip
from keras_ipu_plugin.passes import Expand

layers = keras.layers


def _rng():
    return np.random.default_rng(0)


class CrossAttentionBlock(layers.Layer):
    """Unmasked queries attend over masked token embeddings (`Attention`
    takes one list argument and computes its mask from the query's)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.embed = layers.Embedding(20, 8, mask_zero=True, name="embed")
        self.query = layers.Dense(8, name="query")
        self.attention = layers.Attention(name="attention")

    def call(self, features, ids):
        return self.attention([self.query(features), self.embed(ids)])


class CrossAttentionNet(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.block = CrossAttentionBlock(name="block")
        # Takes the name `attention` (its path is its name, so it claims it
        # first): expanded, the block's attention layer keeps its own name
        # only if free, so it is called through an alias.
        self.attention = layers.GlobalAveragePooling1D(name="attention")
        self.head = layers.Dense(1, name="head")

    def call(self, inputs):
        return self.head(self.attention(self.block(inputs["features"], inputs["ids"])))


def test_a_layer_behind_an_alias_computes_its_mask_from_its_own_arguments():
    # The expanded attention is called through an alias (its name is taken
    # by the pool, so the alias is named after its path). Keras handed the alias's
    # `compute_mask` the tuple of all its positional arguments, and
    # `Attention` rejected it when the model was called.
    ids = _rng().integers(1, 20, size=(8, 10))
    ids[:, 6:] = 0
    x = {"features": _rng().normal(size=(8, 4, 3)).astype("float32"), "ids": ids}
    model = CrossAttentionNet(name="cross")
    model(x)
    passed = kip.apply_passes(kip.convert_to_functional(model, x), [Expand()])
    node = passed.kip_graph.node("block.attention")
    assert isinstance(passed.get_layer("block.attention"), kip.layers.alias.LayerAlias)
    assert node.operation is model.block.attention
    np.testing.assert_allclose(passed(x), model(x), atol=1e-6)
    kip.frontend.verify.equivalence.check_equivalent(model, passed, x)


class MaskedSelfAttentionBlock(layers.Layer):
    """MultiHeadAttention over masked queries and values of another mask,
    called positionally, with an explicit attention mask too."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.embed_q = layers.Embedding(20, 8, mask_zero=True, name="embed_q")
        self.embed_v = layers.Embedding(20, 8, mask_zero=True, name="embed_v")
        self.attention = layers.MultiHeadAttention(num_heads=2, key_dim=4, name="attention")
        self.norm = layers.LayerNormalization(name="norm")

    def call(self, q_ids, v_ids, attention_mask):
        q = self.embed_q(q_ids)
        return self.norm(q + self.attention(q, self.embed_v(v_ids), attention_mask=attention_mask))


class MaskedAttentionNet(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.block = MaskedSelfAttentionBlock(name="block")
        self.pool = layers.GlobalAveragePooling1D(name="pool")
        self.head = layers.Dense(1, name="head")

    def call(self, inputs):
        return self.head(self.pool(self.block(inputs["q"], inputs["v"], inputs["allowed"])))


def test_multi_head_attention_behind_an_alias_keeps_query_value_and_attention_masks():
    rng = _rng()
    q = rng.integers(1, 20, size=(8, 10))
    q[:, 7:] = 0
    v = rng.integers(1, 20, size=(8, 10))
    v[:, 5:] = 0
    allowed = np.tril(np.ones((10, 10), "bool"))[None].repeat(8, axis=0)
    x = {"q": q, "v": v, "allowed": allowed}
    model = MaskedAttentionNet(name="masked")
    model(x)
    passed = kip.apply_passes(kip.convert_to_functional(model, x), [Expand()])
    assert passed.kip_graph.node("block.attention").operation is model.block.attention
    np.testing.assert_allclose(passed(x), model(x), atol=1e-5)
    kip.frontend.verify.equivalence.check_equivalent(model, passed, x)


def make_encoder():
    inputs = keras.Input(shape=(6,))
    x = layers.Dense(8, activation="relu")(inputs)
    x = layers.BatchNormalization()(x)
    outputs = layers.Dense(4)(x)
    return keras.Model(inputs, outputs, name="Embedding")


class Siamese(keras.Model):
    """One functional encoder sub-model called on two inputs."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.encoder = make_encoder()
        self.head = layers.Dense(1, name="head")

    def call(self, inputs):
        difference = self.encoder(inputs["a"]) - self.encoder(inputs["b"])
        return self.head(keras.ops.abs(difference))


def test_shared_sub_model_expands_at_every_call_site_with_unique_names():
    # Expanding the shared encoder at its second call site named the
    # operations its trace made as at the first (`Embedding.convert_to_tensor`
    # twice): the rebuilt functional model was invalid.
    rng = _rng()
    x = {"a": rng.normal(size=(8, 6)).astype("float32"),
         "b": rng.normal(size=(8, 6)).astype("float32")}
    model = Siamese(name="siamese")
    model(x)
    passed = kip.apply_passes(kip.convert_to_functional(model, x), [Expand("all")])
    graph = passed.kip_graph
    dense_nodes = [n for n in graph.nodes if isinstance(n.operation, layers.Dense)]
    # Both sites call the very same sub-layers: the weights stay shared.
    assert len(dense_nodes) == 5
    assert len({id(n.operation) for n in dense_nodes}) == 3
    names = [layer.name for layer in passed.layers]
    assert len(names) == len(set(names))
    np.testing.assert_allclose(passed(x), model(x), atol=1e-6)
    kip.frontend.verify.equivalence.check_equivalent(model, passed, x)
    plugin = kip.PluginModel(Siamese(name="siamese_2"), passes=[Expand("all")])
    plugin.compile(optimizer="sgd", loss="mse")
    history = plugin.fit(x, np.ones((8, 1), "float32"), epochs=2, verbose=0)
    assert np.isfinite(history.history["loss"]).all()
