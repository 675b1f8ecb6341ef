"""Hostile `.keras` files: loading runs nothing a file names.

A real model holding every kind of kip layer (a TensorFlow function, a
random draw, a batch-sized operation, an opaque layer, an alias, a variable
read, a held constant) and a `PluginModel` with passes are saved once; each
case edits one entry of `config.json` the way an attacker would (a path to
`os.system`, `eval`, file writes, native libraries; private names; unknown
names; values of the wrong type) and loads it with Keras's defaults. Each
must fail with an error naming the entry, and nothing may run: no file is
written, no module is imported.
"""

import copy
import json
import sys
import zipfile

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras import ops

import keras_ipu_plugin as kip

PACKAGE = "kip_hostile_test"


@keras.saving.register_keras_serializable(package=PACKAGE)
class Features(keras.layers.Layer):
    """Reads its own weight, a position table, a token broadcast to the
    batch, a random draw, and calls TensorFlow functions."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.proj = keras.layers.Dense(4, name="proj")
        self.positions = keras.layers.Embedding(3, 4, name="positions")
        self.seed_generator = keras.random.SeedGenerator(7)

    def build(self, input_shape):
        self.scale = self.add_weight(shape=(4,), initializer="ones", name="scale")
        self.token = self.add_weight(shape=(1, 1, 4), initializer="ones", name="token")

    def call(self, x, training=None):
        h = self.proj(x) * self.scale  # a variable read
        h = h[:, None, :] + self.positions(ops.arange(3))[None]  # a held constant
        token = ops.broadcast_to(self.token, (ops.shape(x)[0], 1, 4))  # batch-sized
        h = ops.concatenate([token, h], axis=1)
        noise = keras.random.normal((ops.shape(x)[0], 1, 4), stddev=0.0,
                                    seed=self.seed_generator)  # a random draw
        return tf.reduce_sum(tf.square(h + noise), axis=1)  # TensorFlow functions


@keras.saving.register_keras_serializable(package=PACKAGE)
class Dynamic(keras.layers.Layer):
    """Branches in Python on a tensor's value: stays one opaque node."""

    def call(self, x):
        if float(ops.sum(x)) > 1e9:
            return x * 2.0
        return x


@keras.saving.register_keras_serializable(package=PACKAGE)
class Block(keras.layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.proj = keras.layers.Dense(4, name="proj")  # the name of Features.proj

    def call(self, x):
        return self.proj(x)


@keras.saving.register_keras_serializable(package=PACKAGE)
class Counts(keras.layers.Layer):
    """Counts its calls: a variable write (and an ordering node) in the graph."""

    def build(self, input_shape):
        self.calls = self.add_weight(shape=(), initializer="zeros", trainable=False,
                                     name="calls")

    def call(self, x):
        self.calls.assign_add(1.0)
        return x


@keras.saving.register_keras_serializable(package=PACKAGE)
class Hostile(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.features, self.dynamic, self.block = Features(), Dynamic(), Block()
        self.counts = Counts()
        self.head = keras.layers.Dense(1)

    def call(self, x, training=None):
        return self.head(self.block(self.dynamic(self.counts(self.features(x)))))


X = np.random.default_rng(0).random((4, 5)).astype("float32")


def _save(model, path):
    model.save(path)
    with zipfile.ZipFile(path) as archive:
        return {name: archive.read(name) for name in archive.namelist()}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(files of the saved expanded model, files of a saved PluginModel)."""
    folder = tmp_path_factory.mktemp("saved")
    model = Hostile()
    converted = kip.convert_to_functional(model, X)
    passed = kip.apply_passes(converted, [kip.passes.Expand()])
    graph_files = _save(passed, folder / "graph.keras")
    config = json.loads(graph_files["config.json"])
    for kind in ("TFFunction", "RandomDraw", "BatchSizedOperation", "OpaqueLayer", "LayerAlias",
                 "VariableRead", "HeldConstant", "VariableWrite", "AfterWrites"):
        assert _entries(config, kind), kind
    plugin = kip.PluginModel(Hostile(), passes=[
        kip.passes.Expand(), kip.passes.Recompute(kip.passes.Chain(keras.layers.Dense, keras.layers.Dense)),
    ])
    plugin(X)
    plugin_files = _save(plugin, folder / "plugin.keras")
    # Load each once, clean: later loads must import nothing new.
    for files in (graph_files, plugin_files):
        _load(files, folder / "clean.keras")
    return graph_files, plugin_files, passed


def _write(files, config, path):
    with zipfile.ZipFile(path, "w") as archive:
        for name, data in files.items():
            archive.writestr(name, json.dumps(config) if name == "config.json" else data)


def _load(files, path, config=None):
    _write(files, json.loads(files["config.json"]) if config is None else config, path)
    return keras.models.load_model(path)


def _graph_tensor(config):
    """A saved argument that is the graph's first input."""
    name = config["config"]["input_layers"][0][0]
    return {"class_name": "__keras_tensor__",
            "config": {"shape": [None, 5], "dtype": "float32", "keras_history": [name, 0, 0]}}


def _entries(config, class_name):
    """Every serialized object of `class_name` in a config, anywhere."""
    found = []

    def walk(value):
        if isinstance(value, dict):
            if value.get("class_name") == class_name:
                found.append(value)
            for item in value.values():
                walk(item)
        elif isinstance(value, list):
            for item in value:
                walk(item)

    walk(config)
    return found


def test_the_untouched_files_load_and_compute_as_saved(saved, tmp_path):
    graph_files, plugin_files, passed = saved
    loaded = _load(graph_files, tmp_path / "graph.keras")
    np.testing.assert_allclose(loaded(X), passed(X), rtol=1e-5)
    plugin = _load(plugin_files, tmp_path / "plugin.keras")
    assert [type(p).__name__ for p in plugin._kip_session.passes] == ["Expand", "Recompute"]


# -- TensorFlow functions ------------------------------------------------------
# Each of these was reachable by walking attributes from `tf`, and ran inside
# `load_model` with safe_mode=True.
EFFECTFUL_PATHS = [
    ("_os.system", ["touch {out}/shell"]),
    ("__builtins__.eval", ["open('{out}/eval', 'w')"]),
    ("__builtins__.exec", ["open('{out}/exec', 'w')"]),
    ("__builtins__.__import__", ["this"]),
    ("compat.v1.resource_loader.importlib.import_module", ["this"]),
    ("load_library", ["{out}/lib.so"]),
    ("load_op_library", ["{out}/lib.so"]),
    ("io.write_file", ["{out}/write_file", "x"]),
    ("io.gfile.remove", ["{out}/existing"]),
    ("raw_ops.WriteFile", []),
    ("print", ["x"]),
    ("compat.v1.gfile.Copy", ["{out}/existing", "{out}/copy"]),
    ("py_function", []),
    ("numpy_function", []),
    ("saved_model.save", []),
    ("summary.scalar", ["x", 1.0]),
    ("debugging.assert_equal", [1, 2]),
    ("random.normal", [[2]]),
    ("math._private", [1.0]),
    ("math.nosuch", [1.0]),
    ("strings.format", ["{{}}", [1]]),  # pure, but not recorded: not in the table
    ("math", [1.0]),  # a module, not a function
    ("", [1.0]),
    ("math..square", [1.0]),
    ("math.square ", [1.0]),
]


@pytest.mark.parametrize("path,args", EFFECTFUL_PATHS, ids=[p or "empty" for p, _ in EFFECTFUL_PATHS])
def test_a_tf_function_outside_the_table_is_refused_and_nothing_runs(saved, tmp_path, path, args):
    graph_files = saved[0]
    out = tmp_path / "out"
    out.mkdir()
    (out / "existing").write_text("keep")
    config = json.loads(graph_files["config.json"])
    layers = config["config"]["layers"]
    layers.append({
        "module": "keras_ipu_plugin.layers.tf_calls", "class_name": "TFFunction",
        "config": {"function": path, "name": "evil"},
        "registered_name": "keras_ipu_plugin>TFFunction", "name": "evil",
        # With a graph tensor among its arguments, as a traced call has:
        # the name alone is refused.
        "inbound_nodes": [{"args": [_graph_tensor(config)] + json.loads(
            json.dumps(args).replace("{out}", str(out))), "kwargs": {}}],
    })
    modules = set(sys.modules)
    with pytest.raises(kip.LoadError, match="TFFunction `evil`") as raised:
        _load(graph_files, tmp_path / "evil.keras", config)
    assert repr(f"tf.{path}")[1:-1] in str(raised.value) or path == ""
    assert sorted(p.name for p in out.iterdir()) == ["existing"]
    assert (out / "existing").read_text() == "keep"
    assert set(sys.modules) - modules == set()


@pytest.mark.parametrize("config_edit,match", [
    (lambda c: c.update(function=42), "a function path is a string"),
    (lambda c: c.update(function=["math", "square"]), "a function path is a string"),
    (lambda c: c.pop("function"), "a saved config is"),
    (lambda c: c.update(extra="x"), "a saved config is"),
    (lambda c: c.update(name=7), "a name is a string"),
])
def test_a_tf_function_entry_of_the_wrong_shape_is_refused(saved, tmp_path, config_edit, match):
    config = json.loads(saved[0]["config.json"])
    config_edit(_entries(config, "TFFunction")[0]["config"])
    with pytest.raises(kip.LoadError, match=match):
        _load(saved[0], tmp_path / "evil.keras", config)


def test_every_table_entry_is_a_public_function_and_every_recorded_function_loads():
    from keras_ipu_plugin.layers import tf_calls as table

    for path in table.RECORDED:
        assert table.refused_reason(path) is None, path
        assert callable(table.function_at(path, "test")), path
        assert "random" not in path and not any(p.startswith("_") for p in path.split("."))


# -- every other kip layer a file can name --------------------------------------
HOSTILE_ENTRIES = [
    # RandomDraw: the distribution is looked up in keras.random
    ("RandomDraw", lambda c: c.update(distribution="__class__"), "distribution"),
    ("RandomDraw", lambda c: c.update(distribution="shuffle"), "distribution"),
    ("RandomDraw", lambda c: c["arguments"].update(__init__=1), "arguments"),
    ("RandomDraw", lambda c: c["arguments"].update(stddev="__import__('os')"), "arguments.stddev"),
    ("RandomDraw", lambda c: c.update(arguments=["x"]), "arguments"),
    ("RandomDraw", lambda c: c.update(seed={"module": "os", "class_name": "system",
                                            "config": {}, "registered_name": None}), "seed"),
    ("RandomDraw", lambda c: c.update(seed={"module": "keras.layers", "class_name": "Lambda",
                                            "config": {}, "registered_name": None}), "seed"),
    ("RandomDraw", lambda c: c.update(seed="os.system"), "seed"),
    ("RandomDraw", lambda c: c.update(draw_dtype="object"), "draw_dtype"),
    ("RandomDraw", lambda c: c.update(shape=["x"]), "shape"),
    # BatchSizedOperation: the operation is a Keras object, its attributes set by name
    ("BatchSizedOperation", lambda c: c.update(operation={
        "module": "keras_ipu_plugin.layers.tf_calls", "class_name": "TFFunction",
        "config": {"function": "_os.system"}, "registered_name": "keras_ipu_plugin>TFFunction"}),
     "operation"),
    ("BatchSizedOperation", lambda c: c.update(operation={
        "module": "keras.src.utils.io_utils", "class_name": "print_msg", "config": {},
        "registered_name": None}), "operation"),
    ("BatchSizedOperation", lambda c: c.update(operation="os.system"), "operation"),
    ("BatchSizedOperation", lambda c: c.update(attributes=["call"]), "attributes"),
    ("BatchSizedOperation", lambda c: c.update(attributes=["__class__"]), "attributes"),
    ("BatchSizedOperation", lambda c: c.update(attributes="shape"), "attributes"),
    ("BatchSizedOperation", lambda c: c.update(multiples={"shape": "x"}), "multiples"),
    ("BatchSizedOperation", lambda c: c.update(multiples={"call": 2}), "multiples"),
    # OpaqueLayer / LayerAlias: the wrapped layer is Keras's to make
    ("OpaqueLayer", lambda c: c.update(layer="os.system"), "layer"),
    ("OpaqueLayer", lambda c: c.update(reason=5), "reason"),
    ("OpaqueLayer", lambda c: c.update(output_specs={"shape": [None, "x"], "dtype": "float32"}),
     "output_specs"),
    ("OpaqueLayer", lambda c: c.update(output_specs={"shape": [None], "dtype": "object"}),
     "output_specs"),
    ("OpaqueLayer", lambda c: c.update(output_specs={"list": "x", "tuple": False}),
     "output_specs"),
    ("LayerAlias", lambda c: c.update(layer=["x"]), "layer"),
    ("LayerAlias", lambda c: c.update(tensor_outputs_only="yes"), "tensor_outputs_only"),
    # variable reads and constants
    ("VariableRead", lambda c: c.update(variable_shape=[-1]), "variable_shape"),
    ("VariableRead", lambda c: c.update(variable_shape=[None]), "variable_shape"),
    ("VariableRead", lambda c: c.update(variable_dtype="object"), "variable_dtype"),
    ("VariableRead", lambda c: c.update(variable_trainable="no"), "variable_trainable"),
    ("HeldConstant", lambda c: c.update(value_dtype="object"), "value_dtype"),
    ("HeldConstant", lambda c: c.update(value=[{"a": 1}]), "value"),
    # variable writes, and the variable a write shares with another layer
    ("VariableWrite", lambda c: c.update(method="eval"), "method"),
    ("VariableWrite", lambda c: c.update(method=["assign"]), "method"),
    ("VariableWrite", lambda c: c.update(variable_dtype="object"), "variable_dtype"),
    ("VariableWrite", lambda c: c.update(variable_shape=["x"]), "variable_shape"),
    ("VariableWrite", lambda c: c.update(variable_trainable=1), "variable_trainable"),
    ("VariableWrite", lambda c: c.update(variable_owner="os.system"), "variable_owner"),
    ("VariableWrite", lambda c: c.update(variable_owner=["head", -1]), "variable_owner"),
    ("VariableWrite", lambda c: c.update(variable_owner=["no_such_layer", 0]), "variable_owner"),
    ("VariableWrite", lambda c: c.update(variable_owner=[c["variable_owner"][0], 99]),
     "variable_owner"),
    ("VariableWrite", lambda c: c.update(variable_owner=["head", 0]), "variable_owner"),
    ("VariableRead", lambda c: c.update(variable_owner=[1, 0]), "variable_owner"),
    # the functional model's own entries
    ("KipFunctional", lambda c: c.update(kip_original_mask="eval"), "kip_original_mask"),
    ("KipFunctional", lambda c: c.update(kip_pinned_training={"x": "no"}), "kip_pinned_training"),
    ("KipFunctional", lambda c: c.update(kip_stage_devices=[1]), "kip_stage_devices"),
    ("KipFunctional", lambda c: c.update(kip_layer_paths=["x"]), "kip_layer_paths"),
    ("KipFunctional", lambda c: c.update(kip_annotations={"head": {"stage": -1}}),
     "kip_annotations.head.stage"),
    ("KipFunctional", lambda c: c.update(kip_annotations={"head": {"outline": {"__init__": 1}}}),
     "kip_annotations.head.outline"),
]


@pytest.mark.parametrize("class_name,config_edit,key", HOSTILE_ENTRIES,
                         ids=[f"{c}-{k}-{i}" for i, (c, _, k) in enumerate(HOSTILE_ENTRIES)])
def test_a_hostile_entry_of_a_kip_layer_is_refused_naming_layer_and_key(
        saved, tmp_path, class_name, config_edit, key):
    config = json.loads(saved[0]["config.json"])
    entry = _entries(config, class_name)[0]
    config_edit(entry["config"])
    modules = set(sys.modules)
    with pytest.raises(kip.LoadError) as raised:
        _load(saved[0], tmp_path / "evil.keras", config)
    message = str(raised.value)
    assert f"{class_name} `" in message and key in message, message
    assert set(sys.modules) - modules == set()


def test_a_wrapped_lambda_is_refused_by_keras_safe_mode_and_loads_when_unsafe_is_asked(
        saved, tmp_path):
    """The layer an OpaqueLayer wraps is the user's: Keras makes it, under
    its own safe_mode (a Lambda's bytecode is code)."""
    config = json.loads(saved[0]["config.json"])
    opaque = _entries(config, "OpaqueLayer")[0]["config"]
    marker = tmp_path / "lambda_ran"
    lambda_layer = keras.layers.Lambda(lambda x: x)
    opaque["layer"] = keras.saving.serialize_keras_object(lambda_layer)
    _write(saved[0], config, tmp_path / "lambda.keras")
    with pytest.raises(ValueError, match="safe_mode"):
        keras.models.load_model(tmp_path / "lambda.keras")
    assert not marker.exists()
    loaded = keras.models.load_model(tmp_path / "lambda.keras", safe_mode=False)
    assert any(type(layer).__name__ == "OpaqueLayer" for layer in loaded.layers)


# -- passes saved with a PluginModel -----------------------------------------------
def _first_pass(config):
    return _entries(config, "PluginModel")[0]["config"]["passes"]


PASS_EDITS = [
    (lambda p: p.__setitem__(0, {"pass": "os.system", "config": {}}), "Unknown pass"),
    (lambda p: p.__setitem__(0, {"pass": "expand", "config": {"targets": [{"class": "__class__"}]}}),
     "unknown layer class"),
    (lambda p: p.__setitem__(0, {"pass": "expand", "config": {
        "targets": [{"class": "__subclasses__"}]}}), "unknown layer class"),
    (lambda p: p[1]["config"]["targets"][0]["chain"].append({"op": "__import__"}),
     "not a public keras.ops function"),
    (lambda p: p[1]["config"]["targets"][0]["chain"].append({"op": "_impl"}),
     "not a public keras.ops function"),
    (lambda p: p[1]["config"]["targets"][0]["chain"].append({"tf": "_os.system"}),
     "refusing `tf._os.system`"),
    (lambda p: p[1]["config"]["targets"][0]["chain"].append({"tf": "io.write_file"}),
     "refusing `tf.io.write_file`"),
    (lambda p: p[1]["config"]["targets"][0]["chain"].append({"class": "os:system"}),
     "unknown layer class"),
    (lambda p: p[1]["config"]["targets"][0]["chain"].append({"tf": 3}), "a chain step is"),
]


@pytest.mark.parametrize("edit,match", PASS_EDITS, ids=[str(i) for i in range(len(PASS_EDITS))])
def test_a_hostile_saved_pass_is_refused_and_nothing_is_imported(saved, tmp_path, edit, match):
    config = json.loads(saved[1]["config.json"])
    edit(_first_pass(config))
    modules = set(sys.modules)
    with pytest.raises(ValueError, match=match):
        _load(saved[1], tmp_path / "evil.keras", config)
    assert set(sys.modules) - modules == set()


# -- chain steps in configs -------------------------------------------------------
@pytest.mark.parametrize("step,match", [
    ({"tf": "io.write_file"}, "refusing `tf.io.write_file`"),
    ({"tf": "_os.system"}, "private part"),
    ({"tf": "math.nosuch"}, "not one of the TensorFlow functions kip records"),
    ({"op": "__import__"}, "not a public keras.ops function"),
    ({"op": "image"}, "not a public keras.ops function"),  # a namespace, not a function
    ({"class": "__class__"}, "unknown layer class"),
    ("__class__", None),  # a string step is a layer name: it only ever matches names
])
def test_config_chain_steps_are_checked_against_the_tables_when_read(step, match):
    config = {"recompute": [{"chain": ["Dense", step]}]}
    if match is None:
        (one,) = kip.passes_from_config(config)
        assert one.targets[0].steps[1].target == "__class__"
        return
    with pytest.raises(kip.ConfigError, match=match) as raised:
        kip.passes_from_config(config)
    assert raised.value.path.startswith("recompute"), raised.value.path


def test_a_chain_step_naming_a_tf_function_outside_the_table_is_refused_in_python():
    with pytest.raises(kip.PassError, match="chain step"):
        kip.passes.Chain(keras.layers.Dense, tf.io.write_file)
    with pytest.raises(kip.PassError, match="never matches"):
        kip.passes.Chain(keras.layers.Dense, tf.math.bincount)
    assert kip.passes.Chain(keras.layers.Dense, tf.nn.relu)


def test_an_edited_file_is_refused_whole_and_the_same_clean_file_still_loads(saved, tmp_path):
    config = json.loads(saved[0]["config.json"])
    hostile = copy.deepcopy(config)
    _entries(hostile, "TFFunction")[0]["config"]["function"] = "_os.system"
    with pytest.raises(kip.LoadError):
        _load(saved[0], tmp_path / "evil.keras", hostile)
    np.testing.assert_allclose(_load(saved[0], tmp_path / "ok.keras", config)(X), saved[2](X),
                               rtol=1e-5)


# -- a file names no path, runs no op ---------------------------------------------
def _plugin_entry(plugin_files, **changes):
    """The saved PluginModel object of `plugin.keras`, its config changed."""
    entry = json.loads(plugin_files["config.json"])
    entry["config"].update(changes)
    return entry


@pytest.fixture()
def passes_file(tmp_path):
    """A pass config on disk that a file could name by its path."""
    path = tmp_path / "elsewhere.yaml"
    path.write_text("read_from_disk: all\n")  # read, it would fail naming this key
    return str(path)


def test_a_saved_plugin_model_whose_passes_are_a_path_is_refused_without_reading_it(
        saved, tmp_path, passes_file):
    """`passes` of a saved PluginModel is the list its `get_config` wrote:
    a string is never read as a config file (a YAML file elsewhere, a FIFO,
    `/dev/stdin`), it is refused naming the key."""
    config = _plugin_entry(saved[1], passes=passes_file)
    with pytest.raises(kip.LoadError, match=r"PluginModel `.*`: passes must be") as raised:
        _load(saved[1], tmp_path / "evil.keras", config)
    assert "read_from_disk" not in str(raised.value)


def test_a_plugin_model_entry_among_a_graphs_layers_is_checked_before_it_is_made(
        saved, tmp_path, passes_file):
    """The same entry, reached as a layer of a saved KipFunctional."""
    config = json.loads(saved[0]["config.json"])
    entry = _plugin_entry(saved[1], passes=passes_file)
    entry.update(name="inner", inbound_nodes=[])
    config["config"]["layers"].append(entry)
    with pytest.raises(kip.LoadError, match=r"PluginModel `.*`: passes must be"):
        _load(saved[0], tmp_path / "evil.keras", config)


def test_a_mode_switch_body_of_another_class_is_refused_from_the_file_before_it_is_made(
        saved, tmp_path, passes_file):
    """A ModeSwitch's body is a saved KipFunctional: its class is read from
    the file, and another class (a PluginModel whose passes name a path)
    is refused before Keras makes it."""
    config = json.loads(saved[0]["config.json"])
    config["config"]["layers"].append({
        "module": "keras_ipu_plugin.runtime.mode_switch", "class_name": "ModeSwitch",
        "registered_name": "keras_ipu_plugin>ModeSwitch", "name": "switch", "inbound_nodes": [],
        "config": {"name": "switch", "body": _plugin_entry(saved[1], passes=passes_file),
                   "outputs": {"training": [0], "inference": [0]}, "none_means": "inference"},
    })
    with pytest.raises(kip.LoadError, match=r"ModeSwitch `switch`: body must be a saved "
                                            r"KipFunctional") as raised:
        _load(saved[0], tmp_path / "evil.keras", config)
    assert "read_from_disk" not in str(raised.value)


def _constant_node(name, class_entry, args, kwargs=None):
    return {**class_entry, "name": name,
            "config": {**class_entry["config"], "name": name},
            "inbound_nodes": [{"args": args, "kwargs": kwargs or {}}]}


TF_FUNCTION = {"module": "keras_ipu_plugin.layers.tf_calls", "class_name": "TFFunction",
               "registered_name": "keras_ipu_plugin>TFFunction", "config": {}}


@pytest.mark.parametrize("function,args,kwargs", [
    ("broadcast_to", [1.0, [64, 64]], {}),
    ("range", [10], {}),
    ("math.square", [], {"x": 2.0}),
    ("math.square", [{"class_name": "__numpy__", "config": {"value": [1.0], "dtype": "float32"}}],
     {}),
])
def test_a_node_called_on_constants_only_is_refused_before_it_runs(
        saved, tmp_path, function, args, kwargs):
    """A traced call always has a graph tensor among its arguments: a node
    whose arguments are all constants can only come from an edited file,
    and running it while loading would compute (and allocate) what the
    file asks. It is refused naming the node; nothing runs."""
    config = json.loads(saved[0]["config.json"])
    entry = dict(TF_FUNCTION, config={"function": function})
    config["config"]["layers"].append(_constant_node("big", entry, args, kwargs))
    modules = set(sys.modules)
    with pytest.raises(kip.LoadError, match="`big`.* constants"):
        _load(saved[0], tmp_path / "evil.keras", config)
    assert set(sys.modules) - modules == set()


def test_a_random_draw_anchored_on_a_keyword_constant_is_refused_before_it_draws(saved, tmp_path):
    config = json.loads(saved[0]["config.json"])
    draw = copy.deepcopy(_entries(config, "RandomDraw")[0])
    draw["config"]["shape"] = [None, 64, 64]
    config["config"]["layers"].append(
        _constant_node("drawn", draw, [], {"anchor": [[1.0]] * 8}))
    with pytest.raises(kip.LoadError, match="`drawn`.* constants"):
        _load(saved[0], tmp_path / "evil.keras", config)


@pytest.mark.parametrize("key,value", [
    ("static_batch", "false"), ("verify", "no"), ("rebuild_on_new_variables", "maybe"),
    ("static_batch", 0), ("name", ["x"]), ("model", "os.system"), ("passes", {"expand": 1}),
    ("extra", 1),
])
def test_a_saved_plugin_model_field_of_the_wrong_type_is_refused_naming_it(
        saved, tmp_path, key, value):
    """`static_batch: "false"` is no false: each field of a saved
    PluginModel is the type its `get_config` writes, or the load fails
    naming it (never a string kept where a bool belongs)."""
    config = _plugin_entry(saved[1], **{key: value})
    with pytest.raises(kip.LoadError, match=f"PluginModel `[^`]*`: .*{key}"):
        _load(saved[1], tmp_path / "evil.keras", config)


BATCH_SIZED_EDITS = [
    (lambda c: c.update(operation={"module": "keras.src.ops.core", "class_name": "Cond",
                                   "config": {"name": "cond"}, "registered_name": "Cond"},
                        attributes=[]), "attributes"),
    (lambda c: c.update(attributes=[]), "attributes"),
    (lambda c: c["operation"].update(module="keras.src.ops.nosuch"), "operation"),
    (lambda c: c["operation"].update(class_name="__class__"), "operation"),
    (lambda c: c["operation"].update(registered_name=7), "operation"),
    (lambda c: c["operation"]["config"].update(shape="x"), "shape"),
]


@pytest.mark.parametrize("edit,key", BATCH_SIZED_EDITS, ids=[str(i) for i in
                                                              range(len(BATCH_SIZED_EDITS))])
def test_a_batch_sized_operation_that_could_not_run_is_refused_at_load(saved, tmp_path, edit, key):
    """A BatchSizedOperation whose operation or attributes could not run
    (an operation with no shape to fill, a module that does not exist) is
    refused at load with a LoadError naming the node, not a TypeError
    from Keras at the first call; nothing the file names is imported."""
    config = json.loads(saved[0]["config.json"])
    edit(_entries(config, "BatchSizedOperation")[0]["config"])
    modules = set(sys.modules)
    with pytest.raises(kip.LoadError, match=f"BatchSizedOperation `.*`.*{key}"):
        _load(saved[0], tmp_path / "evil.keras", config)
    assert set(sys.modules) - modules == set()


@pytest.mark.parametrize("devices", [
    ["/device:IPU:" + "9" * 100_000], ["x" * 100_000], ["/cpu:0", "not a device"],
    ["/device:CPU:99999999999"],
])
def test_a_stage_device_name_that_is_no_device_is_refused_at_load(saved, tmp_path, devices):
    """A stage device name is a TensorFlow device (`/cpu:0`,
    `/device:IPU:1`) of bounded length: anything else fails the load
    naming the key, not the first call with `invalid literal for int()`."""
    config = json.loads(saved[0]["config.json"])
    config["config"]["kip_stage_devices"] = devices
    with pytest.raises(kip.LoadError, match="kip_stage_devices"):
        _load(saved[0], tmp_path / "evil.keras", config)


def test_real_stage_device_names_load(saved, tmp_path):
    config = json.loads(saved[0]["config.json"])
    config["config"]["kip_stage_devices"] = ["/cpu:0", "/device:CPU:0",
                                             "/job:localhost/replica:0/task:0/device:CPU:0"]
    loaded = _load(saved[0], tmp_path / "ok.keras", config)
    assert loaded.kip_stage_devices == config["config"]["kip_stage_devices"]


@pytest.mark.parametrize("class_entry,args,kwargs", [
    (dict(TF_FUNCTION, config={"function": "broadcast_to"}), [1.0, [64, 64]], {}),
    (dict(TF_FUNCTION, config={"function": "math.square"}), [], {"x": 2.0}),
    ("RandomDraw", [], {"anchor": [[1.0]] * 8}),
    ("BatchSizedOperation", [[[1.0]], [[[1.0, 1.0, 1.0, 1.0]]]], {}),
])
def test_a_kip_node_on_constants_in_a_keras_functional_file_is_refused_before_it_runs(
        saved, tmp_path, class_entry, args, kwargs):
    """A file whose outer model is Keras's own `Functional` (whose nodes kip
    does not check before Keras calls them) holding a kip node called on
    constants only: the node refuses the call itself, before it runs."""
    config = json.loads(saved[0]["config.json"])
    if isinstance(class_entry, str):
        class_entry = copy.deepcopy(_entries(config, class_entry)[0])
    config.update(module="keras.src.models.functional", class_name="Functional",
                  registered_name="Functional")
    for key in [key for key in config["config"] if key.startswith("kip_")]:
        del config["config"][key]
    config["config"]["layers"].append(_constant_node("big", class_entry, args, kwargs))
    with pytest.raises(kip.LoadError, match="`big` is called with constants only"):
        _load(saved[0], tmp_path / "evil.keras", config)


def test_a_variable_shape_edited_to_gigabytes_is_refused_before_it_is_made(saved, tmp_path):
    """A read node's variable is made before the saved weights are read:
    a shape edited to billions of values is refused, not allocated."""
    config = json.loads(saved[0]["config.json"])
    _entries(config, "VariableRead")[0]["config"]["variable_shape"] = [2 ** 28 + 1]
    with pytest.raises(kip.LoadError, match="VariableRead `.*`: variable_shape"):
        _load(saved[0], tmp_path / "evil.keras", config)


def test_a_graph_input_given_twice_is_refused_at_load(saved, tmp_path):
    """A functional graph lists each input once: a file listing one twice
    loaded a graph whose first call failed with Keras's error."""
    config = json.loads(saved[0]["config.json"])
    (one,) = [config["config"]["input_layers"]]  # one input: [layer, node, tensor]
    config["config"]["input_layers"] = [one, one]
    with pytest.raises(kip.LoadError, match="input_layers must be each input once"):
        _load(saved[0], tmp_path / "evil.keras", config)
