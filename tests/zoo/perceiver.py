"""Follows the Keras example "Image classification with Perceiver"
(Khalid Salama, keras.io/examples/vision/perceiver_image_classification/):
`Patches` (keras.ops.image.extract_patches), a `PatchEncoder` (Dense
projection plus a position Embedding of `ops.arange` positions), a
cross-attention module and a Transformer module built as functional models,
and a subclassed `Perceiver` whose learned latent array is a weight made in
`build` and read directly in `call` (expanded to a batch of one, as in the
example), iterated through the shared cross-attention and Transformer
modules, then pooled and classified. Tiny sizes: 8x8 images, 2x2 patches,
4 latents of width 8, 2 iterations.
"""

import keras
import numpy as np
from keras import layers
from keras import ops

IMAGE, PATCH, CLASSES = 8, 2, 5
NUM_PATCHES = (IMAGE // PATCH) ** 2
LATENT_DIM, PROJECTION_DIM, HEADS = 4, 8, 2


class Patches(layers.Layer):
    def __init__(self, patch_size, **kwargs):
        super().__init__(**kwargs)
        self.patch_size = patch_size

    def call(self, images):
        batch_size = ops.shape(images)[0]
        patches = ops.image.extract_patches(images, size=(self.patch_size, self.patch_size))
        patch_dims = patches.shape[-1]
        return ops.reshape(patches, [batch_size, -1, patch_dims])


class PatchEncoder(layers.Layer):
    def __init__(self, num_patches, projection_dim, **kwargs):
        super().__init__(**kwargs)
        self.num_patches = num_patches
        self.projection = layers.Dense(units=projection_dim)
        self.position_embedding = layers.Embedding(input_dim=num_patches, output_dim=projection_dim)

    def call(self, patches):
        positions = ops.arange(start=0, stop=self.num_patches, step=1)
        return self.projection(patches) + self.position_embedding(positions)


def create_ffn(hidden_units, dropout_rate):
    ffn_layers = [layers.Dense(units, activation="gelu") for units in hidden_units[:-1]]
    ffn_layers += [layers.Dense(units=hidden_units[-1]), layers.Dropout(dropout_rate)]
    return keras.Sequential(ffn_layers)


def create_cross_attention_module(latent_dim, data_dim, projection_dim, ffn_units, dropout_rate):
    inputs = {
        "latent_array": layers.Input(shape=(latent_dim, projection_dim), name="latent_array"),
        "data_array": layers.Input(shape=(data_dim, projection_dim), name="data_array"),
    }
    latent_array = layers.LayerNormalization(epsilon=1e-6)(inputs["latent_array"])
    data_array = layers.LayerNormalization(epsilon=1e-6)(inputs["data_array"])
    query = layers.Dense(units=projection_dim)(latent_array)
    key = layers.Dense(units=projection_dim)(data_array)
    value = layers.Dense(units=projection_dim)(data_array)
    attention_output = layers.Attention(use_scale=True, dropout=0.1)(
        [query, key, value], return_attention_scores=False
    )
    attention_output = layers.Add()([attention_output, latent_array])
    attention_output = layers.LayerNormalization(epsilon=1e-6)(attention_output)
    outputs = create_ffn(ffn_units, dropout_rate)(attention_output)
    outputs = layers.Add()([outputs, attention_output])
    return keras.Model(inputs=inputs, outputs=outputs, name="cross_attention")


def create_transformer_module(latent_dim, projection_dim, num_heads, num_blocks, ffn_units, dropout_rate):
    inputs = layers.Input(shape=(latent_dim, projection_dim))
    x0 = inputs
    for _ in range(num_blocks):
        x1 = layers.LayerNormalization(epsilon=1e-6)(x0)
        attention_output = layers.MultiHeadAttention(
            num_heads=num_heads, key_dim=projection_dim, dropout=0.1
        )(x1, x1)
        x2 = layers.Add()([attention_output, x0])
        x3 = layers.LayerNormalization(epsilon=1e-6)(x2)
        x3 = create_ffn(ffn_units, dropout_rate)(x3)
        x0 = layers.Add()([x3, x2])
    return keras.Model(inputs=inputs, outputs=x0, name="transformer")


class Perceiver(keras.Model):
    def __init__(self, patch_size, data_dim, latent_dim, projection_dim, num_heads,
                 num_transformer_blocks, ffn_units, dropout_rate, num_iterations,
                 classifier_units, **kwargs):
        super().__init__(**kwargs)
        self.latent_dim = latent_dim
        self.data_dim = data_dim
        self.patch_size = patch_size
        self.projection_dim = projection_dim
        self.num_heads = num_heads
        self.num_transformer_blocks = num_transformer_blocks
        self.ffn_units = ffn_units
        self.dropout_rate = dropout_rate
        self.num_iterations = num_iterations
        self.classifier_units = classifier_units

    def build(self, input_shape):
        self.latent_array = self.add_weight(
            shape=(self.latent_dim, self.projection_dim), initializer="random_normal",
            trainable=True, name="latent_array",
        )
        self.patcher = Patches(self.patch_size)
        self.patch_encoder = PatchEncoder(self.data_dim, self.projection_dim)
        self.cross_attention = create_cross_attention_module(
            self.latent_dim, self.data_dim, self.projection_dim, self.ffn_units, self.dropout_rate
        )
        self.transformer = create_transformer_module(
            self.latent_dim, self.projection_dim, self.num_heads,
            self.num_transformer_blocks, self.ffn_units, self.dropout_rate,
        )
        self.global_average_pooling = layers.GlobalAveragePooling1D()
        self.classification_head = create_ffn(self.classifier_units, self.dropout_rate)
        super().build(input_shape)

    def call(self, inputs):
        patches = self.patcher(inputs)
        encoded_patches = self.patch_encoder(patches)
        cross_attention_inputs = {
            "latent_array": ops.expand_dims(self.latent_array, 0),
            "data_array": encoded_patches,
        }
        for _ in range(self.num_iterations):
            latent_array = self.cross_attention(cross_attention_inputs)
            latent_array = self.transformer(latent_array)
            cross_attention_inputs["latent_array"] = latent_array
        representation = self.global_average_pooling(latent_array)
        return self.classification_head(representation)


def build():
    return Perceiver(
        PATCH, NUM_PATCHES, LATENT_DIM, PROJECTION_DIM, HEADS, num_transformer_blocks=1,
        ffn_units=[PROJECTION_DIM, PROJECTION_DIM], dropout_rate=0.1, num_iterations=2,
        classifier_units=[PROJECTION_DIM, CLASSES], name="perceiver",
    )


def data(batch):
    rng = np.random.RandomState(0)
    x = rng.rand(batch, IMAGE, IMAGE, 3).astype("float32")
    return x, rng.randint(0, CLASSES, size=(batch, 1))


def compile_kwargs():
    return {
        "optimizer": keras.optimizers.AdamW(learning_rate=1e-3, weight_decay=1e-4),
        "loss": keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        "metrics": [keras.metrics.SparseCategoricalAccuracy(name="acc")],
    }
