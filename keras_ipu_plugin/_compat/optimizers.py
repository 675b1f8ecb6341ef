"""A built optimizer's per-variable state (no public API extends one).

Part of `_compat`, the one package that touches private Keras / TensorFlow
APIs (see its `__init__`). What is done with the state (extending an
optimizer for new variables, handing a variable's state to another, saving
it in the model's order) is `training/session/new_variables.py`'s.
"""


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
