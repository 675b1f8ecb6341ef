"""Output specs as precise as the inputs allow (spec precision).

Keras's own output specs leave a dimension unknown where a layer's formula
cannot tell it (`EinsumDense(output_shape=(None, heads, dim))` leaves the
sequence length out) and call a product sparse where one factor is not a
Keras tensor. Later code in a traced `call` reads these shapes
(`ops.arange(ops.shape(x)[1])`), and a None there would be taken for the
batch size: `precise_specs` asks TensorFlow's shape inference instead, and
`dense_unless_given_sparse` keeps a spec dense that no sparse argument made.

Example:
    >>> precise_specs(einsum_dense, (x,), {}, recorded)   # (None, 7, 4, 8), not (None, None, 4, 8)
"""

import keras
import tensorflow as tf

from keras_ipu_plugin import _compat
from keras_ipu_plugin.layers.state.reads import is_read


def states_own_output_shape(cls):
    """Whether `cls` defines its output shape for the `call` it has: a
    `compute_output_spec` / `compute_output_shape` of its own, not only one
    inherited from a class whose `call` it overrides. (keras_hub's
    `CachedMultiHeadAttention` adds `cache` to `MultiHeadAttention.call`,
    whose `compute_output_spec` knows no `cache` argument.)"""
    def owner(name):
        return next(klass for klass in cls.__mro__ if name in vars(klass))

    call_owner = owner("call")
    for name in ("compute_output_spec", "compute_output_shape"):
        spec_owner = owner(name)
        if spec_owner in (keras.layers.Layer, _compat.Operation):
            continue
        if issubclass(spec_owner, call_owner):
            return True
    return False


def precise_specs(operation, args, kwargs, outputs):
    """The output specs of a layer's call: as recorded, or, where Keras
    left a dimension other than the batch unknown although the inputs
    know theirs (`EinsumDense(output_shape=(None, heads, dim))` leaves the
    sequence length out), as TensorFlow's shape inference on the layer's
    `call` works them out. Later traces of the graph start from these
    shapes, and code such as `ops.arange(ops.shape(x)[1])` needs them."""
    if not isinstance(operation, keras.layers.Layer) or is_read(operation) or all(
        None not in tuple(t.shape)[1:] for t in outputs
    ):
        return outputs
    inputs = [leaf for leaf in keras.tree.flatten((args, kwargs))
              if isinstance(leaf, keras.KerasTensor)]
    if any(None in tuple(t.shape)[1:] for t in inputs):
        return outputs
    try:  # `call` run on symbolic TensorFlow tensors, not the layer's formula
        inferred = [t for t in keras.tree.flatten(
            _compat.Operation.compute_output_spec(operation, *args, **kwargs)
        ) if t is not None]
    except Exception:  # the recorded shapes are right, only less precise
        return outputs
    if len(inferred) != len(outputs):
        return outputs
    precise = []
    for recorded, better in zip(outputs, inferred):
        shape, known = tuple(recorded.shape), tuple(better.shape)
        if len(shape) != len(known) or any(
            a is not None and a != b for a, b in zip(shape[1:], known[1:])
        ):
            return outputs
        precise.append(keras.KerasTensor(
            shape[:1] + known[1:], dtype=recorded.dtype, sparse=recorded.sparse))
    return precise


def dense_unless_given_sparse(specs, structure):
    """`specs` with `sparse=False` where no argument is sparse. Keras's
    `ops.multiply` calls its output sparse when either argument is not a
    tensor of its own (`x * ops.cast(scale, x.dtype)` in keras_hub's Gemma
    embedding); a layer later rebuilt on such a spec is traced on a
    SparseTensor and fails (or computes sparse). `structure`: the
    arguments, a KerasTensor given as the spec recorded for it."""
    if not any(spec.sparse for spec in specs) or any(
        getattr(leaf, "sparse", False) is True or isinstance(leaf, tf.SparseTensor)
        for leaf in keras.tree.flatten(structure)
    ):
        return specs
    return [
        keras.KerasTensor(spec.shape, dtype=spec.dtype, ragged=spec.ragged) if spec.sparse else spec
        for spec in specs
    ]
