"""Symbolic idioms Keras rejects, followed while a trace runs (trace-time patches).

Public Keras code writes `ops.tile(token, (ops.shape(x)[0], 1, 1))` and
`table[None]`. On symbolic tensors Keras's `Tile` multiplies the unknown
batch size (None) into its output shape (TypeError), and its symbolic
indexing takes ints and tuples only, rejecting a bare None, Ellipsis or
slice although `x[None]` is exactly `x[(None,)]`. Inside
`traced_idioms()` (on the thread that entered it only) the tile's output
shape is None where its repeats are (the tracer then makes it a
`BatchSizedOperation` that reads the batch size when the graph runs) and
a bare key is recorded as the same key in a tuple. Outside, and on other
threads, Keras is exactly as it was; what changes only ever raised before.
A `keras.ops` call given a graph tensor where Keras takes a Python size
(`ops.segment_sum(..., num_segments=ops.max(ids) + 1)`, `ops.repeat(x,
counts)`, `ops.one_hot`, `ops.bincount(minlength=...)`; the table
`_compat.tensor_size_attributes`) is recorded as a `TensorSizedOperation`
taking the tensor as a graph input, and a `num_segments` given explicitly
as None (`ops.shape(x)[0]` of an unknown dimension) is marked for the
tracer to fill from the graph (`unknown_sizes`).
A `keras.random.normal / uniform / truncated_normal` draw is handed to the
tracer's `record_draw` (which records it as a graph node, or returns None
to let it run as Keras runs it): run eagerly, it would draw once, freeze
the numbers into the graph and advance the layer's seed generator.
A `tf.TensorArray` written with symbolic tensors in a Python loop and
stacked (keras_hub's RWKV-7) keeps them in its list and stacks them with
`keras.ops.stack` (`tensor_arrays.py`).
Every change is thread-confined: the wrappers put on Keras's classes while
any thread is inside the context consult this thread-local state and do
exactly what Keras does on every other thread; a class attribute (NumPy's
`__array_priority__`) is a descriptor that has the traced value on a tracing
thread only. Each wrapper holds the original it replaced, so a call another
thread started just before the last trace ended still runs Keras's code.

`_compat.traced_idiom_targets` names the Keras objects wrapped (the access);
what the wrappers do is tracing behaviour, and lives here, next to the tracer
(`call_trace.CallTrace.active` enters the context for each mode traced).

Example:
    >>> with traced_idioms():
    ...     keras.KerasTensor((5, 8))[None].shape
    (1, 5, 8)
"""

import contextlib
import copy
import inspect
import threading
import types
import weakref

import numpy as np
import tensorflow as tf

from keras_ipu_plugin import _compat
from keras_ipu_plugin.frontend.idioms import tensor_arrays

_idioms_state = threading.local()
_idioms_lock = threading.Lock()
_idioms_users = [0]
_idioms_patches = []  # (owner, name, original, owner had its own) to restore


def _in_traced_idioms():
    return getattr(_idioms_state, "depth", 0) > 0


class _OnTracingThreads:
    """A class attribute with `traced` as its value on a thread inside
    `traced_idioms()` and the class's own value elsewhere; where the class
    had none, AttributeError, so NumPy (which looks `__array_priority__` up
    with `getattr`) sees none."""

    def __init__(self, name, traced, original):
        self._name, self._traced, self._original = name, traced, original

    def __get__(self, instance, owner=None):
        if _in_traced_idioms():
            return self._traced
        if self._original is _NOT_SET:
            raise AttributeError(
                f"type object {getattr(owner, '__name__', owner)!r} has no attribute {self._name!r}")
        return self._original


def _tile_output_spec(original):
    def compute_output_spec(self, x):
        repeats = self.repeats
        if not _in_traced_idioms() or isinstance(repeats, int) or None not in list(repeats):
            return original(self, x)
        filled = copy.copy(self)
        filled.repeats = type(repeats)(1 if r is None else r for r in repeats)
        spec = original(filled, x)
        shape = list(spec.shape)
        # Repeats align with the output's last dimensions (numpy's rule).
        for offset, repeat in enumerate(reversed(list(repeats))):
            if repeat is None:
                shape[len(shape) - 1 - offset] = None
        return type(spec)(tuple(shape), dtype=spec.dtype)

    return compute_output_spec


_DRAWS = ("normal", "uniform", "truncated_normal")


def _intercepted_draw(original):
    def draw(*args, **kwargs):
        recorders = getattr(_idioms_state, "recorders", None)
        if not recorders or recorders[-1] is None or _compat.in_shape_inference():
            return original(*args, **kwargs)
        bound = inspect.signature(original).bind(*args, **kwargs)
        bound.apply_defaults()
        recorded = recorders[-1](draw.kind, dict(bound.arguments))
        return original(*args, **kwargs) if recorded is None else recorded

    return draw


def _initialize_without_recording(original):
    def initialize(self, initializer):
        """A variable's initializer draws its numbers as Keras draws them: a
        layer built while a trace runs (a sub-layer first called there) would
        otherwise get a graph tensor for its initial value."""
        if not _in_traced_idioms():
            return original(self, initializer)
        recorders = _idioms_state.__dict__.setdefault("recorders", [])
        recorders.append(None)
        try:
            return original(self, initializer)
        finally:
            recorders.pop()

    return initialize


def _getitem(original):
    def getitem(self, key):
        if _in_traced_idioms() and (key is None or key is Ellipsis or isinstance(key, slice)):
            key = (key,)
        return original(self, key)

    return getitem


# A NumPy value met by a symbolic tensor (`x * np.float64(p)`, `np.float64(p)
# * x`, a rate from `np.linspace`, `np.ones(n) * x`): TensorFlow's tensors
# convert it to their own dtype (and NumPy defers to them, `__array_priority__`),
# so the layer computes in float32; Keras's symbolic ops promote to float64, or
# NumPy raises on the left. While tracing, a scalar is given as the Python
# number it holds, which Keras treats as TensorFlow does (weakly typed), and an
# array as TensorFlow converts it (an error where TensorFlow would raise).
_SCALAR_OPERATORS = (
    "__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__",
    "__truediv__", "__rtruediv__", "__floordiv__", "__rfloordiv__", "__mod__",
    "__rmod__", "__pow__", "__rpow__", "__lt__", "__le__", "__gt__", "__ge__",
)
_ARRAY_PRIORITY = "__array_priority__"
_NOT_SET = object()


def _python_scalar_operator(original):
    def operator(self, other):
        if _in_traced_idioms():
            if isinstance(other, np.generic):
                other = other.item()
            elif isinstance(other, np.ndarray) and self.dtype is not None:
                other = np.asarray(tf.convert_to_tensor(other, dtype=self.dtype))
        return original(self, other)

    operator.__name__ = getattr(original, "__name__", "operator")
    return operator


def _ndim_symbolic_call(original):
    def symbolic_call(self, x):
        """`ops.ndim` of a symbolic tensor while tracing: its static rank, a
        Python int, as TensorFlow's backend gives for a tensor (`x.shape.rank`);
        Keras's symbolic call gives a KerasTensor instead, which code such as
        keras_hub RoFormer-v2's `ndim = ndim or max(axes) + 1` cannot branch on."""
        if _in_traced_idioms() and getattr(x, "shape", None) is not None:
            return len(x.shape)
        return original(self, x)

    return symbolic_call


def _tensor_sized_call(placeholders):
    """`symbolic_call` of a Keras operation that takes a size as a Python
    value (`SegmentSum.num_segments`, `Repeat.repeats`): given a symbolic
    tensor there while tracing (`num_segments=ops.max(ids) + 1`), the call
    is recorded as a `TensorSizedOperation` taking that tensor as a graph
    input (Keras would fail working out the shape); `placeholders`:
    {attribute: what it holds in the recorded operation's config}."""
    def make(original):
        def symbolic_call(self, *args, **kwargs):
            if not _in_traced_idioms():
                return original(self, *args, **kwargs)
            KerasTensor = _compat.traced_idiom_targets().keras_tensor  # noqa: N806
            given = [name for name in placeholders
                     if isinstance(vars(self).get(name), KerasTensor)]
            if not given:
                return original(self, *args, **kwargs)
            from keras_ipu_plugin.layers.keras_ops.tensor_sized import TensorSizedOperation

            parameters = inspect.signature(type(self).__init__).parameters.values()
            config = {parameter.name: getattr(self, parameter.name) for parameter in parameters
                      if parameter.name not in ("self", "name")
                      and parameter.kind in (parameter.POSITIONAL_OR_KEYWORD,
                                             parameter.KEYWORD_ONLY)}
            config.update({name: placeholders[name] for name in given})
            recorded = TensorSizedOperation(type(self)(**config), given, name=self.name)
            return recorded(*[getattr(self, name) for name in given], *args, **kwargs)

        return symbolic_call

    return make


# {operation: attributes}: Keras operations made while tracing by a call
# given None explicitly for a size (`ops.segment_sum(x, ids,
# num_segments=ops.shape(x)[0])`, the unknown batch size): that None is an
# unknown dimension, which the tracer fills from the graph when it runs.
# Keras's default (no `num_segments`: as many segments as ids) is not one.
_unknown_sizes = weakref.WeakKeyDictionary()


def unknown_sizes(operation):
    """The attributes of `operation` (a Keras operation recorded while
    tracing) that hold an unknown dimension as None given explicitly."""
    try:
        return list(_unknown_sizes.get(operation, ()))
    except TypeError:  # not weakly referenceable: none recorded
        return []


def _explicit_none_segments(original):
    def segment(*args, **kwargs):
        if not _in_traced_idioms():
            return original(*args, **kwargs)
        try:
            given = inspect.signature(original).bind(*args, **kwargs).arguments
        except TypeError:  # Keras's own error follows
            given = {}
        result = original(*args, **kwargs)
        if "num_segments" in given and given["num_segments"] is None:
            node, _ = _compat.producing_node(result)
            if node is not None:
                _unknown_sizes[node.operation] = ("num_segments",)
        return result

    return segment


def _patch(owner, name, make):
    """Put `make(original)` in place of `owner.name`, to be undone by `_unpatch_all`."""
    original = getattr(owner, name, _NOT_SET)
    own = isinstance(owner, types.ModuleType) or name in vars(owner)
    replacement = make(original)
    _idioms_patches.append((owner, name, original, own))
    setattr(owner, name, replacement)


def _unpatch_all():
    while _idioms_patches:
        owner, name, original, own = _idioms_patches.pop()
        if own:
            setattr(owner, name, original)
        else:  # inherited, or none: the class is left as it was
            delattr(owner, name)


def _named_draw(kind):
    def make(original):
        draw = _intercepted_draw(original)
        draw.kind = kind
        return draw

    return make


@contextlib.contextmanager
def traced_idioms(record_draw=None):
    """Follow `ops.tile` with the batch size in its repeats, indexing
    with a bare None / Ellipsis / slice, `ops.ndim` (a Python int, as on
    a TensorFlow tensor) and NumPy values met by operators (converted as
    TensorFlow converts them) on symbolic tensors, on this thread,
    while the context lasts, and hand `keras.random` draws to
    `record_draw(distribution, arguments)` (see above). Other threads
    see Keras exactly as it is outside the context.

    Example:
        >>> with traced_idioms():
        ...     keras.KerasTensor((5, 8))[None].shape
        (1, 5, 8)
    """
    keras_objects = _compat.traced_idiom_targets()
    KerasTensor = keras_objects.keras_tensor  # noqa: N806 (a class)
    with _idioms_lock:
        if _idioms_users[0] == 0:
            try:
                _patch(keras_objects.variable, keras_objects.variable_initializer,
                       _initialize_without_recording)
                _patch(keras_objects.tile, "compute_output_spec", _tile_output_spec)
                _patch(KerasTensor, "__getitem__", _getitem)
                for name in _SCALAR_OPERATORS:
                    _patch(KerasTensor, name, _python_scalar_operator)
                # As tf.Tensor's: NumPy defers to the tensor's operators.
                _patch(KerasTensor, _ARRAY_PRIORITY,
                       lambda original: _OnTracingThreads(_ARRAY_PRIORITY, 100, original))
                _patch(keras_objects.ndim, "symbolic_call", _ndim_symbolic_call)
                for kind in _DRAWS:
                    _patch(keras_objects.random_backend, kind, _named_draw(kind))
                for operation, placeholders in _compat.tensor_size_attributes().items():
                    _patch(operation, "symbolic_call", _tensor_sized_call(placeholders))
                for module, name in _compat.segment_functions():
                    _patch(module, name, _explicit_none_segments)
                array, write, stack = _compat.eager_tensor_array_targets()
                _patch(array, write, lambda original: tensor_arrays.symbolic_write(
                    original, _in_traced_idioms))
                _patch(array, stack, lambda original: tensor_arrays.symbolic_stack(
                    original, _in_traced_idioms))
            except BaseException:
                _unpatch_all()  # Keras exactly as it was, not half-changed
                raise
        _idioms_users[0] += 1
    _idioms_state.depth = getattr(_idioms_state, "depth", 0) + 1
    recorders = _idioms_state.__dict__.setdefault("recorders", [])
    recorders.append(record_draw)
    try:
        yield
    finally:
        recorders.pop()
        _idioms_state.depth -= 1
        with _idioms_lock:
            _idioms_users[0] -= 1
            if _idioms_users[0] == 0:
                _unpatch_all()


__all__ = ["traced_idioms", "unknown_sizes"]
