"""`Replacement`: what `Replace` puts in a target's place, and how the old
layer's weights reach the new one.

The new layer is built from the old layer's config merged with `params`;
with `copy_weights=True` the old weights are copied into it (default copiers
for Dense, LayerNormalization, Embedding and Conv layers; `copy_weights_fn`
for anything else), and the two are compared on random inputs.
"""

import functools
import inspect

import keras
import numpy as np
import tensorflow as tf

from keras_ipu_plugin.errors import ConfigError
from keras_ipu_plugin.errors import PassError
from keras_ipu_plugin.errors import config_path
from keras_ipu_plugin.errors import short_repr
from keras_ipu_plugin.ir.graph import map_values
from keras_ipu_plugin.passes.infra.base import config_value
from keras_ipu_plugin.passes.infra.base import saved_config
from keras_ipu_plugin.passes.infra.layer_class_names import class_named
from keras_ipu_plugin.passes.infra.layer_class_names import name_of_class
from keras_ipu_plugin.runtime.distribution import strategy_owning

_REPLACEMENT_KEYS = ("class", "params", "copy_weights")
_DEFAULT_COPIED = (
    keras.layers.Dense,
    keras.layers.EinsumDense,
    keras.layers.LayerNormalization,
    keras.layers.Embedding,
    keras.layers.Conv1D,
    keras.layers.Conv2D,
    keras.layers.Conv3D,
    keras.layers.DepthwiseConv2D,
    keras.layers.SeparableConv2D,
    keras.layers.BatchNormalization,
)


class Replacement:
    """How to replace one target: the new class, config changes, weights.

    Example:
        >>> Replacement(MyDense, params={"name": "fast_dense"}, copy_weights=True)
    """

    def __init__(self, new_class, params=None, copy_weights=False, copy_weights_fn=None):
        if not (isinstance(new_class, type) and issubclass(new_class, keras.layers.Layer)):
            raise PassError(
                f"Replacement: `new_class` must be a keras Layer class; got {new_class!r}."
            )
        self.new_class = new_class
        self.params = dict(params or {})
        self.copy_weights = bool(copy_weights or copy_weights_fn)
        self.copy_weights_fn = copy_weights_fn
        unknown = sorted(set(self.params) - accepted_config_keys(new_class))
        if unknown:
            raise PassError(
                f"Replacement of {new_class.__name__}: unknown parameter "
                f"`{unknown[0]}` (accepted: {', '.join(sorted(accepted_config_keys(new_class)))})."
            )

    def __repr__(self):
        return (f"Replacement({self.new_class.__name__}, params={self.params!r}, "
                f"copy_weights={self.copy_weights})")

    def __eq__(self, other):
        return isinstance(other, Replacement) and (
            self.new_class, self.params, self.copy_weights, self.copy_weights_fn
        ) == (other.new_class, other.params, other.copy_weights, other.copy_weights_fn)

    # -- configs and saving ------------------------------------------------------
    def get_config(self, owner="Replacement"):
        if self.copy_weights_fn is not None:
            function = getattr(self.copy_weights_fn, "__qualname__", repr(self.copy_weights_fn))
            raise PassError(
                f"{owner}: copy_weights_fn={function} is a Python function, which cannot be "
                "saved; save the weights only (save_weights), or drop copy_weights_fn and "
                "copy the weights with a default copier."
            )
        return {
            "new_class": name_of_class(self.new_class, owner),
            "params": config_value(self.params, f"{owner}.params"),
            "copy_weights": self.copy_weights,
        }

    @classmethod
    def from_config(cls, config, owner="Replacement"):
        config = saved_config(config, owner, required=("new_class",),
                              optional=("params", "copy_weights"))
        name = config["new_class"]
        new_class = class_named(name) if isinstance(name, str) else None
        if new_class is None:
            raise PassError(
                f"{owner}: unknown layer class {short_repr(name)}; register it with "
                "kip.register_layer or @keras.saving.register_keras_serializable() "
                "before loading."
            )
        return cls(new_class, config.get("params"), config.get("copy_weights", False))

    @classmethod
    def from_user_config(cls, spec, path, reader):
        """`{class: MyDense, params: {name: fast}, copy_weights: true}`."""
        if not isinstance(spec, dict):
            raise ConfigError(path, f"expected a mapping with `class`; got {type(spec).__name__}")
        for key in spec:
            if key not in _REPLACEMENT_KEYS:
                raise ConfigError(
                    config_path(path, key), f"unknown key (expected {', '.join(_REPLACEMENT_KEYS)})"
                )
        if "class" not in spec:
            raise ConfigError(f"{path}.class", "missing: the class to replace with")
        new_class = reader.layer_class(spec["class"], f"{path}.class")
        params = spec.get("params", {}) or {}
        if not isinstance(params, dict):
            raise ConfigError(f"{path}.params", f"expected a mapping; got {type(params).__name__}")
        accepted = accepted_config_keys(new_class)
        for key in params:
            if key not in accepted:
                raise ConfigError(
                    config_path(f"{path}.params", key),
                    f"{new_class.__name__} has no parameter {short_repr(key)}",
                )
        copy_weights = spec.get("copy_weights", False)
        if not isinstance(copy_weights, bool):
            raise ConfigError(
                f"{path}.copy_weights", f"expected true or false; got {short_repr(copy_weights)}"
            )
        return cls(new_class, params, copy_weights)

    def make_layer(self, old, name=None):
        """A new layer from `old`'s config merged with `params` (and `name`:
        the functional model needs distinct names when one `params` name
        replaces several layers)."""
        accepted = accepted_config_keys(self.new_class)
        config = {k: v for k, v in layer_config(old, self.params).items() if k in accepted}
        config.update(self.params)
        if name is not None:
            config["name"] = name
        return self.new_class.from_config(config)


def new_layer_for(node, replacement, name=None, run=None):
    """The layer replacing the one of graph `node`, built (under the
    strategy owning the old one's variables) on random inputs of the
    node's shapes, weights copied and compared if asked: `(layer, what the
    report says)`. Raises `PassError` when copied weights do not give the
    same outputs although the config is kept.

    `run`: the nodes of a `Chain` match that the new layer replaces as a
    whole (`node` first); the new layer is then compared with the run."""
    old = node.operation
    if not isinstance(old, keras.layers.Layer):
        raise PassError(
            f"replace: `{node.name}` ({type(old).__name__}) is not a layer; a chain "
            "is replaced by a layer made from its first layer, so it must start with one."
        )
    strategy = strategy_owning(old.weights)
    with strategy.scope():
        new = replacement.make_layer(old, name)
        args = map_values(lambda v: _random_like(v.spec), node.args)
        kwargs = map_values(lambda v: _random_like(v.spec), node.kwargs)
        kwargs.pop("training", None)
        new(*args, **kwargs)  # builds the variables, under the owning strategy
    detail = f"{type(old).__name__} -> {type(new).__name__}"
    if not has_own_config(old):
        detail += " (no get_config: its constructor arguments read from its attributes)"
    if replacement.params:
        detail += f", params {replacement.params}"
    if replacement.copy_weights:
        copy = replacement.copy_weights_fn or _default_copier(old, new)
        copy(old, new)
        reference = old if run is None else functools.partial(_run_nodes, run)
        difference, scale = _max_difference(reference, new, args, kwargs)
        detail += f", weights copied, max output difference {difference:.2e}"
        if config_equivalent(replacement) and difference > 1e-5 * max(scale, 1.0):
            raise PassError(
                f"replace: `{node.name}` replaced by {type(new).__name__} with "
                f"copied weights differs from the original by {difference:.3g}; "
                "the replacement is not equivalent."
            )
    return new, detail


def config_equivalent(replacement):
    return set(replacement.params) <= {"name"}


def _default_copier(old, new):
    if isinstance(old, _DEFAULT_COPIED):
        return copy_weights_by_name
    raise PassError(
        f"replace: no default weight copier for {type(old).__name__} "
        f"(`{old.name}`); pass copy_weights_fn=lambda old, new: ..."
    )


def copy_weights_by_name(old, new):
    """Copy each weight of `old` into the weight of `new` with the same name."""
    sources = {v.name: v for v in old.weights}
    for variable in new.weights:
        source = sources.get(variable.name)
        if source is None or tuple(source.shape) != tuple(variable.shape):
            raise PassError(
                f"replace: cannot copy weights from `{old.name}` into "
                f"`{new.name}`: no weight named `{variable.name}` of shape "
                f"{tuple(variable.shape)} in the original."
            )
        variable.assign(source)


def _random_like(spec):
    shape = [d if d is not None else 2 for d in spec.shape]
    rng = np.random.RandomState(0)
    if "int" in spec.dtype:
        return tf.constant(rng.randint(0, 2, size=shape), dtype=spec.dtype)
    if spec.dtype == "bool":
        return tf.constant(rng.rand(*shape) > 0.5)
    if spec.dtype == "string":
        return tf.fill(shape, "")
    return tf.constant(rng.randn(*shape), dtype=spec.dtype)


def _run_nodes(run, *args, **kwargs):
    """What the run of nodes (a `Chain` match) computes from `args` given to
    its first node; each later node reads the one before it, and nothing else."""
    outputs = run[0].operation(*args, **kwargs)
    for node in run[1:]:
        node_args = map_values(lambda value, tensor=outputs: tensor, node.args)
        node_kwargs = map_values(lambda value, tensor=outputs: tensor, node.kwargs)
        node_kwargs.pop("training", None)
        outputs = node.operation(*node_args, **node_kwargs)
    return outputs


def _max_difference(old, new, args, kwargs):
    """The largest absolute output difference, and the largest |output|."""
    expected = [np.asarray(e, "float64") for e in keras.tree.flatten(old(*args, **kwargs))]
    actual = [np.asarray(a, "float64") for a in keras.tree.flatten(new(*args, **kwargs))]
    if len(expected) != len(actual) or any(
        e.shape != a.shape for e, a in zip(expected, actual)
    ):
        return float("inf"), 0.0
    difference = max((float(np.max(np.abs(a - e), initial=0.0))
                      for e, a in zip(expected, actual)), default=0.0)
    scale = max((float(np.max(np.abs(e), initial=0.0)) for e in expected), default=0.0)
    return difference, scale


def has_own_config(layer):
    """Whether `layer.get_config()` works (Keras writes it for a class that
    does not, unless an argument was one it cannot serialise)."""
    try:
        layer.get_config()
    except NotImplementedError:
        return False
    return True


def layer_config(layer, given=()):
    """`layer.get_config()`, or, for a layer that has none (keras_hub's
    Gemma `RMSNormalization` writes no `get_config` and is given a dtype
    policy object, which Keras cannot write one for), its constructor's
    arguments read back from its attributes of the same names
    (`self.epsilon = epsilon`), with the base Layer's (`name`, `dtype`,
    `trainable`). An argument neither stored so nor in `given` (the
    Replacement's `params`) raises `PassError`: guessing its default could
    build a layer computing something else.

    Example:
        >>> layer_config(keras_hub_gemma_rms_norm)["epsilon"]
        1e-06
    """
    try:
        return layer.get_config()
    except NotImplementedError:
        pass
    config = {"name": layer.name, "dtype": layer.dtype_policy, "trainable": layer.trainable}
    missing = []
    for klass in type(layer).__mro__:
        if klass is keras.layers.Layer:
            break
        if "__init__" not in vars(klass):
            continue
        for name, parameter in inspect.signature(klass.__init__).parameters.items():
            if name == "self" or name in config or parameter.kind in (
                inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL
            ):
                continue
            if name in given:
                continue
            if name in vars(layer):
                config[name] = vars(layer)[name]
            else:
                missing.append(name)
    if missing:
        raise PassError(
            f"replace: `{layer.name}` ({type(layer).__name__}) has no config (its "
            f"`get_config` is not implemented) and keeps no attribute for the "
            f"constructor argument(s) {', '.join(f'`{m}`' for m in missing)}; give "
            f"them in the Replacement's params, or implement `get_config` on "
            f"{type(layer).__name__}."
        )
    return config


def accepted_config_keys(layer_class):
    """Config keys `layer_class` accepts: its `__init__` parameters up the
    class hierarchy, plus the base Layer's."""
    keys = set()
    for klass in layer_class.__mro__:
        if "__init__" not in vars(klass):
            continue
        for name, parameter in inspect.signature(klass.__init__).parameters.items():
            if parameter.kind not in (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL):
                keys.add(name)
        if klass is keras.layers.Layer:
            break
    keys.discard("self")
    keys.update({"name", "dtype", "trainable", "autocast"})
    return keys
