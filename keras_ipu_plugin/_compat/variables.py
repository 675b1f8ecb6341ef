"""Variables: their strategy, their stored value, stateless scopes, Keras's global seed generator.

Part of `_compat`, the one package that touches private Keras / TensorFlow
APIs (see its `__init__`)."""

import tensorflow as tf
from keras.src.backend.common import global_state


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
