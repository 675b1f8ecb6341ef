"""Follows the Keras example "English-to-Spanish translation with a
sequence-to-sequence Transformer" (fchollet,
keras.io/examples/nlp/neural_machine_translation_with_transformer/):
`PositionalEmbedding` (token and position Embeddings, positions from
`ops.arange` over the sequence length, and a `compute_mask` that marks
padding tokens), a `TransformerEncoder` and a `TransformerDecoder` that
support masking (`call(..., mask=None)` turning the incoming Keras mask
into an attention mask, the decoder combining it with a causal mask built
from `ops.shape(inputs)[0]` and tiled to the batch: multiples given as a
tuple, since Keras 3.15 cannot tile by the example's concatenated tensor in
a traced step), and a softmax head;
the example's functional model is written here as a subclassed model over
a dict of `encoder_inputs` and `decoder_inputs`, trained on the target
shifted by one. Tiny sizes: vocabulary 20, sequences of 6, width 8.
"""

import keras
import numpy as np
from keras import layers
from keras import ops

VOCAB, LENGTH, EMBED, DENSE, HEADS = 20, 6, 8, 16, 2


class TransformerEncoder(layers.Layer):
    def __init__(self, embed_dim, dense_dim, num_heads, **kwargs):
        super().__init__(**kwargs)
        self.embed_dim = embed_dim
        self.dense_dim = dense_dim
        self.num_heads = num_heads
        self.attention = layers.MultiHeadAttention(num_heads=num_heads, key_dim=embed_dim)
        self.dense_proj = keras.Sequential(
            [layers.Dense(dense_dim, activation="relu"), layers.Dense(embed_dim)]
        )
        self.layernorm_1 = layers.LayerNormalization()
        self.layernorm_2 = layers.LayerNormalization()
        self.supports_masking = True

    def call(self, inputs, mask=None):
        if mask is not None:
            padding_mask = ops.cast(mask[:, None, :], dtype="int32")
        else:
            padding_mask = None
        attention_output = self.attention(
            query=inputs, value=inputs, key=inputs, attention_mask=padding_mask
        )
        proj_input = self.layernorm_1(inputs + attention_output)
        proj_output = self.dense_proj(proj_input)
        return self.layernorm_2(proj_input + proj_output)


class PositionalEmbedding(layers.Layer):
    def __init__(self, sequence_length, vocab_size, embed_dim, **kwargs):
        super().__init__(**kwargs)
        self.token_embeddings = layers.Embedding(input_dim=vocab_size, output_dim=embed_dim)
        self.position_embeddings = layers.Embedding(input_dim=sequence_length, output_dim=embed_dim)
        self.sequence_length = sequence_length
        self.vocab_size = vocab_size
        self.embed_dim = embed_dim

    def call(self, inputs):
        length = ops.shape(inputs)[-1]
        positions = ops.arange(0, length, 1)
        embedded_tokens = self.token_embeddings(inputs)
        embedded_positions = self.position_embeddings(positions)
        return embedded_tokens + embedded_positions

    def compute_mask(self, inputs, mask=None):
        return ops.not_equal(inputs, 0)


class TransformerDecoder(layers.Layer):
    def __init__(self, embed_dim, latent_dim, num_heads, **kwargs):
        super().__init__(**kwargs)
        self.embed_dim = embed_dim
        self.latent_dim = latent_dim
        self.num_heads = num_heads
        self.attention_1 = layers.MultiHeadAttention(num_heads=num_heads, key_dim=embed_dim)
        self.attention_2 = layers.MultiHeadAttention(num_heads=num_heads, key_dim=embed_dim)
        self.dense_proj = keras.Sequential(
            [layers.Dense(latent_dim, activation="relu"), layers.Dense(embed_dim)]
        )
        self.layernorm_1 = layers.LayerNormalization()
        self.layernorm_2 = layers.LayerNormalization()
        self.layernorm_3 = layers.LayerNormalization()
        self.supports_masking = True

    def call(self, inputs, mask=None):
        inputs, encoder_outputs = inputs
        causal_mask = self.get_causal_attention_mask(inputs)
        if mask is None:
            inputs_padding_mask, encoder_outputs_padding_mask = None, None
        else:
            inputs_padding_mask, encoder_outputs_padding_mask = mask
        attention_output_1 = self.attention_1(
            query=inputs, value=inputs, key=inputs, attention_mask=causal_mask,
            query_mask=inputs_padding_mask,
        )
        out_1 = self.layernorm_1(inputs + attention_output_1)
        attention_output_2 = self.attention_2(
            query=out_1, value=encoder_outputs, key=encoder_outputs,
            query_mask=inputs_padding_mask, key_mask=encoder_outputs_padding_mask,
        )
        out_2 = self.layernorm_2(out_1 + attention_output_2)
        proj_output = self.dense_proj(out_2)
        return self.layernorm_3(out_2 + proj_output)

    def get_causal_attention_mask(self, inputs):
        input_shape = ops.shape(inputs)
        batch_size, sequence_length = input_shape[0], input_shape[1]
        i = ops.arange(sequence_length)[:, None]
        j = ops.arange(sequence_length)
        mask = ops.cast(i >= j, dtype="int32")
        mask = ops.reshape(mask, (1, input_shape[1], input_shape[1]))
        # The example concatenates the multiples into one tensor; Keras
        # 3.15's `ops.tile` iterates over them, which a traced step cannot.
        return ops.tile(mask, (batch_size, 1, 1))


class Seq2SeqTransformer(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.encoder_embedding = PositionalEmbedding(LENGTH, VOCAB, EMBED)
        self.encoder = TransformerEncoder(EMBED, DENSE, HEADS)
        self.decoder_embedding = PositionalEmbedding(LENGTH, VOCAB, EMBED)
        self.decoder = TransformerDecoder(EMBED, DENSE, HEADS)
        self.dropout = layers.Dropout(0.5)
        self.head = layers.Dense(VOCAB, activation="softmax")

    def call(self, inputs, training=None):
        x = self.encoder_embedding(inputs["encoder_inputs"])
        encoder_outputs = self.encoder(x)
        x = self.decoder_embedding(inputs["decoder_inputs"])
        x = self.decoder([x, encoder_outputs])
        x = self.dropout(x, training=training)
        return self.head(x)


def build():
    return Seq2SeqTransformer(name="translation_transformer")


def data(batch):
    rng = np.random.RandomState(0)
    source = rng.randint(1, VOCAB, size=(batch, LENGTH))
    target = rng.randint(1, VOCAB, size=(batch, LENGTH + 1))
    for row in range(batch):  # some padding, so that the masks matter
        source[row, LENGTH - row % 3:] = 0
        target[row, LENGTH + 1 - row % 2:] = 0
    x = {"encoder_inputs": source, "decoder_inputs": target[:, :-1]}
    return x, target[:, 1:]


def compile_kwargs():
    return {
        "optimizer": "rmsprop",
        "loss": "sparse_categorical_crossentropy",
        "metrics": ["accuracy"],
    }
