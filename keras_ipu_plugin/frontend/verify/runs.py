"""Verification's runs of a model: outputs and the gradients of a fixed
random projection of them, as NumPy, eagerly or as `fit` runs the model
(`RunMode`), in a replica context under a strategy (`run_model`); and the
refusal of trainable variables the forward pass reads that Keras does not
track (`refuse_untracked_variables`); and the tape that hands both models
the same stateful TensorFlow random draws (`taped_stateful_draws`). See
`equivalence.py`.

Example:
    ```python
    run = run_model(model, x, model.trainable_variables, role="original")
    run.outputs, run.gradients, run.watched
    ```
"""

import contextlib
import contextvars
import inspect
import threading
from dataclasses import dataclass

import keras
import numpy as np
import tensorflow as tf

from keras_ipu_plugin import _compat
from keras_ipu_plugin.errors import ConversionError
from keras_ipu_plugin.errors import InputDataError
from keras_ipu_plugin.frontend.trace.attribute_paths import direct_layers
from keras_ipu_plugin.frontend.trace.failures import essential_message
from keras_ipu_plugin.frontend.trace.failures import failing_layer as _failing_layer
from keras_ipu_plugin.frontend.verify.compare import as_numpy
from keras_ipu_plugin.frontend.verify.compare import gradient_numpy
from keras_ipu_plugin.runtime.variables import owning_strategy


# What the batch verified on is called in errors: a conversion made when
# training meets a call it has none for (sequences of a new length) is
# verified on that later batch, not the first.
_VERIFIED_BATCH = contextvars.ContextVar("kip_verified_batch", default="the first batch")


@contextlib.contextmanager
def verifying_on(words):
    """Within, errors of runs call the batch verified on `words`.

    Example:
        ```python
        with verifying_on("this batch"):
            runtime.add_conversion(model, call)   # "... fails when called on this batch"
        ```
    """
    token = _VERIFIED_BATCH.set(words)
    try:
        yield
    finally:
        _VERIFIED_BATCH.reset(token)


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
        ```python
        mode = RunMode(model)
        run_model(model, x, [], role="original", tape=False, mode=mode)
        mode.graph   # True once the original failed eagerly and ran as a function
        ```
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


def run_model(model, x, variables, *, role, tape=True, mode=None, training=False):
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
        keras.tree.map_structure(as_numpy, outputs), [gradient_numpy(g) for g in gradients],
        watched, None if losses is None else as_numpy(losses),
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
        f"The {role} model fails when called on {_VERIFIED_BATCH.get()}, in layer "
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
def refuse_untracked_variables(original, watched):
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
            following.extend(_children(obj, path, nested=obj is not root))
        frontier = following
    return found


def _children(obj, path, nested=True):
    if isinstance(obj, (str, bytes, int, float, bool, np.ndarray, tf.Tensor, type)) or (
            inspect.isroutine(obj) or inspect.ismodule(obj)):
        return []
    if isinstance(obj, dict):
        items = obj.items()
    elif isinstance(obj, (list, tuple)):
        items = enumerate(obj)
    elif isinstance(obj, keras.Sequential) or _compat.is_graph_model(obj):
        # A functional model's layers are named as in node paths, not by its
        # `_layers`: by name, or by position where Keras named them; those of
        # the model converted itself (not `nested`) by name, or by class in
        # graph order where Keras named them (`attribute_paths.py`).
        items = direct_layers(obj, nested=nested)
    elif hasattr(obj, "__dict__"):
        # Public attributes first, and none of Keras's bookkeeping (`_layers`
        # holds every sub-layer too): a message names `cell.tau`, the
        # attribute the user wrote, not `_layers.5.tau`.
        bookkeeping = _compat.layer_bookkeeping_attributes() if isinstance(
            obj, keras.layers.Layer) else ()
        items = sorted(((key, value) for key, value in vars(obj).items()
                        if key not in bookkeeping),
                       key=lambda item: str(item[0]).startswith("_"))
    else:
        return []
    return [(value, f"{path}.{key}" if path else str(key)) for key, value in items
            if not (isinstance(key, str) and key.startswith("__"))]


# -- stateful random draws replayed between two runs -------------------------
# `tf.random.normal(shape)` with no seed generator (a VAE's sampling layer
# written with TensorFlow) draws from a stateful kernel: two runs of the same
# model see other numbers, and no public API replays them. The tape below is
# put in place of TensorFlow's stateful draw ops (`_compat.random_state`
# says which) while verification runs the original and the converted model.


_draws_state = threading.local()
_draws_lock = threading.Lock()
_draws_users = [0]
_draws_patches = []  # (module, name, original): `_compat.swap_stateful_draw_ops`


class DrawTape:
    """The stateful random draws of the run being recorded, handed out in
    the same order to the run being replayed (`record()` / `replay()`
    before each run). A replayed draw that is not the recorded one (another
    op or shape) draws afresh and is counted in `mismatches`."""

    def __init__(self):
        self.mode = None
        self.draws = []  # (op name, argument signature, value)
        self.position = 0
        self.mismatches = 0
        self.drew = False  # whether a TensorFlow kernel drew while taped

    def record(self):
        self.mode, self.draws, self.mismatches = "record", [], 0

    def replay(self):
        self.mode, self.position = "replay", 0

    def stop(self):
        self.mode = None

    @property
    def recorded(self):
        return len(self.draws)

    def draw(self, name, original, args, kwargs):
        signature = _draw_signature(args, kwargs)
        if self.mode == "record":
            self.drew = True
            value = original(*args, **kwargs)
            self.draws.append((name, signature, value))
            return value
        if self.mode == "replay" and self.position < len(self.draws):
            recorded_name, recorded_signature, value = self.draws[self.position]
            self.position += 1
            if (recorded_name, recorded_signature) == (name, signature):
                return value
        if self.mode == "replay":
            self.mismatches += 1
        self.drew = True
        return original(*args, **kwargs)


def _draw_signature(args, kwargs):
    """What tells one draw from another: the ops' arguments, tensors by
    shape and dtype, small integer tensors (a shape) by value; seeds left
    out (an unseeded draw gets a new op seed each time)."""
    def part(value):
        if tf.is_tensor(value) and not isinstance(value, tf.Variable):
            if value.dtype.is_integer and value.shape.rank is not None and value.shape.rank <= 1:
                try:
                    return ("int", tuple(np.asarray(value).reshape(-1).tolist()))
                except Exception:  # a symbolic tensor: graph mode, not taped
                    return ("tensor", str(value.dtype))
            return ("tensor", tuple(value.shape), str(value.dtype))
        if isinstance(value, (list, tuple)):
            return tuple(part(v) for v in value)
        return repr(value) if isinstance(value, (int, float, str, bool, type(None))) else type(value).__name__

    kept = {k: v for k, v in kwargs.items() if k not in ("seed", "seed2", "name")}
    return tuple(part(a) for a in args), tuple(sorted((k, part(v)) for k, v in kept.items()))


def _taped(name, original):
    def draw(*args, **kwargs):
        tape = getattr(_draws_state, "tape", None)
        if tape is None or tape.mode is None or not tf.executing_eagerly():
            return original(*args, **kwargs)
        return tape.draw(name, original, args, kwargs)

    draw.__name__ = name
    return draw


@contextlib.contextmanager
def taped_stateful_draws():
    """A `DrawTape` for TensorFlow's stateful random draws on this thread
    while the context lasts; TensorFlow's global random state (the eager
    op-seed sequence of `tf.random.set_seed`, the global `tf.random.Generator`
    when one exists) is put back as it was when the context ends, so that
    the runs made inside it leave the user's random numbers as they were.

    Example:
        ```python
        with taped_stateful_draws() as tape:
            tape.record(); a = tf.random.normal((2,))
            tape.replay(); b = tf.random.normal((2,))
        bool(tf.reduce_all(a == b))
        # -> True
        ```
    """
    saved = _compat.global_random_state()
    with _draws_lock:
        if _draws_users[0] == 0:
            _draws_patches.extend(_compat.swap_stateful_draw_ops(_taped))
        _draws_users[0] += 1
    outer = getattr(_draws_state, "tape", None)
    tape = _draws_state.tape = DrawTape()
    try:
        yield tape
    finally:
        _draws_state.tape = outer
        with _draws_lock:
            _draws_users[0] -= 1
            if _draws_users[0] == 0:
                _compat.restore_stateful_draw_ops(_draws_patches)
        _compat.put_back_global_random_state(saved, tape.drew)
