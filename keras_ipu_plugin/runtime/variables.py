"""Variables and the `tf.distribute` strategy that owns them: lists of variables
compared by identity, and the strategy checks shared by the conversion and
training paths.

Lists of variables, compared by identity (Keras compares variables by
value in `==`, so `in` on a list of them is wrong).

`tf.distribute` checks shared by the conversion and training paths.
"""

import tensorflow as tf

from keras_ipu_plugin import _compat
from keras_ipu_plugin.errors import ConversionError


def union_of_variables(first, second):
    """The variables of `first` then those of `second` not already in it."""
    seen, merged = set(), []
    for variable in list(first) + list(second):
        if id(variable) not in seen:
            seen.add(id(variable))
            merged.append(variable)
    return merged


def owning_strategy(variable):
    """The strategy that created `variable` (None for the default one)."""
    return _compat.variable_strategy(variable)


def strategy_owning(variables):
    """The strategy that created the first of `variables` made under one,
    else the current strategy: where new, related variables must be made.

    Example:
        ```python
        with strategy_owning(layer.weights).scope():
            new_layer.build(shape)
        ```
    """
    for variable in variables:
        strategy = owning_strategy(variable)
        if strategy is not None:
            return strategy
    return tf.distribute.get_strategy()


def check_built_under(model, strategy):
    """Raise when `model`'s variables were created outside `strategy`.

    Keras then fails only inside `fit` ("`colocate_vars_with` must only be
    passed a variable created in this tf.distribute.Strategy.scope()"), after
    the data pipeline and the train function are set up; this says what to
    do before any of that.

    Example:
        ```python
        with strategy.scope():
            check_built_under(model, strategy)
        ```
    """
    if strategy is None:  # the model was created outside any strategy scope
        return
    for variable in model.variables:
        if owning_strategy(variable) is not strategy:
            raise ConversionError(
                f"Variable `{variable.path}` of model `{model.name}` was created "
                f"outside the {type(strategy).__name__} that trains it. Create "
                "and build the model inside `with strategy.scope():` (or "
                "`with kip.scope(strategy):`), then convert or fit."
            )


def check_trains_under(model, optimizer, strategy):
    """Raise, before any step, when the variables of `model` or `optimizer`
    were created under another tf.distribute strategy than `strategy`, the
    one `fit` is about to train under.

    A model built (or compiled) under the default strategy and then fitted
    inside a `MirroredStrategy` scope, or the other way round: Keras fails in
    the first step with a bare `AssertionError` (plain Keras models too);
    this names the variable, both strategies and what to do.

    Example:
        ```python
        check_trains_under(model, model.optimizer, model.distribute_strategy)
        ```
    """
    trains_under = None if _compat.is_default_strategy(strategy) else strategy
    owners = [("model", model)]
    if optimizer is not None:
        owners.append(("optimizer", optimizer))
    for kind, owner in owners:
        for variable in owner.variables:
            made_under = owning_strategy(variable)
            if made_under is trains_under:
                continue
            made, trains = _name(made_under), _name(trains_under)
            if made == trains:
                made = f"another {made} object"
            raise ConversionError(
                f"Variable `{variable.path}` of {kind} `{owner.name}` was created "
                f"outside the {trains} that `fit` trains it under: under the "
                f"{made}. Keras trains variables only under the strategy that "
                "created them. Create and build the model, and compile it, "
                "inside the scope of the strategy that trains it (`with "
                "strategy.scope():` or `with kip.scope(strategy):`), then fit. To "
                "carry a model trained elsewhere over, re-create it inside that "
                "scope and copy its weights (`new_model.set_weights(model.get_weights())`)."
            )


def _name(strategy):
    if strategy is None:
        return "default strategy (no `strategy.scope()` active)"
    return type(strategy).__name__
