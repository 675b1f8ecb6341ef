"""Mutation testing of the core modules: break a behaviour on purpose, see
which test notices.

Each mutation below replaces one exact snippet of source by another in a
temporary copy of the repository (the working tree is never touched), runs
the test files most related to it (`pytest -x`, under a timeout) and records
the first test that failed. A mutation no test notices "survived": either
the behaviour is not one the library promises, or a test is missing.

    python tools/mutation.py                     # every mutation, one at a time
    python tools/mutation.py --only verify-tolerance-100x --only recompute-no-checkpoint
    python tools/mutation.py --list              # names, places, stale snippets
    python tools/mutation.py --check             # fails on a stale / ambiguous one
    python tools/mutation.py --jobs 2 --json results.json

A snippet that no longer occurs in its file is "stale" (the code moved on:
update the mutation), one that occurs more than once "ambiguous". Either
fails the tool before any test runs (exit status 1, naming each): a mutation
that cannot apply tests nothing. `--check` does only that check (fast; the
test suite runs it: tests/test_mutation_guards.py).
A test that fails without the mutation too cannot be said to catch it: the
tests that caught something are run once more on the unmutated copy, and a
mutation they "caught" that way is reported "caught by a failing test".

Needs nothing beyond the test dependencies (pytest).
"""

import argparse
import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "keras_ipu_plugin"


@dataclasses.dataclass(frozen=True)
class Mutation:
    name: str
    file: str  # relative to the package
    snippet: str  # exact source text, occurring once in `file`
    replacement: str
    description: str
    tests: tuple  # test files (relative to the repository) most related


def M(name, file, snippet, replacement, description, *tests):
    return Mutation(name, file, snippet, replacement, description, tuple(tests))


GUARDED = "tests/passes/test_passes_keep_keras_semantics.py"
VERIFICATION = "tests/frontend/verify/test_verification.py"
CONVERSION = "tests/frontend/test_conversion.py"
MODEL_STATE = "tests/frontend/test_model_state.py"
PASSES = "tests/passes/test_passes.py"
EQUIVALENCE = "tests/passes/test_pass_training_equivalence.py"
BLOCKS = "tests/passes/infra/test_pass_targets_reach_blocks.py"
DYNAMIC = "tests/training/session/test_new_variables.py"
REPLACE_STATE = "tests/training/session/test_replace_training_state.py"
GUARDS = "tests/test_mutation_guards.py"
THREADS = "tests/frontend/trace/test_thread_confinement.py"

MUTATIONS = [
    # -- frontend/verify/: verification compares what it says it compares -----------
    M("verify-tolerance-100x", "frontend/verify/compare.py",
      '"float32": Tolerance(rtol=1e-4, atol=1e-5, dtype="float32"),',
      '"float32": Tolerance(rtol=1e-2, atol=1e-3, dtype="float32"),',
      "verification tolerance 100x looser", VERIFICATION),
    M("verify-half-precision-tolerance-to-nothing", "frontend/verify/compare.py",
      '"bfloat16": Tolerance(rtol=5e-2, atol=5e-2, dtype="bfloat16"),',
      '"bfloat16": Tolerance(rtol=1.0, atol=1.0, dtype="bfloat16"),',
      "under mixed_bfloat16 verification admits anything", VERIFICATION),
    M("verify-bfloat16-compared-as-integers", "frontend/verify/compare.py",
      "        return tf.as_dtype(array.dtype).is_floating\n",
      "        return False\n",
      "bfloat16 outputs are compared exactly, as integers", VERIFICATION),
    M("verify-skip-last-output", "frontend/verify/equivalence.py",
      "for (path, expected), actual in zip(ref_paths, res_leaves):",
      "for (path, expected), actual in list(zip(ref_paths, res_leaves))[:max(1, len(res_leaves) - 1)]:",
      "the last output of a multi-output model is not compared", VERIFICATION),
    M("verify-no-gradients", "frontend/verify/equivalence.py",
      "in zip(variables, reference.gradients, result.gradients):",
      "in zip(variables, reference.gradients, result.gradients[:0]):",
      "gradients are never compared", VERIFICATION),
    M("verify-accepts-all-nan", "frontend/verify/compare.py",
      "    if finite.any():\n        return\n    raise InputDataError(",
      "    return\n    raise InputDataError(",
      "a batch whose outputs are NaN everywhere verifies vacuously", VERIFICATION),
    M("verify-accepts-empty-batch", "frontend/verify/compare.py",
      "    if total == 0:\n",
      "    if total == -1:\n",
      "a batch of 0 rows verifies vacuously", VERIFICATION),
    M("verify-ignores-nan-positions", "frontend/verify/compare.py",
      "        if not np.array_equal(where_expected, where_actual):",
      "        if False:",
      "NaN / Inf in one model only goes unnoticed", VERIFICATION),
    M("verify-ignores-integer-outputs", "frontend/verify/compare.py",
      "        if not np.array_equal(actual, expected):\n            raise ConversionError(",
      "        if False:\n            raise ConversionError(",
      "integer / boolean outputs are not compared", VERIFICATION),
    M("verify-accepts-untracked-variables", "frontend/verify/equivalence.py",
      "        refuse_untracked_variables(original, reference.watched)",
      "        pass",
      "variables Keras cannot see pass verification", VERIFICATION, CONVERSION),
    # -- convert.py ---------------------------------------------------------------
    M("convert-skips-verification", "frontend/convert.py",
      "            if self.verify:\n                with report.timed(",
      "            if False:\n                with report.timed(",
      "convert_to_functional never verifies", VERIFICATION, CONVERSION),
    M("convert-keeps-lost-updates", "frontend/convert.py",
      "            _refuse_lost_updates(graph, before)",
      "            pass",
      "a variable `call` assigns itself is frozen in the graph", CONVERSION),
    M("convert-no-undo-on-failure", "frontend/state.py",
      "    except BaseException as error:\n        state.undo_after(error)\n        raise\n"
      "    return result\n",
      "    except BaseException as error:\n        raise\n"
      "    return result\n",
      "a failed conversion leaves the model changed", MODEL_STATE),
    M("convert-opaque-branches-unbuilt", "frontend/convert.py",
      "    _build_all_branches(layer, specs)\n",
      "    pass\n",
      "an opaque model's untaken branches are built mid-training", CONVERSION, DYNAMIC),
    # -- state.py -------------------------------------------------------------------
    M("state-no-nontrainable-restore", "frontend/state.py",
      "    def restore_after_success(self):\n        self._new.settle()\n        self._values.restore()\n",
      "    def restore_after_success(self):\n        self._new.settle()\n",
      "ModelState does not restore non-trainable values after a conversion", MODEL_STATE),
    M("state-no-attribute-restore", "frontend/state.py",
      "        for attributes in self._attributes.values():\n            attributes.restore()",
      "        for attributes in self._attributes.values():\n            pass",
      "plain Python attributes a conversion changed stay changed", MODEL_STATE),
    M("state-undo-keeps-objects", "frontend/state.py",
      "        steps = [functools.partial(self._objects.restore_object, index)\n"
      "                 for index in range(len(self._objects.objects))]",
      "        steps = []",
      "a failed conversion keeps the layers it built and the nodes it recorded", MODEL_STATE),
    M("state-no-replay", "frontend/state.py",
      "        new.settle()\n        values.restore()\n        # A global seed",
      "        new.settle()\n        # A global seed",
      "verification runs do not start from the same RNG / counter state",
      VERIFICATION, MODEL_STATE),
    M("state-new-variables-kept", "frontend/state.py",
      "            if id(variable) in wanted and value is not None and not _same(_now(variable), value):",
      "            if False:",
      "variables a conversion created keep what its runs changed", MODEL_STATE),
    # -- the interpreter and its run-time effects (runtime/effects.py) -----------------------------------------------------------
    M("executor-ignores-pinned-training", "runtime/interpreter.py",
      '        if node.training in (True, False):\n            kwargs["training"] = node.training',
      '        if False:\n            kwargs["training"] = node.training',
      "the executor overrides a pinned training=False", GUARDED),
    M("executor-state-in-recompute-segments", "runtime/effects.py",
      "        if (not backend.recomputes_segments or has_forward_state(node.operation)\n"
      "                or notes.get(\"remat\") == \"keep\"):",
      "        if (not backend.recomputes_segments\n"
      "                or notes.get(\"remat\") == \"keep\"):",
      "BatchNormalization / Dropout run inside recompute segments", "tests/runtime/test_run_effects.py",
      GUARDED),
    M("executor-outline-ignores-config", "runtime/effects.py",
      "    return (type(layer), config, signature, repr(sorted(kwargs.items())))",
      "    return (type(layer), signature, repr(sorted(kwargs.items())))",
      "Outline shares one body between layers of different configs", GUARDED),
    M("executor-outline-ignores-training", "runtime/effects.py",
      "            mode = _training_key(training)",
      "            mode = None",
      "an outlined body traced in one training mode runs in the other", GUARDED, PASSES),
    M("executor-outline-drops-state", "runtime/effects.py",
      "        for variable, value in zip(layer.non_trainable_variables, new_state):\n"
      "            variable.assign(value)",
      "        for variable, value in zip(layer.non_trainable_variables, new_state):\n"
      "            pass",
      "an outlined BatchNormalization never updates its statistics", GUARDED, EQUIVALENCE),
    M("executor-recompute-drops-losses", "runtime/effects.py",
      "        for layer, loss in zip(loss_owners, results[outputs + len(seeds):]):\n"
      "            layer.add_loss(loss)",
      "        for layer, loss in zip(loss_owners, results[outputs + len(seeds):]):\n"
      "            pass",
      "losses added inside a recompute segment are lost", GUARDS, EQUIVALENCE, GUARDED),
    M("recompute-no-checkpoint", "runtime/effects.py",
      "            segments.append(Segment(current, recompute=True))",
      "            segments.append(Segment(current, recompute=False))",
      "Recompute saves no memory (no segment is recomputed)", GUARDED),
    M("executor-keep-last-segment-flipped", "runtime/effects.py",
      "    if _activation_size(tail) < largest:",
      "    if _activation_size(tail) >= largest:",
      "the last segment is recomputed when nothing is saved by it, and kept when it is",
      GUARDED),
    M("executor-ignores-stages", "runtime/effects.py",
      '        stage = node.annotations.get("stage", 0)',
      '        stage = 0',
      "every layer runs in pipeline stage 0", "tests/runtime/test_run_effects.py", PASSES),
    # -- recompute_grad --------------------------------------------------------------
    M("recompute-keeps-activations", "runtime/backends/__init__.py",
      "        with _compat.stop_gradient_recording():\n            results = list(fn(*args))",
      "        if True:\n            results = list(fn(*args))",
      "Recompute saves no memory (the forward pass is taped)", GUARDED),
    M("recompute-zero-gradients", "runtime/backends/__init__.py",
      "            grads = tape.gradient(targets, list(inputs) + variables, output_gradients=seeds)",
      "            grads = tape.gradient(targets, list(inputs) + variables, output_gradients=seeds,\n"
      "                                  unconnected_gradients=tf.UnconnectedGradients.ZERO)",
      "an unconnected variable gets zeros instead of None (AdamW decays it)", EQUIVALENCE),
    M("recompute-dense-gradients", "runtime/backends/__init__.py",
      "            return grads[:len(inputs)], grads[len(inputs):]",
      "            return grads[:len(inputs)], [tf.convert_to_tensor(g) if g is not None else g\n"
      "                                         for g in grads[len(inputs):]]",
      "sparse (embedding) gradients come out dense", EQUIVALENCE),
    M("recompute-ignores-seeds", "runtime/backends/__init__.py",
      "                if seed is not None and _differentiable(output):",
      "                if _differentiable(output):",
      "an output with no incoming gradient is differentiated as if it had one", EQUIVALENCE),
    # -- passes ---------------------------------------------------------------------
    M("replace-copies-kernel-only", "passes/replacement.py",
      "    for variable in new.weights:\n        source = sources.get(variable.name)",
      "    for variable in new.weights[:1]:\n        source = sources.get(variable.name)",
      "Replace copies the kernel but not the bias / BatchNormalization statistics",
      GUARDED, PASSES),
    M("replace-unshares", "passes/replace.py",
      "                if key not in made:",
      "                if True:",
      "a layer shared by several call sites gets one replacement per site", PASSES, BLOCKS),
    M("replace-no-reuse", "passes/replace.py",
      "        old, reused = node.operation, graph.reusable.get(id(node.operation))",
      "        old, reused = node.operation, None",
      "a rebuild replaces layers anew, from their untrained originals", REPLACE_STATE),
    M("targets-exact-class", "passes/infra/base.py",
      "    return isinstance(node.operation, target)",
      "    return type(node.operation) is target",
      "a class target does not match subclasses", PASSES, BLOCKS),
    M("stages-any-order", "passes/annotate.py",
      "            if stage < inputs_stage:",
      "            if False:",
      "a layer may read the output of a later pipeline stage", PASSES),
    M("recompute-block-first-node", "passes/annotate.py",
      "            last = block_nodes[-1]",
      "            last = block_nodes[0]",
      "Recompute of an expanded block checkpoints after its first node", BLOCKS),
    M("expand-drops-pinned-training", "passes/expand.py",
      "    training = node.training if node.training in (True, False) else None\n    try:",
      "    training = None\n    try:",
      "a block called with a pinned training does not pass it on through Expand", GUARDED),
    M("expand-agnostic-ignores-training-arg", "layers/layer_kinds.py",
      "    if not is_expandable(layer) or takes_training(layer):\n        return False",
      "    if not is_expandable(layer):\n        return False",
      "a block whose call takes `training` is traced in one mode only", GUARDED, PASSES),
    # -- new_variables.py / apply.py --------------------------------------------------------
    M("watch-records-nothing", "training/session/new_variables.py",
      "        self._created.append(variable)",
      "        pass",
      "VariableWatch records no created variable", DYNAMIC),
    M("learn-by-count", "training/session/new_variables.py",
      "        unknown = [v for v in variables if id(v) not in known_ids]",
      "        unknown = [] if len(variables) == len(known_ids) else [\n"
      "            v for v in variables if id(v) not in known_ids]",
      "an optimizer meeting as many variables as it knows assumes it knows them",
      REPLACE_STATE),
    M("extend-forgets-old-state", "training/session/new_variables.py",
      "            if old[index] is not None:\n                new[index].assign(old[index])",
      "            if old[index] is not None:\n                pass",
      "extending an optimizer resets the old variables' moments", DYNAMIC),
    M("hand-over-nothing", "training/session/new_variables.py",
      "            hand_over_optimizer_slot(optimizer, old, new)\n",
      "",
      "a loaded optimizer's state does not pass to the replacement layers", REPLACE_STATE),
    M("apply-compares-no-gradients", "passes/infra/manager.py",
      "        kept = [v for v in model.trainable_variables if id(v) not in replaced]",
      "        kept = []",
      "apply_passes compares outputs only", PASSES, VERIFICATION),
    # -- silent wrong results, each guarded in tests/test_mutation_guards.py ------------
    M("chain-second-reader", "passes/infra/patterns.py",
      "    if len(readers) != 1 or readers[0].input_values != [value]:",
      "    if not readers or readers[0].input_values != [value]:",
      "a Chain matches a node whose output has a second reader", GUARDS),
    M("chain-through-outputs", "passes/infra/patterns.py",
      "    if len(node.outputs) != 1 or id(node.outputs[0]) in graph_outputs:",
      "    if len(node.outputs) != 1:",
      "a Chain runs through a model output", GUARDS),
    M("costs-four-bytes", "planning/node_costs.py",
      "    return dtype.size",
      "    return 4",
      "the planner counts every element as 4 bytes (float16 at double size)", GUARDS),
    M("time-balance-keeps-last", "planning/graph_planning.py",
      "    best = min(range(len(candidates)), key=lambda k: stage_balance.imbalance(timed[k]))",
      "    best = len(candidates) - 1",
      "balance='time' keeps the last re-plan, though it measured worse", GUARDS),
    M("inline-unread-output-unmasked", "passes/expand.py",
      "        if new.mask is not None or old.mask is None:",
      "        if new.mask is not None or old.mask is None or not old.users:",
      "an expanded block's output no layer reads (a model output) loses its Keras mask",
      GUARDS),
    M("attach-mask-drops-mask", "layers/keras_ops/masks.py",
      "    def compute_mask(self, inputs, mask=None):\n        return mask",
      "    def compute_mask(self, inputs, mask=None):\n        return None",
      "AttachMask attaches no mask: an expanded block's output loses it", GUARDS),
    M("plugin-class-attribute-on-wrapper", "training/model.py",
      "        if name not in vars(wrapped) and not hasattr(type(wrapped), name):",
      "        if name not in vars(wrapped):",
      "an attribute the wrapped class defines, set on PluginModel, stays on the wrapper",
      GUARDS),
    M("verify-one-row", "frontend/verify/compare.py",
      "MIN_ROWS = 2\n",
      "MIN_ROWS = 1\n",
      "verification on 1 row of 8: a graph mixing rows passes", GUARDS),
    M("verify-first-rows", "frontend/verify/compare.py",
      "    positions = np.unique(np.linspace(0, len(candidates) - 1, wanted).round().astype(int))",
      "    positions = np.arange(wanted)",
      "verification on the first rows instead of rows spread over the batch", GUARDS),
    M("replay-ignores-pinned-training", "frontend/replay.py",
      "    return (block_key, call_key, node.training), objects, inputs",
      "    return (block_key, call_key), objects, inputs",
      "a block's trace is replayed for a call with another pinned training", GUARDS),
    M("state-model-attributes-only", "frontend/state.py",
      "        for layer in _compat.all_layers(self.model):\n"
      "            if id(layer) not in self._attributes",
      "        for layer in [self.model]:\n"
      "            if id(layer) not in self._attributes",
      "a successful conversion leaves a sub-layer's Python counter changed", GUARDS),
    # -- trace-time changes stay on the tracing thread ---------------------------------
    M("idioms-priority-on-every-thread", "frontend/idioms.py",
      "        if _in_traced_idioms():\n            return self._traced",
      "        if True:\n            return self._traced",
      "KerasTensor.__array_priority__ on every thread while a trace runs (NumPy defers)",
      THREADS),
    M("idioms-bare-index-on-every-thread", "frontend/idioms.py",
      "        if _in_traced_idioms() and (key is None or key is Ellipsis or isinstance(key, slice)):",
      "        if key is None or key is Ellipsis or isinstance(key, slice):",
      "`x[None]` on a symbolic tensor is accepted on every thread while a trace runs", THREADS),
    M("idioms-tile-on-every-thread", "frontend/idioms.py",
      "        if not _in_traced_idioms() or isinstance(repeats, int) or None not in list(repeats):",
      "        if isinstance(repeats, int) or None not in list(repeats):",
      "`ops.tile` takes a None repeat on every thread while a trace runs", THREADS),
    M("idioms-ndim-on-every-thread", "frontend/idioms.py",
      "        if _in_traced_idioms() and getattr(x, \"shape\", None) is not None:",
      "        if getattr(x, \"shape\", None) is not None:",
      "`ops.ndim` of a symbolic tensor is an int on every thread while a trace runs", THREADS),
    M("idioms-numpy-scalars-on-every-thread", "frontend/idioms.py",
      "        if _in_traced_idioms():\n            if isinstance(other, np.generic):",
      "        if True:\n            if isinstance(other, np.generic):",
      "NumPy values met by symbolic tensors are converted on every thread while a trace runs",
      THREADS),
    M("tf-dispatch-on-every-thread", "frontend/idioms.py",
      "        if not _recording():\n            return NotImplemented",
      "        if not _registered:\n            return NotImplemented",
      "TensorFlow functions on symbolic tensors are recorded on every thread", THREADS),
]


@dataclasses.dataclass
class Result:
    mutation: Mutation
    line: int = 0
    status: str = ""  # caught, survived, stale, ambiguous, timeout, broken
    caught_by: str = ""
    seconds: float = 0.0

    @property
    def where(self):
        return f"{self.mutation.file}:{self.line}" if self.line else self.mutation.file


def locate(mutation, root):
    """`(line, status)`: where the snippet starts, or why it cannot apply."""
    path = root / PACKAGE / mutation.file
    if not path.exists():
        return 0, "stale"
    text = path.read_text()
    count = text.count(mutation.snippet)
    if count == 0:
        return 0, "stale"
    if count > 1:
        return 0, "ambiguous"
    return text[: text.index(mutation.snippet)].count("\n") + 1, ""


def check(mutations, root=ROOT):
    """0 when every mutation applies (its snippet occurs once in its file);
    else print each that does not, with why, and return 1."""
    unusable = [(m, status) for m in mutations for _, status in [locate(m, root)] if status]
    for mutation, status in unusable:
        print(f"[{status:>9}] {mutation.name}: its snippet occurs "
              f"{'nowhere' if status == 'stale' else 'more than once'} in "
              f"{PACKAGE}/{mutation.file}; update the mutation", flush=True)
    if unusable:
        print(f"{len(unusable)} of {len(mutations)} mutation(s) cannot apply: "
              + ", ".join(m.name for m, _ in unusable))
        return 1
    return 0


def copy_repository(destination):
    """The tracked and untracked (not ignored) files of the working tree,
    as they are now, under `destination`."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT, check=True, capture_output=True).stdout.decode().split("\0")
        files = [name for name in listed if name and (ROOT / name).is_file()]
    except (OSError, subprocess.CalledProcessError):
        files = [str(p.relative_to(ROOT)) for p in ROOT.rglob("*")
                 if p.is_file() and ".git" not in p.parts and "__pycache__" not in p.parts]
    for name in files:
        target = destination / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, target)


def run_tests(root, tests, timeout, select=()):
    """`(returncode, output, seconds)` of pytest on `tests` in `root`."""
    # One process per mutation (`--jobs` runs several): under pytest-xdist
    # (the project's `-n 2`) `-x` ends in exit status 2, "interrupted", which
    # would read as broken.
    command = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
               "-n", "0", "-rf", *tests, *select]
    env = dict(os.environ, PYTHONPATH=str(root), PYTHONDONTWRITEBYTECODE="1")
    start = time.monotonic()
    try:
        done = subprocess.run(command, cwd=root, env=env, capture_output=True,
                              text=True, timeout=timeout)
        return done.returncode, done.stdout + done.stderr, time.monotonic() - start
    except subprocess.TimeoutExpired as expired:
        output = (expired.stdout or b"")
        output = output.decode() if isinstance(output, bytes) else output
        return None, output, time.monotonic() - start


_FAILED = re.compile(r"^(?:FAILED|ERROR) (.+)$", re.MULTILINE)


def first_failure(output):
    """The first failing test's id in pytest's short summary (`-rf`)."""
    found = _FAILED.search(output)
    return found.group(1).split(" - ", 1)[0].strip() if found else ""


def mutate_and_test(mutation, root, timeout):
    result = Result(mutation)
    result.line, status = locate(mutation, root)
    if status:
        result.status = status
        return result
    path = root / PACKAGE / mutation.file
    original = path.read_text()
    path.write_text(original.replace(mutation.snippet, mutation.replacement, 1))
    try:
        code, output, result.seconds = run_tests(root, mutation.tests, timeout)
    finally:
        path.write_text(original)
    if code is None:
        result.status = "timeout"
    elif code == 0:
        result.status = "survived"
    elif code == 1:
        result.status, result.caught_by = "caught", first_failure(output)
    else:  # 2: interrupted / collection error, 3: internal, 4: usage, 5: none collected
        result.status = "broken"
        result.caught_by = first_failure(output) or f"pytest exit code {code}"
    return result


def confirm_catchers(results, root, timeout):
    """Run each test that caught a mutation on the unmutated copy: one that
    fails there caught nothing."""
    catchers = sorted({r.caught_by for r in results if r.status == "caught"})
    failing = set()
    for test in catchers:
        code, _, _ = run_tests(root, [test], timeout)
        if code != 0:
            failing.add(test)
    for result in results:
        if result.status == "caught" and result.caught_by in failing:
            result.status = "caught by a failing test"


def table(results):
    rows = [("mutation", "file:line", "caught by", "time")]
    for r in results:
        if r.status == "caught":
            caught = r.caught_by
        elif r.status == "survived":
            caught = "SURVIVED"
        else:
            caught = f"{r.status}: {r.caught_by}" if r.caught_by else r.status
        rows.append((r.mutation.name, r.where, caught, f"{r.seconds:.0f}s" if r.seconds else "-"))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = [" | ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", action="append", default=[],
                        help="run this mutation (repeatable; a comma-separated list too)")
    parser.add_argument("--list", action="store_true", help="list the mutations and exit")
    parser.add_argument("--check", action="store_true",
                        help="only check that every mutation applies (exit 1 naming those "
                             "that do not)")
    parser.add_argument("--timeout", type=float, default=900,
                        help="seconds for the tests of one mutation (default 900)")
    parser.add_argument("--jobs", type=int, default=1,
                        help="mutations tested at once, each in its own copy (default 1)")
    parser.add_argument("--no-confirm", action="store_true",
                        help="skip re-running the catching tests without their mutation")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args(argv)

    names = [n for item in args.only for n in item.split(",") if n]
    unknown = sorted(set(names) - {m.name for m in MUTATIONS})
    if unknown:
        parser.error(f"unknown mutation(s): {', '.join(unknown)} (see --list)")
    chosen = [m for m in MUTATIONS if not names or m.name in names]

    if args.list:
        for mutation in chosen:
            line, status = locate(mutation, ROOT)
            where = f"{mutation.file}:{line}" if line else f"{mutation.file} ({status})"
            print(f"{mutation.name:40} {where:34} {mutation.description}")
        return check(chosen, ROOT)
    # A mutation that cannot apply tests nothing: never a pass.
    unusable = check(chosen, ROOT)
    if unusable or args.check:
        return unusable

    jobs = max(1, min(args.jobs, len(chosen)))
    with tempfile.TemporaryDirectory(prefix="kip-mutation-") as scratch:
        roots = []
        for index in range(jobs):
            root = Path(scratch) / f"copy{index}"
            copy_repository(root)
            roots.append(root)
        free = list(roots)

        def one(mutation):
            root = free.pop()
            try:
                result = mutate_and_test(mutation, root, args.timeout)
            finally:
                free.append(root)
            print(f"[{result.status:>9}] {mutation.name} ({result.seconds:.0f}s) "
                  f"{result.caught_by}", flush=True)
            return result

        with ThreadPoolExecutor(jobs) as pool:
            results = list(pool.map(one, chosen))
        if not args.no_confirm:
            confirm_catchers(results, roots[0], args.timeout)

    print()
    print(table(results))
    survived = [r for r in results if r.status != "caught"]
    print(f"\n{len(results) - len(survived)} of {len(results)} caught; "
          + (", ".join(f"{r.mutation.name} ({r.status})" for r in survived) or "none missed"))
    if args.json:
        Path(args.json).write_text(json.dumps([
            {"mutation": r.mutation.name, "where": r.where, "status": r.status,
             "caught_by": r.caught_by, "seconds": round(r.seconds, 1),
             "description": r.mutation.description, "tests": list(r.mutation.tests)}
            for r in results], indent=2))
    return 0 if not survived else 1


if __name__ == "__main__":
    sys.exit(main())
