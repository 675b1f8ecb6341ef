"""Follows the MLP-Mixer of the Keras example "Image classification with
modern MLP models" (Khalid Salama, keras.io/examples/vision/mlp_image_classification/):
a `Patches` layer that reshapes `extract_patches` output with the batch
size read by `ops.shape(images)[0]`, `MLPMixerLayer` blocks (token mixing
on the transposed patches through a Sequential MLP, then channel mixing,
with a shared LayerNormalization), and the example's functional
`build_classifier` (patches -> Dense projection -> Sequential of blocks ->
pooling -> Dropout -> Dense). Tiny sizes: 8x8 images, 2x2 patches, width 8.
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


class MLPMixerLayer(layers.Layer):
    def __init__(self, num_patches, hidden_units, dropout_rate, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.mlp1 = keras.Sequential([
            layers.Dense(units=num_patches, activation="gelu"),
            layers.Dense(units=num_patches),
            layers.Dropout(rate=dropout_rate),
        ])
        self.mlp2 = keras.Sequential([
            layers.Dense(units=num_patches, activation="gelu"),
            layers.Dense(units=hidden_units),
            layers.Dropout(rate=dropout_rate),
        ])
        self.normalize = layers.LayerNormalization(epsilon=1e-6)

    def build(self, input_shape):
        return super().build(input_shape)

    def call(self, inputs):
        x = self.normalize(inputs)
        x_channels = ops.transpose(x, axes=(0, 2, 1))
        mlp1_outputs = self.mlp1(x_channels)
        mlp1_outputs = ops.transpose(mlp1_outputs, axes=(0, 2, 1))
        x = mlp1_outputs + inputs
        x_patches = self.normalize(x)
        mlp2_outputs = self.mlp2(x_patches)
        return x + mlp2_outputs


def build_classifier(blocks, positional_encoding=False):
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
    return keras.Model(inputs=inputs, outputs=logits, name="mlp_mixer")


def build():
    blocks = keras.Sequential(
        [MLPMixerLayer(NUM_PATCHES, EMBEDDING, 0.2) for _ in range(BLOCKS)]
    )
    return build_classifier(blocks)


def data(batch):
    rng = np.random.RandomState(0)
    return rng.rand(batch, IMAGE, IMAGE, 3).astype("float32"), rng.randint(0, CLASSES, size=(batch, 1))


def compile_kwargs():
    return {
        "optimizer": keras.optimizers.AdamW(learning_rate=1e-3, weight_decay=1e-4),
        "loss": keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        "metrics": [keras.metrics.SparseCategoricalAccuracy(name="acc")],
    }
