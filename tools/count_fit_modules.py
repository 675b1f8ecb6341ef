"""How many of the package's modules one first `fit` runs through.

A reader following

    kip.PluginModel(MyModel(), passes=[Expand("all"), Recompute(auto=True)]).fit(x, y)

from the call to the optimizer step reads every module that call enters. This
tool counts them by running it: after the package is imported (imports are
not counted), `sys.setprofile` records every Python function of the package
entered while the wrapper's first `fit` runs (converting, applying the
passes, training one epoch; making and compiling the wrapper are not
counted), and the tool
prints

- the modules entered (each `keras_ipu_plugin/...py` file with at least one
  function called), and
- how many of those are `_compat/` modules (named accesses to private
  Keras / TensorFlow APIs, which a reader follows by name, not by file), and
- the switches: how often, in the order functions were entered, the entered
  function's module differs from the one entered just before it.

    python tools/count_fit_modules.py            # the two numbers
    python tools/count_fit_modules.py --list     # and the modules, most entered first

Run it from the repository root (the package is imported from there). The
model (the README's `MyModel`) is small and fixed, so the numbers change only when the code does.
"""

import argparse
import collections
import os
import pathlib
import sys
import threading

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_ipu_plugin as kip  # noqa: E402
from keras_ipu_plugin.passes import Expand, Recompute  # noqa: E402

PACKAGE = pathlib.Path(kip.__file__).resolve().parent


class Block(keras.layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(32, activation="relu")
        self.norm = keras.layers.LayerNormalization()

    def call(self, x):
        return x + self.norm(self.dense(x))


class MyModel(keras.Model):
    def __init__(self):
        super().__init__()
        self.stem = keras.layers.Dense(32)
        self.block = Block()
        self.head = keras.layers.Dense(1)

    def call(self, x, training=None):
        return self.head(self.block(self.stem(x)))


def module_of(filename):
    """`frontend/convert.py` for a file of the package, else None."""
    try:
        return pathlib.Path(filename).resolve().relative_to(PACKAGE).as_posix()
    except ValueError:
        return None


def count_first_fit():
    """(entered: Counter of module -> functions entered, switches)."""
    keras.utils.set_random_seed(0)
    x = np.random.rand(64, 8).astype("float32")
    y = np.random.rand(64, 1).astype("float32")
    model = MyModel()

    entered = collections.Counter()
    switches = 0
    last = None
    modules = {}

    def profile(frame, event, arg):
        nonlocal switches, last
        if event != "call":
            return
        filename = frame.f_code.co_filename
        module = modules.get(filename, ...)
        if module is ...:
            module = modules[filename] = module_of(filename)
        if module is None:
            return
        entered[module] += 1
        if last is not None and module != last:
            switches += 1
        last = module

    plugin = kip.PluginModel(model, passes=[Expand("all"), Recompute(auto=True)])
    plugin.compile(optimizer="adam", loss="mse")
    threading.setprofile(profile)
    sys.setprofile(profile)
    try:
        plugin.fit(x, y, batch_size=16, epochs=1, verbose=0)
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    return entered, switches


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--list", action="store_true",
                        help="also list the modules entered, most entered first")
    options = parser.parse_args(argv)
    entered, switches = count_first_fit()
    print(f"modules entered: {len(entered)}")
    compat = sum(1 for module in entered if module.startswith("_compat/"))
    print(f"  of which _compat/ (private-API access, one module per topic): {compat}")
    print(f"switches between modules: {switches}")
    if options.list:
        for module, count in entered.most_common():
            print(f"{count:8d}  {module}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
