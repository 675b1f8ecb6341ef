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

A layer (the whole model, most often) whose `call` returns another output
structure in training than in inference (a recommender adding top-k
`"predictions"` in inference only) is held with the specs of each mode
(`mode_output_specs`): the node's outputs are the leaves of every mode, one
mode after the other, and a call fills those of the mode it runs (the
others are scalar zeros no one reads); `mode_outputs()` says which outputs
are each mode's, for the model around it to return that mode's structure.
"""

import functools

import keras
import numpy as np
import tensorflow as tf

from keras_ipu_plugin.layers import saved_values
from keras_ipu_plugin.layers.user_code import takes_training
from keras_ipu_plugin.layers.user_code import layer_view


@keras.saving.register_keras_serializable(package="keras_ipu_plugin")
class OpaqueLayer(keras.layers.Layer):
    """Runs `layer`'s own `call`; output shapes come from a real first call.

    Example:
        ```python
        node = OpaqueLayer(model, output_specs=..., reason="Python `if` on a tensor")
        ```
    """

    def __init__(self, layer, output_specs, reason="", mode_output_specs=None,
                 none_means="inference", **kwargs):
        kwargs.setdefault("name", f"{layer.name}_opaque")
        kwargs.setdefault("dtype", layer.dtype_policy)
        super().__init__(**kwargs)
        self.layer = layer
        self.reason = reason
        # nest of (shape, dtype) with the batch dimension None where it varies
        self.output_specs = output_specs
        # {mode: specs} where the output structure depends on `training`
        # (modes as `MODE_TRAINING`: training, inference, default), else None
        self.mode_output_specs = None if mode_output_specs is None else dict(mode_output_specs)
        if self.mode_output_specs is not None and none_means not in self.mode_output_specs:
            raise ValueError(f"`none_means` {none_means!r} is none of the modes held "
                             f"({', '.join(self.mode_output_specs)}).")
        self.none_means = none_means
        self._takes_training = takes_training(layer)
        self.built = True

    def call(self, *args, training=None, **kwargs):
        if self._takes_training:
            kwargs["training"] = training
        if tf.executing_eagerly():
            outputs = self.layer(*args, **kwargs)
        else:
            outputs = autograph_call(self.layer, args, kwargs)
        if self.mode_output_specs is None:
            return outputs
        return self._every_mode(outputs, self.mode_for(training))

    def mode_for(self, training):
        """The mode (a key of `mode_output_specs`) a call with this
        `training` value runs."""
        if training is None:
            return self.none_means
        if isinstance(training, (bool, np.bool_)):
            return "training" if training else "inference"
        raise TypeError(
            f"`{self.name}` returns another structure in training than in inference: "
            f"it needs a Python True / False / None as `training`, not "
            f"{type(training).__name__} {training!r}.")

    def mode_outputs(self):
        """`{mode: nest of output indices}`: which of the node's outputs make
        each mode's structure (None where one structure serves every mode)."""
        if self.mode_output_specs is None:
            return None
        found, start = {}, 0
        for mode, specs in self.mode_output_specs.items():
            count = len(_flat_specs(specs))
            indices = iter(range(start, start + count))
            found[mode] = _map_specs(lambda spec: next(indices), specs)
            start += count
        return found

    def _every_mode(self, outputs, mode):
        """The leaves of every mode, this mode's from `outputs`, the others
        scalar zeros (never returned: `mode_outputs` picks this mode's)."""
        expected = self.mode_output_specs[mode]
        leaves = keras.tree.flatten(outputs)
        held = _map_specs(lambda spec: "tensor", expected)
        given = keras.tree.map_structure(lambda leaf: "tensor", outputs)
        if held != given:
            raise ValueError(
                f"`{self.layer.name}` returned another structure in {mode} than when it "
                f"was converted: {given!r}, not {held!r}.")
        found = []
        for each, specs in self.mode_output_specs.items():
            if each == mode:
                found.extend(leaves)
            else:
                found.extend(keras.ops.zeros((), dtype=spec[1]) for spec in _flat_specs(specs))
        return found

    def compute_output_spec(self, *args, **kwargs):
        if self.mode_output_specs is None:
            return _specs_to_tensors(self.output_specs)
        return [_specs_to_tensors(spec) for specs in self.mode_output_specs.values()
                for spec in _flat_specs(specs)]

    def get_config(self):
        config = super().get_config()
        config.update(
            layer=keras.saving.serialize_keras_object(self.layer),
            output_specs=_specs_to_config(self.output_specs),
            reason=self.reason,
        )
        if self.mode_output_specs is not None:
            config.update(
                mode_output_specs={mode: _specs_to_config(specs)
                                   for mode, specs in self.mode_output_specs.items()},
                none_means=self.none_means)
        return config

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        entry = f"OpaqueLayer `{config.get('name')}`"
        saved_values.saved_layer_config(
            config, entry, ("layer", "reason", "output_specs", "mode_output_specs",
                            "none_means"))
        saved_values.saved_str(config.get("reason", ""), entry, "reason")
        config["output_specs"] = _specs_from_config(config.get("output_specs"), entry)
        modes = config.get("mode_output_specs")
        if modes is not None:
            if not (isinstance(modes, dict) and {"training", "inference"} <= set(modes)
                    and set(modes) <= set(MODES)):
                saved_values.refuse(entry, "mode_output_specs",
                                    "a mapping of training / inference (/ default) to specs",
                                    modes)
            config["mode_output_specs"] = {
                mode: _specs_from_config(specs, entry) for mode, specs in modes.items()}
            none_means = config.get("none_means", "inference")
            if not (isinstance(none_means, str) and none_means in modes):
                saved_values.refuse(entry, "none_means", f"one of {', '.join(modes)}",
                                    none_means)
        config["layer"] = saved_values.saved_user_layer(config.get("layer"), entry)
        return cls(**config)


#: The modes an `OpaqueLayer` may hold output specs for, in the order its
#: outputs hold them (`runtime.mode_switch.MODES` names the same ones).
MODES = ("training", "inference", "default")


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


def _map_specs(fn, specs):
    """`fn` applied to each (shape, dtype) spec of a nest, the nest kept,
    in the order `keras.tree.flatten` gives the leaves (a dict's by key)."""
    if _is_spec(specs):
        return fn(specs)
    if isinstance(specs, dict):
        return {k: _map_specs(fn, specs[k]) for k in sorted(specs)}
    return type(specs)(_map_specs(fn, v) for v in specs)


def _flat_specs(specs):
    found = []
    _map_specs(found.append, specs)
    return found


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
    """A view (`user_code.layer_view`) of `layer` whose user-written `call`s, its
    own and its sub-layers', run AutoGraph-converted."""
    return layer_view(layer, _view_class)
