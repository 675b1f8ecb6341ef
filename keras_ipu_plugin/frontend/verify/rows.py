"""Which rows of the batch verification runs on (see `verify.py`, "Cost").

`reference_run` leaves out the rows whose inputs, or whose outputs in the
original, hold NaN or Inf, refuses a batch that leaves none, and narrows
the rest to a few rows spread over the batch (1/8 of it, at least
`MIN_ROWS`) where the original's outputs on them equal its outputs for the
same rows of a larger probe: a model that mixes rows, or has a fixed batch
size, is verified on the whole batch.

Example:
    >>> reference, x_rows = reference_run(run, model, x, variables, None, verification,
    ...                                   None, tolerance=tolerance_for(model))
"""

import keras
import numpy as np
import tensorflow as tf

from keras_ipu_plugin.errors import InputDataError
from keras_ipu_plugin.frontend.verify.compare import is_float_array
from keras_ipu_plugin.frontend.verify.compare import is_inexact
from keras_ipu_plugin.frontend.verify.compare import outputs_close
from keras_ipu_plugin.frontend.verify.compare import path_name
from keras_ipu_plugin.frontend.verify.compare import some
from keras_ipu_plugin.frontend.verify.compare import values_of


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
