"""Follows the Keras example "Named Entity Recognition using Transformers"
(Varun Singh, keras.io/examples/nlp/ner_transformers/): a subclassed
`NERModel` over a `TokenAndPositionEmbedding` whose positions are
`tf.range(start=0, limit=tf.shape(inputs)[-1], delta=1)` (a TensorFlow
function with no tensor to compute from but a size computed in the graph),
one `TransformerBlock` (multi-head attention, dropout,
LayerNormalization, a Sequential feed-forward) and per-token softmax tags,
trained with the example's `CustomNonPaddingTokenLoss` (padding tokens,
tag 0, left out). Tiny sizes: 20 words, 8 tokens, 5 tags, embeddings of 8.
"""

import keras
import numpy as np
import tensorflow as tf
from keras import layers
from keras import ops

VOCAB, MAXLEN, TAGS, EMBED, HEADS, FF = 20, 8, 5, 8, 2, 8


class TransformerBlock(layers.Layer):
    def __init__(self, embed_dim, num_heads, ff_dim, rate=0.1, **kwargs):
        super().__init__(**kwargs)
        self.att = keras.layers.MultiHeadAttention(num_heads=num_heads, key_dim=embed_dim)
        self.ffn = keras.Sequential(
            [keras.layers.Dense(ff_dim, activation="relu"), keras.layers.Dense(embed_dim)]
        )
        self.layernorm1 = keras.layers.LayerNormalization(epsilon=1e-6)
        self.layernorm2 = keras.layers.LayerNormalization(epsilon=1e-6)
        self.dropout1 = keras.layers.Dropout(rate)
        self.dropout2 = keras.layers.Dropout(rate)

    def call(self, inputs, training=False):
        attn_output = self.att(inputs, inputs)
        attn_output = self.dropout1(attn_output, training=training)
        out1 = self.layernorm1(inputs + attn_output)
        ffn_output = self.ffn(out1)
        ffn_output = self.dropout2(ffn_output, training=training)
        return self.layernorm2(out1 + ffn_output)


class TokenAndPositionEmbedding(layers.Layer):
    def __init__(self, maxlen, vocab_size, embed_dim, **kwargs):
        super().__init__(**kwargs)
        self.token_emb = keras.layers.Embedding(input_dim=vocab_size, output_dim=embed_dim)
        self.pos_emb = keras.layers.Embedding(input_dim=maxlen, output_dim=embed_dim)

    def call(self, inputs):
        maxlen = tf.shape(inputs)[-1]
        positions = tf.range(start=0, limit=maxlen, delta=1)
        position_embeddings = self.pos_emb(positions)
        token_embeddings = self.token_emb(inputs)
        return token_embeddings + position_embeddings


class NERModel(keras.Model):
    def __init__(self, num_tags, vocab_size, maxlen=128, embed_dim=32, num_heads=2, ff_dim=32,
                 **kwargs):
        super().__init__(**kwargs)
        self.embedding_layer = TokenAndPositionEmbedding(maxlen, vocab_size, embed_dim)
        self.transformer_block = TransformerBlock(embed_dim, num_heads, ff_dim)
        self.dropout1 = layers.Dropout(0.1)
        self.ff = layers.Dense(ff_dim, activation="relu")
        self.dropout2 = layers.Dropout(0.1)
        self.ff_final = layers.Dense(num_tags, activation="softmax")

    def call(self, inputs, training=False):
        x = self.embedding_layer(inputs)
        x = self.transformer_block(x)
        x = self.dropout1(x, training=training)
        x = self.ff(x)
        x = self.dropout2(x, training=training)
        x = self.ff_final(x)
        return x


class CustomNonPaddingTokenLoss(keras.losses.Loss):
    def __init__(self, name="custom_ner_loss"):
        super().__init__(name=name)

    def call(self, y_true, y_pred):
        loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=False, reduction=None)
        loss = loss_fn(y_true, y_pred)
        mask = ops.cast((y_true > 0), dtype="float32")
        loss = loss * mask
        return ops.sum(loss) / ops.sum(mask)


def build():
    return NERModel(TAGS, VOCAB, MAXLEN, EMBED, HEADS, FF, name="ner")


def data(batch):
    rng = np.random.RandomState(0)
    tokens = rng.randint(1, VOCAB, size=(batch, MAXLEN)).astype("int32")
    tags = rng.randint(0, TAGS, size=(batch, MAXLEN)).astype("int32")
    tags[:, 0] = 1  # every row has a token that is not padding
    return tokens, tags


def compile_kwargs():
    return {"optimizer": keras.optimizers.Adam(), "loss": CustomNonPaddingTokenLoss()}
