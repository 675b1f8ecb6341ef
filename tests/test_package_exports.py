"""Every module of the package that declares `__all__` defines or imports
each name it lists, so `from keras_ipu_plugin.<module> import *` works (a
module once listed names it did not define, and the star import raised)."""

import importlib
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "keras_ipu_plugin"


def _modules_declaring_all():
    names = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if "__all__" not in path.read_text():
            continue
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names.append(".".join(parts))
    return names


@pytest.mark.parametrize("name", _modules_declaring_all())
def test_every_name_in_all_is_the_modules(name):
    module = importlib.import_module(name)
    missing = [item for item in getattr(module, "__all__", ()) if not hasattr(module, item)]
    # What `from <module> import *` needs: it raises on the first missing name.
    assert not missing, f"{name}.__all__ lists names it does not have: {missing}"
