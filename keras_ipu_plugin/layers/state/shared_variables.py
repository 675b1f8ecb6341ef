"""One variable held by several layers of a graph, saved and loaded as one.

A graph's read and write nodes (`VariableRead`, `VariableWrite`) hold the
very variable they read or write, which a layer of the graph often holds
too: PixelCNN's masked conv is a `Conv2D` holding its kernel, a read of the
kernel and a write of it. Keras saves each layer's variables and loads a
file into new variables, one per layer: the conv would then read one
kernel and the write node write another, a silently different model.

`KipFunctional.get_config` records, in the config of each read or write
node whose variable another layer holds, where that variable is
(`variable_owner`: the layer's name and the variable's index in its
`weights`; a layer not a read or write node is preferred, else the first
node that holds it). Loading makes each such node hold the owner's
variable (`link_shared_variables`) before the weights are loaded.

Example:
    >>> config = model.get_config()        # `mark_shared_variables` ran
    >>> loaded = KipFunctional.from_config(config)
    >>> loaded.get_layer("first.conv.kernel.assign").variable is \\
    ...     loaded.get_layer("conv2d").kernel
    True
"""

from keras_ipu_plugin.layers import saved_values
from keras_ipu_plugin.layers.state.reads import HoldsVariable


def mark_shared_variables(model, config):
    """Put `variable_owner` in the saved config (`config`, `model`'s) of each
    read or write node whose variable another layer holds."""
    owners = {}  # id(variable) -> (owner name, index)
    holders = [layer for layer in model.layers if not isinstance(layer, HoldsVariable)]
    holders += [layer for layer in model.layers if isinstance(layer, HoldsVariable)]
    for layer in holders:
        for index, variable in enumerate(layer.weights):
            owners.setdefault(id(variable), (layer.name, index))
    entries = {entry.get("name") or entry.get("config", {}).get("name"): entry
               for entry in config.get("layers", [])}
    for layer in model.layers:
        if not isinstance(layer, HoldsVariable):
            continue
        owner = owners[id(layer.variable)]
        if owner[0] != layer.name and layer.name in entries:
            entries[layer.name]["config"]["variable_owner"] = list(owner)


def link_shared_variables(model, entry):
    """Make each loaded read or write node of `model` that names a
    `variable_owner` hold that layer's variable; `kip.LoadError` naming the
    node when the owner or the variable is not there or does not match."""
    for layer in model.layers:
        owner = getattr(layer, "variable_owner", None)
        if not isinstance(layer, HoldsVariable) or owner is None:
            continue
        where = f"{entry}: {type(layer).__name__} `{layer.name}`"
        name, index = owner
        found = [other for other in model.layers if other.name == name and other is not layer]
        if not found:
            saved_values.refuse(where, "variable_owner", "the name of another layer of the model",
                                name)
        weights = found[0].weights
        if index >= len(weights):
            saved_values.refuse(where, "variable_owner",
                                f"an index among the {len(weights)} weights of `{name}`", index)
        variable, placeholder = weights[index], layer.variable
        if (tuple(variable.shape) != tuple(placeholder.shape)
                or variable.dtype != placeholder.dtype
                or variable.trainable != placeholder.trainable):
            saved_values.refuse(
                where, "variable_owner",
                f"a variable of shape {tuple(placeholder.shape)}, {placeholder.dtype}, "
                f"trainable={placeholder.trainable}",
                f"`{variable.path}` of shape {tuple(variable.shape)}, {variable.dtype}, "
                f"trainable={variable.trainable}")
        layer.link_variable(variable)


__all__ = ["mark_shared_variables", "link_shared_variables"]
