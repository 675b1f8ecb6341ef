"""User code: the one rule for what is user code, the one probe for `training`,
and the views that run a user layer's code differently without changing the
layer.

The one rule for what is user code, and the one probe for `training`.

Tracing goes through user code and stops at library code. For a layer the
rule is `is_user_layer`: its class is not one `keras.layers` exports (whose
`call` is Keras's formula) nor the plugin's own. A user's subclass of a Keras
layer is user code, and so are the classes Keras ships without exporting
them (`keras.src.applications`: ConvNeXt's `LayerScale`, model code written
with Keras layers like a user's). For code (a module, a source file, a
function) it is `is_user_module`: written outside the library packages, or
in Keras's applications. Tracing runs a `call` inline only where both say
so (`user_call`): a user's subclass of `Dense` that keeps `Dense.call` is a
layer Expand may inline, but its `call` runs as Keras runs it.

Every place that asks "is this user code?" asks one of these: which layers
tracing makes views of (`user_call`), which layers Expand inlines
(`is_user_layer`, through `layer_kinds.is_expandable` and the `Tracer`),
which layers' attributes are put back after a trace and which frame of a
traceback is the user's line (`is_user_class`, `is_user_source`). Every
place that asks whether a layer's `call` takes `training` asks
`takes_training`. The frontend's `Tracer` (`frontend/trace/tracer.py`) exposes
the layer rule and the probe as overridable hooks.

Example:
    ```python
    is_user_module("keras.src.layers.core.dense"), is_user_module("my_model")
    # -> (False, True)
    is_user_layer(keras.layers.Dense(2)), is_user_layer(MyBlock())
    # -> (False, True)
    takes_training(keras.layers.Dropout(0.1)), takes_training(keras.layers.Flatten())
    # -> (True, False)
    ```

Views of user layers: stand-ins that run a layer's code differently
without changing the layer.

A view of `layer` is a new object of a subclass of the layer's class (made by
a `view_class(cls, call)` factory), holding a shallow copy of the layer's
attributes in which user-written sub-layers are replaced by their own views.
It shares every variable, state list and Keras-internal list with the layer;
the user's objects are only read. Layers without user code (Keras's own) are
used as they are. Being a subclass keeps `isinstance` and zero-argument
`super()` in the user's code working.

`opaque.py` uses views whose `call` is AutoGraph-converted; the trace
(`frontend/trace/trace_views.py`) uses views whose symbolic calls are traced
inline on KerasTensors.

Example:
    ```python
    view = layer_view(model, lambda cls, call: type(cls.__name__, (cls,), {}))
    view.blocks[0] is not model.blocks[0]   # a view of the block
    # -> True
    ```
"""

import functools
import inspect
import re

import keras

from keras_ipu_plugin import _compat

__all__ = [
    "LIBRARY_PACKAGES",
    "is_user_module",
    "is_user_class",
    "is_user_layer",
    "user_call",
    "is_user_source",
    "takes_training",
    "takes_keyword",
    "layer_view",
    "shallow_view",
    "viewed_layer",
    "user_call",
    "LIBRARY_PACKAGES",
]


# The library packages: code written there is not the user's. (optree is
# Keras's tree library: its frames sit between the user's code and Keras's
# in a traceback.)
LIBRARY_PACKAGES = ("keras", "tf_keras", "tensorflow", "keras_ipu_plugin", "optree")


def is_keras_module(module):
    """Whether a class of the module named `module` is one of Keras's own
    (a saved file names it, and Keras alone resolves it)."""
    module = module or ""
    return module == "keras" or module.startswith("keras.")


def is_user_module(module):
    """Whether code of the module named `module` is user code: not of a
    library package, or Keras's model code (its applications)."""
    module = module or ""
    return module.split(".")[0] not in LIBRARY_PACKAGES or _compat.is_keras_model_code(module)


def is_user_class(cls):
    """Whether class `cls` is written in user code (`is_user_module`)."""
    return is_user_module(getattr(cls, "__module__", "") or "")


# The classes the public `keras.layers` namespace exports (exact classes: a
# subclass is user code).
_KERAS_LAYER_CLASSES = frozenset(
    value for value in vars(keras.layers).values()
    if isinstance(value, type) and issubclass(value, keras.layers.Layer)
)


def is_user_layer(layer):
    """Whether `layer` is user code: its class is not one `keras.layers`
    exports (exactly: a subclass is user code) nor the plugin's own.
    (`tests/passes/test_expand_public_architectures.py` pins a user's subclass of
    `Dense` and Keras's applications' `LayerScale` as user code.)"""
    cls = type(layer)
    return cls not in _KERAS_LAYER_CLASSES and not (cls.__module__ or "").startswith(
        "keras_ipu_plugin.")


def user_call(layer, is_user=is_user_layer, through_overrides=False):
    """The `call` tracing runs inline for `layer`: its class's, where the
    layer is user code (`is_user(layer)`) and the `call` is written in user
    code (`is_user_module`: a user's subclass of `Dense` keeping `Dense.call`
    is called as Keras calls a `Dense`), or, with `through_overrides` (the
    trace's question), where Keras's `call` reaches a method the user's class
    overrides (`overridden_helpers`); None
    otherwise, and for a `call` set on the instance by its owner (left as it
    is)."""
    if "call" in vars(layer) or not is_user(layer):
        return None
    function = getattr(type(layer), "call", None)
    if function is None:
        return None
    if not is_user_module(getattr(function, "__module__", "")) and not (
            through_overrides and overridden_helpers(type(layer))):
        return None
    return function


# Methods a Keras layer calls around `call` (construction, building,
# shapes, saving), not from it: a user's override of one leaves `call`
# Keras's own.
_NOT_CALLED_BY_CALL = frozenset({
    "__init__", "build", "build_from_config", "get_config", "from_config", "get_build_config",
    "compute_output_shape", "compute_output_spec", "compute_mask", "_build_attention",
    "_build_from_signature", "add_weight", "save_own_variables", "load_own_variables",
})


def overridden_helpers(cls):
    """The names of the methods of Keras's own base of `cls` that a user's
    class between them overrides, which `call` may reach: a
    `MultiHeadAttention` subclass overriding `_compute_attention` runs the
    user's code (and its weights) from Keras's `call`, so tracing must run
    that `call` inline too. Empty for a class that only adds `build` or
    `get_config`.

    Example:
        ```python
        class Biased(keras.layers.MultiHeadAttention):
            def _compute_attention(self, *args, **kwargs): ...
        overridden_helpers(Biased)
        # -> ['_compute_attention']
        ```
    """
    user_classes = [base for base in cls.__mro__ if base is not object and is_user_class(base)]
    library = [base for base in cls.__mro__ if base is not object and not is_user_class(base)]
    found = []
    for base in user_classes:
        for name, value in vars(base).items():
            if (name in _NOT_CALLED_BY_CALL or name == "call" or not callable(value)
                    or (name.startswith("__") and name.endswith("__"))):
                continue
            if any(name in vars(keras_base) for keras_base in library) and name not in found:
                found.append(name)
    return found


_LIBRARY_PATHS = re.compile(
    r"[/\\](" + "|".join(re.escape(package) for package in LIBRARY_PACKAGES) + r")[/\\]")


def is_user_source(filename):
    """Whether the source file `filename` (a traceback frame's) is user
    code: outside the library packages' folders. (A frame knows its file
    before its module: AutoGraph's converted code has a module of its own.)"""
    return not _LIBRARY_PATHS.search(filename or "")


def takes_training(layer_or_function):
    """Whether a layer's `call` (or a function) has a parameter named
    `training`: Keras's own rule for handing a layer its training mode
    (`Layer.__init__` reads the same signature), so a `call` that only
    forwards `**kwargs` is not handed it. A signature Python cannot read
    counts as none."""
    function = layer_or_function
    if isinstance(function, keras.layers.Layer):
        function = function.call
    function = getattr(function, "__func__", function)
    try:
        return _takes_training(function)
    except TypeError:  # an unhashable callable
        return _signature_takes_training(function)


@functools.lru_cache(maxsize=None)
def _takes_training(function):
    # By the function (a class's `call`, not a bound method): Expand asks
    # once per block of a model of hundreds.
    return _signature_takes_training(function)


def _signature_takes_training(function):
    try:
        return "training" in inspect.signature(function).parameters
    except ValueError:  # no signature (a builtin)
        return False


def takes_keyword(function, name):
    """Whether `function` can be called with keyword `name`: a parameter of
    that name, or `**kwargs` (or a signature Python cannot read). For
    functions other than a layer's `call`, which Keras hands whatever `call`
    was given (a `compute_output_spec`)."""
    try:
        parameters = inspect.signature(function).parameters
    except (TypeError, ValueError):
        return True
    return name in parameters or any(
        p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())


_VIEWED = "_kip_viewed_layer"  # in a view's own dict: the layer it views

# Types whose values are neither layers nor containers (learnt as views are
# made): a view of a model copies every attribute of every layer, most of
# them Keras's bookkeeping, and a set lookup is cheaper than four isinstance
# checks each.
_HOLDS_NO_LAYER = {bool, int, float, str, bytes, type(None)}


def layer_view(layer, view_class, memo=None, traced_call=user_call):
    """A view of `layer` whose class is `view_class(type(layer), function)`,
    `function` being `traced_call(layer)`: the `call` of user code
    (`user_code.user_call`; a `Tracer` may say otherwise), None for a layer
    used as it is; `memo` ({id(layer): view}) shares one view per layer
    across a call."""
    memo = {} if memo is None else memo
    if id(layer) in memo:
        return memo[id(layer)]
    function = traced_call(layer)
    if function is None:
        memo[id(layer)] = layer
        return layer
    view = object.__new__(view_class(type(layer), function))
    memo[id(layer)] = view

    def views_in(value):
        kind = type(value)
        if kind in _HOLDS_NO_LAYER:
            return value
        if isinstance(value, keras.layers.Layer):
            return layer_view(value, view_class, memo, traced_call)
        if isinstance(value, (list, tuple)) and any(isinstance(v, keras.layers.Layer) for v in value):
            views = [views_in(v) for v in value]
            return tuple(views) if isinstance(value, tuple) else views
        if isinstance(value, dict) and any(isinstance(v, keras.layers.Layer) for v in value.values()):
            return {k: views_in(v) for k, v in value.items()}
        if not isinstance(value, (list, tuple, dict)):
            _HOLDS_NO_LAYER.add(kind)
        return value

    holds_no_layer = _HOLDS_NO_LAYER
    state = {name: value if type(value) in holds_no_layer else views_in(value)
             for name, value in vars(layer).items()}
    state[_VIEWED] = layer
    object.__setattr__(view, "__dict__", state)
    return view


def shallow_view(layer, view_class):
    """A view of `layer` of class `view_class` (a subclass of the layer's)
    holding the layer's own attributes, sub-layers included, as they are.

    Example:
        ```python
        view = shallow_view(dense, type("Dense", (keras.layers.Dense,), {}))
        view.kernel is dense.kernel and viewed_layer(view) is dense
        # -> True
        ```
    """
    view = object.__new__(view_class)
    state = dict(vars(layer))
    state[_VIEWED] = layer
    object.__setattr__(view, "__dict__", state)
    return view


def viewed_layer(obj):
    """The user's layer `obj` is a view of, or None when it is not a view."""
    return getattr(obj, "__dict__", {}).get(_VIEWED)
