"""`TFRandomDraw`: a TensorFlow random draw a layer's `call` makes, as a
graph operation.

Code written for TensorFlow samples with its stateful functions:
keras.io's VAE as often written, `epsilon = tf.random.normal(shape=(batch,
dim))` with `batch = tf.shape(z_mean)[0]`. On Keras 3's symbolic tensors
such a call raises, so the layer used to run whole. While tracing, the
tracer records it as this operation instead (`frontend/idioms/tf_functions.py`):
when the graph runs it makes the very same call (`tf.random.normal` with
the same shape tensors, mean, stddev, dtype and op-level seed, or none), so
it draws as the original does, from TensorFlow's own random state: the
same numbers for the same op seed in a `tf.function`, fresh numbers for an
unseeded draw. Verification replays the original's draws in the converted
run (`frontend/verify/runs.py`'s `taped_stateful_draws`), as it does for a layer kept whole.

A draw advances its kernel's state: it is no pure function, so it is not
a `TFFunction` (whose table holds side-effect free functions only), and a
node drawing is never recomputed (`draws_statefully`): a recomputation
would draw other numbers than the forward pass used. The function is
resolved only from `tf_function_table.RANDOM_DRAWS`, also when loading.

Example:
    >>> draw = TFRandomDraw("random.normal", name="tf_normal")
    >>> draw((tf_shape_0, 2), seed=1337).shape   # tf_shape_0: a symbolic int
    (None, 2)
"""

import inspect

import keras
import tensorflow as tf

from keras_ipu_plugin.errors import LoadError
from keras_ipu_plugin.errors import short_repr
from keras_ipu_plugin.layers.saved_values import refuse_constant_call
from keras_ipu_plugin.layers.saved_values import saved_function_config
from keras_ipu_plugin.layers.tf_calls.tf_function_table import draw_function_at


@keras.saving.register_keras_serializable(package="keras_ipu_plugin")
class TFRandomDraw(keras.Operation):
    """Calls the TensorFlow random function `function` (a path under `tf`
    of `tf_function_table.RANDOM_DRAWS`, such as `"random.normal"`) on its
    arguments each time the graph runs.

    Example:
        >>> draw = TFRandomDraw("random.uniform")
        >>> draw((None, 2), minval=0.9, maxval=1.1, batch_of=x).shape   # x: (4, 3)
        (4, 2)
    """

    def __init__(self, function, name=None):
        if name is not None and not isinstance(name, str):
            raise LoadError(f"TFRandomDraw: a name is a string; got {short_repr(name)}.")
        # Checked before the operation exists: nothing named runs otherwise.
        callable_ = draw_function_at(function, name or "(unnamed)")
        super().__init__(name=name)
        self.function = function
        self._tf_callable = callable_

    def call(self, *args, batch_of=None, **kwargs):
        # `batch_of`: a graph tensor whose batch size each None of the
        # draw's `shape` is (`tf.random.normal(ops.shape(x))`, traced while
        # the batch size was unknown).
        refuse_constant_call(self, args, dict(kwargs, batch_of=batch_of))
        if batch_of is not None:
            bound = self._signature().bind(*args, **kwargs).arguments
            batch = tf.shape(batch_of)[0]
            bound["shape"] = [batch if dim is None else dim for dim in bound["shape"]]
            return self._tf_callable(**bound)
        return self._tf_callable(*args, **kwargs)

    def compute_output_spec(self, *args, batch_of=None, **kwargs):
        if batch_of is None:
            return super().compute_output_spec(*args, **kwargs)
        bound = self._signature().bind(*args, **kwargs).arguments
        dtype = bound.get("dtype") or "float32"
        return keras.KerasTensor(
            tuple(batch_of.shape[0] if dim is None else dim for dim in bound["shape"]),
            dtype=keras.backend.standardize_dtype(dtype))

    def _signature(self):
        return inspect.signature(self._tf_callable)

    def get_config(self):
        return {"function": self.function, "name": self.name}

    @classmethod
    def from_config(cls, config):
        function, name = saved_function_config(cls.__name__, config)
        return cls(function, name=name)


def draws_statefully(operation):
    """Whether `operation` is a TensorFlow random draw: its run advances a
    kernel's state, which a recomputation would advance again (drawing
    other numbers than the forward pass used), so it never sits in a
    recomputed segment.

    Example:
        >>> draws_statefully(TFRandomDraw("random.normal")), draws_statefully(keras.layers.Dense(2))
        (True, False)
    """
    return isinstance(operation, TFRandomDraw)


__all__ = ["TFRandomDraw", "draws_statefully"]
