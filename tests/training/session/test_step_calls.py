"""What a train step calls is what is converted.

Models follow public Keras examples: keras.io's knowledge distillation
(its own `compile` and `compute_loss`), DCGAN and WGAN-GP (no `call`: a
generator and a discriminator, two optimizers, a custom `compile`), the
automatic speech recognition transformer (a train step calling
`self([source, target[:, :-1]])` on a dict batch), and the FixRes recipe
(train at one resolution, fine-tune at a larger one). Each trains through
PluginModel / PluginCallback with losses equal to plain Keras on an
identical twin.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras import ops

import keras_ipu_plugin as kip


def _conversions(trained):
    session = trained._kip_session if isinstance(trained, kip.PluginModel) else None
    return session.conversions


def _assert_histories_equal(actual, expected, atol=1e-5):
    """Equal, and not vacuously: a custom step's `{"loss": ...}` is shown by
    Keras as its own (never updated) loss tracker, 0.0 for both."""
    assert set(actual) == set(expected)
    for key in expected:
        np.testing.assert_allclose(actual[key], expected[key], atol=atol, err_msg=key)
        assert np.all(np.asarray(expected[key]) != 0.0), key


def _assert_same_weights(model, reference, atol=1e-5):
    assert len(model.weights) == len(reference.weights)
    for mine, theirs in zip(model.weights, reference.weights):
        np.testing.assert_allclose(mine.numpy(), theirs.numpy(), atol=atol, err_msg=mine.path)


# -- knowledge distillation: its own compile and compute_loss (13.5) -----------


class Distiller(keras.Model):
    """keras.io/examples/vision/knowledge_distillation (Keras 3 version)."""

    def __init__(self, student, teacher):
        super().__init__()
        self.teacher = teacher
        self.student = student

    def compile(self, optimizer, metrics, student_loss_fn, distillation_loss_fn,
                alpha=0.1, temperature=3):
        super().compile(optimizer=optimizer, metrics=metrics)
        self.student_loss_fn = student_loss_fn
        self.distillation_loss_fn = distillation_loss_fn
        self.alpha = alpha
        self.temperature = temperature

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, allow_empty=False):
        teacher_pred = self.teacher(x, training=False)
        student_loss = self.student_loss_fn(y, y_pred)
        distillation_loss = self.distillation_loss_fn(
            ops.softmax(teacher_pred / self.temperature, axis=1),
            ops.softmax(y_pred / self.temperature, axis=1),
        ) * (self.temperature ** 2)
        return self.alpha * student_loss + (1 - self.alpha) * distillation_loss

    def call(self, x):
        return self.student(x)


def _mlp(units, name, inputs=8):
    return keras.Sequential([keras.Input((inputs,)), keras.layers.Dense(16, activation="relu"),
                             keras.layers.Dense(units)], name=name)


def _classification(n=64, features=8, classes=3):
    rng = np.random.default_rng(0)
    return (rng.normal(size=(n, features)).astype("float32"),
            rng.integers(0, classes, size=(n,)).astype("int32"))


def _distill(plugin, run_eagerly=False):
    keras.utils.set_random_seed(1)
    distiller = Distiller(_mlp(3, "student"), _mlp(3, "teacher"))
    model = kip.PluginModel(distiller) if plugin else distiller
    model.compile(
        optimizer=keras.optimizers.Adam(),
        metrics=[keras.metrics.SparseCategoricalAccuracy()],
        student_loss_fn=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        distillation_loss_fn=keras.losses.KLDivergence(), alpha=0.1, temperature=10,
    )
    if run_eagerly:
        model.run_eagerly = True
    x, y = _classification()
    history = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    return history.history, model, distiller


@pytest.mark.parametrize("run_eagerly", [False, True])
def test_distiller_compiles_as_it_wrote_it_and_trains_like_plain_keras(run_eagerly):
    expected, _, _ = _distill(False, run_eagerly)
    actual, plugin, distiller = _distill(True, run_eagerly)
    _assert_histories_equal(actual, expected)
    assert isinstance(plugin.optimizer, keras.optimizers.Adam)  # not the default RMSprop
    assert plugin.optimizer is distiller.optimizer
    assert distiller.alpha == 0.1 and distiller.temperature == 10
    # the teacher, called in compute_loss, is converted too
    assert {c.callee.name for c in _conversions(plugin)} == {distiller.name, "teacher"}


@pytest.mark.parametrize("entry", ["plugin_model", "callback"])
def test_distiller_trains_like_plain_keras_under_a_mirrored_strategy(entry, mirrored):
    """The step's calls are seen in a dry run inside the strategy's replicas."""
    x, y = _classification()

    def train(how, strategy):
        with strategy.scope():
            keras.utils.set_random_seed(1)
            distiller = Distiller(_mlp(3, "student"), _mlp(3, "teacher"))
            model = kip.PluginModel(distiller) if how == "plugin_model" else distiller
            model.compile(
                optimizer=keras.optimizers.Adam(), metrics=[],
                student_loss_fn=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                distillation_loss_fn=keras.losses.KLDivergence(), alpha=0.1, temperature=10)
        callbacks = [kip.PluginCallback()] if how == "callback" else []
        history = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0,
                            callbacks=callbacks)
        return history.history, distiller

    expected, reference = train(None, tf.distribute.get_strategy())
    actual, distiller = train(entry, mirrored)
    _assert_histories_equal(actual, expected)
    _assert_same_weights(distiller, reference)


def test_scope_trains_a_step_calling_the_model_on_what_it_builds():
    keras.utils.set_random_seed(4)
    plain = SpeechTransformer()
    plain.compile(optimizer="adam", loss=keras.losses.CategoricalCrossentropy(from_logits=True))
    expected = plain.fit(_speech_batches(), epochs=2, verbose=0).history
    keras.utils.set_random_seed(4)
    with kip.scope():
        model = SpeechTransformer()
        model.compile(optimizer="adam", loss=keras.losses.CategoricalCrossentropy(from_logits=True))
    actual = model.fit(_speech_batches(), epochs=2, verbose=0).history
    _assert_histories_equal(actual, expected)
    _assert_same_weights(model, plain)
    assert kip.scope_report(model) is not None


class CompiledWithItsOwnLoss(keras.Model):
    """A `compile` of its own that hands Keras the loss, and a train step
    that asks Keras's `compute_loss` for it."""

    def __init__(self):
        super().__init__()
        self.hidden = keras.layers.Dense(8, activation="relu")
        self.out = keras.layers.Dense(1)

    def compile(self, optimizer, loss, l2=0.0):
        super().compile(optimizer=optimizer, loss=loss)
        self.l2 = l2

    def call(self, x):
        return self.out(self.hidden(x))

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(x=x, y=y, y_pred=y_pred)
            loss += self.l2 * ops.sum(self.out.kernel ** 2)
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
        return {"step_loss": loss}


def test_train_step_calling_compute_loss_gets_the_loss_its_compile_gave():
    x, _ = _classification()
    y = x[:, :1] * 2.0

    def train(plugin):
        keras.utils.set_random_seed(4)
        model = CompiledWithItsOwnLoss()
        trained = kip.PluginModel(model) if plugin else model
        trained.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", l2=0.01)
        return trained.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0).history, model

    expected, reference = train(False)
    actual, model = train(True)
    _assert_histories_equal(actual, expected)
    _assert_same_weights(model, reference)


class OwnHelperNamedLikeKeras(keras.Model):
    """A helper of its own named `_compute_loss`, as Keras's private one."""

    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(1)

    def call(self, x):
        return self.dense(x)

    def _compute_loss(self, y, y_pred):
        return ops.mean(ops.abs(y - y_pred)) * 3.0

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = self._compute_loss(y, self(x, training=True))
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
        return {"step_loss": loss}


@pytest.mark.parametrize("entry", ["plugin_model", "callback"])
def test_the_models_own_helper_is_not_shadowed_by_keras(entry):
    x, _ = _classification()
    y = x[:, :1]

    def train(plugin):
        keras.utils.set_random_seed(4)
        model = OwnHelperNamedLikeKeras()
        trained = kip.PluginModel(model) if plugin == "plugin_model" else model
        trained.compile(optimizer=keras.optimizers.SGD(0.05))
        callbacks = [kip.PluginCallback()] if plugin == "callback" else []
        return trained.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0,
                           callbacks=callbacks).history, model

    expected, reference = train(None)
    actual, model = train(entry)
    _assert_histories_equal(actual, expected)
    _assert_same_weights(model, reference)


# -- several inputs, and what the step really calls (13.5) ----------------------


class TwoTowers(keras.Model):
    """Three inputs given as a tuple: `((a, b, c), y)`."""

    def __init__(self):
        super().__init__()
        self.a = keras.layers.Dense(4)
        self.b = keras.layers.Dense(4)
        self.c = keras.layers.Dense(4)
        self.out = keras.layers.Dense(1)

    def call(self, inputs):
        a, b, c = inputs
        return self.out(self.a(a) + self.b(b) * self.c(c))


@pytest.mark.parametrize("entry", ["plugin_model", "callback"])
def test_a_tuple_of_inputs_is_all_of_x(entry):
    rng = np.random.default_rng(5)
    inputs = tuple(rng.normal(size=(48, d)).astype("float32") for d in (3, 5, 2))
    y = rng.normal(size=(48, 1)).astype("float32")

    def train(plugin):
        keras.utils.set_random_seed(4)
        model = TwoTowers()
        trained = kip.PluginModel(model) if plugin == "plugin_model" else model
        trained.compile(optimizer="adam", loss="mse")
        callbacks = [kip.PluginCallback()] if plugin == "callback" else []
        history = trained.fit(inputs, y, batch_size=16, epochs=2, shuffle=False, verbose=0,
                              callbacks=callbacks)
        return history.history, trained, callbacks

    expected, _, _ = train(None)
    actual, trained, callbacks = train(entry)
    _assert_histories_equal(actual, expected)
    converted = trained.converted if entry == "plugin_model" else callbacks[0].converted
    assert len(converted.inputs) == 3


class SpeechTransformer(keras.Model):
    """After keras.io/examples/audio/transformer_asr: the batch is a dict,
    and the step calls the model on `[source, target[:, :-1]]`."""

    def __init__(self, classes=10):
        super().__init__()
        self.classes = classes
        self.encoder = keras.layers.Dense(8, activation="relu")
        self.embed = keras.layers.Embedding(classes, 8)
        self.decoder = keras.layers.Dense(8, activation="relu")
        self.classifier = keras.layers.Dense(classes)
        self.loss_metric = keras.metrics.Mean(name="loss")

    @property
    def metrics(self):
        return [self.loss_metric]

    def call(self, inputs):
        source, target = inputs
        memory = ops.mean(self.encoder(source), axis=1, keepdims=True)
        return self.classifier(self.decoder(self.embed(target) + memory))

    def train_step(self, batch):
        source, target = batch["source"], batch["target"]
        dec_input, dec_target = target[:, :-1], target[:, 1:]
        with tf.GradientTape() as tape:
            preds = self([source, dec_input])
            one_hot = tf.one_hot(dec_target, depth=self.classes)
            mask = tf.cast(tf.math.not_equal(dec_target, 0), "float32")
            loss = self.compute_loss(None, one_hot, preds, sample_weight=mask)
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
        self.loss_metric.update_state(loss)
        return {"loss": self.loss_metric.result()}


def _speech_batches(n=48, frames=6, tokens=7):
    rng = np.random.default_rng(6)
    source = rng.normal(size=(n, frames, 5)).astype("float32")
    target = rng.integers(1, 10, size=(n, tokens)).astype("int32")
    target[:, -2:] = 0  # padding
    return tf.data.Dataset.from_tensor_slices({"source": source, "target": target}).batch(16)


@pytest.mark.parametrize("entry", ["plugin_model", "callback"])
@pytest.mark.parametrize("run_eagerly", [False, True])
def test_step_calling_the_model_on_what_it_builds_from_a_dict_batch(entry, run_eagerly):
    def train(plugin):
        keras.utils.set_random_seed(4)
        model = SpeechTransformer()
        trained = kip.PluginModel(model) if plugin == "plugin_model" else model
        trained.compile(optimizer="adam",
                        loss=keras.losses.CategoricalCrossentropy(from_logits=True),
                        run_eagerly=run_eagerly)
        callbacks = [kip.PluginCallback()] if plugin == "callback" else []
        history = trained.fit(_speech_batches(), epochs=2, verbose=0, callbacks=callbacks)
        return history.history, trained, callbacks

    expected, _, _ = train(None)
    actual, trained, callbacks = train(entry)
    _assert_histories_equal(actual, expected)
    converted = trained.converted if entry == "plugin_model" else callbacks[0].converted
    source, dec_input = converted.inputs
    assert tuple(source.shape) == (None, 6, 5) and tuple(dec_input.shape) == (None, 6)
    assert int(trained.optimizer.iterations.numpy()) == 6


# -- GANs: no `call`, sub-models called by the step (13.4) ----------------------


class GAN(keras.Model):
    """keras.io/examples/generative/dcgan_overriding_train_step (dense)."""

    def __init__(self, discriminator, generator, latent_dim, seed=1337):
        super().__init__()
        self.discriminator = discriminator
        self.generator = generator
        self.latent_dim = latent_dim
        self.seed_generator = keras.random.SeedGenerator(seed)

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
        latent = keras.random.normal((batch_size, self.latent_dim), seed=self.seed_generator)
        generated = self.generator(latent)
        combined = ops.concatenate([generated, real_images], axis=0)
        labels = ops.concatenate([ops.ones((batch_size, 1)), ops.zeros((batch_size, 1))], axis=0)
        labels += 0.05 * keras.random.uniform(ops.shape(labels), seed=self.seed_generator)
        with tf.GradientTape() as tape:
            d_loss = self.loss_fn(labels, self.discriminator(combined))
        grads = tape.gradient(d_loss, self.discriminator.trainable_weights)
        self.d_optimizer.apply_gradients(zip(grads, self.discriminator.trainable_weights))
        latent = keras.random.normal((batch_size, self.latent_dim), seed=self.seed_generator)
        with tf.GradientTape() as tape:
            predictions = self.discriminator(self.generator(latent))
            g_loss = self.loss_fn(ops.zeros((batch_size, 1)), predictions)
        grads = tape.gradient(g_loss, self.generator.trainable_weights)
        self.g_optimizer.apply_gradients(zip(grads, self.generator.trainable_weights))
        self.d_loss_metric.update_state(d_loss)
        self.g_loss_metric.update_state(g_loss)
        return {"d_loss": self.d_loss_metric.result(), "g_loss": self.g_loss_metric.result()}


class WGANGP(keras.Model):
    """keras.io/examples/generative/wgan_gp: several critic steps per
    generator step, and a gradient penalty (a tape inside a tape)."""

    def __init__(self, discriminator, generator, latent_dim, d_steps=2, gp_weight=10.0):
        super().__init__()
        self.discriminator = discriminator
        self.generator = generator
        self.latent_dim = latent_dim
        self.d_steps = d_steps
        self.gp_weight = gp_weight
        self.seed_generator = keras.random.SeedGenerator(7)

    def compile(self, d_optimizer, g_optimizer, d_loss_fn, g_loss_fn):
        super().compile()
        self.d_optimizer = d_optimizer
        self.g_optimizer = g_optimizer
        self.d_loss_fn = d_loss_fn
        self.g_loss_fn = g_loss_fn

    def gradient_penalty(self, batch_size, real_images, fake_images):
        alpha = keras.random.uniform((batch_size, 1), seed=self.seed_generator)
        interpolated = real_images + alpha * (fake_images - real_images)
        with tf.GradientTape() as gp_tape:
            gp_tape.watch(interpolated)
            pred = self.discriminator(interpolated, training=True)
        grads = gp_tape.gradient(pred, [interpolated])[0]
        norm = ops.sqrt(ops.sum(ops.square(grads), axis=1))
        return ops.mean((norm - 1.0) ** 2)

    def train_step(self, real_images):
        batch_size = ops.shape(real_images)[0]
        for _ in range(self.d_steps):
            latent = keras.random.normal((batch_size, self.latent_dim), seed=self.seed_generator)
            with tf.GradientTape() as tape:
                fake_images = self.generator(latent, training=True)
                fake_logits = self.discriminator(fake_images, training=True)
                real_logits = self.discriminator(real_images, training=True)
                d_cost = self.d_loss_fn(real_img=real_logits, fake_img=fake_logits)
                gp = self.gradient_penalty(batch_size, real_images, fake_images)
                d_loss = d_cost + gp * self.gp_weight
            d_gradient = tape.gradient(d_loss, self.discriminator.trainable_variables)
            self.d_optimizer.apply_gradients(
                zip(d_gradient, self.discriminator.trainable_variables))
        latent = keras.random.normal((batch_size, self.latent_dim), seed=self.seed_generator)
        with tf.GradientTape() as tape:
            generated = self.generator(latent, training=True)
            g_loss = self.g_loss_fn(self.discriminator(generated, training=True))
        gen_gradient = tape.gradient(g_loss, self.generator.trainable_variables)
        self.g_optimizer.apply_gradients(zip(gen_gradient, self.generator.trainable_variables))
        return {"d_loss": d_loss, "g_loss": g_loss}


def _critic_loss(real_img, fake_img):
    return ops.mean(fake_img) - ops.mean(real_img)


def _generator_loss(fake_img):
    return -ops.mean(fake_img)


def _make_gan(kind):
    keras.utils.set_random_seed(3)
    discriminator = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="relu"),
                                      keras.layers.Dense(1)], name="discriminator")
    generator = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"),
                                  keras.layers.Dense(6)], name="generator")
    if kind == "dcgan":
        return GAN(discriminator, generator, latent_dim=4), dict(
            d_optimizer=keras.optimizers.Adam(1e-3), g_optimizer=keras.optimizers.Adam(1e-3),
            loss_fn=keras.losses.BinaryCrossentropy(from_logits=True))
    return WGANGP(discriminator, generator, latent_dim=4), dict(
        d_optimizer=keras.optimizers.Adam(2e-4, beta_1=0.5),
        g_optimizer=keras.optimizers.Adam(2e-4, beta_1=0.5),
        d_loss_fn=_critic_loss, g_loss_fn=_generator_loss)


@pytest.mark.parametrize("kind", ["dcgan", "wgan_gp"])
@pytest.mark.parametrize("entry", ["plugin_model", "callback"])
def test_gan_trains_through_the_plugin_like_plain_keras(kind, entry):
    images = np.random.default_rng(8).normal(size=(48, 6)).astype("float32")

    def train(how):
        gan, compile_arguments = _make_gan(kind)
        trained = kip.PluginModel(gan, passes=[kip.passes.Expand()]) if how == "plugin_model" else gan
        trained.compile(**compile_arguments)
        callbacks = [kip.PluginCallback(passes=[kip.passes.Expand()])] if how == "callback" else []
        history = trained.fit(images, batch_size=16, epochs=2, shuffle=False, verbose=0,
                              callbacks=callbacks)
        return history.history, gan, trained, callbacks

    expected, reference, _, _ = train(None)
    actual, gan, trained, callbacks = train(entry)
    _assert_histories_equal(actual, expected)
    for mine, theirs in zip(gan.weights, reference.weights):
        np.testing.assert_allclose(mine.numpy(), theirs.numpy(), atol=1e-5, err_msg=mine.path)
    session = trained._kip_session if entry == "plugin_model" else callbacks[0].session
    called = {c.callee.name: c for c in session.conversions}
    assert set(called) == {"generator", "discriminator"}  # each sub-model the step calls
    assert all(isinstance(c.model, kip.KipFunctional) for c in called.values())
    assert int(gan.g_optimizer.iterations.numpy()) == 6
    report = trained.kip_report if entry == "plugin_model" else callbacks[0].kip_report
    assert report is not None and report.touched("convert")


# -- shapes follow the data: FixRes fine-tuning at a larger size (13.9) ---------


class FullyConvolutional(keras.Model):
    def __init__(self):
        super().__init__()
        self.conv = keras.layers.Conv2D(4, 3, activation="relu")
        self.pool = keras.layers.GlobalAveragePooling2D()
        self.head = keras.layers.Dense(2)

    def call(self, x):
        return self.head(self.pool(self.conv(x)))


def _images(size, n=32, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(n, size, size, 3)).astype("float32"),
            rng.normal(size=(n, 2)).astype("float32"))


@pytest.mark.parametrize("entry", ["plugin_model", "callback"])
@pytest.mark.parametrize("run_eagerly", [False, True])
def test_fine_tuning_at_a_new_resolution_converts_anew_keeping_the_optimizer(entry, run_eagerly):
    def train(how):
        keras.utils.set_random_seed(2)
        model = FullyConvolutional()
        trained = kip.PluginModel(model) if how == "plugin_model" else model
        trained.compile(optimizer="adam", loss="mse", run_eagerly=run_eagerly)
        callbacks = [kip.PluginCallback()] if how == "callback" else []
        losses = []
        for size in (32, 48):
            x, y = _images(size)
            history = trained.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0,
                                  callbacks=callbacks)
            losses += history.history["loss"]
        return losses, model, trained, callbacks

    expected, reference, _, _ = train(None)
    actual, model, trained, callbacks = train(entry)
    np.testing.assert_allclose(actual, expected, atol=1e-5)
    for mine, theirs in zip(model.weights, reference.weights):
        np.testing.assert_allclose(mine.numpy(), theirs.numpy(), atol=1e-5, err_msg=mine.path)
    assert int(trained.optimizer.iterations.numpy()) == 8  # one optimizer, state kept
    session = trained._kip_session if entry == "plugin_model" else callbacks[0].session
    first, second = [tuple(c.model.inputs[0].shape[1:3]) for c in session.conversions]
    assert first == (32, 32)
    # Keras traces the step again with the size left open (None) when it
    # changes; a conversion made in that trace keeps it open too.
    assert second in ((48, 48), (None, None))


def test_plugin_model_called_at_a_new_size_converts_for_it():
    x32, _ = _images(32, n=4)
    x48, _ = _images(48, n=4)
    model = FullyConvolutional()
    plugin = kip.PluginModel(model)
    np.testing.assert_allclose(plugin(x32), model(x32), atol=1e-6)
    np.testing.assert_allclose(plugin(x48), model(x48), atol=1e-6)
    np.testing.assert_allclose(plugin.predict(x32, verbose=0), model(x32), atol=1e-5)
    np.testing.assert_allclose(plugin.predict(x48, verbose=0), model(x48), atol=1e-5)
    assert len(plugin._kip_session.conversions) >= 2


# -- an explicit mask is honoured as the original model honours it (12.4) ------


class MaskedPooling(keras.Model):
    """`call` takes `mask` and applies it its own way."""

    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(4, activation="tanh")
        self.out = keras.layers.Dense(1)

    def call(self, x, mask=None):
        y = self.dense(x)
        if mask is not None:
            weights = ops.expand_dims(ops.cast(mask, y.dtype), -1)
            y = ops.sum(y * weights, axis=1) / ops.maximum(ops.sum(weights, axis=1), 1.0)
        else:
            y = ops.mean(y, axis=1)
        return self.out(y)

    def train_step(self, batch):
        x, mask, y = batch["x"], batch["mask"], batch["y"]
        with tf.GradientTape() as tape:
            loss = ops.mean((self(x, mask=mask, training=True) - y) ** 2)
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
        return {"step_loss": loss}


def _masked_data(n=48, steps=5):
    rng = np.random.default_rng(9)
    x = rng.normal(size=(n, steps, 3)).astype("float32")
    mask = rng.uniform(size=(n, steps)) > 0.4
    mask[:, 0] = True
    y = rng.normal(size=(n, 1)).astype("float32")
    return x, mask, y


def test_plugin_model_honours_an_explicit_mask_as_the_original_does():
    x, mask, _ = _masked_data(n=6)
    model = MaskedPooling()
    plugin = kip.PluginModel(model)
    with_mask, without = model(x, mask=mask), model(x)
    assert not np.allclose(with_mask, without, atol=1e-3)  # the mask matters
    np.testing.assert_allclose(plugin(x, mask=mask), with_mask, atol=1e-6)
    np.testing.assert_allclose(plugin(x), without, atol=1e-6)
    masked = [c for c in plugin._kip_session.conversions if not c.simple]
    assert len(masked) == 1 and "mask" in masked[0].model.input


@pytest.mark.parametrize("run_eagerly", [False, True])
def test_step_passing_a_mask_trains_like_plain_keras(run_eagerly):
    x, mask, y = _masked_data()
    dataset = tf.data.Dataset.from_tensor_slices({"x": x, "mask": mask, "y": y}).batch(16)

    def train(plugin):
        keras.utils.set_random_seed(4)
        model = MaskedPooling()
        trained = kip.PluginModel(model) if plugin else model
        trained.compile(optimizer="adam", run_eagerly=run_eagerly)
        return trained.fit(dataset, epochs=2, verbose=0).history, model

    expected, reference = train(False)
    actual, model = train(True)
    _assert_histories_equal(actual, expected)
    _assert_same_weights(model, reference)


class CountsItsSteps(keras.Model):
    """A step of its own with state besides the weights: a step counter, a
    running mean and random noise drawn from the model's seed generator."""

    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(1)
        self.steps = keras.Variable(0, dtype="int32", trainable=False, name="steps")
        self.seed_generator = keras.random.SeedGenerator(11)
        self.error = keras.metrics.Mean(name="error")

    @property
    def metrics(self):
        return [self.error]

    def call(self, x):
        return self.dense(x)

    def train_step(self, data):
        x, y = data
        x = x + 0.1 * keras.random.normal(ops.shape(x), seed=self.seed_generator)
        with tf.GradientTape() as tape:
            loss = ops.mean((self(x) - y) ** 2)
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
        self.steps.assign_add(1)
        self.error.update_state(loss)
        return {"error": self.error.result()}


@pytest.mark.parametrize("entry", ["plugin_model", "callback"])
def test_the_dry_run_leaves_no_trace(entry):
    """The step run once to see its calls changes nothing: the counter reads
    the number of steps, the running mean and the random draws are those of
    plain Keras, and the optimizer stepped once per batch."""
    x, _ = _classification()
    y = x[:, :1]

    def train(how):
        keras.utils.set_random_seed(4)
        model = CountsItsSteps()
        trained = kip.PluginModel(model) if how == "plugin_model" else model
        trained.compile(optimizer=keras.optimizers.SGD(0.05))
        callbacks = [kip.PluginCallback()] if how == "callback" else []
        history = trained.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0,
                              callbacks=callbacks)
        return history.history, model, trained

    expected, reference, _ = train(None)
    actual, model, trained = train(entry)
    _assert_histories_equal(actual, expected)
    _assert_same_weights(model, reference)
    assert int(model.steps.numpy()) == 8
    assert int(trained.optimizer.iterations.numpy()) == 8


class CountsItsTraces(CountsItsSteps):
    """`CountsItsSteps`, counting the Python runs of its step (its traces)."""

    runs = 0

    def train_step(self, data):
        CountsItsTraces.runs += 1
        return super().train_step(data)


@pytest.mark.parametrize("entry", ["plugin_model", "callback"])
def test_the_dry_run_traces_the_step_once_and_builds_the_optimizer_after_it(entry):
    """An optimizer the step builds at its first apply is built after the
    dry run, not in it: a variable made while TensorFlow traces the dry run
    would make it trace the dry run again. The step then runs in Python
    twice (the dry run, the step's trace), and the optimizer is built on
    what plain Keras builds it on."""
    x, _ = _classification()
    y = x[:, :1]

    def train(how):
        keras.utils.set_random_seed(4)
        model = CountsItsTraces()
        model(x[:2])  # built: the dry run makes no weight of the model either
        trained = kip.PluginModel(model) if how == "plugin_model" else model
        trained.compile(optimizer=keras.optimizers.Adam(0.01))
        callbacks = [kip.PluginCallback()] if how == "callback" else []
        CountsItsTraces.runs = 0
        trained.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0, callbacks=callbacks)
        return model, trained.optimizer

    reference, plain_optimizer = train(None)
    model, optimizer = train(entry)
    assert CountsItsTraces.runs == 2
    # the same slots, in the same order (names follow each twin's layer names)
    assert ([tuple(v.shape) for v in optimizer.variables]
            == [tuple(v.shape) for v in plain_optimizer.variables])
    for mine, theirs in zip(optimizer.variables, plain_optimizer.variables):
        np.testing.assert_allclose(mine.numpy(), theirs.numpy(), atol=1e-6, err_msg=mine.path)
    _assert_same_weights(model, reference)


class PenaltySetPerInstance(keras.Model):
    """An instance attribute hiding a method of the class, as Python allows:
    `self.penalty` is the one given to `__init__`."""

    def __init__(self, penalty):
        super().__init__()
        self.dense = keras.layers.Dense(1)
        self.penalty = penalty

    def penalty(self, kernel):  # noqa: F811 - hidden on every instance
        return 0.0

    def call(self, x):
        return self.dense(x)

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = ops.mean((self(x) - y) ** 2) + self.penalty(self.dense.kernel)
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
        return {"step_loss": loss}


def test_step_sees_instance_attributes_that_hide_methods_of_the_class():
    x, _ = _classification()
    y = x[:, :1]

    def train(plugin):
        keras.utils.set_random_seed(4)
        model = PenaltySetPerInstance(lambda kernel: 5.0 * ops.sum(kernel ** 2))
        trained = kip.PluginModel(model) if plugin else model
        trained.compile(optimizer=keras.optimizers.SGD(0.05))
        return trained.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0).history, model

    expected, reference = train(False)
    actual, model = train(True)
    _assert_histories_equal(actual, expected)
    _assert_same_weights(model, reference)
