"""`PluginCallback`: convert the model being fitted at `on_train_begin`."""

import keras

from keras_ipu_plugin.apply import apply_passes
from keras_ipu_plugin.apply import validate_passes
from keras_ipu_plugin.convert import Converter
from keras_ipu_plugin.errors import PassError
from keras_ipu_plugin.passes.replace import Replace
from keras_ipu_plugin.training import LazyStepFunction


class PluginCallback(keras.callbacks.Callback):
    """Run the rest of `fit` through the converted, passed graph.

    The model is converted from the first batch of the training data (that
    batch is trained on as usual, not skipped or read twice) under the
    model's strategy; the user's model object keeps its variables, updated
    in place. `model.converted_by_callback` is not set: the converted model
    is `callback.converted`.

    Example:
        >>> callback = kip.PluginCallback(passes=[kip.passes.Expand()])
        >>> model.fit(dataset, epochs=2, callbacks=[callback])
        >>> print(callback.kip_report)
    """

    def __init__(self, passes=(), rebuild_on_new_variables=True, verify=True):
        super().__init__()
        self.passes = validate_passes(passes)
        if any(isinstance(p, Replace) for p in self.passes):
            raise PassError(
                "PluginCallback cannot apply Replace: the new layers' variables "
                "would not belong to the model being fitted (its optimizer is "
                "already built). Use kip.PluginModel for Replace."
            )
        self.rebuild_on_new_variables = rebuild_on_new_variables
        self.verify = verify
        self.converted = None

    @property
    def kip_report(self):
        return None if self.converted is None else self.converted.kip_report

    def on_train_begin(self, logs=None):
        if getattr(self.model, "optimizer", None) is None:
            raise ValueError(
                f"PluginCallback: model `{self.model.name}` is not compiled."
            )
        self.model.train_function = LazyStepFunction(
            self.model, "train_step", self._convert
        )

    def _convert(self, x):
        with self.model.distribute_strategy.scope():
            converted = Converter(verify=self.verify).convert(self.model, x)
            if self.passes:
                converted = apply_passes(converted, self.passes)
        self.converted = converted
        return converted
