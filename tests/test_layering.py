"""The package's layering, read from the source (no import needed).

The data flows one way (see docs/architecture.md):

    _compat, errors, report, concurrency   (the base: no imports of ours above them)
    ir/         the graph IR
    runtime/    IR -> Keras model, and running it (rebuild, layers, executor, backends)
    frontend/   model + first batch -> IR (inputs, tracing, state, verify, convert)
    passes/     IR -> IR (each pass, the manager, configs, presets)
    training/   PluginModel, PluginCallback, kip.scope, dynamic variables
    cli, the package itself

A module may import its own layer and the layers before it, never one after
it; imports inside functions count (they hid a cycle once). And only
`_compat.py` touches private Keras / TensorFlow APIs: `keras.src`,
`tensorflow.python`, or a private attribute of an object the plugin did not
make.
"""

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "keras_ipu_plugin"
NAME = "keras_ipu_plugin"

LAYERS = [
    {"_compat", "errors", "report", "concurrency"},
    {"ir"},
    {"runtime"},
    {"frontend"},
    {"passes"},
    {"training"},
    {"cli", "__main__", ""},
]

# Graphcore's documented import path for its IPU API (`from tensorflow.python
# import ipu`): public for Graphcore's SDK, loaded by name in the backend.
ALLOWED_PRIVATE_MODULES = {"tensorflow.python.ipu"}
# Private by name, public by contract: namedtuple's fields.
ALLOWED_PRIVATE_ATTRIBUTES = {"_fields"}


def _modules():
    modules = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join([NAME, *parts])] = path
    return modules


MODULES = _modules()
TREES = {name: ast.parse(path.read_text()) for name, path in MODULES.items()}


def _imports(module):
    """The package modules `module` imports, anywhere in its source."""
    found = set()
    for node in ast.walk(TREES[module]):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(NAME):
            for alias in node.names:
                candidate = f"{node.module}.{alias.name}"
                found.add(candidate if candidate in MODULES else node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith(NAME))
    found.discard(module)
    return {name for name in found if name in MODULES and name != NAME}


def _layer(module):
    top = module[len(NAME) + 1:].split(".")[0] if module != NAME else ""
    for index, members in enumerate(LAYERS):
        if top in members:
            return index
    raise AssertionError(f"module {module} belongs to no layer: add it to LAYERS")


def _cycle():
    """One import cycle among the package's modules, or None."""
    graph = {module: _imports(module) for module in MODULES}
    state, stack = {}, []

    def visit(module):
        state[module] = "open"
        stack.append(module)
        for imported in sorted(graph[module]):
            if state.get(imported) == "open":
                return stack[stack.index(imported):] + [imported]
            if imported not in state:
                found = visit(imported)
                if found:
                    return found
        state[module] = "done"
        stack.pop()
        return None

    for module in sorted(graph):
        if module not in state:
            found = visit(module)
            if found:
                return found
    return None


def test_every_module_belongs_to_a_layer():
    for module in MODULES:
        _layer(module)


def test_no_import_cycle_function_local_imports_included():
    cycle = _cycle()
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_only_its_own_layer_and_those_before_it(module):
    upward = sorted(
        imported for imported in _imports(module) if _layer(imported) > _layer(module)
    )
    assert not upward, f"{module} (layer {_layer(module)}) imports later layers: {upward}"


def _names_the_package_defines():
    """Underscore names our own code defines (functions, classes, attributes
    it assigns, arguments): reading those is not private access."""
    own = set()
    for module, tree in TREES.items():
        if module == f"{NAME}._compat":
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                own.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                own.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                own.add(node.id)
            elif isinstance(node, ast.arg):
                own.add(node.arg)
    return {name for name in own if name.startswith("_")}


def _private_accesses(module, own):
    found = []
    for node in ast.walk(TREES[module]):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [node.module] if isinstance(node, ast.ImportFrom) else [
                alias.name for alias in node.names]
            for name in filter(None, names):
                if name.startswith(("keras.src", "keras._", "tensorflow.python")) and (
                        name not in ALLOWED_PRIVATE_MODULES):
                    found.append(f"line {node.lineno}: imports {name}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if node.value.startswith(("keras.src", "tensorflow.python")) and (
                    node.value not in ALLOWED_PRIVATE_MODULES):
                found.append(f"line {node.lineno}: names module {node.value}")
        elif isinstance(node, ast.Attribute):
            name = node.attr
            if _is_private(name) and name not in own:
                found.append(f"line {node.lineno}: reads .{name}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and (
                node.func.id in ("getattr", "setattr", "hasattr", "delattr")) and len(node.args) > 1:
            name = node.args[1]
            if isinstance(name, ast.Constant) and isinstance(name.value, str) and (
                    _is_private(name.value) and name.value not in own):
                found.append(f"line {node.lineno}: {node.func.id}(..., {name.value!r})")
    return found


def _is_private(name):
    return (name.startswith("_") and not name.startswith("__")
            and not name.startswith("_kip") and name not in ALLOWED_PRIVATE_ATTRIBUTES)


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m != f"{NAME}._compat"))
def test_private_keras_and_tensorflow_access_only_in_compat(module):
    found = _private_accesses(module, _names_the_package_defines())
    assert not found, f"{module} reaches into Keras / TensorFlow privately: {found}"


def test_the_checks_see_what_they_must_see():
    """The checks above would catch each kind of violation."""
    tree = ast.parse(
        "from keras.src.layers import Layer\n"
        "import keras_ipu_plugin.training.model\n"
        "def f(model):\n"
        "    from keras_ipu_plugin.passes import expand\n"
        "    return model._inbound_nodes, getattr(model, '_tracker')\n"
    )
    TREES["keras_ipu_plugin.ir.probe"] = tree
    MODULES["keras_ipu_plugin.ir.probe"] = PACKAGE / "ir" / "probe.py"
    try:
        imported = _imports("keras_ipu_plugin.ir.probe")
        assert {"keras_ipu_plugin.training.model", "keras_ipu_plugin.passes.expand"} <= imported
        found = _private_accesses("keras_ipu_plugin.ir.probe", set())
        assert any("keras.src" in f for f in found)
        assert any("_inbound_nodes" in f for f in found)
        assert any("_tracker" in f for f in found)
    finally:
        del TREES["keras_ipu_plugin.ir.probe"], MODULES["keras_ipu_plugin.ir.probe"]
