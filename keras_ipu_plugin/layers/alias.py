"""`LayerAlias`: a second name for a layer inside a functional model.

A functional model needs a distinct name for each layer, but sub-layers of
different custom layers often share one (`conv1` in every residual block),
and those layers are the user's objects, whose names the plugin must not
change. When an inlined layer's name is taken, the rebuilt model calls it
through an alias named after its graph path (`block_2.conv1`): a thin layer
that holds the same layer object, so the variables are the same.

To Keras the alias has the layer's own call signature, so its `__call__`
fills masks and hands `compute_mask` the same arguments as the layer's
would (see `_compat.adopt_call_signature`).
"""


import keras

from keras_ipu_plugin import _compat
from keras_ipu_plugin.layers import saved_values
from keras_ipu_plugin.layers.user_code import takes_training


@keras.saving.register_keras_serializable(package="keras_ipu_plugin")
class LayerAlias(keras.layers.Layer):
    """Calls `layer` under another name.

    Example:
        ```python
        alias = LayerAlias(block_2.conv1, name="block_2.conv1")
        alias.layer is block_2.conv1
        # -> True
        ```
    """

    def __init__(self, layer, tensor_outputs_only=False, **kwargs):
        kwargs.setdefault("dtype", layer.dtype_policy)
        super().__init__(**kwargs)
        self.layer = layer
        # The layer returns None among its outputs (keras_hub's attention
        # returns `(output, None)` without a cache), which a functional
        # model's node cannot hold: the alias returns the tensors alone, in
        # order, as the graph IR recorded them.
        self.tensor_outputs_only = tensor_outputs_only
        self.supports_masking = layer.supports_masking
        self._passes_training = takes_training(layer)
        _compat.adopt_call_signature(self, layer)
        self.built = True

    @property
    def aliased_layer(self):
        """The layer this alias calls."""
        return self.layer

    def call(self, *args, training=None, **kwargs):
        if self._passes_training:
            kwargs["training"] = training
        return self._tensors(self.layer(*args, **kwargs))

    def compute_output_spec(self, *args, training=None, **kwargs):
        if self._passes_training:
            kwargs["training"] = training
        return self._tensors(self.layer.compute_output_spec(*args, **kwargs))

    def _tensors(self, outputs):
        if not self.tensor_outputs_only:
            return outputs
        return [leaf for leaf in keras.tree.flatten(outputs) if leaf is not None]

    def compute_mask(self, *args, **kwargs):
        return self.layer.compute_mask(*args, **kwargs)

    def get_config(self):
        config = super().get_config()
        config["layer"] = keras.saving.serialize_keras_object(self.layer)
        config["tensor_outputs_only"] = self.tensor_outputs_only
        return config

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        entry = f"LayerAlias `{config.get('name')}`"
        saved_values.saved_layer_config(config, entry, ("layer", "tensor_outputs_only"))
        saved_values.saved_bool(config.get("tensor_outputs_only", False), entry,
                                "tensor_outputs_only")
        config["layer"] = saved_values.saved_user_layer(config.get("layer"), entry)
        return cls(**config)
