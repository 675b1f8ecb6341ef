"""`Outline`, `Recompute`, `PipelineStages`: annotations on graph nodes.

These passes record what should happen to matched layers; the backend turns
the annotations into effect when the model runs (see `backends.py`). They are
stored on the rebuilt model (`kip_annotations`), so they survive `rebuild()`
and saving.
"""

from keras_ipu_plugin.errors import PassError
from keras_ipu_plugin.passes.base import Pass
from keras_ipu_plugin.passes.base import as_targets
from keras_ipu_plugin.passes.base import describe
from keras_ipu_plugin.passes.base import matched_nodes
from keras_ipu_plugin.passes.base import matches


class Outline(Pass):
    """Share one compiled body between repeated layers.

    `outline_kwargs` go to the IPU's `outlined_function` where there is one.

    Example:
        >>> kip.passes.Outline(TransformerBlock)
    """

    step = "outline"

    def __init__(self, targets, **outline_kwargs):
        self.targets = as_targets(targets)
        self.outline_kwargs = dict(outline_kwargs)

    def run(self, graph, report):
        from keras_ipu_plugin.executor import outline_config

        for node in matched_nodes(graph, self.targets, self.step):
            node.annotations["outline"] = dict(self.outline_kwargs)
            _, error = outline_config(node.operation)
            if error is None:
                report.add(self.step, node.name, "outlined", _kwargs_text(self.outline_kwargs))
            else:
                report.add(self.step, node.name, "outlined alone", (
                    f"its get_config fails ({type(error).__name__}: {error}), so "
                    "nothing shows it equal to another layer: it shares no body"
                ))
        return graph


class Recompute(Pass):
    """Put a recomputation checkpoint after each matched layer.

    Activations between two checkpoints are recomputed in the backward pass
    instead of being kept, trading compute for memory.

    Example:
        >>> kip.passes.Recompute(["block_1", "block_2"])
    """

    step = "recompute"

    def __init__(self, targets):
        self.targets = as_targets(targets)

    def run(self, graph, report):
        for node in matched_nodes(graph, self.targets, self.step):
            node.annotations["recompute"] = True
            report.add(self.step, node.name, "checkpoint after")
        return graph


class PipelineStages(Pass):
    """Assign pipeline stages: `stages[i]` lists the targets of stage i.

    Layers not listed take the stage of their latest input, so every layer
    gets a stage; a layer may not feed a layer of an earlier stage.

    Example:
        >>> kip.passes.PipelineStages([["encoder"], ["decoder", "head"]])
    """

    step = "pipeline_stages"

    def __init__(self, stages):
        if not isinstance(stages, (list, tuple)) or not stages:
            raise PassError("PipelineStages takes a non-empty list of lists of targets.")
        self.stages = tuple(as_targets(stage) for stage in stages)

    def run(self, graph, report):
        assigned = {}
        for index, targets in enumerate(self.stages):
            for node in matched_nodes(graph, targets, self.step):
                if id(node) in assigned and assigned[id(node)] != index:
                    raise PassError(
                        f"pipeline_stages: layer `{node.name}` is listed in "
                        f"stages {assigned[id(node)]} and {index}."
                    )
                assigned[id(node)] = index
        for node in graph.nodes:
            producers = [v.producer for v in node.input_values if v.producer]
            latest = max(producers, key=lambda p: assigned[id(p)], default=None)
            inputs_stage = assigned[id(latest)] if latest is not None else 0
            stage = assigned.get(id(node), inputs_stage)
            if stage < inputs_stage:
                raise PassError(
                    f"pipeline_stages: layer `{node.name}` is in stage {stage} "
                    f"but reads the output of `{latest.name}`, in stage "
                    f"{inputs_stage}; stages must follow the data flow."
                )
            assigned[id(node)] = stage
            node.annotations["stage"] = stage
            report.add(self.step, node.name, f"stage {stage}")
        return graph


def _kwargs_text(kwargs):
    return ", ".join(f"{k}={v!r}" for k, v in sorted(kwargs.items()))


__all__ = ["Outline", "Recompute", "PipelineStages", "describe", "matches"]
