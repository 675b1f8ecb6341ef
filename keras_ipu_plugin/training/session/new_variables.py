"""Dynamically created variables: notice them, extend optimizers, rebuild.

A model may create variables after its first batch: a branch taken for the
first time, a layer switched on between epochs. Plain Keras then fails in
the optimizer ("Unknown variable ... This optimizer can only be called for
the variables it was originally built with").

- `VariableWatch` notices variable creation. In graph mode variables can only
  appear while a step is traced, so the step function counts its traces and
  looks at the model's variables only after one: compiled steps pay
  nothing. Eager steps run under a `tf.variable_creator_scope` that records
  creations; nothing walks the model's variables unless one was created.
- `extend_optimizer` gives a built optimizer state for new variables only:
  the old variables' moments, EMA and the iteration count are kept exactly.
- `hand_over_optimizer_state` gives the variables of layers a Replace pass
  made the state the optimizer holds for the layers they replace (a model
  loaded with its optimizer state builds the optimizer over the wrapped
  model's own layers, before any conversion made their replacements).
- `OptimizingFacade` stands in for an optimizer inside a train step, and
  extends it when it is asked to apply gradients to variables it does not
  know (so the new variables get their update in the step that created
  them); inside a `tf.function` trace or a replica it asks the caller to
  extend it outside and retrace instead (`NeedsExtension`).
"""

import contextlib

import tensorflow as tf

from keras_ipu_plugin import _compat
from keras_ipu_plugin.runtime.variables import strategy_owning


class VariableWatch:
    """Records variables created while `watching()` is active.

    Example:
        ```python
        watch = VariableWatch()
        with watch.watching():
            layer(x)
        watch.take()     # the variables created, and clears the record
        ```
    """

    def __init__(self, enabled=True):
        self.enabled = enabled  # off only to measure what watching costs
        self._created = []
        self._refused = []

    def _creator(self, next_creator, **kwargs):
        try:
            variable = next_creator(**kwargs)
        except Exception:
            # A `tf.function` refuses variables created on a later trace
            # than its first: noted here, so that the step function knows
            # the error came from a variable being created, not from the
            # user's code.
            self._refused.append(kwargs.get("name"))
            raise
        self._created.append(variable)
        return variable

    @contextlib.contextmanager
    def watching(self):
        if not self.enabled:
            yield self
            return
        with tf.variable_creator_scope(self._creator):
            yield self

    @property
    def changed(self):
        return bool(self._created)

    @property
    def refused(self):
        """Whether a variable creation failed while watching (since `take`)."""
        return bool(self._refused)

    def take(self):
        created, self._created, self._refused = self._created, [], []
        return created


class NeedsExtension(Exception):
    """Raised inside a trace: `optimizer` must learn `variables` first."""

    def __init__(self, optimizer, variables):
        self.optimizer = optimizer
        self.variables = variables
        super().__init__(
            f"optimizer `{optimizer.name}` meets new variables: "
            + ", ".join(v.path for v in variables)
        )


class NewVariablesError(ValueError):
    """New variables appeared and `rebuild_on_new_variables=False`."""


def extend_optimizer(optimizer, new_variables):
    """Give a built `optimizer` state for `new_variables`, keeping the rest.

    Example:
        ```python
        extend_optimizer(model.optimizer, [new_layer.kernel, new_layer.bias])
        ```
    """
    known = _compat.optimizer_trainable_variables(optimizer)
    known_ids = {id(v) for v in known}
    new_variables = [v for v in new_variables if id(v) not in known_ids]
    if not new_variables:
        return []
    if not optimizer.built:
        return new_variables  # built later on all variables by Keras itself
    strategy = strategy_owning([optimizer.iterations])
    with strategy.scope():
        scratch = optimizer.__class__.from_config(optimizer.get_config())
        scratch.build(known + new_variables)
        transplant_optimizer_state(optimizer, scratch, len(known))
    return new_variables


def transplant_optimizer_state(target, scratch, old_count):
    """Give `target` the state lists of `scratch` (built on target's old
    variables followed by the new ones), keeping target's own non-slot
    variables (iterations, learning rate, ...) and copying the old entries'
    values across."""
    old_lists = _compat.optimizer_slot_lists(target)
    new_lists = _compat.optimizer_slot_lists(scratch)
    for name, old in old_lists.items():
        new = new_lists[name]
        for index in range(old_count):
            if old[index] is not None:
                new[index].assign(old[index])
    in_new_lists = {id(v) for lst in new_lists.values() for v in lst if v is not None}
    in_old_lists = {id(v) for lst in old_lists.values() for v in lst if v is not None}
    target_others = iter([v for v in _compat.optimizer_own_variables(target) if id(v) not in in_old_lists])
    variables = [
        v if id(v) in in_new_lists else next(target_others) for v in _compat.optimizer_own_variables(scratch)
    ]
    _compat.set_optimizer_state(target, new_lists, variables,
                                _compat.optimizer_trainable_variables(scratch))


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

    Example:
        ```python
        with optimizer_state_in_order(model.optimizer, model.trainable_variables):
            model.save("model.keras")
        ```
    """
    layers = [optimizer, getattr(optimizer, "inner_optimizer", None)]
    saved = [(one, _compat.optimizer_own_variables(one)) for one in layers if one is not None and one.built]
    try:
        for one, current in saved:
            reordered = _variables_in_order(one, variables)
            if reordered is not None:
                _compat.set_optimizer_variables(one, reordered)
        yield
    finally:
        for one, current in saved:
            _compat.set_optimizer_variables(one, current)


def _variables_in_order(optimizer, variables):
    """The optimizer's own variables with the per-variable slots permuted to the
    order of `variables`, or None when they are not its own or it holds a
    variable without slots (`overwrite_with_gradient`: positions shift)."""
    known = _compat.optimizer_trainable_variables(optimizer)
    position = {id(v): index for index, v in enumerate(known)}
    sources = [position.get(id(v)) for v in variables]
    if (len(sources) != len(known) or None in sources or len(set(sources)) != len(sources)
            or sources == list(range(len(known)))):
        return None
    lists = _compat.optimizer_slot_lists(optimizer)
    if any(item is None for slots in lists.values() for item in slots):
        return None
    slot_of = {id(item): (slots, index) for slots in lists.values()
               for index, item in enumerate(slots)}
    reordered = []
    for variable in _compat.optimizer_own_variables(optimizer):
        if id(variable) in slot_of:
            slots, index = slot_of[id(variable)]
            variable = slots[sources[index]]
        reordered.append(variable)
    return reordered


def replaced_variable_pairs(replaced_layers):
    """`(old variable, new variable)` for each `(old layer, new layer)` of
    `replaced_layers`: each trainable variable of the new layer with the old
    layer's variable of the same weight name, shape and dtype (the pairing
    PluginModel copies weights back by before saving). A new variable with
    no such counterpart has none (a replacement with other parameters).

    Example:
        ```python
        replaced_variable_pairs(converted.kip_replaced)
        # -> [(<Variable path=head/kernel>, <Variable path=head/kernel>), ...]
        ```
    """
    pairs = []
    for old_layer, new_layer in replaced_layers:
        by_name = {v.name: v for v in old_layer.trainable_variables}
        for new in new_layer.trainable_variables:
            old = by_name.get(new.name)
            if (old is not None and old is not new and tuple(old.shape) == tuple(new.shape)
                    and old.dtype == new.dtype):
                pairs.append((old, new))
    return pairs


def hand_over_optimizer_state(optimizer, replaced_layers):
    """Give the variables of each new layer of `replaced_layers` (`(old,
    new)` layer pairs made by Replace) the state a built `optimizer` holds
    for the old layer's variables of the same name: the new variable takes
    the old one's place, moments and all, and the old one leaves the
    optimizer. Training then goes on as if the layer had never been
    replaced, as the weights copied by `Replacement(copy_weights=True)` do.
    Returns the `(old, new)` variable pairs handed over.

    Without it, a model whose optimizer was built over the replaced layers
    (loaded with its optimizer state, or built by `fit` before a callback
    converted) fails at the next step with Keras's "Unknown variable", or,
    extended instead, restarts the replaced layers' moments from zero.

    Example:
        ```python
        hand_over_optimizer_state(plugin.optimizer, converted.kip_replaced)
        ```
    """
    if not optimizer.built:
        return []  # built later by Keras, over the variables in use
    handed = []
    for old, new in replaced_variable_pairs(replaced_layers):
        if (_compat.optimizer_knows(optimizer, old)
                and not _compat.optimizer_knows(optimizer, new)):
            hand_over_optimizer_slot(optimizer, old, new)
            handed.append((old, new))
    return handed


def hand_over_optimizer_slot(optimizer, old, new):
    """Make `optimizer` apply to `new` what it applied to `old`: `new` takes
    `old`'s index, so its state (moments, EMA, accumulated gradients, every
    per-variable list) becomes `new`'s, and `old` leaves the optimizer.

    A LossScaleOptimizer keeps the per-variable state in its inner optimizer
    and an index of its own: both are handed over.
    """
    for one in (optimizer, getattr(optimizer, "inner_optimizer", None)):
        if one is not None and one.built:
            _compat.replace_optimizer_variable(one, old, new)


class OptimizingFacade:
    """An optimizer that learns unknown variables before applying to them.

    With `rebuild=False` it raises `NewVariablesError` naming the variables
    and their layers instead (Keras's behaviour, with a clearer message).
    While `skip()` is true it applies nothing (a step run only to see what
    it calls, see `training.StepFunction`); an optimizer not built yet is
    built there, or, given `defer_build`, handed to it with the variables
    to build on (`defer_build(optimizer, variables)`), for the caller to
    build once the run is over.
    """

    def __init__(self, optimizer, rebuild=True, owner=None, skip=None, defer_build=None):
        object.__setattr__(self, "_kip_optimizer", optimizer)
        object.__setattr__(self, "_kip_rebuild", rebuild)
        object.__setattr__(self, "_kip_owner", owner)
        object.__setattr__(self, "_kip_skip", skip or (lambda: False))
        object.__setattr__(self, "_kip_defer_build", defer_build)

    def __getattr__(self, name):
        return getattr(self._kip_optimizer, name)

    def __setattr__(self, name, value):
        setattr(self._kip_optimizer, name, value)

    def apply(self, grads, trainable_variables=None):
        if self._kip_skip():
            return self._build_only(trainable_variables)
        if trainable_variables is not None:
            self._learn(trainable_variables)
        return self._kip_optimizer.apply(grads, trainable_variables)

    def apply_gradients(self, grads_and_vars):
        grads_and_vars = list(grads_and_vars)
        if self._kip_skip():
            return self._build_only([v for _, v in grads_and_vars])
        self._learn([v for _, v in grads_and_vars])
        return self._kip_optimizer.apply_gradients(grads_and_vars)

    def _build_only(self, variables):
        # What the first apply would build, built (or left to the caller
        # to build), and nothing applied.
        if variables is not None and not self._kip_optimizer.built:
            if self._kip_defer_build is not None:
                self._kip_defer_build(self._kip_optimizer, list(variables))
            else:
                self._kip_optimizer.build(list(variables))
        return None

    def _learn(self, variables):
        optimizer = self._kip_optimizer
        if not optimizer.built:
            return
        # By identity, never by count: a Replace pass swaps variables for
        # others and keeps their number. Runs once per trace in graph mode;
        # an eager step pays one pass over its variables.
        known_ids = {id(v) for v in _compat.optimizer_trainable_variables(optimizer)}
        unknown = [v for v in variables if id(v) not in known_ids]
        if not unknown:
            return
        if not self._kip_rebuild:
            raise NewVariablesError(describe_new_variables(unknown, self._kip_owner))
        # Extend in place where variables may be created right here: eagerly,
        # outside any replica of a multi-device strategy, or from a replica
        # through `merge_call` (one extension for all replicas). Raising
        # NeedsExtension instead makes the caller run the step again, and an
        # eager step has already run its forward pass by now: its state
        # updates (counters, statistics, metrics, another optimizer's
        # update) would run twice.
        if tf.executing_eagerly():
            if tf.distribute.get_strategy().num_replicas_in_sync == 1:
                extend_optimizer(optimizer, unknown)
                return
            context = tf.distribute.get_replica_context()
            if context is not None:
                context.merge_call(lambda _: extend_optimizer(optimizer, unknown))
                return
        raise NeedsExtension(optimizer, unknown)


def describe_new_variables(variables, owner=None):
    names = ", ".join(f"`{v.path}`" for v in variables)
    layers = sorted({v.path.rsplit("/", 1)[0] for v in variables})
    model = f" of model `{owner.name}`" if owner is not None else ""
    return (
        f"New variables appeared during training{model}: {names} (in "
        f"{', '.join(layers)}). The optimizer was built without them. Pass "
        "rebuild_on_new_variables=True (the default) to kip.PluginModel / "
        "kip.PluginCallback to rebuild the graph and extend the optimizer."
    )


__all__ = [
    "VariableWatch", "NeedsExtension", "NewVariablesError", "extend_optimizer",
    "hand_over_optimizer_state", "replaced_variable_pairs",
    "OptimizingFacade", "describe_new_variables",
]
