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
from keras_ipu_plugin.errors import config_error
from keras_ipu_plugin.errors import config_path
from keras_ipu_plugin.errors import short_repr
from keras_ipu_plugin.report import Report
from keras_ipu_plugin.runtime.backends.ipu import check_outline_kwargs
from keras_ipu_plugin.passes.infra.base import refuse_inside
from keras_ipu_plugin.passes.infra.base import run_inside
from keras_ipu_plugin.passes.infra.base import split_targets
from keras_ipu_plugin.passes.infra.base import Pass
from keras_ipu_plugin.passes.infra.base import as_targets
from keras_ipu_plugin.passes.infra.base import config_value
from keras_ipu_plugin.passes.infra.base import describe
from keras_ipu_plugin.passes.infra.base import block_label
from keras_ipu_plugin.passes.infra.base import matched_nodes_and_blocks
from keras_ipu_plugin.passes.infra.base import matches
from keras_ipu_plugin.passes.infra.base import register_pass
from keras_ipu_plugin.passes.infra.base import saved_config
from keras_ipu_plugin.passes.infra.base import targets_config
from keras_ipu_plugin.passes.infra.base import targets_from_config
from keras_ipu_plugin.passes.expand import expand_blocks
from keras_ipu_plugin.passes.expand import expand_to_reach
from keras_ipu_plugin.passes.expand import expandable_blocks
from keras_ipu_plugin.planning.graph_planning import BALANCES
from keras_ipu_plugin.planning.graph_planning import check_auto
from keras_ipu_plugin.planning.graph_planning import check_memory_budget
from keras_ipu_plugin.planning.graph_planning import apply_recompute
from keras_ipu_plugin.planning.graph_planning import choose_recompute
from keras_ipu_plugin.planning.graph_planning import plan_recompute
from keras_ipu_plugin.planning.graph_planning import recompute_budget
from keras_ipu_plugin.planning.graph_planning import plan_stages
from keras_ipu_plugin.passes.microbatching import check_pipeline_settings
from keras_ipu_plugin.passes.microbatching import report_pipeline


@register_pass("outline", order=2)
class Outline(Pass):
    """Share one compiled body between repeated layers.

    `outline_kwargs` go to the IPU's `outlined_function` where there is one;
    only its own arguments are accepted (`unique_sharding`,
    `keep_input_layouts`, `name`), on every backend, so a config that would
    fail on the IPU fails everywhere.

    Example:
        ```python
        kip.passes.Outline(TransformerBlock)
        ```
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
        for target in self.targets:
            expand_to_reach(graph, target, report, self.step)
        here, inside = split_targets(graph, self.targets)
        nodes, blocks = _find(graph, here, report, self.step) if here else ([], [])
        # Inside a switch's modes: each mode's graph shares bodies among its own layers.
        run_inside(graph, inside, lambda targets: lambda branch: Outline(
            targets, **self.outline_kwargs).run(branch, report))
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
                               _joined(f"layer of {block_label(block)}", entry))
        return graph


@register_pass("recompute", order=3)
class Recompute(Pass):
    """Put a recomputation checkpoint after each matched layer, or let the
    plan choose them (`auto=True`).

    Activations between two checkpoints are recomputed in the backward pass
    instead of being kept, trading compute for memory. With `auto=True` the
    plan is made from the graph's shapes at the first batch (per replica;
    see `passes.planning`), choosing per node between keeping its
    activations, recomputing it inside its layer (its internal tensors
    dropped, its output kept, as `keras.RematScope` does to a layer) and
    recomputing it from a checkpoint (`planning.recompute_plan`): without
    `memory_budget`, the smallest estimated peak memory among the plans
    that recompute at most one forward pass, with `memory_budget` (bytes as
    an int, or a float in (0, 1]: a fraction of the estimated peak without
    recomputation) the least recomputation that meets it. With a budget, custom
    layers still whole (no `Expand()` before) are expanded when the plan
    over their sub-layers meets the budget where the whole layers cannot, or
    with less recomputation (then each sub-layer may be recomputed inside its
    block's recomputation, as `keras.RematScope("larger_than")` does). The
    estimate counts an optimizer update's temporaries and the prefetched
    input batches too. The report holds the plan's table (each node's kind
    included).

    Example:
        ```python
        kip.passes.Recompute(["block_1", "block_2"])
        kip.passes.Recompute(auto=True, memory_budget=0.5)
        ```
    """

    step = "recompute"

    def __init__(self, targets=None, *, auto=False, memory_budget=None):
        self.auto = check_auto(auto, "Recompute")
        self.memory_budget = check_memory_budget(memory_budget, self.auto)
        if targets is not None and self.auto:
            raise PassError("Recompute takes targets or auto=True (planned checkpoints), "
                            "not both.", field="auto")
        if targets is None and not self.auto:
            raise PassError("Recompute needs targets (the layers to checkpoint after), "
                            "or auto=True to plan the checkpoints.")
        self.targets = None if targets is None else as_targets(targets)

    # -- configs and saving ------------------------------------------------------
    def get_config(self):
        return {
            "targets": None if self.targets is None else targets_config(self.targets, "Recompute"),
            "auto": self.auto,
            "memory_budget": self.memory_budget,
        }

    @classmethod
    def from_config(cls, config):
        config = saved_config(config, "Recompute", required=(),
                              optional=("targets", "auto", "memory_budget"))
        targets = config.get("targets")
        return cls(None if targets is None else targets_from_config(targets, "Recompute"),
                   auto=config.get("auto", False), memory_budget=config.get("memory_budget"))

    @classmethod
    def from_user_config(cls, value, path, reader):
        """`recompute: [block_1, block_2]`, one target, or
        `recompute: {auto: true, memory_budget: 0.5}`."""
        if not isinstance(value, dict):
            return cls(reader.targets(value, path))
        arguments = _user_arguments(value, path, ("targets", "auto", "memory_budget"))
        targets = arguments.pop("targets", None)
        if targets is not None:
            targets = reader.targets(targets, f"{path}.targets")
        return _built(cls, targets, arguments, path)

    def run(self, graph, report):
        if self.auto:
            _plan_auto(graph, self.memory_budget, report, self.step)
            return graph
        for target in self.targets:
            expand_to_reach(graph, target, report, self.step)
        here, inside = split_targets(graph, self.targets)
        nodes, blocks = _find(graph, here, report, self.step) if here else ([], [])
        # Checkpoints inside a switch's modes: each mode's graph runs them.
        run_inside(graph, inside, lambda targets: lambda branch: Recompute(targets).run(
            branch, report))
        for node in nodes:
            node.annotations["recompute"] = True
            report.add(self.step, node.name, "checkpoint after")
        for block, block_nodes in blocks:
            last = block_nodes[-1]
            last.annotations["recompute"] = True
            report.add(self.step, last.name, "checkpoint after",
                       f"end of {block_label(block)}")
        return graph


def _plan_auto(graph, memory_budget, report, step):
    """`Recompute(auto=True)`'s plan. With a budget and custom layers still
    whole (no `Expand()` before), the plan is also made with those layers
    expanded into their sub-layers, where it may recompute each sub-layer
    inside its block's recomputation (what `keras.RematScope("larger_than")`
    does to a block and its layers) or only some of them; the layers are
    expanded, as `Expand()` does, when that plan meets a budget the whole
    layers cannot, or meets it with less recomputation."""
    blocks = expandable_blocks(graph)
    if memory_budget is None or not blocks:
        plan_recompute(graph, memory_budget, report, step)
        return
    refusal = None
    try:
        whole = choose_recompute(graph, memory_budget, step)
        budget = whole.budget
    except PassError as error:
        whole, refusal = None, error
        budget = recompute_budget(graph, memory_budget)
    trial = graph.copy()
    expand_blocks(trial, Report(), step)
    try:
        inside = choose_recompute(trial, memory_budget, step, budget=budget)
    except PassError as error:
        if whole is None:
            raise error from None  # the smallest peak of the two
        inside = None
    if inside is None or (whole is not None and whole.extra_flops <= inside.extra_flops):
        apply_recompute(whole, report, step)
        return
    names = expand_blocks(graph, report, step)
    why = ("no plan of the whole layers meets the budget" if whole is None else
           f"the budget is met with {inside.plan.extra_fraction:.2f} of a forward pass "
           f"recomputed, against {whole.plan.extra_fraction:.2f} with the whole layers")
    apply_recompute(choose_recompute(graph, memory_budget, step, budget=budget), report, step,
                    note=f"the sub-layers of {', '.join(names[:6])}"
                         + (f", ... ({len(names)} in all)" if len(names) > 6 else "")
                         + f", expanded as Expand() does: {why}")


@register_pass("pipeline_stages", order=4)
class PipelineStages(Pass):
    """Assign pipeline stages: `stages[i]` lists the targets of stage i, or
    `num_stages=N` cuts the graph into N balanced stages.

    With lists, layers not listed take the stage of their latest input, so
    every layer gets a stage; a layer may not feed a layer of an earlier
    stage. With `num_stages`, the graph's nodes (in topological order) are
    cut into N contiguous stages with the smallest largest stage cost, by
    `balance`: `"params"` (weights), `"activations"` (bytes kept for the
    backward pass at the first batch) or `"time"` (each node's forward and
    backward pass timed alone on the first batch's shapes). The report holds
    the plan's table.

    Training through PluginModel, PluginCallback or kip.scope with
    `microbatches=M > 1` (or `devices`) is pipelined (`training/pipelined/
    step.py`): each batch is split into M microbatches, stage s
    runs its forward and backward passes on `devices[s % len(devices)]`
    (default: the visible GPUs when there are at least as many as stages,
    else the current device, which makes it gradient accumulation), in the
    order of `schedule` ("gpipe": all forwards, then the backwards; "1f1b":
    one forward, one backward, at most S microbatches' activations alive per
    stage), and one optimizer step per batch equals the whole batch's.

    Example:
        ```python
        kip.passes.PipelineStages([["encoder"], ["decoder", "head"]])
        kip.passes.PipelineStages(num_stages=4, balance="time")
        kip.passes.PipelineStages(num_stages=2, microbatches=4,
                                  devices=["/GPU:0", "/GPU:1"], schedule="1f1b")
        ```
    """

    step = "pipeline_stages"

    def __init__(self, stages=None, *, num_stages=None, balance="params", microbatches=1,
                 devices=None, schedule="gpipe"):
        self.microbatches, self.devices, self.schedule = check_pipeline_settings(
            microbatches, devices, schedule)
        if balance not in BALANCES:
            raise PassError(f"PipelineStages: balance is one of {', '.join(map(repr, BALANCES))}; "
                            f"got {short_repr(balance)}.", field="balance")
        self.balance = balance
        if stages is not None and num_stages is not None:
            raise PassError("PipelineStages takes a list of lists of targets or "
                            "num_stages=N (balanced stages), not both.", field="num_stages")
        if stages is None and num_stages is None:
            raise PassError("PipelineStages needs stages (a list of lists of targets), "
                            "or num_stages=N to balance N stages.")
        if num_stages is not None:
            if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
                raise PassError("PipelineStages: num_stages is a positive int; got "
                                f"{short_repr(num_stages)}.", field="num_stages")
            self.stages, self.num_stages = None, num_stages
            return
        if balance != "params":
            raise PassError(f"PipelineStages: balance={balance!r} balances num_stages=N; "
                            "explicit stage lists are used as given.", field="balance")
        if not isinstance(stages, (list, tuple)) or not stages:
            raise PassError("PipelineStages takes a non-empty list of lists of targets.")
        self.stages = tuple(as_targets(stage) for stage in stages)
        self.num_stages = None

    # -- configs and saving ------------------------------------------------------
    def get_config(self):
        return {
            "stages": None if self.stages is None else [
                targets_config(stage, "PipelineStages") for stage in self.stages],
            "num_stages": self.num_stages,
            "balance": self.balance,
            "microbatches": self.microbatches,
            "devices": None if self.devices is None else list(self.devices),
            "schedule": self.schedule,
        }

    @property
    def pipeline_settings(self):
        """`(microbatches, devices or None, schedule)`: what the pipelined
        training step runs (`training/pipelined/step.py`)."""
        return self.microbatches, self.devices, self.schedule

    @classmethod
    def from_config(cls, config):
        config = saved_config(config, "PipelineStages", required=(),
                              optional=("stages", "num_stages", "balance", "microbatches",
                                        "devices", "schedule"))
        stages = config.get("stages")
        if stages is not None and not isinstance(stages, list):
            raise PassError(
                f"PipelineStages.from_config: stages are a list; got {short_repr(stages)}."
            )
        if stages is not None:
            stages = [targets_from_config(stage, "PipelineStages") for stage in stages]
        return cls(stages, num_stages=config.get("num_stages"),
                   balance=config.get("balance", "params"),
                   microbatches=config.get("microbatches", 1), devices=config.get("devices"),
                   schedule=config.get("schedule", "gpipe"))

    @classmethod
    def from_user_config(cls, value, path, reader):
        """`pipeline_stages: [[encoder], [decoder, head]]`, or
        `pipeline_stages: {num_stages: 4, balance: time}` (and `microbatches`,
        `devices`, `schedule`)."""
        if isinstance(value, dict):
            arguments = _user_arguments(value, path, ("stages", "num_stages", "balance",
                                                      "microbatches", "devices", "schedule"))
            stages = arguments.pop("stages", None)
            if stages is not None:
                if not isinstance(stages, list) or not stages:
                    raise ConfigError(f"{path}.stages",
                                      "expected a non-empty list of lists of targets")
                stages = [reader.targets(stage, config_path(f"{path}.stages", i))
                          for i, stage in enumerate(stages)]
            return _built(cls, stages, arguments, path)
        if not isinstance(value, list) or not value:
            raise ConfigError(path, "expected a non-empty list of lists of targets, or "
                                    "{num_stages: N, balance: params | activations | time}")
        return cls([reader.targets(stage, config_path(path, i)) for i, stage in enumerate(value)])

    def run(self, graph, report):
        if self.num_stages is not None:
            plan_stages(graph, self.num_stages, self.balance, report, self.step)
            report_pipeline(graph, self.pipeline_settings, None, report, self.step)
            return graph
        assigned = {}
        for targets in self.stages:
            for target in targets:
                expand_to_reach(graph, target, report, self.step)
        for index, targets in enumerate(self.stages):
            refuse_inside(graph, targets, self.step)
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
        report_pipeline(graph, self.pipeline_settings, None, report, self.step)
        return graph


def _user_arguments(value, path, known):
    """A config mapping's keys checked against `known` argument names."""
    for key in value:
        if key not in known:
            raise ConfigError(config_path(path, key), f"unknown key (expected {', '.join(known)})")
    return dict(value)


def _built(cls, first, arguments, path):
    """`cls(first, **arguments)`, its errors as `ConfigError`s at the path of
    the argument at fault (`recompute.memory_budget`), else at `path`."""
    try:
        return cls(first, **arguments)
    except PassError as error:
        raise config_error(path, error) from None


def _keyword_arguments(kwargs, owner):
    if not (isinstance(kwargs, dict) and all(
            isinstance(k, str) and k.isidentifier() and k != "targets" for k in kwargs)):
        raise PassError(f"{owner}.from_config: outline_kwargs are keyword arguments; got "
                        f"{short_repr(kwargs)}.")
    return kwargs


def _find(graph, targets, report, step):
    """Reach each target (expanding the layers that hold it), then match.
    A target only inside a `ModeSwitch` is an error (`refuse_inside`)
    unless the pass reaches there itself (Recompute)."""
    for target in targets:
        expand_to_reach(graph, target, report, step)
    refuse_inside(graph, targets, step)
    return matched_nodes_and_blocks(graph, targets, step)


def _joined(*parts):
    return ", ".join(part for part in parts if part)


def _outline_entry(node, detail):
    """The report's (action, detail) for outlining `node`: a layer whose
    `get_config` fails is outlined alone (nothing shows it equal to another)."""
    from keras_ipu_plugin.runtime.effects import outline_config

    _, error = outline_config(node.operation)
    if error is None:
        return "outlined", detail
    return "outlined alone", (
        f"its get_config fails ({type(error).__name__}: {error}), so nothing "
        "shows it equal to another layer: it shares no body")


def _kwargs_text(kwargs):
    return ", ".join(f"{k}={v!r}" for k, v in sorted(kwargs.items()))


__all__ = ["Outline", "Recompute", "PipelineStages", "describe", "matches"]
