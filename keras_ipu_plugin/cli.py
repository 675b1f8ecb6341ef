"""`python -m keras_ipu_plugin inspect`: convert a user's model on random data
and show what the plugin makes of it.

    python -m keras_ipu_plugin inspect my_model.py:MyModel --data-shape 16
    python -m keras_ipu_plugin inspect net.py:Net --data-shape 32,32,3 \\
        --passes passes.yaml --plot net.png
    python -m keras_ipu_plugin inspect seq.py:Seq2Seq \\
        --data-shape source=6 --data-shape target_in=6 --dtype int32

`FILE.py:NAME` names a `keras.Model` subclass in a Python file (or any
callable there that returns a model, e.g. `build_model`); it is called with
no arguments. Each `--data-shape` is one input's shape without the batch
dimension (`16`, `32,32,3` or `32x32x3`; empty for one value per example),
optionally named (`tokens=12`): several unnamed shapes make a list of
inputs, named ones a dict. Random data of a batch of 2 is made for them, the
model is converted (and checked equal) on it, the passes of `--passes` (a
JSON or YAML config, see `kip.passes_from_config`) are applied, and the
report, the converted model's summary and its graph's nodes (named by
their paths, `block_1.dense`) are printed. `--plot OUT.png`
draws the converted graph with `kip.plot_model` (its nodes by path; the
format is the extension's: `.svg`, `.pdf`, ...; `.dot` writes the dot
source), which needs pydot and, for an image, graphviz: without them the
command says so and exits with code 2.

Exit codes: 0 done; 1 the model could not be loaded, converted or passed;
2 a usage error, or `--plot` without pydot / graphviz.
"""

import argparse
import importlib
import importlib.util
import re
import shutil
import sys
from pathlib import Path

import numpy as np

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2

PLOT_HELP = (
    "--plot needs pydot and graphviz: `pip install pydot` (or, from a "
    "checkout, `pip install -e \".[plot]\"`) and graphviz's `dot` on PATH "
    "(e.g. `apt-get install graphviz`, `brew install graphviz`, "
    "`conda install graphviz`)."
)


class CliError(Exception):
    """A failure the command reports in one line, with its exit code."""

    def __init__(self, message, code=EXIT_FAILED):
        super().__init__(message)
        self.code = code


def build_parser():
    parser = argparse.ArgumentParser(
        prog="python -m keras_ipu_plugin",
        description="Tools for keras_ipu_plugin.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands.required = True
    inspect = commands.add_parser(
        "inspect",
        help="convert a model on random data; print the report and the graph summary",
        description=(
            "Convert a model on random data of the given shapes, apply passes, "
            "print the report and the converted model's summary, and optionally "
            "plot the converted graph."
        ),
    )
    inspect.add_argument(
        "target", metavar="FILE.py:NAME",
        help="a Python file and the keras.Model subclass (or model factory) in it",
    )
    inspect.add_argument(
        "--data-shape", action="append", required=True, metavar="[NAME=]DIMS",
        help=("one input's shape without the batch dimension, e.g. 16 or 32,32,3; "
              "repeat for several inputs; NAME= makes the inputs a dict"),
    )
    inspect.add_argument(
        "--dtype", action="append", metavar="DTYPE",
        help=("the inputs' dtype (default float32): once for all inputs, or once "
              "per --data-shape, in order; int dtypes draw from --int-range, "
              "'string' from a few short words"),
    )
    inspect.add_argument(
        "--int-range", default="0,2", metavar="LOW,HIGH",
        help="integer inputs are drawn from [LOW, HIGH) (default 0,2)",
    )
    inspect.add_argument("--batch-size", type=int, default=2, help="default 2")
    inspect.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    inspect.add_argument(
        "--passes", metavar="CONFIG",
        help="a JSON or YAML passes config (see kip.passes_from_config)",
    )
    inspect.add_argument(
        "--allow-imports", action="store_true",
        help="let the config name classes as 'package.module:Class' (imports the module, "
        "which runs its top-level code: only for configs you trust)",
    )
    inspect.add_argument(
        "--no-verify", action="store_true",
        help="skip comparing the converted model with the original",
    )
    inspect.add_argument(
        "--plot", metavar="OUT.png",
        help="draw the converted graph (needs pydot and graphviz)",
    )
    return parser


def main(argv=None):
    """Run the command line `argv` (default `sys.argv[1:]`); return the exit code."""
    args = build_parser().parse_args(argv)
    try:
        if args.command == "inspect":
            return inspect(args)
    except CliError as error:
        print(f"error: {error}", file=sys.stderr)
        return error.code
    return EXIT_USAGE  # pragma: no cover - argparse requires a command


# -- inspect ---------------------------------------------------------------------
def inspect(args):
    # Fail on what can be checked cheaply before importing and converting.
    if args.plot:
        check_plot_dependencies(args.plot)
    shapes = [parse_shape(text) for text in args.data_shape]
    dtypes = parse_dtypes(args.dtype, len(shapes))
    int_range = parse_int_range(args.int_range)
    if args.batch_size < 1:
        raise CliError("--batch-size must be at least 1.", EXIT_USAGE)

    import keras

    import keras_ipu_plugin as kip

    keras.utils.set_random_seed(args.seed)
    factory = load_target(args.target)
    model = instantiate(factory, args.target)
    data = random_inputs(shapes, dtypes, args.batch_size, int_range, args.seed)
    passes = None
    if args.passes:
        try:
            passes = kip.passes_from_config(args.passes, allow_imports=args.allow_imports)
        except (ValueError, TypeError, OSError) as error:
            raise CliError(f"--passes {args.passes}: {error}")
    try:
        converted = kip.convert_to_functional(model, data, verify=not args.no_verify)
        if not args.dtype:
            token_data = _token_ids_for_embeddings(converted, data, int_range, args.seed)
            if token_data is not None:
                # float32 is the default; an input an Embedding reads is ids
                print("note: inputs an Embedding reads are drawn as int32 ids "
                      "(--dtype chooses otherwise)")
                data = token_data
                converted = kip.convert_to_functional(model, data, verify=not args.no_verify)
        if passes:
            converted = kip.apply_passes(converted, passes, verify=not args.no_verify)
    except (ValueError, TypeError) as error:
        hint = ""
        if not args.dtype:
            hint = (" (the inputs were float32, the default: a model taking token ids or "
                    "other integers needs --dtype int32)")
        raise CliError(f"{type(error).__name__}: {error}{hint}")

    print(f"model: {type(model).__name__} from {args.target}")
    print(f"inputs: {describe_inputs(data)}")
    print(converted.kip_report)
    converted.summary(line_length=120, print_fn=_print_line, expand_nested=False)
    # Keras's summary shows layer names (an expanded layer keeps its own);
    # the graph's table shows each node's path.
    from keras_ipu_plugin.report import graph_table
    from keras_ipu_plugin.report import render

    print(render(graph_table(converted.kip_graph)))
    if args.plot:
        plot(converted, args.plot)
    return EXIT_OK


def _print_line(line, line_break=True):
    print(line, end="\n" if line_break else "")


def check_plot_dependencies(path):
    """Raise `CliError` (exit code 2) unless pydot imports and, for an image
    (not a `.dot` source file), graphviz's `dot` is on PATH."""
    try:
        importlib.import_module("pydot")
    except ImportError:
        raise CliError("pydot is not installed. " + PLOT_HELP, EXIT_USAGE) from None
    source = Path(path).suffix.lower() in (".dot", ".gv")
    if not source and shutil.which("dot") is None:
        raise CliError(
            "graphviz is not installed (no `dot` on PATH). " + PLOT_HELP, EXIT_USAGE
        )


def plot(model, path):
    import keras_ipu_plugin as kip

    path = Path(path)
    if path.parent and not path.parent.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
    try:
        kip.plot_model(model, to_file=str(path), show_shapes=True, show_dtype=True)
    except ImportError as error:  # kip's own check of pydot / graphviz
        raise CliError(str(error), EXIT_USAGE) from None
    if not path.exists():
        raise CliError(f"plot_model wrote no file at {path}.")
    print(f"plot: {path}")


# -- the model -------------------------------------------------------------------
def load_target(target):
    """The object NAME in FILE.py of `FILE.py:NAME`."""
    file_part, sep, name = target.rpartition(":")
    if not sep or not file_part or not name:
        raise CliError(
            f"expected FILE.py:NAME (e.g. my_model.py:MyModel); got {target!r}.",
            EXIT_USAGE,
        )
    path = Path(file_part)
    if not path.is_file():
        raise CliError(f"no such file: {path}", EXIT_USAGE)
    module_name = "kip_inspect_" + re.sub(r"\W", "_", path.stem)
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise CliError(f"cannot import {path} (not a Python file?).", EXIT_USAGE)
    module = importlib.util.module_from_spec(spec)
    # The file's folder is importable while it loads, as with `python FILE.py`.
    folder = str(path.resolve().parent)
    sys.path.insert(0, folder)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as error:
        sys.modules.pop(module_name, None)
        raise CliError(f"importing {path} failed: {type(error).__name__}: {error}")
    finally:
        if folder in sys.path:
            sys.path.remove(folder)
    try:
        return getattr(module, name)
    except AttributeError:
        raise CliError(f"{path} has no `{name}`; {_callables_of(module)}", EXIT_USAGE) from None


def _callables_of(module):
    """What `FILE.py:NAME` may name in `module`: its own classes and
    functions (not those it imported)."""
    names = sorted(
        attribute for attribute, value in vars(module).items()
        if not attribute.startswith("_") and callable(value)
        and getattr(value, "__module__", None) == module.__name__)
    if not names:
        return "it defines no class or function."
    shown = ", ".join(names[:20]) + (f" and {len(names) - 20} more" if len(names) > 20 else "")
    return f"it defines {shown}."


def instantiate(factory, target):
    import keras

    if not callable(factory):
        raise CliError(f"`{target}` is not a class or a function.", EXIT_USAGE)
    try:
        model = factory()
    except Exception as error:
        raise CliError(
            f"`{target}()` failed (it is called with no arguments): "
            f"{type(error).__name__}: {error}"
        )
    if not isinstance(model, keras.Model):
        raise CliError(
            f"`{target}()` returned a {type(model).__name__}, not a keras.Model.",
            EXIT_USAGE,
        )
    return model


# -- the data ----------------------------------------------------------------------
def parse_shape(text):
    """`(name or None, dims)` from `[NAME=]DIMS`."""
    name, sep, dims = text.partition("=")
    if not sep:
        name, dims = None, text
    elif not name.strip():
        raise CliError(f"--data-shape {text!r}: empty input name.", EXIT_USAGE)
    dims = dims.strip()
    if dims in ("", "()"):
        return (name and name.strip(), ())
    try:
        shape = tuple(int(d) for d in re.split(r"[,x\s]+", dims.strip("()")) if d)
    except ValueError:
        raise CliError(
            f"--data-shape {text!r}: dimensions must be integers, e.g. 16 or 32,32,3.",
            EXIT_USAGE,
        ) from None
    if any(d < 1 for d in shape):
        raise CliError(f"--data-shape {text!r}: dimensions must be positive.", EXIT_USAGE)
    return (name and name.strip(), shape)


def parse_dtypes(dtypes, count):
    dtypes = dtypes or ["float32"]
    if len(dtypes) == 1:
        dtypes = dtypes * count
    if len(dtypes) != count:
        raise CliError(
            f"give --dtype once, or once per --data-shape ({count}); got {len(dtypes)}.",
            EXIT_USAGE,
        )
    checked = []
    for dtype in dtypes:
        if dtype in ("string", "str"):
            checked.append("string")
            continue
        try:
            checked.append(np.dtype(dtype).name)
        except TypeError:
            raise CliError(f"--dtype {dtype!r} is not a dtype.", EXIT_USAGE) from None
    return checked


def parse_int_range(text):
    try:
        low, high = (int(v) for v in text.split(","))
    except ValueError:
        raise CliError(f"--int-range {text!r}: expected LOW,HIGH.", EXIT_USAGE) from None
    if high <= low:
        raise CliError(f"--int-range {text!r}: HIGH must exceed LOW.", EXIT_USAGE)
    return low, high


_WORDS = np.array(["red", "green", "blue", "alpha", "beta", "gamma"])


def random_inputs(shapes, dtypes, batch_size, int_range, seed):
    """One array per input; a list for several unnamed inputs, a dict for named."""
    rng = np.random.default_rng(seed)
    arrays = []
    for (_, shape), dtype in zip(shapes, dtypes):
        full = (batch_size,) + shape
        if dtype == "string":
            arrays.append(rng.choice(_WORDS, size=full))
        elif dtype == "bool":
            arrays.append(rng.random(full) > 0.5)
        elif np.issubdtype(np.dtype(dtype), np.integer):
            arrays.append(rng.integers(*int_range, size=full).astype(dtype))
        else:
            arrays.append(rng.normal(size=full).astype(dtype))
    names = [name for name, _ in shapes]
    if any(names):
        if not all(names):
            raise CliError("name every --data-shape (NAME=DIMS) or none.", EXIT_USAGE)
        if len(set(names)) != len(names):
            raise CliError("--data-shape names must be distinct.", EXIT_USAGE)
        return dict(zip(names, arrays))
    return arrays[0] if len(arrays) == 1 else arrays


def _token_ids_for_embeddings(converted, data, int_range, seed):
    """`data` with each float input that an `Embedding` reads directly drawn
    as int32 ids from `int_range` instead, or None where there is none."""
    import keras

    leaves = keras.tree.flatten(data)
    values = keras.tree.flatten(converted.kip_graph.input_values)
    rng = np.random.default_rng(seed)
    changed = False
    for index, (leaf, value) in enumerate(zip(leaves, values)):
        reads = [user for user in value.users
                 if isinstance(getattr(user, "operation", None), keras.layers.Embedding)]
        if reads and np.asarray(leaf).dtype.kind == "f":
            leaves[index] = rng.integers(*int_range, size=np.shape(leaf)).astype("int32")
            changed = True
    return keras.tree.pack_sequence_as(data, leaves) if changed else None


def describe_inputs(data):
    def one(array):
        kind = "string" if array.dtype.kind in "US" else array.dtype.name
        return f"{kind}{list(array.shape)}"

    if isinstance(data, dict):
        return ", ".join(f"{k}: {one(v)}" for k, v in data.items())
    if isinstance(data, list):
        return ", ".join(one(v) for v in data)
    return one(data)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
