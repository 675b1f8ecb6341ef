"""Passes from a config: a dict, or a JSON / YAML file.

```yaml
expand: all                     # or a list of targets
replace:
  Dense: {class: MyDense, params: {name: fast}, copy_weights: true}
outline: [TransformerBlock]     # or {targets: [...], kwargs: {...}}
recompute: [block_1, block_2]
pipeline_stages: [[encoder], [decoder, head]]
```
Classes are named by their Keras name (`"Dense"`), by a name registered with
`kip.register_layer`, or as `"package.module:Class"` when
`allow_imports=True`. A target string that names a class matches that class;
any other string is a layer name. Configs are data: YAML is read with
`yaml.safe_load`, nothing is evaluated.
"""

import importlib
import json
import os

import keras
import yaml

from keras_ipu_plugin import passes as passes_lib
from keras_ipu_plugin.errors import ConfigError
from keras_ipu_plugin.errors import PassError

_KEYS = ("expand", "replace", "outline", "recompute", "pipeline_stages")
_REPLACEMENT_KEYS = ("class", "params", "copy_weights")
_registry = {}


def register_layer(cls, name=None):
    """Make a layer class nameable in configs (also usable as a decorator).

    Example:
        >>> @kip.register_layer
        ... class FastDense(keras.layers.Dense): ...
        >>> kip.passes_from_config({"replace": {"Dense": {"class": "FastDense"}}})
    """
    if not (isinstance(cls, type) and issubclass(cls, keras.layers.Layer)):
        raise TypeError(f"register_layer takes a keras Layer class; got {cls!r}.")
    _registry[name or cls.__name__] = cls
    return cls


def passes_from_config(config, *, allow_imports=False):
    """A list of passes from a dict or a `.json` / `.yaml` / `.yml` file.

    Passes come in the order expand, replace, outline, recompute,
    pipeline_stages. Any error is one `kip.ConfigError` whose `path` says
    where inside the config it is (e.g. `replace.Dense.params.unitz`).

    Example:
        >>> kip.passes_from_config({"expand": "all", "recompute": ["block_1"]})
        [Expand(targets=('all',)), Recompute(targets=('block_1',))]
    """
    if isinstance(config, (str, os.PathLike)):
        config = _load_file(config)
    if not isinstance(config, dict):
        raise ConfigError("", f"a config must be a mapping; got {type(config).__name__}")
    for key in config:
        if key not in _KEYS:
            raise ConfigError(str(key), f"unknown key (expected one of {', '.join(_KEYS)})")
    resolver = _Resolver(allow_imports)
    built = []
    try:
        if "expand" in config:
            built.append(passes_lib.Expand(_targets(config["expand"], "expand", resolver)))
        if "replace" in config:
            built.append(_replace(config["replace"], resolver))
        if "outline" in config:
            built.append(_outline(config["outline"], resolver))
        if "recompute" in config:
            built.append(passes_lib.Recompute(_targets(config["recompute"], "recompute", resolver)))
        if "pipeline_stages" in config:
            built.append(_stages(config["pipeline_stages"], resolver))
    except PassError as error:
        raise ConfigError("", str(error)) from error
    return built


def _load_file(path):
    path = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
    except OSError as error:
        raise ConfigError("", f"cannot read config file {path!r}: {error}") from error
    try:
        if path.endswith(".json"):
            return json.loads(text)
        return yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as error:
        raise ConfigError("", f"{path!r} is not valid {'JSON' if path.endswith('.json') else 'YAML'}: {error}") from error


class _Resolver:
    """Turns class names in a config into classes."""

    def __init__(self, allow_imports):
        self.allow_imports = allow_imports

    def find(self, name):
        """The class `name` names, or None when it names no class."""
        if name in _registry:
            return _registry[name]
        candidate = getattr(keras.layers, name, None)
        if isinstance(candidate, type) and issubclass(candidate, keras.layers.Layer):
            return candidate
        if ":" in name:
            return self._import(name)
        return None

    def require(self, name, path):
        if not isinstance(name, str):
            raise ConfigError(path, f"a class name must be a string; got {type(name).__name__}")
        try:
            cls = self.find(name)
        except ConfigError as error:
            raise _at(path, error) from error
        if cls is None:
            raise ConfigError(
                path,
                f"unknown layer class {name!r} (not a keras.layers name nor "
                "registered with kip.register_layer)",
            )
        return cls

    def _import(self, name):
        if not self.allow_imports:
            raise ConfigError(
                "", f"{name!r} names a class to import; pass allow_imports=True to allow it"
            )
        module_name, _, attribute = name.partition(":")
        try:
            cls = getattr(importlib.import_module(module_name), attribute)
        except (ImportError, AttributeError) as error:
            raise ConfigError("", f"cannot import {name!r}: {error}") from error
        if not (isinstance(cls, type) and issubclass(cls, keras.layers.Layer)):
            raise ConfigError("", f"{name!r} is not a keras Layer class")
        return cls


def _at(path, error):
    """`error` (raised where the path was not known) placed at `path`."""
    message = error.args[0] if not error.path else str(error)
    return ConfigError(path, message)


def _target(value, path, resolver):
    if not isinstance(value, str):
        raise ConfigError(path, f"a target must be a string; got {type(value).__name__}")
    if value == "all":
        return value
    try:
        cls = resolver.find(value)
    except ConfigError as error:
        raise _at(path, error) from error
    return cls if cls is not None else value


def _targets(value, path, resolver):
    if value is True:
        return ("all",)
    if isinstance(value, str):
        return (_target(value, path, resolver),)
    if not isinstance(value, list) or not value:
        raise ConfigError(path, f"expected a target or a non-empty list of targets; got {value!r}")
    return tuple(_target(item, f"{path}.{i}", resolver) for i, item in enumerate(value))


def _replace(value, resolver):
    if not isinstance(value, dict) or not value:
        raise ConfigError("replace", "expected a mapping {target: {class: ..., params: ...}}")
    mapping = {}
    for target_name, spec in value.items():
        path = f"replace.{target_name}"
        target = _target(target_name, path, resolver)
        if not isinstance(spec, dict):
            raise ConfigError(path, f"expected a mapping with `class`; got {type(spec).__name__}")
        for key in spec:
            if key not in _REPLACEMENT_KEYS:
                raise ConfigError(f"{path}.{key}", f"unknown key (expected {', '.join(_REPLACEMENT_KEYS)})")
        if "class" not in spec:
            raise ConfigError(f"{path}.class", "missing: the class to replace with")
        new_class = resolver.require(spec["class"], f"{path}.class")
        params = spec.get("params", {}) or {}
        if not isinstance(params, dict):
            raise ConfigError(f"{path}.params", f"expected a mapping; got {type(params).__name__}")
        from keras_ipu_plugin.passes.replace import accepted_config_keys

        accepted = accepted_config_keys(new_class)
        for key in params:
            if key not in accepted:
                raise ConfigError(f"{path}.params.{key}", f"{new_class.__name__} has no parameter {key!r}")
        copy_weights = spec.get("copy_weights", False)
        if not isinstance(copy_weights, bool):
            raise ConfigError(f"{path}.copy_weights", f"expected true or false; got {copy_weights!r}")
        mapping[target] = passes_lib.Replacement(new_class, params, copy_weights)
    return passes_lib.Replace(mapping)


def _outline(value, resolver):
    if isinstance(value, dict):
        for key in value:
            if key not in ("targets", "kwargs"):
                raise ConfigError(f"outline.{key}", "unknown key (expected targets, kwargs)")
        kwargs = value.get("kwargs", {}) or {}
        if not isinstance(kwargs, dict):
            raise ConfigError("outline.kwargs", f"expected a mapping; got {type(kwargs).__name__}")
        for key in kwargs:
            if not isinstance(key, str) or not key.isidentifier():
                raise ConfigError(f"outline.kwargs.{key}", "expected a keyword argument name")
        return passes_lib.Outline(_targets(value.get("targets"), "outline.targets", resolver), **kwargs)
    return passes_lib.Outline(_targets(value, "outline", resolver))


def _stages(value, resolver):
    if not isinstance(value, list) or not value:
        raise ConfigError("pipeline_stages", "expected a non-empty list of lists of targets")
    return passes_lib.PipelineStages(
        [_targets(stage, f"pipeline_stages.{i}", resolver) for i, stage in enumerate(value)]
    )
