"""Views of user layers: stand-ins that run a layer's code differently
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
    >>> view = layer_view(model, lambda cls, call: type(cls.__name__, (cls,), {}))
    >>> view.blocks[0] is not model.blocks[0]   # a view of the block
    True
"""

from keras_ipu_plugin.layers.user_code import LIBRARY_PACKAGES
from keras_ipu_plugin.layers.user_code import user_call


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
    import keras

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
        >>> view = shallow_view(dense, type("Dense", (keras.layers.Dense,), {}))
        >>> view.kernel is dense.kernel and viewed_layer(view) is dense
        True
    """
    view = object.__new__(view_class)
    state = dict(vars(layer))
    state[_VIEWED] = layer
    object.__setattr__(view, "__dict__", state)
    return view


def viewed_layer(obj):
    """The user's layer `obj` is a view of, or None when it is not a view."""
    return getattr(obj, "__dict__", {}).get(_VIEWED)


__all__ = ["layer_view", "shallow_view", "viewed_layer", "user_call", "LIBRARY_PACKAGES"]
