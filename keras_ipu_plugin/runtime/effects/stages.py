"""What the PipelineStages pass's annotation does when the graph runs: each
layer is called in its stage's scope (`backend.stage_scope`): on the
portable backend the device `kip_stage_devices[stage]` names (a model
without devices runs as it is); the IPU backend places stages through
Graphcore's pipeline API instead (`backends.ipu.assign_stages`), so its
scope is empty. A layer without a stage annotation is in stage 0.

Example:
    >>> staged = kip.apply_passes(converted, [kip.passes.PipelineStages(num_stages=2)])
    >>> staged.kip_stage_devices = ["/cpu:0", "/cpu:0"]
    >>> staged(x)      # each layer runs under tf.device of its stage
"""

from keras_ipu_plugin.runtime.interpreter import RunEffect
from keras_ipu_plugin.runtime.interpreter import register_run_effect


@register_run_effect
class Stages(RunEffect):
    """Every call in its pipeline stage's scope."""

    name = "stages"
    keys = ("stage",)
    order = 10  # inside Recompute's output checkpoints, around an outlined body

    def active(self):
        # Stages change nothing without devices to place them on.
        devices = self.interpreter.stage_devices
        if devices:
            self.backend.check_stage_devices(devices, f"The model's kip_stage_devices {devices!r}")
        return bool(devices)

    def applies(self, node):
        return True  # a layer without a stage is in stage 0

    def call(self, node, run, args, kwargs, proceed):
        stage = node.annotations.get("stage", 0)
        with self.backend.stage_scope(stage, self.interpreter.stage_devices):
            return proceed(args, kwargs)
