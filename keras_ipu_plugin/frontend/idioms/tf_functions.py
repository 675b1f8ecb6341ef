"""TensorFlow functions called on symbolic tensors while tracing.

A layer written for Keras 2 calls TensorFlow directly: `tf.square(a - b)`,
`tf.nn.relu(x)`, `tf.reduce_sum(x, axis=-1)`, `tf.reshape(x, [tf.shape(x)[0],
-1])`. On Keras 3's symbolic tensors these raise ("A KerasTensor cannot be
used as input to a TensorFlow function"), so such a layer used to stay one
opaque node. While a trace runs, on the tracing thread, `recorded()` makes
each such call a `TFFunction` graph operation instead (`layers/
tf_function.py`), through TensorFlow's public dispatch for custom types
(`tf.experimental.dispatch_for_api`).

Covered: TensorFlow's elementwise functions (unary and binary: `tf.math.*`,
`tf.nn.relu`, ...) and the common non-elementwise ones (`tf.einsum`,
`tf.range(tf.shape(x)[-1])`, `tf.stop_gradient`, ...): exactly the table
`layers/tf_calls.py`, which is also all a saved model may name.
TensorFlow's random draws given a symbolic shape or tensor
(`tf.random.normal(shape=(tf.shape(x)[0], dim))`) are recorded as
`TFRandomDraw`s (`layers/tf_calls.py`), which draw as the original
does each time the graph runs (the table's `RANDOM_DRAWS`). Nothing outside
the table is recorded: such a call still raises, and the layer stays whole
with that reason, as before.

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
from keras_ipu_plugin.layers.tf_calls import TFFunction
from keras_ipu_plugin.layers.tf_calls import public_name_of
from keras_ipu_plugin.layers.tf_calls import ELEMENTWISE
from keras_ipu_plugin.layers.tf_calls import RANDOM_DRAWS
from keras_ipu_plugin.layers.tf_calls import TENSOR_PARAMETERS
from keras_ipu_plugin.layers.tf_calls import draw_function_at
from keras_ipu_plugin.layers.tf_calls import function_at
from keras_ipu_plugin.layers.tf_calls import TFRandomDraw

_LIST_PARAMETER = "*"

_state = threading.local()
_registration_lock = threading.Lock()
_registered = []


@contextlib.contextmanager
def recorded(batch_anchor=None):
    """Record the TensorFlow functions called on symbolic tensors on this
    thread as graph operations while the context lasts. `batch_anchor()`:
    the graph tensor whose batch size a None in a random draw's shape is
    (`tf.random.normal(ops.shape(x))` while the batch is unknown), or None."""
    _register_once()
    _state.depth = getattr(_state, "depth", 0) + 1
    anchors = _state.__dict__.setdefault("batch_anchors", [])
    anchors.append(batch_anchor)
    try:
        yield
    finally:
        anchors.pop()
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
        for path, parameters in TENSOR_PARAMETERS.items():
            function = function_at(path, "tracing")
            _register(function, path=path, signatures_for=lambda names, parameters=parameters: [
                {name.lstrip(_LIST_PARAMETER): typing.List[symbolic]
                 if name.startswith(_LIST_PARAMETER) else symbolic}
                for name in parameters if name.lstrip(_LIST_PARAMETER) in names
            ])
        for path in RANDOM_DRAWS:
            _register_draw(path)
        _registered.append(True)


def _register_draw(path):
    """Record `tf.<path>` (a random draw) called on symbolic tensors as a
    `TFRandomDraw`. Its shape is often a list mixing symbolic sizes and
    numbers (`(tf.shape(x)[0], dim)`), which the type-based dispatch cannot
    describe; the draw fails converting it before drawing anything, and
    TensorFlow's fallback dispatch is then consulted."""
    function = draw_function_at(path, "tracing")
    signature = inspect.signature(function)
    target = _target(path, signature, operation=TFRandomDraw)

    def fallback(args, kwargs):
        if _holds_symbolic((args, kwargs)):
            return target(*args, **kwargs)
        # `tf.random.normal(ops.shape(x))`: the batch size is None while
        # traced; the draw takes it from a graph tensor when the graph runs.
        anchor = _batch_anchor() if _recording() else None
        shape = _bound(signature, args, kwargs).get("shape")
        if anchor is None or not _has_unknown_size(shape):
            return NotImplemented
        return target(*args, **kwargs, batch_of=anchor)

    _compat.add_fallback_dispatch(function, fallback)


def _batch_anchor():
    anchors = getattr(_state, "batch_anchors", None)
    provider = anchors[-1] if anchors else None
    return None if provider is None else provider()


def _bound(signature, args, kwargs):
    try:
        return signature.bind(*args, **kwargs).arguments
    except TypeError:
        return {}


def _has_unknown_size(shape):
    """Whether `shape` is a list of sizes (ints) and None, with a None."""
    return isinstance(shape, (list, tuple)) and any(dim is None for dim in shape) and all(
        dim is None or (isinstance(dim, int) and not isinstance(dim, bool)) for dim in shape)


def _register(function, signatures_for, path=None):
    # A table entry registers under its own path: `tf.nn.softmax` is also
    # exported as `tf.math.softmax`, which `public_name_of` finds first, and
    # the entry was never recorded (`tf.norm` as `tf.linalg.norm`).
    path = path or public_name_of(function)
    if path is None or (path not in ELEMENTWISE and path not in TENSOR_PARAMETERS):
        return  # outside the table: it could not be loaded (random: no seed kept)
    signature = inspect.signature(function)
    signatures = signatures_for(list(signature.parameters))
    if not signatures:
        return
    target = _target(path, signature)
    if any(parameter.kind is inspect.Parameter.VAR_POSITIONAL
           for parameter in signature.parameters.values()):
        # `tf.einsum(equation, *inputs)`: the type-based dispatch takes no
        # var-positional parameter; TensorFlow's fallback dispatch is
        # consulted once the function has failed on the symbolic tensors
        # (it fails converting them, before computing anything).
        _compat.add_fallback_dispatch(function, lambda args, kwargs: (
            target(*args, **kwargs) if _holds_symbolic((args, kwargs)) else NotImplemented))
        return
    tf.experimental.dispatch_for_api(function, *signatures)(target)


def _holds_symbolic(structure):
    return any(isinstance(leaf, keras.KerasTensor) for leaf in keras.tree.flatten(structure))


def _target(path, signature, operation=TFFunction):
    """The dispatch target of one TensorFlow function: a call of
    `operation` (a `TFFunction`, or a `TFRandomDraw` for a draw) while
    tracing on this thread; TensorFlow's own behaviour otherwise."""

    def target(*args, batch_of=None, **kwargs):
        if not _recording():
            return NotImplemented
        bound = signature.bind(*args, **kwargs)
        bound.arguments.pop("name", None)  # TensorFlow's op name; nodes have theirs
        for parameter in signature.parameters.values():
            if parameter.kind is inspect.Parameter.VAR_KEYWORD:  # `tf.einsum(..., name=)`
                bound.arguments.get(parameter.name, {}).pop("name", None)
        short = "tf_" + path.rsplit(".", 1)[-1]
        uid = keras.backend.get_uid(short)
        made = operation(path, name=short if uid == 1 else f"{short}_{uid - 1}")
        if batch_of is not None:  # a draw whose shape holds the batch size as None
            return made(*bound.args, **bound.kwargs, batch_of=batch_of)
        result = made(*bound.args, **bound.kwargs)
        return _sized_shape(result) if path == "shape" else result

    target.__signature__ = signature
    return target


class _SymbolicShape(keras.KerasTensor):
    """`tf.shape(x)` of a symbolic tensor, recorded while tracing: `len()`
    of it is `x`'s rank, as TensorFlow gives it for an eager tensor:
    `(tf.shape(x)[0],) + (1,) * (len(tf.shape(x)) - 1)`, a `StochasticDepth`
    written for Keras 2 (keras.io's CCT once). (Inside a `tf.function`
    TensorFlow refuses `len` of a graph tensor, so such a model runs
    eagerly only in plain Keras 3; the graph follows the eager meaning.)
    A KerasTensor has no `len()`; only the tensors this tracer makes for
    `tf.shape` get one, so no other KerasTensor changes."""

    def __len__(self):
        return self.shape[0]


def _sized_shape(result):
    """`result` (a recorded `tf.shape`'s output) with `len()` where its
    length, the rank of the tensor measured, is known."""
    if type(result) is keras.KerasTensor and len(result.shape) == 1 and isinstance(
            result.shape[0], int):
        result.__class__ = _SymbolicShape
    return result


__all__ = ["recorded"]
