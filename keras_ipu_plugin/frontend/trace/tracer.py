"""The `Tracer`: where tracing stops, and which `call`s take `training`.

As torch.fx's `Tracer.is_leaf_module`, one overridable method says where
tracing stops: `is_user_code(layer)`. A layer of user code is traced
through: its `call` runs inline on the symbolic tensors while the model is
traced, and Expand inlines its node into the nodes of its `call`. A layer
that is not (Keras's own layers; what a subclass says to keep whole) is a
leaf: one node that calls the layer. `takes_training(layer)` says whether
a layer's `call` is handed `training`. The defaults are the package's one
rule and one probe (`layers/user_code.py`).

A tracer is in use on the thread that made it current (`with
tracer.tracing():`); conversion, Expand and the training runtime trace with
the one in use, `DEFAULT_TRACER` otherwise.

Example:
    >>> class KeepAttention(Tracer):
    ...     def is_user_code(self, layer):
    ...         return not isinstance(layer, MyAttention) and super().is_user_code(layer)
    >>> with KeepAttention().tracing():
    ...     expanded = kip.apply_passes(model, [kip.passes.Expand("all")])
    >>> # every MyAttention is one node of `expanded`, the rest is expanded
"""

import contextlib
import threading

from keras_ipu_plugin.layers import user_code


class Tracer:
    """The hooks of a trace; subclass it and override them (see the module
    docstring). The default instance is `DEFAULT_TRACER`."""

    def is_user_code(self, layer):
        """Whether tracing goes through `layer` (True), or keeps it as one
        node, a leaf (False). Default: the one rule, `user_code.is_user_layer`
        (its class is not one `keras.layers` exports nor the plugin's own).
        A nested functional model is inlined by Expand whatever this says of
        it: its graph is no code of anyone's to trace."""
        return user_code.is_user_layer(layer)

    def takes_training(self, layer):
        """Whether `layer`'s `call` is handed the `training` mode. Default:
        it has a `training` parameter (`user_code.takes_training`, as Keras
        decides)."""
        return user_code.takes_training(layer)

    def traced_call(self, layer):
        """The `call` tracing runs inline for `layer` (its class's, when
        written in user code: `user_code.user_call`), or None for a leaf;
        override `is_user_code`, not this."""
        return user_code.user_call(layer, self.is_user_code, through_overrides=True)

    @contextlib.contextmanager
    def tracing(self):
        """Make this the tracer in use on this thread while the context lasts."""
        stack = _in_use.__dict__.setdefault("stack", [])
        stack.append(self)
        try:
            yield self
        finally:
            stack.pop()


DEFAULT_TRACER = Tracer()

_in_use = threading.local()


def current_tracer():
    """The tracer in use on this thread (`Tracer.tracing`), else `DEFAULT_TRACER`."""
    stack = getattr(_in_use, "stack", None)
    return stack[-1] if stack else DEFAULT_TRACER


__all__ = ["Tracer", "DEFAULT_TRACER", "current_tracer"]
