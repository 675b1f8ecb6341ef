"""Check that a converted model computes what the original computes.

`check_equivalent` runs both models on one batch in inference mode, every
run from the same variable state (put back afterwards: verifying moves no
statistic and consumes no draw), and compares

- every output, element by element: floats within a tolerance scaled by
  the largest finite value, integers, booleans and strings exactly;
- the gradients of a fixed random projection of the float outputs with
  respect to every trainable variable of the original (or the variables
  asked for);
- a training step's forward pass, as `fit` calls the model (`training=True`,
  or no `training` for a `call` that takes none), both models from the same
  state: its outputs, and every variable it writes — BatchNormalization
  statistics, counters, seed-generator states, variables a `call` assigns,
  in any nested sub-model, and the state of layers the model calls without
  owning them — within the tolerance of each value's dtype
  (`Tolerance.for_values`). A difference is a refusal naming the variable and
  its layer.

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
of the original over twice as many rows that contain them, and the training
step's forward pass (no tape) of each over the verified rows. The sub-batch
is used only where it is the same computation: the original's outputs on
those rows must equal its outputs for the same rows of that larger probe
(a model that mixes rows even in inference mode is verified on the whole
batch, as is a probe with non-finite outputs, so that the whole batch
tells which rows to leave out), and a model with a fixed batch size, or
an original that fails on fewer rows (a batch size written in its code), is
verified on the whole batch.

Every run starts from the same values of every variable both models hold,
a whole model's weights: they are compared bit for bit in place (no copy),
and read once after a run, what it wrote being put back in the same pass
(`_Variables`). Copied and compared as bytes before and after each run,
they took about as long as the runs on a BERT (docs/benchmarks.md).

The parts are modules of their own: running a model for its outputs and
gradients (`runs.py`), and which rows are verified and how two runs' values
are compared (`compare.py`).

Example:
    ```python
    verification = check_equivalent(model, converted, x)
    verification.describe()
    # -> '2 of 16 rows; 1 output(s), max difference 0.00e+00; gradients of 4 of 4 ...'
    ```
"""

from dataclasses import dataclass
from dataclasses import field

import keras
import numpy as np
import tensorflow as tf

from keras_ipu_plugin import _compat
from keras_ipu_plugin.errors import ConversionError
from keras_ipu_plugin.frontend.state import UndoneWrites
from keras_ipu_plugin.frontend.state import VariableValues
from keras_ipu_plugin.frontend.state import replay_state
from keras_ipu_plugin.frontend.trace.writes import handles_of
from keras_ipu_plugin.frontend.trace.training_modes import switch_modes
from keras_ipu_plugin.frontend.verify.compare import as_numpy
from keras_ipu_plugin.frontend.verify.compare import as_tensor
from keras_ipu_plugin.frontend.verify.compare import comparable
from keras_ipu_plugin.frontend.verify.compare import compare_values
from keras_ipu_plugin.frontend.verify.compare import outputs_close
from keras_ipu_plugin.frontend.verify.compare import path_name
from keras_ipu_plugin.frontend.verify.compare import tolerance_for
from keras_ipu_plugin.frontend.verify.compare import variable_name
from keras_ipu_plugin.frontend.verify.compare import fixed_batch_size
from keras_ipu_plugin.frontend.verify.compare import reference_run
from keras_ipu_plugin.frontend.verify.compare import row_count
from keras_ipu_plugin.frontend.verify.runs import RunMode
from keras_ipu_plugin.frontend.verify.runs import refuse_untracked_variables
from keras_ipu_plugin.frontend.verify.runs import run_model
from keras_ipu_plugin.frontend.verify.runs import taped_stateful_draws


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
    original, converted, x, *, tolerance=None, what="converted",
    gradients=True, variables=None, rows="auto", before_each_run=None, training=False,
    step_training="fit",
):
    """Compare `converted` with `original` on batch `x`; return a `Verification`.

    Raises `ConversionError` naming the first output or variable that
    differs (or the layer where `converted` fails), and `InputDataError`
    when `x` cannot show a difference (see the module docstring).

    Args:
        tolerance: a `compare.Tolerance`; default the one for the
            least precise dtype a layer of either model computes in
            (`tolerance_for`: float32's, or float16's under
            `mixed_float16`, ...), named in the refusal.
        gradients: False compares outputs only (for a model whose layers a
            pass replaced, so that the variables differ).
        variables: the variables whose gradients are compared; default
            every trainable variable of `original`.
        rows: "auto" (a few rows where that is the same computation, see
            the module docstring), None for the whole batch, or a number.
        before_each_run: called before every run of either model (e.g. to
            put seed generators back, so that every run sees the same
            random draws).
        step_training: the `training` of the training step compared
            (outputs and every variable its forward pass writes): "fit" for
            the call `fit` makes (`training=True`, or none for a `call` that
            takes none), True, or False for no training step (a conversion
            that pins inference). Not compared with `gradients=False`: the
            layers a pass replaced hold state of their own.
        training: the mode both models run in. A converted model holding
            a layer that branches on `training` (a `ModeSwitch`) is checked
            in inference, then in training (and with None where that is a
            mode of its own), every run from the same seeds and variables.

    Example:
        ```python
        check_equivalent(model, converted, x)   # raises when they differ
        # -> Verification(what='converted', rows=2, total_rows=16, ...)
        ```
    """
    x = keras.tree.map_structure(as_tensor, x)
    if tolerance is None:
        tolerance = tolerance_for(original, converted)
    whole = x  # the batch as given: each other mode narrows it again
    variables = list(original.trainable_variables if variables is None else variables)
    if not gradients:
        variables = []
    verification = Verification(what, rows=0, total_rows=row_count(x),
                                variables=len(variables))
    if tolerance.dtype != "float32":
        verification.notes.append(
            f"tolerances for {tolerance.dtype} computation"
            + (f" (dtype policy `{tolerance.policy}`)" if tolerance.policy else ""))

    # Every run starts from the same variable state, put back afterwards: a
    # model drawing random numbers at inference (a VAE's sampling layer)
    # sees the same draws in each, and verifying moves no counter.
    # Every variable both models hold, trainable ones too (a call may write
    # a kernel: PixelCNN's mask), starts each run as it was, so that what a
    # call writes can be compared (`_compare_writes`).
    mode = RunMode(original)
    state = _Variables(_shared_variables(original, converted))
    # TensorFlow's stateful draws (`tf.random.normal(shape)`, no seed
    # generator) are recorded in each run of the original and handed out
    # again, in order, to the run of the converted model, which thus sees
    # the reference run's numbers; TensorFlow's global random state is put
    # back afterwards (`verify_runs.taped_stateful_draws`).
    with replay_state(original, converted) as replay, _restoring(state), \
            taped_stateful_draws() as draws:

        def run(model, x, variables, role, tape=True, run_training=training):
            replay()
            state.before_run()
            if before_each_run is not None:
                before_each_run()
            draws.record() if role == "original" else draws.replay()
            try:
                return run_model(model, x, variables, role=role, tape=tape, mode=mode,
                            training=run_training)
            finally:
                draws.stop()

        # A model with a fixed batch size cannot run on a few rows of it.
        fixed = fixed_batch_size(original) or fixed_batch_size(converted)
        reference, x = reference_run(
            run, original, x, variables, rows, verification, fixed, tolerance=tolerance
        )
        refuse_untracked_variables(original, reference.watched)
        written = state.changes()
        result = run(converted, x, variables, role=what)
        _compare_writes(written, state.changes(), tolerance, what, verification)
        # What `fit`'s forward pass writes (statistics, counters, seed
        # states), which an inference run never shows; compared last, after
        # the inference and mode checks, whose differences are the clearer.
        step = _training_step_runs(run, state, original, converted, x, what,
                                   step_training) if (
            training is False and gradients and step_training is not False) else None
        step_rows = x
        del x  # nothing of the batch is needed any more
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
                    f"Output `{path_name(path, 'output')}` is None in the "
                    f"{'original' if expected is None else what} model only.")
            continue
        difference = compare_values(f"output `{path_name(path, 'output')}`",
                              expected, actual, tolerance, what)
        verification.outputs += 1
        verification.max_output_difference = max(
            verification.max_output_difference, difference)
    # before the gradients, which the losses are part of: the clearer cause
    _compare_losses(reference.losses, result.losses, tolerance, what)
    for variable, expected, actual in zip(variables, reference.gradients, result.gradients):
        if expected is None and actual is None:
            continue
        if expected is None or actual is None:
            raise ConversionError(
                f"The gradient w.r.t. variable `{variable_name(variable)}` is "
                f"{'missing' if actual is None else 'present'} in the {what} "
                f"model but {'present' if actual is None else 'missing'} in the "
                "original."
            )
        difference = compare_values(
            f"the gradient w.r.t. variable `{variable_name(variable)}`",
            *comparable(expected, actual), tolerance, what,
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
                original, converted, whole, other, tolerance=tolerance, what=what,
                gradients=gradients, variables=variables, rows=rows,
                before_each_run=before_each_run))
    if step is not None:
        _compare_training_step(step, state, original, step_rows, tolerance, what,
                               verification)
    return verification


def _compare_losses(expected, actual, tolerance, what):
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
    compare_values("the sum of the losses the call adds (`model.losses`)", expected, actual,
                   tolerance, what)


def _check_mode(original, converted, x, training, **options):
    """`check_equivalent` in mode `training`, as a note; where the
    original itself computes differently in two runs of that mode from
    the same state (a random draw verification cannot replay), the note
    says the mode was not compared."""
    try:
        checked = check_equivalent(original, converted, x, training=training, **options)
    except ConversionError as error:
        if _reproducible(original, x, training, options["tolerance"]):
            raise ConversionError(f"With training={training} (the model holds a layer "
                                  f"that branches on `training`): {error}") from error
        return (f"training={training}: not compared, the original gives other outputs "
                "in two runs of that mode from the same state")
    return f"training={training}: {checked.describe()}"


def _reproducible(model, x, training, tolerance, state=None):
    try:
        with replay_state(model) as replay, UndoneWrites() as undo:
            first = keras.tree.map_structure(as_numpy, model(x, training=training))
            replay()
            undo.put_back()
            if state is not None:
                state.restore()
            second = keras.tree.map_structure(as_numpy, model(x, training=training))
        if state is not None:
            state.restore()
    except Exception:
        return True
    return all(outputs_close(a, b, tolerance) for a, b in zip(
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


class _Variables(VariableValues):
    """The variables both models hold, as verification puts them back
    before each run: a whole model's weights, so each is read as few times
    as can be. `changes()` after a run reads each once and puts back what
    the run wrote; the next run then starts from the saved state without
    reading them again (`before_run`)."""

    def __init__(self, variables):
        super().__init__(variables)
        self.as_saved = True  # nothing ran since they were last compared or put back

    def before_run(self):
        if not self.as_saved:
            self.restore()
        self.as_saved = False

    def changes(self):
        """What the last run wrote (`changed_values`), put back."""
        found = self.changed_values(put_back=True)
        self.as_saved = True
        return found

    def restore(self):
        super().restore()
        self.as_saved = True


class _restoring:
    """Puts `state` (a `_Variables`) back on leaving, error or not."""

    def __init__(self, state):
        self.state = state

    def __enter__(self):
        return self.state

    def __exit__(self, *exc_info):
        try:
            if not self.state.as_saved:
                self.state.restore()
        except Exception:  # the block's own error is the one to see
            if exc_info[0] is None:
                raise
        return False


def _training_step_runs(run, state, original, converted, x, what, step_training="fit"):
    """Run both models forward as `fit`'s step calls them (`training=True`,
    or no `training` for a model whose `call` takes none), each from the
    same state, with no tape; return `(mode, runs)`, each run its outputs,
    the changed variables of either model (`state.changed_values()`) and
    the writes to variables neither holds (a layer called but not owned: a
    module-level augmentation's seed states), seen through `UndoneWrites`
    and put back after each run."""
    step_mode = step_training if step_training != "fit" else (
        True if _compat.call_takes_training_argument(original) else None)
    runs = []
    # Variables one model holds and the other does not (those of a layer a
    # pass replaced, and of its replacement) are each model's own, not a
    # layer called without being owned.
    held = state.handle_ids() | {id(handle) for model in (original, converted)
                                 for variable in model.variables
                                 for handle in handles_of(variable)}
    for model, role in ((original, "original"), (converted, what)):
        with UndoneWrites() as unowned:
            outcome = run(model, x, [], role=role, tape=False, run_training=step_mode)
            owned = state.changes()
            others = {key: value for key, value in unowned.written_values().items()
                      if key not in held}
        runs.append((outcome, owned, others))
    return step_mode, runs


def _compare_training_step(step, state, original, x, tolerance, what, verification):
    """Compare the training-step runs of `_training_step_runs`: outputs, and
    every variable either run wrote, within the tolerance of its dtype.
    Where the original itself gives other results in two such runs from the
    same state (a draw verification cannot replay), the step is noted as not
    compared instead."""
    step_mode, ((reference, expected, expected_others),
                (result, actual, actual_others)) = step
    label = f"training={step_mode}" if step_mode else "no `training` argument"
    try:
        for (path, want), got in zip(keras.tree.flatten_with_path(reference.outputs),
                                     keras.tree.flatten(result.outputs)):
            if want is not None and got is not None:
                compare_values(f"output `{path_name(path, 'output')}` in a training step",
                               want, got, tolerance, what)
        _compare_writes(expected, actual, tolerance, what, None,
                        when=f"in a training step ({label}, as `fit` calls the model)")
        _compare_other_writes(expected_others, actual_others, tolerance, what)
    except ConversionError:
        if _reproducible(original, x, step_mode, tolerance, state):
            raise
        verification.notes.append(
            "training step: not compared, the original gives other outputs in two runs "
            "from the same state")
        return
    written = len(expected) + len(expected_others)
    verification.notes.append(
        f"training step ({label}): outputs and {written} variable(s) it writes equal")


def _compare_other_writes(expected, actual, tolerance, what):
    """The writes of one training step to variables neither model holds
    (`{id(handle): value}`), e.g. the seed states of a layer called but not
    owned."""
    for key in list(expected) + [k for k in actual if k not in expected]:
        if key not in expected or key not in actual:
            which = "original" if key in expected else what
            raise ConversionError(
                f"In a training step only the {which} model writes a variable that "
                "neither model holds (a layer the model calls without owning it, such as "
                "a random augmentation kept outside the model): a draw or an update is "
                "lost or added.")
        compare_values("a variable neither model holds (a layer called but not owned) "
                       "after a training step", expected[key], actual[key],
                       tolerance, what)


def _compare_writes(expected, actual, tolerance, what, verification, when="after the call"):
    """Raise `ConversionError` naming the first variable that one model's
    call changed and the other's did not, or changed to another value (within
    the tolerance of the variable's dtype). `expected` / `actual`:
    `{id: (variable, value)}` of the variables each run changed, from the
    same state (`VariableValues.changed_values`)."""
    for key in list(expected) + [k for k in actual if k not in expected]:
        variable = (expected.get(key) or actual.get(key))[0]
        name = variable_name(variable)
        if key not in actual or key not in expected:
            changes, keeps = ("the original", f"the {what} model") if key not in actual else (
                f"the {what} model", "the original")
            raise ConversionError(
                f"Calling {changes} {when} writes variable `{name}`{_of_layer(name)}, and "
                f"calling {keeps} leaves it as it was: a write the model makes in its "
                "forward pass (BatchNormalization's moving statistics, a counter, a seed "
                "generator's state, an `assign` in `call`) is lost or added. A layer "
                "whose `call` writes a variable must run whole.")
        compare_values(f"variable `{name}`{_of_layer(name)} {when}", expected[key][1],
                       actual[key][1], tolerance, what)
    if expected and verification is not None:
        verification.notes.append(
            f"{len(expected)} variable(s) written by the call compared")


def _of_layer(path):
    """` (layer `a/b`)` for a variable path `a/b/moving_mean`, else ''."""
    layer, _, _ = path.rpartition("/")
    return f" (layer `{layer}`)" if layer else ""


def check_runs(model, x, *, what="passed"):
    """Raise `ConversionError` naming the layer where `model` fails on `x`
    (in inference mode); for a model that may compute something else than
    its original on purpose, so only that it runs can be checked.

    Example:
        ```python
        check_runs(passed, x)
        ```
    """
    run_model(model, keras.tree.map_structure(as_tensor, x), [], role=what, tape=False,
         mode=RunMode(model, any_role=True))


def synthetic_batch(specs, rows=2, unknown_size=4):
    """A batch for input `specs` (`inputs.InputSpec`s) where no real one is
    kept: floats random normal, integers zeros, booleans False; `rows` rows
    unless a spec fixes the batch size, `unknown_size` for the other
    unknown dimensions. Returns `(x, None)`, or `(None, reason)` when an
    input's dtype has no sensible made-up value (strings).

    Example:
        ```python
        x, reason = synthetic_batch(graph.input_specs)
        ```
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
