"""A `tf.TensorArray` written in a Python loop and stacked.

`RWKV7TimeMix` (TensorFlow backend) writes each step of a recurrence into a
`tf.TensorArray` over a static length and stacks it. While a trace runs,
a symbolic value is kept in the eager array's list and `stack()` records
`keras.ops.stack` of it (`frontend/idioms.py`): the layer expands to
graph operations, equal to the original at other batch sizes, in training
through `PluginModel(passes=[Expand("all")])` and after saving. What cannot
be followed (an index computed in the graph, an unwritten element of
unknown shape) keeps the layer whole, saying what to write; outside a
trace `tf.TensorArray` is TensorFlow's own.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras import layers
from keras import ops

import keras_ipu_plugin as kip
from keras_ipu_plugin.passes import Expand

from graph_checks import custom_layers_left  # tests/ is on sys.path

WIDTH = 4


class DeltaRule(layers.Layer):
    """RWKV-7's `rnn_generalized_delta_rule` in small: a state updated step
    by step, each step's output written into a `tf.TensorArray`."""

    def __init__(self, read_back=False, **kwargs):
        super().__init__(**kwargs)
        self.read_back = read_back
        self.key = layers.Dense(WIDTH, name="key")
        self.decay = layers.Dense(WIDTH, activation="sigmoid", name="decay")

    def call(self, x):
        k, w = self.key(x), self.decay(x)
        steps = x.shape[1]
        state = ops.zeros_like(k[:, 0, :])
        out = tf.TensorArray(k.dtype, size=steps, clear_after_read=not self.read_back)
        for t in range(steps):
            state = state * w[:, t, :] + k[:, t, :]
            if self.read_back and t > 0:  # the step before, read back from the array
                state = state + 0.5 * out.read(t - 1)
            out = out.write(t, ops.tanh(state))
        return ops.transpose(out.stack(), [1, 0, 2])


class TimeMixNet(keras.Model):
    def __init__(self, block, **kwargs):
        super().__init__(**kwargs)
        self.embed = layers.Dense(WIDTH, name="embed")
        self.block = block
        self.head = layers.Dense(1, name="head")

    def call(self, x):
        return self.head(ops.mean(self.block(self.embed(x)), axis=1))


def _data(rows=24, seed=0, steps=5):
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(rows, steps, 3)).astype("float32"),
            rng.normal(size=(rows, 1)).astype("float32"))


def _built(block, seed=3):
    keras.utils.set_random_seed(seed)
    model = TimeMixNet(block, name="net")
    model(_data()[0][:2])
    return model


@pytest.mark.parametrize("read_back", [False, True])
def test_a_tensor_array_written_in_a_python_loop_expands_to_a_stack(read_back, tmp_path):
    model = _built(DeltaRule(read_back=read_back, name="mix"))
    x, _ = _data(4)
    converted = kip.convert_to_functional(model, x)
    assert not converted.kip_report.opaque
    passed = kip.apply_passes(converted, [Expand("all")])
    assert custom_layers_left(passed) == []
    assert not passed.kip_report.opaque
    assert sum(type(n.operation).__name__ == "Stack" for n in passed.kip_graph.nodes) == 1
    for batch in (1, 7):
        other = _data(batch, seed=batch)[0]
        np.testing.assert_allclose(passed(other), model(other), rtol=1e-5, atol=1e-6)
    path = str(tmp_path / "passed.keras")
    passed.save(path)
    other = _data(3, seed=9)[0]
    np.testing.assert_allclose(keras.models.load_model(path)(other), model(other),
                               rtol=1e-5, atol=1e-6)


def test_plugin_model_with_expand_trains_as_plain_keras():
    x, y = _data(24)
    start = [v.numpy() for v in _built(DeltaRule(name="mix")).weights]
    weights = {}
    for how in ("plain", "plugin"):
        # Twins from one start: the block's Dense layers are built in its
        # first call, which draws other initial weights from one build to the next.
        model = _built(DeltaRule(name="mix"))
        model.set_weights(start)
        trained = model
        if how == "plugin":
            trained = kip.PluginModel(model, passes=[Expand("all")])
            trained.convert(x[:8])
            assert not trained.converted.kip_report.opaque
            assert custom_layers_left(trained.converted) == []
        trained.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
        trained.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)  # 3 steps
        weights[how] = [v.numpy() for v in model.weights]
    for expected, actual in zip(weights["plain"], weights["plugin"]):
        np.testing.assert_allclose(actual, expected, rtol=0, atol=1e-5)
    assert any(not np.allclose(value, first) for value, first in
               zip(weights["plain"], start)), "training moved no weight"


class Gathers(layers.Layer):
    def call(self, x):
        out = tf.TensorArray(x.dtype, size=3, clear_after_read=False)
        for i in range(3):
            out = out.write(i, x[:, i] * float(i + 1))
        return ops.transpose(out.gather([2, 0]), [1, 0, 2])


class Concatenates(layers.Layer):
    def call(self, x):
        out = tf.TensorArray(x.dtype, size=2, infer_shape=False)
        out = out.write(0, ops.transpose(x[:, :2], [1, 0, 2]))
        out = out.write(1, ops.transpose(x[:, 2:], [1, 0, 2]))
        return ops.transpose(out.concat(), [1, 0, 2])


class UnstacksAndReads(layers.Layer):
    def call(self, x):
        out = tf.TensorArray(x.dtype, size=5).unstack(ops.transpose(x, [1, 0, 2]))
        return ops.stack([out.read(3), out.read(1)], axis=1) + ops.cast(out.size(), x.dtype)


class Scatters(layers.Layer):
    def call(self, x):
        out = tf.TensorArray(x.dtype, size=2).scatter([1, 0], ops.transpose(x[:, :2], [1, 0, 2]))
        return ops.transpose(out.stack(), [1, 0, 2])


@pytest.mark.parametrize("block", [Gathers, Concatenates, UnstacksAndReads, Scatters])
def test_the_arrays_other_methods_follow_from_its_list(block):
    model = _built(block(name="mix"))
    x, _ = _data(4)
    passed = kip.apply_passes(kip.convert_to_functional(model, x), [Expand("all")])
    assert custom_layers_left(passed) == [] and not passed.kip_report.opaque
    other = _data(7, seed=2)[0]
    np.testing.assert_allclose(passed(other), model(other), rtol=1e-6)


class WritesAtAGraphIndex(layers.Layer):
    def call(self, x):
        out = tf.TensorArray(x.dtype, size=2)
        index = ops.cast(ops.sum(ops.zeros_like(x[0, 0, :1])), "int32")
        return ops.transpose(out.write(index, x[:, 0]).write(1, x[:, 1]).stack(), [1, 0, 2])


class LeavesAnElementUnwritten(layers.Layer):
    def call(self, x):
        out = tf.TensorArray(x.dtype, size=3)
        out = out.write(0, x[:, 0]).write(2, x[:, 2])  # 1: zeros, TensorFlow stacks there
        return ops.transpose(out.stack(), [1, 0, 2])


def test_an_element_left_unwritten_is_zeros_of_the_batch_size():
    """Traced with the batch unknown, the zeros' shape is not known: the
    trace at batch size 1 follows them as zeros of the data's batch size."""
    model = _built(LeavesAnElementUnwritten(name="mix"))
    x, _ = _data(4)
    passed = kip.apply_passes(kip.convert_to_functional(model, x), [Expand("all")])
    assert custom_layers_left(passed) == [] and not passed.kip_report.opaque
    for batch in (1, 7):
        other = _data(batch, seed=batch)[0]
        np.testing.assert_allclose(passed(other), model(other), rtol=1e-6)


def test_a_graph_index_stays_whole_saying_what_to_write():
    model = _built(WritesAtAGraphIndex(name="mix"))
    x, _ = _data(4)
    converted = kip.convert_to_functional(model, x)
    passed = kip.apply_passes(converted, [Expand("all")])
    reasons = {**converted.kip_report.opaque, **passed.kip_report.opaque}
    assert list(reasons) == ["block"], reasons  # by its attribute path
    assert "at an index computed in the graph" in reasons["block"], reasons
    assert "`ops.stack`" in reasons["block"] and "expand" in reasons["block"], reasons
    assert not reasons["block"].startswith(("TypeError", "ValueError")), reasons
    np.testing.assert_allclose(passed(x), model(x), rtol=1e-6)


def test_in_a_trace_stack_records_keras_stack_and_refuses_unknown_zeros():
    from keras_ipu_plugin.frontend.idioms import traced_idioms

    a, b = keras.KerasTensor((None, 3)), keras.KerasTensor((None, 3))
    with traced_idioms():
        stacked = tf.TensorArray(tf.float32, size=2).write(0, a).write(1, b).stack()
        assert isinstance(stacked, keras.KerasTensor) and tuple(stacked.shape) == (2, None, 3)
        with pytest.raises(tf.errors.InvalidArgumentError, match="dtype is float32"):
            tf.TensorArray(tf.float32, size=1).write(0, keras.KerasTensor((None, 3), "int32"))
        with pytest.raises(tf.errors.OutOfRangeError, match="not resizeable"):
            tf.TensorArray(tf.float32, size=1).write(1, a)
        with pytest.raises(ValueError, match="Incompatible shape"):
            tf.TensorArray(tf.float32, size=2).write(0, a).write(1, keras.KerasTensor((None, 4)))
        with pytest.raises(ValueError, match=r"elements \[1\] were never written"):
            tf.TensorArray(tf.float32, size=2).write(0, a).stack()
        grown = tf.TensorArray(tf.float32, size=0, dynamic_size=True).write(1, a)
        with pytest.raises(ValueError, match="were never written"):
            grown.stack()


def test_outside_a_trace_a_tensor_array_is_tensorflows_own():
    out = tf.TensorArray(tf.float32, size=2).write(0, tf.ones(3)).write(1, tf.zeros(3))
    np.testing.assert_array_equal(out.stack().numpy(), [[1, 1, 1], [0, 0, 0]])
    with pytest.raises(ValueError, match="KerasTensor"):  # as TensorFlow refuses it
        tf.TensorArray(tf.float32, size=1).write(0, keras.KerasTensor((None, 3)))
