"""Follows the Keras example "GPT text generation from scratch with
KerasHub" (Jesse Chan, keras.io/examples/generative/text_generation_gpt/):
a functional miniature GPT built from keras_hub's layers, not a backbone:
`keras_hub.layers.TokenAndPositionEmbedding`, a stack of
`keras_hub.layers.TransformerDecoder`s called without a cross-attention
input (each builds its causal mask from `ops.shape(x)[0]`, the batch size,
None when a functional model is built) and a `Dense` head over the
vocabulary, trained on next-token labels with sparse categorical
cross-entropy from logits. Tiny sizes: vocabulary 40, sequences of 8,
width 8, 2 heads, 2 decoders.
"""

import keras
import keras_hub
import numpy as np
from keras import layers

VOCAB, LENGTH, WIDTH, HEADS, DECODERS = 40, 8, 8, 2, 2
SLOW = True


def build():
    inputs = keras.Input(shape=(None,), dtype="int32")
    x = keras_hub.layers.TokenAndPositionEmbedding(
        vocabulary_size=VOCAB, sequence_length=LENGTH, embedding_dim=WIDTH, mask_zero=True,
    )(inputs)
    for _ in range(DECODERS):
        x = keras_hub.layers.TransformerDecoder(num_heads=HEADS, intermediate_dim=2 * WIDTH)(x)
    outputs = layers.Dense(VOCAB)(x)
    return keras.Model(inputs=inputs, outputs=outputs, name="gpt_text_generation")


def data(batch):
    rng = np.random.RandomState(0)
    tokens = rng.randint(1, VOCAB, size=(batch, LENGTH + 1)).astype("int32")
    return tokens[:, :-1], tokens[:, 1:]


def compile_kwargs():
    return {
        "loss": keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        "optimizer": keras.optimizers.Adam(learning_rate=0.01),
        "metrics": [keras_hub.metrics.Perplexity(from_logits=True, mask_token_id=0)],
    }
