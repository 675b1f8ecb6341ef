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
        self, *args, kip_pinned_training=None, kip_annotations=None, **kwargs
    ):
        super().__init__(*args, **kwargs)
        self.kip_pinned_training = dict(kip_pinned_training or {})
        self.kip_annotations = {
            name: dict(values) for name, values in (kip_annotations or {}).items()
        }
        self.kip_report = None
        self.kip_graph = None

    def call(self, inputs, training=None, mask=None, **kwargs):
        context = dict(kwargs, training=training)
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
        return config
