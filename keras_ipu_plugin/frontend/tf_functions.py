"""TensorFlow functions called on symbolic tensors while tracing.

A layer written for Keras 2 calls TensorFlow directly: `tf.square(a - b)`,
`tf.nn.relu(x)`, `tf.reduce_sum(x, axis=-1)`, `tf.reshape(x, [tf.shape(x)[0],
-1])`. On Keras 3's symbolic tensors these raise ("A KerasTensor cannot be
used as input to a TensorFlow function"), so such a layer used to stay one
opaque node. While a trace runs, on the tracing thread, `recorded()` makes
each such call a `TFFunction` graph operation instead (`runtime/
tf_function.py`), through TensorFlow's public dispatch for custom types
(`tf.experimental.dispatch_for_api`).

Covered: TensorFlow's elementwise functions (unary and binary: `tf.math.*`,
`tf.nn.relu`, ...) and the common non-elementwise ones in `_FUNCTIONS`.
Random functions are never recorded (the graph would not keep their seeds),
nor is anything TensorFlow does not export publicly: those still raise, and
the layer stays whole with that reason, as before.

The dispatch targets are registered once, on the first trace, and decline
(`NotImplemented`, TensorFlow's own behaviour follows) on every call made
outside a trace on the tracing thread.

Example:
    >>> with recorded():
    ...     y = tf.square(keras.KerasTensor((None, 4)))
    >>> type(y).__name__, y.shape
    ('KerasTensor', (None, 4))
"""

import contextlib
import inspect
import threading
import typing

import keras
import tensorflow as tf

from keras_ipu_plugin import _compat
from keras_ipu_plugin.runtime.tf_function import TFFunction
from keras_ipu_plugin.runtime.tf_function import public_name_of
from keras_ipu_plugin.runtime.tf_function import tf_function_named

# Non-elementwise TensorFlow functions recorded, with the parameters that
# make a call on a symbolic tensor (one of them must be one; a list
# parameter, a list of them).
_FUNCTIONS = {
    # reductions and scans
    "math.reduce_sum": ("input_tensor",), "math.reduce_mean": ("input_tensor",),
    "math.reduce_max": ("input_tensor",), "math.reduce_min": ("input_tensor",),
    "math.reduce_prod": ("input_tensor",), "math.reduce_logsumexp": ("input_tensor",),
    "math.reduce_std": ("input_tensor",), "math.reduce_variance": ("input_tensor",),
    "math.reduce_any": ("input_tensor",), "math.reduce_all": ("input_tensor",),
    "math.reduce_euclidean_norm": ("input_tensor",), "norm": ("tensor",),
    "math.argmax": ("input",), "math.argmin": ("input",), "math.top_k": ("input",),
    "math.cumsum": ("x",), "math.cumprod": ("x",), "nn.moments": ("x",),
    "math.l2_normalize": ("x",), "clip_by_norm": ("t",),
    "math.unsorted_segment_sum": ("data", "segment_ids", "num_segments"),
    "math.segment_sum": ("data", "segment_ids"), "math.segment_mean": ("data", "segment_ids"),
    "math.segment_max": ("data", "segment_ids"),
    # neural network functions
    "nn.softmax": ("logits",), "nn.log_softmax": ("logits",),
    "nn.bias_add": ("value", "bias"), "nn.conv1d": ("input", "filters"),
    "nn.conv2d": ("input", "filters"), "nn.depth_to_space": ("input",),
    "nn.space_to_depth": ("input",), "linalg.matmul": ("a", "b"),
    "linalg.band_part": ("input",), "sequence_mask": ("lengths",),
    "image.resize": ("images",), "image.extract_patches": ("images",),
    # shapes, indexing, joining
    "reshape": ("tensor", "shape"), "transpose": ("a",), "expand_dims": ("input",),
    "squeeze": ("input",), "tile": ("input", "multiples"), "broadcast_to": ("input", "shape"),
    "pad": ("tensor",), "shape": ("input",), "size": ("input",), "slice": ("input_",),
    "gather": ("params", "indices"), "gather_nd": ("params", "indices"),
    "one_hot": ("indices",), "where": ("condition", "x", "y"),
    "split": ("value",), "unstack": ("value",),
    "concat": ("*values",), "stack": ("*values",), "math.add_n": ("*inputs",),
}
_LIST_PARAMETER = "*"

_state = threading.local()
_registration_lock = threading.Lock()
_registered = []


@contextlib.contextmanager
def recorded():
    """Record the TensorFlow functions called on symbolic tensors on this
    thread as graph operations while the context lasts."""
    _register_once()
    _state.depth = getattr(_state, "depth", 0) + 1
    try:
        yield
    finally:
        _state.depth -= 1


def _recording():
    return getattr(_state, "depth", 0) > 0


def _register_once():
    with _registration_lock:
        if _registered:
            return
        _compat.make_dispatchable(keras.KerasTensor)
        symbolic = keras.KerasTensor
        unary, binary = _compat.tf_elementwise_functions()
        for function in unary:
            _register(function, lambda names: [{names[0]: symbolic}])
        for function in binary:
            _register(function, lambda names: [{names[0]: symbolic}, {names[1]: symbolic}])
        for path, parameters in _FUNCTIONS.items():
            function = tf_function_named(path)
            _register(function, lambda names, parameters=parameters: [
                {name.lstrip(_LIST_PARAMETER): typing.List[symbolic]
                 if name.startswith(_LIST_PARAMETER) else symbolic}
                for name in parameters if name.lstrip(_LIST_PARAMETER) in names
            ])
        _registered.append(True)


def _register(function, signatures_for):
    path = public_name_of(function)
    if path is None or "random" in path:
        return  # not public (it could not be saved), or random (no seed kept)
    signature = inspect.signature(function)
    signatures = signatures_for(list(signature.parameters))
    if not signatures:
        return
    tf.experimental.dispatch_for_api(function, *signatures)(_target(path, signature))


def _target(path, signature):
    """The dispatch target of one TensorFlow function: a `TFFunction` call
    while tracing on this thread; TensorFlow's own behaviour otherwise."""

    def target(*args, **kwargs):
        if not _recording():
            return NotImplemented
        bound = signature.bind(*args, **kwargs)
        bound.arguments.pop("name", None)  # TensorFlow's op name; nodes have theirs
        short = "tf_" + path.rsplit(".", 1)[-1]
        uid = keras.backend.get_uid(short)
        operation = TFFunction(path, name=short if uid == 1 else f"{short}_{uid - 1}")
        return operation(*bound.args, **bound.kwargs)

    target.__signature__ = signature
    return target


__all__ = ["recorded"]
