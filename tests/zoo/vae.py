"""Follows the Keras example "Variational AutoEncoder" (fchollet,
keras.io/examples/generative/vae/): a functional `encoder` whose `Sampling`
layer draws z = mean + exp(log_var / 2) * eps with its own SeedGenerator on
every call (inference too), a functional `decoder`, and a `VAE` model whose
own `train_step` calls both and adds the KL loss to the reconstruction
loss, tracked by `Mean` metrics. The example's VAE has no `call`; this port
adds the one most ports add (encode, sample, decode), so that the model can
also be converted and served. Sizes are tiny (8x8 images, latent 2).
"""

import keras
import numpy as np
import tensorflow as tf
from keras import ops

IMAGE, LATENT = 8, 2
NO_NORM_LAYERS = True


class Sampling(keras.layers.Layer):
    """Uses (z_mean, z_log_var) to sample z, the vector encoding a digit."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.seed_generator = keras.random.SeedGenerator(1337)

    def call(self, inputs):
        z_mean, z_log_var = inputs
        batch = ops.shape(z_mean)[0]
        dim = ops.shape(z_mean)[1]
        epsilon = keras.random.normal(shape=(batch, dim), seed=self.seed_generator)
        return z_mean + ops.exp(0.5 * z_log_var) * epsilon


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


def make_decoder():
    latent_inputs = keras.Input(shape=(LATENT,))
    x = keras.layers.Dense(2 * 2 * 16, activation="relu")(latent_inputs)
    x = keras.layers.Reshape((2, 2, 16))(x)
    x = keras.layers.Conv2DTranspose(16, 3, activation="relu", strides=2, padding="same")(x)
    x = keras.layers.Conv2DTranspose(8, 3, activation="relu", strides=2, padding="same")(x)
    outputs = keras.layers.Conv2DTranspose(1, 3, activation="sigmoid", padding="same")(x)
    return keras.Model(latent_inputs, outputs, name="decoder")


class VAE(keras.Model):
    def __init__(self, encoder, decoder, **kwargs):
        super().__init__(**kwargs)
        self.encoder = encoder
        self.decoder = decoder
        self.total_loss_tracker = keras.metrics.Mean(name="total_loss")
        self.reconstruction_loss_tracker = keras.metrics.Mean(name="reconstruction_loss")
        self.kl_loss_tracker = keras.metrics.Mean(name="kl_loss")

    @property
    def metrics(self):
        return [
            self.total_loss_tracker,
            self.reconstruction_loss_tracker,
            self.kl_loss_tracker,
        ]

    def call(self, inputs):
        _, _, z = self.encoder(inputs)
        return self.decoder(z)

    def train_step(self, data):
        with tf.GradientTape() as tape:
            z_mean, z_log_var, z = self.encoder(data)
            reconstruction = self.decoder(z)
            reconstruction_loss = ops.mean(
                ops.sum(keras.losses.binary_crossentropy(data, reconstruction), axis=(1, 2))
            )
            kl_loss = -0.5 * (1 + z_log_var - ops.square(z_mean) - ops.exp(z_log_var))
            kl_loss = ops.mean(ops.sum(kl_loss, axis=1))
            total_loss = reconstruction_loss + kl_loss
        grads = tape.gradient(total_loss, self.trainable_weights)
        self.optimizer.apply_gradients(zip(grads, self.trainable_weights))
        self.total_loss_tracker.update_state(total_loss)
        self.reconstruction_loss_tracker.update_state(reconstruction_loss)
        self.kl_loss_tracker.update_state(kl_loss)
        return {
            "loss": self.total_loss_tracker.result(),
            "reconstruction_loss": self.reconstruction_loss_tracker.result(),
            "kl_loss": self.kl_loss_tracker.result(),
        }


def build():
    return VAE(make_encoder(), make_decoder(), name="vae")


def data(batch):
    rng = np.random.RandomState(0)
    return rng.rand(batch, IMAGE, IMAGE, 1).astype("float32"), None


def compile_kwargs():
    return {"optimizer": keras.optimizers.Adam()}
