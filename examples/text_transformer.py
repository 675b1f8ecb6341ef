"""Text classification with a small Transformer encoder, through keras_ipu_plugin.

Runs on CPU in a few seconds on synthetic data:

    python examples/text_transformer.py

A subclassed model in the keras.io style: a token + position embedding
(`mask_zero=True`, so padding is masked), two Transformer blocks written as
custom layers, masked average pooling and a classification head. It is
wrapped in `kip.PluginModel`, which converts it to a functional graph at the
first batch and applies the passes:

- `Expand()` inlines the custom layers into their Keras layers (nodes are
  named by attribute path, `blocks.0.attention`, `blocks.0.ffn_in`, ...);
- `Recompute` puts a recomputation checkpoint at the end of each block
  (after its last LayerNormalization, `blocks.i.norm_2`, which exists once
  the blocks are expanded);
- `Outline` makes the layers the two blocks repeat (same class, config and
  input signature) share one compiled body.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_ipu_plugin as kip  # noqa: E402

VOCAB, LENGTH, DIM, HEADS, CLASSES, BLOCKS = 50, 12, 16, 2, 2, 2


class TokenAndPositionEmbedding(keras.layers.Layer):
    def __init__(self, vocab, length, dim, **kwargs):
        super().__init__(**kwargs)
        self.vocab, self.length, self.dim = vocab, length, dim
        self.token_emb = keras.layers.Embedding(vocab, dim, mask_zero=True)
        self.pos_emb = keras.layers.Embedding(length, dim)

    def call(self, inputs):
        positions = keras.ops.arange(0, keras.ops.shape(inputs)[-1])
        return self.token_emb(inputs) + self.pos_emb(positions)

    def compute_mask(self, inputs, mask=None):
        return self.token_emb.compute_mask(inputs)

    def get_config(self):
        return {**super().get_config(), "vocab": self.vocab,
                "length": self.length, "dim": self.dim}


class TransformerBlock(keras.layers.Layer):
    def __init__(self, dim, heads, ff_dim, rate=0.1, **kwargs):
        super().__init__(**kwargs)
        self.dim, self.heads, self.ff_dim, self.rate = dim, heads, ff_dim, rate
        self.supports_masking = True  # the padding mask passes through
        # After Expand these are `blocks.0.attention`, ... (attribute paths)
        self.attention = keras.layers.MultiHeadAttention(
            heads, dim // heads, dropout=rate, name="attention")
        self.ffn_in = keras.layers.Dense(ff_dim, activation="relu", name="ffn_in")
        self.ffn_out = keras.layers.Dense(dim, name="ffn_out")
        self.norm_1 = keras.layers.LayerNormalization(epsilon=1e-6, name="norm_1")
        self.norm_2 = keras.layers.LayerNormalization(epsilon=1e-6, name="norm_2")
        self.dropout_1 = keras.layers.Dropout(rate, name="dropout_1")
        self.dropout_2 = keras.layers.Dropout(rate, name="dropout_2")

    def call(self, inputs, mask=None, training=None):
        attention_mask = None
        if mask is not None:
            # (batch, query, key): a padded key is never attended to
            attention_mask = keras.ops.expand_dims(mask, 1)
        attended = self.attention(inputs, inputs, attention_mask=attention_mask,
                                  training=training)
        x = self.norm_1(inputs + self.dropout_1(attended, training=training))
        ffn = self.ffn_out(self.ffn_in(x))
        return self.norm_2(x + self.dropout_2(ffn, training=training))

    def get_config(self):
        return {**super().get_config(), "dim": self.dim, "heads": self.heads,
                "ff_dim": self.ff_dim, "rate": self.rate}


class TextClassifier(keras.Model):
    def __init__(self, vocab=VOCAB, length=LENGTH, dim=DIM, heads=HEADS,
                 classes=CLASSES, blocks=BLOCKS, **kwargs):
        super().__init__(**kwargs)
        self.embedding = TokenAndPositionEmbedding(vocab, length, dim, name="embedding")
        self.blocks = [
            TransformerBlock(dim, heads, dim * 2, name=f"block_{i}") for i in range(blocks)
        ]
        self.pool = keras.layers.GlobalAveragePooling1D()
        self.dropout = keras.layers.Dropout(0.1)
        self.head = keras.layers.Dense(classes)

    def call(self, inputs, training=None):
        x = self.embedding(inputs)
        mask = self.embedding.compute_mask(inputs)
        for block in self.blocks:
            x = block(x, mask=mask, training=training)
        x = self.pool(x, mask=mask)
        return self.head(self.dropout(x, training=training))


def build_model():
    return TextClassifier()


def make_data(samples=256, seed=0):
    """Token ids with random padding; the label is whether token 1 occurs."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(2, VOCAB, size=(samples, LENGTH))
    lengths = rng.integers(LENGTH // 2, LENGTH + 1, size=samples)
    tokens[np.arange(LENGTH)[None, :] >= lengths[:, None]] = 0  # padding
    labels = rng.integers(0, 2, size=samples)
    where = rng.integers(0, LENGTH // 2, size=samples)
    tokens[labels == 1, where[labels == 1]] = 1
    return tokens.astype("int32"), labels.astype("int32")


def passes():
    return [
        # Inline the blocks (and the embedding) into their Keras layers. The
        # embedding stays one opaque node, and the report says why: its
        # position ids are a constant (`arange`), and inlined, the position
        # Embedding called on it would be frozen into the graph.
        kip.passes.Expand(),
        # One recomputation checkpoint per block, at its end: `norm_2` exists
        # as `blocks.0.norm_2`, `blocks.1.norm_2` after Expand.
        kip.passes.Recompute([f"blocks.{i}.norm_2" for i in range(BLOCKS)]),
        # Outline what the blocks repeat: a target by a sub-layer's Keras
        # name (no path is `ffn_in`, so it is an alias) matches it in every
        # block, and equal layers share one body.
        # (Not `Outline(TransformerBlock)` on unexpanded blocks: a block takes
        # the padding mask as a tensor argument, and the portable outliner
        # runs such a call un-outlined.)
        kip.passes.Outline(["ffn_in", "ffn_out", "norm_1"]),
    ]


def compile_model(model):
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )


def main():
    keras.utils.set_random_seed(0)
    x, y = make_data()
    model = kip.PluginModel(build_model(), passes=passes())
    compile_model(model)
    history = model.fit(x, y, batch_size=32, epochs=3, verbose=2)
    print(model.kip_report)
    print(f"backend: {kip.backend()}")
    print(f"final loss: {history.history['loss'][-1]:.4f}")
    return history


if __name__ == "__main__":
    main()
