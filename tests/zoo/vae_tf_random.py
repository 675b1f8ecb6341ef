"""Follows the Keras example "Variational AutoEncoder" (fchollet,
keras.io/examples/generative/vae/) as it is often written with TensorFlow
(and as it was for tf.keras): the `Sampling` layer draws its noise with
`tf.random.normal(shape=(batch, dim))`, a stateful TensorFlow draw, rather
than with `keras.random.normal` and a SeedGenerator. Verification once
refused such a model ("two runs give different output"); it now replays
the original's draws in the converted run, and the draw is a
`TFRandomDraw` graph node, so `Sampling` expands.

The draw here carries an op-level seed (`seed=1337`), so that plain Keras
and the plugin draw the same numbers in their training steps (both under
the harness's global seed) and the training check compares them step for
step; the same layer without the op seed is tested in
tests/frontend/idioms/test_public_code_idioms.py, where statistics of the draws are
compared. The `VAE` model's own `train_step` is the example's; its `call`
(encode, sample, decode) is the one ports add. Tiny sizes: 8x8 images,
latent 2.
"""

import keras
import numpy as np
import tensorflow as tf
from keras import ops

from zoo.vae import VAE
from zoo.vae import make_decoder

IMAGE, LATENT = 8, 2
NO_NORM_LAYERS = True


class Sampling(keras.layers.Layer):
    """Uses (z_mean, z_log_var) to sample z, the vector encoding a digit."""

    def call(self, inputs):
        z_mean, z_log_var = inputs
        batch = tf.shape(z_mean)[0]
        dim = tf.shape(z_mean)[1]
        epsilon = tf.random.normal(shape=(batch, dim), seed=1337)
        return z_mean + tf.exp(0.5 * z_log_var) * epsilon


def make_encoder():
    inputs = keras.Input(shape=(IMAGE, IMAGE, 1))
    x = keras.layers.Conv2D(8, 3, activation="relu", strides=2, padding="same")(inputs)
    x = keras.layers.Conv2D(16, 3, activation="relu", strides=2, padding="same")(x)
    x = keras.layers.Flatten()(x)
    x = keras.layers.Dense(16, activation="relu")(x)
    z_mean = keras.layers.Dense(LATENT, name="z_mean")(x)
    z_log_var = keras.layers.Dense(LATENT, name="z_log_var")(x)
    z = Sampling()([z_mean, z_log_var])
    return keras.Model(inputs, [z_mean, z_log_var, z], name="encoder")


def build():
    return VAE(make_encoder(), make_decoder(), name="vae_tf_random")


def data(batch):
    rng = np.random.RandomState(0)
    return rng.rand(batch, IMAGE, IMAGE, 1).astype("float32"), None


def compile_kwargs():
    return {"optimizer": keras.optimizers.Adam()}
