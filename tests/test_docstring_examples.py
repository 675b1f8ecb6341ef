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
