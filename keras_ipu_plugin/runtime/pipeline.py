"""A staged `KipFunctional` run one pipeline stage at a time.

`PipelineStages` records a stage on every node; the pipelined training step
(`training/pipelined/step.py`) runs each stage of each microbatch on its own
device, under its own gradient tape. This module cuts the interpreter's plan
(`model.kip_interpreter().steps`: nodes and recompute segments) where the stage
changes and runs one stage's part on the values that cross into it:

    staged = StagedModel(converted, get_backend())
    values = staged.input_tensors(x)           # graph Value -> tensor
    for stage in staged.stages:
        staged.run_stage(stage, values, training=True)
    y = staged.outputs(values)

A stage's `inputs` are the values it reads from the model's inputs or from
earlier stages, its `outputs` those that later stages or the model's outputs
read: the only tensors that go from one stage's device to another's.
"""

from dataclasses import dataclass
from dataclasses import field

import keras
import tensorflow as tf

from keras_ipu_plugin import _compat
from keras_ipu_plugin.ir.graph import Node
from keras_ipu_plugin.runtime.backends import get_backend
from keras_ipu_plugin.runtime.effects import Segment
from keras_ipu_plugin.runtime.effects import wire_segments
from keras_ipu_plugin.runtime.interpreter import Run
from keras_ipu_plugin.runtime.interpreter import interpreter_for

#: The schedules of the pipelined training step (`PipelineStages(schedule=)`).
SCHEDULES = ("gpipe", "1f1b")


def stage_of(node):
    """The pipeline stage of `node` (a node of the interpreter's graph; 0
    where none is recorded): the one place the pipeline reads stage
    annotations.

    Example:
        ```python
        [stage_of(node) for node in interpreter_for(staged, backend).graph.nodes]
        # -> [0, 0, 1, 1]
        ```
    """
    return node.annotations.get("stage", 0)


def split_steps(steps, outputs):
    """The interpreter's `steps` (nodes and `Segment`s) cut where the stage
    changes and regrouped by stage, each stage's pieces in plan order, the
    stages ascending: `[(stage, [Segment])]`. A node is a one-node segment
    run normally; a recomputed segment cut in two is two recomputed
    segments. `outputs`: the Values the graph returns.

    Example:
        ```python
        split_steps(interpreter_for(model, backend).steps, graph.outputs)
        # -> [(0, [Segment(...), ...]), (1, [...])]
        ```
    """
    pieces = []
    for step in steps:
        if isinstance(step, Node):
            pieces.append(Segment([step]))
            continue
        run = []
        for node in step.nodes:
            if run and stage_of(node) != stage_of(run[-1]):
                pieces.append(Segment(run, recompute=step.recompute))
                run = []
            run.append(node)
        if run:
            pieces.append(Segment(run, recompute=step.recompute))
    stages = sorted({stage_of(piece.nodes[0]) for piece in pieces})
    grouped = [(stage, [p for p in pieces if stage_of(p.nodes[0]) == stage])
               for stage in stages]
    wire_segments([piece for _, part in grouped for piece in part], outputs)
    return grouped


@dataclass
class Stage:
    """One stage's part of the plan and the Values crossing into and out
    of it."""

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
        self.interpreter = interpreter_for(model, backend)
        self.graph = self.interpreter.graph
        parts = split_steps(self.interpreter.steps, self.graph.outputs)
        self.stages = [Stage(index, segments) for index, segments in parts]
        self._wire_stages()

    @property
    def num_stages(self):
        return len(self.stages)

    def _wire_stages(self):
        produced_in = {}  # Value -> position of the stage producing it
        for position, stage in enumerate(self.stages):
            for segment in stage.segments:
                for node in segment.nodes:
                    for value in node.outputs:
                        produced_in[value] = position
        names = self.tensor_names()
        needed_later = {value: len(self.stages) for value in keras.tree.flatten(self.graph.outputs)}
        for position, stage in enumerate(self.stages):
            for segment in stage.segments:
                for value in segment.inputs:
                    source = produced_in.get(value)
                    if source is not None and source > position:
                        raise ValueError(
                            f"Pipeline stage {stage.index} of `{self.model.name}` reads the "
                            f"output of `{names[value]}`, in the later stage "
                            f"{self.stages[source].index}: stages must follow the data flow.")
                    if source != position and value not in stage.inputs:
                        stage.inputs.append(value)
                    if source is not None and source < position:
                        needed_later[value] = max(needed_later.get(value, 0), position)
        for position, stage in enumerate(self.stages):
            stage.outputs = [
                value for segment in stage.segments for value in segment.outputs
                if produced_in.get(value) == position and needed_later.get(value, -1) > position]

    # -- running -----------------------------------------------------------------
    def input_tensors(self, inputs):
        """`{Value: tensor}` for the model's inputs given `inputs` (the
        structure the model is called on)."""
        flat = _compat.standardize_inputs(self.model, inputs)
        return dict(zip(keras.tree.flatten(self.graph.input_values), keras.tree.flatten(flat)))

    def run_stage(self, stage, tensors, training):
        """Run `stage`'s part on `tensors` (`{Value: tensor}`, holding the
        stage's inputs), adding what the stage computes."""
        run = Run(tensors, training, {"training": training})
        for segment in stage.segments:
            segment.run(self.interpreter, run)

    def outputs(self, tensors):
        """The model's outputs (as calling it returns them) from `tensors`."""
        flat = [tensors[value] for value in keras.tree.flatten(self.graph.outputs)]
        outputs = keras.tree.pack_sequence_as(_compat.output_structure(self.model), flat)
        if isinstance(outputs, (list, tuple)) and len(outputs) == 1:
            return outputs[0]  # as KipFunctional.call returns it
        return outputs

    def tensor_names(self):
        """`{Value: name of the layer producing it}` (for errors)."""
        names = {value: tensor.name
                 for value, tensor in zip(keras.tree.flatten(self.graph.input_values),
                                          self.model.inputs)}
        for stage in self.stages:
            for segment in stage.segments:
                for node in segment.nodes:
                    for value in node.outputs:
                        names[value] = getattr(node.operation, "name", "?")
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
        ```python
        stage_devices(["/CPU:0", "/CPU:1"], [], 3)
        # -> ['/CPU:0', '/CPU:1', '/CPU:0']
        ```
    """
    devices, model_devices = list(devices or []), list(model_devices or [])
    if devices and model_devices and devices != model_devices:
        raise ValueError(
            f"PipelineStages(devices={devices!r}) and the model's kip_stage_devices "
            f"{model_devices!r} place the stages on different devices: the forward pass "
            "would run on one and the backward pass on the other. Give one of them.")
    backend = get_backend()
    backend.check_stage_devices(devices, f"PipelineStages(devices={devices!r})")
    backend.check_stage_devices(model_devices, f"The model's kip_stage_devices {model_devices!r}")
    chosen = devices or model_devices or default_devices(num_stages)
    return [chosen[s % len(chosen)] if chosen else None for s in range(num_stages)]


__all__ = ["SCHEDULES", "Stage", "StagedModel", "default_devices", "split_steps", "stage_devices",
           "stage_of"]
