"""The Keras and TensorFlow objects the trace-time idioms wrap (`frontend/idioms/traced_idioms.py`): the wrappers are tracing behaviour and live with the tracer; only reaching the objects is access.

Part of `_compat`, the one package that touches private Keras / TensorFlow
APIs (see its `__init__`)."""

import functools
import sys
import types


# The patches themselves (what each wrapper does, thread-confined) are tracing
# behaviour and live with the tracer; only reaching the objects is access.


def traced_idiom_targets():
    """The Keras objects `frontend/idioms/traced_idioms.py` wraps while a trace runs:
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
    of the methods `frontend/idioms/traced_idioms.py` wraps (`frontend/idioms/tensor_arrays.py`)."""
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
    Also what `frontend/idioms/traced_idioms.py` wraps the `symbolic_call` of."""
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
    own `keras.src.ops.math`): `frontend/idioms/traced_idioms.py` wraps them to
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
