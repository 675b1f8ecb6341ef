"""Follows the Keras example "Train a Vision Transformer on small-scale
datasets" (Aritra Roy Gosthipaty and Sayak Paul,
keras.io/examples/vision/vit_small_ds/): a functional ViT whose
`ShiftedPatchTokenization` shifts the image diagonally with
`tf.image.crop_to_bounding_box` and `tf.image.pad_to_bounding_box`,
concatenates the shifts with `tf.concat` and cuts patches with
`tf.image.extract_patches`, and whose `MultiHeadAttentionLSA` subclasses
`MultiHeadAttention`, overriding its private `_compute_attention` to divide
the queries by a trainable temperature `tau` held as an attribute, with the
diagonal of the scores masked. (The example holds `tau` as a `tf.Variable`,
which Keras 3 does not track; this port holds it as a `keras.Variable`, as
the example's Keras 3 revision does. The augmentation is left out.) Tiny
sizes: 8x8 images, patches of 4, width 8, 2 heads, 2 blocks.
"""

import math

import keras
import numpy as np
import tensorflow as tf
from keras import layers
from keras import ops

IMAGE, PATCH, CLASSES, PROJECTION, HEADS, BLOCKS = 8, 4, 3, 8, 2, 2
PATCHES = (IMAGE // PATCH) ** 2
SLOW = True


class ShiftedPatchTokenization(layers.Layer):
    def __init__(self, image_size=IMAGE, patch_size=PATCH, num_patches=PATCHES,
                 projection_dim=PROJECTION, **kwargs):
        super().__init__(**kwargs)
        self.image_size = image_size
        self.patch_size = patch_size
        self.half_patch = patch_size // 2
        self.flatten_patches = layers.Reshape((num_patches, -1))
        self.projection = layers.Dense(units=projection_dim)
        self.layer_norm = layers.LayerNormalization(epsilon=1e-6)

    def crop_shift_pad(self, images, mode):
        # where the image is cropped and where the crop is put back
        crop_at = {"left-up": (self.half_patch, self.half_patch), "left-down": (0, self.half_patch),
                   "right-up": (self.half_patch, 0), "right-down": (0, 0)}[mode]
        shift_to = {"left-up": (0, 0), "left-down": (self.half_patch, 0),
                    "right-up": (0, self.half_patch),
                    "right-down": (self.half_patch, self.half_patch)}[mode]
        size = self.image_size - self.half_patch
        crop = tf.image.crop_to_bounding_box(images, crop_at[0], crop_at[1], size, size)
        return tf.image.pad_to_bounding_box(
            crop, shift_to[0], shift_to[1], self.image_size, self.image_size)

    def call(self, images):
        images = tf.concat(
            [images] + [self.crop_shift_pad(images, mode)
                        for mode in ("left-up", "left-down", "right-up", "right-down")],
            axis=-1,
        )
        patches = tf.image.extract_patches(
            images=images, sizes=[1, self.patch_size, self.patch_size, 1],
            strides=[1, self.patch_size, self.patch_size, 1], rates=[1, 1, 1, 1], padding="VALID",
        )
        tokens = self.projection(self.layer_norm(self.flatten_patches(patches)))
        return tokens, patches


class PatchEncoder(layers.Layer):
    def __init__(self, num_patches=PATCHES, projection_dim=PROJECTION, **kwargs):
        super().__init__(**kwargs)
        self.position_embedding = layers.Embedding(input_dim=num_patches, output_dim=projection_dim)
        self.positions = ops.arange(start=0, stop=num_patches, step=1)

    def call(self, encoded_patches):
        return encoded_patches + self.position_embedding(self.positions)


class MultiHeadAttentionLSA(layers.MultiHeadAttention):
    """Locality self-attention: a trainable softmax temperature."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.tau = keras.Variable(math.sqrt(float(self._key_dim)), trainable=True, name="tau")

    def _compute_attention(self, query, key, value, attention_mask=None, training=None,
                           return_attention_scores=False, **kwargs):
        query = ops.multiply(query, 1.0 / self.tau)
        attention_scores = ops.einsum(self._dot_product_equation, key, query)
        attention_scores = self._masked_softmax(attention_scores, attention_mask)
        dropped = self._dropout_layer(attention_scores, training=training)
        return ops.einsum(self._combine_equation, dropped, value), attention_scores


def mlp(x, hidden_units, dropout_rate):
    for units in hidden_units:
        x = layers.Dense(units, activation="gelu")(x)
        x = layers.Dropout(dropout_rate)(x)
    return x


def build():
    # every token but itself: the diagonal of the scores is masked
    diagonal_mask = (1 - np.eye(PATCHES, dtype="int8"))[None]
    inputs = layers.Input(shape=(IMAGE, IMAGE, 3))
    tokens, _ = ShiftedPatchTokenization()(inputs)
    encoded = PatchEncoder()(tokens)
    for _ in range(BLOCKS):
        x1 = layers.LayerNormalization(epsilon=1e-6)(encoded)
        attention = MultiHeadAttentionLSA(num_heads=HEADS, key_dim=PROJECTION, dropout=0.1)(
            x1, x1, attention_mask=diagonal_mask)
        x2 = layers.Add()([attention, encoded])
        x3 = mlp(layers.LayerNormalization(epsilon=1e-6)(x2), [PROJECTION * 2, PROJECTION], 0.1)
        encoded = layers.Add()([x3, x2])
    representation = layers.Flatten()(layers.LayerNormalization(epsilon=1e-6)(encoded))
    features = mlp(layers.Dropout(0.5)(representation), [16], 0.5)
    return keras.Model(inputs=inputs, outputs=layers.Dense(CLASSES)(features), name="vit_small_ds")


def data(batch):
    rng = np.random.RandomState(0)
    return (rng.rand(batch, IMAGE, IMAGE, 3).astype("float32"),
            rng.randint(0, CLASSES, size=(batch,)).astype("int32"))


def compile_kwargs():
    return {
        "loss": keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        "optimizer": keras.optimizers.SGD(learning_rate=0.01),
        "metrics": [keras.metrics.SparseCategoricalAccuracy(name="accuracy")],
    }
