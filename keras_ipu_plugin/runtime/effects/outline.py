"""What the Outline pass's annotation does when the graph runs: layers of a
group share one compiled body (the backend's `outline`: a `tf.function`
here, `ipu.outlined_function` on the IPU), called on each layer's own
weights.

Layers share a body when their class, config (but the name), symbolic
input signature and the call's keyword values are equal; the training mode
is part of what they share unless nothing in the layer reads it. A write
node runs as itself: an outlined body runs on the weights passed in, in a
stateless scope that would keep the write.

Example:
    >>> outlined = kip.apply_passes(converted, [kip.passes.Outline(Block)])
    >>> outlined(x)
    >>> len(outlined.kip_interpreter().effects["outline"].bodies)   # one per group
    1
"""

import inspect

import keras
import tensorflow as tf

from keras_ipu_plugin import _compat
from keras_ipu_plugin.layers.alias import LayerAlias
from keras_ipu_plugin.layers.layer_kinds import training_agnostic
from keras_ipu_plugin.layers.state.variable_write import is_write_node
from keras_ipu_plugin.runtime.interpreter import RunEffect
from keras_ipu_plugin.runtime.interpreter import register_run_effect


@register_run_effect
class Outline(RunEffect):
    """Outlined bodies shared between the layers of a group."""

    name = "outline"
    keys = ("outline",)
    order = 20  # innermost: the body replaces the layer's own call

    def __init__(self, interpreter):
        super().__init__(interpreter)
        self.bodies = {}  # key -> shared function

    def applies(self, node):
        # A write node runs as itself (see the module docstring).
        operation = node.operation
        return ("outline" in node.annotations and isinstance(operation, keras.layers.Layer)
                and not is_write_node(getattr(operation, "aliased_layer", operation)))

    def call(self, node, run, args, kwargs, proceed):
        return self._outlined_call(node, node.annotations["outline"], args, kwargs,
                                   run.context.get("training"))

    def _outlined_call(self, node, outline_kwargs, args, kwargs, training):
        # An expanded layer runs behind an alias whose config holds the
        # layer's own name: grouped by the alias, no two would share.
        layer = getattr(node.operation, "aliased_layer", node.operation)
        # Only what `call` takes (`__call__` would drop an unused `training`
        # itself; kept, it would split the layers into two groups).
        accepted = inspect.signature(layer.call).parameters
        if not any(p.kind is p.VAR_KEYWORD for p in accepted.values()):
            kwargs = {k: v for k, v in kwargs.items() if k in accepted}
        # Tensors (a mask, an attention mask) are arguments of the shared
        # body; other values are part of what makes two calls share it.
        tensor_kwargs = {k: v for k, v in kwargs.items() if tf.is_tensor(v)}
        static_kwargs = {k: v for k, v in kwargs.items() if k not in tensor_kwargs}
        # The body is traced once per key: the model's training mode is part
        # of it unless nothing in the layer reads it, since sub-layers that
        # take it from the context (a Dropout in a block whose `call` has no
        # `training`) bake it into the trace.
        if training_agnostic(layer):
            static_kwargs.pop("training", None)
            mode = None
        else:
            mode = _training_key(training)
        key = _outline_key(layer, node, static_kwargs) + (tuple(sorted(tensor_kwargs)), mode)
        shared = self.bodies.get(key)
        if shared is None:
            body = _shared_body(layer, static_kwargs, self.interpreter.owner, training)
            shared = self.backend.outline(body, **outline_kwargs)
            self.bodies[key] = shared
        outputs, new_state, losses = shared(
            [_compat.current_value(v) for v in layer.trainable_variables],
            [_compat.current_value(v) for v in layer.non_trainable_variables],
            tensor_kwargs,
            *args,
        )
        for variable, value in zip(layer.non_trainable_variables, new_state):
            variable.assign(value)
        for loss in losses:
            layer.add_loss(loss)
        return outputs


def _shared_body(representative, kwargs, model, training):
    """One body for every layer of a group: the representative layer called
    (through `__call__`, as the model calls it) on the weights passed in, so
    N layers share it.

    Not `stateless_call`: that runs `call` bare, skipping what `__call__`
    does around it — casting the inputs to the compute dtype and reading the
    weights in it under a mixed precision policy (an outlined Dense under
    `mixed_float16` computed in float32 on float16-rounded weights), the
    activity regularizer and the masks. Weights come in stored, uncast:
    `__call__` casts them as it would the variables.
    """
    kwargs = dict(kwargs)

    def body(trainable, non_trainable, tensor_kwargs, *args):
        mapping = list(zip(representative.trainable_variables, trainable)) + list(
            zip(representative.non_trainable_variables, non_trainable)
        )
        # Under a scope of its own: the body may be traced in a graph of its
        # own, where the layer's would be a root scope, which TensorFlow
        # refuses for a name starting with `_` (a layer of a class `_Conv`).
        with _compat.stateless_scope(mapping, collect_losses=True) as scope, \
                tf.name_scope("outlined"):
            with _compat.call_context(model, training):
                outputs = representative(*args, **kwargs, **tensor_kwargs)
        new_state = [
            scope.get_current_value(v) for v in representative.non_trainable_variables
        ]
        return outputs, new_state, list(scope.losses)

    return body


def _training_key(training):
    if training is None or isinstance(training, bool):
        return training
    return "tensor"


def _outline_key(layer, node, kwargs):
    """Layers share a body when class, config (but the name), the symbolic
    input signature and the call's keyword values are equal. A layer whose
    config cannot be read shares with none (see `outline_config`)."""
    config, _ = outline_config(layer)
    config = ("alone", id(layer)) if config is None else repr(sorted(config.items()))
    signature = tuple(
        (tuple(value.spec.shape), value.spec.dtype) for value in node.input_values
    )
    return (type(layer), config, signature, repr(sorted(kwargs.items())))


def outline_config(layer):
    """`(config, None)`: what must be equal for two layers of one class to
    share an outlined body (the config but the name); `(None, error)` when
    the layer's own `get_config` fails (keras_hub 0.32's
    `LlamaTransformerDecoder` reads an attribute it never sets): nothing
    then shows two such layers equal, so the layer is outlined alone.

    Example:
        >>> outline_config(keras.layers.Dense(3, name="a"))[0]["units"]
        3
    """
    inner = layer.layer if isinstance(layer, LayerAlias) else layer
    try:
        config = dict(inner.get_config())
    except Exception as error:  # user code: any failure means "unknown"
        return None, error
    config.pop("name", None)
    return config, None
