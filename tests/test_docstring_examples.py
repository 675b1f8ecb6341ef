"""The `>>>` examples in the docstrings of the modules listed here run as
written, with the module's own names in scope (doctest), and print what the
docstring says. A module joins the list once its examples are complete
(every name they use defined in the example or the module); the examples of
other modules are illustrations, not run. `module:A,B` runs only the examples
of `A` and `B` (and their methods) in a module whose other examples are
illustrations."""

import doctest
import importlib

import pytest

RUNNABLE = [
    "keras_ipu_plugin.frontend.idioms:recorded",
    "keras_ipu_plugin.frontend.trace.attribute_paths",
    "keras_ipu_plugin.frontend.trace.failures",
    "keras_ipu_plugin.ir.graph:Namespace",
    "keras_ipu_plugin.layers.tf_calls:TFFunction,public_name_of",
    "keras_ipu_plugin.passes.microbatching",
    "keras_ipu_plugin.planning.exact_plan",
    "keras_ipu_plugin.planning.stage_balance",
]


@pytest.mark.parametrize("name", RUNNABLE)
def test_the_docstring_examples_run_as_written(name):
    name, _, objects = name.partition(":")
    module = importlib.import_module(name)
    finder = doctest.DocTestFinder()
    if objects:
        tests = [test for object_name in objects.split(",")
                 for test in finder.find(getattr(module, object_name), f"{name}.{object_name}",
                                         module=module, globs=vars(module))
                 if test.examples]
    else:
        tests = [test for test in finder.find(module) if test.examples]
    assert tests, f"{name} has no `>>>` example left: take it off the list"
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    failures = []
    for test in tests:
        result = runner.run(test, out=failures.append)
        assert result.attempted
    assert not failures, "".join(failures)


def test_every_prompt_example_in_the_package_is_one_that_runs():
    """A `>>>` example outside the list would read as a doctest that
    nobody runs: examples that are illustrations are fenced as ```python
    blocks instead."""
    import ast
    import pathlib

    package = pathlib.Path(importlib.import_module("keras_ipu_plugin").__file__).parent
    listed = {}
    for entry in RUNNABLE:
        name, _, objects = entry.partition(":")
        listed[name] = set(objects.split(",")) if objects else None
    unrun = []
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        source = path.read_text()
        if ">>>" not in source or (name in listed and listed[name] is None):
            continue
        runs = set()  # lines inside the objects whose examples run
        for node in ast.walk(ast.parse(source)):
            if (isinstance(node, (ast.ClassDef, ast.FunctionDef))
                    and node.name in (listed.get(name) or ())):
                runs.update(range(node.lineno, node.end_lineno + 1))
        unrun += [f"{path.relative_to(package.parent)}:{number}"
                  for number, line in enumerate(source.splitlines(), 1)
                  if line.lstrip().startswith(">>>") and number not in runs]
    assert not unrun, f"`>>>` examples that no test runs: {unrun[:10]}"
