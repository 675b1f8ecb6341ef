"""`tf.distribute` checks shared by the conversion and training paths."""

import tensorflow as tf

from keras_ipu_plugin import _compat

from keras_ipu_plugin.errors import ConversionError


def owning_strategy(variable):
    """The strategy that created `variable` (None for the default one)."""
    return _compat.variable_strategy(variable)


def strategy_owning(variables):
    """The strategy that created the first of `variables` made under one,
    else the current strategy: where new, related variables must be made.

    Example:
        >>> with strategy_owning(layer.weights).scope():
        ...     new_layer.build(shape)
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
        >>> with strategy.scope():
        ...     check_built_under(model, strategy)
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
