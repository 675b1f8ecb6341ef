"""Symbolic idioms Keras rejects, followed while a trace runs: trace-time patches
(`ops.tile` of the batch size, `tf.TensorArray` writes, ...) and TensorFlow
functions called on symbolic tensors. One concept: the idioms of a trace.

Symbolic idioms Keras rejects, followed while a trace runs (trace-time patches).

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
`keras.ops.stack` (`symbolic_write`, `symbolic_stack` below).
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
    ```python
    with traced_idioms():
        keras.KerasTensor((5, 8))[None].shape
    # -> (1, 5, 8)
    ```

`tf.TensorArray` written with symbolic tensors while a trace runs.

keras_hub's RWKV-7 time mix (`rnn_generalized_delta_rule`, TensorFlow
backend) collects a Python loop's outputs in a `tf.TensorArray` and stacks
them:

    out = tf.TensorArray(dtype, size=T)
    for t in range(T):
        out = out.write(t, step(t))
    out = out.stack()

Run eagerly, as a trace runs `call`, the array is TensorFlow's eager one:
a Python list of tensors, `stack()` one `tf.stack` of it. A symbolic
tensor cannot be converted into that list ("A KerasTensor cannot be used
as input to a TensorFlow function"), so the layer stayed whole. On the
tracing thread only, `traced_idioms` wraps the eager array's `write` and
`stack`: a symbolic value is kept in the list as it is, with TensorFlow's
own checks (index in range, or the array resizable; one dtype; shapes
compatible, merged as `infer_shape` says), and `stack()` of a list holding
one is `keras.ops.stack` of it, recorded in the graph: the loop, unrolled
over its static length, is its steps' graph operations and one stack, and
computes exactly what `tf.stack` of the eager list computes. Reading an
element back (`read`), `size()`, and `gather` / `concat` / `unstack` /
`scatter` (TensorFlow's `tf.stack` / `tf.concat` / `tf.unstack` on the
list, recorded as `TFFunction`s) follow from the list. What cannot be
followed raises, saying what to write, and the layer stays whole: a write
at an index computed in the graph, and `stack()` with an element never
written whose shape is not known while tracing (TensorFlow stacks zeros
there; the trace at batch size 1 then follows them as zeros of the batch).

Example:
    ```python
    with traced_idioms():    # inside a trace
        out = tf.TensorArray("float32", size=2).write(0, a).write(1, b).stack()
    out.shape                # a KerasTensor, keras.ops.stack([a, b])
    # -> (2, None, 4)
    ```

TensorFlow functions called on symbolic tensors while tracing.

A layer written for Keras 2 calls TensorFlow directly: `tf.square(a - b)`,
`tf.nn.relu(x)`, `tf.reduce_sum(x, axis=-1)`, `tf.reshape(x, [tf.shape(x)[0],
-1])`. On Keras 3's symbolic tensors these raise ("A KerasTensor cannot be
used as input to a TensorFlow function"), so such a layer used to stay one
opaque node. While a trace runs, on the tracing thread, `recorded()` makes
each such call a `TFFunction` graph operation instead (`layers/
tf_calls.py`), through TensorFlow's public dispatch for custom types
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

See `recorded` for an example.
"""

import contextlib
import copy
import inspect
import operator
import threading
import types
import typing
import weakref

import keras
import numpy as np
import tensorflow as tf

from keras_ipu_plugin import _compat
from keras_ipu_plugin.layers.tf_calls import (
    TFFunction,
    public_name_of,
    ELEMENTWISE,
    RANDOM_DRAWS,
    TENSOR_PARAMETERS,
    draw_function_at,
    function_at,
    TFRandomDraw,
)

__all__ = [
    "traced_idioms",
    "unknown_sizes",
    "symbolic_write",
    "symbolic_stack",
    "WRITE_INSTEAD",
    "recorded",
]


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
        ```python
        with traced_idioms():
            keras.KerasTensor((5, 8))[None].shape
        # -> (1, 5, 8)
        ```
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
                _patch(array, write, lambda original: symbolic_write(
                    original, _in_traced_idioms))
                _patch(array, stack, lambda original: symbolic_stack(
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


# Said where a `tf.TensorArray` of symbolic tensors cannot be followed.
WRITE_INSTEAD = "collect the values in a Python list and `ops.stack` them for the layer to expand"


def _is_symbolic(value):
    return isinstance(value, keras.KerasTensor)


def symbolic_write(original, active):
    """The eager array's `_write(self, index, value)`, keeping a symbolic
    `value` in its list while `active()` (see the module docstring)."""

    def write(self, index, value):
        if not (active() and _is_symbolic(value)):
            return original(self, index, value)
        index = _static_index(index)
        items, dtype, dynamic_size, infer_shape, element_shape = _compat.tensor_array_state(self)
        if index < 0:
            raise tf.errors.OutOfRangeError(
                None, None, f"Writing to negative indices (index {index}) is not allowed.")
        if index >= len(items):
            if not dynamic_size:
                raise tf.errors.OutOfRangeError(
                    None, None, f"Tried to write to index {index} but array is not "
                    f"resizeable and size is: {len(items)} ")
            items.extend(None for _ in range(index - len(items) + 1))
        if tf.as_dtype(value.dtype) != dtype:
            raise tf.errors.InvalidArgumentError(
                None, None, f"TensorArray dtype is {dtype.name} but Op is trying to "
                f"write dtype {tf.as_dtype(value.dtype).name} ")
        shape = tf.TensorShape(value.shape)
        if not element_shape.is_compatible_with(shape):
            raise ValueError(f"Incompatible shape for value ({shape}), expected "
                             f"({element_shape})")
        if infer_shape:
            _compat.set_tensor_array_element_shape(self, element_shape.merge_with(shape))
        items[index] = value

    return write


def symbolic_stack(original, active):
    """The eager array's `stack(self, name=None)`: `keras.ops.stack` of its
    list where it holds a symbolic tensor while `active()`."""

    def stack(self, name=None):
        items, _, _, _, element_shape = _compat.tensor_array_state(self)
        if not (active() and any(_is_symbolic(item) for item in items)):
            return original(self, name=name)
        unwritten = [index for index, item in enumerate(items) if item is None]
        if unwritten and not element_shape.is_fully_defined():
            raise ValueError(
                f"`tf.TensorArray.stack()` of an array whose elements {unwritten} were never "
                f"written (TensorFlow stacks zeros there) and whose element shape "
                f"{element_shape} is not fully known while tracing; write every "
                f"element, or {WRITE_INSTEAD}")
        for index in unwritten:
            _compat.tensor_array_zeros(self, index)
        return keras.ops.stack(list(items), axis=0)

    return stack


def _static_index(index):
    """A Python int (or a concrete scalar tensor, as TensorFlow's eager array
    takes); an index computed in the graph cannot say where the value goes."""
    if _is_symbolic(index):
        raise TypeError(
            "`tf.TensorArray.write` at an index computed in the graph: only a Python int "
            f"index (a loop over `range(n)`) is followed while tracing; {WRITE_INSTEAD}")
    if tf.is_tensor(index):
        index = index.numpy()
    return operator.index(index)


_LIST_PARAMETER = "*"

_state = threading.local()
_registration_lock = threading.Lock()
_registered = []


@contextlib.contextmanager
def recorded(batch_anchor=None):
    """Record the TensorFlow functions called on symbolic tensors on this
    thread as graph operations while the context lasts. `batch_anchor()`:
    the graph tensor whose batch size a None in a random draw's shape is
    (`tf.random.normal(ops.shape(x))` while the batch is unknown), or None.

    Example:
        >>> with recorded():
        ...     y = tf.square(keras.KerasTensor((None, 4)))
        >>> type(y).__name__, y.shape
        ('KerasTensor', (None, 4))
    """
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
