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

from keras_ipu_plugin import _compat
from keras_ipu_plugin.errors import ConfigError
from keras_ipu_plugin.errors import PassError
from keras_ipu_plugin.errors import config_path
from keras_ipu_plugin.errors import short_repr
from keras_ipu_plugin.ir.graph import map_values
from keras_ipu_plugin.passes.infra.base import config_value
from keras_ipu_plugin.passes.infra.base import saved_config
from keras_ipu_plugin.passes.infra.layer_class_names import class_named
from keras_ipu_plugin.passes.infra.layer_class_names import name_of_class
from keras_ipu_plugin.runtime.variables import strategy_owning

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
        ```python
        Replacement(MyDense, params={"name": "fast_dense"}, copy_weights=True)
        ```
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
        ```python
        layer_config(keras_hub_gemma_rms_norm)["epsilon"]
        # -> 1e-06
        ```
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


#: Keras's layers holding layers that Replace rebuilds around a replaced
#: layer: `{class: {attribute holding a layer: its key in the class's config}}`
#: (the class exactly: an LSTM is an RNN subclass whose cell is its own).
HOLDERS = {
    keras.layers.RNN: {"cell": "cell"},
    keras.layers.TimeDistributed: {"layer": "layer"},
    keras.layers.Bidirectional: {"forward_layer": "layer", "backward_layer": "backward_layer"},
}


class NotRebuilt(Exception):
    """A holder cannot be rebuilt around its replaced layers; `reason` says why."""

    def __init__(self, reason):
        self.reason = reason
        super().__init__(reason)


def holder_with_replaced(node, is_target, replacement, name):
    """A new layer of the class of `node`'s holder (`HOLDERS`: an RNN, a
    TimeDistributed, a Bidirectional) built from its config, each layer it
    holds that `is_target(layer, path)` says is a target (or each such
    direct attribute of one: a custom cell's LayerNormalization) made by
    `replacement`; its weights copied from the holder's (the replaced ones
    by the replacement's copier, or left fresh as the replacement says)
    and, with the config kept, its outputs compared. The user's holder is
    not changed. Returns `(layer, [paths replaced], what the report says)`;
    raises `NotRebuilt` where it cannot be (a class Keras cannot rebuild
    from its config, a target deeper than one attribute down)."""
    old = node.operation
    roles = HOLDERS.get(type(old))
    if roles is None:
        raise NotRebuilt(f"`{node.name}` is a {type(old).__name__}, which Replace does not "
                         "rebuild around a replaced layer")
    config = keras.saving.serialize_keras_object(old)
    inner_config = config["config"]
    inner_config["name"] = name  # the model's names are distinct
    swaps, pairs, paths = [], [], []
    for role, key in roles.items():
        inner = getattr(old, role)
        path = f"{node.name}.{role}"
        if is_target(inner, path):
            new_inner = replacement.make_layer(inner)
            inner_config[key] = keras.saving.serialize_keras_object(new_inner)
            pairs.append((role, None, inner))
            paths.append(path)
            continue
        for attribute, value in vars(inner).items():
            if isinstance(value, keras.layers.Layer) and is_target(
                    value, f"{path}.{attribute}"):
                swaps.append((role, attribute, value))
                paths.append(f"{path}.{attribute}")
    reached = {id(inner) for role in roles for inner in [getattr(old, role)]
               if f"{node.name}.{role}" in paths}
    reached |= {id(sub) for _, _, sub in swaps}
    deeper = [sub for sub in _compat.sub_layers(old)
              if id(sub) not in reached and is_target(sub, None)
              and not any(id(outer) in reached and sub in _compat.sub_layers(outer)
                          for outer in _compat.sub_layers(old))]
    if not paths or deeper:
        shown = f" (`{deeper[0].name}`)" if deeper else ""
        raise NotRebuilt(f"a matching layer{shown} is deeper inside `{node.name}` than a "
                         "layer it holds or an attribute of one")
    # Unbuilt, so that a layer swapped in below is built in its place.
    config = _without_build_configs(config)
    try:
        new = keras.saving.deserialize_keras_object(config)
    except Exception as error:  # noqa: BLE001 - the reason is reported
        raise NotRebuilt(
            f"a new {type(old).__name__} cannot be built from the config of `{node.name}` "
            f"({type(error).__name__}: {str(error)[:200]}); register the classes it holds "
            "with `keras.saving.register_keras_serializable` and give them `get_config`")
    for role, attribute, old_sub in swaps:
        holder = getattr(new, role)
        made = replacement.make_layer(old_sub)
        # On the new holder only (ours): its own fresh layer there is never
        # built, so it holds no weight.
        setattr(holder, attribute, made)
        # Its config does not record the swap: a saved model would load the
        # old class there. Refused when saving, never loaded otherwise.
        object.__setattr__(holder, "get_config", functools.partial(
            _unsaved_swap, f"{node.name}.{role}", attribute, type(made).__name__))
        pairs.append((role, attribute, old_sub))
    strategy = strategy_owning(old.weights)
    with strategy.scope():
        args = map_values(lambda v: _random_like(v.spec), node.args)
        kwargs = map_values(lambda v: _random_like(v.spec), node.kwargs)
        kwargs.pop("training", None)
        new(*args, **kwargs)
    replaced_new = []
    for role, attribute, old_sub in pairs:
        new_sub = getattr(getattr(new, role), attribute) if attribute else getattr(new, role)
        replaced_new.append(new_sub)
        if replacement.copy_weights:
            (replacement.copy_weights_fn or _default_copier(old_sub, new_sub))(old_sub, new_sub)
    old_replaced = {id(v) for _, _, sub in pairs for v in sub.weights}
    new_replaced = {id(v) for sub in replaced_new for v in sub.weights}
    kept_old = [v for v in old.weights if id(v) not in old_replaced]
    kept_new = [v for v in new.weights if id(v) not in new_replaced]
    if len(kept_old) != len(kept_new) or any(
            tuple(a.shape) != tuple(b.shape) for a, b in zip(kept_old, kept_new)):
        raise NotRebuilt(f"the new {type(old).__name__} built from the config of "
                         f"`{node.name}` holds other weights than it")
    for source, variable in zip(kept_old, kept_new):
        variable.assign(source)
    detail = (f"{type(old).__name__} rebuilt from its config around "
              + ", ".join(f"`{p}`" for p in paths)
              + f" ({', '.join(type(sub).__name__ for _, _, sub in pairs)} -> "
              + f"{replacement.new_class.__name__}")
    detail += ", weights copied" if replacement.copy_weights else ", new weights"
    if replacement.copy_weights:
        difference, scale = _max_difference(old, new, args, kwargs)
        detail += f", max output difference {difference:.2e}"
        if config_equivalent(replacement) and difference > 1e-5 * max(scale, 1.0):
            raise PassError(
                f"replace: `{node.name}` rebuilt around {type(new).__name__} with copied "
                f"weights differs from the original by {difference:.3g}; the replacement "
                "is not equivalent.")
    return new, paths, detail + ")"


def _without_build_configs(config):
    """A serialized layer's config without the `build_config` entries (of
    it and of the layers it holds), so that Keras makes it unbuilt."""
    if isinstance(config, dict):
        return {key: _without_build_configs(value) for key, value in config.items()
                if key != "build_config"}
    if isinstance(config, list):
        return [_without_build_configs(value) for value in config]
    return config


def _unsaved_swap(path, attribute, new_class):
    raise ValueError(
        f"`{path}` holds `{attribute}` replaced by {new_class}, which the config of "
        f"`{path}` does not record (its class builds its own `{attribute}`): a saved model "
        "would load the original layer there. Save the weights (`save_weights`), or "
        "save the model before Replace.")
