"""Follows the Keras example "WGAN-GP overriding `Model.train_step`"
(A_K_Nain, keras.io/examples/generative/wgan_gp/): a functional critic
(`discriminator`: strided convolutions, LeakyReLU, Dropout) and a
functional `generator` (Dense, BatchNormalization, UpSampling2D + Conv2D
blocks), and a `WGAN` model with no `call` whose own
`compile(d_optimizer=, g_optimizer=, d_loss_fn=, g_loss_fn=)` takes two
optimizers and two loss functions, and whose `train_step` trains the critic
`discriminator_extra_steps` times per generator step with a gradient
penalty computed by a nested GradientTape on interpolated images. Latent
vectors come from the model's SeedGenerator (the example's `tf.random`
calls, in their Keras 3 form). Tiny sizes: 8x8 grey images, latent 8.
"""

import keras
import numpy as np
import tensorflow as tf
from keras import layers

IMAGE, LATENT = 8, 8
NO_NORM_LAYERS = True


def conv_block(x, filters, strides, use_bn=False, use_dropout=False):
    x = layers.Conv2D(filters, 3, strides=strides, padding="same")(x)
    if use_bn:
        x = layers.BatchNormalization()(x)
    x = layers.LeakyReLU(0.2)(x)
    if use_dropout:
        x = layers.Dropout(0.3)(x)
    return x


def make_discriminator():
    images = keras.Input(shape=(IMAGE, IMAGE, 1))
    x = conv_block(images, 8, strides=2)
    x = conv_block(x, 16, strides=2, use_dropout=True)
    x = layers.Flatten()(x)
    x = layers.Dropout(0.2)(x)
    x = layers.Dense(1)(x)
    return keras.Model(images, x, name="discriminator")


def upsample_block(x, filters):
    x = layers.UpSampling2D((2, 2))(x)
    x = layers.Conv2D(filters, 3, padding="same", use_bias=False)(x)
    x = layers.BatchNormalization()(x)
    return layers.LeakyReLU(0.2)(x)


def make_generator():
    noise = keras.Input(shape=(LATENT,))
    x = layers.Dense(2 * 2 * 16, use_bias=False)(noise)
    x = layers.BatchNormalization()(x)
    x = layers.LeakyReLU(0.2)(x)
    x = layers.Reshape((2, 2, 16))(x)
    x = upsample_block(x, 16)
    x = upsample_block(x, 8)
    x = layers.Conv2D(1, 3, padding="same", activation="tanh")(x)
    return keras.Model(noise, x, name="generator")


class WGAN(keras.Model):
    def __init__(self, discriminator, generator, latent_dim,
                 discriminator_extra_steps=2, gp_weight=10.0, **kwargs):
        super().__init__(**kwargs)
        self.discriminator = discriminator
        self.generator = generator
        self.latent_dim = latent_dim
        self.d_steps = discriminator_extra_steps
        self.gp_weight = gp_weight
        self.seed_generator = keras.random.SeedGenerator(42)

    def compile(self, d_optimizer, g_optimizer, d_loss_fn, g_loss_fn):
        super().compile()
        self.d_optimizer = d_optimizer
        self.g_optimizer = g_optimizer
        self.d_loss_fn = d_loss_fn
        self.g_loss_fn = g_loss_fn

    def gradient_penalty(self, batch_size, real_images, fake_images):
        alpha = keras.random.normal([batch_size, 1, 1, 1], 0.0, 1.0, seed=self.seed_generator)
        interpolated = real_images + alpha * (fake_images - real_images)
        with tf.GradientTape() as gp_tape:
            gp_tape.watch(interpolated)
            pred = self.discriminator(interpolated, training=True)
        grads = gp_tape.gradient(pred, [interpolated])[0]
        norm = tf.sqrt(tf.reduce_sum(tf.square(grads), axis=[1, 2, 3]))
        return tf.reduce_mean((norm - 1.0) ** 2)

    def train_step(self, real_images):
        batch_size = tf.shape(real_images)[0]
        for _ in range(self.d_steps):
            random_latent_vectors = keras.random.normal(
                shape=(batch_size, self.latent_dim), seed=self.seed_generator
            )
            with tf.GradientTape() as tape:
                fake_images = self.generator(random_latent_vectors, training=True)
                fake_logits = self.discriminator(fake_images, training=True)
                real_logits = self.discriminator(real_images, training=True)
                d_cost = self.d_loss_fn(real_img=real_logits, fake_img=fake_logits)
                gp = self.gradient_penalty(batch_size, real_images, fake_images)
                d_loss = d_cost + gp * self.gp_weight
            d_gradient = tape.gradient(d_loss, self.discriminator.trainable_variables)
            self.d_optimizer.apply_gradients(
                zip(d_gradient, self.discriminator.trainable_variables)
            )
        random_latent_vectors = keras.random.normal(
            shape=(batch_size, self.latent_dim), seed=self.seed_generator
        )
        with tf.GradientTape() as tape:
            generated_images = self.generator(random_latent_vectors, training=True)
            gen_img_logits = self.discriminator(generated_images, training=True)
            g_loss = self.g_loss_fn(gen_img_logits)
        gen_gradient = tape.gradient(g_loss, self.generator.trainable_variables)
        self.g_optimizer.apply_gradients(zip(gen_gradient, self.generator.trainable_variables))
        return {"d_loss": d_loss, "g_loss": g_loss}


def discriminator_loss(real_img, fake_img):
    return tf.reduce_mean(fake_img) - tf.reduce_mean(real_img)


def generator_loss(fake_img):
    return -tf.reduce_mean(fake_img)


def build():
    return WGAN(make_discriminator(), make_generator(), LATENT, name="wgan_gp")


def data(batch):
    rng = np.random.RandomState(0)
    return (rng.rand(batch, IMAGE, IMAGE, 1) * 2 - 1).astype("float32"), None


def compile_kwargs():
    return {
        "d_optimizer": keras.optimizers.Adam(learning_rate=2e-4, beta_1=0.5, beta_2=0.9),
        "g_optimizer": keras.optimizers.Adam(learning_rate=2e-4, beta_1=0.5, beta_2=0.9),
        "d_loss_fn": discriminator_loss,
        "g_loss_fn": generator_loss,
    }


def parts(model, x, y):
    """The WGAN has no `call`: its step calls the generator on latent
    vectors and the critic on images."""
    latent = np.random.RandomState(1).normal(size=(len(x), LATENT)).astype("float32")
    return [("generator", model.generator, latent), ("discriminator", model.discriminator, x)]
