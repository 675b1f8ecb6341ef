"""TensorFlow's internals:

- its dispatch, op callbacks, gradient recording and error tracebacks;
- its stateful random draws and global random state: the ops a recorder
  takes the place of, and the state put back after runs that drew
  (`frontend/verify/runs.py`'s `taped_stateful_draws` is the recorder);
- `tf.data` pipelines: whether one is batched, its strategy;
- the Keras and TensorFlow objects the trace-time idioms wrap
  (`frontend/idioms.py`): the wrappers are tracing behaviour and live with
  the tracer; only reaching the objects is access.

Part of `_compat`, the one package that touches private Keras / TensorFlow
APIs (see its `__init__`).
"""

import contextlib
import functools
import importlib
import inspect
import re
import sys
import types


# TensorFlow's type-based dispatch (`tf.experimental.dispatch_for_api`, public)
# consults its targets only for argument types registered as dispatchable,
# which only TensorFlow's internal API can do; and its lists of elementwise
# functions are private. Registering KerasTensor changes nothing by itself:
# with no target that accepts a call, TensorFlow goes on as before.


def make_dispatchable(cls):
    """Let TensorFlow's dispatch targets see arguments of type `cls`."""
    from tensorflow.python.util import dispatch

    dispatch.register_dispatchable_type(cls)


def add_fallback_dispatch(function, target):
    """Call `target(args, kwargs)` when `function` fails on its arguments
    (TensorFlow's first dispatch system, for functions its type-based one
    does not cover: `tf.einsum(equation, *inputs)` has var-positional
    inputs, which `tf.experimental.dispatch_for_api` refuses). `target`
    returns NotImplemented to let the function's own error through. Only
    `tf.__internal__` exports the dispatcher class."""
    from tensorflow.python.util import dispatch

    class _Fallback(dispatch.OpDispatcher):
        def handle(self, args, kwargs):
            result = target(args, kwargs)
            return self.NOT_SUPPORTED if result is NotImplemented else result

    _Fallback().register(function)


def tf_elementwise_functions():
    """`(unary, binary)`: TensorFlow's elementwise functions, as it lists
    them for `tf.experimental.dispatch_for_*_elementwise_apis`."""
    from tensorflow.python.util import dispatch

    return tuple(dispatch._UNARY_ELEMENTWISE_APIS), tuple(dispatch._BINARY_ELEMENTWISE_APIS)


def stop_gradient_recording():
    """A context in which no gradient tape records (TensorFlow's own
    `tf.recompute_grad` runs its forward pass so: the tape then keeps none
    of the segment's activations)."""
    from tensorflow.python.eager import record

    return record.stop_recording()


@contextlib.contextmanager
def op_callback(callback):
    """Within: `callback(op_type, inputs, attrs, outputs, op_name=None,
    graph=None)` is called after every TensorFlow op this thread runs
    eagerly (and every op it adds to a graph, with `graph` set).

    Why private: nothing public observes a variable being written
    (`tf.Variable.assign` and Keras's `Variable.assign` have no hook, and
    patching them would reach every thread). TensorFlow keeps op callbacks
    in its eager context's thread-local data, so other threads run as before.
    """
    from tensorflow.python.framework import op_callbacks

    op_callbacks.add_op_callback(callback)
    try:
        yield
    finally:
        op_callbacks.remove_op_callback(callback)


# TensorFlow filters its own frames out of the tracebacks of its errors
# (`traceback_utils.filter_traceback`); the frame of its filter stays, and
# holds the function it called (`fn`), TensorFlow's dispatch handler, whose
# target is a variable of its closure (`dispatch_target`). No public API
# says which function an error came from.
_TF_RANDOM_MODULES = re.compile(r"tensorflow[/\\.]python[/\\.]ops[/\\.]"
                                r"(stateless_|stateful_)?random_ops(\.py)?$")


def raised_in_tf_random_function(error):
    """Whether `error` was raised inside one of TensorFlow's random
    functions (`tf.random.normal(shape=(batch, dim))` on symbolic sizes)."""
    tb = error.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        called = frame.f_locals.get("fn") if frame.f_code.co_name == "error_handler" else None
        module = _module_called(called) if callable(called) else ""
        if _TF_RANDOM_MODULES.search(frame.f_code.co_filename) or _TF_RANDOM_MODULES.search(module):
            return True
        tb = tb.tb_next
    return False


def _module_called(function):
    try:
        function = inspect.unwrap(function)
        target = inspect.getclosurevars(function).nonlocals.get("dispatch_target")
    except (ValueError, TypeError):
        return ""
    return getattr(target if callable(target) else function, "__module__", None) or ""


# `tf.random.normal(shape)` with no seed generator (a VAE's sampling layer
# written with TensorFlow) draws from a stateful kernel: two runs of the same
# model see other numbers, and no public API replays them. TensorFlow's
# public functions call its generated ops by module attribute (`random_ops`
# calls `gen_random_ops.random_standard_normal`, `tf.random.Generator`
# calls `gen_stateful_random_ops.stateful_standard_normal_v2`), so putting a
# recorder in their place covers every public spelling. On other threads, in
# graph mode and outside the context they draw as they always do; Keras's
# own `keras.random` uses stateless ops, untouched.
_STATEFUL_DRAW_OPS = {
    "tensorflow.python.ops.gen_random_ops": (
        "random_standard_normal", "random_uniform", "random_uniform_int", "truncated_normal",
        "parameterized_truncated_normal", "random_gamma", "random_poisson_v2", "multinomial",
        "random_shuffle"),
    "tensorflow.python.ops.gen_stateful_random_ops": (
        "stateful_standard_normal_v2", "stateful_uniform", "stateful_uniform_int",
        "stateful_uniform_full_int", "stateful_truncated_normal", "stateful_random_binomial"),
}


def swap_stateful_draw_ops(wrap):
    """Put `wrap(name, original)` in place of each of TensorFlow's stateful
    random draw ops, where its public functions call them; returns
    `[(module, name, original)]` for `restore_stateful_draw_ops`."""
    swapped = []
    for module_name, names in _STATEFUL_DRAW_OPS.items():
        module = importlib.import_module(module_name)
        for name in names:
            original = getattr(module, name, None)
            if original is not None:
                swapped.append((module, name, original))
                setattr(module, name, wrap(name, original))
    return swapped


def restore_stateful_draw_ops(swapped):
    """Put back what `swap_stateful_draw_ops` replaced (emptying `swapped`)."""
    while swapped:
        module, name, original = swapped.pop()
        setattr(module, name, original)


def global_random_state():
    """TensorFlow's global random state, for `put_back_global_random_state`."""
    from tensorflow.python.eager import context
    from tensorflow.python.ops import stateful_random_ops

    rng = getattr(context.context(), "_rng", None)
    generator = stateful_random_ops.global_generator  # None until first asked for
    return (rng, rng.getstate() if rng is not None else None,
            generator, None if generator is None else generator.state.numpy())


def put_back_global_random_state(saved, drew):
    """The op-seed sequence and the global generator as they were; where a
    kernel drew, TensorFlow's kernels are reset too (as `tf.random.set_seed`
    resets them): the op seeds handed out again would otherwise find the
    kernels the taped runs advanced, and draw other numbers than without
    those runs. (A kernel with an explicit op seed that drew before the
    context then restarts its sequence, as after `tf.random.set_seed`.)"""
    from tensorflow.python.eager import context

    rng, rng_state, generator, generator_state = saved
    if rng is not None:
        rng.setstate(rng_state)
    if generator is not None:
        generator.state.assign(generator_state)
    if drew:
        context.context().clear_kernel_cache()


_BATCHING_DATASETS = (
    "_BatchDataset",
    "_ParallelBatchDataset",
    "_PaddedBatchDataset",
    "_RebatchDataset",
    "_LegacyRebatchDataset",
    "_DenseToRaggedDataset",
    "_DenseToSparseBatchDataset",
    "_BucketBySequenceLengthDataset",
    "_UnbatchDataset",
)


def dataset_is_batched(dataset):
    """True / False when the pipeline shows it, None when it cannot tell.

    Walks the chain of input datasets: a batching stage means batched; a chain
    rooted at `from_tensor_slices` with no batching stage means unbatched.
    """
    current = dataset
    while current is not None:
        name = type(current).__name__
        if name == "_UnbatchDataset":
            return False
        if name in _BATCHING_DATASETS:
            return True
        if name == "_TensorSliceDataset":
            return False
        try:
            inputs = current._inputs()
        except Exception:  # pragma: no cover - unknown dataset kinds
            return None
        current = inputs[0] if inputs else None
    return None


def dataset_strategy(dataset):
    """The strategy a distributed dataset was made by, or None."""
    return getattr(dataset, "_strategy", None)


def stateful_op_names(graph_def):
    """The names of the stateful ops (by TensorFlow's op registry) among
    the nodes of `graph_def` and of the functions of its library: a
    serialized `tf.data` pipeline's, to see what reading it may change.

    Example:
        ```python
        stateful_op_names(graph_of(dataset.map(lambda x: x + gen.normal(()))))
        # -> {'RngReadAndSkip', 'AssignVariableOp', 'VarHandleOp', 'RangeDataset', ...}
        ```
    """
    from tensorflow.python.framework import op_def_registry

    nodes = [*graph_def.node, *(node for function in graph_def.library.function
                                for node in function.node_def)]
    return {node.op for node in nodes
            if getattr(op_def_registry.get(node.op), "is_stateful", False)}


# The patches themselves (what each wrapper does, thread-confined) are tracing
# behaviour and live with the tracer; only reaching the objects is access.


def traced_idiom_targets():
    """The Keras objects `frontend/idioms.py` wraps while a trace runs:
    `variable` (the backend's Variable class) and `variable_initializer` (the
    name of its private method that draws the initial value), `tile` and
    `ndim` (the `ops.tile` / `ops.ndim` operation classes), `keras_tensor`,
    and `random_backend` (the module `keras.random` draws call into)."""
    from keras.src import backend
    from keras.src.backend.common.keras_tensor import KerasTensor
    from keras.src.ops.numpy import Ndim
    from keras.src.ops.numpy import Tile
    from keras.src.random import random

    return types.SimpleNamespace(
        variable=backend.Variable, variable_initializer="_initialize_with_initializer",
        tile=Tile, ndim=Ndim, keras_tensor=KerasTensor,
        random_backend=random.backend.random)


def eager_tensor_array_targets():
    """`(class, write, stack)`: TensorFlow's eager `TensorArray` implementation
    (what `tf.TensorArray` is while a trace runs `call` eagerly) and the names
    of the methods `frontend/idioms.py` wraps (`frontend/idioms.py`)."""
    from tensorflow.python.ops import tensor_array_ops

    return tensor_array_ops._EagerTensorArray, "_write", "stack"


def tensor_array_state(array):
    """`(items, dtype, dynamic_size, infer_shape, element_shape)` of an eager
    TensorArray implementation: `items` is its own list of elements (None
    where unwritten), to change in place."""
    return (array._tensor_array, array._dtype, array._dynamic_size, array._infer_shape,
            array._element_shape)


def set_tensor_array_element_shape(array, shape):
    array._element_shape = shape


def tensor_array_zeros(array, index):
    """TensorFlow's zeros for an unwritten element (kept in the array, as its
    `stack` keeps them)."""
    return array._maybe_zero(index)


def tensor_size_attributes():
    """`{keras.ops operation class: {attribute: placeholder}}`: the operations
    whose size (or weights) a traced call may give as a graph tensor, where
    Keras takes a Python value (`ops.segment_sum(..., num_segments=tensor)`,
    `ops.repeat(x, tensor)`), with the value each attribute holds in a saved
    `layers.tensor_sized.TensorSizedOperation` (the tensor fills it when the
    graph runs). TensorFlow's functions under them take a tensor there.
    Also what `frontend/idioms.py` wraps the `symbolic_call` of."""
    from keras.src.ops.math import SegmentMax
    from keras.src.ops.math import SegmentSum
    from keras.src.ops.math import TopK
    from keras.src.ops.nn import MultiHot
    from keras.src.ops.nn import OneHot
    from keras.src.ops.numpy import Bincount
    from keras.src.ops.numpy import Repeat

    return {
        SegmentSum: {"num_segments": None}, SegmentMax: {"num_segments": None},
        Repeat: {"repeats": None}, OneHot: {"num_classes": None},
        MultiHot: {"num_classes": 1}, Bincount: {"weights": None, "minlength": 0},
        TopK: {"k": None},
    }


@functools.lru_cache(maxsize=None)
def segment_functions():
    """`[(module, name)]` where `keras.ops.segment_sum` / `segment_max` are
    reachable as module attributes (`keras.ops`, `keras.ops.math`, Keras's
    own `keras.src.ops.math`): `frontend/idioms.py` wraps them to
    see a `num_segments` given explicitly as None (an unknown dimension,
    `ops.shape(x)[0]` while tracing)."""
    from keras.src.ops import math as keras_math

    found = []  # (a tuple: cached)
    for name in ("segment_sum", "segment_max"):
        function = getattr(keras_math, name)
        for module in list(sys.modules.values()):
            module_name = getattr(module, "__name__", "") or ""
            if module_name.startswith("keras") and isinstance(module, types.ModuleType) \
                    and getattr(module, "__dict__", {}).get(name) is function:
                found.append((module, name))
    return tuple(found)
