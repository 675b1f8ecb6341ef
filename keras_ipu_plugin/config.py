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
any other string is a layer name.

Configs are data, and reading one is bounded: a file is at most
`MAX_CONFIG_BYTES`, nests at most `MAX_CONFIG_DEPTH` mappings and lists and
holds at most `MAX_CONFIG_VALUES` values; a key given twice is an error
(JSON and YAML would keep the last value silently); YAML is read with the
safe constructor (no tags that build Python objects) and without aliases
(`*name`): an alias repeats a value without repeating its text, so a few
hundred bytes of aliases (or of `<<` merges of aliases) expand to billions
of values. `allow_imports=True` is the one exception to "data only": it
imports the named module, which runs that module's top-level code.
"""

import importlib
import json
import os

import keras
import yaml
from yaml.composer import Composer
from yaml.constructor import SafeConstructor
from yaml.resolver import Resolver

from keras_ipu_plugin import passes as passes_lib
from keras_ipu_plugin.errors import ConfigError
from keras_ipu_plugin.errors import PassError
from keras_ipu_plugin.errors import config_path
from keras_ipu_plugin.errors import short_repr

try:  # libyaml's parser, several times faster than PyYAML's Python one
    from yaml.cyaml import CParser as _YamlParser
except ImportError:  # pragma: no cover - PyYAML built without libyaml
    from yaml.parser import Parser
    from yaml.reader import Reader
    from yaml.scanner import Scanner

    class _YamlParser(Reader, Scanner, Parser):
        def __init__(self, stream):
            Reader.__init__(self, stream)
            Scanner.__init__(self)
            Parser.__init__(self)

MAX_CONFIG_BYTES = 1_000_000
"""The largest config file read (a pass config is a few hundred bytes)."""
MAX_CONFIG_DEPTH = 32
"""The most mappings and lists a config may nest (the config itself is one)."""
MAX_CONFIG_VALUES = 100_000
"""The most values (mappings, lists and scalars) a config may hold."""

_KEYS = ("expand", "replace", "outline", "recompute", "pipeline_stages")
_REPLACEMENT_KEYS = ("class", "params", "copy_weights")
_KEY_TYPES = (str, int, float, bool, type(None))
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

    `allow_imports=True` lets the config name classes as
    `"package.module:Class"`: the module is imported, which runs its
    top-level code, before kip checks that it names a Layer class. Pass it
    only for configs you trust as you trust code.

    Example:
        >>> kip.passes_from_config({"expand": "all", "recompute": ["block_1"]})
        [Expand(targets=('all',)), Recompute(targets=('block_1',))]
    """
    if isinstance(config, (str, os.PathLike)):
        config = _load_file(config)
    config = _bounded_copy(config)
    if not isinstance(config, dict):
        raise ConfigError("", f"a config must be a mapping; got {type(config).__name__}")
    for key in config:
        if key not in _KEYS:
            raise ConfigError(config_path("", key), f"unknown key (expected one of {', '.join(_KEYS)})")
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


# -- reading files -------------------------------------------------------------
def _load_file(path):
    name = os.fspath(path)
    try:
        with open(name, "rb") as handle:
            # Read one byte past the limit, never the whole of a huge file.
            data = handle.read(MAX_CONFIG_BYTES + 1)
    except OSError as error:
        raise ConfigError("", f"cannot read config file {name!r}: {error}") from error
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError(
            "", f"{name!r} is larger than {MAX_CONFIG_BYTES} bytes, the limit for a "
            "config file (kip.config.MAX_CONFIG_BYTES); is it the right file?"
        )
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ConfigError(
            "", f"{name!r} is not UTF-8 text (byte 0x{data[error.start]:02x} at offset "
            f"{error.start}); save it as UTF-8"
        ) from error
    if name.endswith(".json"):
        return _parse_json(text, name)
    return _parse_yaml(text, name)


def _parse_json(text, name):
    try:
        return json.loads(text, object_pairs_hook=_json_mapping)
    except RecursionError as error:
        raise ConfigError(
            "", f"{name!r} is nested too deeply to read (a config nests at most "
            f"{MAX_CONFIG_DEPTH} mappings and lists)"
        ) from error
    except ValueError as error:
        raise ConfigError("", f"{name!r} is not valid JSON: {error}") from error


def _parse_yaml(text, name):
    loader = _YamlLoader(text, name)
    try:
        return loader.get_single_data()
    except ConfigError:
        raise
    except (yaml.YAMLError, ValueError) as error:  # ValueError: e.g. a date 2020-13-45
        raise ConfigError("", f"{name!r} is not valid YAML: {error}") from error
    finally:
        loader.dispose()


class _ReadMapping(dict):
    """A mapping read from a file, with the keys the file gave more than
    once (`repeated`): JSON and YAML readers keep the last value silently;
    `_bounded_copy` reports them at their path."""

    repeated = ()


def _json_mapping(pairs):
    mapping = _ReadMapping(pairs)
    if len(mapping) < len(pairs):
        mapping.repeated = _repeated(key for key, _ in pairs)
    return mapping


def _repeated(keys):
    seen, repeated = set(), []
    for key in keys:
        if key in seen and key not in repeated:
            repeated.append(key)
        seen.add(key)
    return tuple(repeated)


class _YamlLoader(Composer, _YamlParser, SafeConstructor, Resolver):
    """`yaml.CSafeLoader` (libyaml's parser, PyYAML's safe constructor) with
    PyYAML's Python composer: libyaml's composer recurses in C without a
    limit and crashes the interpreter on a deeply nested document. This one
    stops at `MAX_CONFIG_DEPTH`, refuses aliases, and names the path of the
    node at fault; mappings record their repeated keys.
    """

    def __init__(self, text, name):
        _YamlParser.__init__(self, text)
        Composer.__init__(self)
        SafeConstructor.__init__(self)
        Resolver.__init__(self)
        self._file = name
        self._path = []  # (mapping key or list index, is a collection)

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise ConfigError(
                self._node_path(index),
                f"YAML aliases are not allowed in a config (*{short_repr(event.anchor)[1:-1]} "
                f"at {self._where(event)}): write the value out",
            )
        collection = self.check_event(yaml.SequenceStartEvent, yaml.MappingStartEvent)
        self._path.append((_path_key(index), collection))
        try:
            if sum(is_collection for _, is_collection in self._path) > MAX_CONFIG_DEPTH:
                raise ConfigError(
                    self._node_path(None),
                    f"nested deeper than {MAX_CONFIG_DEPTH} mappings and lists "
                    f"(at {self._where(self.peek_event())})",
                )
            return super().compose_node(parent, index)
        finally:
            self._path.pop()

    def _node_path(self, index):
        path = ""
        for key, _ in self._path + [(_path_key(index), False)]:
            if key is not None:
                path = config_path(path, key)
        return path

    def _where(self, event):
        mark = event.start_mark
        return f"{self._file!r} line {mark.line + 1}, column {mark.column + 1}"

    def construct_yaml_map(self, node):
        # Keys written next to a `<<` merge override the merged ones (that is
        # what a merge is for): only keys written in this mapping count.
        keys = [
            self.construct_object(key_node, deep=True)
            for key_node, _ in node.value if key_node.tag not in _MERGE_TAGS
        ]
        data = _ReadMapping()
        data.repeated = _repeated(key for key in keys if _hashable(key))
        yield data
        data.update(self.construct_mapping(node))


_MERGE_TAGS = ("tag:yaml.org,2002:merge", "tag:yaml.org,2002:value")
_YamlLoader.add_constructor("tag:yaml.org,2002:map", _YamlLoader.construct_yaml_map)


def _path_key(index):
    """A node's key in its parent: a list index, or a mapping key's text."""
    if isinstance(index, int):
        return index
    if isinstance(index, yaml.ScalarNode):
        return index.value
    return None


def _hashable(key):
    try:
        hash(key)
    except TypeError:
        return False
    return True


def _bounded_copy(config):
    """`config` as plain dicts, lists and scalars, checked to be small: at
    most `MAX_CONFIG_DEPTH` levels and `MAX_CONFIG_VALUES` values (a dict
    that contains itself, or one list shared a million times, is refused
    rather than walked forever), no key given twice, scalar keys only."""
    count = 0

    def copy(value, path, depth):
        nonlocal count
        count += 1
        if count > MAX_CONFIG_VALUES:
            raise ConfigError(
                path, f"the config holds more than {MAX_CONFIG_VALUES} values "
                "(kip.config.MAX_CONFIG_VALUES)"
            )
        if not isinstance(value, (dict, list, tuple)):
            return value
        if depth == MAX_CONFIG_DEPTH:
            raise ConfigError(
                path, f"nested deeper than {MAX_CONFIG_DEPTH} mappings and lists "
                "(kip.config.MAX_CONFIG_DEPTH); does a mapping or list contain itself?"
            )
        if isinstance(value, dict):
            for key in getattr(value, "repeated", ()):
                raise ConfigError(
                    config_path(path, key),
                    "this key is given twice; only one value can hold",
                )
            copied = {}
            for key, item in value.items():
                if not isinstance(key, _KEY_TYPES):
                    raise ConfigError(
                        path, f"a key must be a string; got {type(key).__name__} {short_repr(key)}"
                    )
                copied[key] = copy(item, config_path(path, key), depth + 1)
            return copied
        items = [copy(item, config_path(path, i), depth + 1) for i, item in enumerate(value)]
        return items if isinstance(value, list) else tuple(items)

    return copy(config, "", 0)


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
                f"unknown layer class {short_repr(name)} (not a keras.layers name nor "
                "registered with kip.register_layer)",
            )
        return cls

    def _import(self, name):
        module_name, _, attribute = name.partition(":")
        # Checked before anything is imported: a name such as "os:system:x"
        # must not import (and run) a module.
        if not (all(part.isidentifier() for part in module_name.split("."))
                and attribute.isidentifier()):
            raise ConfigError(
                "", f"{short_repr(name)} is not of the form 'package.module:Class' "
                "(names separated by dots, one colon)"
            )
        if not self.allow_imports:
            raise ConfigError(
                "", f"{short_repr(name)} names a class to import; pass allow_imports=True "
                "to allow it (importing runs the module's top-level code)"
            )
        try:
            module = importlib.import_module(module_name)
        except Exception as error:  # the module's own code may raise anything
            raise ConfigError(
                "", f"cannot import {short_repr(name)}: {type(error).__name__}: {short_repr(str(error))}"
            ) from error
        cls = getattr(module, attribute, None)
        if cls is None:
            raise ConfigError("", f"cannot import {short_repr(name)}: module {short_repr(module_name)} has no {short_repr(attribute)}")
        if not (isinstance(cls, type) and issubclass(cls, keras.layers.Layer)):
            raise ConfigError("", f"{short_repr(name)} is not a keras Layer class")
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
        raise ConfigError(
            path, f"expected a target or a non-empty list of targets; got {short_repr(value)}"
        )
    return tuple(_target(item, config_path(path, i), resolver) for i, item in enumerate(value))


def _replace(value, resolver):
    if not isinstance(value, dict) or not value:
        raise ConfigError("replace", "expected a mapping {target: {class: ..., params: ...}}")
    mapping = {}
    for target_name, spec in value.items():
        path = config_path("replace", target_name)
        target = _target(target_name, path, resolver)
        if not isinstance(spec, dict):
            raise ConfigError(path, f"expected a mapping with `class`; got {type(spec).__name__}")
        for key in spec:
            if key not in _REPLACEMENT_KEYS:
                raise ConfigError(
                    config_path(path, key), f"unknown key (expected {', '.join(_REPLACEMENT_KEYS)})"
                )
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
                raise ConfigError(
                    config_path(f"{path}.params", key),
                    f"{new_class.__name__} has no parameter {short_repr(key)}",
                )
        copy_weights = spec.get("copy_weights", False)
        if not isinstance(copy_weights, bool):
            raise ConfigError(f"{path}.copy_weights", f"expected true or false; got {short_repr(copy_weights)}")
        mapping[target] = passes_lib.Replacement(new_class, params, copy_weights)
    return passes_lib.Replace(mapping)


def _outline(value, resolver):
    if isinstance(value, dict):
        for key in value:
            if key not in ("targets", "kwargs"):
                raise ConfigError(config_path("outline", key), "unknown key (expected targets, kwargs)")
        kwargs = value.get("kwargs", {}) or {}
        if not isinstance(kwargs, dict):
            raise ConfigError("outline.kwargs", f"expected a mapping; got {type(kwargs).__name__}")
        for key in kwargs:
            if not isinstance(key, str) or not key.isidentifier():
                raise ConfigError(config_path("outline.kwargs", key), "expected a keyword argument name")
        return passes_lib.Outline(_targets(value.get("targets"), "outline.targets", resolver), **kwargs)
    return passes_lib.Outline(_targets(value, "outline", resolver))


def _stages(value, resolver):
    if not isinstance(value, list) or not value:
        raise ConfigError("pipeline_stages", "expected a non-empty list of lists of targets")
    return passes_lib.PipelineStages(
        [_targets(stage, config_path("pipeline_stages", i), resolver) for i, stage in enumerate(value)]
    )
