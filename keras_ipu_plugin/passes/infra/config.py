"""Passes from a config: a dict or list, or a JSON / YAML file.

```yaml
expand: all                     # or a list of targets
replace:
  Dense: {class: MyDense, params: {name: fast}, copy_weights: true}
outline: [TransformerBlock]     # or {targets: [...], kwargs: {...}}
recompute: [block_1, block_2]
pipeline_stages: [[encoder], [decoder, head]]
```
Each key is a registered pass (`kip.passes.register_pass`), which reads its
own value (`from_user_config`); a mapping runs them in their registered
order (the built-in ones as above), a list of one-key mappings
(`[{expand: all}, {recompute: [block_1]}]`) in its own order.
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

import yaml
from yaml.composer import Composer
from yaml.constructor import SafeConstructor
from yaml.resolver import Resolver

from keras_ipu_plugin.errors import ConfigError
from keras_ipu_plugin.errors import PassError
from keras_ipu_plugin.errors import config_error
from keras_ipu_plugin.errors import config_path
from keras_ipu_plugin.errors import short_repr
from keras_ipu_plugin.passes.infra.base import ALL
from keras_ipu_plugin.passes.infra.base import Pass
from keras_ipu_plugin.passes.infra.base import registered_passes
from keras_ipu_plugin.passes.infra.layer_class_names import class_named
from keras_ipu_plugin.passes.infra.layer_class_names import is_layer_class
from keras_ipu_plugin.passes.infra.layer_class_names import register_layer
from keras_ipu_plugin.passes.infra.patterns import Chain

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

_KEY_TYPES = (str, int, float, bool, type(None))

__all__ = [
    "ConfigReader", "MAX_CONFIG_BYTES", "MAX_CONFIG_DEPTH", "MAX_CONFIG_VALUES",
    "passes_from_config", "register_layer",
]


def passes_from_config(config, *, allow_imports=False):
    """A list of passes from a dict, a list, or a `.json` / `.yaml` / `.yml` file.

    In a mapping, passes come in the order expand, replace, outline,
    recompute, pipeline_stages (then passes registered by users); a list of
    one-key mappings gives its own order. Any error is one `kip.ConfigError`
    whose `path` says where inside the config it is (e.g.
    `replace.Dense.params.unitz`, `0.recompute.1`).

    `allow_imports=True` lets the config name classes as
    `"package.module:Class"`: the module is imported, which runs its
    top-level code, before kip checks that it names a Layer class. Pass it
    only for configs you trust as you trust code.

    Example:
        ```python
        kip.passes_from_config({"expand": "all", "recompute": ["block_1"]})
        # -> [Expand(targets=('all',)), Recompute(targets=('block_1',))]
        kip.passes_from_config([{"recompute": "block_1"}, {"expand": "all"}])
        # -> [Recompute(targets=('block_1',)), Expand(targets=('all',))]
        ```
    """
    if isinstance(config, (str, os.PathLike)):
        config = _load_file(config)
    config = _bounded_copy(config)
    reader = ConfigReader(allow_imports)
    return [_build(key, value, path, reader) for key, value, path in _entries(config)]


def _entries(config):
    """(pass key, value, path) for each pass of `config`, in run order."""
    known = registered_passes()
    expected = f"expected one of {', '.join(known)}"
    if isinstance(config, dict):
        for key in config:
            if key not in known:
                raise ConfigError(config_path("", key), f"unknown key ({expected})")
        return [(key, config[key], key) for key in known if key in config]
    if not isinstance(config, list):
        raise ConfigError(
            "", "a config must be a mapping {pass: value} or a list of one-pass mappings; "
            f"got {type(config).__name__}"
        )
    entries = []
    for index, item in enumerate(config):
        path = config_path("", index)
        if not (isinstance(item, dict) and len(item) == 1):
            raise ConfigError(
                path, "each item of a list config is a mapping of one pass key to its "
                f"value, e.g. {{expand: all}}; got {short_repr(item)}"
            )
        ((key, value),) = item.items()
        if key not in known:
            raise ConfigError(config_path(path, key), f"unknown pass ({expected})")
        entries.append((key, value, config_path(path, key)))
    return entries


def _build(key, value, path, reader):
    pass_class = registered_passes()[key]
    try:
        built = pass_class.from_user_config(value, path, reader)
    except ConfigError:
        raise
    except (PassError, TypeError, ValueError) as error:  # a pass's own checks
        raise config_error(path, error) from error
    if not isinstance(built, Pass):
        raise ConfigError(
            path, f"{pass_class.__name__}.from_user_config returned {short_repr(built)}, not a pass"
        )
    return built


# -- reading files -------------------------------------------------------------
def _load_file(path):
    name = os.fspath(path)
    try:
        with open(name, "rb") as handle:
            # Read one byte past the limit, never the whole of a huge file.
            data = handle.read(MAX_CONFIG_BYTES + 1)
    except (OSError, ValueError) as error:  # ValueError: a NUL in the path
        raise ConfigError("", f"cannot read config file {name!r}: {error}") from error
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError(
            "", f"{name!r} is larger than {MAX_CONFIG_BYTES} bytes, the limit for a "
            "config file (kip.passes.config.MAX_CONFIG_BYTES); is it the right file?"
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
    # PyYAML's constructors raise plain Python errors on some malformed
    # scalars: ValueError for the date 2020-13-45, AttributeError for
    # `!!timestamp 1`, KeyError for `!!bool x`.
    except (yaml.YAMLError, ValueError, TypeError, AttributeError, LookupError,
            ArithmeticError) as error:
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
                "(kip.passes.config.MAX_CONFIG_VALUES)"
            )
        if not isinstance(value, (dict, list, tuple)):
            return value
        if depth == MAX_CONFIG_DEPTH:
            raise ConfigError(
                path, f"nested deeper than {MAX_CONFIG_DEPTH} mappings and lists "
                "(kip.passes.config.MAX_CONFIG_DEPTH); does a mapping or list contain itself?"
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


class ConfigReader:
    """Reads targets and layer classes the way a user's config names them;
    a pass's `from_user_config` gets one.

    A target string that names a layer class (see `layer_class_names`, or
    `"package.module:Class"` with `allow_imports`) is that class; any other
    string is a layer name or path; `"all"` is every layer.
    """

    def __init__(self, allow_imports):
        self.allow_imports = allow_imports

    def targets(self, value, path):
        """One target, a non-empty list of them, or `true` for all."""
        if value is True:
            return (ALL,)
        if isinstance(value, str):
            return (self.target(value, path),)
        if not isinstance(value, list) or not value:
            raise ConfigError(
                path, f"expected a target or a non-empty list of targets; got {short_repr(value)}"
            )
        return tuple(self.target(item, config_path(path, i)) for i, item in enumerate(value))

    def target(self, value, path):
        if isinstance(value, dict) and set(value) == {"chain"}:
            return self._chain(value["chain"], f"{path}.chain")
        if not isinstance(value, str):
            raise ConfigError(path, "a target must be a string or {chain: [steps]}; got "
                                    f"{type(value).__name__}")
        if value == ALL:
            return value
        cls = self._find(value, path)
        return cls if cls is not None else value

    def _chain(self, steps, path):
        """`{chain: [Dense, {op: gelu}]}`: a string step names a layer class
        if it names one, else a layer; `{op: ...}`, `{tf: ...}` name
        functions (see `passes.infra.patterns`)."""
        if not isinstance(steps, list):
            raise ConfigError(path, f"expected a list of steps; got {short_repr(steps)}")
        resolved = []
        for i, step in enumerate(steps):
            where = config_path(path, i)
            try:
                resolved.append(self.target(step, where) if isinstance(step, str)
                                else Chain.step_from_config(step, "chain"))
            except PassError as error:
                raise ConfigError(where, str(error)) from None
        try:
            return Chain(*resolved)
        except PassError as error:
            raise ConfigError(path, str(error)) from None

    def layer_class(self, name, path):
        """The class `name` names (an error if it names none)."""
        if not isinstance(name, str):
            raise ConfigError(path, f"a class name must be a string; got {type(name).__name__}")
        cls = self._find(name, path)
        if cls is None:
            raise ConfigError(
                path,
                f"unknown layer class {short_repr(name)} (not a keras.layers name nor "
                "registered with kip.register_layer or keras.saving.register_keras_serializable)",
            )
        return cls

    def _find(self, name, path):
        cls = class_named(name)
        if cls is None and ":" in name:
            try:
                cls = self._import(name)
            except ConfigError as error:
                raise ConfigError(path, error.args[0]) from error
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
                "", f"cannot import {short_repr(name)}: {type(error).__name__}: "
                f"{short_repr(str(error))}"
            ) from error
        cls = getattr(module, attribute, None)
        if cls is None:
            raise ConfigError(
                "", f"cannot import {short_repr(name)}: module {short_repr(module_name)} "
                f"has no {short_repr(attribute)}"
            )
        if not is_layer_class(cls):
            raise ConfigError("", f"{short_repr(name)} is not a keras Layer class")
        return cls
