"""A batch that its microbatches do not divide, in a microbatched pipeline.

Plain Keras trains a partial last batch; so does the pipelined step: B rows
go into M microbatches as equal as possible (the first B % M one row
longer), each microbatch's loss weighed by its rows / B. Fitted through
`kip.PluginModel` in graph mode and under XLA, the weights and the history
equal plain Keras's (1e-5), with sample and class weights, weight and
activity regularizers, and per-output losses. A batch smaller than its
microbatches would leave one empty: refused with kip's message where an
assertion can run; under XLA, which drops assertions, it trains exactly.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_ipu_plugin as kip
from keras_ipu_plugin.passes import PipelineStages
from keras_ipu_plugin.training.pipelined import microbatches
from tests.training.pipelined.test_pipelined_step import Tower

DEVICES = ["/CPU:0", "/CPU:1"]
TOLERANCE = 1e-5


class TwoHeads(keras.Model):
    """Two tanh Dense blocks (one weight-, one activity-regularized) and a
    dict of two outputs, each with its own loss (per-output loss trackers)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.body = keras.layers.Dense(16, activation="tanh", name="body",
                                       kernel_regularizer=keras.regularizers.L2(1e-3))
        self.neck = keras.layers.Dense(16, activation="tanh", name="neck",
                                       activity_regularizer=keras.regularizers.L2(1e-3))
        self.label = keras.layers.Dense(3, name="label")
        self.score = keras.layers.Dense(1, name="score")

    def call(self, x):
        h = self.neck(self.body(x))
        return {"label": self.label(h), "score": self.score(h)}


def _data(samples, build):
    rng = np.random.default_rng(7)
    x = rng.normal(size=(samples, 8)).astype("float32")
    label = rng.integers(0, 3, samples).astype("int32")
    if build is TwoHeads:
        return x, {"label": label, "score": rng.normal(size=(samples, 1)).astype("float32")}
    return x, label


def _compile(model, build, jit):
    if build is TwoHeads:
        loss = {"label": keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                "score": keras.losses.MeanSquaredError()}
        metrics = {"label": ["accuracy"]}
    else:
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        metrics = ["accuracy"]
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss=loss, metrics=metrics,
                  jit_compile=jit)


_INITIAL = {}


def _fit(microbatch_count, build, samples, batch_size, jit, **fit):
    """`(weights, history)` of plain Keras (`microbatch_count` None) or of
    kip's pipelined step, from the same initial weights, for two epochs."""
    x, y = _data(samples, build)
    keras.utils.set_random_seed(11)
    user = build()
    user(x[:1])
    initial = _INITIAL.setdefault(build, [w.numpy() for w in user.weights])
    user.set_weights(initial)
    model = user
    if microbatch_count is not None:
        model = kip.PluginModel(user, passes=[PipelineStages(
            num_stages=2, microbatches=microbatch_count, devices=DEVICES)])
    _compile(model, build, jit)
    history = model.fit(x, y, batch_size=batch_size, epochs=2, verbose=0, shuffle=False, **fit)
    return [w.numpy() for w in user.weights], history.history


def _assert_same(expected, got):
    (plain_weights, plain_history), (weights, history) = expected, got
    assert len(weights) == len(plain_weights)
    for a, b in zip(plain_weights, weights):
        np.testing.assert_allclose(b, a, rtol=TOLERANCE, atol=TOLERANCE)
    assert history.keys() == plain_history.keys()
    for key in plain_history:
        np.testing.assert_allclose(history[key], plain_history[key], rtol=TOLERANCE,
                                   atol=TOLERANCE, err_msg=key)


def _class_weight():
    return {"class_weight": {0: 0.3, 1: 1.0, 2: 2.5}}


def _sample_weight():
    return {"sample_weight": np.random.default_rng(5).uniform(0.1, 2.0, 11).astype("float32")}


@pytest.mark.parametrize("count,samples,fit,jit", [
    (2, 10, dict, False),           # batches 4, 4, 2: slices 2 + 2, and 1 + 1
    (2, 10, dict, True),
    (3, 11, _class_weight, False),  # batches 4, 4, 3: slices 2 + 1 + 1, and 1 + 1 + 1
    (3, 11, _class_weight, True),
    (3, 11, _sample_weight, False),
], ids=["even-graph", "even-xla", "uneven-class-weights-graph", "uneven-class-weights-xla",
        "uneven-sample-weights-graph"])
def test_a_partial_last_batch_trains_as_plain_keras(count, samples, fit, jit):
    """A batch of 4 rows into 3 microbatches, and a partial last batch,
    train to plain Keras's weights and history (loss, accuracy), with
    sample and class weights, weight and activity regularizers."""
    expected = _fit(None, Tower, samples, 4, jit, **fit())
    _assert_same(expected, _fit(count, Tower, samples, 4, jit, **fit()))


@pytest.mark.parametrize("jit", [False, True], ids=["graph", "xla"])
def test_per_output_losses_of_uneven_microbatches_are_the_batch_s(jit):
    """With two outputs, each with its loss, the history's per-output
    losses of uneven microbatches equal plain Keras's."""
    expected = _fit(None, TwoHeads, 11, 4, jit)
    _assert_same(expected, _fit(3, TwoHeads, 11, 4, jit))


# -- a batch smaller than its microbatches ------------------------------------------------

#: kip's message, as Python raises it or as TensorFlow's assertion prints it
#: (each part in brackets).
TOO_SMALL = (r"PipelineStages\(microbatches=3\): a batch of\]? \[?2\]? \[?rows \(`x`\) is "
             r"smaller than its 3 microbatches, so a microbatch would be empty; use a batch "
             r"size of at least 3")


def test_a_batch_smaller_than_its_microbatches_is_refused_in_graph_mode():
    """10 samples in batches of 4 into 3 microbatches: the last batch of
    2 rows is refused with kip's message, not trained on with an empty
    microbatch."""
    with pytest.raises(tf.errors.InvalidArgumentError, match=TOO_SMALL):
        _fit(3, Tower, 10, 4, jit=False)


def test_a_batch_smaller_than_its_microbatches_is_refused_eagerly_and_when_traced_static():
    x, y = _data(2, Tower)
    for eager in (True, False):
        model = kip.PluginModel(Tower(), passes=[PipelineStages(
            num_stages=2, microbatches=3, devices=DEVICES)])
        _compile(model, Tower, jit=False)
        model.run_eagerly = eager
        # train_on_batch traces the step with the batch's shape known.
        with pytest.raises(ValueError, match=TOO_SMALL):
            model.train_on_batch(x, y)


def test_under_xla_a_batch_smaller_than_its_microbatches_trains_exactly():
    """XLA drops the assertion that refuses it in graph mode; the empty
    microbatch then adds no loss, no gradient and writes no variable, so
    the weights and history are still plain Keras's."""
    expected = _fit(None, Tower, 10, 4, jit=True)
    _assert_same(expected, _fit(3, Tower, 10, 4, jit=True))


def test_slices_of_a_batch_size_known_only_when_run_compile_under_xla():
    """The slice sizes come from the batch's shape: with the batch size
    left open, XLA compiles the split for each size it meets."""

    @tf.function(jit_compile=True, input_signature=[tf.TensorSpec([None, 2], tf.float32)])
    def sliced(x):
        sizes = microbatches.slice_sizes(tf.shape(x)[0], 4)
        return [tf.shape(part)[0] for part in microbatches.split(x, sizes, "x")]

    assert [int(n) for n in sliced(tf.zeros([10, 2]))] == [3, 3, 2, 2]
    assert [int(n) for n in sliced(tf.zeros([8, 2]))] == [2, 2, 2, 2]
    assert [int(n) for n in sliced(tf.zeros([3, 2]))] == [1, 1, 1, 0]
    assert microbatches.slice_sizes(10, 4) == [3, 3, 2, 2]
