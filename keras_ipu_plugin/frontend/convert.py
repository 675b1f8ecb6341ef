"""`convert_to_functional`: a subclassed model to a functional one.

The first batch shapes the inputs; `model.call` is traced on symbolic inputs
into the graph IR; the IR is rebuilt as a functional model that calls the
same layer objects (so it shares every variable); the two are then checked
equal on that batch. A model whose `call` cannot be traced becomes one
opaque node that runs the original code.

One conversion at a time in a process.

Converting writes bookkeeping on the user's layers and takes it back: the
nodes a symbolic call records on each layer, its build state, the values a
verification run moves. Two threads converting the same model interleave
those writes and fail ("name 'input' used 2 times", IndexError, "Graph
disconnected"), and so do two *different* models that share a layer (a
siamese encoder, one backbone under two heads): a lock per model cannot
see that, so the lock is process-wide. Conversions are rare and spend
nearly all their time in Python holding the GIL, so serialising them costs
no real parallelism.

Calling a converted model, or training it, takes no lock. Converting a
model while another thread trains it is not supported: the conversion puts
the model's non-trainable variables back to their values from before it
(see `state.ModelState`), which would undo that thread's updates.
"""

import dataclasses
import threading
import time

import keras
import numpy as np
import tensorflow as tf

from keras_ipu_plugin import _compat
from keras_ipu_plugin.errors import ConversionError, InputDataError, InputTypeError
from keras_ipu_plugin.frontend import inputs as inputs_lib
from keras_ipu_plugin.frontend.state import guarded, UndoneWrites, VariableValues, replay_state
from keras_ipu_plugin.frontend.trace.failures import ModeStructureError
from keras_ipu_plugin.frontend.trace.tracer import (
    TraceError,
    essential_message,
    current_tracer,
    trace_model,
)
from keras_ipu_plugin.frontend.trace.training_modes import default_training
from keras_ipu_plugin.frontend.verify.compare import is_float_array, tolerance_for
from keras_ipu_plugin.frontend.verify.equivalence import check_equivalent, keep_first_batch
from keras_ipu_plugin.frontend.verify.runs import taped_stateful_draws
from keras_ipu_plugin.ir.graph import Graph, Node, Value
from keras_ipu_plugin.layers.opaque import OpaqueLayer, autograph_call, output_specs_of
from keras_ipu_plugin.layers.user_code import takes_training
from keras_ipu_plugin.report import Report
from keras_ipu_plugin.runtime.functional import adopt_call_semantics
from keras_ipu_plugin.runtime.rebuild import rebuild

__all__ = ["one_conversion_at_a_time"]


def convert_to_functional(model, data, *, training=None, verify=True, static_batch=False,
                          tracer=None):
    """Convert `model` to a functional model sharing its variables.

    Args:
        model: a `keras.Model` (subclassed, functional or sequential).
        data: the first batch, or a dataset to read it from (see
            `inputs.first_batch`); only `x` shapes the inputs.
        training: None to follow the `training` the converted model is
            called with, or True / False to fix the graph in that mode.
        verify: compare outputs and gradients with the original on the
            first batch (see `verify.check_equivalent`); raise
            `kip.ConversionError` on a mismatch, and refuse a batch or a
            model that cannot show one. The report says what was compared.
        static_batch: fix the batch dimension to the per-replica batch of
            the active `tf.distribute` strategy.
        tracer: the `Tracer` saying where tracing stops; by default the one
            in use (`with tracer.tracing():`), else `DEFAULT_TRACER`.

    Example:
        ```python
        model = MyModel()
        converted = kip.convert_to_functional(model, np.zeros((8, 16)))
        converted.trainable_variables[0] is model.trainable_variables[0]
        # -> True
        print(converted.kip_report)
        ```
    """
    return Converter(training=training, verify=verify, static_batch=static_batch,
                     tracer=tracer).convert(model, data)


class Converter:
    """The one conversion routine every entry point shares."""

    def __init__(self, *, training=None, verify=True, static_batch=False, tracer=None):
        if training not in (None, True, False):
            raise ValueError(f"`training` must be None, True or False; got {training!r}.")
        self.training = training
        # Taken now: the conversion traces with it whatever is in use later.
        self.tracer = current_tracer() if tracer is None else tracer
        self.verify = verify
        self.static_batch = static_batch

    def convert(self, model, data, specs=None):
        """`specs` (a nest like `x` of `inputs.InputSpec`) overrides the input
        shapes taken from the batch: a dimension the caller knows to vary
        (None) stays unknown in the graph."""
        _check_model(model)
        batch = inputs_lib.first_batch(data)
        x = as_tensors(batch.x)
        from_batch = inputs_lib.input_specs(
            x, static_batch=self.static_batch, already_per_replica=batch.per_replica
        )
        if specs is None:
            specs = from_batch
        elif self.static_batch:
            # Given shapes keep their unknown dimensions, but a static batch
            # is the batch's own (the IPU backend needs it fixed).
            specs = keras.tree.map_structure(
                lambda spec, own: dataclasses.replace(spec, batch_size=own.batch_size),
                specs, from_batch,
            )
        with one_conversion_at_a_time():
            return self._convert(model, x, specs)

    def convert_call(self, callee, reference, inputs, symbolic_call, tensors, specs):
        """Convert one call of `callee` that takes tensors besides its inputs
        (`callee(x, mask=m)`): `callee.call`'s body traced on `symbolic_call`
        (`(args, kwargs)` over `inputs`, the graph's symbolic inputs by name,
        made from `specs`), so that every tensor of the call is a named input
        of the graph; checked against `reference` (the callee called the
        ordinary way) on `tensors`, the call's concrete tensors by name.
        Where the body cannot be traced, the graph holds `reference` whole.

        Example:
            ```python
            converted = Converter().convert_call(
                model, bound, inputs, ((inputs["x"],), {"mask": inputs["mask"]}),
                {"x": x, "mask": m}, specs)
            ```
        """
        # As `convert`: nothing of the trace and the checks (nodes,
        # counters, seed draws) stays on the user's model; a failure leaves
        # it exactly as it was.
        def convert(state):
            converted, report = self._trace_call(callee, reference, inputs, symbolic_call,
                                                 tensors, specs)
            if self.verify:
                report.add_verification(
                    callee.name, check_equivalent(reference, converted, tensors))
            converted.kip_report = report
            return converted

        with one_conversion_at_a_time():
            return guarded(callee, convert)

    def _trace_call(self, callee, reference, inputs, symbolic_call, tensors, specs):
        """`(graph model, report)` of `callee.call`'s body traced on
        `symbolic_call` (see `convert_call`)."""
        values = {name: Value(None, 0, tensor) for name, tensor in inputs.items()}
        placeholders = {id(inputs[name]): values[name] for name in inputs}
        args, kwargs = symbolic_call
        report = Report()
        try:
            nodes, outputs = self.tracer.trace(
                callee, args, kwargs, placeholders, training=None, prefix="")
            graph = Graph(specs, values, nodes, outputs, name=callee.name)
            converted = rebuild(graph, name=f"{callee.name}_functional")
            adopt_call_semantics(converted, reference)
            for node in graph.nodes:
                report.add("convert", node.name, "traced", type(node.operation).__name__)
        except TraceError as error:
            # The body cannot be traced with these arguments: the callee is
            # one node of the graph, called with them as the step calls it.
            converted = Converter(verify=False, tracer=self.tracer).convert(
                reference, (tensors,), specs=specs)
            report = converted.kip_report
            report.add_opaque(callee.name, error.reason)
        return converted, report

    def _convert(self, model, x, specs):
        # Calling, tracing and verifying build layers, record nodes on the
        # user's objects and run the model's own code (counters, seed
        # generators): a failure must leave none of it behind, a success
        # only the building (see `state.guarded`).
        def convert(state):
            start = time.perf_counter()
            graph, report = self.trace(model, x, specs, state)
            state.settle()
            converted = rebuild(graph, name=f"{model.name}_functional")
            adopt_call_semantics(converted, model)
            report.timings.append(("convert", model.name, time.perf_counter() - start))
            if self.verify:
                with report.timed("verify", model.name):
                    report.add_verification(model.name,
                                            _verify(model, converted, x, self.training))
            converted.kip_report = report
            keep_first_batch(converted, x)  # what apply_passes verifies on
            return converted

        # A Ctrl-C anywhere before the result is handed back drops the
        # converted model, so it must take its nodes off the user's layers
        # too (`guarded` undoes), however late it comes.
        return guarded(model, convert)

    def trace(self, model, x, specs, state):
        """The graph IR of `model` and the conversion report."""
        # A model never called is built by one eager call on the batch, which
        # also tells a batch the model rejects (a clear InputDataError) from
        # code that cannot be traced. An already built model is traced
        # straight away: the eager call is then needed only if tracing fails.
        outputs = None
        if not model.built:
            outputs = _call_original(model, x)
            state.mark_built()
        report = Report()
        try:
            before = VariableValues(model.non_trainable_variables)
            graph = trace_model(model, specs, training=self.training, tracer=self.tracer)
            _refuse_lost_updates(graph, before)
        except TraceError as error:
            if outputs is None:
                outputs = _call_original(model, x)
            graph = opaque_graph(
                model, specs, outputs, error.reason,
                batch_size=inputs_lib.batch_size_of(x), static_batch=self.static_batch,
                modes_differ=(error.structures if isinstance(error, ModeStructureError)
                              else None),
            )
            report.add_opaque(model.name, error.reason)
        for node in graph.nodes:
            report.add("convert", node.name, "traced", type(node.operation).__name__)
            if isinstance(node.operation, OpaqueLayer):
                # The whole model, or a dynamic sub-layer kept whole.
                whole = node.operation.layer is model
                report.add_opaque(model.name if whole else node.name, node.opaque_reason)
        return graph, report


def _refuse_lost_updates(graph, before):
    """Raise `TraceError` when tracing assigned variables no layer of
    `graph` owns (see `assigned_outside`)."""
    lost = assigned_outside(graph, before)
    if lost:
        raise TraceError(
            "`call` assigns "
            + ", ".join(f"`{v.path}`" for v in lost)
            + " itself (not through a sub-layer): a graph of layers cannot hold "
            "that update, so the model runs its own code"
        )


def assigned_outside(graph, before):
    """The variables of `before` (a `VariableValues` taken before tracing)
    that tracing changed and that no layer of `graph` owns.

    Tracing runs `call`'s Python on symbolic inputs, so an assignment of a
    value that does not depend on the inputs (`self.count.assign_add(1)`)
    runs at once, on the real variable, and leaves nothing in the graph:
    the converted model would never update it. A sub-layer that is a node
    of the graph runs its own `call` (its updates included), so only
    variables outside every node count.
    """
    changed = before.changed()
    if not changed:
        return []
    owned = {
        id(v)
        for node in graph.nodes
        if isinstance(node.operation, keras.layers.Layer)
        for v in node.operation.variables
    }
    return [v for v in changed if id(v) not in owned]


def _verify(model, converted, x, training=None):
    """`check_equivalent`, and a clearer refusal when the original model
    itself gives different outputs on the same batch. `training`: the mode
    the conversion pinned, if any (the training step is then run in it)."""
    try:
        return check_equivalent(model, converted, x,
                                step_training="fit" if training is None else training)
    except ConversionError as mismatch:
        differing = _nondeterministic_output(model, x)
        if differing is None:
            raise
        raise ConversionError(
            f"Cannot verify `{model.name}`: two runs of the original model on the "
            f"first batch in inference mode give different {differing}, even "
            "with its seed generators and counters reset between them. It draws "
            "random numbers verification cannot replay (e.g. `tf.random.normal`, "
            "or a random op seeded by TensorFlow's global seed). Draw them with "
            "a seed generator the layer holds — `self.seed_generator = "
            "keras.random.SeedGenerator(1337)` in `__init__`, then "
            "`keras.random.normal(shape, seed=self.seed_generator)` — or convert "
            "with verify=False."
        ) from mismatch


def _nondeterministic_output(model, x):
    """The first output that differs, beyond verification's tolerance,
    between two runs of `model` on `x` started from the same variable
    state; None when they agree (or when the probe itself fails: the
    mismatch then stands as it is)."""
    try:
        # TensorFlow's stateful draws are replayed as verification replays
        # them: what still differs, verification cannot make equal.
        with replay_state(model) as replay, taped_stateful_draws() as draws:
            draws.record()
            first = model(x, training=False)
            replay()
            draws.replay()
            second = model(x, training=False)
    except Exception:
        return None
    tolerance = tolerance_for(model)  # verification's own
    for (path, a), b in zip(keras.tree.flatten_with_path(first), keras.tree.flatten(second)):
        a, b = np.asarray(a), np.asarray(b)
        if is_float_array(a):
            scale = max(float(np.max(np.abs(a[np.isfinite(a)]), initial=0.0)), 1.0)
            same = a.shape == b.shape and np.allclose(
                a, b, rtol=tolerance.rtol, atol=tolerance.atol * scale, equal_nan=True)
        else:
            same = np.array_equal(a, b)
        if not same:
            return "output `" + (".".join(str(p) for p in path) or "output") + "`"
    return None


def opaque_graph(model, specs, outputs, reason, *, batch_size, static_batch,
                 modes_differ=None):
    """A graph of one `OpaqueLayer` node that runs `model`'s own code.

    A `call` returning another structure in training than in inference
    (only inference adds top-k `"predictions"`) is held with the specs of
    each mode: the node outputs the leaves of every mode and the graph's
    `output_modes` says which make each mode's structure, so the converted
    model returns what the original returns in each mode. `modes_differ`:
    how tracing found the modes' structures differ (None where it did not);
    where they cannot then be learnt, conversion refuses
    (`ConversionError`): the model could not train."""
    # Named by the model's class, not its Keras name (`sas_rec_1` the second
    # time the class is built): a path from one run's report names the node
    # in the next.
    output_specs = output_specs_of(outputs, batch_size, static_batch)
    layer = OpaqueLayer(model, output_specs, reason=reason,
                        name=f"{_compat.auto_layer_name_base(model)}_opaque")
    _build_all_branches(layer, specs)
    modes = _mode_output_specs(model, specs, output_specs, modes_differ,
                               batch_size=batch_size)
    if modes is not None:
        layer = OpaqueLayer(model, output_specs, reason=reason, mode_output_specs=modes[0],
                            none_means=modes[1], name=layer.name)
    input_values = keras.tree.map_structure(
        lambda spec: Value(None, 0, keras.KerasTensor(
            (spec.batch_size,) + spec.shape, dtype=spec.dtype, name=spec.name)),
        specs,
    )
    node = Node(layer.name, layer, (input_values,), {}, output_structure=None)
    node.opaque_reason = reason
    output_tensors = layer.compute_output_spec()
    node.outputs = [
        Value(node, i, t) for i, t in enumerate(keras.tree.flatten(output_tensors))
    ]
    outputs_nest = keras.tree.pack_sequence_as(output_tensors, node.outputs)
    graph = Graph(specs, input_values, [node], outputs_nest, name=model.name)
    if modes is not None:
        graph.output_modes = {"outputs": layer.mode_outputs(), "none_means": layer.none_means}
    return graph


def _mode_output_specs(model, specs, inference_specs, differ_reason=None, batch_size=None):
    """`({mode: output specs}, none_means)` where `model`'s `call` returns
    another structure under `training=True` (or None) than in inference
    (`inference_specs`, from the eager call); None where it returns one
    structure in every mode (or takes no `training`). Each mode is traced
    as the opaque node runs it in a function, symbolically: nothing runs.

    Where the training mode cannot be traced so, the converted model could
    not train if its structures differ: conversion refuses up front
    (`ConversionError`, with the reason) where tracing said they differ
    (`differ_reason`), or where a trace at the first batch's size
    (`batch_size`) shows they do; else the one structure stands."""
    if not takes_training(model):
        return None
    unknown_batch = any(spec.batch_size is None for spec in keras.tree.flatten(specs))

    def specs_in(training, batch=None):
        signature = keras.tree.map_structure(
            lambda spec: tf.TensorSpec((spec.batch_size or batch,) + spec.shape, spec.dtype),
            specs)
        probe = tf.function(
            lambda inputs: autograph_call(model, (inputs,), {"training": training}))
        try:
            traced = probe.get_concrete_function(signature).structured_outputs
        except Exception as error:  # noqa: BLE001 - said below, or the one structure kept
            raise _NoModeSpecs() from error
        return output_specs_of(traced, None, True)

    def refuse(reason, training, error):
        remedies = ("return the same structure in every mode (the loss reading the keys it "
                    "needs), or train the model with plain Keras")
        if unknown_batch:
            remedies = ("convert with static_batch=True (the batch size fixed to the first "
                        f"batch's), {remedies}")
        return ConversionError(
            f"Cannot convert `{model.name}`: {reason}; but its `call` under "
            f"training={training} fails when traced in a function"
            f"{' with the batch size unknown' if unknown_batch else ''} "
            f"({_last_line(error)}), so the structure it "
            "returns in that mode is unknown and the converted model could not train: "
            f"{remedies}.")

    def structure(nest):
        return keras.tree.map_structure(lambda leaf: "tensor", nest)

    held = structure(keras.tree.map_structure(lambda t: 0, inference_specs))
    try:
        in_training = specs_in(True)
    except _NoModeSpecs as unknown:
        error = unknown.__cause__
        if differ_reason is not None:
            raise refuse(differ_reason, True, error) from error
        if not unknown_batch or batch_size is None:
            return None
        try:  # the structure, at least, the first batch's size may tell
            at_first = specs_in(True, batch_size)
        except _NoModeSpecs:
            return None
        if structure(at_first) == held:
            return None
        raise refuse(
            f"its `call` returns another structure in training ({structure(at_first)}) "
            f"than in inference ({held})", True, error) from error
    if structure(in_training) == held:
        return None
    modes = {"training": in_training, "inference": inference_specs}
    default = default_training(model)
    if default is not None:
        return modes, "training" if default else "inference"
    try:
        in_none = specs_in(None)
    except _NoModeSpecs as unknown:
        error = unknown.__cause__
        raise refuse(differ_reason or (
            f"its `call` returns another structure in training ({structure(in_training)}) "
            f"than in inference ({held})"), None, error) from error
    for mode in ("inference", "training"):
        if structure(in_none) == structure(modes[mode]):
            return modes, mode
    modes["default"] = in_none
    return modes, "default"


def _last_line(error):
    """`Type: message` of an error raised tracing a function: TensorFlow
    lists the frames of user code first, Keras its banner and arguments
    around the message; the message alone is what says what failed."""
    lines = [line.strip() for line in str(error).split("Arguments received by")[0].splitlines()
             if line.strip()]
    frames = [i for i, line in enumerate(lines) if line.startswith("File ")]
    tail = [line for line in (lines[frames[-1] + 2:] if frames else lines)
            if "Exception encountered when calling" not in line]
    # (a ValueError only to carry the text: the words are the error's own)
    message = essential_message(ValueError(" ".join(tail)) if tail else error, limit=280)
    return f"{type(error).__name__}: {message}"


class _NoModeSpecs(Exception):
    """A mode of an opaque model cannot be traced in a function."""


def _build_all_branches(layer, specs):
    """Trace the opaque call once in graph mode, so that sub-layers used only
    in branches not taken by the first batch create their variables now,
    before an optimizer is built for the model, instead of mid-training."""
    signature = keras.tree.map_structure(
        lambda spec: tf.TensorSpec((None,) + spec.shape, spec.dtype), specs
    )
    probe = tf.function(lambda inputs: layer(inputs, training=False))
    probe.get_concrete_function(signature)


def _check_model(model):
    if not isinstance(model, keras.Model):
        raise InputTypeError(
            f"Expected a keras.Model to convert; got {type(model).__name__}. "
            "Wrap a single layer in a keras.Model subclass first."
        )


def as_tensors(x):
    inputs_lib.check_dense(x)

    def convert(leaf):
        if isinstance(leaf, np.ndarray) and leaf.dtype == np.float64:
            leaf = leaf.astype(keras.config.floatx())
        return tf.convert_to_tensor(leaf)

    return keras.tree.map_structure(convert, x)


def _call_original(model, x):
    """Build a model never called by calling it as `fit` first calls it:
    a sub-model built lazily in that call (a `Sequential` without an
    `Input`, such as an augmentation kept at module level) records the
    `training` of the call it is built in and keeps it, so a build under
    another mode would change what the model computes ever after. For a
    `call` that takes `training`, inference (`fit`'s `training=True` would
    draw and move statistics; the eager call is a build, not a step); for
    one that takes none, `model(x)`, as `fit` calls it. Whatever the call
    writes (a draw from a layer the model does not own) is put back."""
    call = ((lambda x: model(x, training=False)) if takes_training(model)
            else (lambda x: model(x)))
    try:
        with UndoneWrites():
            return call(x)
    except Exception as error:
        if not getattr(model, "run_eagerly", False):
            # A model that runs in graph mode only (an op with no eager
            # kernel) trains with plain `fit`, which builds and runs it in a
            # function: build it so too (verification then runs so as well).
            try:
                return tf.function(call)(x)
            except Exception:
                pass  # fails as a function too: the eager error is the one to see
        raise InputDataError(
            f"`{model.name}.call` rejected the first batch "
            f"({_describe_structure(x)}): {type(error).__name__}: "
            f"{essential_message(error)}"
        ) from error


def _describe_structure(x):
    if isinstance(x, dict):
        return "a dict with keys " + ", ".join(repr(k) for k in x)
    if isinstance(x, (list, tuple)):
        return f"a {type(x).__name__} of {len(x)} tensors"
    return f"one tensor of shape {tuple(x.shape)}"


# Re-entrant: a rebuild converts and then applies passes, each taking it.
_CONVERSION_LOCK = threading.RLock()


def one_conversion_at_a_time():
    """The lock every conversion, rebuild and `apply_passes` holds while it
    traces, rebuilds or verifies a user's model.

    Example:
        ```python
        with one_conversion_at_a_time():
            graph = trace_model(model, specs)
        ```
    """
    return _CONVERSION_LOCK
