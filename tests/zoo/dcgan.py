"""Follows the Keras example "DCGAN to generate face images" (fchollet,
keras.io/examples/generative/dcgan_overriding_train_step/): a Sequential
`discriminator` and a Sequential `generator`, and a `GAN` model with no
`call` whose own `compile(d_optimizer=, g_optimizer=, loss_fn=)` takes two
optimizers and whose `train_step` samples latent vectors with its
SeedGenerator, trains the discriminator on real and generated images (with
noisy labels), then the generator through the discriminator. Tiny sizes:
16x16 RGB images, latent 8.
"""

import keras
import numpy as np
import tensorflow as tf
from keras import layers
from keras import ops

IMAGE, LATENT = 16, 8
NO_NORM_LAYERS = True


def make_discriminator():
    return keras.Sequential(
        [
            keras.Input(shape=(IMAGE, IMAGE, 3)),
            layers.Conv2D(8, kernel_size=4, strides=2, padding="same"),
            layers.LeakyReLU(negative_slope=0.2),
            layers.Conv2D(16, kernel_size=4, strides=2, padding="same"),
            layers.LeakyReLU(negative_slope=0.2),
            layers.Flatten(),
            layers.Dropout(0.2),
            layers.Dense(1, activation="sigmoid"),
        ],
        name="discriminator",
    )


def make_generator():
    return keras.Sequential(
        [
            keras.Input(shape=(LATENT,)),
            layers.Dense(4 * 4 * 16),
            layers.Reshape((4, 4, 16)),
            layers.Conv2DTranspose(16, kernel_size=4, strides=2, padding="same"),
            layers.LeakyReLU(negative_slope=0.2),
            layers.Conv2DTranspose(8, kernel_size=4, strides=2, padding="same"),
            layers.LeakyReLU(negative_slope=0.2),
            layers.Conv2D(3, kernel_size=5, padding="same", activation="sigmoid"),
        ],
        name="generator",
    )


class GAN(keras.Model):
    def __init__(self, discriminator, generator, latent_dim, **kwargs):
        super().__init__(**kwargs)
        self.discriminator = discriminator
        self.generator = generator
        self.latent_dim = latent_dim
        self.seed_generator = keras.random.SeedGenerator(1337)

    def compile(self, d_optimizer, g_optimizer, loss_fn):
        super().compile()
        self.d_optimizer = d_optimizer
        self.g_optimizer = g_optimizer
        self.loss_fn = loss_fn
        self.d_loss_metric = keras.metrics.Mean(name="d_loss")
        self.g_loss_metric = keras.metrics.Mean(name="g_loss")

    @property
    def metrics(self):
        return [self.d_loss_metric, self.g_loss_metric]

    def train_step(self, real_images):
        batch_size = ops.shape(real_images)[0]
        random_latent_vectors = keras.random.normal(
            shape=(batch_size, self.latent_dim), seed=self.seed_generator
        )
        generated_images = self.generator(random_latent_vectors)
        combined_images = ops.concatenate([generated_images, real_images], axis=0)
        labels = ops.concatenate(
            [ops.ones((batch_size, 1)), ops.zeros((batch_size, 1))], axis=0
        )
        # Add random noise to the labels - important trick!
        labels += 0.05 * keras.random.uniform(ops.shape(labels), seed=self.seed_generator)

        with tf.GradientTape() as tape:
            predictions = self.discriminator(combined_images)
            d_loss = self.loss_fn(labels, predictions)
        grads = tape.gradient(d_loss, self.discriminator.trainable_weights)
        self.d_optimizer.apply_gradients(zip(grads, self.discriminator.trainable_weights))

        random_latent_vectors = keras.random.normal(
            shape=(batch_size, self.latent_dim), seed=self.seed_generator
        )
        misleading_labels = ops.zeros((batch_size, 1))
        with tf.GradientTape() as tape:
            predictions = self.discriminator(self.generator(random_latent_vectors))
            g_loss = self.loss_fn(misleading_labels, predictions)
        grads = tape.gradient(g_loss, self.generator.trainable_weights)
        self.g_optimizer.apply_gradients(zip(grads, self.generator.trainable_weights))

        self.d_loss_metric.update_state(d_loss)
        self.g_loss_metric.update_state(g_loss)
        return {"d_loss": self.d_loss_metric.result(), "g_loss": self.g_loss_metric.result()}


def build():
    return GAN(make_discriminator(), make_generator(), LATENT, name="dcgan")


def data(batch):
    rng = np.random.RandomState(0)
    return rng.rand(batch, IMAGE, IMAGE, 3).astype("float32"), None


def compile_kwargs():
    return {
        "d_optimizer": keras.optimizers.Adam(learning_rate=1e-4),
        "g_optimizer": keras.optimizers.Adam(learning_rate=1e-4),
        "loss_fn": keras.losses.BinaryCrossentropy(),
    }


def parts(model, x, y):
    """The GAN has no `call`: its step calls the generator on latent
    vectors and the discriminator on images."""
    latent = np.random.RandomState(1).normal(size=(len(x), LATENT)).astype("float32")
    return [("generator", model.generator, latent), ("discriminator", model.discriminator, x)]
