"""Follows the Keras example "Image classification with Swin Transformers"
(Rishit Dagli, keras.io/examples/vision/swin_transformers/): `window_partition`
and `window_reverse` with reshapes and transposes, a `WindowAttention`
layer whose relative-position bias table is a weight read directly in
`call` and gathered with a non-trainable relative-position index variable,
a `SwinTransformer` block (LayerNormalization, cyclic shift with
`ops.roll`, windowed attention with a shifted-window attention mask kept
as a non-trainable variable, MLP), `PatchExtract`, `PatchEmbedding`
(Dense projection plus a position Embedding of `ops.arange` positions) and
`PatchMerging`, in a subclassed classifier. Tiny sizes: 8x8 images, 2x2
patches (a 4x4 grid), windows of 2, shift 1, width 8.
"""

import keras
import numpy as np
from keras import layers
from keras import ops

IMAGE, PATCH, CLASSES, EMBED, HEADS, WINDOW, SHIFT, MLP = 8, 2, 3, 8, 2, 2, 1, 16
GRID = IMAGE // PATCH


def window_partition(x, window_size):
    _, height, width, channels = x.shape
    patch_num_y = height // window_size
    patch_num_x = width // window_size
    x = ops.reshape(x, (-1, patch_num_y, window_size, patch_num_x, window_size, channels))
    x = ops.transpose(x, (0, 1, 3, 2, 4, 5))
    return ops.reshape(x, (-1, window_size, window_size, channels))


def window_reverse(windows, window_size, height, width, channels):
    patch_num_y = height // window_size
    patch_num_x = width // window_size
    x = ops.reshape(windows, (-1, patch_num_y, patch_num_x, window_size, window_size, channels))
    x = ops.transpose(x, (0, 1, 3, 2, 4, 5))
    return ops.reshape(x, (-1, height, width, channels))


class WindowAttention(layers.Layer):
    def __init__(self, dim, window_size, num_heads, qkv_bias=True, dropout_rate=0.0, **kwargs):
        super().__init__(**kwargs)
        self.dim = dim
        self.window_size = window_size
        self.num_heads = num_heads
        self.scale = (dim // num_heads) ** -0.5
        self.qkv = layers.Dense(dim * 3, use_bias=qkv_bias)
        self.dropout = layers.Dropout(dropout_rate)
        self.proj = layers.Dense(dim)

        num_window_elements = (2 * self.window_size[0] - 1) * (2 * self.window_size[1] - 1)
        self.relative_position_bias_table = self.add_weight(
            shape=(num_window_elements, self.num_heads), initializer=keras.initializers.Zeros(),
            trainable=True, name="relative_position_bias_table",
        )
        coords_h = np.arange(self.window_size[0])
        coords_w = np.arange(self.window_size[1])
        coords_matrix = np.meshgrid(coords_h, coords_w, indexing="ij")
        coords = np.stack(coords_matrix)
        coords_flatten = coords.reshape(2, -1)
        relative_coords = coords_flatten[:, :, None] - coords_flatten[:, None, :]
        relative_coords = relative_coords.transpose([1, 2, 0])
        relative_coords[:, :, 0] += self.window_size[0] - 1
        relative_coords[:, :, 1] += self.window_size[1] - 1
        relative_coords[:, :, 0] *= 2 * self.window_size[1] - 1
        relative_position_index = relative_coords.sum(-1)
        self.relative_position_index = keras.Variable(
            initializer=relative_position_index, shape=relative_position_index.shape,
            dtype="int32", trainable=False, name="relative_position_index",
        )

    def call(self, x, mask=None):
        _, size, channels = x.shape
        head_dim = channels // self.num_heads
        x_qkv = self.qkv(x)
        x_qkv = ops.reshape(x_qkv, (-1, size, 3, self.num_heads, head_dim))
        x_qkv = ops.transpose(x_qkv, (2, 0, 3, 1, 4))
        q, k, v = x_qkv[0], x_qkv[1], x_qkv[2]
        q = q * self.scale
        k = ops.transpose(k, (0, 1, 3, 2))
        attn = q @ k

        num_window_elements = self.window_size[0] * self.window_size[1]
        relative_position_index_flat = ops.reshape(self.relative_position_index, (-1,))
        relative_position_bias = ops.take(
            self.relative_position_bias_table, relative_position_index_flat, axis=0
        )
        relative_position_bias = ops.reshape(
            relative_position_bias, (num_window_elements, num_window_elements, -1)
        )
        relative_position_bias = ops.transpose(relative_position_bias, (2, 0, 1))
        attn = attn + ops.expand_dims(relative_position_bias, axis=0)

        if mask is not None:
            n_windows = mask.shape[0]
            mask_float = ops.cast(ops.expand_dims(ops.expand_dims(mask, axis=1), axis=0), "float32")
            attn = ops.reshape(attn, (-1, n_windows, self.num_heads, size, size)) + mask_float
            attn = ops.reshape(attn, (-1, self.num_heads, size, size))
        attn = keras.activations.softmax(attn, axis=-1)
        attn = self.dropout(attn)

        x_qkv = attn @ v
        x_qkv = ops.transpose(x_qkv, (0, 2, 1, 3))
        x_qkv = ops.reshape(x_qkv, (-1, size, channels))
        x_qkv = self.proj(x_qkv)
        return self.dropout(x_qkv)


class SwinTransformer(layers.Layer):
    def __init__(self, dim, num_patch, num_heads, window_size=7, shift_size=0,
                 num_mlp=1024, qkv_bias=True, dropout_rate=0.0, **kwargs):
        super().__init__(**kwargs)
        self.dim = dim
        self.num_patch = num_patch
        self.num_heads = num_heads
        self.window_size = window_size
        self.shift_size = shift_size
        self.num_mlp = num_mlp

        self.norm1 = layers.LayerNormalization(epsilon=1e-5)
        self.attn = WindowAttention(
            dim, window_size=(self.window_size, self.window_size), num_heads=num_heads,
            qkv_bias=qkv_bias, dropout_rate=dropout_rate,
        )
        self.drop_path = layers.Dropout(dropout_rate)
        self.norm2 = layers.LayerNormalization(epsilon=1e-5)
        self.mlp = keras.Sequential([
            layers.Dense(num_mlp),
            layers.Activation(keras.activations.gelu),
            layers.Dropout(dropout_rate),
            layers.Dense(dim),
            layers.Dropout(dropout_rate),
        ])
        if min(self.num_patch) < self.window_size:
            self.shift_size = 0
            self.window_size = min(self.num_patch)

    def build(self, input_shape):
        if self.shift_size == 0:
            self.attn_mask = None
        else:
            height, width = self.num_patch
            h_slices = (
                slice(0, -self.window_size),
                slice(-self.window_size, -self.shift_size),
                slice(-self.shift_size, None),
            )
            w_slices = h_slices
            mask_array = np.zeros((1, height, width, 1))
            count = 0
            for h in h_slices:
                for w in w_slices:
                    mask_array[:, h, w, :] = count
                    count += 1
            mask_windows = window_partition(ops.convert_to_tensor(mask_array), self.window_size)
            mask_windows = ops.reshape(mask_windows, [-1, self.window_size * self.window_size])
            attn_mask = ops.expand_dims(mask_windows, axis=1) - ops.expand_dims(mask_windows, axis=2)
            attn_mask = ops.where(attn_mask != 0, -100.0, attn_mask)
            attn_mask = ops.where(attn_mask == 0, 0.0, attn_mask)
            self.attn_mask = keras.Variable(
                initializer=ops.convert_to_numpy(attn_mask).astype("float32"),
                shape=attn_mask.shape, dtype="float32", trainable=False, name="attn_mask",
            )

    def call(self, x, training=False):
        height, width = self.num_patch
        _, num_patches_before, channels = x.shape
        x_skip = x
        x = self.norm1(x)
        x = ops.reshape(x, (-1, height, width, channels))
        if self.shift_size > 0:
            shifted_x = ops.roll(x, shift=[-self.shift_size, -self.shift_size], axis=[1, 2])
        else:
            shifted_x = x

        x_windows = window_partition(shifted_x, self.window_size)
        x_windows = ops.reshape(x_windows, (-1, self.window_size * self.window_size, channels))
        attn_windows = self.attn(x_windows, mask=self.attn_mask)

        attn_windows = ops.reshape(attn_windows, (-1, self.window_size, self.window_size, channels))
        shifted_x = window_reverse(attn_windows, self.window_size, height, width, channels)
        if self.shift_size > 0:
            x = ops.roll(shifted_x, shift=[self.shift_size, self.shift_size], axis=[1, 2])
        else:
            x = shifted_x

        x = ops.reshape(x, (-1, height * width, channels))
        x = self.drop_path(x, training=training)
        x = x_skip + x
        x_skip = x
        x = self.norm2(x)
        x = self.mlp(x)
        x = self.drop_path(x)
        return x_skip + x


class PatchExtract(layers.Layer):
    def __init__(self, patch_size, **kwargs):
        super().__init__(**kwargs)
        self.patch_size = patch_size

    def call(self, images):
        patches = ops.image.extract_patches(images, size=(self.patch_size, self.patch_size))
        patch_dim = patches.shape[-1]
        patch_num = patches.shape[1]
        return ops.reshape(patches, (-1, patch_num * patch_num, patch_dim))


class PatchEmbedding(layers.Layer):
    def __init__(self, num_patch, embed_dim, **kwargs):
        super().__init__(**kwargs)
        self.num_patch = num_patch
        self.proj = layers.Dense(embed_dim)
        self.pos_embed = layers.Embedding(input_dim=num_patch, output_dim=embed_dim)

    def call(self, patch):
        pos = ops.arange(start=0, stop=self.num_patch)
        return self.proj(patch) + self.pos_embed(pos)


class PatchMerging(layers.Layer):
    def __init__(self, num_patch, embed_dim, **kwargs):
        super().__init__(**kwargs)
        self.num_patch = num_patch
        self.embed_dim = embed_dim
        self.linear_trans = layers.Dense(2 * embed_dim, use_bias=False)

    def call(self, x):
        height, width = self.num_patch
        _, _, channels = x.shape
        x = ops.reshape(x, (-1, height, width, channels))
        x0 = x[:, 0::2, 0::2, :]
        x1 = x[:, 1::2, 0::2, :]
        x2 = x[:, 0::2, 1::2, :]
        x3 = x[:, 1::2, 1::2, :]
        x = ops.concatenate((x0, x1, x2, x3), axis=-1)
        x = ops.reshape(x, (-1, (height // 2) * (width // 2), 4 * channels))
        return self.linear_trans(x)


class SwinClassifier(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.patch_extract = PatchExtract(PATCH)
        self.patch_embedding = PatchEmbedding(GRID * GRID, EMBED)
        self.blocks = [
            SwinTransformer(EMBED, (GRID, GRID), HEADS, window_size=WINDOW, shift_size=0,
                            num_mlp=MLP, dropout_rate=0.03),
            SwinTransformer(EMBED, (GRID, GRID), HEADS, window_size=WINDOW, shift_size=SHIFT,
                            num_mlp=MLP, dropout_rate=0.03),
        ]
        self.patch_merging = PatchMerging((GRID, GRID), embed_dim=EMBED)
        self.pool = layers.GlobalAveragePooling1D()
        self.classifier = layers.Dense(CLASSES, activation="softmax")

    def call(self, images, training=None):
        x = self.patch_embedding(self.patch_extract(images))
        for block in self.blocks:
            x = block(x, training=training)
        return self.classifier(self.pool(self.patch_merging(x)))


def build():
    return SwinClassifier(name="swin")


def data(batch):
    rng = np.random.RandomState(0)
    return rng.rand(batch, IMAGE, IMAGE, 3).astype("float32"), rng.randint(0, CLASSES, size=(batch, 1))


def compile_kwargs():
    return {
        "optimizer": keras.optimizers.AdamW(learning_rate=1e-3, weight_decay=1e-4),
        "loss": keras.losses.SparseCategoricalCrossentropy(),
        "metrics": [keras.metrics.SparseCategoricalAccuracy(name="acc")],
    }
