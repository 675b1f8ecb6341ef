"""What Keras objects hold and how Keras trains them:

- a layer's own sub-layers, losses, variables, constructor arguments and
  Keras's bookkeeping attributes;
- variables: their strategy, their stored value, stateless scopes, Keras's
  global seed generator;
- TensorFlow's tracking wrappers around a layer's containers: the raw
  container and what a wrapper records;
- a built optimizer's per-variable state (no public API extends one; what is
  done with it is `training/session/new_variables.py`'s);
- Keras's trainer: its step functions, `compile`'s settings, the symbolic
  build under a strategy, its progress output.

Part of `_compat`, the one package that touches private Keras / TensorFlow
APIs (see its `__init__`).
"""

import functools
import sys
import types

import tensorflow as tf
from keras.src.backend.common import global_state
from keras.src.utils import naming as _naming
from tensorflow.python.trackable import data_structures as _tf_data_structures


def all_layers(layer):
    """`layer` and every layer inside it, each once."""
    return layer._flatten_layers(include_self=True, recursive=True)


def sub_layers(layer, recursive=True):
    """The layers inside `layer` (all of them, or only its direct ones)."""
    return layer._flatten_layers(include_self=False, recursive=recursive)


def clear_own_losses(layer):
    """Forget the losses `layer` itself added (`add_loss`), as Keras does at
    the outermost call of a model (`layers/state.py`: a graph's loss
    node replaces what its previous run added); nothing in a stateless
    scope, whose losses are the scope's (a recomputed segment: the executor
    adds them to the layer afterwards). No public API clears them."""
    from keras.src import backend

    if backend.in_stateless_scope():
        return
    layer._losses.clear()
    layer._loss_ids.clear()


def own_losses(layer):
    """The losses `layer` itself added (`add_loss`), not its sub-layers'
    (`training/session/step_self.py`). No public API tells them apart."""
    return layer._get_own_losses()


def own_variables(layer):
    """The variables `layer` made itself (`add_weight`), not its
    sub-layers': what `layer.weights` adds to theirs, without walking them
    (comparing the blocks of a model reads every layer's)."""
    return [*layer._trainable_variables, *layer._non_trainable_variables]


def auto_layer_name_base(layer):
    """The name Keras gives `layer` when its constructor is given none,
    before its process-wide counter is appended (`Dense` -> `dense`)."""
    return _naming.to_snake_case(type(layer).__name__)


# Instance attributes Keras's own Layer / TensorFlow's Trackable code keeps on
# every layer while building and calling it: restoring the user's plain
# Python attributes after a conversion must leave these as Keras set them.
LAYER_BOOKKEEPING = frozenset({"built", "_called", "_path", "_parent_path", "_lock"})
TRACKABLE_PREFIX = "_self_"


def constructor_config(layer):
    """The arguments `layer` was constructed with, as Keras recorded them
    for its automatic `get_config` (a dict), or None where it did not
    (far cheaper than `get_config()`, which serializes every initializer)."""
    config = getattr(layer, "_auto_config", None)
    return None if config is None else dict(config.config)


# Modules of model code that ships inside Keras, written with its layers as
# a user's code is (ConvNeXt's `LayerScale`); the rest of Keras is its library.
KERAS_MODEL_CODE_MODULES = ("keras.src.applications.",)


def is_keras_model_code(module):
    """Whether `module` (a `__module__` string) is model code shipped inside
    Keras rather than Keras's layer library."""
    return module.startswith(KERAS_MODEL_CODE_MODULES)


#: Where Keras defines its `keras.ops` operation classes (what a saved
#: `BatchSizedOperation` may hold; Keras saves them by this module).
KERAS_OPERATION_MODULES = ("keras.src.ops",)
#: Where a saved `keras.random.SeedGenerator` says it is from.
SEED_GENERATOR_MODULES = ("keras.random", "keras.src.random")


@functools.lru_cache(maxsize=None)
def layer_bookkeeping_attributes():
    """The instance attributes every Keras layer has (`_layers`, `_tracked`,
    node lists, ...): Keras's, never a user's attribute."""
    import keras

    return frozenset(vars(keras.layers.Layer(name="kip_bare"))) | {"_tracked"}


def added_loss(layer, loss):
    """Whether `layer` added `loss` (`add_loss`, or its activity
    regularizer) inside the current `keras.StatelessScope`: Keras keeps the
    ids of the losses a layer added there, and no public accessor."""
    return id(loss) in getattr(layer, "_loss_ids", ())


def variable_strategy(variable):
    """The tf.distribute strategy that created `variable` (a Keras or a TF
    variable), or None for the default one."""
    return getattr(getattr(variable, "value", variable), "_distribute_strategy", None)


def is_default_strategy(strategy):
    """Whether `strategy` is TensorFlow's default one (no `strategy.scope()`
    active), under which variables have no strategy (`variable_strategy`)."""
    from tensorflow.python.distribute import distribute_lib

    return strategy is distribute_lib._get_default_strategy()


def stored_value(variable):
    """A read of `variable`'s stored value (its own dtype, whatever autocast
    scope is active): `variable.value` would already be cast to a mixed
    precision compute dtype. Gradients reach the variable through the read."""
    return tf.convert_to_tensor(variable._value)


def current_value(variable):
    """`variable`'s value as `call` would see it before any autocast: the
    value a surrounding `keras.StatelessScope` maps it to (a recomputed
    segment's weights, read once), else its stored value."""
    from keras.src.backend.common.stateless_scope import get_stateless_scope

    scope = get_stateless_scope()
    if scope is not None:
        value = scope.get_current_value(variable)
        if value is not None:
            return value
    return stored_value(variable)


def stateless_scope(state_mapping, collect_losses=False):
    """A `keras.StatelessScope` mapping each variable to its value in the
    variable's own dtype.

    `StatelessScope` converts each value to `variable.dtype`, which inside
    an autocast scope (any layer call under a mixed precision policy) is
    the compute dtype: a float32 layer in a float16 model then ran on
    weights rounded to float16. The scope is made with no autocast scope
    active; reads inside it still autocast as the calling layer asks.
    """
    import keras

    previous = global_state.get_global_attribute("autocast_scope")
    global_state.set_global_attribute("autocast_scope", None)
    try:
        return keras.StatelessScope(state_mapping=state_mapping, collect_losses=collect_losses)
    finally:
        global_state.set_global_attribute("autocast_scope", previous)


def writes_other_variables(scope, variables):
    """Whether the `keras.StatelessScope` `scope` holds a value assigned to
    a variable that is not one of `variables` (the values the scope was
    given are for those): a write its caller was not handed the variable
    of, such as a draw from a seed generator no layer it ran owns."""
    known = {id(variable) for variable in variables}
    return any(key not in known for key in scope.state_mapping)


def backing_variable(variable):
    """The TensorFlow variable behind a Keras variable (what a
    `tf.variable_creator_scope` sees being created)."""
    return getattr(variable, "_value", variable)


def global_seed_generator_state():
    """The state variable of Keras's global seed generator (what unseeded
    `keras.random.*` calls draw from), or None while none exists. Never
    creates one: creating it draws from Python's `random` module."""
    from keras.src.backend.common import global_state

    generator = global_state.get_global_attribute("global_seed_generator")
    return None if generator is None else generator.state


def variable_signature(variable):
    """`(shape tuple, dtype name, trainable)` of a Keras variable, as stored.

    The public `shape` of the TensorFlow backend's variable builds a
    `tf.TensorShape` at every read, and `dtype` consults the autocast
    scope: together about 6 microseconds a weight, which made comparing the
    blocks of a model (`replay.layer_signature`) cost a quarter of a
    conversion. The stored `_shape` (a tuple) and `_dtype` are what they
    report outside an autocast scope."""
    shape, dtype = getattr(variable, "_shape", None), getattr(variable, "_dtype", None)
    if not isinstance(shape, tuple) or not isinstance(dtype, str):
        shape, dtype = tuple(variable.shape), variable.dtype
    return shape, dtype, variable.trainable


def global_seed_variables():
    """The state of Keras's global seed generator (what `keras.random`
    draws from without a `seed`), if one was made: [] otherwise."""
    state = global_seed_generator_state()
    return [] if state is None else [state]


def raw_container(value):
    """The builtin list, dict or set that holds `value`'s items, or None
    when `value` is not a mutable container.

    TensorFlow's tracking wrappers (which Keras puts around the attributes
    of a functional model once it has been called) are not the builtin
    containers they look like: a `_DictWrapper` is a proxy for which
    `isinstance(w, dict)` holds while `dict.clear(w)` raises TypeError, and a
    `ListWrapper` keeps its items in `_storage`, not in its `list` base.
    Keras's own TrackedList / TrackedDict / TrackedSet are real subclasses.
    Writing through the raw container with the builtin methods bypasses the
    wrappers' tracking, which would otherwise re-track every item put back.
    """
    kind = type(value)
    if kind in NEVER_CONTAINERS:  # most values: checked first, as this runs per attribute
        return None
    if kind in OWN_STORAGE:
        return value
    if isinstance(value, _tf_data_structures._DictWrapper):
        return value.__wrapped__
    if isinstance(value, _tf_data_structures.List):
        return value._storage
    if isinstance(value, (list, dict, set)):
        OWN_STORAGE.add(kind)
        return value
    NEVER_CONTAINERS.add(kind)
    return None


#: Types whose values `raw_container` found not to be containers (it learns
#: them), so that walking a model's attributes costs a set lookup per value.
NEVER_CONTAINERS = {bool, int, float, str, bytes, type(None), tuple}
#: Types whose values are their own raw container, with no wrapper
#: bookkeeping (`list`, Keras's `TrackedList`, ...; learnt likewise).
OWN_STORAGE = {list, dict, set}


_WRAPPER_BOOKKEEPING = {
    # The copy of its items a wrapper compares with to notice changes made
    # behind its back (after which saving the model fails), and its flags.
    "_DictWrapper": ("_self_last_wrapped_dict_snapshot", "_self_external_modification",
                     "_self_non_string_key"),
    "ListWrapper": ("_last_wrapped_list_snapshot", "_external_modification_value",
                    "_non_append_mutation_value"),
}


_NO_BOOKKEEPING = types.MappingProxyType({})


def wrapper_bookkeeping(container):
    """Copies of what a TensorFlow tracking wrapper records about its items
    (empty for other containers), for `restore_wrapper_bookkeeping`."""
    names = _WRAPPER_BOOKKEEPING.get(type(container).__name__)
    if names is None:
        return _NO_BOOKKEEPING  # shared: a snapshot asks for tens of thousands
    saved = {}
    for name in names:
        value = getattr(container, name, None)
        saved[name] = type(value)(value) if isinstance(value, (list, dict)) else value
    return saved


def restore_wrapper_bookkeeping(container, saved):
    for name, value in saved.items():
        value = type(value)(value) if isinstance(value, (list, dict)) else value
        if type(container).__name__ == "_DictWrapper":
            setattr(container, name, value)  # a `_self_` name: kept on the proxy
        else:
            object.__setattr__(container, name, value)


def optimizer_trainable_variables(optimizer):
    """The variables `optimizer` holds state for, in its order (a copy)."""
    return list(getattr(optimizer, "_trainable_variables", []))


def optimizer_slot_lists(optimizer):
    """`{attribute: list}` of per-variable state lists (one entry per
    trainable variable, e.g. Adam's `_momentums`, EMA's averages): the
    optimizer's own lists, to read or replace (`set_optimizer_state`)."""
    count = len(optimizer_trainable_variables(optimizer))
    from keras.src.backend.common.variables import Variable

    lists = {}
    for name, value in vars(optimizer).items():
        # `_variables` is the optimizer's own list of everything it holds:
        # an SGD without momentum over two variables holds two (iterations,
        # learning rate), which looked like a per-variable list.
        if name in ("_trainable_variables", "_variables") or not isinstance(value, list):
            continue
        if count and len(value) == count and all(
            item is None or isinstance(item, Variable) for item in value
        ):
            lists[name] = value
    return lists


def set_optimizer_state(optimizer, slot_lists, variables, trainable_variables):
    """Make `optimizer` hold `slot_lists` (`{attribute: list}`, as
    `optimizer_slot_lists` names them), `variables` (everything it holds, in
    the order Keras saves it: `optimizer_own_variables`) and state for
    `trainable_variables`, in that order."""
    for name, slots in slot_lists.items():
        object.__setattr__(optimizer, name, slots)
    set_optimizer_variables(optimizer, variables)
    optimizer._trainable_variables = list(trainable_variables)
    optimizer._trainable_variables_indices = {
        optimizer._var_key(variable): index for index, variable in enumerate(trainable_variables)}


def optimizer_own_variables(optimizer):
    """Everything `optimizer` itself holds, in the order Keras saves it (a
    copy). `optimizer.variables` says the same, but for a
    LossScaleOptimizer, where it adds its inner optimizer's."""
    return list(optimizer._variables)


def set_optimizer_variables(optimizer, variables):
    """Make `variables` the list `optimizer.variables` returns (what Keras
    saves, by position, `optimizer_own_variables`); the same variables,
    perhaps in another order."""
    optimizer._variables = list(variables)


def optimizer_knows(optimizer, variable):
    """Whether a built `optimizer` holds state for `variable` (looked up as
    Keras looks it up: a distributed variable by its container)."""
    return optimizer._var_key(variable) in optimizer._trainable_variables_indices


def replace_optimizer_variable(optimizer, old, new):
    """Make a built `optimizer` hold `new` where it held `old`: `new` takes
    `old`'s index, so the per-variable state at that index becomes `new`'s,
    and `old` leaves the optimizer."""
    indices = optimizer._trainable_variables_indices
    index = indices.pop(optimizer._var_key(old))
    indices[optimizer._var_key(new)] = index
    optimizer._trainable_variables[index] = new


def make_step_function(model, step_function, jit_compile=None):
    """Keras's own train/test function maker (`TensorFlowTrainer._make_function`)
    around `step_function`: distribution, `jit_compile`, `steps_per_execution`
    and `run_eagerly` behave exactly as in `fit` / `evaluate`.

    `jit_compile`: XLA or not for this function where it differs from the
    model's compiled setting (None: the model's). The model is not changed:
    Keras's maker reads the setting from a view of it."""
    if jit_compile is None or bool(jit_compile) == bool(model.jit_compile):
        return model._make_function(step_function)
    return type(model)._make_function(_JitCompileView(model, bool(jit_compile)), step_function)


class _JitCompileView:
    """`model` as Keras's function maker reads it, but for `jit_compile`:
    every other attribute is the model's, read when the function reads it
    (`steps_per_execution` at each call, as on the model)."""

    def __init__(self, model, jit_compile):
        self.__dict__["_model"] = model
        self.__dict__["jit_compile"] = jit_compile

    def __getattr__(self, name):
        return getattr(self.__dict__["_model"], name)


def auto_jit_compile(model):
    """What Keras's `compile(jit_compile="auto")` resolves to for `model` on
    this machine (XLA where there is a GPU and no distribution strategy)."""
    return bool(model._resolve_auto_jit_compile())


def model_strategy(model):
    """The strategy `model` was created under, or None (Keras keeps it in a
    private attribute; `model.distribute_strategy` falls back to the current
    one, which hides whether the model was built inside a scope)."""
    return getattr(model, "_distribute_strategy", None)


def symbolic_build_from_one_replica(model, iterator=None, data_batch=None):
    """Keras's `_maybe_symbolic_build`, shaping the build from one replica's
    share of the first batch.

    Keras 3 (to at least 3.15) reduces a distributed first batch with
    `strategy.reduce("MEAN", ...)`, which fails under
    MultiWorkerMirroredStrategy ("Attempt to convert a value (PerReplica...)");
    only its shapes and dtypes matter here, so one replica's values do.
    """
    strategy = getattr(model, "_distribute_strategy", None)
    if strategy is None:
        return
    if iterator is not None:
        for _, _, epoch_iterator in iterator:
            batch = next(epoch_iterator)
            data_batch = tf.nest.map_structure(
                lambda v: strategy.experimental_local_results(v)[0]
                if isinstance(v, tf.distribute.DistributedValues) else v,
                batch,
            )
            break
    with strategy.scope():
        model._symbolic_build(data_batch=data_batch)


class OneReplicaSymbolicBuild:
    """A mixin for a `keras.Model` subclass of ours whose symbolic build
    takes one replica's batch (see `symbolic_build_from_one_replica`).

    Overriding Keras's private `_maybe_symbolic_build` is private access, so
    it lives here, in the one module allowed it.
    """

    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        symbolic_build_from_one_replica(self, iterator, data_batch)


def reduces_across_workers(strategy):
    """Whether Keras reduces step outputs with a collective across workers
    (MultiWorkerMirroredStrategy with more than one worker)."""
    extended = getattr(strategy, "extended", None)
    return isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy) and bool(
        getattr(extended, "_in_multi_worker_mode", lambda: False)()
    )


def compile_arguments(model):
    """The keyword arguments `model.compile` was last called with (Keras keeps
    them only in a private attribute), or None before `compile`."""
    config = getattr(model, "_compile_config", None)
    return None if config is None else dict(config.config)


def compile_config(model):
    """The object Keras keeps for `model`'s last `compile` call (a new one at
    each call), or None before `compile`."""
    return getattr(model, "_compile_config", None)


def saving_to_hdf5():
    """Whether Keras's legacy HDF5 writer (`model.save("m.h5")`,
    `keras.saving.save_model(model, "m.h5")`) is on the stack: it reads a
    model's config under its own names, which `load_model` cannot resolve
    for the plugin's registered classes."""
    frame = sys._getframe(1)
    while frame is not None:
        if (frame.f_code.co_name == "save_model_to_hdf5"
                and frame.f_globals.get("__name__", "").startswith("keras.src.legacy.saving")):
            return True
        frame = frame.f_back
    return False


def print_msg(message):
    """Print as Keras's progress bar does (`io_utils.print_msg`: to stdout,
    or to absl logging when interactive logging is off)."""
    from keras.src.utils import io_utils

    io_utils.print_msg(message)


def loss_tracker(model):
    """The `Mean` metric Keras's own `train_step` feeds the loss to (no
    public accessor; `model.metrics` lists it without saying which it is).
    The pipelined step (`training/pipelined/step.py`) feeds it the same."""
    return model._loss_tracker
