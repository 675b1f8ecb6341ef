"""Fuzzing the loader: edited `.keras` files load as saved or fail cleanly.

Real saved files holding every kind of kip node (a converted graph, an
expanded one, a `PluginModel` with passes; `saved_kinds.py`) have their
`config.json` mutated at random under a fixed seed: values of another type,
a string (a path, `/dev/stdin`) where a list was, a constant where a graph
tensor was, huge numbers, deep nesting, unknown classes and modules, keys
dropped or added. Each mutated file is loaded with Keras's defaults, in a
separate process that watches it (an audit hook on `open` and `import`),
and must either load a model computing what the original computes, or
raise an exception (a `kip.LoadError`, or Keras's own error), and in every
case: open no file other than the archive, import no module, take less
than `CASE_SECONDS` and stay under `MEMORY_GROWTH_MB` of memory.

A model that loads and computes something else is reported with the edit
that made it; it fails the test when the edit was to a kip entry (a field a
kip class reads, or a graph node's arguments): a Keras layer's own field
(`"activation": "tanh"`) is the file's to choose.

CI runs `CI_CASES` cases. The long run:

    python tests/layers/test_loader_fuzz.py --cases 10000 [--seed 0] [--report out.json]

(`docs/loading-fuzz.md` records its runs).
"""

import argparse
import copy
import json
import os
import pathlib
import random
import subprocess
import sys
import time
import zipfile

TESTS = pathlib.Path(__file__).resolve().parents[1]
ROOT = TESTS.parent

CI_CASES = 100
CASE_SECONDS = 30
MEMORY_GROWTH_MB = 1500
DATA_LIMIT_MB = 6000
SEED = 20260

#: Strings a mutation puts where other values were: paths a loader must
#: never open, names it must never resolve.
HOSTILE_STRINGS = ["{outside}", "/dev/stdin", "/etc/passwd", "os.system", "__import__",
                   "keras_ipu_plugin.nosuch", "../../outside.yaml", "", "x" * 5000,
                   "__class__", "eval", "true", "false", "1e400"]
HUGE_NUMBERS = [10 ** 30, 2 ** 63, -1, -(2 ** 63), 1e308, float("inf"), float("nan"), 0,
                2 ** 31, 10 ** 9]
UNKNOWN_CLASSES = [
    {"module": "os", "class_name": "system", "config": {}, "registered_name": None},
    {"module": "keras_ipu_plugin.nosuch", "class_name": "Nope", "config": {},
     "registered_name": "keras_ipu_plugin>Nope"},
    {"module": "builtins", "class_name": "open", "config": {"file": "{outside}"},
     "registered_name": None},
    {"module": "keras.layers", "class_name": "Lambda", "config": {}, "registered_name": None},
    {"module": "keras_ipu_plugin.training.model", "class_name": "PluginModel",
     "config": {"name": "p", "model": {}, "passes": "{outside}"},
     "registered_name": "keras_ipu_plugin>PluginModel"},
]
#: The modules AutoGraph writes for a user's layer it converts (when a
#: loaded model is built on zeros): code of the user's classes, not the file's.
AUTOGRAPH = "__autograph_generated_file"


# -- mutations ---------------------------------------------------------------
def _positions(config):
    """Every (container, key) position in a config, with the path to it."""
    found, stack = [], [(config, ())]
    while stack:
        value, path = stack.pop()
        items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(
            value, list) else ()
        for key, item in items:
            found.append((value, key, path + (key,)))
            stack.append((item, path + (key,)))
    return found


def _other_type(value, rng):
    choices = [None, True, 7, -3.5, "text", [1, 2], {"a": 1}, [], {}]
    return rng.choice([c for c in choices if type(c) is not type(value)])


def _nested(rng):
    depth = rng.choice([50, 200, 900])
    value = 1
    for _ in range(depth):
        value = [value] if rng.random() < 0.5 else {"k": value}
    return value


def _constant(rng):
    return rng.choice([1.0, [1.0, 2.0], [[0.0] * 8] * 8, {"class_name": "__numpy__", "config": {
        "value": [1.0], "dtype": rng.choice(["float32", "V1000000000", "object"])}}, 3])


def mutate(config, rng, outside):
    """`(mutated config, [description of each edit], [path of each edit])`:
    one to three edits."""
    config = copy.deepcopy(config)
    edits, paths = [], []
    for _ in range(rng.choice([1, 1, 2, 3])):
        positions = _positions(config)
        container, key, path = rng.choice(positions)
        value = container[key]
        kind = rng.choice(["type", "string", "tensor", "number", "nest", "class", "drop",
                           "add", "list", "bool"])
        if kind == "tensor":
            tensors = [(c, k, p) for c, k, p in positions
                       if isinstance(c[k], dict) and c[k].get("class_name") == "__keras_tensor__"]
            if tensors:
                container, key, path = rng.choice(tensors)
            new = _constant(rng)
        elif kind == "type":
            new = _other_type(value, rng)
        elif kind == "string":
            new = rng.choice(HOSTILE_STRINGS).replace("{outside}", outside)
        elif kind == "number":
            new = rng.choice(HUGE_NUMBERS)
        elif kind == "nest":
            new = _nested(rng)
        elif kind == "class":
            classes = [(c, k, p) for c, k, p in positions
                       if isinstance(c[k], dict) and "class_name" in c[k]]
            if classes:
                container, key, path = rng.choice(classes)
            new = json.loads(json.dumps(rng.choice(UNKNOWN_CLASSES)).replace("{outside}",
                                                                               outside))
            if isinstance(container[key], dict) and rng.random() < 0.5:
                new = dict(container[key], class_name=new["class_name"], module=new["module"],
                           registered_name=new["registered_name"])
        elif kind == "drop":
            if isinstance(container, dict):
                del container[key]
                edits.append(f"drop {_shown(path)}")
                paths.append(path)
                continue
            new = None
        elif kind == "add":
            target = value if isinstance(value, dict) else container
            if isinstance(target, dict):
                target[rng.choice(["extra", "__init__", "passes", "kip_extra"])] = outside
                edits.append(f"add a key at {_shown(path)}")
                paths.append(path)
                continue
            new = [value, value]
        elif kind == "list":
            new = [value] if rng.random() < 0.5 else outside
        else:
            new = rng.choice(["false", "no", 0, 1, None])
        container[key] = new
        retyped = _json_type(new) != _json_type(value)
        edits.append(f"{kind} at {_shown(path)}: {_short(new)}" + (" (retyped)" if retyped else ""))
        paths.append(path)
    return config, edits, paths


def _json_type(value):
    """JSON's type of `value` (an int and a float are both numbers)."""
    if isinstance(value, bool) or value is None:
        return type(value)
    return (int, float) if isinstance(value, (int, float)) else type(value)


def _shown(path):
    return ".".join(str(p) for p in path[-8:])


def _short(value):
    text = json.dumps(value)[:80]
    return text


# -- the watched process ---------------------------------------------------------
def _runner(cases, seed, folder, report_path):
    """Load `cases` mutated files in this process, watched; write the report."""
    import resource
    import signal

    import keras
    import numpy as np

    import keras_ipu_plugin as kip
    import saved_kinds

    folder = pathlib.Path(folder)
    paths, _ = saved_kinds.saved_files(folder / "originals")
    originals = {}
    for name, path in paths.items():
        with zipfile.ZipFile(path) as archive:
            files = {entry: archive.read(entry) for entry in archive.namelist()}
        model = keras.models.load_model(path)  # loaded once: later loads import nothing new
        originals[name] = (files, np.asarray(model(saved_kinds.X)))
        keras.models.load_model(path)(saved_kinds.X)
    outside = folder / "outside.yaml"
    outside.write_text("expand: all\n")
    case_path = folder / "case.keras"

    watching, seen = [False], []
    # The source of a module already imported: read to show a warning's
    # line (`warnings.warn`), never run.
    sources = {getattr(module, "__file__", None) for module in list(sys.modules.values())}

    def audit(event, args):
        if not watching[0]:
            return
        if event == "open":
            target = args[0]
            if isinstance(target, int):
                return
            target = os.fsdecode(target) if isinstance(target, (str, bytes, os.PathLike)) else ""
            if os.path.abspath(target) != str(case_path) and not _keras_extraction(target, str(case_path)) \
                    and target not in sources:
                seen.append(f"opened {target[:200]}")
        elif event == "import" and not args[0].startswith(AUTOGRAPH):
            seen.append(f"imported {args[0]}")

    sys.addaudithook(audit)
    # A size a file chooses must not take the machine: the process's data
    # may grow by `DATA_LIMIT_MB` at most (a larger allocation fails).
    status = pathlib.Path("/proc/self/status").read_text()
    data_kb = int(next(line.split()[1] for line in status.splitlines()
                       if line.startswith("VmData:")))
    resource.setrlimit(resource.RLIMIT_DATA, ((data_kb * 1024 + DATA_LIMIT_MB * 2 ** 20),
                                              resource.getrlimit(resource.RLIMIT_DATA)[1]))

    class TooLong(Exception):
        pass

    def alarm(signum, frame):
        raise TooLong(f"loading took over {CASE_SECONDS} s")

    signal.signal(signal.SIGALRM, alarm)
    baseline_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    modules = set(sys.modules)
    rng = random.Random(seed)
    names = sorted(originals)
    results = {"cases": 0, "loaded_equal": 0, "loaded_different": [], "errors": {}, "samples": {},
               "violations": [], "baseline_mb": baseline_mb}
    started = time.time()
    for index in range(cases):
        name = rng.choice(names)
        files, expected = originals[name]
        original = json.loads(files["config.json"])
        config, edits, edit_paths = mutate(original, rng, str(outside))
        try:
            text = json.dumps(config)
        except (ValueError, RecursionError):
            continue
        with zipfile.ZipFile(case_path, "w") as archive:
            for entry, data in files.items():
                archive.writestr(entry, text if entry == "config.json" else data)
        seen.clear()
        outcome, detail = None, None
        peak_before_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        begin = time.time()
        watching[0] = True
        signal.alarm(CASE_SECONDS)
        try:
            model = keras.models.load_model(case_path)
            watching[0] = False
            signal.alarm(0)
            try:
                got = np.asarray(model(saved_kinds.X))
                same = got.shape == expected.shape and np.allclose(got, expected, rtol=1e-5,
                                                                    atol=1e-5)
            except Exception as error:  # a model that loads but fails its first call
                same, detail = False, f"call: {type(error).__name__}: {str(error)[:200]}"
            outcome = "equal" if same else "different"
        except TooLong as error:
            outcome, detail = "violation", str(error)
        except RecursionError as error:
            outcome, detail = "error", f"RecursionError: {str(error)[:120]}"
        except Exception as error:
            outcome = "error"
            detail = f"{type(error).__name__}"
            samples = results["samples"].setdefault(detail, [])
            if len(samples) < 5:
                samples.append({"edits": edits, "message": str(error)[:300]})
        finally:
            watching[0] = False
            signal.alarm(0)
        elapsed = time.time() - begin
        peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        new_modules = set(sys.modules) - modules
        problems = list(dict.fromkeys(seen))
        new_modules = {m for m in new_modules if not m.startswith(AUTOGRAPH)}
        if new_modules:
            problems.append(f"modules imported: {sorted(new_modules)[:5]}")
            modules |= new_modules
        if peak_mb - peak_before_mb > MEMORY_GROWTH_MB:  # this case's load and first call
            problems.append(f"memory grew by {peak_mb - peak_before_mb:.0f} MB")
        if outcome == "violation":
            problems.append(detail)
        record = {"case": index, "file": name, "edits": edits, "seconds": round(elapsed, 2),
                  "owners": [kip_owned(original, path) for path in edit_paths]}
        results["cases"] += 1
        if problems:
            results["violations"].append(dict(record, problems=problems[:5]))
        elif outcome == "equal":
            results["loaded_equal"] += 1
        elif outcome == "different":
            results["loaded_different"].append(dict(record, detail=detail))
        else:
            results["errors"][detail] = results["errors"].get(detail, 0) + 1
        if index % 200 == 199:
            keras.backend.clear_session()  # slow (a full gc): now and then
            _write_report(results, started, baseline_mb, report_path)  # a long run's so far
    _write_report(results, started, baseline_mb, report_path)


def _write_report(results, started, baseline_mb, report_path):
    import resource

    results["seconds"] = round(time.time() - started, 1)
    results["peak_growth_mb"] = round(
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - baseline_mb)
    pathlib.Path(report_path).write_text(json.dumps(results, indent=1))


#: The fields of a layer's config that Keras's base layer reads, kip's too,
#: and the envelope Keras writes around every saved object.
KERAS_BASE_FIELDS = ("name", "trainable", "dtype", "module", "class_name", "registered_name",
                     "compile_config", "shared_object_id")


def kip_owned(config, path):
    """What the edit at `path` of the original `config` is to: `"field"`, a
    field a kip class reads itself (not Keras's base `name`, `trainable`,
    `dtype`); `"node"`, a node of a kip graph (the arguments it is called
    with); `""`, anything else (a Keras layer's own field)."""
    value, owner, field, in_kip_graph = config, None, None, False
    for key in path:
        if isinstance(value, dict) and isinstance(value.get("module"), str) and isinstance(
                value.get("class_name"), str):
            owner, field = value, None
            in_kip_graph = in_kip_graph or value["class_name"] == "KipFunctional"
        elif owner is not None and field is None:
            field = key
        if key == "inbound_nodes" and in_kip_graph:
            return "node"
        if owner is value and key != "config":
            field = key
        try:
            value = value[key]
        except (KeyError, IndexError, TypeError):
            break
    if owner is None or not owner["module"].startswith("keras_ipu_plugin"):
        return ""
    return "" if field in KERAS_BASE_FIELDS else "field"


def _keras_extraction(path, archive):
    """Whether `path` is where Keras extracts the archive's own members
    while loading: a fresh `tmp...` folder in the system's temporary folder
    or beside the archive (Keras writes the weights there when memory is
    short), the `assets` and `model.weights.h5` in it."""
    import tempfile

    def fresh(folder):
        return os.path.basename(folder).startswith("tmp") and os.path.dirname(folder) in (
            tempfile.gettempdir(), os.path.dirname(archive))

    return path == "assets" or fresh(path) or (
        os.path.basename(path) in ("assets", "model.weights.h5") and fresh(os.path.dirname(path)))


def run(cases, seed, folder, timeout):
    """Run the watched loader over `cases` mutated files; its report."""
    folder = pathlib.Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    report = folder / "report.json"
    here = pathlib.Path(__file__).resolve().parent  # this module, imported by the runner
    code = (f"import sys; sys.path[:0] = [{str(ROOT)!r}, {str(TESTS)!r}, {str(here)!r}]\n"
            "import test_loader_fuzz as fuzz\n"
            f"fuzz._runner({cases}, {seed}, {str(folder)!r}, {str(report)!r})\n")
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONPATH=f"{ROOT}:{TESTS}")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=timeout, cwd=folder, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(report.read_text())


#: The errors kip raises at a first call for what a file may hold and only
#: a conversion can check (a pass target naming no layer of the model).
KIP_CALL_ERRORS = ("LoadError", "PassError", "ConversionError", "ConfigError")


def failures(report):
    """The cases that break what loading promises: anything opened or
    imported, time or memory over the bounds; and an edit to a field a kip
    class reads that loads into a model computing something else silently,
    or failing its first call with an error that is not kip's (the load
    should have refused it), when every edit of the case is such a field,
    and one of them gave it a value of another type or dropped or added a
    key (a number changed for another number loads as the file says)
    (where Keras's own fields were edited too, what the model does is
    Keras's to say). An edit to a graph node's arguments loads a
    graph computing what the edited file says (reported, not failed), as
    an edit to a Keras layer's own field does."""
    bad = [case for case in report["violations"] if not keras_sized(case)]
    for case in report["loaded_different"]:
        if set(case["owners"]) != {"field"}:  # an edit of Keras's own is in it too
            continue
        if not any(edit.endswith("(retyped)") or edit.startswith(("drop", "add"))
                   for edit in case["edits"]):
            continue  # a value of the right type, loaded as the file says
        detail = case["detail"]
        if detail is None or not detail.startswith(tuple(f"call: {e}" for e in KIP_CALL_ERRORS)):
            bad.append(case)
    return bad


def keras_sized(case):
    """Whether a case over the memory or time bound had only Keras layers'
    own fields edited (`Embedding.output_dim: 1000000000`): Keras makes
    what such a field says, as it does without kip; anything opened or
    imported is never Keras's to excuse."""
    return set(case.get("owners", ["field"])) == {""} and all(
        problem.startswith(("memory", "loading took")) for problem in case["problems"])


def check(report):
    """The assertions every run makes on its report."""
    bad = failures(report)
    assert not bad, json.dumps(bad[:5], indent=1)
    assert report["loaded_equal"] + len(report["loaded_different"]) + sum(
        report["errors"].values()) == report["cases"]


def test_mutated_files_load_as_saved_or_fail_and_open_and_import_nothing(tmp_path):
    """A fast slice: `CI_CASES` mutated files under the fixed seed."""
    report = run(CI_CASES, SEED, tmp_path, timeout=600)
    assert report["cases"] >= CI_CASES * 0.95
    assert sum(report["errors"].values()) > 0 and report["loaded_equal"] > 0
    check(report)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=CI_CASES)
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument("--folder", default="/tmp/kip-loader-fuzz")
    parser.add_argument("--report", default=None, help="copy the JSON report here")
    args = parser.parse_args(argv)
    report = run(args.cases, args.seed, args.folder, timeout=24 * 3600)
    if args.report:
        pathlib.Path(args.report).write_text(json.dumps(report, indent=1))
    summary = {key: report[key] for key in ("cases", "loaded_equal", "seconds",
                                            "peak_growth_mb")}
    summary["loaded_different"] = len(report["loaded_different"])
    summary["errors"] = report["errors"]
    summary["violations"] = len(report["violations"])
    summary["keras_sized"] = sum(keras_sized(case) for case in report["violations"])
    print(json.dumps(summary, indent=1))
    check(report)


if __name__ == "__main__":
    main()
