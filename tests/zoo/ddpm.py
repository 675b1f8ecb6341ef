"""Follows the Keras example "Denoising Diffusion Probabilistic Models"
(A_K_Nain, keras.io/examples/generative/ddpm/): a functional U-Net over
`[image, time]` whose `TimeEmbedding` layer computes sinusoidal embeddings
with TensorFlow functions (`tf.cast`, `inputs[:, None] * self.emb[None, :]`
with a concrete `tf.Tensor` it holds, `tf.concat` of `tf.sin` and
`tf.cos`; it once stayed whole with "Failed to convert elements of
SparseTensor"), `TimeMLP`, residual blocks with GroupNormalization, an
`AttentionBlock` written with `tf.einsum` and `tf.reshape` to sizes from
`tf.shape`, down- and up-sampling; and the example's `DiffusionModel`
whose `train_step` diffuses the images at random timesteps
(`GaussianDiffusion.q_sample`, `tf.gather` on the schedule), fits the
network to the noise and updates an EMA copy of the network. The draws
of `train_step` carry op-level seeds (the example's have none), so that
plain Keras and the plugin draw the same numbers; the `call` (the network
on `[images, t]`) is what ports add to serve the model. Tiny sizes: 8x8
images of 1 channel, one level of width 8 (so no down- or up-sampling;
the middle block's attention is kept), one residual block per level, 10
timesteps.
"""

import math

import keras
import numpy as np
import tensorflow as tf
from keras import layers

IMAGE, CHANNELS, WIDTHS, HAS_ATTENTION, GROUPS, TIMESTEPS = 8, 1, (8,), (False,), 4, 10
NO_NORM_LAYERS = True  # GroupNormalization only
SLOW = True
FIRST_CONV = 8


def kernel_init(scale):
    scale = max(scale, 1e-10)
    return keras.initializers.VarianceScaling(scale, mode="fan_avg", distribution="uniform")


class GaussianDiffusion:
    def __init__(self, beta_start=1e-4, beta_end=0.02, timesteps=1000):
        self.betas = betas = np.linspace(beta_start, beta_end, timesteps, dtype=np.float64)
        self.num_timesteps = int(timesteps)
        alphas = 1.0 - betas
        alphas_cumprod = np.cumprod(alphas, axis=0)
        self.sqrt_alphas_cumprod = tf.constant(np.sqrt(alphas_cumprod), dtype=tf.float32)
        self.sqrt_one_minus_alphas_cumprod = tf.constant(
            np.sqrt(1.0 - alphas_cumprod), dtype=tf.float32)

    def _extract(self, a, t, x_shape):
        batch_size = x_shape[0]
        out = tf.gather(a, t)
        return tf.reshape(out, [batch_size, 1, 1, 1])

    def q_sample(self, x_start, t, noise):
        x_start_shape = tf.shape(x_start)
        return (
            self._extract(self.sqrt_alphas_cumprod, t, tf.shape(x_start)) * x_start
            + self._extract(self.sqrt_one_minus_alphas_cumprod, t, x_start_shape) * noise
        )


class AttentionBlock(layers.Layer):
    def __init__(self, units, groups=8, **kwargs):
        self.units = units
        self.groups = groups
        super().__init__(**kwargs)
        self.norm = layers.GroupNormalization(groups=groups)
        self.query = layers.Dense(units, kernel_initializer=kernel_init(1.0))
        self.key = layers.Dense(units, kernel_initializer=kernel_init(1.0))
        self.value = layers.Dense(units, kernel_initializer=kernel_init(1.0))
        self.proj = layers.Dense(units, kernel_initializer=kernel_init(0.0))

    def call(self, inputs):
        batch_size = tf.shape(inputs)[0]
        height = tf.shape(inputs)[1]
        width = tf.shape(inputs)[2]
        scale = tf.cast(self.units, tf.float32) ** (-0.5)
        inputs = self.norm(inputs)
        q = self.query(inputs)
        k = self.key(inputs)
        v = self.value(inputs)
        attn_score = tf.einsum("bhwc, bHWc->bhwHW", q, k) * scale
        attn_score = tf.reshape(attn_score, [batch_size, height, width, height * width])
        attn_score = tf.nn.softmax(attn_score, -1)
        attn_score = tf.reshape(attn_score, [batch_size, height, width, height, width])
        proj = tf.einsum("bhwHW,bHWc->bhwc", attn_score, v)
        proj = self.proj(proj)
        return inputs + proj


class TimeEmbedding(layers.Layer):
    def __init__(self, dim, **kwargs):
        super().__init__(**kwargs)
        self.dim = dim
        self.half_dim = dim // 2
        self.emb = math.log(10000) / (self.half_dim - 1)
        self.emb = tf.exp(tf.range(self.half_dim, dtype=tf.float32) * -self.emb)

    def call(self, inputs):
        inputs = tf.cast(inputs, dtype=tf.float32)
        emb = inputs[:, None] * self.emb[None, :]
        emb = tf.concat([tf.sin(emb), tf.cos(emb)], axis=-1)
        return emb


def ResidualBlock(width, groups=8, activation_fn=keras.activations.swish):
    def apply(inputs):
        x, t = inputs
        input_width = x.shape[3]
        if input_width == width:
            residual = x
        else:
            residual = layers.Conv2D(width, kernel_size=1, kernel_initializer=kernel_init(1.0))(x)
        temb = activation_fn(t)
        temb = layers.Dense(width, kernel_initializer=kernel_init(1.0))(temb)[:, None, None, :]
        x = layers.GroupNormalization(groups=groups)(x)
        x = activation_fn(x)
        x = layers.Conv2D(width, kernel_size=3, padding="same",
                          kernel_initializer=kernel_init(1.0))(x)
        x = layers.Add()([x, temb])
        x = layers.GroupNormalization(groups=groups)(x)
        x = activation_fn(x)
        x = layers.Conv2D(width, kernel_size=3, padding="same",
                          kernel_initializer=kernel_init(0.0))(x)
        x = layers.Add()([x, residual])
        return x

    return apply


def DownSample(width):
    def apply(x):
        return layers.Conv2D(width, kernel_size=3, strides=2, padding="same",
                             kernel_initializer=kernel_init(1.0))(x)

    return apply


def UpSample(width, interpolation="nearest"):
    def apply(x):
        x = layers.UpSampling2D(size=2, interpolation=interpolation)(x)
        return layers.Conv2D(width, kernel_size=3, padding="same",
                             kernel_initializer=kernel_init(1.0))(x)

    return apply


def TimeMLP(units, activation_fn=keras.activations.swish):
    def apply(inputs):
        temb = layers.Dense(units, activation=activation_fn, kernel_initializer=kernel_init(1.0))(
            inputs)
        return layers.Dense(units, kernel_initializer=kernel_init(1.0))(temb)

    return apply


def build_model(img_size, img_channels, widths, has_attention, num_res_blocks=2, norm_groups=8,
                interpolation="nearest", activation_fn=keras.activations.swish, name="unet"):
    image_input = layers.Input(shape=(img_size, img_size, img_channels), name="image_input")
    time_input = keras.Input(shape=(), dtype="int64", name="time_input")
    x = layers.Conv2D(FIRST_CONV, kernel_size=(3, 3), padding="same",
                      kernel_initializer=kernel_init(1.0))(image_input)
    temb = TimeEmbedding(dim=FIRST_CONV * 4)(time_input)
    temb = TimeMLP(units=FIRST_CONV * 4, activation_fn=activation_fn)(temb)
    skips = [x]
    for i in range(len(widths)):
        for _ in range(num_res_blocks):
            x = ResidualBlock(widths[i], groups=norm_groups, activation_fn=activation_fn)([x, temb])
            if has_attention[i]:
                x = AttentionBlock(widths[i], groups=norm_groups)(x)
            skips.append(x)
        if widths[i] != widths[-1]:
            x = DownSample(widths[i])(x)
            skips.append(x)
    x = ResidualBlock(widths[-1], groups=norm_groups, activation_fn=activation_fn)([x, temb])
    x = AttentionBlock(widths[-1], groups=norm_groups)(x)
    x = ResidualBlock(widths[-1], groups=norm_groups, activation_fn=activation_fn)([x, temb])
    for i in reversed(range(len(widths))):
        for _ in range(num_res_blocks + 1):
            x = layers.Concatenate(axis=-1)([x, skips.pop()])
            x = ResidualBlock(widths[i], groups=norm_groups, activation_fn=activation_fn)([x, temb])
            if has_attention[i]:
                x = AttentionBlock(widths[i], groups=norm_groups)(x)
        if i != 0:
            x = UpSample(widths[i], interpolation=interpolation)(x)
    x = layers.GroupNormalization(groups=norm_groups)(x)
    x = activation_fn(x)
    x = layers.Conv2D(img_channels, (3, 3), padding="same", kernel_initializer=kernel_init(0.0))(x)
    return keras.Model([image_input, time_input], x, name=name)


class DiffusionModel(keras.Model):
    def __init__(self, network, ema_network, timesteps, gdf_util, ema=0.999, **kwargs):
        super().__init__(**kwargs)
        self.network = network
        self.ema_network = ema_network
        self.timesteps = timesteps
        self.gdf_util = gdf_util
        self.ema = ema

    def call(self, inputs):  # what ports add, to serve the model
        return self.network(inputs)

    def train_step(self, images):
        batch_size = tf.shape(images)[0]
        t = tf.random.uniform(minval=0, maxval=self.timesteps, shape=(batch_size,),
                              dtype=tf.int64, seed=1)
        with tf.GradientTape() as tape:
            noise = tf.random.normal(shape=tf.shape(images), dtype=images.dtype, seed=2)
            images_t = self.gdf_util.q_sample(images, t, noise)
            pred_noise = self.network([images_t, t], training=True)
            loss = self.loss(noise, pred_noise)
        gradients = tape.gradient(loss, self.network.trainable_weights)
        self.optimizer.apply_gradients(zip(gradients, self.network.trainable_weights))
        for weight, ema_weight in zip(self.network.weights, self.ema_network.weights):
            ema_weight.assign(self.ema * ema_weight + (1 - self.ema) * weight)
        return {"loss": loss}


def _unet(name):
    return build_model(IMAGE, CHANNELS, WIDTHS, HAS_ATTENTION, num_res_blocks=1,
                       norm_groups=GROUPS, name=name)


def build():
    network, ema_network = _unet("network"), _unet("ema_network")
    ema_network.set_weights(network.get_weights())
    return DiffusionModel(network, ema_network, TIMESTEPS, GaussianDiffusion(timesteps=TIMESTEPS),
                          name="ddpm")


def data(batch):
    rng = np.random.RandomState(0)
    return rng.rand(batch, IMAGE, IMAGE, CHANNELS).astype("float32") * 2 - 1, None


def model_input(x, y):
    return [x, np.arange(len(x), dtype="int64") % TIMESTEPS]


def compile_kwargs():
    return {"optimizer": keras.optimizers.Adam(learning_rate=2e-4),
            "loss": keras.losses.MeanSquaredError()}
