"""Follows the Keras example "Compact Convolutional Transformers" (Sayak
Paul, keras.io/examples/vision/cct/): a `CCTTokenizer` (a Sequential of
Conv2D, ZeroPadding2D and MaxPooling2D whose output is reshaped to a
sequence), a `PositionEmbedding` layer that owns its table as a weight,
slices it to the sequence length and broadcasts it to the batch shape in
`call`, Transformer blocks with `StochasticDepth` (a layer that, when
training, drops the residual branch per sample with a random draw from its
SeedGenerator), and `SequencePooling` (attention pooling), written as a
subclassed model. Tiny sizes: 8x8 images, 1 conv layer, width 8, 2 blocks.
"""

import keras
import numpy as np
from keras import layers
from keras import ops

IMAGE, CLASSES, PROJECTION, HEADS, BLOCKS = 8, 3, 8, 2, 2


class CCTTokenizer(layers.Layer):
    def __init__(self, kernel_size=3, stride=1, padding=1, pooling_kernel_size=3,
                 pooling_stride=2, num_conv_layers=1, num_output_channels=(PROJECTION,), **kwargs):
        super().__init__(**kwargs)
        self.conv_model = keras.Sequential()
        for i in range(num_conv_layers):
            self.conv_model.add(layers.Conv2D(
                num_output_channels[i], kernel_size, stride, padding="valid", use_bias=False,
                activation="relu", kernel_initializer="he_normal",
            ))
            self.conv_model.add(layers.ZeroPadding2D(padding))
            self.conv_model.add(layers.MaxPooling2D(pooling_kernel_size, pooling_stride, "same"))

    def call(self, images):
        outputs = self.conv_model(images)
        return ops.reshape(
            outputs, (-1, ops.shape(outputs)[1] * ops.shape(outputs)[2], ops.shape(outputs)[-1])
        )


class PositionEmbedding(layers.Layer):
    def __init__(self, sequence_length, initializer="glorot_uniform", **kwargs):
        super().__init__(**kwargs)
        if sequence_length is None:
            raise ValueError("`sequence_length` must be an Integer, received `None`.")
        self.sequence_length = int(sequence_length)
        self.initializer = keras.initializers.get(initializer)

    def build(self, input_shape):
        feature_size = input_shape[-1]
        self.position_embeddings = self.add_weight(
            name="embeddings", shape=[self.sequence_length, feature_size],
            initializer=self.initializer, trainable=True,
        )
        super().build(input_shape)

    def call(self, inputs, start_index=0):
        shape = ops.shape(inputs)
        feature_length = shape[-1]
        sequence_length = shape[-2]
        position_embeddings = ops.convert_to_tensor(self.position_embeddings)
        position_embeddings = ops.slice(
            position_embeddings, (start_index, 0), (sequence_length, feature_length)
        )
        return ops.broadcast_to(position_embeddings, shape)

    def compute_output_shape(self, input_shape):
        return input_shape


class SequencePooling(layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.attention = layers.Dense(1)

    def call(self, x):
        attention_weights = ops.softmax(self.attention(x), axis=1)
        attention_weights = ops.transpose(attention_weights, axes=(0, 2, 1))
        weighted_representation = ops.matmul(attention_weights, x)
        return ops.squeeze(weighted_representation, -2)


class StochasticDepth(layers.Layer):
    def __init__(self, drop_prop, **kwargs):
        super().__init__(**kwargs)
        self.drop_prob = drop_prop
        self.seed_generator = keras.random.SeedGenerator(1337)

    def call(self, x, training=None):
        if training:
            keep_prob = 1 - self.drop_prob
            shape = (ops.shape(x)[0],) + (1,) * (len(x.shape) - 1)
            random_tensor = keep_prob + keras.random.uniform(shape, 0, 1, seed=self.seed_generator)
            random_tensor = ops.floor(random_tensor)
            return (x / keep_prob) * random_tensor
        return x


def mlp(x, hidden_units, dropout_rate):
    for units in hidden_units:
        x = layers.Dense(units, activation=ops.gelu)(x)
        x = layers.Dropout(dropout_rate)(x)
    return x


class CCT(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.tokenizer = CCTTokenizer()
        self.position_embedding = PositionEmbedding(sequence_length=16)
        dpr = [x for x in np.linspace(0, 0.1, BLOCKS)]
        self.norms_1, self.attentions, self.norms_2, self.mlps = [], [], [], []
        self.depths_1, self.depths_2 = [], []
        for i in range(BLOCKS):
            self.norms_1.append(layers.LayerNormalization(epsilon=1e-5))
            self.attentions.append(layers.MultiHeadAttention(num_heads=HEADS, key_dim=PROJECTION, dropout=0.1))
            self.depths_1.append(StochasticDepth(dpr[i]))
            self.norms_2.append(layers.LayerNormalization(epsilon=1e-5))
            self.mlps.append(keras.Sequential([
                layers.Dense(PROJECTION, activation=ops.gelu), layers.Dropout(0.1),
                layers.Dense(PROJECTION, activation=ops.gelu), layers.Dropout(0.1),
            ]))
            self.depths_2.append(StochasticDepth(dpr[i]))
        self.final_norm = layers.LayerNormalization(epsilon=1e-5)
        self.pooling = SequencePooling()
        self.logits = layers.Dense(CLASSES)

    def call(self, images, training=None):
        encoded_patches = self.tokenizer(images)
        encoded_patches = encoded_patches + self.position_embedding(encoded_patches)
        for i in range(BLOCKS):
            x1 = self.norms_1[i](encoded_patches)
            attention_output = self.attentions[i](x1, x1, training=training)
            attention_output = self.depths_1[i](attention_output, training=training)
            x2 = attention_output + encoded_patches
            x3 = self.norms_2[i](x2)
            x3 = self.mlps[i](x3, training=training)
            x3 = self.depths_2[i](x3, training=training)
            encoded_patches = x3 + x2
        representation = self.final_norm(encoded_patches)
        return self.logits(self.pooling(representation))


def build():
    return CCT(name="cct")


def data(batch):
    rng = np.random.RandomState(0)
    x = rng.rand(batch, IMAGE, IMAGE, 3).astype("float32")
    y = keras.utils.to_categorical(rng.randint(0, CLASSES, size=(batch,)), CLASSES)
    return x, y


def compile_kwargs():
    return {
        "optimizer": keras.optimizers.AdamW(learning_rate=1e-3, weight_decay=1e-4),
        "loss": keras.losses.CategoricalCrossentropy(from_logits=True, label_smoothing=0.1),
        "metrics": [keras.metrics.CategoricalAccuracy(name="accuracy")],
    }
