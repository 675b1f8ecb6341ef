"""A variational autoencoder with a custom `train_step`, through keras_ipu_plugin.

Runs on CPU in a few seconds on synthetic data:

    python examples/vae.py

Written as in the Keras guide "Making new layers and models via
subclassing": an `Encoder` layer (with a `Sampling` layer drawing
z = mean + sigma * eps), a `Decoder` layer, and a `VAE` model whose own
`train_step` / `test_step` compute the reconstruction and KL losses and
track them with metrics. `kip.PluginModel` runs those steps unchanged, with
`self(x)` going through the converted graph; `Expand` inlines the encoder
and decoder into their Keras layers.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import keras_ipu_plugin as kip  # noqa: E402

FEATURES, LATENT, HIDDEN = 16, 2, 32


class Sampling(keras.layers.Layer):
    """z = mean + exp(log_var / 2) * eps when training; the mean otherwise."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.seed_generator = keras.random.SeedGenerator(1337)

    def call(self, inputs, training=None):
        z_mean, z_log_var = inputs
        if not training:
            return z_mean
        epsilon = keras.random.normal(keras.ops.shape(z_mean), seed=self.seed_generator)
        return z_mean + keras.ops.exp(0.5 * z_log_var) * epsilon


class Encoder(keras.layers.Layer):
    def __init__(self, latent=LATENT, hidden=HIDDEN, **kwargs):
        super().__init__(**kwargs)
        self.hidden = keras.layers.Dense(hidden, activation="relu", name="hidden")
        self.z_mean = keras.layers.Dense(latent, name="z_mean")
        self.z_log_var = keras.layers.Dense(latent, name="z_log_var")
        self.sampling = Sampling(name="sampling")

    def call(self, inputs, training=None):
        h = self.hidden(inputs)
        z_mean, z_log_var = self.z_mean(h), self.z_log_var(h)
        z = self.sampling([z_mean, z_log_var], training=training)
        return z_mean, z_log_var, z


class Decoder(keras.layers.Layer):
    def __init__(self, features=FEATURES, hidden=HIDDEN, **kwargs):
        super().__init__(**kwargs)
        self.hidden = keras.layers.Dense(hidden, activation="relu", name="hidden")
        self.out = keras.layers.Dense(features, name="reconstruction")

    def call(self, inputs):
        return self.out(self.hidden(inputs))


class VAE(keras.Model):
    def __init__(self, features=FEATURES, latent=LATENT, hidden=HIDDEN, **kwargs):
        super().__init__(**kwargs)
        self.encoder = Encoder(latent, hidden, name="encoder")
        self.decoder = Decoder(features, hidden, name="decoder")
        self.total_loss_tracker = keras.metrics.Mean(name="loss")
        self.reconstruction_loss_tracker = keras.metrics.Mean(name="reconstruction_loss")
        self.kl_loss_tracker = keras.metrics.Mean(name="kl_loss")

    def call(self, inputs, training=None):
        z_mean, z_log_var, z = self.encoder(inputs, training=training)
        return {"reconstruction": self.decoder(z), "z_mean": z_mean, "z_log_var": z_log_var}

    @property
    def metrics(self):
        return [self.total_loss_tracker, self.reconstruction_loss_tracker, self.kl_loss_tracker]

    def train_step(self, data):
        x = data[0] if isinstance(data, tuple) else data
        with tf.GradientTape() as tape:
            total, reconstruction, kl = vae_losses(self, x, training=True)
        variables = self.trainable_variables
        gradients = tape.gradient(total, variables)
        self.optimizer.apply_gradients(zip(gradients, variables))
        return self._track(total, reconstruction, kl)

    def test_step(self, data):
        x = data[0] if isinstance(data, tuple) else data
        return self._track(*vae_losses(self, x, training=False))

    def _track(self, total, reconstruction, kl):
        self.total_loss_tracker.update_state(total)
        self.reconstruction_loss_tracker.update_state(reconstruction)
        self.kl_loss_tracker.update_state(kl)
        return {
            "loss": self.total_loss_tracker.result(),
            "reconstruction_loss": self.reconstruction_loss_tracker.result(),
            "kl_loss": self.kl_loss_tracker.result(),
        }


def vae_losses(model, x, training):
    """(total, reconstruction, KL) losses of `model` on `x`.

    A function called with the step's `self`, not a method called as
    `self.vae_losses(...)`: under `kip.PluginModel` the step's `self` is the
    wrapper (its `self(x)` runs the converted graph), while a method looked
    up through the wrapper is bound to the wrapped model, whose `self(x)`
    would run the original code instead.
    """
    outputs = model(x, training=training)
    reconstruction_loss = tf.reduce_mean(
        tf.reduce_sum(tf.square(x - outputs["reconstruction"]), axis=-1)
    )
    z_mean, z_log_var = outputs["z_mean"], outputs["z_log_var"]
    kl_loss = tf.reduce_mean(tf.reduce_sum(
        -0.5 * (1 + z_log_var - tf.square(z_mean) - tf.exp(z_log_var)), axis=-1
    ))
    return reconstruction_loss + kl_loss, reconstruction_loss, kl_loss


def eval_loss(model, x, y=None):
    """The total loss on `x` in inference mode (the posterior mean as z)."""
    return float(vae_losses(model, x, training=False)[0])


def build_model():
    return VAE()


def make_data(samples=512, seed=0):
    """Points near a 2-D manifold embedded in FEATURES dimensions."""
    rng = np.random.default_rng(seed)
    latent = rng.normal(size=(samples, LATENT))
    mixing = rng.normal(size=(LATENT, FEATURES))
    x = np.tanh(latent @ mixing) + 0.05 * rng.normal(size=(samples, FEATURES))
    return x.astype("float32")


def passes():
    # One level: the encoder and decoder become their Dense layers; the
    # Sampling layer stays one node (its Python `if not training:` makes
    # it untraceable as a graph, so expanding it would keep it opaque).
    return [kip.passes.Expand(["encoder", "decoder"])]


def compile_model(model):
    model.compile(optimizer=keras.optimizers.Adam(1e-2))  # the losses are in train_step


def main():
    keras.utils.set_random_seed(0)
    x = make_data()
    model = kip.PluginModel(build_model(), passes=passes())
    compile_model(model)
    history = model.fit(x, batch_size=64, epochs=3, verbose=2)
    print(model.kip_report)
    print(f"backend: {kip.backend()}")
    print(f"final loss: {history.history['loss'][-1]:.4f}")
    return history


if __name__ == "__main__":
    main()
