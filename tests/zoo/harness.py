"""The checks over the corpus; each returns a `CheckResult`.

A check never asserts: it returns `pass`, `fail` (it ran and found a
difference, an opaque node, a layer not reached, ...), `error` (something
raised; the detail is the exception's first line) or `n/a` (the model
states, and the check confirms, that the check does not apply). The tests
in `tests/test_zoo.py` assert on these results; `benchmarks/zoo.py` prints
them as a scoreboard.

The checks (public kip API only):

- `check_traced`: `kip.convert_to_functional` (with its verification)
  gives a graph without an opaque node, unless the model file states why.
- `check_expand`: `kip.apply_passes(converted, [Expand("all")])` computes
  the original's outputs and gradients on the batch, and leaves no custom
  layer (a layer class not exported by `keras.layers`) that the report
  gives no reason for. Returns two results (`expand`, `custom_left`).
- `check_replace`: `Replace` of every class of the LayerNormalization
  family found in the model (keras's LayerNormalization and
  RMSNormalization, and custom norms such as keras_hub's `LlamaLayerNorm`
  or `T5LayerNorm`), each by a subclass of itself with its weights
  copied, reaches every norm layer, and the outputs stay equal.
- `check_fit`: `PluginModel` (`how="plugin_model"`) or `PluginCallback`
  (`how="plugin_callback"`) trains 3 steps with the same per-step logs
  (losses, metrics) and the same final variables as plain Keras on an
  identical twin (same weights and RNG states, same data, same seed).
  The same through `PluginModel(passes=[Recompute(auto=True)])`
  (`how="fit_recompute"`: a pass's graph can compute the first batch right
  and still train wrong), and through `PluginModel(passes=[Expand("all")])`
  with every optimizer of the model's `compile` replaced by `Adam`
  (`how="fit_expand"`), against plain Keras compiled the same way: Adam,
  the optimizer with state of its own, turns a difference of rounding in
  a gradient into a step the size of the learning rate, so it is the
  strictest judge of the expanded graph's gradients. A model that compiles
  with Adam already (or AdamW, a subclass) keeps its own optimizer there.

The checks of one model share work when they run one after another (as
`check_model` and tests/test_zoo.py run them): `check_traced`,
`check_expand` and `check_replace` start from one verified conversion
(`shared_conversion`, reset for each check), and both fit checks compare
with one plain-Keras fit (`plain_fit`). Run in any other order, a check
makes them again; the results are the same.

Comparisons restore every non-trainable variable of the model (RNG seed
states, BatchNormalization statistics) before each run, so a model that
draws random numbers at inference compares equal when it computes the same
thing. Outputs, gradients and logged losses are compared with the
tolerances of `kip`'s own verification (`rtol=1e-4`, `atol=1e-5` times the
largest expected magnitude, at least 1); trained weights as `compare_fits`
explains.

Example:
    >>> from zoo import harness
    >>> print(harness.check_traced("recommender"))
    recommender traced: pass (13 nodes) [0.4 s]
"""

import contextlib
import importlib
import re
import time
import traceback
from dataclasses import dataclass

import keras
import numpy as np
import tensorflow as tf

import keras_ipu_plugin as kip
from keras_ipu_plugin.frontend.inputs import without_autotuning
from keras_ipu_plugin.frontend.verify.runs import taped_stateful_draws

SEED = 1234
STEPS = 3
RTOL, ATOL = 1e-4, 1e-5

PASS, FAIL, ERROR, NA = "pass", "fail", "error", "n/a"
CHECKS = (
    "traced", "expand", "custom_left", "to_keras", "replace", "plugin_model", "plugin_callback",
    "fit_expand", "fit_recompute",
)
#: The fit checks: `check_fit(name, how)` for each.
FITS = ("plugin_model", "plugin_callback", "fit_expand", "fit_recompute")


@dataclass
class CheckResult:
    """The outcome of one check on one corpus model."""

    model: str
    check: str
    status: str  # PASS, FAIL, ERROR or NA
    detail: str = ""
    seconds: float = 0.0
    trace: str = ""  # the traceback of an ERROR (benchmarks/zoo.py --traceback)
    # `custom_left`: the classes of the custom layers Expand("all") left
    classes_left: frozenset = frozenset()

    @property
    def ok(self):
        return self.status in (PASS, NA)

    def __str__(self):
        return f"{self.model} {self.check}: {self.status} ({self.detail}) [{self.seconds:.1f} s]"


class CheckFailed(Exception):
    """A check ran and found what it must not (reported as FAIL, not ERROR)."""


# -- the corpus models behind one interface ------------------------------------
class Subject:
    """One corpus module with the interface's defaults filled in.

    Example:
        >>> subject = Subject("vit")
        >>> model = subject.fresh()
        >>> x, y = subject.data()
    """

    def __init__(self, name):
        self.name = name
        self.module = importlib.import_module(f"{__package__}.{name}")
        self.batch = getattr(self.module, "BATCH", 4)
        self.expect_opaque = getattr(self.module, "EXPECT_OPAQUE", None)
        self.no_norm_layers = getattr(self.module, "NO_NORM_LAYERS", False)
        self.slow = getattr(self.module, "SLOW", False)
        self.doc = self.module.__doc__ or ""

    def fresh(self):
        """A new model, built from the same seed every time."""
        keras.utils.set_random_seed(SEED)
        return self.module.build()

    def data(self, batch=None):
        keras.utils.set_random_seed(SEED)
        return self.module.data(batch or self.batch)

    def compile_kwargs(self):
        return self.module.compile_kwargs()

    def parts(self, model, x, y):
        """`[(label, model, inputs)]`: what the structural checks convert."""
        if hasattr(self.module, "parts"):
            return [(label, part, _tensors(inputs))
                    for label, part, inputs in self.module.parts(model, x, y)]
        inputs = self.module.model_input(x, y) if hasattr(self.module, "model_input") else x
        return [(model.name, model, _tensors(inputs))]


def _tensors(structure):
    return keras.tree.map_structure(tf.convert_to_tensor, structure)


def _run_check(name, check, function):
    """Run `function() -> detail` as check `check`: a CheckResult whatever happens."""
    start, trace = time.perf_counter(), ""
    try:
        status, detail = function()
    except CheckFailed as failure:
        status, detail = FAIL, str(failure)
    except Exception as error:  # noqa: BLE001 - the board must go on
        status, detail, trace = ERROR, describe_error(error), traceback.format_exc()
    finally:
        keras.backend.clear_session(free_memory=False)
    return CheckResult(name, check, status, detail, time.perf_counter() - start, trace)


def describe_error(error):
    """`Type: first line of the message`, and the same of the exception it
    was raised while handling, if any (a failing clean-up can hide the
    real error)."""
    text = _first_line(error)
    context = error.__cause__ or (None if error.__suppress_context__ else error.__context__)
    if context is not None and not isinstance(error, CheckFailed):
        text += f" [raised while handling {_first_line(context)}]"
    return text


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
# First lines that only say where an error happened; the message that says
# what happened is on a later line.
_WRAPPERS = ("Exception encountered when calling", "in user code:")


def _first_line(error):
    message = str(error)
    if isinstance(error, KeyError) and error.args and isinstance(error.args[0], str):
        message = error.args[0]  # str() of a KeyError is the repr of its message
    lines = [_ANSI.sub("", line).strip() for line in message.strip().splitlines()]
    lines = [line for line in lines if line]
    first = lines[0] if lines else ""
    if first.startswith(_WRAPPERS):
        cause = next((line for line in lines[1:] if not line.startswith(("File ", "Arguments", "•", "return ", "raise "))), "")
        if cause:
            first = f"{first} {cause}"
    return f"{type(error).__name__}: {first}"


def _labelled(label, text, parts):
    return text if len(parts) == 1 else f"{label}: {text}"


# -- one conversion shared by the structural checks of a model ----------------------
class SharedConversion:
    """A model of `subject`, its parts and one verified conversion of each
    part: what `check_traced` inspects, and what `check_expand` and
    `check_replace` apply their passes to (converting the same model three
    times costs a third of the corpus's time and checks nothing more).

    Each check starts from the state conversion left: `shared_conversion`
    puts every variable back to its value after converting (and the seeds
    to where a fresh model's check started), and `check_unchanged` fails a
    check whose passes changed a variable of the model or the converted
    graph, which `apply_passes` must leave as they were.

    Example:
        >>> shared = shared_conversion(Subject("vit"))
        >>> for (label, part, inputs), converted in shared.for_passes(): ...
    """

    def __init__(self, subject):
        self.subject = subject
        self.model = subject.fresh()
        x, y = subject.data()
        self.parts = subject.parts(self.model, x, y)
        self.error = None
        self._converted = []
        try:
            for _, part, inputs in self.parts:
                self._converted.append(kip.convert_to_functional(part, (inputs,)))
        except Exception as error:  # noqa: BLE001 - check_traced reports it
            self.error = error
        variables = {}
        for model in [self.model, *self._converted]:
            variables.update((id(v), v) for v in model.variables)
        self._state = [(v, np.array(v.numpy())) for v in variables.values()]
        self._graphs = [_graph_signature(model) for model in self._converted]

    def converted(self):
        """One verified conversion per part; raises what conversion raised."""
        if self.error is not None:
            raise self.error
        return self._converted

    def for_passes(self):
        """`[((label, part, inputs), converted)]`: the verified conversions,
        or, where verification (or conversion) failed, a fresh model's parts
        converted without verification, as each check did on its own, so
        that Expand and Replace still report on a model `check_traced`
        fails."""
        if self.error is None:
            return list(zip(self.parts, self._converted))
        model = self.subject.fresh()
        x, y = self.subject.data()
        parts = self.subject.parts(model, x, y)
        return [((label, part, inputs), kip.convert_to_functional(part, (inputs,), verify=False))
                for label, part, inputs in parts]

    def reset(self):
        """Variables as conversion left them, seeds as a fresh model's check had them."""
        for variable, value in self._state:
            variable.assign(value)
        self.subject.data()  # sets the seeds, then draws what data() draws

    def check_unchanged(self, what):
        """Raise `CheckFailed` if `what` changed a variable of the model or
        a converted graph (a later check would see it)."""
        for variable, value in self._state:
            if np.asarray(variable.numpy()).tobytes() != value.tobytes():
                raise CheckFailed(f"{what} changed the variable `{variable.path}` of the "
                                  "model it was applied to")
        for model, signature in zip(self._converted, self._graphs):
            if _graph_signature(model) != signature:
                raise CheckFailed(f"{what} changed the graph of `{model.name}`, "
                                  "the model it was applied to")


def _graph_signature(model):
    return [(node.name, id(node.operation)) for node in model.kip_graph.nodes]


_shared = {}  # the last model's SharedConversion only (keras.applications are large)


def shared_conversion(subject):
    """`subject`'s `SharedConversion`, reset for the next check: made once
    for the checks of a model run one after another (as `check_model` and
    tests/test_zoo.py run them); made again after another model's."""
    if subject.name not in _shared:
        _shared.clear()
        _shared[subject.name] = SharedConversion(subject)
    shared = _shared[subject.name]
    shared.reset()
    return shared


# -- check 1: conversion is fully traced ------------------------------------------
def check_traced(name):
    """Convert (verified) each part; pass when no node is opaque, or when
    the model file states why it cannot be traced."""
    subject = Subject(name)

    def run():
        shared = shared_conversion(subject)
        parts = shared.parts
        found, sizes = [], []
        for (label, _, _), converted in zip(parts, shared.converted()):
            sizes.append(len(converted.kip_graph.nodes))
            found += [(label, node, reason) for node, reason in opaque_nodes(converted)]
        if not found:
            return PASS, f"{sum(sizes)} nodes"
        listing = "; ".join(
            _labelled(label, f"`{node}` opaque: {reason}", parts) for label, node, reason in found
        )
        if subject.expect_opaque:
            return PASS, f"opaque as the model states ({subject.expect_opaque}): {listing}"
        raise CheckFailed(listing)

    return _run_check(name, "traced", run)


def opaque_nodes(model):
    """`[(node name, reason)]` of the opaque nodes of a converted model,
    from its graph and its report."""
    found = {}
    for node in graph_nodes(model.kip_graph):
        if isinstance(node.operation, kip.OpaqueLayer):
            found[node.name] = node.opaque_reason or node.operation.reason
    report = model.kip_report
    for layer, reason in (report.opaque.items() if report is not None else ()):
        if layer not in found and not any(n.startswith(layer) for n in found):
            found[layer] = reason
    return list(found.items())


def graph_nodes(graph):
    """The nodes of `graph` and of the graph of every `training` mode of
    its `kip.ModeSwitch` nodes (a layer branching on `training`), nested
    ones too: what a switch holds is checked as the rest of the graph."""
    nodes = []
    for node in graph.nodes:
        nodes.append(node)
        if isinstance(node.operation, kip.ModeSwitch) and node.operation.branch_graphs:
            for branch in node.operation.branch_graphs.values():
                nodes.extend(graph_nodes(branch))
    return nodes


# -- check 2: Expand("all") ---------------------------------------------------------
def check_expand(name):
    """`(expand, custom_left)` results of one `Expand("all")` per part."""
    subject = Subject(name)
    outcome = {"equal": None, "left": None}

    def run():
        shared = shared_conversion(subject)
        parts = shared.parts
        differences, left, errors = [], [], []
        paths, plain, features, expanded = [], [], [], []
        for (label, part, inputs), converted in shared.for_passes():
            passed = kip.apply_passes(converted, [kip.passes.Expand("all")])
            paths.append(sorted(node.name for node in graph_nodes(passed.kip_graph)))
            expanded.append((label, converted, passed, inputs))
            left += [(label, *entry) for entry in custom_layers_left(passed)]
            try:
                difference = compare_models(part, passed, inputs, gradients=True)
            except Exception as error:  # noqa: BLE001 - the passed model crashes
                errors.append(_labelled(label, "the expanded model fails when called: "
                                        + describe_error(error), parts))
                continue
            if difference:
                before = compare_models(part, converted, inputs, gradients=True)
                if before:
                    difference += f" (the converted model already differs before Expand: {before})"
                differences.append(_labelled(label, difference, parts))
        outcome["left"] = (left, parts)
        _EXPANDED_PATHS[name] = paths
        shared.check_unchanged("Expand")
        # Run after the check: these call the models, and a call may write
        # a variable (PixelCNN's masked kernel); the state is put back after.
        for label, converted, passed, inputs in expanded:
            plain.append(_plain_keras_result(label, passed, inputs))
            features.append(_inner_feature_result(label, converted, passed, inputs))
        shared.reset()
        _TO_KERAS[name] = plain
        _FEATURES[name] = features
        if errors:
            return ERROR, "; ".join(errors + differences)
        if differences:
            raise CheckFailed("; ".join(differences))
        return PASS, "outputs and gradients equal"

    expand = _run_check(name, "expand", run)
    if outcome["left"] is None:  # conversion or Expand itself raised
        custom = CheckResult(name, "custom_left", ERROR, expand.detail, 0.0)
    else:
        custom = _custom_left_result(name, *outcome["left"])
    return expand, custom


_EXPANDED_PATHS = {}  # model name -> the node paths of check_expand's expanded parts
_TO_KERAS = {}  # model name -> [(status, detail)] of `kip.to_keras` per expanded part


def _plain_keras_result(label, passed, inputs):
    """`(status, detail)` of `kip.to_keras` on one expanded part: PASS when
    the plain Keras model computes the part's outputs, NA when the graph
    holds nodes of kip's or the model's classes (named in the detail)."""
    try:
        plain = kip.to_keras(passed)
    except kip.PassError as error:
        if "not Keras's own classes" in str(error):
            return NA, f"{label}: {_first_line(error)}"
        return FAIL, f"{label}: {_first_line(error)}"
    except Exception as error:  # noqa: BLE001 - the board must go on
        return FAIL, f"{label}: to_keras raised {describe_error(error)}"
    try:
        expected, got = passed(inputs), plain(inputs)
    except Exception as error:  # noqa: BLE001 - the plain model crashes
        return FAIL, f"{label}: the plain Keras model fails when called: {describe_error(error)}"
    expected, got = keras.tree.flatten(expected), keras.tree.flatten(got)
    if len(expected) != len(got):
        return FAIL, f"{label}: {len(got)} outputs instead of {len(expected)}"
    for index, (a, b) in enumerate(zip(expected, got)):
        difference = difference_of(a, b)
        if difference:
            return FAIL, f"{label}: output {index} {difference}"
    return PASS, label


_FEATURES = {}  # model name -> [(status, detail)] of an inner feature per part


def _inner_feature_result(label, converted, passed, inputs):
    """`(status, detail)`: the first layer held inside a block the converted
    part keeps whole (a node path `block.child` that `Expand("all")` makes
    a node) extracted from the converted part, which expands only that
    block, equal to the same path extracted from the expanded part; NA when
    the part keeps no such block."""
    top = {node.name for node in converted.kip_graph.nodes}
    inner = [node.name for node in passed.kip_graph.nodes
             if node.is_layer and "." in node.name and node.name.split(".")[0] in top
             and node.name not in top
             and not type(node.operation).__module__.startswith("keras_ipu_plugin")]
    if not inner:
        return NA, f"{label}: no layer inside a block kept whole"
    path = inner[0]
    try:
        got = kip.create_feature_extractor(converted, [path])(inputs)[path]
        expected = kip.create_feature_extractor(passed, [path])(inputs)[path]
    except Exception as error:  # noqa: BLE001 - the board must go on
        return FAIL, f"{label}: `{path}`: {describe_error(error)}"
    for index, (a, b) in enumerate(zip(keras.tree.flatten(expected), keras.tree.flatten(got))):
        difference = difference_of(a, b)
        if difference:
            return FAIL, f"{label}: `{path}` output {index} {difference}"
    return PASS, f"{label}: `{path}`"


def _part_results(name, store):
    """The per-part `(status, detail)` results check_expand's run left in
    `store` for model `name` (running it if it has not run), or None when
    Expand itself failed; raise `CheckFailed` naming the parts that failed."""
    if name not in store:
        check_expand(name)
    results = store.get(name)
    failed = [detail for status, detail in results or () if status == FAIL]
    if failed:
        raise CheckFailed("; ".join(failed))
    return results


def check_inner_feature(name):
    """`kip.create_feature_extractor` at a path inside a block kept whole
    (check_expand's run): equal to the same path of the expanded model."""

    def run():
        results = _part_results(name, _FEATURES)
        if results is None:
            return ERROR, "Expand failed"
        reached = [detail for status, detail in results if status == PASS]
        if not reached:
            return NA, "; ".join(detail for _, detail in results)
        return PASS, "; ".join(reached)

    return _run_check(name, "inner_feature", run)


def check_to_keras(name):
    """`kip.to_keras` of each part after `Expand("all")` (check_expand's
    run): pass when every part is served by a model of Keras's own classes
    computing its outputs; n/a when a part keeps nodes that need kip."""

    def run():
        results = _part_results(name, _TO_KERAS)
        if results is None:
            return ERROR, "Expand failed"
        kept = [detail for status, detail in results if status == NA]
        if kept:
            return NA, "; ".join(kept)
        return PASS, "a Keras-only model computes the outputs"

    return _run_check(name, "to_keras", run)


def expanded_paths(name):
    """The node paths of each part of a fresh build of model `name`, after
    `Expand("all")` (conversion unverified: only names are compared)."""
    subject = Subject(name)
    model = subject.fresh()
    x, y = subject.data()
    paths = []
    for _, part, inputs in subject.parts(model, x, y):
        converted = kip.convert_to_functional(part, (inputs,), verify=False)
        passed = kip.apply_passes(converted, [kip.passes.Expand("all")], verify=False)
        paths.append(sorted(node.name for node in graph_nodes(passed.kip_graph)))
    return paths


def check_stable_paths(name):
    """A second build of the model in the same process (Keras's layer-name
    counters moved on) has the node paths of the first, after
    `Expand("all")`: a path copied from one run's report names the same
    node in the next."""

    def run():
        if name not in _EXPANDED_PATHS:
            check_expand(name)
        first = _EXPANDED_PATHS.get(name)
        if first is None:
            return ERROR, "Expand failed on the first build"
        second = expanded_paths(name)
        for index, (a, b) in enumerate(zip(first, second)):
            if a != b:
                only_first = sorted(set(a) - set(b))[:5]
                only_second = sorted(set(b) - set(a))[:5]
                raise CheckFailed(f"part {index}: paths of the first build only: {only_first}; "
                                  f"of the second only: {only_second}")
        return PASS, f"{sum(map(len, first))} paths equal"

    return _run_check(name, "stable_paths", run)


def _custom_left_result(name, left, parts):
    if not left:
        return CheckResult(name, "custom_left", PASS, "none")
    unexplained = [entry for entry in left if not entry[3]]
    listing = "; ".join(
        _labelled(label, f"`{node}` ({cls})" + (f": {reason}" if reason else ""), parts)
        for label, node, cls, reason in (unexplained or left)
    )
    classes = frozenset(cls for _, _, cls, _ in left)
    if unexplained:
        return CheckResult(name, "custom_left", FAIL,
                           f"{len(left)} left, {len(unexplained)} without a reason: {listing}",
                           classes_left=classes)
    return CheckResult(name, "custom_left", PASS, f"{len(left)} left, each with a reason: {listing}",
                       classes_left=classes)


_KERAS_LAYER_CLASSES = frozenset(
    value for value in vars(keras.layers).values()
    if isinstance(value, type) and issubclass(value, keras.layers.Layer)
)


def is_custom(operation):
    """Whether a graph node's operation is a custom layer: a Layer whose
    class is not one that `keras.layers` exports (a keras_hub layer, a
    user's layer, ConvNeXt's LayerScale, a nested keras.Model, an opaque
    node). `keras.ops` operations and the plugin's own graph layers and
    operations (a TensorFlow function's `TFFunction`) are not custom."""
    if isinstance(operation, kip.OpaqueLayer):
        return True
    if isinstance(operation, kip.LayerAlias):
        operation = operation.layer
    if not isinstance(operation, keras.layers.Layer):  # a keras.ops call, a TFFunction
        return not type(operation).__module__.startswith(("keras.", "keras_ipu_plugin."))
    if type(operation).__module__.startswith("keras_ipu_plugin."):
        return False
    return type(operation) not in _KERAS_LAYER_CLASSES


def custom_layers_left(model):
    """`[(node name, class name, reason or "")]` for the custom layers left
    in a passed model's graph; the reason is the node's or the report's."""
    report = model.kip_report
    opaque = report.opaque if report is not None else {}
    left = []
    for node in graph_nodes(model.kip_graph):
        operation = node.operation
        if not is_custom(operation):
            continue
        layer = operation.layer if isinstance(operation, (kip.OpaqueLayer, kip.LayerAlias)) else operation
        reason = (
            node.opaque_reason or opaque.get(node.name) or opaque.get(getattr(layer, "name", ""))
            or getattr(operation, "reason", "") or ""
        )
        left.append((node.name, type(layer).__name__, reason))
    return left


# -- check 3: Replace reaches every norm layer ----------------------------------------
_NORM_NAME = re.compile(r"(layer|rms)_?norm", re.IGNORECASE)


def is_norm(layer):
    """LayerNormalization family: keras's LayerNormalization and
    RMSNormalization (and subclasses), and custom norm classes named so
    (`LlamaLayerNorm`, `T5LayerNorm`, keras_hub's `RMSNormalization`)."""
    family = (keras.layers.LayerNormalization, keras.layers.RMSNormalization)
    return isinstance(layer, family) or bool(_NORM_NAME.search(type(layer).__name__))


def sub_layers(root):
    """Every layer reachable from `root`'s attributes (lists, dicts,
    tuples too), without `root`; each once."""
    found, seen = [], {id(root)}

    def visit(value):
        if isinstance(value, keras.layers.Layer):
            if id(value) in seen:
                return
            seen.add(id(value))
            found.append(value)
            for item in vars(value).values():
                visit(item)
        elif isinstance(value, (list, tuple, set)):
            for item in value:
                visit(item)
        elif isinstance(value, dict):
            for item in value.values():
                visit(item)

    for item in vars(root).values():
        visit(item)
    return found


_replacement_classes = {}


def replacement_class(cls):
    """A subclass of `cls` adding nothing, one per class (a user's own
    replacement that must compute what the original computes)."""
    if cls not in _replacement_classes:
        _replacement_classes[cls] = type(f"Replaced{cls.__name__}", (cls,), {})
    return _replacement_classes[cls]


def copy_by_position(old, new):
    """Copy `old`'s weights into `new`'s, in order (the same class)."""
    if len(old.weights) != len(new.weights):
        raise ValueError(
            f"`{new.name}` has {len(new.weights)} weights, `{old.name}` {len(old.weights)}"
        )
    for source, target in zip(old.weights, new.weights):
        target.assign(source)


def check_replace(name):
    """Replace every norm class by a subclass of itself (weights copied);
    pass when each norm layer of the model is replaced and outputs are equal."""
    subject = Subject(name)

    def run():
        shared = shared_conversion(subject)
        parts = shared.parts
        notes, problems, total = [], [], 0
        for (label, part, inputs), converted in shared.for_passes():
            reach = replace_every_norm(part, converted)
            if reach is None:
                continue
            norms, classes, new_layers, still, passed = reach
            total += len(norms)
            reach = f"{len(new_layers)}/{len(norms)} reached ({', '.join(c.__name__ for c in classes)})"
            if still or len(new_layers) != len(norms):
                problems.append(_labelled(label, reach + (
                    "; still in the graph: " + ", ".join(f"`{n}`" for n in still) if still else ""
                ), parts))
                continue
            difference = compare_models(part, passed, inputs, gradients=False)
            if difference:
                problems.append(_labelled(label, f"{reach}, but {difference}", parts))
            else:
                notes.append(_labelled(label, reach, parts))
        shared.check_unchanged("Replace")
        if total == 0:
            if subject.no_norm_layers:
                return NA, "no norm layer (as the model states)"
            raise CheckFailed("found no layer of the LayerNormalization family; "
                              "a model without one says NO_NORM_LAYERS = True")
        if subject.no_norm_layers:
            raise CheckFailed(f"the model states NO_NORM_LAYERS but has {total}")
        if problems:
            raise CheckFailed("; ".join(problems))
        return PASS, "; ".join(notes) + ", outputs equal"

    return _run_check(name, "replace", run)


def replace_every_norm(model, converted):
    """`Replace` every class of the LayerNormalization family in `model` by
    a subclass of itself (weights copied) in `converted`, its conversion:
    `(norms, classes, ids of the replacing layers in the graph, names of
    the norms still in it, the passed model)`, or None where `model` holds
    no norm layer. `tools/survey_models.py` asks the same of its models."""
    norms = [layer for layer in sub_layers(model) if is_norm(layer)]
    if not norms:
        return None
    classes = _most_derived_first({type(layer) for layer in norms})
    passes = [
        kip.passes.Replace({cls: kip.passes.Replacement(
            replacement_class(cls), copy_weights_fn=copy_by_position)})
        for cls in classes
    ]
    passed = kip.apply_passes(converted, passes)
    new_layers = {
        id(node.operation) for node in graph_nodes(passed.kip_graph)
        if type(node.operation) in _replacement_classes.values()
    }
    return norms, classes, new_layers, _still_in_graph(passed, norms), passed


def _most_derived_first(classes):
    return sorted(classes, key=lambda cls: -len(cls.__mro__))


def _still_in_graph(model, norms):
    """Names of the norm layers still used by the graph: as nodes, or
    inside a node's layer (an opaque or unexpanded layer)."""
    wanted = {id(layer): layer for layer in norms}
    still = []
    for node in graph_nodes(model.kip_graph):
        operation = node.operation
        if not isinstance(operation, keras.layers.Layer):
            continue
        for layer in [operation] + sub_layers(operation):
            if id(layer) in wanted and layer.name not in still:
                still.append(layer.name)
    return still


# -- comparing two models on one batch --------------------------------------------------
def compare_models(original, other, inputs, *, gradients):
    """'' when `other` computes `original`'s outputs (and gradients of a
    fixed projection of them w.r.t. `original`'s trainable variables) on
    `inputs` in inference mode; else what differs first."""
    variables = list(original.trainable_variables) if gradients else []
    state = _non_trainable_state(original)
    # TensorFlow's stateful draws (`tf.random.normal` with no seed
    # generator) are the original's in the other run too, as kip's own
    # verification replays them.
    with taped_stateful_draws() as draws:
        draws.record()
        expected, expected_grads = _outputs_and_gradients(original, inputs, variables, state)
        draws.replay()
        actual, actual_grads = _outputs_and_gradients(other, inputs, variables, state)
    expected_leaves = keras.tree.flatten(expected)
    actual_leaves = keras.tree.flatten(actual)
    if len(expected_leaves) != len(actual_leaves):
        return f"{len(actual_leaves)} outputs instead of {len(expected_leaves)}"
    for index, (e, a) in enumerate(zip(expected_leaves, actual_leaves)):
        difference = difference_of(e, a)
        if difference:
            return f"output {index} {difference}"
    for variable, e, a in zip(variables, expected_grads, actual_grads):
        if e is None and a is None:
            continue
        if e is None or a is None:
            return (f"the gradient of `{variable.path}` is "
                    f"{'missing' if a is None else 'present'} (original: "
                    f"{'present' if a is None else 'missing'})")
        difference = difference_of(e, a)
        if difference:
            return f"the gradient of `{variable.path}` {difference}"
    return ""


def difference_of(expected, actual):
    """'' when close, else 'differs (...)'; shapes must match."""
    expected = np.asarray(expected)
    actual = np.asarray(actual)
    if expected.shape != actual.shape:
        return f"has shape {actual.shape} instead of {expected.shape}"
    if expected.dtype.kind not in "fc":
        return "" if np.array_equal(expected, actual) else "differs (integer values)"
    scale = max(float(np.max(np.abs(expected))) if expected.size else 0.0, 1.0)
    if np.allclose(actual, expected, rtol=RTOL, atol=ATOL * scale, equal_nan=True):
        return ""
    return f"differs (max abs difference {float(np.max(np.abs(actual - expected))):.3g}, scale {scale:.3g})"


def _non_trainable_state(model):
    """Every variable's value: a call may write trainable ones too
    (PixelCNN masks its kernels), and each run starts from the same state."""
    return [(v, np.array(v.numpy())) for v in model.variables]


def _restore(state):
    for variable, value in state:
        if np.asarray(variable.numpy()).tobytes() != value.tobytes():
            variable.assign(value)


def _outputs_and_gradients(model, inputs, variables, state):
    _restore(state)
    try:
        with tf.GradientTape() as tape:
            outputs = model(inputs, training=False)
            scalar = _projection(outputs)
        grads = tape.gradient(scalar, [v.value for v in variables]) if variables else []
    finally:
        _restore(state)
    outputs = keras.tree.map_structure(lambda t: np.asarray(t), outputs)
    return outputs, [None if g is None else np.asarray(tf.convert_to_tensor(g)) for g in grads]


def _projection(outputs):
    """A scalar of all float outputs, with fixed random weights (a plain sum
    would hide errors that cancel, e.g. across a softmax)."""
    total = tf.constant(0.0)
    for index, tensor in enumerate(keras.tree.flatten(outputs)):
        tensor = tf.convert_to_tensor(tensor)
        if not tensor.dtype.is_floating:
            continue
        weights = np.random.RandomState(index).uniform(0.5, 1.5, size=tensor.shape)
        total += tf.reduce_sum(tf.cast(tensor, "float32") * weights.astype("float32"))
    return total


# -- check 4: training through the plugin equals plain Keras ------------------------------
@dataclass
class FitRun:
    """What a 3-step fit produced: per-step logs and final variables."""

    logs: list  # one {name: float} per step
    variables: list  # (path, value) after training
    converted: bool = True
    note: str = ""  # what the plugin did that the result should say


# The last model's only: the fits of a model run one after another, and the
# variables of keras.applications are large.
_initial = {}  # name -> variable values every twin starts from
_reference = {}  # (name, adam) -> FitRun of plain Keras


def twin(subject):
    """A fresh model with the same variables (weights and RNG states) as
    every other twin of `subject`: built by one call on the first batch,
    then assigned the first twin's values."""
    model = subject.fresh()
    x, y = subject.data()
    for _, part, inputs in subject.parts(model, x, y):
        if not part.built:
            part(inputs)
    variables = model.variables
    if subject.name not in _initial:
        _initial.clear()
        _reference.clear()
        _initial[subject.name] = [np.array(v.numpy()) for v in variables]
    values = _initial[subject.name]
    if len(values) != len(variables):
        raise RuntimeError(f"twins of {subject.name} differ: {len(variables)} variables, not {len(values)}")
    for variable, value in zip(variables, values):
        variable.assign(value)
    return model


def training_data(subject):
    """`STEPS` batches as a dataset, as the Keras examples feed `fit`.

    Without tf.data's autotuning: each iterator of an autotuned dataset runs
    a tuning thread, and deleting the iterator (Keras's epoch iterators are
    left in reference cycles) can wait for that thread's sleep, up to a
    minute, inside an unrelated later test: that was a third of the suite's
    time. The batches are the same.
    """
    x, y = subject.data(subject.batch * STEPS)
    elements = x if y is None else (x, y)
    return without_autotuning(tf.data.Dataset.from_tensor_slices(elements).batch(subject.batch))


class _StepLogs(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.logs = []

    def on_train_batch_end(self, batch, logs=None):
        self.logs.append({
            key: float(np.asarray(value)) for key, value in (logs or {}).items()
            if np.asarray(value).size == 1
        })


def _fit(trainee, subject, callbacks=()):
    recorder = _StepLogs()
    keras.utils.set_random_seed(SEED)
    trainee.fit(training_data(subject), epochs=1, verbose=0, shuffle=False,
                callbacks=[recorder, *callbacks])
    return recorder.logs


#: TensorFlow graph rewrites whose float rounding differs between two graphs
#: of the same ops (docs/reference.md, "Float rounding TensorFlow's graph
#: optimiser chooses"): the remapper fuses a recomputed MatMul with its bias
#: and activation where the forward pass, whose MatMul has two readers, is
#: not fused; the arithmetic optimiser orders an AddN's operands by op name.
#: Adam turns that rounding on a bias with no true gradient (a Dense before a
#: softmax pooling) into steps of the learning rate's size. `fit_recompute`
#: compares with both off, on both sides.
REWRITES_OFF_FOR = {"fit_recompute": ("remapping", "arithmetic_optimization")}


@contextlib.contextmanager
def _graph_rewrites_off(names):
    current = tf.config.optimizer.get_experimental_options()
    previous = {name: current.get(name, True) for name in names}
    tf.config.optimizer.set_experimental_options({name: False for name in names})
    try:
        yield
    finally:
        tf.config.optimizer.set_experimental_options(previous)


def plain_fit(subject, adam=False, rewrites_off=()):
    """The reference: plain Keras on a twin (cached per model), compiled
    as the model says or, with `adam=True`, as `adam_compile_kwargs` says."""
    key = (subject.name, adam, tuple(rewrites_off))
    if key not in _reference:
        model = twin(subject)
        model.compile(**(adam_compile_kwargs(subject) if adam else subject.compile_kwargs()))
        _build_optimizer(model)
        logs = _fit(model, subject)
        _reference[key] = FitRun(logs, _variables_of(model))
    return _reference[key]


def _build_optimizer(model, trainee=None):
    """Build the optimizer of `trainee` (default `model`), when `model` is
    trained by Keras's own `train_step`, over `model.trainable_weights`, as
    that step's first `apply` does.

    Keras (to at least 3.15, without a distribution strategy) builds the
    optimizer while it traces the first step; TensorFlow then traces the
    step a second time, since the first trace created variables. Built
    before `fit`, the step is traced once: half the plain fit's time, with
    the same variables and the same logs. Plain Keras is the reference;
    `plugin_model` and `plugin_callback` build their optimizer as a user's
    `fit` does, inside the plugin's step; the checks of a pass or of Adam
    (`fit_expand`, `fit_recompute`, `fit_adam`) build it before, as this.
    """
    optimizer = getattr(model if trainee is None else trainee, "optimizer", None)
    if (optimizer is None or optimizer.built or not model.trainable_weights
            or type(model).train_step is not keras.Model.train_step):
        return
    optimizer.build(model.trainable_weights)


#: The `passes` of `PluginModel` in each fit check that uses it.
_PLUGIN_MODEL_PASSES = {
    "plugin_model": lambda: (),
    "fit_expand": lambda: [kip.passes.Expand("all")],
    "fit_recompute": lambda: [kip.passes.Recompute(auto=True)],
}


def plugin_fit(subject, how):
    """The same training through `kip.PluginModel` (with the passes of
    `how`, see `_PLUGIN_MODEL_PASSES`) or `kip.PluginCallback`."""
    model, note = twin(subject), ""
    if how in _PLUGIN_MODEL_PASSES:
        # The first-batch verification is `plugin_model`'s to check (and
        # `check_expand`'s, for Expand); training equal to plain Keras is a
        # stronger check than it, and skipping it saves a fifth of a fit.
        wrapper = kip.PluginModel(model, passes=_PLUGIN_MODEL_PASSES[how](),
                                  verify=how == "plugin_model")
        wrapper.compile(**(adam_compile_kwargs(subject) if _with_adam(subject, how)
                           else subject.compile_kwargs()))
        if how != "plugin_model":
            _build_optimizer(model, wrapper)
        logs = _fit(wrapper, subject)
        # A step that calls only sub-models (a GAN) converts those: the
        # report lists what was converted, whatever it was.
        converted = wrapper.kip_report is not None
        if how == "fit_recompute" and converted:
            note = f"{_checkpoints(wrapper.kip_report)} checkpoints planned"
    elif how == "plugin_callback":
        callback = kip.PluginCallback()
        model.compile(**subject.compile_kwargs())
        logs = _fit(model, subject, [callback])
        converted = callback.kip_report is not None
    else:
        raise ValueError(f"how must be one of {FITS}; got {how!r}")
    return FitRun(logs, _variables_of(model), converted, note)


def _checkpoints(report):
    """How many checkpoints `Recompute(auto=True)` planned (0: the plan
    recomputes nothing, and the check shows only that the pass is harmless)."""
    return sum(entry.action == "checkpoint after" for entry in report.entries)


def _is_optimizer(key, value):
    """An optimizer argument of `compile`: an Optimizer, or a name given
    for one (`optimizer="rmsprop"`, a GAN's `d_optimizer="adam"`)."""
    return isinstance(value, keras.optimizers.Optimizer) or (
        isinstance(value, str) and key.endswith("optimizer"))


def _with_adam(subject, how):
    """Whether fit check `how` of `subject` trains with its optimizers
    replaced by Adam (`fit_expand`, unless it compiles with Adam already)."""
    return how == "fit_expand" and not compiles_with_adam(subject)


def compiles_with_adam(subject):
    """Whether every optimizer the model compiles with is Adam (AdamW is a
    subclass); False for a model compiled without one."""
    optimizers = [keras.optimizers.get(value) if isinstance(value, str) else value
                  for key, value in subject.compile_kwargs().items() if _is_optimizer(key, value)]
    return bool(optimizers) and all(isinstance(o, keras.optimizers.Adam) for o in optimizers)


def adam_compile_kwargs(subject):
    """The model's `compile_kwargs` with each optimizer replaced by a fresh
    `Adam(1e-3)`."""
    kwargs = subject.compile_kwargs()
    replaced = {key: keras.optimizers.Adam(1e-3) for key, value in kwargs.items()
                if _is_optimizer(key, value)}
    if not replaced:
        raise CheckFailed(f"no optimizer in compile_kwargs() ({sorted(kwargs)}) to replace by Adam")
    return {**kwargs, **replaced}


def _variables_of(model):
    return [(v.path, np.array(v.numpy())) for v in model.variables]


def compare_fits(reference, run, initial):
    """'' when `run` logged what `reference` logged at every step (every
    key of the reference's logs, within tolerance) and ended with the same
    variables; else the first difference (every key that differs at the
    first step that differs).

    Final variables (non-trainable ones too: BatchNormalization statistics
    are in no loss) are compared relative to how far training moved them
    (`initial` -> `reference`), within 10% of that plus `ATOL`: plain Keras
    itself, run eagerly instead of in a graph (the same float operations in
    another order), ends 2% of the movement away on MobileNetV3Small, since
    Adam and BatchNormalization on small batches amplify rounding; a wrong
    step (another optimizer, a missing gradient or update, another loss)
    is about 100% of the movement away. RNG states and other integer
    variables must be identical.
    """
    if not run.converted:
        return "the plugin never converted the model (plain Keras ran instead)"
    if len(run.logs) != len(reference.logs):
        return f"{len(run.logs)} steps logged instead of {len(reference.logs)}"
    for step, (expected, actual) in enumerate(zip(reference.logs, run.logs), start=1):
        differences = []
        for key, value in expected.items():
            if key not in actual:
                differences.append(f"no `{key}` in the logs (has {sorted(actual)})")
            elif difference_of(np.float64(value), np.float64(actual[key])):
                differences.append(f"`{key}` {actual[key]:.6g}, plain Keras {value:.6g}")
        if differences:
            return f"step {step}: " + "; ".join(differences)
    if len(run.variables) != len(reference.variables):
        return f"{len(run.variables)} variables after training instead of {len(reference.variables)}"
    for start, (path, expected), (_, actual) in zip(initial, reference.variables, run.variables):
        difference = _trained_difference(start, expected, actual)
        if difference:
            return f"variable `{path}` after {STEPS} steps {difference}"
    return ""


def _trained_difference(initial, expected, actual):
    if expected.shape != actual.shape:
        return f"has shape {actual.shape} instead of {expected.shape}"
    if expected.dtype.kind not in "fc":
        return "" if np.array_equal(expected, actual) else "differs (integer values: RNG state?)"
    if not expected.size:
        return ""
    moved = float(np.max(np.abs(expected - initial)))
    difference = float(np.max(np.abs(actual - expected)))
    allowed = 0.1 * moved + ATOL * max(float(np.max(np.abs(expected))), 1.0)
    if difference <= allowed:
        return ""
    return f"differs by {difference:.3g} (training moved it by {moved:.3g})"


def check_fit(name, how):
    """`how`: one of `FITS` (see the module docstring)."""
    subject = Subject(name)
    if how not in FITS:
        raise ValueError(f"how must be one of {FITS}; got {how!r}")

    def run():
        adam = _with_adam(subject, how)
        try:
            with _graph_rewrites_off(REWRITES_OFF_FOR.get(how, ())):
                reference = plain_fit(subject, adam=adam,
                                      rewrites_off=REWRITES_OFF_FOR.get(how, ()))
        except Exception as error:  # noqa: BLE001 - reported, not raised
            return ERROR, f"plain Keras itself fails: {describe_error(error)}"
        with _graph_rewrites_off(REWRITES_OFF_FOR.get(how, ())):
            run = plugin_fit(subject, how)
        difference = compare_fits(reference, run, _initial[name])
        if difference:
            raise CheckFailed(difference)
        losses = ", ".join(f"{logs.get('loss', float('nan')):.4g}" for logs in reference.logs)
        return PASS, f"{STEPS} steps equal (loss {losses})" + (f"; {run.note}" if run.note else "")

    return _run_check(name, how, run)


# -- everything for one model ----------------------------------------------------------------
def check_model(name, checks=CHECKS):
    """The results of `checks` for model `name`, in CHECKS order."""
    results = {}
    if "traced" in checks:
        results["traced"] = check_traced(name)
    if "expand" in checks or "custom_left" in checks or "to_keras" in checks:
        results["expand"], results["custom_left"] = check_expand(name)
    if "to_keras" in checks:
        results["to_keras"] = check_to_keras(name)
    if "replace" in checks:
        results["replace"] = check_replace(name)
    for how in FITS:
        if how in checks:
            results[how] = check_fit(name, how)
    return [results[check] for check in CHECKS if check in results]
