"""`PipelineStages`'s training settings: microbatches, devices, schedule.

The pass checks them when made (`check_pipeline_settings`) and, when it
runs, says in the report what the pipelined step will do
(`report_pipeline`): how many microbatches, on which devices (or that the
stages share the current device: gradient accumulation), which schedule, and
which layers see a microbatch where their result depends on the whole batch
(BatchNormalization's batch statistics, as in GPipe and on the IPU).

Example:
    >>> check_pipeline_settings(4, ["/GPU:0", "/GPU:1"], "1f1b")
    (4, ('/GPU:0', '/GPU:1'), '1f1b')
"""

import keras

from keras_ipu_plugin import _compat
from keras_ipu_plugin.errors import PassError
from keras_ipu_plugin.errors import short_repr
from keras_ipu_plugin.runtime.pipeline import SCHEDULES
from keras_ipu_plugin.runtime.backends import get_backend
from keras_ipu_plugin.runtime.pipeline import default_devices

#: Layers whose result depends on every row of the batch they see.
BATCH_DEPENDENT = (keras.layers.BatchNormalization,)


def check_pipeline_settings(microbatches, devices, schedule):
    """`(microbatches, devices as a tuple or None, schedule)`, checked;
    `PassError` naming the argument at fault otherwise."""
    if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
        raise PassError("PipelineStages: microbatches is a positive int; got "
                        f"{short_repr(microbatches)}.", field="microbatches")
    if devices is not None:
        if (not isinstance(devices, (list, tuple)) or not devices
                or not all(isinstance(d, str) and d for d in devices)):
            raise PassError("PipelineStages: devices is a non-empty list of device names "
                            f"(\"/GPU:0\"); got {short_repr(devices)}.", field="devices")
        devices = tuple(devices)
    if schedule not in SCHEDULES:
        raise PassError(f"PipelineStages: schedule is one of {', '.join(map(repr, SCHEDULES))}; "
                        f"got {short_repr(schedule)}.", field="schedule")
    return microbatches, devices, schedule


def pipelines(settings):
    """Whether the settings ask for the pipelined training step: several
    microbatches, or devices to run each stage's backward pass on too."""
    microbatches, devices, _ = settings
    return microbatches > 1 or devices is not None


def report_pipeline(graph, settings, stage_devices_of_model, report, step):
    """Add the pipelined step's plan to `report` (see the module doc)."""
    microbatches, devices, schedule = settings
    if not pipelines(settings):
        return
    stages = sorted({node.annotations.get("stage", 0) for node in graph.nodes})
    count = len(stages)
    if devices:
        # Checked before the report says where each stage runs.
        try:
            get_backend().check_stage_devices(devices, f"PipelineStages(devices={list(devices)!r})")
        except ValueError as error:
            raise PassError(str(error), field="devices") from None
    chosen = list(devices or stage_devices_of_model or default_devices(count))
    if chosen:
        where = ", ".join(f"stage {s} on {chosen[s % len(chosen)]}" for s in stages)
    else:
        where = ("all stages on the current device: gradient accumulation over "
                 f"{microbatches} microbatches, no overlap (fewer visible GPUs than stages; "
                 "give devices=[...] to place them)")
    report.add(step, graph.name, f"pipelined training, {microbatches} microbatches",
               f"schedule={schedule!r}; {where}; through PluginModel, PluginCallback "
               "or kip.scope")
    if microbatches == 1:
        return
    for node in graph.nodes:
        layers = [node.operation]
        if isinstance(node.operation, keras.layers.Layer):
            layers += _compat.sub_layers(node.operation)
        dependent = [layer for layer in layers if isinstance(layer, BATCH_DEPENDENT)]
        if dependent:
            report.add(step, node.name, "sees a microbatch",
                       f"{', '.join(type(layer).__name__ for layer in dependent)}: batch "
                       f"statistics over batch / {microbatches} rows, as in GPipe and on "
                       "the IPU (training differs from unpipelined)")


__all__ = ["BATCH_DEPENDENT", "check_pipeline_settings", "pipelines", "report_pipeline"]
