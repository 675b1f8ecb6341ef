"""The passes: small classes that transform the graph IR.

Example:
    >>> passes = [kip.passes.Expand(), kip.passes.Recompute(TransformerBlock)]
    >>> passed = kip.apply_passes(converted, passes)
"""

from keras_ipu_plugin.passes.annotate import Outline
from keras_ipu_plugin.passes.annotate import PipelineStages
from keras_ipu_plugin.passes.annotate import Recompute
from keras_ipu_plugin.passes.base import ALL
from keras_ipu_plugin.passes.base import EQUAL
from keras_ipu_plugin.passes.base import LayerName
from keras_ipu_plugin.passes.base import RUNS
from keras_ipu_plugin.passes.base import Pass
from keras_ipu_plugin.passes.base import register_pass
from keras_ipu_plugin.passes.base import registered_passes
from keras_ipu_plugin.passes.expand import Expand
from keras_ipu_plugin.passes.patterns import Chain
from keras_ipu_plugin.passes.replace import Replace
from keras_ipu_plugin.passes.replace import Replacement

__all__ = [
    "ALL", "EQUAL", "LayerName", "RUNS", "Pass", "Expand", "Replace", "Replacement", "Outline",
    "Recompute", "PipelineStages", "Chain", "register_pass", "registered_passes",
]
