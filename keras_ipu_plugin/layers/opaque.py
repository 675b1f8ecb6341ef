"""`OpaqueLayer`: one graph node that runs a layer's original Python code.

A layer whose `call` cannot be traced into Keras layers (Python `if` on a
tensor value, say) is wrapped, not changed: the wrapper holds the original
layer (so the variables are the same objects) and, in graph mode, runs the
original `call` through AutoGraph so that such Python control flow becomes
TensorFlow control flow and trains in `model.fit` without `run_eagerly`.

Keras 3 never applies AutoGraph itself, and AutoGraph does not convert code
reached through a Keras `Layer.__call__`, so converting only the wrapped
layer's `call` would leave a dynamic *sub-layer* (a custom block with a
Python `if` inside an otherwise plain model) failing in graph mode. In graph
mode the wrapper therefore calls a *view* of the layer (`_autograph_view`):
an object of a subclass whose `call` is AutoGraph-converted, sharing the
layer's variables and state, with user-written sub-layers viewed the same
way. The user's layers are never modified.
"""

import functools

import keras
import tensorflow as tf

from keras_ipu_plugin.layers import saved_values
from keras_ipu_plugin.layers.user_code import takes_training
from keras_ipu_plugin.layers.views import layer_view


@keras.saving.register_keras_serializable(package="keras_ipu_plugin")
class OpaqueLayer(keras.layers.Layer):
    """Runs `layer`'s own `call`; output shapes come from a real first call.

    Example:
        >>> node = OpaqueLayer(model, output_specs=..., reason="Python `if` on a tensor")
    """

    def __init__(self, layer, output_specs, reason="", **kwargs):
        kwargs.setdefault("name", f"{layer.name}_opaque")
        kwargs.setdefault("dtype", layer.dtype_policy)
        super().__init__(**kwargs)
        self.layer = layer
        self.reason = reason
        # nest of (shape, dtype) with the batch dimension None where it varies
        self.output_specs = output_specs
        self._takes_training = takes_training(layer)
        self.built = True

    def call(self, *args, training=None, **kwargs):
        if self._takes_training:
            kwargs["training"] = training
        if tf.executing_eagerly():
            return self.layer(*args, **kwargs)
        return autograph_call(self.layer, args, kwargs)

    def compute_output_spec(self, *args, **kwargs):
        return _specs_to_tensors(self.output_specs)

    def get_config(self):
        config = super().get_config()
        config.update(
            layer=keras.saving.serialize_keras_object(self.layer),
            output_specs=_specs_to_config(self.output_specs),
            reason=self.reason,
        )
        return config

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        entry = f"OpaqueLayer `{config.get('name')}`"
        saved_values.saved_layer_config(config, entry, ("layer", "reason", "output_specs"))
        saved_values.saved_str(config.get("reason", ""), entry, "reason")
        config["output_specs"] = _specs_from_config(config.get("output_specs"), entry)
        config["layer"] = saved_values.saved_user_layer(config.get("layer"), entry)
        return cls(**config)


def autograph_call(layer, args, kwargs):
    """`layer(*args, **kwargs)` as an `OpaqueLayer` runs it in graph mode.

    AutoGraph turns Python control flow on tensors into tf.cond /
    tf.while_loop; going through `__call__` keeps Keras's own handling of
    masks, autocasting and the training context.
    """
    return _autograph_view(layer)(*args, **kwargs)


def output_specs_of(outputs, batch_size, static_batch):
    """(shape, dtype) specs of real outputs, the batch dimension made None
    where it equals the batch size (unless the batch is static)."""

    def spec(tensor):
        shape = list(tensor.shape)
        if shape and not static_batch and shape[0] == batch_size:
            shape[0] = None
        return _Spec((tuple(shape), keras.backend.standardize_dtype(tensor.dtype)))

    return keras.tree.map_structure(spec, outputs)


class _Spec(tuple):
    """A (shape, dtype) pair that keras.tree treats as one leaf."""


def _is_spec(x):
    return isinstance(x, _Spec)


def _specs_to_tensors(specs):
    if _is_spec(specs):
        return keras.KerasTensor(specs[0], dtype=specs[1])
    if isinstance(specs, dict):
        return {k: _specs_to_tensors(v) for k, v in specs.items()}
    return type(specs)(_specs_to_tensors(v) for v in specs)


def _specs_to_config(specs):
    if _is_spec(specs):
        return {"shape": list(specs[0]), "dtype": specs[1]}
    if isinstance(specs, dict):
        return {"dict": {k: _specs_to_config(v) for k, v in specs.items()}}
    return {"list": [_specs_to_config(v) for v in specs], "tuple": isinstance(specs, tuple)}


def _specs_from_config(config, entry, depth=0):
    key = "output_specs"
    if not isinstance(config, dict) or depth > 32:
        saved_values.refuse(entry, key, "nested {shape, dtype} specs", config)
    if set(config) == {"shape", "dtype"}:
        return _Spec((saved_values.saved_shape(config["shape"], entry, key),
                      saved_values.saved_dtype(config["dtype"], entry, key)))
    if set(config) == {"dict"} and isinstance(config["dict"], dict):
        return {k: _specs_from_config(v, entry, depth + 1) for k, v in config["dict"].items()}
    if set(config) == {"list", "tuple"} and isinstance(config["list"], list):
        items = [_specs_from_config(v, entry, depth + 1) for v in config["list"]]
        return tuple(items) if saved_values.saved_bool(config["tuple"], entry, key) else items
    saved_values.refuse(entry, key, "nested {shape, dtype} specs", config)


@functools.lru_cache(maxsize=None)
def _converted(function):
    """`function` converted by AutoGraph (cached: conversion parses source)."""
    try:
        return tf.autograph.to_graph(function)
    except Exception:  # no source to convert (defined in exec, a C call)
        return function


@functools.lru_cache(maxsize=None)
def _view_class(cls, function):
    """A subclass of `cls` whose `call` is `function` converted by AutoGraph.

    Being a subclass keeps `isinstance` and zero-argument `super()` in the
    user's code working.
    """
    return type(cls.__name__, (cls,), {"call": _converted(function), "__module__": cls.__module__})


def _autograph_view(layer):
    """A view (`views.layer_view`) of `layer` whose user-written `call`s, its
    own and its sub-layers', run AutoGraph-converted."""
    return layer_view(layer, _view_class)
