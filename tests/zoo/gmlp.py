"""Follows the gMLP of the Keras example "Image classification with modern
MLP models" (Khalid Salama, keras.io/examples/vision/mlp_image_classification/),
written here as a subclassed model: `gMLPLayer` blocks (a channel
projection, a spatial gating unit that splits the channels with `ops.split`,
normalises one half and projects it across patches on the transposed
tensor, a second channel projection and a residual), on patches reshaped
with the batch size read by `ops.shape`. Tiny sizes: 8x8 images, 2x2
patches, width 8.
"""

import keras
import numpy as np
from keras import layers

IMAGE, PATCH, CLASSES, EMBEDDING, BLOCKS = 8, 2, 4, 8, 2
NUM_PATCHES = (IMAGE // PATCH) ** 2


class Patches(layers.Layer):
    def __init__(self, patch_size, **kwargs):
        super().__init__(**kwargs)
        self.patch_size = patch_size

    def call(self, x):
        patches = keras.ops.image.extract_patches(x, self.patch_size)
        batch_size = keras.ops.shape(patches)[0]
        num_patches = keras.ops.shape(patches)[1] * keras.ops.shape(patches)[2]
        patch_dim = keras.ops.shape(patches)[3]
        return keras.ops.reshape(patches, (batch_size, num_patches, patch_dim))


class gMLPLayer(layers.Layer):  # noqa: N801 - the example's name
    def __init__(self, num_patches, embedding_dim, dropout_rate, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.channel_projection1 = keras.Sequential([
            layers.Dense(units=embedding_dim * 2, activation="gelu"),
            layers.Dropout(rate=dropout_rate),
        ])
        self.channel_projection2 = layers.Dense(units=embedding_dim)
        self.spatial_projection = layers.Dense(units=num_patches, bias_initializer="Ones")
        self.normalize1 = layers.LayerNormalization(epsilon=1e-6)
        self.normalize2 = layers.LayerNormalization(epsilon=1e-6)

    def spatial_gating_unit(self, x):
        u, v = keras.ops.split(x, indices_or_sections=2, axis=2)
        v = self.normalize2(v)
        v_channels = keras.ops.transpose(v, axes=(0, 2, 1))
        v_projected = self.spatial_projection(v_channels)
        v_projected = keras.ops.transpose(v_projected, axes=(0, 2, 1))
        return u * v_projected

    def call(self, inputs):
        x = self.normalize1(inputs)
        x_projected = self.channel_projection1(x)
        x_spatial = self.spatial_gating_unit(x_projected)
        x_projected = self.channel_projection2(x_spatial)
        return x + x_projected


class GMLPClassifier(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.patches = Patches(PATCH)
        self.projection = layers.Dense(EMBEDDING)
        self.blocks = [gMLPLayer(NUM_PATCHES, EMBEDDING, 0.2) for _ in range(BLOCKS)]
        self.pool = layers.GlobalAveragePooling1D()
        self.dropout = layers.Dropout(0.2)
        self.logits = layers.Dense(CLASSES)

    def call(self, images, training=None):
        x = self.projection(self.patches(images))
        for block in self.blocks:
            x = block(x, training=training)
        return self.logits(self.dropout(self.pool(x), training=training))


def build():
    return GMLPClassifier(name="gmlp")


def data(batch):
    rng = np.random.RandomState(0)
    return rng.rand(batch, IMAGE, IMAGE, 3).astype("float32"), rng.randint(0, CLASSES, size=(batch, 1))


def compile_kwargs():
    return {
        "optimizer": keras.optimizers.AdamW(learning_rate=1e-3, weight_decay=1e-4),
        "loss": keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        "metrics": [keras.metrics.SparseCategoricalAccuracy(name="acc")],
    }
