"""The passes: small classes that transform the graph IR.

Example:
    ```python
    passes = [kip.passes.Expand(), kip.passes.Recompute(TransformerBlock)]
    passed = kip.apply_passes(converted, passes)
    ```
"""

from keras_ipu_plugin.passes.annotate import Outline
from keras_ipu_plugin.passes.annotate import PipelineStages
from keras_ipu_plugin.passes.annotate import Recompute
from keras_ipu_plugin.passes.infra.base import ALL
from keras_ipu_plugin.passes.infra.base import EQUAL
from keras_ipu_plugin.passes.infra.base import LayerName
from keras_ipu_plugin.passes.infra.base import RUNS
from keras_ipu_plugin.passes.infra.base import Pass
from keras_ipu_plugin.passes.infra.base import register_pass
from keras_ipu_plugin.passes.infra.base import registered_passes
from keras_ipu_plugin.passes.expand import Expand
from keras_ipu_plugin.passes.infra.patterns import Chain
# `kip.passes.config` (its limits, MAX_CONFIG_BYTES, ...) is documented: the
# module lives with the pass infrastructure in `passes/infra/`.
from keras_ipu_plugin.passes.infra import config
from keras_ipu_plugin.passes.replace import Replace
from keras_ipu_plugin.passes.replace import Replacement
# What a pass's annotation does when the model runs (`runtime/interpreter.py`).
from keras_ipu_plugin.runtime.interpreter import RunEffect
from keras_ipu_plugin.runtime.interpreter import register_run_effect

__all__ = [
    "ALL", "EQUAL", "LayerName", "RUNS", "Pass", "Expand", "Replace", "Replacement", "Outline",
    "Recompute", "PipelineStages", "Chain", "register_pass", "registered_passes", "RunEffect",
    "register_run_effect",
]
