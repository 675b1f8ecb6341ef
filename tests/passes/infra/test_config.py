"""Tests of pass configs and of passes as saved data.

Reading: every failure of `kip.passes_from_config` is one
`kip.ConfigError` whose `path` says where in the config it is, whatever the
input: deep nesting, a file that is not UTF-8, a key given twice, a YAML
alias bomb, a huge file, a malformed import path or a module that fails to
import.

Saving: every pass has `get_config` / `from_config`, a
registry makes a pass known to configs and to saving, a config may be a list
(its own order), and `PluginModel` with passes given as Python objects saves
and loads.
"""

import inspect
import json
import sys

import keras
import numpy as np
import pytest
import yaml

import keras_ipu_plugin as kip
from keras_ipu_plugin.passes.infra import config as config_module
from keras_ipu_plugin.passes import Expand
from keras_ipu_plugin.passes import Outline
from keras_ipu_plugin.passes import PipelineStages
from keras_ipu_plugin.passes import Recompute
from keras_ipu_plugin.passes import Replace
from keras_ipu_plugin.passes import Replacement
from keras_ipu_plugin.passes.infra import base
from keras_ipu_plugin.passes.infra.base import as_targets
from keras_ipu_plugin.passes.infra.base import matched_nodes
from keras_ipu_plugin.passes.infra.base import targets_config
from keras_ipu_plugin.passes.infra.base import targets_from_config


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
    # replacement params below sit MAX_CONFIG_DEPTH levels down.
    depth = config_module.MAX_CONFIG_DEPTH

    def config(value):
        return {"replace": {"dense": {"class": "Dense", "params": {"units": value}}}}

    (replace,) = kip.passes_from_config(config(nested_list(depth - 4)))
    assert replace.mapping["dense"].params["units"] == nested_list(depth - 4)
    error = error_of(config(nested_list(depth - 3)))
    assert error.path.startswith("replace.dense.params.units.0")


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
        "    <<: {unique_sharding: false, name: shared}\n"
        "    unique_sharding: true\n"
    )
    (outline,) = kip.passes_from_config(path)
    assert outline.outline_kwargs == {"unique_sharding": True, "name": "shared"}


@pytest.mark.parametrize(
    "text", ["expand: !!timestamp 1\n", "expand: !!bool x\n", "expand: 2020-13-45\n"]
)
def test_malformed_yaml_scalars_are_config_errors(tmp_path, text):
    # PyYAML's constructors raise AttributeError, KeyError, ValueError here.
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    assert "is not valid YAML" in str(error_of(path))


def test_a_path_that_cannot_be_opened_is_a_config_error():
    assert "cannot read config file" in str(error_of("bad\0name.yaml"))


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


# -- passes as data: get_config / from_config, the registry ---------------------
@keras.saving.register_keras_serializable(package="kip_test_config")
class SavedDense(keras.layers.Dense):
    """A Dense subclass Keras can name ("kip_test_config>SavedDense")."""


@keras.saving.register_keras_serializable(package="kip_test_config")
class Block(keras.layers.Layer):
    def __init__(self, width=8, **kwargs):
        super().__init__(**kwargs)
        self.width = width
        self.dense = keras.layers.Dense(width, activation="relu", name="dense")
        self.norm = keras.layers.LayerNormalization(name="norm")

    def call(self, x):
        return self.norm(self.dense(x)) + x

    def get_config(self):
        return {**super().get_config(), "width": self.width}


@keras.saving.register_keras_serializable(package="kip_test_config")
class Net(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.stem = keras.layers.Dense(8, name="stem")
        self.block_1 = Block(name="block_1")
        self.block_2 = Block(name="block_2")
        self.head = keras.layers.Dense(1, name="head")

    def call(self, x):
        return self.head(self.block_2(self.block_1(self.stem(x))))


def data(n=64):
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, 6)).astype("float32"), rng.normal(size=(n, 1)).astype("float32")


def sample_passes():
    return [
        Expand(),
        Expand(["block_1", Block]),
        Replace({keras.layers.Dense: Replacement(SavedDense, params={"units": 8}, copy_weights=True),
                 "head": Replacement(keras.layers.Dense, params={"use_bias": False})}),
        Outline(keras.layers.LayerNormalization, unique_sharding=True),
        Recompute(["block_1.norm", keras.layers.LayerNormalization]),
        PipelineStages([["stem", Block], ["head"]]),
        Recompute(auto=True, memory_budget=0.5),
        Recompute(auto=True, memory_budget=2 ** 30),
        PipelineStages(num_stages=4, balance="time"),
    ]


@pytest.mark.parametrize("one_pass", sample_passes(), ids=repr)
def test_every_pass_round_trips_through_its_config_as_json(one_pass):
    config = json.loads(json.dumps(one_pass.get_config()))
    assert type(one_pass).from_config(config) == one_pass
    saved = json.loads(json.dumps(base.serialize_pass(one_pass)))
    assert base.deserialize_pass(saved) == one_pass


def test_every_registered_pass_saves_every_constructor_argument():
    # A constructor argument that get_config leaves out would come back as
    # its default after loading: a silent change. Replace's one argument,
    # `mapping`, is saved as `replacements` (a class cannot be a JSON key).
    saved_as = {(Replace, "mapping"): "replacements"}
    samples = {type(one_pass): one_pass for one_pass in sample_passes()}
    for key, cls in kip.passes.registered_passes().items():
        if cls not in samples:
            continue  # registered by another test
        config = samples[cls].get_config()
        for name in inspect.signature(cls).parameters:
            assert saved_as.get((cls, name), name) in config, (key, name)


def test_a_name_target_that_names_a_class_stays_a_name_when_saved():
    # In a user's config and in Python "Dense" is the class; a layer named
    # so is `LayerName("Dense")`, and a saved target that was that name must
    # come back as that name.
    assert Recompute(["Dense"]).targets == (keras.layers.Dense,)
    saved = Recompute([kip.passes.LayerName("Dense"), keras.layers.Dense])
    loaded = Recompute.from_config(json.loads(json.dumps(saved.get_config())))
    assert loaded.targets == ("Dense", keras.layers.Dense)
    assert type(loaded.targets[0]) is kip.passes.LayerName


def test_a_layer_class_with_no_name_is_an_error_at_save_naming_it():
    class Unnamed(keras.layers.Dense):
        pass

    for one_pass in (Recompute([Unnamed]),
                     Replace({"head": Replacement(Unnamed)}),
                     PipelineStages([["stem"], [Unnamed]])):
        with pytest.raises(kip.PassError, match="Unnamed.*kip.register_layer"):
            one_pass.get_config()


def test_a_class_registered_with_kip_saves_by_its_registered_name(monkeypatch):
    monkeypatch.setattr(kip.passes.infra.layer_class_names, "_registry", {})

    class Turbo(keras.layers.Dense):
        pass

    kip.register_layer(Turbo, name="TurboDense")
    config = Recompute([Turbo]).get_config()
    assert config == {"targets": [{"class": "TurboDense"}], "auto": False, "memory_budget": None}
    assert Recompute.from_config(config).targets == (Turbo,)


def test_copy_weights_fn_cannot_be_saved_and_the_error_names_it():
    def copy_kernel(old, new):
        new.kernel.assign(old.kernel)

    one_pass = Replace({"head": Replacement(SavedDense, copy_weights_fn=copy_kernel)})
    with pytest.raises(kip.PassError, match="copy_weights_fn=.*copy_kernel"):
        one_pass.get_config()


def test_a_replacement_parameter_that_is_not_data_cannot_be_saved():
    replace = kip.passes.Replace(
        {"dense": kip.passes.Replacement(keras.layers.Dense, params={"activation": lambda x: x})})
    with pytest.raises(kip.PassError, match="activation"):
        replace.get_config()


def test_a_list_config_runs_passes_in_its_own_order(tmp_path):
    listed = [{"recompute": "block_1"}, {"expand": "all"}]
    assert kip.passes_from_config(listed) == [Recompute("block_1"), Expand()]
    path = tmp_path / "ordered.yaml"
    path.write_text("- recompute: block_1\n- expand: all\n- recompute: [block_2]\n")
    assert kip.passes_from_config(path) == [Recompute("block_1"), Expand(), Recompute("block_2")]
    # A mapping keeps the documented order, whatever the order of its keys.
    assert kip.passes_from_config({"recompute": "block_1", "expand": "all"}) == [
        Expand(), Recompute("block_1")]


@pytest.mark.parametrize(
    "config, path",
    [
        ([{"expand": "all", "recompute": ["a"]}], "0"),
        ([{"expand": "all"}, "recompute"], "1"),
        ([{"expand": "all"}, {"expnd": "all"}], "1.expnd"),
        ([{"recompute": ["block_1", 7]}], "0.recompute.1"),
        ([{"replace": {"Dense": {"class": "Dense", "params": {"unitz": 3}}}}],
         "0.replace.Dense.params.unitz"),
        ({"outline": {"targets": ["Dense"], "kwargs": {"targets": 1}}}, "outline.kwargs.targets"),
        ({"pipeline_stages": [["a"], []]}, "pipeline_stages.1"),
    ],
)
def test_errors_in_list_configs_and_pass_checks_name_their_path(config, path):
    error = error_of(config)
    assert error.path == path


def test_one_class_replaced_twice_under_two_names_is_an_error(monkeypatch):
    # Was: the second replacement silently took the place of the first.
    monkeypatch.setattr(kip.passes.infra.layer_class_names, "_registry", {})
    kip.register_layer(SavedDense, name="Fast")
    config = {"replace": {"kip_test_config>SavedDense": {"class": "Dense"}, "Fast": {"class": "Dense"}}}
    error = error_of(config)
    assert error.path == "replace.Fast" and "twice" in str(error)


@pytest.fixture
def pass_registry(monkeypatch):
    """The pass registry, restored after the test."""
    monkeypatch.setattr(base, "_PASSES", dict(base._PASSES))


def define_count_layers():
    """A new pass in one place: the class, its config methods, the decorator."""

    @kip.passes.register_pass("count_layers")
    class CountLayers(kip.passes.Pass):
        """Reports each matched layer under `label`; changes nothing."""

        step = "count_layers"

        def __init__(self, targets, label="seen"):
            self.targets = as_targets(targets)
            self.label = label

        def get_config(self):
            return {"targets": targets_config(self.targets, "CountLayers"), "label": self.label}

        @classmethod
        def from_config(cls, config):
            return cls(targets_from_config(config["targets"], "CountLayers"), config["label"])

        @classmethod
        def from_user_config(cls, value, path, reader):
            if not isinstance(value, dict) or "targets" not in value:
                raise kip.ConfigError(path, "expected {targets: [...], label: ...}")
            return cls(reader.targets(value["targets"], f"{path}.targets"), value.get("label", "seen"))

        def run(self, graph, report):
            for node in matched_nodes(graph, self.targets, self.step):
                report.add(self.step, node.name, self.label)
            return graph

    return CountLayers


def test_a_pass_defined_in_one_place_is_usable_from_configs(pass_registry):
    CountLayers = define_count_layers()
    listed = [{"expand": "all"}, {"count_layers": {"targets": "LayerNormalization", "label": "norm"}}]
    passes = kip.passes_from_config(listed)
    assert passes == [Expand(), CountLayers(keras.layers.LayerNormalization, "norm")]
    # In a mapping, a pass registered without an order runs after the built-in ones.
    mapped = {"count_layers": {"targets": ["block_1.dense"]}, "expand": "all"}
    assert kip.passes_from_config(mapped) == [Expand(), CountLayers("block_1.dense")]
    error = error_of([{"count_layers": {"targets": ["x", 3]}}])
    assert error.path == "0.count_layers.targets.1"

    x, _ = data()
    converted = kip.convert_to_functional(Net(), x[:8])
    passed = kip.apply_passes(converted, listed)  # apply_passes takes the list config too
    assert passed.kip_report.touched("count_layers") == ["block_1.norm", "block_2.norm"]


def test_register_pass_refuses_a_key_taken_by_another_class(pass_registry):
    with pytest.raises(kip.PassError, match="'expand' is taken"):
        @kip.passes.register_pass("expand")
        class OtherExpand(kip.passes.Pass):
            pass
    with pytest.raises(kip.PassError, match="identifier"):
        kip.passes.register_pass("not a key")


def test_an_unregistered_pass_cannot_be_saved_and_the_error_says_how():
    class Unregistered(kip.passes.Pass):
        def run(self, graph, report):
            return graph

    with pytest.raises(kip.PassError, match="register_pass"):
        base.serialize_pass(Unregistered())
    x, _ = data()
    plugin = kip.PluginModel(Net(), passes=[Unregistered()])
    with pytest.raises(kip.PassError, match="cannot be saved with its passes.*Unregistered"):
        plugin.get_config()


def fit_one_epoch(model, x, y):
    model.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False)


def test_plugin_model_with_python_passes_saves_loads_and_trains_on_identically(tmp_path):
    x, y = data()
    passes = [Expand(), Recompute([keras.layers.LayerNormalization])]
    model = kip.PluginModel(Net(), passes=passes)
    model.compile(optimizer="adam", loss="mse")
    fit_one_epoch(model, x, y)
    path = tmp_path / "plugin.keras"
    model.save(path)
    loaded = keras.models.load_model(path)
    assert loaded._kip_session.passes == passes
    np.testing.assert_allclose(loaded.predict(x, verbose=0), model.predict(x, verbose=0), atol=1e-6)
    for fitted in (model, loaded):
        fit_one_epoch(fitted, x, y)
    assert loaded.converted.kip_graph.node("block_1.norm").annotations == {"recompute": True}
    for expected, actual in zip(model.get_weights(), loaded.get_weights(), strict=True):
        np.testing.assert_allclose(actual, expected, atol=1e-6)


def test_plugin_model_with_a_new_pass_saves_and_loads(tmp_path, pass_registry):
    CountLayers = define_count_layers()
    x, y = data()
    model = kip.PluginModel(Net(), passes=[Expand(), CountLayers([keras.layers.Dense])])
    model.compile(optimizer="sgd", loss="mse")
    fit_one_epoch(model, x, y)
    model.save(tmp_path / "counted.keras")
    loaded = keras.models.load_model(tmp_path / "counted.keras")
    assert loaded._kip_session.passes == [Expand(), CountLayers([keras.layers.Dense])]


def test_plugin_model_saved_with_a_config_dict_by_earlier_versions_still_loads():
    config = {
        "name": "old", "model": keras.saving.serialize_keras_object(Net()),
        "passes": {"expand": "all"}, "rebuild_on_new_variables": True, "verify": True,
    }
    assert kip.PluginModel.from_config(config)._kip_session.passes == [Expand()]
