"""`apply_passes`: run passes over a functional model's graph."""

import keras

from keras_ipu_plugin.backends import get_backend
from keras_ipu_plugin.errors import PassError
from keras_ipu_plugin.executor import train_graph_ops
from keras_ipu_plugin.functional import KipFunctional
from keras_ipu_plugin.inputs import InputSpec
from keras_ipu_plugin.opaque import OpaqueLayer
from keras_ipu_plugin.passes.base import Pass
from keras_ipu_plugin.report import Report
from keras_ipu_plugin.tracing import TraceError
from keras_ipu_plugin.tracing import trace_model


def apply_passes(model, passes):
    """Return a new functional model: `model`'s graph after `passes`.

    Layers that no pass replaces are the same objects as in `model` (their
    variables are shared). The result's `kip_report` holds the conversion
    report of `model` (if any) followed by what each pass did.

    Example:
        >>> converted = kip.convert_to_functional(MyModel(), x)
        >>> passed = kip.apply_passes(converted, [kip.passes.Expand()])
        >>> print(passed.kip_report)
    """
    passes = validate_passes(passes)
    graph = graph_of(model)
    report = (getattr(model, "kip_report", None) or Report()).copy()
    for one_pass in passes:
        graph = one_pass.run(graph, report)
    result = graph.rebuild(name=model.name)
    if isinstance(model, KipFunctional):
        result.kip_original_mask = model.kip_original_mask
    stage_devices = getattr(model, "kip_stage_devices", None)
    if stage_devices and not result.kip_stage_devices:
        result.kip_stage_devices = list(stage_devices)
    result.kip_report = report
    if result.kip_stages:
        get_backend().assign_stages(result, result.kip_stages)
    if any("outline" in node.annotations for node in graph.nodes):
        _report_outlined_graph_size(graph, result, report)
    return result


def _report_outlined_graph_size(graph, outlined, report):
    """Put the op count of the training step with and without outlining in
    the report (portable outlining's effect is a smaller traced graph)."""
    plain = graph.copy()
    for node in plain.nodes:
        node.annotations.pop("outline", None)
    report.metrics["train graph ops without outlining"] = train_graph_ops(plain.rebuild())
    report.metrics["train graph ops with outlining"] = train_graph_ops(outlined)


def validate_passes(passes):
    """A list of Pass objects from passes or a config (dict or path)."""
    from keras_ipu_plugin.config import passes_from_config

    if isinstance(passes, (dict, str)) or hasattr(passes, "__fspath__"):
        return passes_from_config(passes)
    if isinstance(passes, Pass):
        return [passes]
    if not isinstance(passes, (list, tuple)):
        raise PassError(
            "`passes` must be a list of kip.passes objects, a config dict or a "
            f"config file path; got {type(passes).__name__}."
        )
    for index, item in enumerate(passes):
        if not isinstance(item, Pass):
            raise PassError(
                f"passes[{index}] is a {type(item).__name__}, not a kip pass "
                "(kip.passes.Expand, Replace, Outline, Recompute, PipelineStages)."
            )
    return list(passes)


def graph_of(model):
    """The graph IR of a functional model, with its recorded annotations."""
    functional = isinstance(model, keras.Model) and hasattr(model, "_nodes_by_depth")
    sequential = isinstance(model, keras.Sequential)
    if not (functional or sequential):
        raise PassError(
            f"apply_passes needs a functional model; `{getattr(model, 'name', model)}` "
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
            f"apply_passes: the sequential model `{model.name}` has no defined "
            "input yet; build it with keras.Input first, or convert it: "
            "kip.convert_to_functional(model, data)."
        ) from error
    specs = keras.tree.map_structure(_spec_of_input, model_inputs)
    try:
        graph = trace_model(_plain_view(model), specs)
    except TraceError as error:  # pragma: no cover - functional models trace
        raise PassError(f"Cannot read the graph of `{model.name}`: {error.reason}")
    annotations = getattr(model, "kip_annotations", {})
    for node in graph.nodes:
        node.annotations.update(annotations.get(getattr(node.operation, "name", None), {}))
        if isinstance(node.operation, OpaqueLayer):
            node.opaque_reason = node.operation.reason
    return graph


def _plain_view(model):
    """A model over `model`'s graph that runs its layers one by one.

    A `KipFunctional` with annotations runs through the backend executor
    (outlined bodies, recompute segments), which is for real tensors; the
    graph is read through a view without annotations that shares the same
    layers and keeps the pinned `training` values.
    """
    if not isinstance(model, KipFunctional):
        return model
    return KipFunctional(
        model.input, model.output, name=model.name,
        kip_pinned_training=model.kip_pinned_training,
    )


def _spec_of_input(tensor):
    return InputSpec(
        name=tensor.name,
        shape=tuple(tensor.shape[1:]),
        dtype=tensor.dtype,
        batch_size=tensor.shape[0],
    )
