"""The losses a traced `call` adds (`self.add_loss(...)`), recorded as graph nodes.

keras.io's VQ-VAE (https://keras.io/examples/generative/vq_vae/) adds its
quantizer's losses in `call`:

    self.add_loss(self.beta * commitment_loss + codebook_loss)

Traced, the loss is a symbolic tensor, which Keras's `add_loss` refuses
("can only be called ... on a tensor input"), and the layer stayed whole.
The views tracing calls (`tracing._inline_view_class`) take `add_loss`
here instead: the traced layer's own `add_loss` of a symbolic loss becomes
an `AddedLoss` node on it (`layers/state/added_loss.py`), which adds the loss
each time the graph runs; the call's first output comes after it, as after
a variable write (`write_nodes.WriteRecorder.finish`), so no loss is left
out of the graph. A concrete loss (computed eagerly while traced, from no
input) is held by a `HeldConstant` node, as other concrete tensors are,
and checked not to be computed from a weight the graph would freeze.

A sub-layer's `add_loss` met while its output shape is worked out (its
`call` run inline for the spec, the sub-layer being one node of the traced
graph) records nothing: the sub-layer's node adds its loss when it runs,
or its own trace records it when Expand inlines it. Outside a trace, and
on a concrete loss anywhere, `add_loss` is Keras's own.

Example:
    >>> # in `type(layer).call(view, x)` while tracing `layer`:
    >>> view.add_loss(ops.mean(x ** 2))    # an AddedLoss node; None
"""

import keras

from keras_ipu_plugin.frontend.trace import write_nodes
from keras_ipu_plugin.layers.state.added_loss import AddedLoss
from keras_ipu_plugin.layers.views import viewed_layer


def traced_add_loss(view, loss):
    """`add_loss` of a view of a user layer (see the module docstring)."""
    leaves = keras.tree.flatten(loss)
    recorder = write_nodes.current()
    symbolic = any(isinstance(leaf, keras.KerasTensor) for leaf in leaves)
    if recorder is None:
        return super(type(view), view).add_loss(loss)
    trace = recorder.trace
    if view is not recorder.view and _user_layer(view) is not _user_layer(trace.layer):
        if symbolic:
            return None  # a sub-layer's spec: its own node or trace adds the loss
        return super(type(view), view).add_loss(loss)
    if not recorder.in_own_context():
        raise write_nodes.WriteError(
            "`call` adds a loss (`self.add_loss(...)`) inside a branch or a loop "
            "(`ops.cond`, `ops.while_loop`, `ops.scan`...), which one graph node cannot "
            "hold: write the loss outside it, added once, choosing with "
            "`ops.where(condition, loss, 0.0)`, for the layer to expand")
    if not all(isinstance(leaf, keras.KerasTensor) or keras.ops.is_tensor(leaf)
               for leaf in leaves):
        # a number: Keras refuses it, in the original's call as here
        return super(type(view), view).add_loss(loss)
    for leaf in leaves:
        if not isinstance(leaf, keras.KerasTensor):
            # computed eagerly while traced, from no input: held by the graph
            # as other concrete tensors are (and checked not to be a weight
            # the graph would freeze)
            leaf = trace.lift((leaf,), {}, trace.layer, role="added_loss")[0][0]
        name = trace.unique_name("add_loss")
        added = AddedLoss(adds_for=_user_layer(trace.layer), name=name)
        output = trace.record_layer(added, name, leaf)
        recorder.writes.append(output)  # the call's first output comes after it
    return None


def _user_layer(layer):
    """The user's layer behind `layer` (a view, a view of a view, or it)."""
    while viewed_layer(layer) is not None:
        layer = viewed_layer(layer)
    return layer


__all__ = ["traced_add_loss"]
