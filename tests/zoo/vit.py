"""Follows the Vision Transformer of keras_hub (`keras_hub.models.ViTBackbone`:
`ViTPatchingAndEmbedding`, `ViTEncoder`, `ViTEncoderBlock`) and of the paper
"An Image is Worth 16x16 Words" (Dosovitskiy et al., 2020), written as user
code: a patching-and-embedding layer that owns a learned CLS token and a
learned position table as its own weights (read directly in `call`, the CLS
token tiled to the batch size with `ops.shape(x)[0]`), an encoder layer that
holds the Transformer encoder blocks (so the blocks sit inside another
layer), and a subclassed classifier reading the CLS position. Tiny sizes:
8x8 images, 4x4 patches, width 8, 2 blocks.
"""

import keras
import numpy as np
from keras import layers
from keras import ops

IMAGE, PATCH, CLASSES, HIDDEN, HEADS, MLP = 8, 4, 3, 8, 2, 16
NUM_PATCHES = (IMAGE // PATCH) ** 2


class PatchingAndEmbedding(layers.Layer):
    def __init__(self, hidden_dim, patch_size, num_patches, **kwargs):
        super().__init__(**kwargs)
        self.hidden_dim = hidden_dim
        self.num_positions = num_patches + 1
        self.patch_embedding = layers.Conv2D(
            hidden_dim, kernel_size=patch_size, strides=patch_size, padding="valid",
            name="patch_embedding",
        )

    def build(self, input_shape):
        self.class_token = self.add_weight(
            shape=(1, 1, self.hidden_dim), initializer="random_normal", name="class_token"
        )
        self.position_embedding = self.add_weight(
            shape=(self.num_positions, self.hidden_dim), initializer="random_normal",
            name="position_embedding",
        )
        self.patch_embedding.build(input_shape)

    def call(self, inputs):
        patches = self.patch_embedding(inputs)
        patches = ops.reshape(patches, (ops.shape(patches)[0], -1, self.hidden_dim))
        class_token = ops.tile(self.class_token, (ops.shape(patches)[0], 1, 1))
        tokens = ops.concatenate([class_token, patches], axis=1)
        return tokens + self.position_embedding[None]


class EncoderBlock(layers.Layer):
    def __init__(self, num_heads, hidden_dim, mlp_dim, dropout_rate=0.1, **kwargs):
        super().__init__(**kwargs)
        self.layer_norm_1 = layers.LayerNormalization(epsilon=1e-6, name="ln_1")
        self.mha = layers.MultiHeadAttention(
            num_heads=num_heads, key_dim=hidden_dim // num_heads, dropout=dropout_rate, name="mha"
        )
        self.dropout = layers.Dropout(dropout_rate)
        self.layer_norm_2 = layers.LayerNormalization(epsilon=1e-6, name="ln_2")
        self.mlp_1 = layers.Dense(mlp_dim, activation="gelu", name="mlp_1")
        self.mlp_2 = layers.Dense(hidden_dim, name="mlp_2")
        self.mlp_dropout = layers.Dropout(dropout_rate)

    def call(self, inputs, training=None):
        x = self.layer_norm_1(inputs)
        x = self.mha(x, x, training=training)
        x = self.dropout(x, training=training)
        x = x + inputs
        y = self.layer_norm_2(x)
        y = self.mlp_dropout(self.mlp_2(self.mlp_1(y)), training=training)
        return x + y


class Encoder(layers.Layer):
    def __init__(self, num_layers, num_heads, hidden_dim, mlp_dim, **kwargs):
        super().__init__(**kwargs)
        self.encoder_layers = [
            EncoderBlock(num_heads, hidden_dim, mlp_dim, name=f"transformer_block_{i + 1}")
            for i in range(num_layers)
        ]
        self.layer_norm = layers.LayerNormalization(epsilon=1e-6, name="ln")

    def call(self, inputs, training=None):
        x = inputs
        for block in self.encoder_layers:
            x = block(x, training=training)
        return self.layer_norm(x)


class ViTClassifier(keras.Model):
    def __init__(self, num_classes=CLASSES, **kwargs):
        super().__init__(**kwargs)
        self.embedding = PatchingAndEmbedding(HIDDEN, PATCH, NUM_PATCHES, name="vit_patching_and_embedding")
        self.encoder = Encoder(2, HEADS, HIDDEN, MLP, name="vit_encoder")
        self.head = layers.Dense(num_classes, name="head")

    def call(self, images, training=None):
        tokens = self.encoder(self.embedding(images), training=training)
        return self.head(tokens[:, 0])


def build():
    return ViTClassifier(name="vit")


def data(batch):
    rng = np.random.RandomState(0)
    return rng.rand(batch, IMAGE, IMAGE, 3).astype("float32"), rng.randint(0, CLASSES, size=(batch,))


def compile_kwargs():
    return {
        "optimizer": keras.optimizers.Adam(1e-3),
        "loss": keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    }
