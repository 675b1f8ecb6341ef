"""Verification's comparisons: one output or gradient of the converted
model against the original's (`compare_values`), and the NumPy forms the
runs are kept in (`as_numpy`, `gradient_numpy`, `SparseRows`).

Floats are compared within a tolerance scaled by the largest finite value,
which follows the dtype the models compute in (`Tolerance`, `tolerance_for`),
integers, booleans and strings exactly, dtypes and shapes exactly, and NaN
or Inf must stand where the original has them (see `verify.py`).

Example:
    >>> compare_values("output `logits`", expected, actual, tolerance_for(model), "converted")
    3.2e-07
"""

from dataclasses import dataclass
from dataclasses import replace

import keras
import numpy as np
import tensorflow as tf

from keras_ipu_plugin import _compat
from keras_ipu_plugin.errors import ConversionError


# -- tolerances ---------------------------------------------------------------------
@dataclass(frozen=True)
class Tolerance:
    """How far a float the converted model computes may be from the
    original's: `|actual - expected| <= atol * scale + rtol * |expected|`,
    `scale` the largest finite `|expected|` of the tensor (at least 1).

    Two graphs that compute the same function round differently wherever
    their ops are grouped differently (a function boundary, a graph
    optimiser's rewrite, a recomputed segment): the differences are a few
    units in the last place of the dtype the layers compute in. Under a
    mixed precision policy that is float16 (about 1e-3 relative) or
    bfloat16 (about 8e-3), eight to sixty-five thousand times float32's,
    while the variables and their gradients are float32: float32's
    tolerance refused equal graphs there. `dtype` is the least precise
    dtype the models compute in, `policy` the dtype policy of a layer
    computing in it (both for the message).

    Example:
        >>> tolerance_for(model)
        Tolerance(rtol=0.01, atol=0.01, dtype='float16', policy='mixed_float16')
    """

    rtol: float
    atol: float
    dtype: str = "float32"
    policy: object = None

    def for_values(self, dtype):
        """The tolerance for values of `dtype`: the looser of this one and
        that dtype's own (a float32 sum of a float64 model's losses is
        rounded to float32)."""
        own = TOLERANCES.get(_REAL_PARTS.get(np.dtype(dtype).name, np.dtype(dtype).name))
        if own is None or (own.rtol <= self.rtol and own.atol <= self.atol):
            return self
        return replace(self, rtol=max(own.rtol, self.rtol), atol=max(own.atol, self.atol),
                       dtype=own.dtype, policy=None)

    def describe(self):
        where = f"{self.dtype} computation"
        if self.policy is not None:
            where += f", dtype policy `{self.policy}`"
        return (f"allowed: {self.atol:g} x largest |value| + {self.rtol:g} x |value|, "
                f"the tolerance for {where}")


# By the dtype a model computes in. float32's are what verification has
# always used (about 80 and 800 units in the last place); float64's are
# five orders of magnitude tighter (still about 1e6 units in float64's last
# place, as a long sum's rounding needs), float16's and bfloat16's six to
# ten units in their last place: a pass that changes the math (a tanh for a
# sigmoid, an output 20% off) stays far outside them.
TOLERANCES = {
    "float64": Tolerance(rtol=1e-9, atol=1e-10, dtype="float64"),
    "float32": Tolerance(rtol=1e-4, atol=1e-5, dtype="float32"),
    "float16": Tolerance(rtol=1e-2, atol=1e-2, dtype="float16"),
    "bfloat16": Tolerance(rtol=5e-2, atol=5e-2, dtype="bfloat16"),
}


_REAL_PARTS = {"complex64": "float32", "complex128": "float64"}


def tolerance_for(*models):
    """The `Tolerance` for the least precise float dtype that any layer of
    `models` computes in (its dtype policy's compute dtype), float32's
    when none computes in floats.

    Example:
        >>> keras.config.set_dtype_policy("mixed_bfloat16")
        >>> tolerance_for(MyModel()).dtype
        'bfloat16'
    """
    least_precise = None
    for model in models:
        if not isinstance(model, keras.layers.Layer):
            continue
        for layer in _compat.all_layers(model):
            policy = getattr(layer, "dtype_policy", None)
            tolerance = TOLERANCES.get(getattr(policy, "compute_dtype", None))
            if tolerance is None:  # integers, strings: compared exactly anyway
                continue
            if least_precise is None or tolerance.rtol > least_precise.rtol:
                least_precise = replace(tolerance, policy=policy.name)
    return least_precise or TOLERANCES["float32"]


# -- comparing --------------------------------------------------------------------
def compare_values(label, expected, actual, tolerance, what):
    """The largest absolute difference between `actual` and `expected`;
    raise `ConversionError` when they differ (`tolerance`: a `Tolerance`)."""
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
    if not is_float_array(expected):
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
    tolerance = tolerance.for_values(expected.dtype)
    expected, actual = expected[finite].astype("float64"), actual[finite].astype("float64")
    difference = float(np.max(np.abs(actual - expected), initial=0.0))
    scale = max(float(np.max(np.abs(expected), initial=0.0)), 1.0)
    if not np.allclose(actual, expected, rtol=tolerance.rtol, atol=tolerance.atol * scale):
        raise ConversionError(
            f"{label} differs between the original and the {what} model "
            f"(max abs difference {difference:.3g}, largest |value| {scale:.3g}; "
            f"{tolerance.describe()})."
        )
    return difference


def is_float_array(array):
    """Whether NumPy `array` holds floats or complex numbers: bfloat16 too,
    an `ml_dtypes` type that NumPy files under kind "V" (once compared as
    if it were an integer, exactly, under `mixed_bfloat16`)."""
    if array.dtype.kind in "fc":
        return True
    try:
        return tf.as_dtype(array.dtype).is_floating
    except TypeError:  # strings, objects
        return False


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


def outputs_close(expected, actual, tolerance):
    for e, a in zip(keras.tree.flatten(expected), keras.tree.flatten(actual)):
        try:
            compare_values("", e, a, tolerance, "")
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
