"""Follows the Keras example "A Vision Transformer without Attention"
(Aritra Roy Gosthipaty and Ritwik Raha,
keras.io/examples/vision/shiftvit/): a subclassed `ShiftViTModel` whose
stages (`StackedShiftBlocks`, holding a list of `ShiftViTBlock`s built in
`build`) shift four groups of channels by a pixel in four directions with
`tf.split`, `tf.image.crop_to_bounding_box`, `tf.image.pad_to_bounding_box`
and `tf.concat`, run an `MLP` (a `keras.Sequential` built in `build`) behind
a `DropPath` that, in training, drops the residual branch per sample with
`tf.random.uniform` of shape `(tf.shape(x)[0],) + (1,) * (len(x.shape) - 1)`, and
merge patches with a strided `Conv2D`. (The example trains through its own
`train_step`, augmenting first; this port's `call` is the example's
forward pass without the augmentation, and the draw carries an op-level
seed so that plain Keras and the plugin draw the same numbers in the
training check: tests/test_public_code_idioms.py tests the unseeded
form.) Tiny sizes: 8x8 images, patches of 2, width 8 (split in four groups
of two, so every channel shifts; the example's width leaves most in place),
two stages of one block each.
"""

import keras
import numpy as np
import tensorflow as tf
from keras import layers

IMAGE, PATCH, CLASSES, PROJECTION = 8, 2, 3, 8
STAGES, EPSILON, DROP_PATH = (1, 1), 1e-5, 0.2
SLOW = True


class MLP(layers.Layer):
    def __init__(self, mlp_expand_ratio, mlp_dropout_rate, **kwargs):
        super().__init__(**kwargs)
        self.mlp_expand_ratio = mlp_expand_ratio
        self.mlp_dropout_rate = mlp_dropout_rate

    def build(self, input_shape):
        channels = input_shape[-1]
        self.mlp = keras.Sequential([
            layers.Dense(int(self.mlp_expand_ratio * channels), activation=tf.nn.gelu),
            layers.Dropout(rate=self.mlp_dropout_rate),
            layers.Dense(channels),
            layers.Dropout(rate=self.mlp_dropout_rate),
        ])

    def call(self, x):
        return self.mlp(x)


class DropPath(layers.Layer):
    """Stochastic depth: drops the whole residual branch of a sample."""

    def __init__(self, drop_path_prob, **kwargs):
        super().__init__(**kwargs)
        self.drop_path_prob = drop_path_prob

    def call(self, x, training=False):
        if training:
            keep_prob = 1 - self.drop_path_prob
            shape = (tf.shape(x)[0],) + (1,) * (len(x.shape) - 1)
            random_tensor = keep_prob + tf.random.uniform(shape, 0, 1, seed=7)
            return (x / keep_prob) * tf.floor(random_tensor)
        return x


class ShiftViTBlock(layers.Layer):
    def __init__(self, epsilon, drop_path_prob, mlp_dropout_rate, num_div=2, shift_pixel=1,
                 mlp_expand_ratio=2, **kwargs):
        super().__init__(**kwargs)
        self.shift_pixel = shift_pixel
        self.mlp_expand_ratio = mlp_expand_ratio
        self.mlp_dropout_rate = mlp_dropout_rate
        self.num_div = num_div
        self.epsilon = epsilon
        self.drop_path_prob = drop_path_prob

    def build(self, input_shape):
        self.H, self.W, self.C = input_shape[1], input_shape[2], input_shape[3]
        self.layer_norm = layers.LayerNormalization(epsilon=self.epsilon)
        self.drop_path = (DropPath(drop_path_prob=self.drop_path_prob)
                          if self.drop_path_prob > 0.0 else layers.Activation("linear"))
        self.mlp = MLP(self.mlp_expand_ratio, self.mlp_dropout_rate)

    def get_shift_pad(self, x, mode):
        # (offset, cut) in height and width: crop `cut` pixels at `offset`, pad them back
        offset_height, offset_width, cut_height, cut_width = {
            "left": (0, 0, 0, self.shift_pixel), "right": (0, self.shift_pixel, 0, self.shift_pixel),
            "up": (0, 0, self.shift_pixel, 0), "down": (self.shift_pixel, 0, self.shift_pixel, 0),
        }[mode]
        crop = tf.image.crop_to_bounding_box(
            x, offset_height, offset_width, self.H - cut_height, self.W - cut_width)
        return tf.image.pad_to_bounding_box(crop, offset_height, offset_width, self.H, self.W)

    def call(self, x, training=False):
        splits = tf.split(x, num_or_size_splits=self.C // self.num_div, axis=-1)
        for index, mode in enumerate(("left", "right", "up", "down")):
            splits[index] = self.get_shift_pad(splits[index], mode)
        x = tf.concat(splits, axis=-1)
        return x + self.drop_path(self.mlp(self.layer_norm(x)), training=training)


class PatchMerging(layers.Layer):
    def __init__(self, epsilon, **kwargs):
        super().__init__(**kwargs)
        self.epsilon = epsilon

    def build(self, input_shape):
        self.reduction = layers.Conv2D(2 * input_shape[-1], kernel_size=2, strides=2,
                                       padding="same", use_bias=False)
        self.layer_norm = layers.LayerNormalization(epsilon=self.epsilon)

    def call(self, x):
        return self.reduction(self.layer_norm(x))


class StackedShiftBlocks(layers.Layer):
    def __init__(self, epsilon, mlp_dropout_rate, num_shift_blocks, stochastic_depth_rate,
                 is_merge, **kwargs):
        super().__init__(**kwargs)
        self.epsilon = epsilon
        self.mlp_dropout_rate = mlp_dropout_rate
        self.num_shift_blocks = num_shift_blocks
        self.stochastic_depth_rate = stochastic_depth_rate
        self.is_merge = is_merge

    def build(self, input_shape):
        rates = np.linspace(self.stochastic_depth_rate / self.num_shift_blocks,
                            self.stochastic_depth_rate, self.num_shift_blocks)
        self.shift_blocks = [
            ShiftViTBlock(epsilon=self.epsilon, drop_path_prob=float(rate),
                          mlp_dropout_rate=self.mlp_dropout_rate)
            for rate in rates
        ]
        if self.is_merge:
            self.patch_merge = PatchMerging(epsilon=self.epsilon)

    def call(self, x, training=False):
        for shift_block in self.shift_blocks:
            x = shift_block(x, training=training)
        if self.is_merge:
            x = self.patch_merge(x)
        return x


class ShiftViTModel(keras.Model):
    def __init__(self, projected_dim, patch_size, num_shift_blocks_per_stages, epsilon,
                 mlp_dropout_rate, stochastic_depth_rate, num_classes, **kwargs):
        super().__init__(**kwargs)
        self.patch_projection = layers.Conv2D(projected_dim, kernel_size=patch_size,
                                              strides=patch_size, padding="same")
        last = len(num_shift_blocks_per_stages) - 1
        self.stages = [
            StackedShiftBlocks(epsilon=epsilon, mlp_dropout_rate=mlp_dropout_rate,
                               num_shift_blocks=blocks,
                               stochastic_depth_rate=stochastic_depth_rate,
                               is_merge=index != last)
            for index, blocks in enumerate(num_shift_blocks_per_stages)
        ]
        self.global_avg_pool = layers.GlobalAveragePooling2D()
        self.classifier = layers.Dense(num_classes)

    def call(self, images, training=False):
        x = self.patch_projection(images)
        for stage in self.stages:
            x = stage(x, training=training)
        return self.classifier(self.global_avg_pool(x))


def build():
    return ShiftViTModel(PROJECTION, PATCH, STAGES, EPSILON, mlp_dropout_rate=0.1,
                         stochastic_depth_rate=DROP_PATH, num_classes=CLASSES, name="shiftvit")


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
