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
    x = np.load(sys.argv[2])
    loaded = sorted(name for name in sys.modules
                    if name.startswith("keras_ipu_plugin") or name.startswith("tests"))
    print(json.dumps({"y": np.asarray(model(x)).tolist(), "modules": loaded}))
""")


def test_an_expanded_model_saves_a_file_keras_alone_loads_with_equal_outputs(tmp_path):
    keras.utils.set_random_seed(0)
    model = Net()
    passed = kip.apply_passes(kip.convert_to_functional(model, X), [kip.passes.Expand("all")])
    plain = kip.to_keras(passed)
    assert all((type(layer).__module__ or "").startswith("keras.") for layer in plain.layers)
    np.testing.assert_allclose(plain(X), model(X), rtol=1e-6, atol=1e-6)
    plain.save(tmp_path / "plain.keras")
    np.save(tmp_path / "x.npy", X)
    # `-I`: the fresh process sees neither this checkout nor the tests.
    result = subprocess.run(
        [sys.executable, "-I", "-c", _LOAD, str(tmp_path / "plain.keras"), str(tmp_path / "x.npy")],
        capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    loaded = json.loads(result.stdout.strip().splitlines()[-1])
    assert loaded["modules"] == []
    np.testing.assert_allclose(np.asarray(loaded["y"]), model(X), rtol=1e-6, atol=1e-6)


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
