"""Tests of pass configs: bounded, strict loading of JSON / YAML files and
dicts (issue 12 item 10).

Every failure of `kip.passes_from_config` is one `kip.ConfigError` whose
`path` says where in the config it is, whatever the input: deep nesting, a
file that is not UTF-8, a key given twice, a YAML alias bomb, a huge file,
a malformed import path or a module that fails to import.
"""

import json
import sys

import keras
import pytest
import yaml

import keras_ipu_plugin as kip
from keras_ipu_plugin import config as config_module
from keras_ipu_plugin.passes import Expand
from keras_ipu_plugin.passes import Recompute


def error_of(config, **kwargs):
    with pytest.raises(kip.ConfigError) as caught:
        kip.passes_from_config(config, **kwargs)
    return caught.value


def nested_list(depth):
    value = "block_1"
    for _ in range(depth):
        value = [value]
    return value


# -- nesting -------------------------------------------------------------------
def test_deeply_nested_dict_is_a_config_error_not_a_recursion_error():
    error = error_of({"expand": nested_list(100_000)})
    assert error.path.startswith("expand.0.0")
    assert "nested deeper than" in str(error)
    assert len(str(error)) < 400


def test_deeply_nested_json_file_is_a_config_error(tmp_path):
    path = tmp_path / "deep.json"
    path.write_text('{"expand": ' + "[" * 100_000 + "]" * 100_000 + "}")
    error = error_of(path)
    assert "deep.json" in str(error) and "nested" in str(error)


def test_deeply_nested_yaml_file_is_a_config_error(tmp_path):
    # libyaml's own composer recurses in C without a limit: this input
    # crashes the interpreter there (a segmentation fault) and raises
    # RecursionError in PyYAML's pure Python loader.
    path = tmp_path / "deep.yaml"
    path.write_text("expand: " + "[" * 100_000 + "]" * 100_000 + "\n")
    error = error_of(path)
    assert "deep.yaml" in str(error) and "nested deeper than" in str(error)


def test_nesting_up_to_the_depth_limit_loads(tmp_path):
    # The limit is on the mapping/list levels of the whole config: the
    # outline kwargs below sit MAX_CONFIG_DEPTH levels down.
    depth = config_module.MAX_CONFIG_DEPTH
    kwargs = {"inner": nested_list(depth - 3)}
    (outline,) = kip.passes_from_config({"outline": {"targets": "dense", "kwargs": kwargs}})
    assert outline.outline_kwargs == kwargs
    too_deep = {"inner": nested_list(depth - 2)}
    error = error_of({"outline": {"targets": "dense", "kwargs": too_deep}})
    assert error.path.startswith("outline.kwargs.inner.0")


def test_a_dict_that_contains_itself_is_a_config_error():
    config = {"recompute": []}
    config["recompute"].append(config)
    error = error_of(config)
    assert error.path.startswith("recompute.0.recompute.0")
    assert "nested deeper than" in str(error)


# -- encodings, duplicate keys -----------------------------------------------------
@pytest.mark.parametrize("name", ["latin1.yaml", "latin1.json"])
def test_a_file_that_is_not_utf8_is_a_config_error_naming_the_file(tmp_path, name):
    path = tmp_path / name
    path.write_bytes('recompute: ["caf\u00e9"]\n'.encode("latin-1"))
    error = error_of(path)
    assert error.path == ""
    assert name in str(error) and "UTF-8" in str(error)


def test_duplicate_keys_in_json_are_an_error_naming_the_key(tmp_path):
    path = tmp_path / "twice.json"
    path.write_text('{"expand": "all", "recompute": ["a"], "expand": ["block_1"]}')
    error = error_of(path)
    assert error.path == "expand"
    assert "twice" in str(error)
    nested = tmp_path / "nested.json"
    nested.write_text(
        '{"replace": {"Dense": {"class": "Dense", "params": {"units": 2, "units": 3}}}}'
    )
    assert error_of(nested).path == "replace.Dense.params.units"


def test_duplicate_keys_in_yaml_are_an_error_naming_the_key(tmp_path):
    path = tmp_path / "twice.yaml"
    path.write_text("expand: all\nrecompute: [a]\nexpand: [block_1]\n")
    error = error_of(path)
    assert error.path == "expand"
    assert "twice" in str(error)
    nested = tmp_path / "nested.yaml"
    nested.write_text("replace:\n  Dense: {class: Dense, params: {units: 2, units: 3}}\n")
    assert error_of(nested).path == "replace.Dense.params.units"


def test_yaml_merge_keys_are_not_duplicates(tmp_path):
    # `<<` merges a mapping; keys written next to it override the merged
    # ones (that is what a merge is for), so they are not duplicates.
    path = tmp_path / "merge.yaml"
    path.write_text(
        "outline:\n"
        "  targets: [Dense]\n"
        "  kwargs:\n"
        "    <<: {unique_sharding: false, other: 1}\n"
        "    unique_sharding: true\n"
    )
    (outline,) = kip.passes_from_config(path)
    assert outline.outline_kwargs == {"unique_sharding": True, "other": 1}


# -- bounded loading ---------------------------------------------------------------
BILLION_LAUGHS = """\
expand:
  - &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]
  - &b [*a, *a, *a, *a, *a, *a, *a, *a, *a]
  - &c [*b, *b, *b, *b, *b, *b, *b, *b, *b]
  - &d [*c, *c, *c, *c, *c, *c, *c, *c, *c]
  - &e [*d, *d, *d, *d, *d, *d, *d, *d, *d]
  - &f [*e, *e, *e, *e, *e, *e, *e, *e, *e]
  - &g [*f, *f, *f, *f, *f, *f, *f, *f, *f]
  - &h [*g, *g, *g, *g, *g, *g, *g, *g, *g]
  - &i [*h, *h, *h, *h, *h, *h, *h, *h, *h]
"""


def test_yaml_alias_bomb_is_refused_at_its_first_alias(tmp_path):
    # ~10^9 values once expanded, from 580 bytes. Aliases are refused in
    # configs (so are merges of aliases, which multiply the same way).
    path = tmp_path / "laughs.yaml"
    path.write_text(BILLION_LAUGHS)
    error = error_of(path)
    assert error.path == "expand.1.0"
    assert "aliases are not allowed" in str(error) and "line 3, column 9" in str(error)
    assert len(str(error)) < 400


def test_yaml_alias_is_refused_with_its_place(tmp_path):
    path = tmp_path / "aliases.yaml"
    path.write_text("recompute: &blocks [block_1, block_2]\noutline: *blocks\n")
    error = error_of(path)
    assert error.path == "outline"
    assert "*blocks" in str(error) and "line 2" in str(error)


def test_a_config_of_shared_lists_is_refused_after_max_values():
    # A Python config can share one list many times: 9**9 values once
    # walked, refused after MAX_CONFIG_VALUES of them.
    laughs = ["lol"] * 9
    for _ in range(8):
        laughs = [laughs] * 9
    error = error_of({"outline": {"targets": "dense", "kwargs": {"laughs": laughs}}})
    assert error.path.startswith("outline.kwargs.laughs.0")
    assert f"more than {config_module.MAX_CONFIG_VALUES} values" in str(error)
    assert len(str(error)) < 400


def test_config_file_over_the_size_limit_is_refused_before_parsing(tmp_path):
    path = tmp_path / "huge.yaml"
    line = "# " + "x" * 98 + "\n"
    path.write_text("expand: all\n" + line * (config_module.MAX_CONFIG_BYTES // 100 + 1))
    error = error_of(path)
    assert "huge.yaml" in str(error)
    assert f"{config_module.MAX_CONFIG_BYTES} bytes" in str(error)


def test_yaml_is_parsed_by_libyaml_when_it_is_installed():
    # libyaml's parser is several times faster than PyYAML's Python one.
    assert yaml.__with_libyaml__  # installed here, so the test below means something
    assert issubclass(config_module._YamlLoader, yaml.cyaml.CParser)


def test_error_messages_show_values_truncated():
    big = {f"key_{i}": "x" * 1000 for i in range(1000)}
    error = error_of({"expand": big})
    assert error.path == "expand"
    assert len(str(error)) < 400
    error = error_of({"replace": {"Dense": {"class": "Dense", "copy_weights": "y" * 10**6}}})
    assert error.path == "replace.Dense.copy_weights"
    assert len(str(error)) < 400


def test_a_long_key_is_truncated_in_the_path():
    error = error_of({"k" * 10**6: 1})
    assert len(error.path) < 100
    assert len(str(error)) < 600


# -- import paths (allow_imports=True runs the module's top-level code) ---------
@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """A module on sys.path whose top-level code leaves a mark when run."""
    marker = tmp_path / "imported"
    (tmp_path / "kip_config_user_module.py").write_text(
        "import pathlib\n"
        "import keras\n"
        f"pathlib.Path({str(marker)!r}).write_text('ran')\n"
        "class UserDense(keras.layers.Dense):\n"
        "    pass\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "kip_config_user_module", raising=False)
    return marker


@pytest.mark.parametrize(
    "name",
    [
        "kip_config_user_module:UserDense:extra",
        "kip_config_user_module:",
        ":UserDense",
        "kip_config_user_module.:UserDense",
        ".kip_config_user_module:UserDense",
        "kip config_user_module:UserDense",
        "kip_config_user_module:User-Dense",
    ],
)
def test_malformed_import_path_is_refused_before_importing(user_module, name):
    error = error_of({"replace": {"Dense": {"class": name}}}, allow_imports=True)
    assert error.path == "replace.Dense.class"
    assert "package.module:Class" in str(error)
    assert not user_module.exists()  # the module's code never ran


def test_well_formed_import_path_imports_the_module(user_module):
    (replace,) = kip.passes_from_config(
        {"replace": {"Dense": {"class": "kip_config_user_module:UserDense"}}},
        allow_imports=True,
    )
    assert user_module.exists()
    assert replace.mapping[keras.layers.Dense].new_class.__name__ == "UserDense"


def test_a_module_that_fails_to_import_is_a_config_error(tmp_path, monkeypatch):
    (tmp_path / "kip_config_broken_module.py").write_text("raise RuntimeError('boom at import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "kip_config_broken_module", raising=False)
    error = error_of({"recompute": ["kip_config_broken_module:Block"]}, allow_imports=True)
    assert error.path == "recompute.0"
    assert "boom at import" in str(error)


def test_config_from_a_plain_mapping_still_loads(tmp_path):
    path = tmp_path / "plain.json"
    path.write_text(json.dumps({"expand": "all", "recompute": ["block_1"]}))
    assert kip.passes_from_config(path) == [Expand("all"), Recompute(["block_1"])]
