"""The losses a training step sees: `self.losses` of the model, and of a
sub-model it calls, when the forward pass ran through converted graphs.

Plain Keras keeps a loss that `call` adds (`self.add_loss(...)`: keras.io's
VQ-VAE quantizer, a router's load-balancing loss) on the layer that added
it, so that `model.losses` and `sub_model.losses` hold it after a call, and
Keras's `compute_loss` adds it to the training loss. In a converted graph
the loss is added by the graph's own `AddedLoss` node
(`layers/state.py`), which the user's model does not hold: a step
running through the plugin would read the user's layers and miss it. So
the step's `self` and its sub-models (`step_self.py`) add to their own
`losses` what the `AddedLoss` nodes added in the conversions run for them
(or for a model inside them) on this thread, in the graph being traced
(a conversion run in another `tf.function` trace, or eagerly, is not this
step's).

The other losses (activity regularizers, weight regularizers, layers kept
whole adding their own) are on layers the user's model holds, and are read
there as Keras reads them: nothing is counted twice.

Example:
    >>> ran = StepLosses()
    >>> outputs = ran.record(model, converted, converted(x))
    >>> ran.losses(model, model.losses)   # with what converted's AddedLoss nodes added
"""

import threading

import tensorflow as tf

from keras_ipu_plugin import _compat
from keras_ipu_plugin.layers.state import loss_nodes


class StepLosses:
    """The conversions run on each thread, by the model they stand for."""

    def __init__(self):
        self._local = threading.local()

    def record(self, callee, converted, outputs):
        """Note that `converted` ran for `callee` (now, in this graph);
        returns `outputs`."""
        ran = self._local.__dict__.setdefault("ran", {})
        ran[id(callee)] = (callee, converted, _current_graph())
        return outputs

    def losses(self, model, keras_losses):
        """`model`'s losses in the step: `keras_losses` (Keras's `losses` of
        the user's `model`) without what the layers the conversions run
        expanded added themselves at an earlier call of the user's model
        (the verification's, the user's own: Keras would clear them at the
        model's next call, which the graph stands for), and with what the
        `AddedLoss` nodes of those conversions added instead."""
        nodes = self._loss_nodes(model)
        stale = {id(loss) for node in nodes if node.adds_for is not None
                 and node.adds_for() is not None
                 for loss in _compat.own_losses(node.adds_for())}
        return ([loss for loss in keras_losses if id(loss) not in stale]
                + [loss for node in nodes for loss in node.losses])

    def _loss_nodes(self, model):
        """The `AddedLoss` nodes of the conversions run for `model` or a
        model inside it, in the graph being traced."""
        inside = {id(layer) for layer in _compat.all_layers(model)}
        graph = _current_graph()
        found = []
        for callee, converted, where in getattr(self._local, "ran", {}).values():
            if id(callee) in inside and where is graph:
                found.extend(loss_nodes(converted))
        return found


def _current_graph():
    """The graph being built (a `tf.function` trace), or None when eager."""
    return None if tf.executing_eagerly() else tf.compat.v1.get_default_graph()


__all__ = ["StepLosses"]
