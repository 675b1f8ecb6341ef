"""Checks on the values a saved kip layer's config holds.

A `.keras` file is data someone else may have written. Each kip layer's
`from_config` checks every value it reads before using it, and a value of
the wrong kind is a `kip.LoadError` naming the layer and the key
(`"RandomDraw `noise`: arguments.stddev ..."`), raised before the layer
exists, so nothing a file names runs. Keras objects inside a config (a
wrapped layer, a seed generator, a `keras.ops` operation) are deserialized
by Keras itself, under its `safe_mode`.

Example:
    ```python
    saved_shape([None, 4], "read `scale`", "variable_shape")
    # -> (None, 4)
    saved_shape(["4"], "read `scale`", "variable_shape")
    ```
    Traceback (most recent call last):
    keras_ipu_plugin.errors.LoadError: read `scale`: variable_shape ...
"""

import sys

import keras
import numpy as np

from keras_ipu_plugin.errors import LoadError
from keras_ipu_plugin.errors import short_repr


def refuse(entry, key, expected, value):
    raise LoadError(f"{entry}: {key} must be {expected}; the file has {short_repr(value)}.")


def saved_bool(value, entry, key):
    if not isinstance(value, bool):
        refuse(entry, key, "true or false", value)
    return value


def saved_str(value, entry, key):
    if not isinstance(value, str):
        refuse(entry, key, "a string", value)
    return value


def saved_number(value, entry, key):
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        refuse(entry, key, "a number", value)
    return value


def saved_shape(value, entry, key, allow_unknown=True):
    """A shape: a list of non-negative ints (and None where allowed)."""
    if not isinstance(value, (list, tuple)) or not all(
        (dim is None and allow_unknown)
        or (isinstance(dim, int) and not isinstance(dim, bool) and dim >= 0)
        for dim in value
    ):
        refuse(entry, key, "a list of sizes (non-negative ints" +
               (" or null)" if allow_unknown else ")"), value)
    return tuple(value)


def saved_dtype(value, entry, key, allow_none=False):
    """A Keras dtype name (`"float32"`); never an object dtype."""
    if value is None and allow_none:
        return None
    try:
        standard = keras.backend.standardize_dtype(value) if isinstance(value, str) else None
    except (ValueError, TypeError):
        standard = None
    if standard is None or standard == "object":
        refuse(entry, key, "a dtype name such as 'float32'", value)
    return value


def saved_keys(config, entry, known):
    """`config`, a mapping whose keys are all among `known` (what the
    class's `get_config` and Keras's base `get_config` write)."""
    if not isinstance(config, dict):
        refuse(entry, "its config", "a mapping", config)
    unknown = [key for key in config if key not in known]
    if unknown:
        raise LoadError(f"{entry}: unknown key {short_repr(unknown[0])} (its config has "
                        f"{', '.join(sorted(known))}).")
    return config


#: The keys Keras's base layer writes in every layer's config.
LAYER_KEYS = ("name", "trainable", "dtype", "autocast")


def saved_layer_config(config, entry, own_keys=()):
    """A saved kip layer's config, checked before anything is made from
    it: a mapping of Keras's base layer keys and the layer's `own_keys`
    only, a string name, true / false for `trainable` and `autocast` (the
    layer's own values are checked by its `from_config`).

    Example:
        ```python
        saved_layer_config({"name": "n", "trainable": "no"}, "AttachMask `n`")
        ```
        Traceback (most recent call last):
        keras_ipu_plugin.errors.LoadError: AttachMask `n`: trainable must be true or false ...
    """
    saved_keys(config, entry, LAYER_KEYS + tuple(own_keys))
    saved_str(config.get("name"), entry, "name")
    for key in ("trainable", "autocast"):
        if key in config:
            saved_bool(config[key], entry, key)
    return config


def saved_class_entry(value, entry, key, kind, modules):
    """The class a saved Keras object `value` (`{"module": ..., "class_name":
    ...}`) names, read from the file without importing anything: its module
    must be one of `modules` (or a submodule) that is imported already, and
    the class a public class of `kind` defined there, found by its name in
    that module's namespace (one lookup, no attribute walk)."""
    expected = f"a saved {kind.__name__} (of {', '.join(modules)})"
    if not isinstance(value, dict):
        refuse(entry, key, expected, value)
    module, name = value.get("module"), value.get("class_name")
    registered = value.get("registered_name")
    if not (isinstance(module, str) and isinstance(name, str)
            and (registered is None or isinstance(registered, str))
            and any(module == m or module.startswith(m + ".") for m in modules)
            and name.isidentifier() and not name.startswith("_")
            and isinstance(value.get("config", {}), dict)):
        refuse(entry, key, expected, value)
    found = vars(sys.modules[module]).get(name) if module in sys.modules else None
    if not (isinstance(found, type) and issubclass(found, kind)):
        refuse(entry, key, expected, f"{module}.{name}")
    return found


def saved_keras_object(value, entry, key, kind, modules):
    """`value` deserialized by Keras (under its safe mode) when the file
    says it is a class of one of `modules` (`saved_class_entry`, checked
    before anything is made), then checked to be an instance of `kind`;
    any error Keras raises making it is a `LoadError` naming the entry."""
    saved_class_entry(value, entry, key, kind, modules)
    try:
        obj = keras.saving.deserialize_keras_object(value)
    except LoadError:
        raise
    except (ValueError, TypeError, KeyError, AttributeError) as error:
        raise LoadError(f"{entry}: {key} could not be made from the file: "
                        f"{short_repr(str(error))}") from error
    if not isinstance(obj, kind):
        refuse(entry, key, f"a saved {kind.__name__}", type(obj).__name__)
    return obj


def saved_user_layer(value, entry, key="layer"):
    """A layer of the user's that a kip layer wraps, made by Keras from its
    saved config (under Keras's safe mode: a `Lambda` needs safe_mode=False)."""
    if not isinstance(value, dict):
        refuse(entry, key, "a saved layer", value)
    _refuse_unregistered_class(value, entry, key)
    layer = keras.saving.deserialize_keras_object(value)
    if not isinstance(layer, keras.layers.Layer):
        refuse(entry, key, "a saved layer", type(layer).__name__)
    return layer


def _refuse_unregistered_class(value, entry, key):
    """A `LoadError` naming the user's class a saved layer names when this
    process has not registered it: Keras would say only that the kip layer
    holding it "could not be deserialized properly"."""
    module, registered = value.get("module"), value.get("registered_name")
    if isinstance(module, str) and (module == "keras" or module.startswith(
            ("keras.", "keras_hub.", "keras_ipu_plugin."))):
        return
    if not isinstance(registered, str):
        return  # no name to register it by: Keras's own error says what it could not find
    if keras.saving.get_registered_object(registered) is not None:
        return
    raise LoadError(
        f"{entry}: {key} is a `{value.get('class_name')}` (registered as `{registered}`"
        + (f", module `{module}`" if isinstance(module, str) else "")
        + "), a class this process has not registered. Import the module that defines it "
        "before loading; its class must be decorated with "
        "`@keras.saving.register_keras_serializable()`.")


def refuse_constant_call(operation, args, kwargs):
    """Raise a `LoadError` where a kip node is called on constants only:
    a graph calls each on a graph tensor (a symbolic one while building, a
    real one when it runs), so such a call is a node of an edited file that
    Keras is making while loading (a functional model of Keras's own class,
    whose nodes kip does not check first), and would run it eagerly.

    Example:
        ```python
        refuse_constant_call(square, (2.0,), {})
        ```
        Traceback (most recent call last):
        keras_ipu_plugin.errors.LoadError: TFFunction `square` is called with constants only ...
    """
    for leaf in keras.tree.flatten((args, kwargs)):
        if isinstance(leaf, (keras.KerasTensor, keras.Variable)) or keras.ops.is_tensor(leaf):
            return
        if hasattr(leaf, "dtype") and hasattr(leaf, "shape") and not isinstance(leaf, np.ndarray):
            return  # a backend variable or tensor-like value of the graph
    raise LoadError(
        f"{type(operation).__name__} `{operation.name}` is called with constants only (no "
        "tensor of the graph among its arguments). A graph calls every kip node on a graph "
        "tensor; a saved node giving it constants only comes from an edited file, and "
        "would run while loading. Nothing was run.")


def saved_function_config(entry, config):
    """`(function, name)` of a saved `{'function': path, 'name': name}`
    config of a layer that calls a TensorFlow function by its table path
    (`TFFunction`, `TFRandomDraw`: the path is resolved from their own
    table afterwards); `entry` names the layer class in the error.

    Example:
        ```python
        saved_function_config("TFFunction", {"function": "math.square", "name": "sq"})
        # -> ('math.square', 'sq')
        ```
    """
    if not isinstance(config, dict) or set(config) - {"function", "name"} or (
            "function" not in config):
        raise LoadError(
            f"{entry}: a saved config is {{'function': path, 'name': name}}; got "
            f"{short_repr(config)}."
        )
    return config["function"], config.get("name")


__all__ = ["LAYER_KEYS", "refuse", "saved_bool", "saved_class_entry", "saved_layer_config", "saved_function_config", "saved_dtype",
           "saved_keras_object", "saved_keys", "saved_number", "saved_shape", "saved_str",
           "saved_user_layer", "refuse_constant_call"]
