"""The package's layering, read from the source (no import needed).

The data flows one way (see docs/architecture.md):

    _compat, errors, report   (the base: no imports of ours above them)
    ir/           the graph IR
    layers/       the layers a graph may hold (alias, opaque, reads, writes, ...)
    runtime/      IR -> Keras model, and running it (rebuild, executor, backends)
    frontend/     model + first batch -> IR: trace/, idioms/, batch/, replay,
                  verify/, and inputs, state, convert
    planning/     node costs, the recompute and stage planners, stage timing
    passes/infra/  pass infrastructure (Pass, registry, patterns, configs, manager)
    passes/       IR -> IR (each pass, presets)
    training/pipelined/, training/session/   what step functions run on
    training/     the entry points: PluginModel, PluginCallback, kip.scope
    cli, the package itself

A module may import its own layer and the layers before it, never one after
it; imports inside functions count (they hid a cycle once). And only the
`_compat/` package touches private Keras / TensorFlow APIs: `keras.src`,
`tensorflow.python`, or a private attribute of an object the plugin did not
make.
"""

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "keras_ipu_plugin"
NAME = "keras_ipu_plugin"

LAYERS = [
    {"_compat", "errors", "report"},
    {"ir"},
    {"layers"},
    {"runtime"},
    {"frontend"},
    {"planning"},
    {"passes.infra"},
    {"passes"},
    {"training.pipelined", "training.session"},
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


def _parse(source):
    """The module's tree, each node knowing its parent (an attribute chain
    is read once, from its outermost node)."""
    tree = ast.parse(source)
    for parent in ast.walk(tree):
        for child in ast.iter_child_nodes(parent):
            child._kip_parent = parent
    return tree


TREES = {name: _parse(path.read_text()) for name, path in MODULES.items()}


def _dotted(node):
    """`a.b.c` of an attribute chain rooted at a name, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([node.id, *reversed(parts)])


def _longest_module(dotted):
    """The longest package module `dotted` starts with (`a.b.C` -> `a.b`)."""
    parts = dotted.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in MODULES:
            return candidate
    return None


def _imports(module):
    """The package modules `module` imports, anywhere in its source: import
    statements, attribute chains from the package's name
    (`import keras_ipu_plugin` then `keras_ipu_plugin.training.model.X`), and
    modules named to `importlib.import_module` / `__import__`."""
    found = set()
    for node in ast.walk(TREES[module]):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(NAME):
            for alias in node.names:
                candidate = f"{node.module}.{alias.name}"
                found.add(candidate if candidate in MODULES else node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith(NAME))
        elif isinstance(node, ast.Attribute) and not isinstance(
                getattr(node, "_kip_parent", None), ast.Attribute):
            dotted = _dotted(node)
            if dotted and dotted.startswith(NAME + "."):
                found.add(_longest_module(dotted))
        elif isinstance(node, ast.Call) and node.args and isinstance(
                node.args[0], ast.Constant) and isinstance(node.args[0].value, str) and (
                _dotted(node.func) in ("importlib.import_module", "__import__", "import_module")):
            name = node.args[0].value
            if name.startswith(NAME):
                found.add(_longest_module(name) or name)
    found.discard(module)
    found.discard(None)
    return {name for name in found if name in MODULES and name != NAME}


def _layer(module):
    """The index in LAYERS of the longest folder holding `module`
    (`passes.infra.base` is in `passes.infra`, `passes.expand` in `passes`)."""
    parts = module[len(NAME) + 1:].split(".") if module != NAME else [""]
    for end in range(len(parts), 0, -1):
        folder = ".".join(parts[:end])
        for index, members in enumerate(LAYERS):
            if folder in members:
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


def _in_compat(module):
    """Whether `module` is the `_compat` package or one of its modules."""
    return module == f"{NAME}._compat" or module.startswith(f"{NAME}._compat.")


def _names_the_package_defines():
    """Underscore names our own code defines (functions, classes, attributes
    it assigns, arguments): reading those is not private access."""
    own = set()
    for module, tree in TREES.items():
        if _in_compat(module):
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


def _keras_private_names():
    """Private names Keras's base classes define: defining one of them in a
    subclass overrides Keras's private API, which is private access too."""
    import keras

    bases = (keras.Model, keras.layers.Layer, keras.callbacks.Callback,
             keras.optimizers.Optimizer, keras.Variable, keras.KerasTensor)
    return {name for base in bases for name in dir(base) if _is_private(name)}


def _private_accesses(module, own, keras_private=frozenset()):
    found = []
    for node in ast.walk(TREES[module]):
        if isinstance(node, ast.ClassDef):
            for statement in node.body:
                if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef)) and (
                        statement.name in keras_private):
                    found.append(f"line {statement.lineno}: {node.name} overrides Keras's "
                                 f"private {statement.name}")
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


KERAS_PRIVATE = _keras_private_names()
# A name Keras's base classes define privately is Keras's even where our code
# also assigns it (`self._tracker = ...` on a Layer would be Keras's tracker).
OWN_PRIVATE = _names_the_package_defines() - KERAS_PRIVATE


@pytest.mark.parametrize("module", sorted(m for m in MODULES if not _in_compat(m)))
def test_private_keras_and_tensorflow_access_only_in_compat(module):
    found = _private_accesses(module, OWN_PRIVATE, KERAS_PRIVATE)
    assert not found, f"{module} reaches into Keras / TensorFlow privately: {found}"


def test_the_checks_see_what_they_must_see():
    """The checks above would catch each kind of violation."""
    tree = _parse(
        "from keras.src.layers import Layer\n"
        "import importlib\n"
        "import keras_ipu_plugin\n"
        "import keras_ipu_plugin.training.model\n"
        "def f(model):\n"
        "    from keras_ipu_plugin.passes import expand\n"
        "    keras_ipu_plugin.training.callback.PluginCallback()\n"
        "    importlib.import_module('keras_ipu_plugin.training.scope')\n"
        "    return model._inbound_nodes, getattr(model, '_tracker')\n"
        "class M(Layer):\n"
        "    def _maybe_build(self, shapes):\n"
        "        pass\n"
    )
    TREES["keras_ipu_plugin.ir.probe"] = tree
    MODULES["keras_ipu_plugin.ir.probe"] = PACKAGE / "ir" / "probe.py"
    try:
        imported = _imports("keras_ipu_plugin.ir.probe")
        assert {"keras_ipu_plugin.training.model", "keras_ipu_plugin.passes.expand",
                "keras_ipu_plugin.training.callback",
                "keras_ipu_plugin.training.scope"} <= imported
        found = _private_accesses("keras_ipu_plugin.ir.probe", set(), KERAS_PRIVATE)
        assert any("overrides Keras's private _maybe_build" in f for f in found)
        assert any("keras.src" in f for f in found)
        assert any("_inbound_nodes" in f for f in found)
        assert any("_tracker" in f for f in found)
    finally:
        del TREES["keras_ipu_plugin.ir.probe"], MODULES["keras_ipu_plugin.ir.probe"]


def test_a_subfolder_is_its_own_layer():
    """`passes/infra/` (the infrastructure) sits before `passes/` (the
    passes): the infrastructure importing a pass would be caught."""
    assert _layer(f"{NAME}.passes.infra.base") < _layer(f"{NAME}.passes.expand")
    assert _layer(f"{NAME}.passes") == _layer(f"{NAME}.passes.expand")
    assert _layer(f"{NAME}.layers.opaque") < _layer(f"{NAME}.runtime.interpreter")
    assert _layer(f"{NAME}.planning.node_costs") < _layer(f"{NAME}.passes.infra.manager")
    assert _layer(f"{NAME}.training.session.session") < _layer(f"{NAME}.training.model")
    assert _layer(f"{NAME}.training.pipelined.step") == _layer(f"{NAME}.training.session.calls")


def test_the_architecture_page_draws_the_layers_in_their_import_order():
    """docs/architecture.md lists the layers in the order imports flow; the
    list is LAYERS, folder for folder."""
    text = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    block = text.split("The imports run in this order", 1)[1].split("```", 2)[1]
    drawn = [line.split()[0].rstrip(",").rstrip("/").replace("/", ".") for line in block.splitlines()
             if line.strip()]
    expected = ["base" if "_compat" in members else
                "cli" if "cli" in members else min(members) for members in LAYERS]
    assert drawn == expected
