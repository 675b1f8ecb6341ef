"""`kip.to_keras`: a model of Keras's own classes, whose file loads in a
process that imports neither keras_ipu_plugin nor the user's code."""

import json
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest

import keras_ipu_plugin as kip


class Unit(keras.layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.proj = keras.layers.Dense(8, name="proj")  # the same name in every unit
        self.norm = keras.layers.LayerNormalization()
        self.drop = keras.layers.Dropout(0.3)

    def call(self, x, training=None):
        return keras.ops.relu(x + self.drop(self.norm(self.proj(x)), training=training))


class Net(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.units = [Unit() for _ in range(3)]
        self.mlp = keras.Sequential([keras.layers.Dense(8), keras.layers.Dense(4)])
        self.shared = keras.layers.Dense(4)
        self.head = keras.layers.Dense(2)

    def call(self, x, training=None):
        for unit in self.units:
            x = unit(x, training=training)
        h = self.mlp(x) * 2.0
        return self.head(self.shared(self.shared(h)))  # one layer, two call sites


X = np.random.default_rng(0).normal(size=(4, 8)).astype("float32")

_LOAD = textwrap.dedent("""
    import json, sys
    import numpy as np
    import keras
    model = keras.models.load_model(sys.argv[1])
    arrays = np.load(sys.argv[2])
    flat = [arrays[f"arr_{i}"] for i in range(len(arrays.files))]
    structure = json.loads(sys.argv[3])
    x = flat[0] if structure is None else keras.tree.pack_sequence_as(structure, flat)
    outputs = keras.tree.flatten(model(x))
    loaded = sorted(name for name in sys.modules
                    if name.startswith("keras_ipu_plugin") or name.startswith("tests"))
    print(json.dumps({
        "y": [np.asarray(y).tolist() for y in outputs],
        "dtypes": [str(np.asarray(y).dtype) for y in outputs],
        "weights": [np.asarray(w).tolist() for w in model.weights],
        "trainable": [w.trainable for w in model.weights],
        "modules": loaded}))
""")


def outputs_loaded_by_keras_alone(model, x, tmp_path):
    """`model`'s outputs on `x` (a nest of arrays) from its `.keras` file
    loaded in a fresh Python process that imports neither keras_ipu_plugin
    nor this checkout's tests (`-I`), with the weights loaded there; fails
    when loading needs either."""
    model.save(tmp_path / "plain.keras")
    flat = [np.asarray(array) for array in keras.tree.flatten(x)]
    np.savez(tmp_path / "x.npz", *flat)
    result = subprocess.run(
        [sys.executable, "-I", "-c", _LOAD, str(tmp_path / "plain.keras"), str(tmp_path / "x.npz"),
         json.dumps(keras.tree.map_structure(lambda _: 0, x) if not isinstance(x, np.ndarray)
                    else None)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    loaded = json.loads(result.stdout.strip().splitlines()[-1])
    assert loaded["modules"] == []
    return loaded


def test_an_expanded_model_saves_a_file_keras_alone_loads_with_equal_outputs(tmp_path):
    keras.utils.set_random_seed(0)
    model = Net()
    passed = kip.apply_passes(kip.convert_to_functional(model, X), [kip.passes.Expand("all")])
    plain = kip.to_keras(passed)
    assert all((type(layer).__module__ or "").startswith("keras.") for layer in plain.layers)
    np.testing.assert_allclose(plain(X), model(X), rtol=1e-6, atol=1e-6)
    loaded = outputs_loaded_by_keras_alone(plain, X, tmp_path)
    np.testing.assert_allclose(np.asarray(loaded["y"][0]), model(X), rtol=1e-6, atol=1e-6)


def test_the_plain_model_keeps_the_shared_layer_shared_and_training_modes():
    keras.utils.set_random_seed(0)
    model = Net()
    passed = kip.apply_passes(kip.convert_to_functional(model, X), [kip.passes.Expand("all")])
    plain = kip.to_keras(passed)
    shared = [layer for layer in plain.layers if layer.name == "shared"]
    assert len(shared) == 1 and len(shared[0]._inbound_nodes) == 2
    # Dropout follows `training`, as in the user's model.
    assert not np.allclose(plain(X, training=True), plain(X, training=False))


def test_nodes_that_need_kip_or_the_users_code_are_named():
    keras.utils.set_random_seed(0)
    converted = kip.convert_to_functional(Net(), X)
    with pytest.raises(kip.PassError, match=r"`units.0` \([\w.]*Unit\).*`units.2`.*Expand\(\"all\"\)"):
        kip.to_keras(converted)


def test_a_plugin_model_gives_its_converted_graph():
    keras.utils.set_random_seed(0)
    model = Net()
    plugin = kip.PluginModel(model, passes=[kip.passes.Expand("all")])
    with pytest.raises(kip.PassError, match="to_keras: the PluginModel .* has not seen a batch"):
        kip.to_keras(plugin)
    plugin(X)
    np.testing.assert_allclose(kip.to_keras(plugin)(X), model(X), rtol=1e-6, atol=1e-6)


@keras.saving.register_keras_serializable(package="my_activations")
def scaled_tanh(x):
    return 2.0 * keras.ops.tanh(x)


def test_a_function_registered_by_the_users_package_is_named():
    """A Keras layer whose config names a function registered by another
    package (keras_hub's `gelu_approximate` activation) needs that package
    to load: named, not written into a file Keras alone fails on."""
    inputs = keras.Input((8,))
    model = keras.Model(inputs, keras.layers.Dense(4, activation=scaled_tanh, name="head")(inputs))
    passed = kip.apply_passes(kip.convert_to_functional(model, X), [kip.passes.Expand("all")])
    with pytest.raises(kip.PassError, match=r"`head` \(the registered function "
                       r"`my_activations>scaled_tanh` in its config\)"):
        kip.to_keras(passed)
