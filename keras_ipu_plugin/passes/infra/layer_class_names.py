"""Names of layer classes in configs and in saved passes.

A layer class is named by a name given to `kip.register_layer`, by its
Keras name (`"Dense"` for `keras.layers.Dense`), or by its Keras registered
name (`"my_package>MyDense"`, from `@keras.saving.register_keras_serializable`,
also found in a `keras.saving.custom_object_scope`). `class_named` finds the
class a name names; `name_of_class` gives the name that finds the class
again, so a saved pass loads with the very classes it was made with.

Example:
    ```python
    @kip.register_layer
    class FastDense(keras.layers.Dense): ...
    class_named("FastDense") is FastDense
    # -> True
    name_of_class(keras.layers.Dense, "Replace")
    # -> 'Dense'
    ```
"""

import functools

import keras

from keras_ipu_plugin.errors import PassError

_registry = {}


def register_layer(cls, name=None):
    """Make a layer class nameable in configs (also usable as a decorator).

    Example:
        ```python
        @kip.register_layer
        class FastDense(keras.layers.Dense): ...
        kip.passes_from_config({"replace": {"Dense": {"class": "FastDense"}}})
        ```
    """
    if not is_layer_class(cls):
        raise TypeError(f"register_layer takes a keras Layer class; got {cls!r}.")
    _registry[name or cls.__name__] = cls
    return cls


def class_named(name):
    """The layer class `name` names, or None when it names none."""
    if not isinstance(name, str):
        return None
    if name in _registry:
        return _registry[name]
    for candidate in (_builtin_layer_classes().get(name),
                      keras.saving.get_registered_object(name)):
        if is_layer_class(candidate):
            return candidate
    return None


@functools.lru_cache(maxsize=None)
def _builtin_layer_classes():
    """`{name: class}` of the public layer classes of `keras.layers`: what a
    config's class name is looked up in (never as an attribute of its text)."""
    return {name: getattr(keras.layers, name) for name in dir(keras.layers)
            if not name.startswith("_") and is_layer_class(getattr(keras.layers, name))}


def name_of_class(cls, owner):
    """A name `class_named` turns back into `cls` (an error if none does:
    `owner`, the pass or argument holding `cls`, is named in it)."""
    candidates = [cls.__name__]
    candidates += [name for name, registered in _registry.items() if registered is cls]
    candidates.append(keras.saving.get_registered_name(cls))
    for name in candidates:
        if class_named(name) is cls:
            return name
    raise PassError(
        f"{owner}: the layer class {cls.__module__}.{cls.__qualname__} has no name to "
        "save it by; register it with kip.register_layer or "
        "@keras.saving.register_keras_serializable() (before saving and before loading)."
    )


def is_layer_class(value):
    return isinstance(value, type) and issubclass(value, keras.layers.Layer)
