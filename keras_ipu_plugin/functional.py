"""`KipFunctional`: the functional model class every conversion returns.

It is an ordinary Keras functional model with three additions, all stored in
its config so they survive `save` / `load_model`:

- `kip_pinned_training`: layers the original code called with a hard-coded
  `training=` value (a frozen BatchNormalization). Keras's own functional
  model overwrites those with the outer `training`; this one keeps them.
- `kip_annotations`: what the Outline / Recompute / PipelineStages passes
  recorded per layer, for the backend to act on.
- `kip_report` (not saved): the report of the conversion and passes.
"""

import keras

from keras_ipu_plugin import _keras_internals


@keras.saving.register_keras_serializable(package="keras_ipu_plugin")
class KipFunctional(_keras_internals.Functional):
    """A functional model that honours `training` values pinned by the code.

    Example:
        >>> converted = kip.convert_to_functional(model, x)
        >>> isinstance(converted, kip.KipFunctional)
        True
        >>> converted.kip_pinned_training   # e.g. {"frozen_bn": False}
    """

    def __init__(
        self,
        *args,
        kip_pinned_training=None,
        kip_annotations=None,
        kip_stage_devices=None,
        **kwargs,
    ):
        super().__init__(*args, **kwargs)
        self.kip_pinned_training = dict(kip_pinned_training or {})
        self.kip_annotations = {
            name: dict(values) for name, values in (kip_annotations or {}).items()
        }
        self.kip_stage_devices = list(kip_stage_devices or [])
        self.kip_report = None
        self.kip_graph = None
        # (old layer, new layer) pairs made by Replace; not tracked, so the
        # replaced layers' variables are not this model's
        object.__setattr__(self, "kip_replaced", ())
        self._kip_executor = None

    @property
    def kip_stages(self):
        """`{layer name: pipeline stage}` from the PipelineStages pass."""
        return {
            name: notes["stage"]
            for name, notes in self.kip_annotations.items()
            if "stage" in notes
        }

    def _uses_executor(self):
        return bool(self.kip_stage_devices) or any(
            "recompute" in notes or "outline" in notes
            for notes in self.kip_annotations.values()
        )

    def call(self, inputs, training=None, mask=None, **kwargs):
        context = dict(kwargs, training=training)
        if self._uses_executor():
            if self._kip_executor is None:
                from keras_ipu_plugin.backends import get_backend
                from keras_ipu_plugin.executor import Executor

                self._kip_executor = Executor(self, get_backend())
            inputs = _keras_internals.standardize_inputs(self, inputs)
            if mask is not None:
                for x, one_mask in zip(inputs, keras.tree.flatten(mask)):
                    if one_mask is not None:
                        _keras_internals.set_keras_mask(x, one_mask)
            outputs = self._kip_executor(inputs, training, context)
            if isinstance(outputs, (list, tuple)) and len(outputs) == 1:
                return outputs[0]
            return outputs
        pinned = self.kip_pinned_training

        def operation_fn(operation):
            accepted = _keras_internals.call_context_args(operation)

            def call(*args, **op_kwargs):
                for name, value in context.items():
                    if value is None or name not in accepted:
                        continue
                    if name == "training" and operation.name in pinned:
                        continue
                    op_kwargs[name] = value
                return operation(*args, **op_kwargs)

            return call

        return _keras_internals.run_functional_graph(
            self, inputs, mask, operation_fn
        )

    def get_config(self):
        config = super().get_config()
        config["kip_pinned_training"] = dict(self.kip_pinned_training)
        config["kip_annotations"] = {
            name: dict(values) for name, values in self.kip_annotations.items()
        }
        config["kip_stage_devices"] = list(self.kip_stage_devices)
        return config
