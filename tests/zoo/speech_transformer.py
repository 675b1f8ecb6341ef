"""Follows the Keras example "Automatic Speech Recognition with Transformer"
(Apoorv Nandan, keras.io/examples/audio/transformer_asr/): a
`TokenEmbedding` (token and position Embeddings), a
`SpeechFeatureEmbedding` (strided Conv1D stack), `TransformerEncoder`
layers in a Sequential `encoder`, `TransformerDecoder` layers set as
attributes `dec_layer_{i}` with a causal mask tiled to the batch size (multiples
given as a tuple: Keras 3.15 cannot tile by the example's concatenated
tensor in a traced step),
and a `Transformer` model whose `call` takes `[source, target]`, whose
`train_step` reads a dict batch `{"source", "target"}` and calls
`self([source, target[:, :-1]])`, and whose loss is `compute_loss` with a
padding mask as sample weight, tracked by its own `Mean` metric. Tiny
sizes: 16 audio frames of 6 features, targets of 6 tokens, width 8.
"""

import keras
import numpy as np
import tensorflow as tf
from keras import layers
from keras import ops

FRAMES, FEATURES, TARGET, CLASSES, HIDDEN, HEADS, FF = 16, 6, 6, 10, 8, 2, 16


class TokenEmbedding(layers.Layer):
    def __init__(self, num_vocab=1000, maxlen=100, num_hid=64, **kwargs):
        super().__init__(**kwargs)
        self.emb = keras.layers.Embedding(num_vocab, num_hid)
        self.pos_emb = layers.Embedding(input_dim=maxlen, output_dim=num_hid)

    def call(self, x):
        maxlen = ops.shape(x)[-1]
        x = self.emb(x)
        positions = ops.arange(start=0, stop=maxlen, step=1)
        positions = self.pos_emb(positions)
        return x + positions


class SpeechFeatureEmbedding(layers.Layer):
    def __init__(self, num_hid=64, **kwargs):
        super().__init__(**kwargs)
        self.conv1 = keras.layers.Conv1D(num_hid, 11, strides=2, padding="same", activation="relu")
        self.conv2 = keras.layers.Conv1D(num_hid, 11, strides=2, padding="same", activation="relu")

    def call(self, x):
        return self.conv2(self.conv1(x))


class TransformerEncoder(layers.Layer):
    def __init__(self, embed_dim, num_heads, feed_forward_dim, rate=0.1, **kwargs):
        super().__init__(**kwargs)
        self.att = layers.MultiHeadAttention(num_heads=num_heads, key_dim=embed_dim)
        self.ffn = keras.Sequential([
            layers.Dense(feed_forward_dim, activation="relu"),
            layers.Dense(embed_dim),
        ])
        self.layernorm1 = layers.LayerNormalization(epsilon=1e-6)
        self.layernorm2 = layers.LayerNormalization(epsilon=1e-6)
        self.dropout1 = layers.Dropout(rate)
        self.dropout2 = layers.Dropout(rate)

    def call(self, inputs, training=False):
        attn_output = self.att(inputs, inputs)
        attn_output = self.dropout1(attn_output, training=training)
        out1 = self.layernorm1(inputs + attn_output)
        ffn_output = self.ffn(out1)
        ffn_output = self.dropout2(ffn_output, training=training)
        return self.layernorm2(out1 + ffn_output)


class TransformerDecoder(layers.Layer):
    def __init__(self, embed_dim, num_heads, feed_forward_dim, dropout_rate=0.1, **kwargs):
        super().__init__(**kwargs)
        self.layernorm1 = layers.LayerNormalization(epsilon=1e-6)
        self.layernorm2 = layers.LayerNormalization(epsilon=1e-6)
        self.layernorm3 = layers.LayerNormalization(epsilon=1e-6)
        self.self_att = layers.MultiHeadAttention(num_heads=num_heads, key_dim=embed_dim)
        self.enc_att = layers.MultiHeadAttention(num_heads=num_heads, key_dim=embed_dim)
        self.self_dropout = layers.Dropout(0.5)
        self.enc_dropout = layers.Dropout(0.1)
        self.ffn_dropout = layers.Dropout(0.1)
        self.ffn = keras.Sequential([
            layers.Dense(feed_forward_dim, activation="relu"),
            layers.Dense(embed_dim),
        ])

    def causal_attention_mask(self, batch_size, n_dest, n_src, dtype):
        """Masks the upper half of the dot product matrix in self attention."""
        i = ops.arange(n_dest)[:, None]
        j = ops.arange(n_src)
        m = i >= j - n_src + n_dest
        mask = ops.cast(m, dtype)
        mask = ops.reshape(mask, [1, n_dest, n_src])
        # The example concatenates the multiples into one tensor; Keras
        # 3.15's `ops.tile` iterates over them, which a traced step cannot.
        return ops.tile(mask, (batch_size, 1, 1))

    def call(self, enc_out, target):
        input_shape = ops.shape(target)
        batch_size = input_shape[0]
        seq_len = input_shape[1]
        causal_mask = self.causal_attention_mask(batch_size, seq_len, seq_len, "bool")
        target_att = self.self_att(target, target, attention_mask=causal_mask)
        target_norm = self.layernorm1(target + self.self_dropout(target_att))
        enc_out = self.enc_att(target_norm, enc_out)
        enc_out_norm = self.layernorm2(self.enc_dropout(enc_out) + target_norm)
        ffn_out = self.ffn(enc_out_norm)
        return self.layernorm3(enc_out_norm + self.ffn_dropout(ffn_out))


class Transformer(keras.Model):
    def __init__(self, num_hid=64, num_head=2, num_feed_forward=128, source_maxlen=100,
                 target_maxlen=100, num_layers_enc=4, num_layers_dec=1, num_classes=10, **kwargs):
        super().__init__(**kwargs)
        self.loss_metric = keras.metrics.Mean(name="loss")
        self.num_layers_enc = num_layers_enc
        self.num_layers_dec = num_layers_dec
        self.target_maxlen = target_maxlen
        self.num_classes = num_classes

        self.enc_input = SpeechFeatureEmbedding(num_hid=num_hid)
        self.dec_input = TokenEmbedding(num_vocab=num_classes, maxlen=target_maxlen, num_hid=num_hid)
        self.encoder = keras.Sequential(
            [self.enc_input]
            + [TransformerEncoder(num_hid, num_head, num_feed_forward) for _ in range(num_layers_enc)]
        )
        for i in range(num_layers_dec):
            setattr(self, f"dec_layer_{i}", TransformerDecoder(num_hid, num_head, num_feed_forward))
        self.classifier = layers.Dense(num_classes)

    def decode(self, enc_out, target):
        y = self.dec_input(target)
        for i in range(self.num_layers_dec):
            y = getattr(self, f"dec_layer_{i}")(enc_out, y)
        return y

    def call(self, inputs):
        source = inputs[0]
        target = inputs[1]
        x = self.encoder(source)
        y = self.decode(x, target)
        return self.classifier(y)

    @property
    def metrics(self):
        return [self.loss_metric]

    def train_step(self, batch):
        """Processes one batch inside model.fit()."""
        source = batch["source"]
        target = batch["target"]
        dec_input = target[:, :-1]
        dec_target = target[:, 1:]
        with tf.GradientTape() as tape:
            preds = self([source, dec_input])
            one_hot = ops.one_hot(dec_target, self.num_classes)
            mask = ops.logical_not(ops.equal(dec_target, 0))
            loss = self.compute_loss(None, one_hot, preds, sample_weight=mask)
        trainable_vars = self.trainable_variables
        gradients = tape.gradient(loss, trainable_vars)
        self.optimizer.apply_gradients(zip(gradients, trainable_vars))
        self.loss_metric.update_state(loss)
        return {"loss": self.loss_metric.result()}


def build():
    return Transformer(
        num_hid=HIDDEN, num_head=HEADS, num_feed_forward=FF, target_maxlen=TARGET,
        num_layers_enc=2, num_layers_dec=1, num_classes=CLASSES, name="speech_transformer",
    )


def data(batch):
    rng = np.random.RandomState(0)
    source = rng.normal(size=(batch, FRAMES, FEATURES)).astype("float32")
    target = rng.randint(1, CLASSES, size=(batch, TARGET))
    for row in range(batch):
        target[row, TARGET - row % 3:] = 0  # padding
    return {"source": source, "target": target}, None


def model_input(x, y):
    return [x["source"], x["target"][:, :-1]]


def compile_kwargs():
    return {
        "optimizer": keras.optimizers.Adam(1e-3),
        "loss": keras.losses.CategoricalCrossentropy(from_logits=True, label_smoothing=0.1),
    }
