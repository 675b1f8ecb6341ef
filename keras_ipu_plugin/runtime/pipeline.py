"""A staged `KipFunctional` run one pipeline stage at a time.

`PipelineStages` records a stage on every node; the pipelined training step
(`training/pipelined_step.py`) runs each stage of each microbatch on its own
device, under its own gradient tape. This module cuts the executor's plan
(recompute segments included) where the stage changes and runs one stage's
part on the tensors that cross into it:

    staged = StagedModel(converted, get_backend())
    tensors = staged.input_tensors(x)          # KerasTensor id -> value
    for stage in staged.stages:
        staged.run_stage(stage, tensors, training=True)
    y = staged.outputs(tensors)

A stage's `inputs` are the tensors it reads from the model's inputs or from
earlier stages, its `outputs` those that later stages or the model's outputs
read: the only tensors that go from one stage's device to another's.
"""

from dataclasses import dataclass
from dataclasses import field

import keras
import tensorflow as tf

from keras_ipu_plugin import _compat
from keras_ipu_plugin.runtime.executor import Executor
from keras_ipu_plugin.runtime.executor import split_plan

#: The schedules of the pipelined training step (`PipelineStages(schedule=)`).
SCHEDULES = ("gpipe", "1f1b")


def stage_of(model, node):
    """The pipeline stage of Keras functional node `node` of `model` (0 where
    none is recorded): the one place the pipeline reads stage annotations.

    Example:
        >>> [stage_of(staged, node) for node in _compat.functional_nodes(staged)]
        [0, 0, 1, 1]
    """
    notes = model.kip_annotations.get(getattr(node.operation, "name", None), {})
    return notes.get("stage", 0)


@dataclass
class Stage:
    """One stage's part of the plan and the tensor ids crossing into and
    out of it."""

    index: int
    segments: list
    inputs: list = field(default_factory=list)
    outputs: list = field(default_factory=list)

    @property
    def layer_names(self):
        return [getattr(node.operation, "name", "?") for s in self.segments for node in s.nodes]


class StagedModel:
    """`model`'s plan cut into its pipeline stages (see the module doc).

    Stages with no node (a stage number no node carries) are left out;
    `stages[i].index` is the stage number the annotations gave.
    """

    def __init__(self, model, backend):
        self.model = model
        self.executor = Executor(model, backend)
        parts = split_plan(self.executor.segments, model, lambda node: stage_of(model, node))
        self.stages = [Stage(index, segments) for index, segments in parts]
        self._wire_stages()

    @property
    def num_stages(self):
        return len(self.stages)

    def _wire_stages(self):
        produced_in = {}  # tensor id -> position of the stage producing it
        for position, stage in enumerate(self.stages):
            for segment in stage.segments:
                for node in segment.nodes:
                    for tensor in _compat.node_outputs(node):
                        produced_in[id(tensor)] = position
        names = self.tensor_names()
        needed_later = {id(t): len(self.stages) for t in self.model.outputs}
        for position, stage in enumerate(self.stages):
            for segment in stage.segments:
                for tensor_id in segment.inputs:
                    source = produced_in.get(tensor_id)
                    if source is not None and source > position:
                        raise ValueError(
                            f"Pipeline stage {stage.index} of `{self.model.name}` reads the "
                            f"output of `{names[tensor_id]}`, in the later stage "
                            f"{self.stages[source].index}: stages must follow the data flow.")
                    if source != position and tensor_id not in stage.inputs:
                        stage.inputs.append(tensor_id)
                    if source is not None and source < position:
                        needed_later[tensor_id] = max(needed_later.get(tensor_id, 0), position)
        for position, stage in enumerate(self.stages):
            stage.outputs = [
                i for segment in stage.segments for i in segment.outputs
                if produced_in.get(i) == position and needed_later.get(i, -1) > position]

    # -- running -----------------------------------------------------------------
    def input_tensors(self, inputs):
        """`{KerasTensor id: value}` for the model's inputs given `inputs`
        (the structure the model is called on)."""
        flat = _compat.standardize_inputs(self.model, inputs)
        return {id(x): y for x, y in zip(self.model.inputs, keras.tree.flatten(flat))}

    def run_stage(self, stage, tensors, training):
        """Run `stage`'s part on `tensors` (it holds the stage's inputs),
        adding what the stage computes."""
        self.executor.run_segments(stage.segments, tensors, training, {"training": training})

    def outputs(self, tensors):
        """The model's outputs (as calling it returns them) from `tensors`."""
        flat = [tensors[id(t)] for t in self.model.outputs]
        outputs = keras.tree.pack_sequence_as(_compat.output_structure(self.model), flat)
        if isinstance(outputs, (list, tuple)) and len(outputs) == 1:
            return outputs[0]  # as KipFunctional.call returns it
        return outputs

    def tensor_names(self):
        """`{KerasTensor id: name of the layer producing it}` (for errors)."""
        names = {id(t): t.name for t in self.model.inputs}
        for stage in self.stages:
            for segment in stage.segments:
                for node in segment.nodes:
                    for tensor in _compat.node_outputs(node):
                        names[id(tensor)] = getattr(node.operation, "name", "?")
        return names


def default_devices(num_stages):
    """The visible GPUs where there are at least as many as `num_stages`
    (more than one), else [] (every stage on the current device)."""
    gpus = [device.name for device in tf.config.list_logical_devices("GPU")]
    return gpus if num_stages > 1 and len(gpus) >= num_stages else []


def stage_devices(devices, model_devices, num_stages):
    """The device of each of `num_stages` stages (None: the current one):
    `devices` (the pass's) or `model_devices` (`model.kip_stage_devices`),
    stage s on `devices[s % len(devices)]`, else `default_devices`.

    Example:
        >>> stage_devices(["/CPU:0", "/CPU:1"], [], 3)
        ['/CPU:0', '/CPU:1', '/CPU:0']
    """
    devices, model_devices = list(devices or []), list(model_devices or [])
    if devices and model_devices and devices != model_devices:
        raise ValueError(
            f"PipelineStages(devices={devices!r}) and the model's kip_stage_devices "
            f"{model_devices!r} place the stages on different devices: the forward pass "
            "would run on one and the backward pass on the other. Give one of them.")
    chosen = devices or model_devices or default_devices(num_stages)
    return [chosen[s % len(chosen)] if chosen else None for s in range(num_stages)]


__all__ = ["SCHEDULES", "Stage", "StagedModel", "default_devices", "stage_devices", "stage_of"]
