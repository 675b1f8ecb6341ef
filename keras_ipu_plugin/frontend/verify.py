"""Check that a converted model computes what the original computes.

`check_equivalent` runs both models on one batch in inference mode (so
nothing stateful — BatchNormalization statistics, dropout — changes while
checking) and compares

- every output, element by element: floats within a tolerance scaled by
  the largest finite value, integers, booleans and strings exactly;
- the gradients of a fixed random projection of the float outputs with
  respect to every trainable variable of the original (or the variables
  asked for).

A check that cannot show a difference is refused, never reported equal
(each of these once passed vacuously):

- A batch with 0 rows, or with no row whose inputs are all finite, raises
  `InputDataError`. Rows whose inputs, or whose outputs in the original,
  hold NaN or Inf are left out (a NaN compared with a NaN shows nothing);
  NaN or Inf where the other model is finite is a mismatch.
- Variables the original's forward pass reads but Keras does not track (a
  raw `tf.Variable`, a `tf.Module` from another framework, a layer kept in
  an object Keras does not look into) raise `ConversionError` naming them.
  Plain Keras would not train them either (`fit` trains
  `model.trainable_variables`), but a model that reads them holds a weight
  its author means to learn and that nothing will ever move, and
  verification cannot tell whether the converted model reads them as the
  original does (no gradient of theirs is compared): "verified" would be a
  guess. They are found by the gradient tape, which records every
  trainable variable the forward pass reads.
- Zero gradients compared is reported, not refused. A model with no
  trainable variable (a Normalization layer alone) has nothing to train:
  its outputs are all there is to verify, and it converts. The same for a
  model whose float outputs depend on none of its trainable variables
  (`stop_gradient`, integer outputs). The report then says "outputs equal",
  not "outputs and gradients equal", and "gradients of 0 of N" with the
  reason, so it never reads as a check of training.

Cost: a training step runs forward and backward over the whole batch. The
check runs both models forward and backward over a few of its rows (1/8 of
the batch, at least 2), one after the other, keeping only NumPy copies of
the results, after one forward pass (no tape, so no activations are kept)
of the original over twice as many rows that contain them. The sub-batch
is used only where it is the same computation: the original's outputs on
those rows must equal its outputs for the same rows of that larger probe
(a model that mixes rows even in inference mode is verified on the whole
batch, as is a probe with non-finite outputs, so that the whole batch
tells which rows to leave out), and a model with a fixed batch size, or
an original that fails on fewer rows (a batch size written in its code), is
verified on the whole batch.

Example:
    >>> verification = check_equivalent(model, converted, x)
    >>> verification.describe()
    '2 of 16 rows; 1 output(s), max difference 0.00e+00; gradients of 4 of 4 ...'
"""

import inspect
from dataclasses import dataclass
from dataclasses import field

import keras
import numpy as np
import tensorflow as tf

from keras_ipu_plugin import _compat
from keras_ipu_plugin.runtime.distribution import owning_strategy
from keras_ipu_plugin.errors import ConversionError
from keras_ipu_plugin.frontend.state import VariableValues
from keras_ipu_plugin.frontend.state import replay_state
from keras_ipu_plugin.errors import InputDataError
from keras_ipu_plugin.frontend.tracing import _failing_layer
from keras_ipu_plugin.frontend.tracing import essential_message
from keras_ipu_plugin.frontend.training_branches import switch_modes

# The share of the batch verified, and the fewest rows: two rows at least,
# so that a converted graph that mixes rows cannot pass.
ROWS_FRACTION = 8
MIN_ROWS = 2
# How many times the verified rows the probe that shows they are computed as
# in the whole batch holds (see `_narrowed_reference_run`).
PROBE_FACTOR = 2


@dataclass
class Verification:
    """What one `check_equivalent` compared, for the report.

    `gradients` counts the variables whose gradients were compared;
    `variables` the ones asked for (the others had no gradient in either
    model: no float output depends on them).
    """

    what: str
    rows: int
    total_rows: object  # int, or None when the inputs share no batch dimension
    outputs: int = 0
    gradients: int = 0
    variables: int = 0
    max_output_difference: float = 0.0
    max_gradient_difference: float = 0.0
    notes: list = field(default_factory=list)

    @property
    def action(self):
        return "outputs and gradients equal" if self.gradients else "outputs equal"

    def describe(self):
        rows = (f"{self.rows} of {self.total_rows} rows" if self.total_rows is not None
                else "the whole batch")
        text = (f"{rows}; {self.outputs} output(s), max difference "
                f"{self.max_output_difference:.2e}; gradients of {self.gradients} of "
                f"{self.variables} trainable variable(s)")
        if self.gradients:
            text += f", max difference {self.max_gradient_difference:.2e}"
        return "; ".join([text] + self.notes)


def check_equivalent(
    original, converted, x, *, rtol=1e-4, atol=1e-5, what="converted",
    gradients=True, variables=None, rows="auto", before_each_run=None, training=False,
):
    """Compare `converted` with `original` on batch `x`; return a `Verification`.

    Raises `ConversionError` naming the first output or variable that
    differs (or the layer where `converted` fails), and `InputDataError`
    when `x` cannot show a difference (see the module docstring).

    Args:
        gradients: False compares outputs only (for a model whose layers a
            pass replaced, so that the variables differ).
        variables: the variables whose gradients are compared; default
            every trainable variable of `original`.
        rows: "auto" (a few rows where that is the same computation, see
            the module docstring), None for the whole batch, or a number.
        before_each_run: called before every run of either model (e.g. to
            put seed generators back, so that every run sees the same
            random draws).
        training: the mode both models run in. A converted model holding
            a layer that branches on `training` (a `ModeSwitch`) is checked
            in inference, then in training (and with None where that is a
            mode of its own), every run from the same seeds and variables.

    Example:
        >>> check_equivalent(model, converted, x)   # raises when they differ
        Verification(what='converted', rows=2, total_rows=16, ...)
    """
    x = keras.tree.map_structure(_as_tensor, x)
    whole = x  # the batch as given: each other mode narrows it again
    variables = list(original.trainable_variables if variables is None else variables)
    if not gradients:
        variables = []
    verification = Verification(what, rows=0, total_rows=_row_count(x),
                                variables=len(variables))

    # Every run starts from the same variable state, put back afterwards: a
    # model drawing random numbers at inference (a VAE's sampling layer)
    # sees the same draws in each, and verifying moves no counter.
    # Every variable both models hold, trainable ones too (a call may write
    # a kernel: PixelCNN's mask), starts each run as it was, so that what a
    # call writes can be compared (`_compare_writes`).
    mode = RunMode(original)
    state = VariableValues(_shared_variables(original, converted))
    # TensorFlow's stateful draws (`tf.random.normal(shape)`, no seed
    # generator) are recorded in each run of the original and handed out
    # again, in order, to the run of the converted model, which thus sees
    # the reference run's numbers; TensorFlow's global random state is put
    # back afterwards (`_compat.taped_stateful_draws`).
    with replay_state(original, converted) as replay, _restoring(state), \
            _compat.taped_stateful_draws() as draws:

        def run(model, x, variables, role, tape=True):
            replay()
            state.restore()
            if before_each_run is not None:
                before_each_run()
            draws.record() if role == "original" else draws.replay()
            try:
                return _run(model, x, variables, role=role, tape=tape, mode=mode,
                            training=training)
            finally:
                draws.stop()

        # A model with a fixed batch size cannot run on a few rows of it.
        fixed = _fixed_batch_size(original) or _fixed_batch_size(converted)
        reference, x = _reference_run(
            run, original, x, variables, rows, verification, fixed, rtol=rtol, atol=atol
        )
        _refuse_untracked_variables(original, reference.watched)
        written = state.changed_values()
        result = run(converted, x, variables, role=what)
        del x  # nothing of the batch is needed any more
        _compare_writes(written, state.changed_values(), rtol, atol, what, verification)
    if mode.graph:
        verification.notes.append(mode.describe())

    ref_paths = keras.tree.flatten_with_path(reference.outputs)
    res_leaves = keras.tree.flatten(result.outputs)
    if len(ref_paths) != len(res_leaves):
        raise ConversionError(
            f"The {what} model returns {len(res_leaves)} outputs; the original "
            f"returns {len(ref_paths)}."
        )
    for (path, expected), actual in zip(ref_paths, res_leaves):
        if expected is None or actual is None:
            if (expected is None) != (actual is None):
                raise ConversionError(
                    f"Output `{_path_name(path, 'output')}` is None in the "
                    f"{'original' if expected is None else what} model only.")
            continue
        difference = _compare(f"output `{_path_name(path, 'output')}`",
                              expected, actual, rtol, atol, what)
        verification.outputs += 1
        verification.max_output_difference = max(
            verification.max_output_difference, difference)
    # before the gradients, which the losses are part of: the clearer cause
    _compare_losses(reference.losses, result.losses, rtol, atol, what)
    for variable, expected, actual in zip(variables, reference.gradients, result.gradients):
        if expected is None and actual is None:
            continue
        if expected is None or actual is None:
            raise ConversionError(
                f"The gradient w.r.t. variable `{_variable_name(variable)}` is "
                f"{'missing' if actual is None else 'present'} in the {what} "
                f"model but {'present' if actual is None else 'missing'} in the "
                "original."
            )
        difference = _compare(
            f"the gradient w.r.t. variable `{_variable_name(variable)}`",
            *_comparable(expected, actual), rtol, atol, what,
        )
        verification.gradients += 1
        verification.max_gradient_difference = max(
            verification.max_gradient_difference, difference)
    if variables and not verification.gradients:
        verification.notes.append("no float output depends on a trainable variable")
    elif not variables and gradients:
        verification.notes.append("the model has no trainable variable")
    if training is False:
        for other in switch_modes(converted):
            verification.notes.append(_check_mode(
                original, converted, whole, other, rtol=rtol, atol=atol, what=what,
                gradients=gradients, variables=variables, rows=rows,
                before_each_run=before_each_run))
    return verification


def _compare_losses(expected, actual, rtol, atol, what):
    """The losses each model's call left in `model.losses` (a loss `call`
    adds with `add_loss`, regularizers), summed, must agree: `compute_loss`
    adds them to the training loss."""
    if expected is None and actual is None:
        return
    if expected is None or actual is None:
        which, other = ("original", what) if actual is None else (what, "original")
        raise ConversionError(
            f"The {which} model adds losses in its call (`model.losses`, e.g. "
            f"`self.add_loss(...)`) and the {other} model adds none.")
    _compare("the sum of the losses the call adds (`model.losses`)", expected, actual,
             rtol, atol, what)


def _check_mode(original, converted, x, training, **options):
    """`check_equivalent` in mode `training`, as a note; where the
    original itself computes differently in two runs of that mode from
    the same state (a random draw verification cannot replay), the note
    says the mode was not compared."""
    try:
        checked = check_equivalent(original, converted, x, training=training, **options)
    except ConversionError as error:
        if _reproducible(original, x, training):
            raise ConversionError(f"With training={training} (the model holds a layer "
                                  f"that branches on `training`): {error}") from error
        return (f"training={training}: not compared, the original gives other outputs "
                "in two runs of that mode from the same state")
    return f"training={training}: {checked.describe()}"


def _reproducible(model, x, training):
    try:
        with replay_state(model) as replay:
            first = keras.tree.map_structure(_numpy, model(x, training=training))
            replay()
            second = keras.tree.map_structure(_numpy, model(x, training=training))
    except Exception:
        return True
    return all(_outputs_close(a, b, 1e-4, 1e-5) for a, b in zip(
        keras.tree.flatten(first), keras.tree.flatten(second)))


def _shared_variables(original, converted):
    """The variables of either model, but those of layers a pass replaced
    and of their replacements (`kip_replaced`): each has its own state."""
    replaced = {id(v) for pair in getattr(converted, "kip_replaced", None) or ()
                for layer in pair for v in layer.variables}
    found, seen = [], set()
    for variable in list(original.variables) + list(converted.variables):
        if id(variable) not in replaced and id(variable) not in seen:
            seen.add(id(variable))
            found.append(variable)
    return found


class _restoring:
    """Puts `state` (a `VariableValues`) back on leaving, error or not."""

    def __init__(self, state):
        self.state = state

    def __enter__(self):
        return self.state

    def __exit__(self, *exc_info):
        try:
            self.state.restore()
        except Exception:  # the block's own error is the one to see
            if exc_info[0] is None:
                raise
        return False


def _compare_writes(expected, actual, rtol, atol, what, verification):
    """Raise `ConversionError` naming the first variable that one model's
    call changed and the other's did not, or changed to another value.
    `expected` / `actual`: `{id: (variable, value)}` of the variables each
    run changed, from the same state (`VariableValues.changed_values`)."""
    for key in list(expected) + [k for k in actual if k not in expected]:
        variable = (expected.get(key) or actual.get(key))[0]
        name = _variable_name(variable)
        if key not in actual or key not in expected:
            changes, keeps = ("the original", f"the {what} model") if key not in actual else (
                f"the {what} model", "the original")
            raise ConversionError(
                f"Calling {changes} writes variable `{name}`, and calling {keeps} leaves "
                "it as it was: a write the model makes in its forward pass (an `assign` "
                "in `call`) is lost or added. A layer whose `call` writes a variable must "
                "run whole.")
        _compare(f"variable `{name}` after the call", expected[key][1], actual[key][1],
                 rtol, atol, what)
    if expected:
        verification.notes.append(
            f"{len(expected)} variable(s) written by the call compared")


def check_runs(model, x, *, what="passed"):
    """Raise `ConversionError` naming the layer where `model` fails on `x`
    (in inference mode); for a model that may compute something else than
    its original on purpose, so only that it runs can be checked.

    Example:
        >>> check_runs(passed, x)
    """
    _run(model, keras.tree.map_structure(_as_tensor, x), [], role=what, tape=False,
         mode=RunMode(model, any_role=True))


def synthetic_batch(specs, rows=2, unknown_size=4):
    """A batch for input `specs` (`inputs.InputSpec`s) where no real one is
    kept: floats random normal, integers zeros, booleans False; `rows` rows
    unless a spec fixes the batch size, `unknown_size` for the other
    unknown dimensions. Returns `(x, None)`, or `(None, reason)` when an
    input's dtype has no sensible made-up value (strings).

    Example:
        >>> x, reason = synthetic_batch(graph.input_specs)
    """
    rng = np.random.RandomState(0)

    def make(spec):
        dtype = tf.as_dtype(spec.dtype)
        shape = [spec.batch_size or rows] + [unknown_size if d is None else d
                                             for d in spec.shape]
        if dtype.is_floating or dtype.is_complex:
            return tf.cast(rng.normal(size=shape), dtype)
        if dtype.is_integer or dtype.is_bool:
            return tf.zeros(shape, dtype)
        raise TypeError(f"input `{spec.name}` is a {dtype.name} tensor")

    try:
        return keras.tree.map_structure(make, specs), None
    except TypeError as error:
        return None, f"{error}: no synthetic value for it"


def keep_first_batch(model, x):
    """Keep `x` on `model` as `model.kip_first_batch`, for `apply_passes` to
    verify against. Set past Keras's attribute tracking: it is no weight,
    no sub-layer, and not part of the model's config."""
    object.__setattr__(model, "kip_first_batch", x)


# -- choosing the rows ------------------------------------------------------------
def _reference_run(run, original, x, variables, rows, verification, fixed, *, rtol, atol):
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
            f"rows {_some(np.setdiff1d(np.arange(total), kept))} left out: "
            "their inputs hold NaN or Inf")
    wanted = _rows_wanted(rows, count)
    subset_allowed = count is not None and fixed is None
    if subset_allowed and wanted < count:
        narrowed = _narrowed_reference_run(run, original, x, variables, count, wanted,
                                           rtol=rtol, atol=atol)
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
    verification.rows = _row_count(x) if count is not None else 0
    return reference, x


def _narrowed_reference_run(run, original, x, variables, count, wanted, *, rtol, atol):
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
    if not _outputs_close(expected, reference.outputs, rtol, atol):
        return mixed
    return reference, picked


def _outputs_left_out(kept, finite, culprit):
    rows = kept[~finite] if kept is not None else np.flatnonzero(~finite)
    return (f"rows {_some(rows)} left out: the original's output `{culprit}` "
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
        if leaf is None or not _is_inexact(leaf.dtype):
            continue
        name = _path_name(path, "x")
        if total is None:
            if not bool(tf.reduce_all(tf.math.is_finite(_values_of(leaf)))):
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
                f"`{name}` has NaN or Inf in rows {_some(np.flatnonzero(~finite))}"
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
            f"{_some(np.flatnonzero(~bad_rows[name]))} of input `{name}` contain NaN "
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
        if leaf.dtype.kind in "fc":
            rows = np.isfinite(leaf).reshape(count, -1).all(axis=1)
            if culprit is None and not rows.all():
                culprit = _path_name(path, "output")
            finite &= rows
    return finite, culprit


def _finite_overall(outputs):
    for path, leaf in keras.tree.flatten_with_path(outputs):
        if leaf is not None and leaf.dtype.kind in "fc" and not np.isfinite(leaf).all():
            return np.zeros(1, bool), _path_name(path, "output")
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


def _outputs_close(expected, actual, rtol, atol):
    for e, a in zip(keras.tree.flatten(expected), keras.tree.flatten(actual)):
        try:
            _compare("", e, a, rtol, atol, "")
        except ConversionError:
            return False
    return True


def _fixed_batch_size(model):
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


# -- running the models -------------------------------------------------------------
@dataclass
class _Run:
    outputs: object  # NumPy arrays, nested like the model's outputs
    gradients: list  # NumPy arrays or None, one per variable
    watched: list  # TensorFlow variables the forward pass read
    losses: object = None  # the sum of `model.losses` after the call, or None


class RunMode:
    """How verification runs the models: eagerly, as long as the original
    runs eagerly; else, for a model that does not train eagerly (no
    `run_eagerly=True`), in a `tf.function`, as `fit` runs it — a model
    that only runs in graph mode (an op with no eager kernel) trains with
    plain `fit`, so it must verify too. Eager first: tracing a function per
    run would cost more than the training step verification stands in for.

    Example:
        >>> mode = RunMode(model)
        >>> _run(model, x, [], role="original", tape=False, mode=mode)
        >>> mode.graph   # True once the original failed eagerly and ran as a function
    """

    def __init__(self, original, any_role=False):
        self.graph = False
        self.eager_error = None
        self.allowed = not getattr(original, "run_eagerly", False)
        self.any_role = any_role  # check_runs: the model checked is the only one

    def may_switch(self, role):
        return (not self.graph and self.allowed
                and (self.any_role or role == "original"))

    def describe(self):
        error = self.eager_error
        return (f"verified in graph mode, as fit runs the model: it fails eagerly "
                f"({type(error).__name__}: {essential_message(error, limit=160)})")


def _run(model, x, variables, *, role, tape=True, mode=None, training=False):
    """Outputs and gradients as NumPy (nothing of the run stays on the
    device), computed in a replica context; in a `tf.function` when `mode`
    (a `RunMode`) says so, or when the eager run of the original fails and
    the model may run as `fit` runs it (the mode then stays graph).

    Under a `tf.distribute` strategy scope the caller is in the cross-replica
    context, where a mirrored variable has no single handle to differentiate
    against; the computation then runs as one replica's step (every replica
    sees the whole batch, so the first replica's result is the answer).
    """
    mode = mode or RunMode(model)
    watched = []
    try:
        outputs, gradients = _computed(model, x, variables, tape, watched, mode.graph,
                                       training)
    except Exception as error:
        if type(error).__module__.startswith("keras_ipu_plugin"):
            raise  # already says what is wrong (a nested conversion, new variables)
        if not mode.may_switch(role):
            raise _call_error(model, role, error) from error
        del watched[:]
        try:
            outputs, gradients = _computed(model, x, variables, tape, watched, True, training)
        except Exception:
            # Fails in graph mode too: the eager error is the one to see.
            raise _call_error(model, role, error) from error
        mode.graph, mode.eager_error = True, error
    outputs, losses = outputs  # the call's outputs, and the losses it added
    return _Run(
        keras.tree.map_structure(_numpy, outputs), [_gradient_numpy(g) for g in gradients],
        watched, None if losses is None else _numpy(losses),
    )


def _computed(model, x, variables, tape, watched, graph, training=False):
    """`(outputs, gradients)` of one run, eagerly or as one `tf.function`
    (a new one each run: its trace reads the variables `watched`)."""
    def compute(x):
        if tf.distribute.has_strategy() and tf.distribute.in_cross_replica_context():
            strategy = tf.distribute.get_strategy()
            outputs, gradients = strategy.run(
                _outputs_and_gradients, args=(model, x, variables, tape, watched, training))

            def first_replica(value):
                return None if value is None else strategy.experimental_local_results(value)[0]

            return (keras.tree.map_structure(first_replica, outputs),
                    [first_replica(g) for g in gradients])
        return _outputs_and_gradients(model, x, variables, tape, watched, training)

    if graph:
        return tf.function(compute)(x)
    return compute(x)


def _outputs_and_gradients(model, x, variables, tape, watched, training=False):
    """`((outputs, losses), gradients)`: `losses` the sum of what the call
    left in `model.losses` (a loss `call` adds, regularizers), or None;
    the gradients are of the outputs' projection plus that sum, so that a
    loss the graph adds is checked with its gradient, as training uses it."""
    if not tape:
        outputs = model(x, training=training)
        return (outputs, _loss_sum(model)), []
    with tf.GradientTape() as gradient_tape:
        outputs = model(x, training=training)
        losses = _loss_sum(model)
        scalar = _projection(outputs) if losses is None else _projection(outputs) + losses
    watched.extend(gradient_tape.watched_variables())
    gradients = gradient_tape.gradient(scalar, [_tf_variable(v) for v in variables])
    return (outputs, losses), gradients


def _loss_sum(model):
    """The sum of `model.losses` (float32), None when it has none."""
    losses = [tf.cast(tf.reduce_sum(loss), tf.float32) for loss in model.losses]
    return tf.add_n(losses) if losses else None


def _call_error(model, role, error):
    where = _failing_layer(error)
    text = f"{type(error).__name__}: {essential_message(error, limit=300)}"
    if role == "original":
        return InputDataError(
            f"Cannot verify: the original model `{model.name}` fails on the batch "
            f"(in layer `{where or model.name}`): {text}"
        )
    return ConversionError(
        f"The {role} model fails when called on the first batch, in layer "
        f"`{where or model.name}`: {text}"
    )


def _tf_variable(variable):
    return getattr(variable, "value", variable)


def _projection(outputs):
    total = tf.constant(0.0)
    for index, tensor in enumerate(keras.tree.flatten(outputs)):
        if tensor is None:
            continue
        tensor = tf.convert_to_tensor(tensor)
        if not tensor.dtype.is_floating:
            continue
        weights = np.random.RandomState(index).uniform(
            0.5, 1.5, size=[d or 1 for d in tensor.shape]
        )
        total += tf.reduce_sum(tf.cast(tensor, tf.float32) * weights.astype("float32"))
    return total


# -- untracked variables ----------------------------------------------------------
def _refuse_untracked_variables(original, watched):
    """Raise when the forward pass read trainable TensorFlow variables that
    are not variables of `original` (Keras does not see them: no gradient
    of theirs is compared, `fit` does not train them, checkpoints miss them)."""
    tracked = set()
    for variable in original.variables:
        handle = _tf_variable(variable)
        tracked.update((id(variable), id(handle)))
        # A mirrored variable is read through its per-device components.
        strategy = owning_strategy(variable) or tf.distribute.get_strategy()
        tracked.update(id(c) for c in strategy.experimental_local_results(handle))
    untracked = [v for v in watched if id(v) not in tracked]
    if not untracked:
        return
    names = _attribute_paths(original, untracked)
    listed = ", ".join(
        f"`{names[id(v)]}` (tf.Variable '{v.name}')" if id(v) in names
        else f"tf.Variable '{v.name}'" for v in untracked[:8]
    )
    more = f" and {len(untracked) - 8} more" if len(untracked) > 8 else ""
    raise ConversionError(
        f"`{original.name}` reads trainable variables that Keras does not track: "
        f"{listed}{more}. They are not in `model.trainable_variables`, so `fit` "
        "would not train them and verification could not compare their "
        "gradients. Make them Keras weights (`self.add_weight`), or hold the "
        "layers or modules that own them directly as attributes of a Keras "
        "layer (or in a list or dict attribute)."
    )


def _attribute_paths(root, variables, max_depth=6):
    """`{id(tf variable): "attr.path"}` for `variables` reachable from `root`
    through instance attributes, lists, tuples and dicts."""
    wanted = {id(v) for v in variables}
    found = {}
    seen = set()
    frontier = [(root, "")]
    for _ in range(max_depth):
        following = []
        for obj, path in frontier:
            if id(obj) in seen:
                continue
            seen.add(id(obj))
            for handle in (obj, getattr(obj, "value", None) if isinstance(
                    obj, keras.Variable) else None):
                if handle is not None and id(handle) in wanted:
                    found.setdefault(id(handle), path)
            following.extend(_children(obj, path))
        frontier = following
    return found


def _children(obj, path):
    if isinstance(obj, (str, bytes, int, float, bool, np.ndarray, tf.Tensor, type)) or (
            inspect.isroutine(obj) or inspect.ismodule(obj)):
        return []
    if isinstance(obj, dict):
        items = obj.items()
    elif isinstance(obj, (list, tuple)):
        items = enumerate(obj)
    elif hasattr(obj, "__dict__"):
        items = vars(obj).items()
    else:
        return []
    return [(value, f"{path}.{key}" if path else str(key)) for key, value in items
            if not (isinstance(key, str) and key.startswith("__"))]


# -- comparing --------------------------------------------------------------------
def _compare(label, expected, actual, rtol, atol, what):
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


# -- small helpers ------------------------------------------------------------------
def _as_tensor(leaf):
    if leaf is None or isinstance(leaf, (tf.Tensor, tf.RaggedTensor, tf.SparseTensor)):
        return leaf
    return tf.convert_to_tensor(leaf)


def _numpy(value):
    return None if value is None else np.asarray(value)


@dataclass
class _Rows:
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


def _gradient_numpy(gradient):
    if not isinstance(gradient, tf.IndexedSlices):
        return _numpy(gradient)
    indices, positions = np.unique(np.asarray(gradient.indices), return_inverse=True)
    values = np.zeros((len(indices),) + tuple(gradient.values.shape[1:]),
                      gradient.values.dtype.as_numpy_dtype)
    np.add.at(values, positions, np.asarray(gradient.values))
    return _Rows(indices, values, tuple(int(d) for d in gradient.dense_shape))


def _comparable(expected, actual):
    """Both as arrays of the same layout: the touched rows when both are
    sparse on the same rows, else dense."""
    if isinstance(expected, _Rows) and isinstance(actual, _Rows) and np.array_equal(
            expected.indices, actual.indices):
        return expected.values, actual.values
    as_array = lambda g: g.dense() if isinstance(g, _Rows) else g  # noqa: E731
    return as_array(expected), as_array(actual)


def _row_count(x):
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


def _values_of(leaf):
    return getattr(leaf, "flat_values", getattr(leaf, "values", leaf))


def _is_inexact(dtype):
    dtype = tf.as_dtype(dtype)
    return dtype.is_floating or dtype.is_complex


def _path_name(path, default):
    return ".".join(str(p) for p in path) or default


def _variable_name(variable):
    return getattr(variable, "path", None) or variable.name


def _some(indices, limit=6):
    shown = ", ".join(str(int(i)) for i in indices[:limit])
    return shown + (f" and {len(indices) - limit} more" if len(indices) > limit else "")

