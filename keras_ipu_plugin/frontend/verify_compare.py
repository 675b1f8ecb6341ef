"""Verification's comparisons: one output or gradient of the converted
model against the original's (`compare_values`), and the NumPy forms the
runs are kept in (`as_numpy`, `gradient_numpy`, `SparseRows`).

Floats are compared within a tolerance scaled by the largest finite value,
integers, booleans and strings exactly, dtypes and shapes exactly, and NaN
or Inf must stand where the original has them (see `verify.py`).

Example:
    >>> compare_values("output `logits`", expected, actual, 1e-4, 1e-5, "converted")
    3.2e-07
"""

from dataclasses import dataclass

import keras
import numpy as np
import tensorflow as tf

from keras_ipu_plugin.errors import ConversionError


# -- comparing --------------------------------------------------------------------
def compare_values(label, expected, actual, rtol, atol, what):
    """The largest absolute difference between `actual` and `expected`;
    raise `ConversionError` when they differ."""
    if expected.shape != actual.shape:
        raise ConversionError(
            f"{label} has shape {actual.shape} in the {what} model and "
            f"{expected.shape} in the original."
        )
    # The dtype itself, not only its kind: a graph computing in float64
    # where the original computed in float32 (`x * np.float64(p)`, which
    # Keras promotes and TensorFlow does not) agrees to float32 precision,
    # and would silently hand float64 tensors to whatever comes next.
    if expected.dtype != actual.dtype:
        raise ConversionError(
            f"{label} has dtype {actual.dtype} in the {what} model and "
            f"{expected.dtype} in the original."
        )
    if expected.dtype.kind not in "fc":
        if not np.array_equal(actual, expected):
            raise ConversionError(
                f"{label} differs between the original and the {what} model "
                f"({_count_differing(actual, expected)} elements differ)."
            )
        return 0.0
    expected, actual = _real_view(expected), _real_view(actual)
    finite = np.isfinite(expected)
    for test, name in ((np.isnan, "NaN"), (np.isposinf, "+Inf"), (np.isneginf, "-Inf")):
        where_expected, where_actual = test(expected), test(actual)
        if not np.array_equal(where_expected, where_actual):
            count = int(np.sum(where_expected != where_actual))
            raise ConversionError(
                f"{label} differs between the original and the {what} model: "
                f"{count} element(s) are {name} in one and not in the other."
            )
    if not finite.any() and expected.size:
        raise ConversionError(
            f"Cannot verify {label}: it is NaN or Inf everywhere in the original "
            f"on the verified rows, so no difference can show. Check the model "
            "(or pass verify=False)."
        )
    expected, actual = expected[finite].astype("float64"), actual[finite].astype("float64")
    difference = float(np.max(np.abs(actual - expected), initial=0.0))
    scale = max(float(np.max(np.abs(expected), initial=0.0)), 1.0)
    if not np.allclose(actual, expected, rtol=rtol, atol=atol * scale):
        raise ConversionError(
            f"{label} differs between the original and the {what} model "
            f"(max abs difference {difference:.3g}, largest |value| {scale:.3g})."
        )
    return difference


# The spacing of floats near 1 (machine epsilon) of the half-precision dtypes.
_HALF_EPSILON = {tf.float16: 2.0 ** -10, tf.bfloat16: 2.0 ** -7}


def dtype_tolerances(dtype, rtol, atol):
    """`(rtol, atol)` for values of `dtype`: at least 8 units of its
    precision for float16 and bfloat16 (a statistic computed in them cannot
    agree to float32's 1e-4), else as given.

    Example:
        >>> dtype_tolerances("bfloat16", 1e-4, 1e-5)
        (0.0625, 0.0625)
    """
    try:
        epsilon = _HALF_EPSILON.get(tf.as_dtype(dtype))
    except TypeError:
        epsilon = None
    if epsilon is None:
        return rtol, atol
    return max(rtol, 8 * epsilon), max(atol, 8 * epsilon)


def _real_view(array):
    """A complex array as its real and imaginary parts (the NaN / Inf
    tests are for reals)."""
    if array.dtype.kind == "c":
        return np.stack([array.real, array.imag], axis=-1)
    return array


def _count_differing(actual, expected):
    try:
        return int(np.sum(actual != expected))
    except (TypeError, ValueError):  # pragma: no cover - exotic dtypes
        return "some"


def outputs_close(expected, actual, rtol, atol):
    for e, a in zip(keras.tree.flatten(expected), keras.tree.flatten(actual)):
        try:
            compare_values("", e, a, rtol, atol, "")
        except ConversionError:
            return False
    return True


def comparable(expected, actual):
    """Both as arrays of the same layout: the touched rows when both are
    sparse on the same rows, else dense."""
    if isinstance(expected, SparseRows) and isinstance(actual, SparseRows) and np.array_equal(
            expected.indices, actual.indices):
        return expected.values, actual.values
    as_array = lambda g: g.dense() if isinstance(g, SparseRows) else g  # noqa: E731
    return as_array(expected), as_array(actual)


@dataclass
class SparseRows:
    """A sparse gradient (an embedding's) as the rows it touches, summed
    per row: a few rows of the batch touch a few rows of the table, and a
    dense copy of a large vocabulary's gradient would cost more memory than
    the training step it stands in for."""

    indices: np.ndarray
    values: np.ndarray
    dense_shape: tuple

    def dense(self):
        array = np.zeros(self.dense_shape, self.values.dtype)
        array[self.indices] = self.values
        return array


def gradient_numpy(gradient):
    if not isinstance(gradient, tf.IndexedSlices):
        return as_numpy(gradient)
    indices, positions = np.unique(np.asarray(gradient.indices), return_inverse=True)
    values = np.zeros((len(indices),) + tuple(gradient.values.shape[1:]),
                      gradient.values.dtype.as_numpy_dtype)
    np.add.at(values, positions, np.asarray(gradient.values))
    return SparseRows(indices, values, tuple(int(d) for d in gradient.dense_shape))


def as_numpy(value):
    return None if value is None else np.asarray(value)


# -- small helpers ------------------------------------------------------------------
def as_tensor(leaf):
    if leaf is None or isinstance(leaf, (tf.Tensor, tf.RaggedTensor, tf.SparseTensor)):
        return leaf
    return tf.convert_to_tensor(leaf)


def some(indices, limit=6):
    shown = ", ".join(str(int(i)) for i in indices[:limit])
    return shown + (f" and {len(indices) - limit} more" if len(indices) > limit else "")


def path_name(path, default):
    return ".".join(str(p) for p in path) or default


def variable_name(variable):
    return getattr(variable, "path", None) or variable.name


def values_of(leaf):
    return getattr(leaf, "flat_values", getattr(leaf, "values", leaf))


def is_inexact(dtype):
    dtype = tf.as_dtype(dtype)
    return dtype.is_floating or dtype.is_complex
