"""`apply_passes`: run passes over a functional model's graph.

With the environment variable `KIP_LINT_GRAPHS=1` (the test suite sets it)
every graph is checked with `Graph.lint()` before the passes and after each
one, so a pass that leaves a malformed graph fails at that pass, naming it.
"""

import os

import keras
import tensorflow as tf

from keras_ipu_plugin import _compat
from keras_ipu_plugin.runtime.backends import get_backend
from keras_ipu_plugin.frontend.convert import one_conversion_at_a_time
from keras_ipu_plugin.errors import ConversionError
from keras_ipu_plugin.errors import InputDataError
from keras_ipu_plugin.errors import PassError
from keras_ipu_plugin.runtime.variables import strategy_owning
from keras_ipu_plugin.runtime.functional import KipFunctional
from keras_ipu_plugin.runtime.functional import adopt_call_semantics
from keras_ipu_plugin.runtime.interpreter import graph_of as run_graph_of
from keras_ipu_plugin.ir.graph import InputSpec
from keras_ipu_plugin.layers.opaque import OpaqueLayer
from keras_ipu_plugin.passes.infra.base import EQUAL
from keras_ipu_plugin.passes.infra.base import Pass
from keras_ipu_plugin.passes.infra.base import registered_passes
from keras_ipu_plugin.planning.node_costs import first_batch_rows
from keras_ipu_plugin.report import Report
from keras_ipu_plugin.frontend.state import guarded
from keras_ipu_plugin.frontend.trace.tracer import TraceError
from keras_ipu_plugin.frontend.trace.failures import failing_layer as _failing_layer
from keras_ipu_plugin.frontend.trace.tracer import essential_message
from keras_ipu_plugin.frontend.trace.tracer import current_tracer
from keras_ipu_plugin.frontend.trace.tracer import trace_model
from keras_ipu_plugin.frontend.verify.equivalence import check_equivalent
from keras_ipu_plugin.frontend.verify.equivalence import check_runs
from keras_ipu_plugin.frontend.verify.equivalence import keep_first_batch
from keras_ipu_plugin.frontend.verify.equivalence import synthetic_batch
from keras_ipu_plugin.runtime.rebuild import rebuild


def apply_passes(model, passes, *, verify=True, reuse_replacements=(), tracer=None):
    """Return a new functional model: `model`'s graph after `passes`.

    Layers that no pass replaces are the same objects as in `model` (their
    variables are shared). The result's `kip_report` holds the conversion
    report of `model` (if any) followed by what each pass did and what
    verification compared.

    Verification (`verify=True`) checks the result against `model` on the
    first batch that `convert_to_functional` kept (`model.kip_first_batch`;
    the result keeps it too), the way conversion is checked
    (`verify.check_equivalent`), as far as the passes claim equivalence:

    - Expand, Outline, Recompute, PipelineStages, and Replace with copied
      weights and unchanged parameters claim the same model: the outputs
      are compared, and the gradients of every variable the result keeps
      (the replaced layers' variables are no longer in it).
    - Replace without copied weights, or with `params` other than `name`,
      changes what the model computes on purpose: only that the result
      runs on the batch is checked. (A pass class of your own says which it
      is with `claim = kip.passes.EQUAL` or `kip.passes.RUNS`.)
    - A model without a kept batch (a functional model of your own, or a
      loaded one) is checked on a small synthetic batch built from its
      input specs: floats random normal, integers zeros, booleans False.
      That is weaker evidence (zeros reach one embedding row), and where it
      cannot be built (a string input) or the model itself rejects it, the
      report says that the passes were not verified, and why.

    A result that differs or fails when called raises `kip.PassError`
    naming the first pass whose result fails and what differs (the output
    or variable, or the layer that raised). `verify=False` skips all this.

    `reuse_replacements`: `(old layer, new layer)` pairs an earlier run of
    the same passes made (its result's `kip_replaced`); Replace puts those
    new layers in again instead of making others (a model converted again,
    for a new input shape or new variables, keeps training the same
    replacement layers). Verification compares them with the old layers
    as they are: the caller copies trained weights back first.

    `tracer`: the `Tracer` saying where tracing stops (Expand's reach, the
    traces the passes make), handed to each pass with the graph it edits
    (`graph.tracer`); by default the one in use (`with tracer.tracing():`),
    else `DEFAULT_TRACER`.

    Example:
        ```python
        converted = kip.convert_to_functional(MyModel(), x)
        passed = kip.apply_passes(converted, [kip.passes.Expand()])
        print(passed.kip_report)   # ends with a "verify" row
        ```
    """
    passes = validate_passes(passes)
    tracer = current_tracer() if tracer is None else tracer
    with one_conversion_at_a_time():
        # Passes trace the user's layers (running their Python) and record
        # nodes on them: a failure leaves nothing behind, a success only
        # what building leaves (see `state.guarded`).
        return guarded(
            model, lambda state: _apply_passes(model, passes, verify, reuse_replacements, tracer))


def _apply_passes(model, passes, verify, reuse_replacements, tracer):
    graph = graph_of(model, tracer)
    graph.reusable = {id(old): new for old, new in reuse_replacements}
    input_specs = graph.input_specs
    report = (getattr(model, "kip_report", None) or Report()).copy()
    _lint(graph, "before the passes")
    for one_pass in passes:
        with report.timed(one_pass.step, model.name):
            graph = _run_pass(one_pass, graph, report, tracer)
        _lint(graph, f"after pass {type(one_pass).__name__}")
        _check_stage_order(graph, f"after pass {type(one_pass).__name__}")
    result = _rebuilt(graph, model, passes)
    if isinstance(model, KipFunctional):
        adopt_call_semantics(result, model)
    result.kip_report = report
    first_batch = getattr(model, "kip_first_batch", None)
    if verify:
        with report.timed("verify", result.name):
            _verify_passed(model, result, passes, report, first_batch, input_specs,
                           graph.reusable, tracer)
    else:
        report.add("verify", model.name, "not verified", "apply_passes(verify=False)")
    if first_batch is not None:
        keep_first_batch(result, first_batch)
    if any("outline" in node.annotations for node in graph.nodes):
        _report_outlined_graph_size(graph, result, report)
    return result


def _lint(graph, when):
    """`graph.lint()` where `KIP_LINT_GRAPHS` asks for it (it is linear in
    the graph, but a conversion should not pay for it), as a `PassError`
    saying which pass left the graph malformed."""
    if os.environ.get("KIP_LINT_GRAPHS", "") in ("", "0"):
        return
    try:
        graph.lint()
    except ValueError as error:
        raise PassError(f"apply_passes: {when}: {error}") from error


def _check_stage_order(graph, when):
    """A `PassError` naming the first layer that sits in an earlier pipeline
    stage than a layer it reads: a pass run after `PipelineStages` must keep
    the stages following the data flow, else the pipelined step could not
    run them in order (and would fail at the first batch, far from the
    pass at fault). Graphs without stages pass unchecked."""
    staged = {id(node): node.annotations["stage"] for node in graph.nodes
              if "stage" in node.annotations}
    if not staged:
        return
    for node in graph.nodes:
        stage = staged.get(id(node), 0)
        for value in node.input_values:
            producer = value.producer
            if producer is not None and staged.get(id(producer), 0) > stage:
                raise PassError(
                    f"apply_passes: {when}: layer `{node.name}` is in pipeline stage "
                    f"{stage} but reads the output of `{producer.name}`, in stage "
                    f"{staged.get(id(producer), 0)}: stages must follow the data flow "
                    "(a pass after PipelineStages moved a layer out of its stage; run "
                    "it before PipelineStages).")


def _run_pass(one_pass, graph, report, tracer):
    """`one_pass` run on `graph`, which carries `tracer` to it (a pass of
    one's own may return a graph it made: it gets the tracer too)."""
    graph.tracer = tracer
    graph = one_pass.run(graph, report)
    graph.tracer = tracer
    return graph


def _rebuilt(graph, model, passes):
    try:
        result = rebuild(graph, name=model.name)
    except Exception as error:
        if type(error).__module__.startswith("keras_ipu_plugin"):
            raise
        where = _failing_layer(error)
        raise PassError(
            f"apply_passes: the graph after {_names(passes)} cannot be rebuilt into a "
            f"model{f' (at layer `{where}`)' if where else ''}: "
            f"{type(error).__name__}: {essential_message(error)}"
        ) from error
    stage_devices = getattr(model, "kip_stage_devices", None)
    if stage_devices and not result.kip_stage_devices:
        result.kip_stage_devices = list(stage_devices)
    if result.kip_layer_stages:
        get_backend().assign_stages(result, result.kip_layer_stages)
    return result


def _verify_passed(model, result, passes, report, first_batch, input_specs, reusable, tracer):
    """Check `result` as far as `passes` claim; raise `PassError` on failure."""
    x, synthetic = first_batch, first_batch is None
    if synthetic:
        x, reason = synthetic_batch(input_specs)
        if x is None:
            report.add("verify", model.name, "not verified", reason)
            return
    try:
        verification = _check(model, result, passes, x, synthetic)
    except InputDataError as error:
        if synthetic:
            report.add("verify", model.name, "not verified",
                       f"on a synthetic batch: {error}")
            return
        raise PassError(
            f"apply_passes cannot verify {_names(passes)} on the first batch kept "
            f"with `{model.name}`: {error}"
        ) from error
    except ConversionError as error:
        culprit = (_first_failing_pass(model, passes, x, synthetic, reusable, tracer)
                   if len(passes) > 1 else 0)
        which = ("the passes " + _names(passes) if culprit is None
                 else f"pass {_names([passes[culprit]])}")
        raise PassError(f"apply_passes: after {which}: {error}") from error
    where = "on a synthetic batch (no first batch kept)" if synthetic else None
    if isinstance(verification, str):
        report.add("verify", model.name, "runs", "; ".join(filter(None, [verification, where])))
    else:
        verification.notes.extend(filter(None, [where]))
        report.add_verification(model.name, verification)


def _check(model, result, passes, x, synthetic):
    """`check_equivalent` where every pass claims EQUAL, else `check_runs`:
    a `Verification`, or a note on what was checked."""
    if all(p.claim == EQUAL for p in passes):
        # Only Replace may drop variables: any other variable the input's
        # outputs depend on must still get its gradient in the result (a
        # variable frozen into a constant would get none, and never train).
        replaced = {id(v) for old, _ in result.kip_replaced for v in old.trainable_variables}
        kept = [v for v in model.trainable_variables if id(v) not in replaced]
        verification = check_equivalent(model, result, x, what="passed", variables=kept)
        dropped = len(model.trainable_variables) - len(kept)
        if dropped:
            verification.notes.append(
                f"{dropped} variable(s) of replaced layers not compared")
        return verification
    if synthetic:
        # The made-up batch must be one the model takes before a failure of
        # the result can be blamed on the passes.
        check_runs(model, x, what="original")
    check_runs(result, x, what="passed")
    changing = [type(p).__name__ for p in passes if p.claim != EQUAL]
    return (f"outputs not compared: {', '.join(changing)} changes what the model "
            "computes (new weights or parameters)")


def _first_failing_pass(model, passes, x, synthetic, reusable, tracer):
    """The index of the first pass after which verification fails (the
    passes run again on a fresh graph, one more each time), or None when
    running them again fails otherwise."""
    graph = graph_of(model, tracer)
    graph.reusable = dict(reusable)
    for index, one_pass in enumerate(passes[:-1]):
        try:
            graph = _run_pass(one_pass, graph, Report(), tracer)
            _check(model, _rebuilt(graph.copy(), model, passes[: index + 1]),
                   passes[: index + 1], x, synthetic)
        except (ConversionError, InputDataError):
            return index
        except Exception:  # noqa: BLE001 - attribution is best effort
            return None
    return len(passes) - 1


def _names(passes):
    return ", ".join(type(p).__name__ for p in passes)


def _report_outlined_graph_size(graph, outlined, report):
    """Put the op count of the training step with and without outlining in
    the report (portable outlining's effect is a smaller traced graph)."""
    plain = graph.copy()
    for node in plain.nodes:
        node.annotations.pop("outline", None)
    report.metrics["train graph ops without outlining"] = train_graph_ops(rebuild(plain))
    report.metrics["train graph ops with outlining"] = train_graph_ops(outlined)


def train_graph_ops(model):
    """Number of ops in a traced training step of `model` (forward pass in
    training mode and the gradients of its outputs): what outlining shrinks.

    Example:
        ```python
        train_graph_ops(passed)
        # -> 144
        ```
    """
    specs = keras.tree.map_structure(
        lambda tensor: tf.TensorSpec(tensor.shape, tensor.dtype), model.input
    )

    strategy = strategy_owning(model.trainable_variables)

    def one_replica(inputs):
        # Under a scope of its own, as Keras's `fit` calls the model: a
        # model's root scope may not start with `_` (a class `_Net`).
        with tf.GradientTape() as tape, tf.name_scope("train_step"):
            outputs = model(inputs, training=True)
            loss = tf.add_n([
                tf.reduce_sum(tf.cast(output, "float32"))
                for output in keras.tree.flatten(outputs)
                if output.dtype.is_floating
            ])
        return tape.gradient(loss, model.trainable_variables)

    @tf.function(autograph=False)
    def step(inputs):
        # Mirrored variables can only be read inside a replica.
        return strategy.run(one_replica, args=(inputs,))

    return len(step.get_concrete_function(specs).graph.get_operations())


def validate_passes(passes):
    """A list of Pass objects from passes or a config (dict, list of
    one-pass dicts, or path). One pass object is the list of it, as Keras's
    `fit` takes one callback for the list of it: every entry point
    (`apply_passes`, `PluginModel`, `PluginCallback`, `kip.scope`) reads
    its `passes` here.

    Example:
        ```python
        validate_passes(kip.passes.Expand("all"))   # [Expand("all")]
        ```
    """
    from keras_ipu_plugin.passes.infra.config import passes_from_config

    if isinstance(passes, (dict, str)) or hasattr(passes, "__fspath__"):
        return passes_from_config(passes)
    if isinstance(passes, list) and passes and all(isinstance(item, dict) for item in passes):
        return passes_from_config(passes)
    if isinstance(passes, Pass):
        return [passes]
    if not isinstance(passes, (list, tuple)):
        raise PassError(
            "`passes` must be a kip pass, a list of them, a config dict or a "
            f"config file path; got {_not_a_pass(passes)}."
        )
    for index, item in enumerate(passes):
        if not isinstance(item, Pass):
            known = ", ".join(cls.__name__ for cls in registered_passes().values())
            raise PassError(
                f"passes[{index}] is {_not_a_pass(item)}, not a kip pass "
                f"(kip.passes: {known}; or a config of them)."
            )
    return list(passes)


def _not_a_pass(value):
    """What `value` is, in an error about `passes`: a pass class is told to
    be made (`Expand` given for `Expand()`)."""
    if isinstance(value, type) and issubclass(value, Pass):
        return (f"the class {value.__name__} itself: make the pass, "
                f"{value.__name__}(...)")
    return f"a {type(value).__name__}"


def graph_of(model, tracer=None):
    """The graph IR of a functional model, with its recorded annotations
    and the first batch's per-replica rows (what planning passes plan for).
    `tracer`: the `Tracer` the passes trace more of it with (`graph.tracer`),
    and that reads a functional model without a graph."""
    graph = graph_of_model(model, "apply_passes", tracer)
    graph.tracer = tracer
    graph.batch_rows = first_batch_rows(model, graph.input_specs)
    return graph


def graph_of_model(model, caller, tracer=None):
    """A graph of the functional `model` to edit (its own, copied, for a
    converted or passed model; read from its layers otherwise, traced with
    `tracer`, the one in use by default). `caller` names the function in
    errors."""
    functional = isinstance(model, keras.Model) and _compat.is_graph_model(model)
    sequential = isinstance(model, keras.Sequential)
    if not (functional or sequential):
        raise PassError(
            f"{caller} needs a functional model; `{getattr(model, 'name', model)}` "
            "is not one. Convert it first: kip.convert_to_functional(model, data)."
        )
    if getattr(model, "kip_graph", None) is not None:
        return model.kip_graph.copy()
    try:
        # A Sequential model has one input; `.input` fails on one built from
        # a keras.Input but never called, `.inputs` does not.
        model_inputs = model.inputs[0] if sequential else model.input
    except (AttributeError, ValueError, TypeError, IndexError) as error:
        raise PassError(
            f"{caller}: the sequential model `{model.name}` has no defined "
            "input yet; build it with keras.Input first, or convert it: "
            "kip.convert_to_functional(model, data)."
        ) from error
    specs = keras.tree.map_structure(_spec_of_input, model_inputs)
    try:
        graph = trace_model(_plain_view(model), specs, tracer=tracer)
    except TraceError as error:  # pragma: no cover - functional models trace
        raise PassError(f"Cannot read the graph of `{model.name}`: {error.reason}")
    for node in graph.nodes:
        if isinstance(node.operation, OpaqueLayer):
            node.opaque_reason = node.operation.reason
    if isinstance(model, KipFunctional):
        _restore_paths(graph, model.kip_layer_paths)
        # Each call site's annotations, by node path, as the model runs them
        # (by Keras name where the trace named a node otherwise).
        by_path = {node.name: node.annotations for node in run_graph_of(model).nodes}
        by_name = model.kip_annotations
        for node in graph.nodes:
            notes = (by_path[node.name] if node.name in by_path
                     else by_name.get(getattr(node.operation, "name", None), {}))
            node.annotations.update(notes)
    # Read as a plain functional model: the outputs of every mode, flat.
    graph.output_modes = getattr(model, "kip_output_modes", None)
    return graph


def _restore_paths(graph, paths):
    """Name a loaded model's nodes by their paths again (`block_1.dense`
    for the layer `dense`): its graph is read from its Keras layers, and
    `paths` (`kip_layer_paths`) says which path each layer call had. A layer
    called at several paths takes them in call order, where the counts agree."""
    by_layer = {}
    for path, name in paths.items():
        by_layer.setdefault(name, []).append(path)
    calls = {}
    for node in graph.nodes:
        if node.is_layer:
            calls.setdefault(node.operation.name, []).append(node)
    renamed = {}
    for name, nodes in calls.items():
        if len(by_layer.get(name, ())) == len(nodes):
            renamed.update(zip(nodes, by_layer[name]))
    graph.rename_nodes(renamed)


def _plain_view(model):
    """A model over `model`'s graph that runs its layers one by one.

    A `KipFunctional` runs its graph through the interpreter with the
    run-time effects of its annotations (outlined bodies, recompute
    segments), which are for real tensors; the graph is read through a view
    without annotations that shares the same layers and keeps the pinned
    `training` values.
    """
    if not isinstance(model, KipFunctional):
        return model
    return KipFunctional(
        model.input, model.output, name=model.name,
        kip_pinned_training=model.kip_pinned_training,
        kip_node_training=model.kip_node_training,
        kip_layer_paths=model.kip_layer_paths,
    )


def _spec_of_input(tensor):
    return InputSpec(
        name=tensor.name,
        shape=tuple(tensor.shape[1:]),
        dtype=tensor.dtype,
        batch_size=tensor.shape[0],
    )
