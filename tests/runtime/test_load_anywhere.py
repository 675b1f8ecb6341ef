"""A saved model loads wherever `keras_ipu_plugin` is imported.

Each kip class a saved file can name is registered with Keras by `import
keras_ipu_plugin` alone: a model holding every kind of kip node, saved
here, loads in a fresh Python process that imports only the package and the
user's own classes, and computes what it computed when saved. The classes
are found by walking the package's modules (a class added later is checked
too), not from a list kept by hand.
"""

import ast
import json
import pathlib
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import saved_kinds

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "keras_ipu_plugin"


def _run_fresh(code, tmp_path):
    """Run `code` in a fresh interpreter (the tests folder on its path,
    this checkout's package first); its stdout's last line, read as JSON."""
    script = tmp_path / "fresh.py"
    script.write_text(textwrap.dedent(code))
    result = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=600,
        cwd=tmp_path, env={"PYTHONPATH": f"{ROOT}:{ROOT / 'tests'}", "PATH": "/usr/bin:/bin",
                           "TF_CPP_MIN_LOG_LEVEL": "3", "HOME": str(tmp_path)})
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def _registered_classes():
    """`(module, class name)` of each class in the package that Keras can
    make from a file: decorated with `register_keras_serializable`."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and any(
                    "register_keras_serializable" in ast.unparse(decorator)
                    for decorator in node.decorator_list):
                found.append((module.removesuffix(".__init__"), node.name))
    return found


def test_the_walk_finds_the_kip_classes():
    names = {name for _, name in _registered_classes()}
    assert {"KipFunctional", "PluginModel", "ModeSwitch", "TFFunction",
            "TensorSizedOperation"} <= names


def test_every_serializable_class_is_registered_by_a_bare_import(tmp_path):
    """After `import keras_ipu_plugin` in a fresh process, Keras finds each
    of the package's serializable classes by its registered name."""
    classes = _registered_classes()
    registered = _run_fresh("""
        import json
        import keras
        import keras_ipu_plugin
        print(json.dumps(sorted(
            name for name in keras.saving.get_custom_objects() if name.startswith("keras_ipu_plugin>"))))
    """, tmp_path)
    missing = [f"{module}.{name}" for module, name in classes
               if f"keras_ipu_plugin>{name}" not in registered]
    assert not missing, f"registered only when their module is imported: {missing}"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = tmp_path_factory.mktemp("kinds")
    paths, models = saved_kinds.saved_files(folder)
    outputs = {name: np.asarray(model(saved_kinds.X)).tolist() for name, model in models.items()}
    return paths, outputs


def test_the_saved_files_hold_every_node_kind(saved):
    import zipfile

    paths, _ = saved
    with zipfile.ZipFile(paths["expanded.keras"]) as archive:
        kinds = saved_kinds.config_kinds(json.loads(archive.read("config.json")))
    assert set(saved_kinds.NODE_KINDS) <= kinds, set(saved_kinds.NODE_KINDS) - kinds


def test_a_model_holding_every_node_kind_loads_in_a_fresh_process(saved, tmp_path):
    """Saved here, loaded in a process that imports only keras_ipu_plugin
    and the user's classes: the same outputs, for each saved form."""
    paths, outputs = saved
    loaded = _run_fresh(f"""
        import json
        import keras
        import numpy as np
        import keras_ipu_plugin
        import saved_kinds  # the user's classes
        paths = {json.dumps({name: str(path) for name, path in paths.items()})}
        print(json.dumps({{name: np.asarray(keras.models.load_model(path)(saved_kinds.X)).tolist()
                          for name, path in paths.items()}}))
    """, tmp_path)
    for name, expected in outputs.items():
        np.testing.assert_allclose(loaded[name], expected, rtol=1e-5, atol=1e-6, err_msg=name)


def test_a_plugin_model_file_whose_user_class_is_not_registered_names_the_class(tmp_path):
    """Keras would say only that `PluginModel` "could not be deserialized
    properly"; the cause is the user's class, not registered in the process
    that loads (its module not imported)."""
    (tmp_path / "user_models.py").write_text(textwrap.dedent("""
        import keras

        @keras.saving.register_keras_serializable(package="user_models")
        class Mine(keras.Model):
            def __init__(self, **kwargs):
                super().__init__(**kwargs)
                self.dense = keras.layers.Dense(2)

            def call(self, x):
                return self.dense(x)
    """))
    saved = _run_fresh(f"""
        import json, sys
        import numpy as np
        sys.path.insert(0, {str(tmp_path)!r})
        import keras_ipu_plugin as kip
        import user_models
        plugin = kip.PluginModel(user_models.Mine())
        plugin(np.ones((2, 3), "float32"))
        plugin.save("plugin.keras")
        print(json.dumps("saved"))
    """, tmp_path)
    assert saved == "saved"
    message = _run_fresh("""
        import json
        import keras
        import keras_ipu_plugin as kip
        try:
            keras.models.load_model("plugin.keras")
        except kip.LoadError as error:
            print(json.dumps(str(error)))
    """, tmp_path)
    assert "model is a `Mine` (registered as `user_models>Mine`" in message
    assert "has not registered" in message and "register_keras_serializable" in message
