"""Every `fit` option plain Keras accepts trains the same through every entry point.

A model trained through `kip.PluginModel`, `kip.PluginCallback` or
`kip.scope` must take the same optimizer steps, on the same batches in the
same order, as the same model trained by plain Keras with the same `fit`
arguments: `steps_per_execution`, `initial_epoch`, `validation_freq`, class
and sample weights, a partial last batch, datasets with `repeat` / `take` /
`steps_per_epoch`, a seeded `tf.data` shuffle, callbacks that stop training.
Each case trains a plain Keras twin and the plugin from one seed and
compares every variable (trainable, non-trainable, the optimizer's) and the
history `fit` returns. The comparison is exact: the plugin runs the same
operations on the same batches as Keras, so nothing may round differently.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_ipu_plugin as kip
from keras_ipu_plugin.passes import Expand
from keras_ipu_plugin.passes import PipelineStages

layers = keras.layers

FEATURES, CLASSES = 4, 3


class Classifier(keras.Model):
    """Dense, BatchNormalization (non-trainable statistics), Dense logits."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.hidden = layers.Dense(8, name="hidden")
        self.norm = layers.BatchNormalization(name="norm")
        self.logits = layers.Dense(CLASSES, name="logits")

    def call(self, x, training=None):
        return self.logits(keras.ops.relu(self.norm(self.hidden(x), training=training)))


def _data(n):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, FEATURES)).astype("float32")
    y = rng.integers(0, CLASSES, size=(n,)).astype("int32")
    return x, y


def _dataset(n, batch_size=8):
    return tf.data.Dataset.from_tensor_slices(_data(n)).batch(batch_size)


class StopAtBatch(keras.callbacks.Callback):
    """Stops training at the end of batch `batch` of epoch `epoch`."""

    def __init__(self, epoch, batch):
        super().__init__()
        self.stop_epoch, self.stop_batch, self.epoch = epoch, batch, None

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if self.epoch == self.stop_epoch and batch >= self.stop_batch:
            self.model.stop_training = True


# Each option: `compile` keyword arguments, and a function giving `fit`'s
# arguments (called once per training, so datasets and callbacks are fresh).
OPTIONS = {
    "steps_per_execution": (
        {"steps_per_execution": 3},
        lambda: dict(x=_data(48)[0], y=_data(48)[1], batch_size=8, epochs=2)),
    "steps_per_execution_partial": (
        # 5 batches, the last one partial: executions of 2, 2 and 1 steps.
        {"steps_per_execution": 2},
        lambda: dict(x=_data(36)[0], y=_data(36)[1], batch_size=8, epochs=2)),
    "steps_per_execution_dataset": (
        {"steps_per_execution": 4},
        lambda: dict(x=_dataset(40), epochs=2)),
    "steps_per_execution_eager": (
        {"steps_per_execution": 3, "run_eagerly": True},
        lambda: dict(x=_data(48)[0], y=_data(48)[1], batch_size=8, epochs=2)),
    "initial_epoch": (
        {}, lambda: dict(x=_data(24)[0], y=_data(24)[1], batch_size=8, epochs=3, initial_epoch=1)),
    "validation_freq": (
        {}, lambda: dict(x=_data(24)[0], y=_data(24)[1], batch_size=8, epochs=3,
                         validation_data=_data(16), validation_freq=2)),
    "class_weight": (
        {}, lambda: dict(x=_data(24)[0], y=_data(24)[1], batch_size=8, epochs=2,
                         class_weight={0: 1.0, 1: 3.0, 2: 0.5})),
    "sample_weight": (
        {}, lambda: dict(x=_data(24)[0], y=_data(24)[1], batch_size=8, epochs=2,
                         sample_weight=np.linspace(0.1, 2.0, 24).astype("float32"))),
    "partial_last_batch": (
        {}, lambda: dict(x=_data(28)[0], y=_data(28)[1], batch_size=8, epochs=2)),
    "numpy_shuffle": (
        {}, lambda: dict(x=_data(32)[0], y=_data(32)[1], batch_size=8, epochs=2, shuffle=True)),
    "dataset_repeat_steps_per_epoch": (
        {}, lambda: dict(x=_dataset(24).repeat(), epochs=2, steps_per_epoch=4)),
    "dataset_take": (
        {}, lambda: dict(x=_dataset(48).take(3), epochs=2)),
    "dataset_seeded_shuffle": (
        {}, lambda: dict(
            x=tf.data.Dataset.from_tensor_slices(_data(40)).shuffle(40, seed=1).batch(8),
            epochs=2)),
    "callback_stops_training": (
        {}, lambda: dict(x=_data(40)[0], y=_data(40)[1], batch_size=8, epochs=3,
                         callbacks=[StopAtBatch(epoch=1, batch=2)])),
    "early_stopping_with_steps_per_execution": (
        {"steps_per_execution": 2},
        lambda: dict(x=_data(40)[0], y=_data(40)[1], batch_size=8, epochs=6,
                     callbacks=[keras.callbacks.EarlyStopping(
                         monitor="loss", patience=0, min_delta=10.0)])),
}

ENTRY_POINTS = ["PluginModel", "PluginCallback", "scope"]


def _train(entry_point, option):
    """`(state, history)` after fitting a fresh Classifier with `option`,
    through `entry_point` (None: plain Keras)."""
    # A dataset's shuffle seed is drawn from the global seed when it is made.
    keras.utils.set_random_seed(7)
    compile_kwargs, fit_kwargs = OPTIONS[option][0], OPTIONS[option][1]()
    model = Classifier(name="classifier")
    model(_data(2)[0])

    def compile_(target):
        target.compile(optimizer=keras.optimizers.Adam(learning_rate=0.01),
                       loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                       metrics=["accuracy"], **compile_kwargs)

    trained = model
    if entry_point == "PluginModel":
        trained = kip.PluginModel(model)
        compile_(trained)
    elif entry_point == "scope":
        with kip.scope():
            compile_(model)
    else:
        compile_(model)
    if entry_point == "PluginCallback":
        fit_kwargs["callbacks"] = [*fit_kwargs.get("callbacks", ()), kip.PluginCallback()]
    # Keras seeds numpy shuffling from the global seed: the same for both.
    keras.utils.set_random_seed(11)
    history = trained.fit(verbose=0, **fit_kwargs)
    return _state(model, trained.optimizer), history.history


def _state(model, optimizer):
    """Every variable that training changes: the model's by path, the
    optimizer's in its order (its iterations count and moments)."""
    state = {f"model:{v.path}": v.numpy() for v in model.weights}
    state.update({f"optimizer:{i}:{v.name}": v.numpy() for i, v in enumerate(optimizer.variables)})
    return state


def _assert_same_training(actual, expected, case):
    (state, history), (expected_state, expected_history) = actual, expected
    assert state.keys() == expected_state.keys(), case
    for name, value in expected_state.items():
        np.testing.assert_array_equal(
            state[name], value, err_msg=f"{case}: {name} differs from plain Keras")
    assert history.keys() == expected_history.keys(), case
    for key, values in expected_history.items():
        np.testing.assert_array_equal(
            history[key], values, err_msg=f"{case}: history `{key}` differs from plain Keras")


_plain = {}


def _plain_training(option):
    if option not in _plain:
        _plain[option] = _train(None, option)
    return _plain[option]


# The cases run by default (the rest are `slow`): `steps_per_execution`
# through every entry point, and through PluginModel the options that once
# trained differently or that reach the step function's own paths.
FAST = {(entry_point, "steps_per_execution") for entry_point in ENTRY_POINTS} | {
    ("PluginModel", option) for option in (
        "steps_per_execution_eager", "validation_freq", "class_weight",
        "dataset_repeat_steps_per_epoch", "dataset_seeded_shuffle", "callback_stops_training")}


def _cases():
    for entry_point in ENTRY_POINTS:
        for option in OPTIONS:
            marks = () if (entry_point, option) in FAST else (pytest.mark.slow,)
            yield pytest.param(entry_point, option, marks=marks, id=f"{entry_point}-{option}")


@pytest.mark.parametrize("entry_point, option", list(_cases()))
def test_every_fit_option_trains_as_plain_keras_through_every_entry_point(entry_point, option):
    """The optimizer steps once per batch from the very first execution
    (6 batches at `steps_per_execution=3` are 6 steps an epoch, not 4), on
    the batches plain Keras trains on, to the same variables."""
    expected = _plain_training(option)
    actual = _train(entry_point, option)
    _assert_same_training(actual, expected, f"{entry_point} with {option}")


# -- a pipelined model with dict inputs --------------------------------------


class TwoInputNet(keras.Model):
    """Dict inputs, two blocks that PipelineStages puts on two stages."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.first = layers.Dense(8, activation="tanh", name="first")
        self.second = layers.Dense(1, name="second")

    def call(self, inputs):
        joined = keras.ops.concatenate([inputs["a"], inputs["b"]], axis=-1)
        return self.second(self.first(joined))


def _train_two_inputs(passes):
    rng = np.random.default_rng(3)
    x = {"a": rng.normal(size=(48, 2)).astype("float32"),
         "b": rng.normal(size=(48, 3)).astype("float32")}
    y = rng.normal(size=(48, 1)).astype("float32")
    keras.utils.set_random_seed(7)
    model = TwoInputNet(name="two_inputs")
    model({k: v[:2] for k, v in x.items()})
    trained = model if passes is None else kip.PluginModel(model, passes=passes)
    trained.compile(optimizer=keras.optimizers.Adam(learning_rate=0.01), loss="mse",
                    steps_per_execution=3)
    history = trained.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    return _state(model, trained.optimizer), history.history


@pytest.fixture(scope="module")
def plain_two_inputs():
    return _train_two_inputs(None)


@pytest.mark.parametrize("passes", [
    pytest.param(lambda: [PipelineStages([["first"], ["second"]])], id="stages"),
    pytest.param(lambda: [PipelineStages([["first"], ["second"]], microbatches=2)],
                 id="stages_microbatched", marks=pytest.mark.slow),
    pytest.param(lambda: [Expand("all")], id="expand", marks=pytest.mark.slow),
])
def test_pipelined_dict_input_model_with_steps_per_execution_trains_as_plain_keras(
        passes, plain_two_inputs):
    expected = plain_two_inputs
    actual = _train_two_inputs(passes())
    (state, _), (expected_state, _) = actual, expected
    assert state["optimizer:0:iteration"] == expected_state["optimizer:0:iteration"] == 12
    for name, value in expected_state.items():
        # Microbatches sum their gradients in another order than one batch.
        np.testing.assert_allclose(state[name], value, rtol=0, atol=1e-6,
                                   err_msg=f"{name} differs from plain Keras")


# -- a seeded tf.data shuffle ---------------------------------------------------


@pytest.mark.parametrize("built", [pytest.param(True, marks=pytest.mark.slow), False],
                         ids=["built", "unbuilt"])
def test_plugin_model_trains_on_a_seeded_shuffle_in_plain_keras_order(built):
    """Converting from a dataset's first batch does not move its shuffle on:
    `fit` sees the batches, in the order, that plain Keras sees (a wrapped
    model built or not; the built one is also a case of the matrix above)."""

    def train(plugin):
        keras.utils.set_random_seed(7)
        model = Classifier(name="classifier")
        if built:
            model(_data(2)[0])
        trained = kip.PluginModel(model) if plugin else model
        trained.compile(optimizer=keras.optimizers.Adam(learning_rate=0.01),
                        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        dataset = tf.data.Dataset.from_tensor_slices(_data(40)).shuffle(40, seed=1).batch(8)
        history = trained.fit(dataset, epochs=2, verbose=0)
        return _state(model, trained.optimizer), history.history

    _assert_same_training(train(plugin=True), train(plugin=False), "seeded shuffle")


@pytest.mark.parametrize("reader", [
    "convert_to_functional", pytest.param("PluginModel.convert", marks=pytest.mark.slow)])
def test_reading_a_seeded_shuffle_for_conversion_leaves_fit_its_order(reader):
    """`convert_to_functional(model, dataset)` / `plugin.convert(dataset)`
    read the dataset's first batch without changing what a later `fit`
    sees: a reshuffling seeded shuffle still gives its first order."""

    def shuffled():
        return tf.data.Dataset.from_tensor_slices(_data(40)).shuffle(40, seed=1).batch(8)

    def train(read_first):
        keras.utils.set_random_seed(7)
        model = Classifier(name="classifier")
        model(_data(2)[0])
        dataset = shuffled()
        if read_first and reader == "convert_to_functional":
            kip.convert_to_functional(model, dataset)
        trained = model
        if read_first and reader == "PluginModel.convert":
            trained = kip.PluginModel(model)
            trained.convert(dataset)
        trained.compile(optimizer=keras.optimizers.Adam(learning_rate=0.01),
                        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        history = trained.fit(dataset, epochs=2, verbose=0)
        return _state(model, trained.optimizer), history.history

    _assert_same_training(train(read_first=True), train(read_first=False), reader)


def test_a_seeded_shuffle_copy_gives_the_first_order_and_leaves_the_original():
    from keras_ipu_plugin.frontend.inputs import dataset_to_peek

    def orders(dataset):
        return [batch.numpy().tolist() for batch in dataset]

    expected = orders(tf.data.Dataset.range(12).shuffle(12, seed=1).batch(4))
    dataset = tf.data.Dataset.range(12).shuffle(12, seed=1).batch(4)
    copy = dataset_to_peek(dataset)
    assert copy is not dataset
    assert orders(copy) == expected
    assert orders(dataset) == expected
    # Nothing to copy where nothing draws seeds: the dataset is read itself.
    plain = tf.data.Dataset.range(4).batch(2)
    assert dataset_to_peek(plain) is plain


def _through_a_generator(dataset):
    generator = tf.random.Generator.from_seed(3)
    return dataset.map(lambda x, y: (x + generator.normal(tf.shape(x)), y))


@pytest.mark.parametrize("pipeline", [
    "seeded random map", "seeded shuffle of a seeded random map", "python map"])
def test_a_pipeline_whose_draws_restart_each_iteration_is_read_exactly(pipeline):
    """A dataset whose functions draw from seeded random ops (instantiated
    anew for each iteration) or call Python trains through PluginModel,
    which reads its first batch to convert, exactly as with plain Keras."""

    def make():
        dataset = tf.data.Dataset.from_tensor_slices(_data(40))
        if pipeline == "python map":
            dataset = dataset.map(lambda x, y: (tf.py_function(
                lambda v: v * 2.0, [x], tf.float32), y))
            dataset = dataset.map(lambda x, y: (tf.ensure_shape(x, (FEATURES,)), y))
        else:
            dataset = dataset.map(lambda x, y: (x + tf.random.uniform(tf.shape(x), seed=4), y))
        if pipeline == "seeded shuffle of a seeded random map":
            dataset = dataset.shuffle(40, seed=1)
        return dataset.batch(8)

    def train(plugin):
        keras.utils.set_random_seed(7)
        model = Classifier(name="classifier")
        trained = kip.PluginModel(model) if plugin else model
        trained.compile(optimizer=keras.optimizers.Adam(learning_rate=0.01),
                        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        history = trained.fit(make(), epochs=2, verbose=0)
        return _state(model, trained.optimizer), history.history

    _assert_same_training(train(plugin=True), train(plugin=False), pipeline)


def test_a_pipeline_writing_state_outside_it_is_refused_with_what_to_do():
    """A `map` drawing from a `tf.random.Generator` moves the generator at
    every element read, copy or not: reading the first batch to convert
    would give `fit` other numbers than plain Keras, so it is refused,
    naming the op and the ways out; the first batch given itself trains."""
    dataset = _through_a_generator(tf.data.Dataset.from_tensor_slices(_data(16))).batch(8)
    expected_error = (r"without changing what a later `fit` sees: .*`RngReadAndSkip`.*"
                      r"Give the first batch itself.*PluginCallback")
    with pytest.raises(kip.InputDataError, match=expected_error):
        kip.convert_to_functional(Classifier(name="classifier"), dataset)
    model = kip.PluginModel(Classifier(name="classifier"))
    model.compile(optimizer="adam",
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    with pytest.raises(kip.InputDataError, match=expected_error):
        model.fit(dataset, epochs=1, verbose=0)
    model.convert(_data(8)[0])
    model.fit(dataset, epochs=1, verbose=0)
    assert model.converted is not None


# -- a later fit on sequences of another length ---------------------------------

VOCAB, MAX_LENGTH, WIDTH = 50, 16, 8


class PositionEmbedding(layers.Layer):
    """Token embedding plus learnt positions sliced to the sequence length."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.tokens = layers.Embedding(VOCAB, WIDTH, name="tokens")

    def build(self, input_shape):
        self.tokens.build(input_shape)
        self.positions = self.add_weight(
            shape=(MAX_LENGTH, WIDTH), initializer="random_normal", name="positions")

    def call(self, ids):
        return self.tokens(ids) + self.positions[:keras.ops.shape(ids)[1]]


class SlicingEncoder(keras.Model):
    """A transformer's embedding: the slice in a layer, or in the model's own
    `call` (`in_call`)."""

    def __init__(self, in_call=False, **kwargs):
        super().__init__(**kwargs)
        self.in_call = in_call
        self.embed = PositionEmbedding(name="embed")
        self.hidden = layers.Dense(WIDTH, activation="relu", name="hidden")
        self.head = layers.Dense(1, name="head")

    def build(self, input_shape):
        self.embed.build(input_shape)

    def call(self, ids):
        if self.in_call:
            h = self.embed.tokens(ids) + self.embed.positions[:keras.ops.shape(ids)[1]]
        else:
            h = self.embed(ids)
        return self.head(keras.ops.mean(self.hidden(h), axis=1))


def _sequences(length, n=16):
    rng = np.random.default_rng(length)
    return (rng.integers(0, VOCAB, size=(n, length)).astype("int32"),
            rng.normal(size=(n, 1)).astype("float32"))


def _train_lengths(passes, in_call, lengths=(16, 8)):
    keras.utils.set_random_seed(7)
    model = SlicingEncoder(in_call=in_call, name="encoder")
    model(_sequences(MAX_LENGTH)[0][:2])
    trained = model if passes is None else kip.PluginModel(model, passes=passes)
    trained.compile(optimizer=keras.optimizers.Adam(learning_rate=0.01), loss="mse")
    for length in lengths:
        x, y = _sequences(length)
        trained.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    return _state(model, trained.optimizer), trained


_plain_lengths = {}


@pytest.mark.parametrize("passes, in_call", [
    pytest.param(lambda: [Expand("all")], False, id="expand_all-slice_in_layer"),
    pytest.param(lambda: [], True, id="no_passes-slice_in_call", marks=pytest.mark.slow),
    pytest.param(lambda: [], False, id="no_passes-slice_in_layer", marks=pytest.mark.slow),
    pytest.param(lambda: [Expand("all")], True, id="expand_all-slice_in_call",
                 marks=pytest.mark.slow),
])
def test_a_later_fit_on_shorter_sequences_trains_as_plain_keras(passes, in_call):
    """Fitted at length 16 and then at length 8, a model slicing its
    positions to the sequence length converts again for length 8 (its
    passes too) and trains as plain Keras does."""
    if in_call not in _plain_lengths:
        _plain_lengths[in_call] = _train_lengths(None, in_call)[0]
    expected = _plain_lengths[in_call]
    actual, plugin = _train_lengths(passes(), in_call)
    assert [c.signature.describe() for c in plugin._kip_session.conversions] == [
        "(?, 16) int32", "(?, 8) int32"]
    for name, value in expected.items():
        np.testing.assert_allclose(actual[name], value, rtol=0, atol=1e-6,
                                   err_msg=f"{name} differs from plain Keras")


def test_a_conversion_failing_on_a_later_batch_says_this_batch():
    """A conversion made for a later batch names that batch, not the first.
    (Here: batches padded to a length the dataset does not state, so the
    step is traced with the length unknown, and Expand cannot expand the
    layer slicing its positions to it.)"""
    keras.utils.set_random_seed(7)
    model = SlicingEncoder(name="encoder")
    plugin = kip.PluginModel(model, passes=[Expand("all")])
    plugin.compile(optimizer="sgd", loss="mse")
    plugin.fit(*_sequences(16), batch_size=4, epochs=1, verbose=0)
    ids, y = _sequences(8)
    padded = tf.data.Dataset.from_tensor_slices((ids, y)).padded_batch(
        4, padded_shapes=([None], [1]))
    with pytest.raises(kip.PassError) as error:
        plugin.fit(padded, epochs=1, verbose=0)
    assert "fails when called on this batch" in str(error.value)
    assert "first batch" not in str(error.value)
