"""`AttachMask`: give a tensor the Keras mask a layer's call gave it.

Keras attaches a mask to a layer's outputs after its `call` (the layer's
`compute_mask`, or the mask it received), and hands it to the `mask`
argument of the layers the outputs feed. Once Expand inlines the layer, its
last inner operation produces the output (`tokens + positions`: no mask);
the expanded graph attaches the mask the layer's `__call__` would have
attached, so every later layer receives the same masks as in the original.

Example:
    ```python
    masked = AttachMask(name="embedding.mask")(embedded, mask=padding)
    keras.ops.all(masked._keras_mask == padding)
    ```
"""

import keras
import tensorflow as tf

from keras_ipu_plugin.layers import saved_values


@keras.saving.register_keras_serializable(package="keras_ipu_plugin")
class AttachMask(keras.layers.Layer):
    """Returns `inputs` (a new tensor, same values) carrying the Keras mask `mask`.

    Example:
        ```python
        AttachMask()(x, mask=m)  # Keras sets the output's mask to m
        ```
    """

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.supports_masking = True
        self.built = True

    def call(self, inputs, mask=None):
        del mask  # attached by Keras after `call`: `compute_mask` returns it
        # A new tensor: the input keeps its own mask (Keras sets `_keras_mask`
        # on the very object it returns).
        return tf.identity(inputs)

    def compute_mask(self, inputs, mask=None):
        return mask

    def compute_output_spec(self, inputs, mask=None):
        return keras.KerasTensor(inputs.shape, dtype=inputs.dtype)

    @classmethod
    def from_config(cls, config):
        saved_values.saved_layer_config(config, f"AttachMask `{config.get('name')}`")
        return cls(**config)
