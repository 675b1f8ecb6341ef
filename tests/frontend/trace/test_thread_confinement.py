"""What a trace changes is confined to the tracing thread.

While one thread converts a model (held inside its trace by an Event, so the
order is certain), another thread sees Keras and TensorFlow exactly as they
are with no trace running: the operators with NumPy values, NumPy's
`__array_priority__`, indexing with a bare None / slice, `ops.tile` with a
None repeat, `ops.ndim`, `keras.random` draws, variable initialisation and
TensorFlow's dispatch on symbolic tensors. Each check compares the second
thread's outcome (its value's type, dtype and shape, or the exception type)
with the outcome of the same code run before any trace.
"""

import contextlib
import threading
import types

import numpy as np
import pytest
import tensorflow as tf

import keras
from keras import layers
from keras import ops

import keras_ipu_plugin as kip
from keras_ipu_plugin.frontend import idioms as traced_idioms_lib

WAIT = 60  # seconds: only a failure ever waits this long


class HoldsTheTrace(layers.Layer):
    """Uses the idioms the trace follows (a NumPy scalar on the left, a bare
    None index) and, the first time it is traced, waits inside the trace
    until the test releases it."""

    def __init__(self, entered, release, seen, **kwargs):
        super().__init__(**kwargs)
        self.dense = layers.Dense(4, name="dense")
        # Held in objects the test keeps: the trace calls a view of the layer.
        self._entered, self._release, self._seen = entered, release, seen

    def call(self, x):
        if isinstance(x, keras.KerasTensor) and not self._entered.is_set():
            self._seen.inside_trace = traced_idioms_lib._in_traced_idioms()
            self._entered.set()
            assert self._release.wait(WAIT), "the test never released the trace"
        h = np.float64(0.5) * self.dense(x)  # float32 on the tracing thread
        return h[None][0]


class Holder(keras.Model):
    def __init__(self, entered, release, seen, **kwargs):
        super().__init__(**kwargs)
        self.block = HoldsTheTrace(entered, release, seen, name="block")

    def call(self, x):
        return self.block(x)


@contextlib.contextmanager
def a_conversion_held_in_its_trace():
    """Run a real conversion on another thread, hold it inside its trace
    while the block runs, then let it finish; it must succeed (the tracing
    thread keeps its idioms) and equal the model."""
    entered, release = threading.Event(), threading.Event()
    x = np.random.RandomState(0).normal(size=(4, 3)).astype("float32")
    seen = types.SimpleNamespace(inside_trace=None)  # Keras copies a list
    model = Holder(entered, release, seen, name="holder")
    model(x)
    done = {}

    def convert():
        try:
            done["converted"] = kip.convert_to_functional(model, x)
        except BaseException as error:  # reported on the test's thread
            done["error"] = error
            entered.set()

    tracer = threading.Thread(target=convert, name="tracer")
    tracer.start()
    try:
        assert entered.wait(WAIT), "the conversion never reached the block"
        assert "error" not in done, done.get("error")
        assert seen.inside_trace is True
        yield
    finally:
        release.set()
        tracer.join(WAIT)
    assert not tracer.is_alive()
    if "error" in done:
        raise done["error"]
    np.testing.assert_allclose(done["converted"](x), model(x), atol=1e-6)
    assert done["converted"](x).dtype == "float32"


def outcome(work):
    """What `work()` gives: `("value", type, dtype, shape)` or `("raises", type)`."""
    try:
        value = work()
    except Exception as error:  # noqa: BLE001 - the outcome is the point
        return ("raises", type(error).__name__)
    dtype = getattr(value, "dtype", None)
    return ("value", type(value).__name__, None if dtype is None else str(dtype),
            tuple(getattr(value, "shape", ())))


def on_another_thread(work):
    """`work()` run on a new thread (not the tracing one); returns its result."""
    result = {}

    def run():
        try:
            result["value"] = work()
        except BaseException as error:
            result["error"] = error

    thread = threading.Thread(target=run, name="other")
    thread.start()
    thread.join(WAIT)
    assert not thread.is_alive()
    if "error" in result:
        raise result["error"]
    return result["value"]


def same_as_without_a_trace(cases):
    """Each case's outcome on another thread while a conversion is held in
    its trace equals its outcome with no trace running."""
    plain = {name: outcome(work) for name, work in cases.items()}
    with a_conversion_held_in_its_trace():
        during = on_another_thread(lambda: {name: outcome(work) for name, work in cases.items()})
    assert during == plain
    return plain


def symbolic():
    return keras.KerasTensor((2, 3))


# -- the operators with NumPy values ----------------------------------------------
def test_numpy_scalars_and_arrays_with_symbolic_tensors_on_another_thread_are_plain_keras():
    plain = same_as_without_a_trace({
        "float64 * tensor": lambda: np.float64(0.5) * symbolic(),
        "tensor * float64": lambda: symbolic() * np.float64(0.5),
        "float32 + tensor": lambda: np.float32(2) + symbolic(),
        "float64 < tensor": lambda: np.float64(1) < symbolic(),
        "ones * tensor": lambda: np.ones(3) * symbolic(),
        "tensor - ones": lambda: symbolic() - np.ones(3),
    })
    # Plain Keras: NumPy on the left raises, on the right promotes.
    assert plain["float64 * tensor"][0] == "raises"
    assert plain["tensor * float64"][2] == "float64"


def test_array_priority_exists_on_the_tracing_thread_only():
    seen = {}

    def look():
        return (hasattr(keras.KerasTensor, "__array_priority__"),
                hasattr(symbolic(), "__array_priority__"))

    plain = look()
    with a_conversion_held_in_its_trace():
        seen["other"] = on_another_thread(look)
    assert plain == (False, False)
    assert seen["other"] == (False, False)
    assert look() == (False, False)  # and after


# -- indexing, tile, ndim ---------------------------------------------------------
def test_bare_index_tile_and_ndim_on_another_thread_are_plain_keras():
    plain = same_as_without_a_trace({
        "x[None]": lambda: symbolic()[None],
        "x[1:]": lambda: symbolic()[1:],
        "x[...]": lambda: symbolic()[...],
        "tile with None": lambda: ops.tile(keras.KerasTensor((2, 3)), (None, 1)),
        "ndim": lambda: ops.ndim(symbolic()),
    })
    assert plain["x[None]"][0] == "raises"
    assert plain["tile with None"][0] == "raises"
    assert plain["ndim"][1] == "KerasTensor"


# -- random draws and variable initialisation ---------------------------------------
def _draws():
    generator = keras.random.SeedGenerator(7)
    return [keras.random.normal((2, 3), seed=generator),
            keras.random.uniform((2, 3), seed=generator),
            keras.random.truncated_normal((2, 3), seed=generator),
            keras.random.normal((2, 3), seed=11)]


def test_random_draws_on_another_thread_draw_as_keras_does():
    plain = [np.asarray(d) for d in _draws()]
    with a_conversion_held_in_its_trace():
        during = on_another_thread(_draws)
    assert [type(d).__name__ for d in during] == [type(d).__name__ for d in _draws()]
    for expected, drawn in zip(plain, during):
        np.testing.assert_array_equal(np.asarray(drawn), expected)


def _built_layer():
    dense = layers.Dense(3, kernel_initializer=keras.initializers.GlorotUniform(seed=5),
                         bias_initializer=keras.initializers.RandomNormal(seed=6))
    dense.build((None, 4))
    return [np.asarray(v) for v in dense.weights]


def test_variables_initialised_on_another_thread_get_keras_initial_values():
    plain = _built_layer()
    with a_conversion_held_in_its_trace():
        during = on_another_thread(_built_layer)
    for expected, built in zip(plain, during):
        np.testing.assert_array_equal(built, expected)


# -- TensorFlow's dispatch ----------------------------------------------------------
def test_tensorflow_functions_on_symbolic_tensors_raise_on_another_thread():
    plain = same_as_without_a_trace({
        "tf.square": lambda: tf.square(symbolic()),
        "tf.nn.relu": lambda: tf.nn.relu(symbolic()),
        "tf.add": lambda: tf.add(symbolic(), 1.0),
        "tf.reduce_sum": lambda: tf.reduce_sum(symbolic(), axis=-1),
        "tf.reshape": lambda: tf.reshape(symbolic(), [-1]),
        "tf.concat": lambda: tf.concat([symbolic(), symbolic()], axis=0),
        "tf.shape": lambda: tf.shape(symbolic()),
    })
    assert {result for result in plain.values()} == {("raises", "ValueError")}


def test_no_tensorflow_function_called_on_another_thread_becomes_a_graph_node():
    with a_conversion_held_in_its_trace():
        with pytest.raises(ValueError, match="KerasTensor cannot be used as input"):
            on_another_thread(lambda: tf.square(symbolic()))


# -- a call another thread began while the trace was on -----------------------------
def test_a_keras_method_looked_up_during_a_trace_still_works_after_it():
    # Another thread may look a method up (a wrapper while a trace runs) and
    # call it once the last trace has ended and the class is restored.
    from keras.src.ops.numpy import Ndim
    from keras.src.ops.numpy import Tile

    def look_up():
        return (keras.KerasTensor.__getitem__, keras.KerasTensor.__mul__,
                Tile.compute_output_spec, Ndim.symbolic_call)

    with a_conversion_held_in_its_trace():
        getitem, mul, tile_spec, ndim_call = on_another_thread(look_up)
    x = symbolic()
    assert getitem(x, (None,)).shape == (1, 2, 3)
    assert mul(x, 2.0).shape == (2, 3)
    assert tile_spec(Tile((2, 1)), x).shape == (4, 3)
    assert outcome(lambda: ndim_call(Ndim(), x)) == outcome(lambda: ops.ndim(x))


def test_a_failure_while_installing_the_idioms_leaves_keras_as_it_was(monkeypatch):
    from keras.src.ops.numpy import Tile

    originals = (keras.KerasTensor.__getitem__, keras.KerasTensor.__mul__,
                 Tile.compute_output_spec)

    def fails(original):
        raise RuntimeError("installing failed")

    monkeypatch.setattr(traced_idioms_lib, "_ndim_symbolic_call", fails)  # one of the last installed
    with pytest.raises(RuntimeError, match="installing failed"):
        with traced_idioms_lib.traced_idioms():
            pass
    assert (keras.KerasTensor.__getitem__, keras.KerasTensor.__mul__,
            Tile.compute_output_spec) == originals
    assert not hasattr(keras.KerasTensor, "__array_priority__")
    monkeypatch.undo()
    with traced_idioms_lib.traced_idioms():  # and the next trace installs them afresh
        assert keras.KerasTensor((5, 8))[None].shape == (1, 5, 8)
    assert keras.KerasTensor.__getitem__ is originals[0]
