"""`TFFunction`: a TensorFlow function called on graph tensors, as a graph
operation.

Keras 3 records `keras.ops` calls on symbolic tensors but refuses
TensorFlow's own functions (`tf.square(a - b)`, `tf.nn.relu(x)`,
`tf.reduce_sum(x, -1)`): "A KerasTensor cannot be used as input to a
TensorFlow function". Code written for Keras 2 is full of them, and every
layer using one stayed a black box to Expand. While tracing, the tracer
records such a call as this operation (`frontend/idioms/tf_functions.py`), which
calls the very same TensorFlow function when the graph runs: its gradient
is TensorFlow's, its output shapes are TensorFlow's shape inference, and it
saves by the function's public name (`"math.square"`). A name is resolved
only from the table of functions the tracer records (`tf_function_table`):
a saved model naming anything else fails to load, before anything runs.

Example:
    >>> square = TFFunction("math.square")
    >>> square(keras.KerasTensor((None, 4))).shape
    (None, 4)
"""

import functools
import inspect

import keras
import tensorflow as tf

from keras_ipu_plugin.errors import LoadError
from keras_ipu_plugin.errors import short_repr
from keras_ipu_plugin.layers.saved_values import refuse_constant_call
from keras_ipu_plugin.layers.saved_values import saved_function_config
from keras_ipu_plugin.layers.tf_calls.tf_function_table import function_at

# The public namespaces a function is saved by, in the order its name is
# looked for (`tf.square` is saved as "math.square"). "image" comes after
# the top level, so a function exported at both keeps its shorter name; a
# namespace missing here made every function in it unrecordable
# (`tf.image.extract_patches` in keras.io's ViT left its layer whole).
_NAMESPACES = ("math", "nn", "linalg", "bitwise", "", "image")


@keras.saving.register_keras_serializable(package="keras_ipu_plugin")
class TFFunction(keras.Operation):
    """Calls the TensorFlow function with public name `function` (a path
    under `tf`, such as `"math.square"` or `"reshape"`, one of the table
    `tf_function_table.RECORDED`) on its arguments."""

    def __init__(self, function, name=None):
        if name is not None and not isinstance(name, str):
            raise LoadError(f"TFFunction: a name is a string; got {short_repr(name)}.")
        # Checked before the operation exists: nothing named runs otherwise.
        callable_ = function_at(function, name or "(unnamed)")
        super().__init__(name=name)
        self.function = function
        self._tf_callable = callable_

    def call(self, *args, **kwargs):
        refuse_constant_call(self, args, kwargs)
        return self._tf_callable(*args, **kwargs)

    def compute_output_spec(self, *args, **kwargs):
        # Keras calls the product of a symbolic tensor and a concrete one
        # sparse (`ops.multiply` takes what is not a KerasTensor for sparse:
        # DDPM's `TimeEmbedding`, `inputs[:, None] * self.emb[None, :]`),
        # and TensorFlow's shape inference on a SparseTensor placeholder then
        # fails ("Failed to convert elements of SparseTensor") or loses the
        # shape. The tensors a kip graph carries are dense: sparse inputs
        # are refused (`frontend/inputs.py`) and traced specs are made dense
        # where no argument is sparse (`output_specs.dense_unless_given_sparse`).
        args, kwargs = keras.tree.map_structure(_dense_spec, (args, kwargs))
        return super().compute_output_spec(*args, **kwargs)

    def get_config(self):
        return {"function": self.function, "name": self.name}

    @classmethod
    def from_config(cls, config):
        function, name = saved_function_config(cls.__name__, config)
        return cls(function, name=name)


def _dense_spec(leaf):
    if isinstance(leaf, keras.KerasTensor) and leaf.sparse:
        return keras.KerasTensor(leaf.shape, dtype=leaf.dtype, ragged=leaf.ragged)
    return leaf


def public_name_of(function):
    """The public path under `tf` of `function` (or of a function it wraps),
    or None when TensorFlow does not export it.

    Example:
        >>> public_name_of(tf.square)
        'math.square'
    """
    return _public_names().get(id(function))


@functools.lru_cache(maxsize=None)
def _public_names():
    names = {}
    for namespace in _NAMESPACES:
        module = getattr(tf, namespace) if namespace else tf
        for attribute in sorted(dir(module)):
            if attribute.startswith("_"):
                continue
            try:
                value = getattr(module, attribute)
            except Exception:  # a lazily loaded module that cannot load here (tf.keras)
                continue
            if not callable(value) or inspect.isclass(value):
                continue
            path = f"{namespace}.{attribute}" if namespace else attribute
            # TensorFlow wraps its ops (dispatch, weak types): the function
            # handed to a dispatcher is one of the layers inside.
            for layer in _wrapped_chain(value):
                names.setdefault(id(layer), path)
    return names


def _wrapped_chain(function):
    seen = []
    while function is not None and all(function is not s for s in seen):
        seen.append(function)
        function = getattr(function, "__wrapped__", None)
    return seen


__all__ = ["TFFunction", "public_name_of"]
