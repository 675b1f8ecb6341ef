"""`Outline`, `Recompute`, `PipelineStages`: annotations on graph nodes.

These passes record what should happen to matched layers; the backend turns
the annotations into effect when the model runs (see `backends.py`). They are
stored on the rebuilt model (`kip_annotations`), so they survive `rebuild()`
and saving.

A target inside a custom layer is reached by expanding that layer (the
report says so), so a class target matches its blocks wherever they sit. A
target naming a block that Expand already inlined (its path, its name or its
class) stands for that block's nodes: `Recompute` checkpoints after the
block's last node, `Outline` outlines each of its layers, `PipelineStages`
puts all of them in the stage.
"""

from keras_ipu_plugin.errors import ConfigError
from keras_ipu_plugin.errors import PassError
from keras_ipu_plugin.errors import config_path
from keras_ipu_plugin.errors import short_repr
from keras_ipu_plugin.runtime.ipu_backend import check_outline_kwargs
from keras_ipu_plugin.passes.base import Pass
from keras_ipu_plugin.passes.base import as_targets
from keras_ipu_plugin.passes.base import config_value
from keras_ipu_plugin.passes.base import describe
from keras_ipu_plugin.passes.base import matched_nodes_and_blocks
from keras_ipu_plugin.passes.base import matches
from keras_ipu_plugin.passes.base import register_pass
from keras_ipu_plugin.passes.base import saved_config
from keras_ipu_plugin.passes.base import targets_config
from keras_ipu_plugin.passes.base import targets_from_config
from keras_ipu_plugin.passes.expand import expand_to_reach


@register_pass("outline", order=2)
class Outline(Pass):
    """Share one compiled body between repeated layers.

    `outline_kwargs` go to the IPU's `outlined_function` where there is one;
    only its own arguments are accepted (`unique_sharding`,
    `keep_input_layouts`, `name`), on every backend, so a config that would
    fail on the IPU fails everywhere.

    Example:
        >>> kip.passes.Outline(TransformerBlock)
    """

    step = "outline"

    def __init__(self, targets, **outline_kwargs):
        self.targets = as_targets(targets)
        self.outline_kwargs = check_outline_kwargs(outline_kwargs)

    # -- configs and saving ------------------------------------------------------
    def get_config(self):
        return {
            "targets": targets_config(self.targets, "Outline"),
            "outline_kwargs": config_value(self.outline_kwargs, "Outline.outline_kwargs"),
        }

    @classmethod
    def from_config(cls, config):
        config = saved_config(config, "Outline", required=("targets",),
                              optional=("outline_kwargs",))
        return cls(targets_from_config(config["targets"], "Outline"),
                   **_keyword_arguments(config.get("outline_kwargs", {}), "Outline"))

    @classmethod
    def from_user_config(cls, value, path, reader):
        """`outline: [Block]`, or `outline: {targets: [Block], kwargs: {...}}`."""
        if not isinstance(value, dict):
            return cls(reader.targets(value, path))
        for key in value:
            if key not in ("targets", "kwargs"):
                raise ConfigError(config_path(path, key), "unknown key (expected targets, kwargs)")
        kwargs = value.get("kwargs", {}) or {}
        if not isinstance(kwargs, dict):
            raise ConfigError(f"{path}.kwargs", f"expected a mapping; got {type(kwargs).__name__}")
        for key in kwargs:
            if not isinstance(key, str) or not key.isidentifier() or key == "targets":
                raise ConfigError(
                    config_path(f"{path}.kwargs", key), "expected a keyword argument name"
                )
        return cls(reader.targets(value.get("targets"), f"{path}.targets"), **kwargs)

    def run(self, graph, report):
        nodes, blocks = _find(graph, self.targets, report, self.step)
        detail = _kwargs_text(self.outline_kwargs)
        for node in nodes:
            node.annotations["outline"] = dict(self.outline_kwargs)
            report.add(self.step, node.name, *_outline_entry(node, detail))
        for block, block_nodes in blocks:
            # The block is gone; its layers share bodies with the layers of
            # equal config in the other blocks.
            for node in block_nodes:
                if node.is_layer and "outline" not in node.annotations:
                    node.annotations["outline"] = dict(self.outline_kwargs)
                    action, entry = _outline_entry(node, detail)
                    report.add(self.step, node.name, action,
                               _joined(f"layer of expanded `{block.path}`", entry))
        return graph


@register_pass("recompute", order=3)
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

    # -- configs and saving ------------------------------------------------------
    def get_config(self):
        return {"targets": targets_config(self.targets, "Recompute")}

    @classmethod
    def from_config(cls, config):
        config = saved_config(config, "Recompute", required=("targets",))
        return cls(targets_from_config(config["targets"], "Recompute"))

    @classmethod
    def from_user_config(cls, value, path, reader):
        """`recompute: [block_1, block_2]`, or one target."""
        return cls(reader.targets(value, path))

    def run(self, graph, report):
        nodes, blocks = _find(graph, self.targets, report, self.step)
        for node in nodes:
            node.annotations["recompute"] = True
            report.add(self.step, node.name, "checkpoint after")
        for block, block_nodes in blocks:
            last = block_nodes[-1]
            last.annotations["recompute"] = True
            report.add(self.step, last.name, "checkpoint after",
                       f"end of expanded `{block.path}`")
        return graph


@register_pass("pipeline_stages", order=4)
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

    # -- configs and saving ------------------------------------------------------
    def get_config(self):
        return {"stages": [targets_config(stage, "PipelineStages") for stage in self.stages]}

    @classmethod
    def from_config(cls, config):
        config = saved_config(config, "PipelineStages", required=("stages",))
        stages = config["stages"]
        if not isinstance(stages, list):
            raise PassError(
                f"PipelineStages.from_config: stages are a list; got {short_repr(stages)}."
            )
        return cls([targets_from_config(stage, "PipelineStages") for stage in stages])

    @classmethod
    def from_user_config(cls, value, path, reader):
        """`pipeline_stages: [[encoder], [decoder, head]]`."""
        if not isinstance(value, list) or not value:
            raise ConfigError(path, "expected a non-empty list of lists of targets")
        return cls([reader.targets(stage, config_path(path, i)) for i, stage in enumerate(value)])

    def run(self, graph, report):
        assigned = {}
        for targets in self.stages:
            for target in targets:
                expand_to_reach(graph, target, report, self.step)
        for index, targets in enumerate(self.stages):
            nodes, blocks = matched_nodes_and_blocks(graph, targets, self.step)
            for node in nodes + [n for _, block_nodes in blocks for n in block_nodes]:
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


def _keyword_arguments(kwargs, owner):
    if not (isinstance(kwargs, dict) and all(
            isinstance(k, str) and k.isidentifier() and k != "targets" for k in kwargs)):
        raise PassError(f"{owner}.from_config: outline_kwargs are keyword arguments; got "
                        f"{short_repr(kwargs)}.")
    return kwargs


def _find(graph, targets, report, step):
    """Reach each target (expanding the layers that hold it), then match."""
    for target in targets:
        expand_to_reach(graph, target, report, step)
    return matched_nodes_and_blocks(graph, targets, step)


def _joined(*parts):
    return ", ".join(part for part in parts if part)


def _outline_entry(node, detail):
    """The report's (action, detail) for outlining `node`: a layer whose
    `get_config` fails is outlined alone (nothing shows it equal to another)."""
    from keras_ipu_plugin.runtime.executor import outline_config

    _, error = outline_config(node.operation)
    if error is None:
        return "outlined", detail
    return "outlined alone", (
        f"its get_config fails ({type(error).__name__}: {error}), so nothing "
        "shows it equal to another layer: it shares no body")


def _kwargs_text(kwargs):
    return ", ".join(f"{k}={v!r}" for k, v in sorted(kwargs.items()))


__all__ = ["Outline", "Recompute", "PipelineStages", "describe", "matches"]
