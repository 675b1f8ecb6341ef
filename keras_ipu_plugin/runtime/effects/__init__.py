"""The run-time effects of the built-in annotation passes, one file each:
`recompute.py` (Recompute: segments under checkpoints; `activation_remat.py`, the
activation of a Dense recomputed from its pre-activation), `outline.py`
(Outline: shared bodies), `stages.py` (PipelineStages: stage placement).
Importing this package registers them (`interpreter.register_run_effect`);
they sit with the runtime, not with their passes, so that a model loaded
from a file runs with them whatever was imported."""

from keras_ipu_plugin.runtime.effects import activation_remat  # noqa: F401 (registers)
from keras_ipu_plugin.runtime.effects import outline  # noqa: F401 (registers)
from keras_ipu_plugin.runtime.effects import recompute  # noqa: F401 (registers)
from keras_ipu_plugin.runtime.effects import stages  # noqa: F401 (registers)
