"""What verification compares (values, within a tolerance) and on which rows of
the batch.

Verification's comparisons: one output or gradient of the converted
model against the original's (`compare_values`), and the NumPy forms the
runs are kept in (`as_numpy`, `gradient_numpy`, `SparseRows`).

Floats are compared within a tolerance scaled by the largest finite value,
which follows the dtype the models compute in (`Tolerance`, `tolerance_for`),
integers, booleans and strings exactly, dtypes and shapes exactly, and NaN
or Inf must stand where the original has them (see `equivalence.py`).

Example:
    ```python
    compare_values("output `logits`", expected, actual, tolerance_for(model), "converted")
    # -> 3.2e-07
    ```

Which rows of the batch verification runs on (see `equivalence.py`, "Cost").

`reference_run` leaves out the rows whose inputs, or whose outputs in the
original, hold NaN or Inf, refuses a batch that leaves none, and narrows
the rest to a few rows spread over the batch (1/8 of it, at least
`MIN_ROWS`) where the original's outputs on them equal its outputs for the
same rows of a larger probe: a model that mixes rows, or has a fixed batch
size, is verified on the whole batch.

Example:
    ```python
    reference, x_rows = reference_run(run, model, x, variables, None, verification,
                                      None, tolerance=tolerance_for(model))
    ```
"""

from dataclasses import dataclass, replace

import keras
import numpy as np
import tensorflow as tf

from keras_ipu_plugin import _compat
from keras_ipu_plugin.errors import ConversionError, InputDataError


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
        ```python
        tolerance_for(model)
        # -> Tolerance(rtol=0.01, atol=0.01, dtype='float16', policy='mixed_float16')
        ```
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
        ```python
        keras.config.set_dtype_policy("mixed_bfloat16")
        tolerance_for(MyModel()).dtype
        # -> 'bfloat16'
        ```
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


# The share of the batch verified, and the fewest rows: two rows at least,
# so that a converted graph that mixes rows cannot pass.
ROWS_FRACTION = 8


MIN_ROWS = 2


# How many times the verified rows the probe that shows they are computed as
# in the whole batch holds (see `_narrowed_reference_run`).
PROBE_FACTOR = 2


# -- choosing the rows ------------------------------------------------------------
def reference_run(run, original, x, variables, rows, verification, fixed, *, tolerance):
    """Run the original with gradients on the rows to verify on: the batch
    without non-finite rows, narrowed to a few rows where that is the same
    computation. Returns the run and the rows' inputs."""
    total = verification.total_rows
    if total == 0:
        raise InputDataError(
            f"Cannot verify the {verification.what} model: the first batch has 0 "
            "rows, so no output can differ. Give a first batch with at least one "
            "row (or pass verify=False)."
        )
    x, kept = _finite_input_rows(x, total, fixed, verification.what)
    count = len(kept) if kept is not None else None
    if count is not None and count < total:
        verification.notes.append(
            f"rows {some(np.setdiff1d(np.arange(total), kept))} left out: "
            "their inputs hold NaN or Inf")
    wanted = _rows_wanted(rows, count)
    subset_allowed = count is not None and fixed is None
    if subset_allowed and wanted < count:
        narrowed = _narrowed_reference_run(run, original, x, variables, count, wanted,
                                           tolerance=tolerance)
        if not isinstance(narrowed, str):
            reference, picked = narrowed
            verification.rows = len(picked)
            return reference, _take(x, picked)
        verification.notes.append(f"{narrowed}: verified on the whole batch")
        # The whole batch forward only: to find the rows whose outputs are
        # finite, and what the sub-batch must reproduce.
        whole = run(original, x, [], role="original", tape=False)
        finite, culprit = _finite_output_rows(whole.outputs, count)
        if finite is not None:
            _refuse_all_nonfinite(finite, culprit, verification.what)
            candidates = np.flatnonzero(finite)
            if len(candidates) < count:
                verification.notes.append(_outputs_left_out(kept, finite, culprit))
                x, kept, count = _take(x, candidates), kept[candidates], len(candidates)
        del whole
    reference = run(original, x, variables, role="original")
    finite, culprit = _finite_output_rows(reference.outputs, count)
    if finite is None:
        finite, culprit = _finite_overall(reference.outputs)
    _refuse_all_nonfinite(finite, culprit, verification.what)
    if not finite.all():
        if not subset_allowed:
            raise InputDataError(
                f"Cannot verify the {verification.what} model: the original's output "
                f"`{culprit}` holds NaN or Inf, and the rows cannot be left out "
                f"({_why_whole(fixed)}). Check the data and the model, or pass "
                "verify=False."
            )
        x = _take(x, np.flatnonzero(finite))
        verification.notes.append(_outputs_left_out(kept, finite, culprit))
        reference = run(original, x, variables, role="original")
        finite, culprit = _finite_output_rows(reference.outputs, int(finite.sum()))
        if finite is None or not finite.all():
            raise InputDataError(
                f"Cannot verify the {verification.what} model: the original's output "
                f"`{culprit}` holds NaN or Inf on rows whose outputs were finite "
                "before the other rows were left out. Check the data and the model, "
                "or pass verify=False."
            )
    verification.rows = row_count(x) if count is not None else 0
    return reference, x


def _narrowed_reference_run(run, original, x, variables, count, wanted, *, tolerance):
    """The original's run with gradients on `wanted` rows of `x`, where that
    is the same computation as on the batch; else the reason it is not shown
    to be (a string).

    The rows are checked against a forward pass (no tape) over a probe of
    `PROBE_FACTOR` times as many rows that contains them: outputs for a row
    that depend on the other rows of the batch (statistics over the batch,
    attention across it) come out differently on the two, while the probe
    costs a fraction of a forward pass over the whole batch. A probe with a
    non-finite output row is not narrowed: the whole batch then tells which
    rows to leave out.

    An original that fails on fewer rows than the batch's (a batch size
    written as a constant in its code: `ops.reshape(x, (BATCH, -1, d))`) is
    verified on the whole batch too; only failing on the whole batch says
    that it fails on the batch.
    """
    mixed = ("the original's outputs for a row depend on the other rows, or some "
             "rows' outputs are not finite")
    failed = "the original fails on {} of the {} rows (is a batch size fixed in its code?)"
    probe_rows = _spread(np.arange(count), min(count, PROBE_FACTOR * wanted))
    try:
        probe = run(original, _take(x, probe_rows), [], role="original", tape=False)
    except InputDataError:
        return failed.format(len(probe_rows), count)
    finite, _ = _finite_output_rows(probe.outputs, len(probe_rows))
    if finite is None or not finite.all():
        return mixed
    chosen = _spread(np.arange(len(probe_rows)), wanted)
    picked = probe_rows[chosen]
    try:
        reference = run(original, _take(x, picked), variables, role="original")
    except InputDataError:
        return failed.format(len(picked), count)
    expected = keras.tree.map_structure(lambda o: o[chosen], probe.outputs)
    if not outputs_close(expected, reference.outputs, tolerance):
        return mixed
    return reference, picked


def _outputs_left_out(kept, finite, culprit):
    rows = kept[~finite] if kept is not None else np.flatnonzero(~finite)
    return (f"rows {some(rows)} left out: the original's output `{culprit}` "
            "holds NaN or Inf there")


def _rows_wanted(rows, count):
    if count is None or rows is None:
        return count
    if rows == "auto":
        return max(MIN_ROWS, count // ROWS_FRACTION)
    return int(rows)


def _spread(candidates, wanted):
    """`wanted` of `candidates`, spread from the first to the last."""
    if wanted >= len(candidates):
        return candidates
    positions = np.unique(np.linspace(0, len(candidates) - 1, wanted).round().astype(int))
    return candidates[positions]


def _finite_input_rows(x, total, fixed, what):
    """`x` without the rows that hold NaN or Inf, and the kept row indices
    (None when the inputs share no batch dimension)."""
    bad_rows = {}
    for path, leaf in keras.tree.flatten_with_path(x):
        if leaf is None or not is_inexact(leaf.dtype):
            continue
        name = path_name(path, "x")
        if total is None:
            if not bool(tf.reduce_all(tf.math.is_finite(values_of(leaf)))):
                raise InputDataError(
                    f"Cannot verify the {what} model: input `{name}` holds NaN or Inf "
                    "and its rows cannot be left out (the inputs share no batch "
                    "dimension). Give a finite first batch (or pass verify=False)."
                )
            continue
        finite = np.isfinite(leaf.numpy()).reshape(total, -1).all(axis=1)
        if not finite.all():
            bad_rows[name] = finite
    if total is None:
        return x, None
    if not bad_rows:
        return x, np.arange(total)
    kept = np.flatnonzero(np.logical_and.reduce(list(bad_rows.values())))
    if len(kept) == 0:
        whole = [name for name, finite in bad_rows.items() if not finite.any()]
        detail = (
            f"every row of input `{whole[0]}` contains NaN or Inf" if whole else
            "no row is finite in every input (" + ", ".join(
                f"`{name}` has NaN or Inf in rows {some(np.flatnonzero(~finite))}"
                for name, finite in bad_rows.items()) + ")"
        )
        raise InputDataError(
            f"Cannot verify the {what} model on the first batch: {detail}, so no "
            "row can show a difference. Give a first batch with finite rows (or "
            "pass verify=False)."
        )
    if fixed is not None:
        name = next(iter(bad_rows))
        raise InputDataError(
            f"Cannot verify the {what} model: rows "
            f"{some(np.flatnonzero(~bad_rows[name]))} of input `{name}` contain NaN "
            f"or Inf, and the model has a fixed batch size of {fixed}, so they "
            "cannot be left out. Give a finite first batch (or pass verify=False)."
        )
    return _take(x, kept), kept


def _finite_output_rows(outputs, count):
    """Per row, whether every float output is finite, and the first output
    that is not; (None, None) when the outputs are not per row."""
    if count is None:
        return None, None
    finite, culprit = np.ones(count, bool), None
    for path, leaf in keras.tree.flatten_with_path(outputs):
        if leaf is None:
            continue
        if leaf.ndim == 0 or leaf.shape[0] != count:
            return None, None
        if is_float_array(leaf):
            rows = np.isfinite(leaf).reshape(count, -1).all(axis=1)
            if culprit is None and not rows.all():
                culprit = path_name(path, "output")
            finite &= rows
    return finite, culprit


def _finite_overall(outputs):
    for path, leaf in keras.tree.flatten_with_path(outputs):
        if leaf is not None and is_float_array(leaf) and not np.isfinite(leaf).all():
            return np.zeros(1, bool), path_name(path, "output")
    return np.ones(1, bool), None


def _refuse_all_nonfinite(finite, culprit, what):
    if finite.any():
        return
    raise InputDataError(
        f"Cannot verify the {what} model: the original's output `{culprit}` holds "
        "NaN or Inf on every row of the first batch whose inputs are finite, and "
        "NaN compared with NaN shows no difference. Check the model's weights and "
        "the data (or pass verify=False)."
    )


def fixed_batch_size(model):
    """The batch size a functional model's inputs fix, or None."""
    try:
        inputs = model.inputs
    except (AttributeError, ValueError):
        return None
    for tensor in inputs or ():
        if tensor.shape and tensor.shape[0] is not None:
            return tensor.shape[0]
    return None


def _why_whole(fixed):
    if fixed is not None:
        return f"the model has a fixed batch size of {fixed}"
    return "the outputs are not per row"


def row_count(x):
    """The batch size the leaves of `x` share, or None."""
    sizes = set()
    for leaf in keras.tree.flatten(x):
        if leaf is None:
            continue
        if not isinstance(leaf, tf.Tensor) or leaf.shape.rank in (None, 0):
            return None
        sizes.add(int(leaf.shape[0]))
    return sizes.pop() if len(sizes) == 1 else None


def _take(x, rows):
    rows = tf.constant(np.asarray(rows), tf.int32)
    return keras.tree.map_structure(
        lambda leaf: None if leaf is None else tf.gather(leaf, rows), x)
