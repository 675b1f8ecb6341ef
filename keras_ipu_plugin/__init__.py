"""keras_ipu_plugin: run subclassed Keras models as functional graphs.

Example:
    ```python
    import keras_ipu_plugin as kip
    converted = kip.convert_to_functional(MyModel(), x_first_batch)
    passed = kip.apply_passes(converted, [kip.passes.Expand()])
    print(passed.kip_report)
    ```
"""

__version__ = "0.1.0"

from keras_ipu_plugin import passes
from keras_ipu_plugin.errors import ConfigError
from keras_ipu_plugin.errors import ConversionError
from keras_ipu_plugin.errors import InputDataError
from keras_ipu_plugin.errors import InputTypeError
from keras_ipu_plugin.errors import IpuError
from keras_ipu_plugin.errors import LoadError
from keras_ipu_plugin.errors import PassError
from keras_ipu_plugin.frontend.convert import Converter
from keras_ipu_plugin.frontend.convert import convert_to_functional
from keras_ipu_plugin.passes.infra.config import passes_from_config
from keras_ipu_plugin.passes.features import create_feature_extractor
from keras_ipu_plugin.passes.plain_keras import to_keras
from keras_ipu_plugin.passes.infra.config import register_layer
from keras_ipu_plugin.passes.infra.manager import apply_passes
from keras_ipu_plugin.report import Report
from keras_ipu_plugin.report import summary
from keras_ipu_plugin.layers.alias import LayerAlias
from keras_ipu_plugin.runtime.backends import backend
from keras_ipu_plugin.passes.ipu_presets import ipu_replacements
from keras_ipu_plugin.runtime.functional import KipFunctional
from keras_ipu_plugin.runtime.mode_switch import ModeSwitch
from keras_ipu_plugin.runtime.model_plot import model_to_dot
from keras_ipu_plugin.runtime.model_plot import plot_model
from keras_ipu_plugin.layers.opaque import OpaqueLayer
from keras_ipu_plugin.training.callback import PluginCallback
from keras_ipu_plugin.training.session.new_variables import NewVariablesError
from keras_ipu_plugin.training.model import PluginModel
from keras_ipu_plugin.training.scope import scope
from keras_ipu_plugin.training.scope import scope_report

__all__ = [
    "ConfigError", "ConversionError", "Converter", "InputDataError", "InputTypeError",
    "IpuError", "KipFunctional", "LayerAlias", "LoadError", "ModeSwitch", "NewVariablesError", "OpaqueLayer", "PassError",
    "PluginCallback", "PluginModel", "Report", "apply_passes", "backend", "create_feature_extractor",
    "convert_to_functional", "ipu_replacements", "model_to_dot", "passes", "passes_from_config", "plot_model",
    "register_layer", "scope", "scope_report", "summary", "to_keras",
]
