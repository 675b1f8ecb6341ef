"""Follows the Keras example "Text classification with Switch Transformer"
(Khalid Salama, keras.io/examples/nlp/text_classification_with_switch_transformer/),
in its TensorFlow form: a functional classifier whose `TransformerBlock`
has a `Switch` mixture-of-experts feed-forward. The `Switch` reshapes the
tokens to `[num_tokens_per_batch, embed_dim]`, a Python int computed from
the data's batch size (a batch size written as a constant), routes
them with a `Router` (top-1 expert, a load-balancing loss by `add_loss`,
expert capacity, noise on the logits in training) and dispatches and
combines with `tf.einsum`. The noise carries an op-level seed
(`seed=1337`), so that plain Keras and the plugin draw the same numbers in
training; the example's has none. Tiny sizes: 20 words, 4 tokens, batch 4,
2 experts, embeddings of 8.

What stays whole (with the reason in the report): `Switch`, whose reshape
to the fixed number of tokens runs at the data's batch size only (write -1
there, or `ops.shape(x)[0] * tokens`, for it to expand).
"""

import keras
import numpy as np
import tensorflow as tf
from keras import layers

VOCAB, TOKENS, BATCH, EXPERTS, EMBED, HEADS = 20, 4, 4, 2, 8, 2
FF = EMBED
NUM_TOKENS_PER_BATCH = BATCH * TOKENS
DROPOUT = 0.25


class TokenAndPositionEmbedding(layers.Layer):
    def __init__(self, maxlen, vocab_size, embed_dim, **kwargs):
        super().__init__(**kwargs)
        self.token_emb = layers.Embedding(input_dim=vocab_size, output_dim=embed_dim)
        self.pos_emb = layers.Embedding(input_dim=maxlen, output_dim=embed_dim)

    def call(self, x):
        maxlen = tf.shape(x)[-1]
        positions = tf.range(start=0, limit=maxlen, delta=1)
        positions = self.pos_emb(positions)
        x = self.token_emb(x)
        return x + positions


def create_feedforward_network(ff_dim, name=None):
    return keras.Sequential(
        [layers.Dense(ff_dim, activation="relu"), layers.Dense(ff_dim)], name=name
    )


def load_balanced_loss(router_probs, expert_mask):
    num_experts = tf.shape(expert_mask)[-1]
    density = tf.reduce_mean(expert_mask, axis=0)
    density_proxy = tf.reduce_mean(router_probs, axis=0)
    loss = tf.reduce_mean(density_proxy * density) * tf.cast(
        (num_experts**2), tf.dtypes.float32
    )
    return loss


class Router(layers.Layer):
    def __init__(self, num_experts, expert_capacity, **kwargs):
        self.num_experts = num_experts
        self.route = layers.Dense(units=num_experts)
        self.expert_capacity = expert_capacity
        super().__init__(**kwargs)

    def call(self, inputs, training=False):
        router_logits = self.route(inputs)
        if training:
            # Add noise for exploration across experts.
            router_logits += tf.random.uniform(
                shape=router_logits.shape, minval=0.9, maxval=1.1, seed=1337
            )
        router_probs = keras.activations.softmax(router_logits, axis=-1)
        expert_gate, expert_index = tf.math.top_k(router_probs, k=1)
        expert_mask = tf.one_hot(expert_index, depth=self.num_experts)
        aux_loss = load_balanced_loss(router_probs, expert_mask)
        self.add_loss(aux_loss)
        position_in_expert = tf.cast(
            tf.math.cumsum(expert_mask, axis=0) * expert_mask, tf.dtypes.int32
        )
        expert_mask *= tf.cast(
            tf.math.less(tf.cast(position_in_expert, tf.dtypes.int32), self.expert_capacity),
            tf.dtypes.float32,
        )
        expert_mask_flat = tf.reduce_sum(expert_mask, axis=-1)
        expert_gate *= expert_mask_flat
        combined_tensor = tf.expand_dims(
            expert_gate
            * expert_mask_flat
            * tf.squeeze(tf.one_hot(expert_index, depth=self.num_experts), 1),
            -1,
        ) * tf.squeeze(tf.one_hot(position_in_expert, depth=self.expert_capacity), 1)
        dispatch_tensor = tf.cast(combined_tensor, tf.dtypes.float32)
        return dispatch_tensor, combined_tensor


class Switch(layers.Layer):
    def __init__(self, num_experts, embed_dim, num_tokens_per_batch, capacity_factor=1,
                 **kwargs):
        self.num_experts = num_experts
        self.embed_dim = embed_dim
        self.experts = [create_feedforward_network(embed_dim) for _ in range(num_experts)]
        self.expert_capacity = num_tokens_per_batch // self.num_experts
        self.router = Router(self.num_experts, self.expert_capacity)
        super().__init__(**kwargs)

    def call(self, inputs):
        batch_size = tf.shape(inputs)[0]
        num_tokens_per_example = tf.shape(inputs)[1]
        inputs = tf.reshape(inputs, [NUM_TOKENS_PER_BATCH, self.embed_dim])
        dispatch_tensor, combine_tensor = self.router(inputs)
        expert_inputs = tf.einsum("ab,acd->cdb", inputs, dispatch_tensor)
        expert_inputs = tf.reshape(
            expert_inputs, [self.num_experts, self.expert_capacity, self.embed_dim]
        )
        expert_input_list = tf.unstack(expert_inputs, axis=0)
        expert_output_list = [
            self.experts[idx](expert_input) for idx, expert_input in enumerate(expert_input_list)
        ]
        expert_outputs = tf.stack(expert_output_list, axis=1)
        expert_outputs_combined = tf.einsum("abc,xba->xc", expert_outputs, combine_tensor)
        outputs = tf.reshape(
            expert_outputs_combined, [batch_size, num_tokens_per_example, self.embed_dim]
        )
        return outputs


class TransformerBlock(layers.Layer):
    def __init__(self, embed_dim, num_heads, ffn, dropout_rate=0.1, **kwargs):
        super().__init__(**kwargs)
        self.att = layers.MultiHeadAttention(num_heads=num_heads, key_dim=embed_dim)
        self.ffn = ffn
        self.layernorm1 = layers.LayerNormalization(epsilon=1e-6)
        self.layernorm2 = layers.LayerNormalization(epsilon=1e-6)
        self.dropout1 = layers.Dropout(dropout_rate)
        self.dropout2 = layers.Dropout(dropout_rate)

    def call(self, inputs, training=None):
        attn_output = self.att(inputs, inputs)
        attn_output = self.dropout1(attn_output, training=training)
        out1 = self.layernorm1(inputs + attn_output)
        ffn_output = self.ffn(out1)
        ffn_output = self.dropout2(ffn_output, training=training)
        return self.layernorm2(out1 + ffn_output)


def build():
    switch = Switch(EXPERTS, EMBED, NUM_TOKENS_PER_BATCH)
    transformer_block = TransformerBlock(FF, HEADS, switch)
    inputs = layers.Input(shape=(TOKENS,))
    embedding_layer = TokenAndPositionEmbedding(TOKENS, VOCAB, EMBED)
    x = embedding_layer(inputs)
    x = transformer_block(x)
    x = layers.GlobalAveragePooling1D()(x)
    x = layers.Dropout(DROPOUT)(x)
    x = layers.Dense(FF, activation="relu")(x)
    x = layers.Dropout(DROPOUT)(x)
    outputs = layers.Dense(2, activation="softmax")(x)
    return keras.Model(inputs=inputs, outputs=outputs, name="switch_transformer")


def data(batch):
    rng = np.random.RandomState(0)
    x = rng.randint(0, VOCAB, size=(batch, TOKENS)).astype("float32")
    return x, rng.randint(0, 2, size=(batch,)).astype("int32")


def compile_kwargs():
    return {"optimizer": keras.optimizers.Adam(learning_rate=0.001),
            "loss": "sparse_categorical_crossentropy", "metrics": ["accuracy"]}
