"""`tf.TensorArray` written with symbolic tensors while a trace runs.

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
    >>> with traced_idioms():    # inside a trace
    ...     out = tf.TensorArray("float32", size=2).write(0, a).write(1, b).stack()
    >>> out.shape                # a KerasTensor, keras.ops.stack([a, b])
    (2, None, 4)
"""

import operator

import keras
import tensorflow as tf

from keras_ipu_plugin import _compat

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


__all__ = ["symbolic_write", "symbolic_stack", "WRITE_INSTEAD"]
