"""Follows the FNet of the Keras example "Image classification with modern
MLP models" (Khalid Salama, keras.io/examples/vision/mlp_image_classification/):
`FNetLayer` blocks that mix tokens with a 2-D Fourier transform
(`keras.ops.fft2` on (real, zeros), keeping the real part), add the input,
normalise, apply a Sequential feed-forward network and normalise again; the
example's functional `build_classifier` with a learned position embedding
(an Embedding of `ops.arange` positions added to the projected patches).
Tiny sizes: 8x8 images, 2x2 patches, width 8.
"""

import keras
import numpy as np
from keras import layers
from keras import ops

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


class FNetLayer(layers.Layer):
    def __init__(self, embedding_dim, dropout_rate, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.ffn = keras.Sequential([
            layers.Dense(units=embedding_dim, activation="gelu"),
            layers.Dropout(rate=dropout_rate),
            layers.Dense(units=embedding_dim),
        ])
        self.normalize1 = layers.LayerNormalization(epsilon=1e-6)
        self.normalize2 = layers.LayerNormalization(epsilon=1e-6)

    def call(self, inputs):
        real_part = inputs
        im_part = keras.ops.zeros_like(inputs)
        x = keras.ops.fft2((real_part, im_part))[0]
        x = x + inputs
        x = self.normalize1(x)
        x_ffn = self.ffn(x)
        x = x + x_ffn
        return self.normalize2(x)


def build_classifier(blocks, positional_encoding=True):
    inputs = layers.Input(shape=(IMAGE, IMAGE, 3))
    patches = Patches(PATCH)(inputs)
    x = layers.Dense(units=EMBEDDING)(patches)
    if positional_encoding:
        x = x + layers.Embedding(input_dim=NUM_PATCHES, output_dim=EMBEDDING)(
            ops.arange(0, NUM_PATCHES, 1)
        )
    x = blocks(x)
    representation = layers.GlobalAveragePooling1D()(x)
    representation = layers.Dropout(rate=0.2)(representation)
    logits = layers.Dense(CLASSES)(representation)
    return keras.Model(inputs=inputs, outputs=logits, name="fnet")


def build():
    blocks = keras.Sequential([FNetLayer(EMBEDDING, 0.2) for _ in range(BLOCKS)])
    return build_classifier(blocks, positional_encoding=True)


def data(batch):
    rng = np.random.RandomState(0)
    return rng.rand(batch, IMAGE, IMAGE, 3).astype("float32"), rng.randint(0, CLASSES, size=(batch, 1))


def compile_kwargs():
    return {
        "optimizer": keras.optimizers.AdamW(learning_rate=1e-3, weight_decay=1e-4),
        "loss": keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        "metrics": [keras.metrics.SparseCategoricalAccuracy(name="acc")],
    }
