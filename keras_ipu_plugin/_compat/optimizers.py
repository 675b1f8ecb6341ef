"""A built optimizer's per-variable state (no public API extends one).

Part of `_compat`, the one package that touches private Keras / TensorFlow
APIs (see its `__init__`)."""

import contextlib


def optimizer_trainable_variables(optimizer):
    return list(getattr(optimizer, "_trainable_variables", []))


def optimizer_slot_lists(optimizer):
    """`{attribute: list}` of per-variable state lists (one entry per
    trainable variable, e.g. Adam's `_momentums`, EMA's averages)."""
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


def transplant_optimizer_state(target, scratch, old_count):
    """Give `target` the state lists of `scratch` (built on target's old
    variables followed by the new ones), keeping target's own non-slot
    variables (iterations, learning rate, ...) and copying the old entries'
    values across."""
    old_lists = optimizer_slot_lists(target)
    new_lists = optimizer_slot_lists(scratch)
    for name, old in old_lists.items():
        new = new_lists[name]
        for index in range(old_count):
            if old[index] is not None:
                new[index].assign(old[index])
    in_new_lists = {id(v) for lst in new_lists.values() for v in lst if v is not None}
    in_old_lists = {id(v) for lst in old_lists.values() for v in lst if v is not None}
    target_others = iter([v for v in target._variables if id(v) not in in_old_lists])
    variables = [
        v if id(v) in in_new_lists else next(target_others) for v in scratch._variables
    ]
    for name, new in new_lists.items():
        object.__setattr__(target, name, new)
    target._variables = variables
    target._trainable_variables = scratch._trainable_variables[:]
    target._trainable_variables_indices = dict(scratch._trainable_variables_indices)


@contextlib.contextmanager
def optimizer_state_in_order(optimizer, variables):
    """Within: a built `optimizer` lists its state (`optimizer.variables`,
    what Keras saves, by position) in the order a build over `variables`
    would have made it. `variables` are the optimizer's own, in the order
    the model lists them when loaded; nothing but that list's order changes.

    Keras loads saved optimizer state by position into an optimizer built
    over the loaded model's variables. An optimizer extended for variables
    created after the first batch holds them last: saved as it is, a grown
    layer's moments loaded into its neighbour's (silently, where the shapes
    agree). Keras's optimizers build their state variable by variable, so
    the slots of the i-th variable take the place of those of the variable
    now at that index.
    """
    layers = [optimizer, getattr(optimizer, "inner_optimizer", None)]
    saved = [(one, one._variables) for one in layers if one is not None and one.built]
    try:
        for one, current in saved:
            reordered = _variables_in_order(one, variables)
            if reordered is not None:
                one._variables = reordered
        yield
    finally:
        for one, current in saved:
            one._variables = current


def _variables_in_order(optimizer, variables):
    """`optimizer._variables` with the per-variable slots permuted to the
    order of `variables`, or None when they are not its own or it holds a
    variable without slots (`overwrite_with_gradient`: positions shift)."""
    known = optimizer_trainable_variables(optimizer)
    position = {id(v): index for index, v in enumerate(known)}
    sources = [position.get(id(v)) for v in variables]
    if (len(sources) != len(known) or None in sources or len(set(sources)) != len(sources)
            or sources == list(range(len(known)))):
        return None
    lists = optimizer_slot_lists(optimizer)
    if any(item is None for slots in lists.values() for item in slots):
        return None
    slot_of = {id(item): (slots, index) for slots in lists.values()
               for index, item in enumerate(slots)}
    reordered = []
    for variable in optimizer._variables:
        if id(variable) in slot_of:
            slots, index = slot_of[id(variable)]
            variable = slots[sources[index]]
        reordered.append(variable)
    return reordered


def optimizer_knows(optimizer, variable):
    """Whether a built `optimizer` holds state for `variable` (looked up as
    Keras looks it up: a distributed variable by its container)."""
    return optimizer._var_key(variable) in optimizer._trainable_variables_indices


def hand_over_optimizer_slot(optimizer, old, new):
    """Make `optimizer` apply to `new` what it applied to `old`: `new` takes
    `old`'s index, so its state (moments, EMA, accumulated gradients, every
    per-variable list) becomes `new`'s, and `old` leaves the optimizer.

    A LossScaleOptimizer keeps the per-variable state in its inner optimizer
    and an index of its own: both are handed over.
    """
    for one in (optimizer, getattr(optimizer, "inner_optimizer", None)):
        if one is None or not one.built:
            continue
        indices = one._trainable_variables_indices
        index = indices.pop(one._var_key(old))
        indices[one._var_key(new)] = index
        one._trainable_variables[index] = new
