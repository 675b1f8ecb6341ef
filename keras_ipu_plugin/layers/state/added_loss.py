"""`AddedLoss`: a loss a layer's `call` adds (`self.add_loss(...)`), as a
graph node.

keras.io's VQ-VAE quantizer adds its commitment and codebook losses in
`call`, `self.add_loss(self.beta * commitment_loss + codebook_loss)`; the
Switch Transformer's router adds its load-balancing loss. Keras 3 takes
`add_loss` on concrete tensors only, so a functional model cannot carry
such a loss from its symbolic build, and the layer used to run whole. The
tracer records the call as this layer instead (`frontend/trace/trace_views.py`): it
is called on the loss's graph tensor and adds it with Keras's own
`add_loss` each time the graph runs, so `model.losses` of the graph's
model holds the same loss after a call as the original's does, and Keras's
`compute_loss` adds it to the training loss as it adds the original's.

The node returns the loss (so that the call's first output can be ordered
after it: a functional model runs only what its outputs need,
`frontend/trace/writes.py`); it is never expanded and never outlined, and
saves with the model.

A call of the graph's model replaces what the node added at its previous
call (one loss per call, as the original's layer has after each call of
its model), also when the graph runs nested in another model, which Keras
clears only at its outermost call.

Example:
    >>> added = AddedLoss(name="vector_quantizer.add_loss")
    >>> loss = added(commitment + codebook)     # in a graph: added at each run
    >>> graph_model(x); graph_model.losses      # [the loss of this call]
"""

import weakref

import keras

from keras_ipu_plugin import _compat
from keras_ipu_plugin.layers import saved_values


@keras.saving.register_keras_serializable(package="keras_ipu_plugin")
class AddedLoss(keras.layers.Layer):
    """Adds its input to the losses of the model holding it (Keras's
    `add_loss`) each time it runs; returns it.

    Example:
        >>> AddedLoss(name="router.add_loss")(aux_loss)
    """

    def __init__(self, adds_for=None, **kwargs):
        # The loss is added as `call` computed it: never cast by a policy.
        kwargs["autocast"] = False
        super().__init__(**kwargs)
        # The user's layer whose `add_loss` this is (not saved, not tracked):
        # what that layer added at an earlier call of the user's model is
        # this node's to stand for (`training/session/step_losses.py`).
        self.adds_for = None if adds_for is None else weakref.ref(adds_for)
        self.built = True

    def call(self, loss):
        self.add_loss(loss)
        return loss

    def add_loss(self, loss):
        # One node is one `add_loss` call of the original's `call`: what an
        # earlier run added is this run's to replace. (Also when the
        # executor adds the loss of a recomputed segment's run; a
        # recomputation in the backward pass, in a stateless scope, leaves
        # the forward pass's loss in place.)
        _compat.clear_own_losses(self)
        super().add_loss(loss)

    def compute_output_spec(self, loss):
        return keras.KerasTensor(loss.shape, dtype=loss.dtype)

    def get_config(self):
        config = super().get_config()
        config.pop("autocast", None)
        return config

    @classmethod
    def from_config(cls, config):
        saved_values.saved_layer_config(config, f"AddedLoss `{config.get('name')}`")
        return cls(**config)


def loss_nodes(model):
    """The `AddedLoss` layers of `model` (its graph, the `ModeSwitch` bodies
    and nested graph models it holds)."""
    return [layer for layer in _compat.all_layers(model) if isinstance(layer, AddedLoss)]


def added_losses(model):
    """The losses the `AddedLoss` nodes of `model` (a graph's model, and the
    `ModeSwitch` bodies and nested graph models it holds) added at their
    latest run.

    Example:
        >>> converted(x)
        >>> added_losses(converted)     # [the quantizer's loss]
    """
    return [loss for layer in loss_nodes(model) for loss in layer.losses]


__all__ = ["AddedLoss", "added_losses", "loss_nodes"]
