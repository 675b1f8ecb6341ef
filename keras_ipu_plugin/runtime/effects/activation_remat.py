"""Recomputing a Dense layer's activation alone: the note `activation_remat`.

A `keras.layers.Dense(768, activation="gelu")` keeps, for its backward pass,
its pre-activation `z` and gelu's intermediates (about three tensors the
size of its output), besides its input. With this note the layer's linear
part (`matmul`, bias) runs as usual and its activation runs under a
checkpoint: the backward pass keeps `z` only and recomputes the activation
from it, an elementwise op that costs a few percent of the matmul. This is
PyTorch's selective activation checkpointing (save the matmul's output,
recompute the pointwise ops), for one layer; `Recompute(auto=True)` writes
the note where the traced backward shows it saves memory
(`planning.node_costs`), in any kind of plan (a node kept, or recomputed in a
segment, still drops its activation's intermediates).

The split computes exactly what `Dense.call` computes, `activation(matmul(x,
kernel) + bias)`, with the same ops on the same values. So it is applied only
where that is all the layer's call does: a layer of class `Dense` itself
(not a subclass, whose `call` may differ), without LoRA, quantization, an
activity regularizer or a mixed-precision policy (whose casts `__call__`
makes), called on one tensor. Any other layer carrying the note runs as it
is (the note is a memory choice; results are the same either way).

Example:
    >>> passed.kip_annotations["blocks.0.dense.1"] = {"activation_remat": True}
    >>> passed(x, training=True)   # that Dense keeps z, recomputes gelu(z)
"""

import keras

from keras_ipu_plugin import _compat
from keras_ipu_plugin.runtime.interpreter import RunEffect
from keras_ipu_plugin.runtime.interpreter import register_run_effect

#: The annotation key (its value: True).
KEY = "activation_remat"


def splittable(layer):
    """Whether `layer`'s call is `activation(matmul(x, kernel) + bias)` and
    nothing more, with an activation other than the identity (see the
    module docstring).

    Example:
        >>> splittable(keras.layers.Dense(4, activation="gelu"))
        True
        >>> splittable(keras.layers.Dense(4))
        False
    """
    layer = getattr(layer, "aliased_layer", layer)
    if type(layer) is not keras.layers.Dense or not layer.built:
        return False
    activation = layer.activation
    if activation is None or activation is keras.activations.linear:
        return False
    if getattr(layer, "lora_enabled", False) or getattr(layer, "quantization_mode", None):
        return False
    if layer.activity_regularizer is not None:
        return False
    policy = layer.dtype_policy
    return policy.compute_dtype == policy.variable_dtype


def split_call(layer, inputs, checkpoint):
    """`layer(inputs)` for a `splittable` layer, its activation run under
    `checkpoint(fn, anchored=1)` (a backend's `checkpoint_segment`): the
    pre-activation is kept, the activation recomputed. A Keras mask on
    `inputs` goes on to the output, as Dense's `__call__` passes it.

    Example:
        >>> y = split_call(dense, x, get_backend().checkpoint_segment)
    """
    layer = getattr(layer, "aliased_layer", layer)
    pre = keras.ops.matmul(inputs, layer.kernel)
    if layer.bias is not None:
        pre = keras.ops.add(pre, layer.bias)
    activation = layer.activation
    (outputs,) = checkpoint(lambda z: [activation(z)], anchored=1)(pre)
    mask = _compat.keras_mask(inputs)
    if mask is not None:
        _compat.set_keras_mask(outputs, mask)
    return outputs


def _single_tensor_call(args, kwargs):
    """The call is `layer(x)` (a `training` keyword aside, which Dense
    ignores)."""
    extra = {key for key in kwargs if key != "training"}
    return len(args) == 1 and not extra and keras.ops.is_tensor(args[0])


@register_run_effect
class ActivationRemat(RunEffect):
    """A Dense layer's activation recomputed from its kept pre-activation."""

    name = "activation_remat"
    keys = (KEY,)
    order = 30  # innermost: it replaces the layer's own call (an outlined body wins)

    def applies(self, node):
        return node.annotations.get(KEY) is True

    def call(self, node, run, args, kwargs, proceed):
        if (not self.backend.recomputes_segments or not splittable(node.operation)
                or not _single_tensor_call(args, kwargs)):
            return proceed(args, kwargs)
        return split_call(node.operation, args[0], self.backend.checkpoint_segment)
