"""How Keras calls a layer: the call context (`training`), the arguments `__call__` reads and the masks it adds.

Part of `_compat`, the one package that touches private Keras / TensorFlow
APIs (see its `__init__`)."""

import contextlib

from keras.src.backend.common import global_state
from keras.src.layers.layer import CallContext

from keras_ipu_plugin._compat.nodes import keras_mask


_CALL_CTX = "current_call_ctx"


@contextlib.contextmanager
def call_context(entry_layer, training):
    """Run a block as if inside `entry_layer.__call__(..., training=training)`.

    Sub-layers called without an explicit `training` then resolve it from this
    context exactly as they would inside the real `__call__`.
    """
    previous = global_state.get_global_attribute(_CALL_CTX)
    context = CallContext(entry_layer=entry_layer)
    context.set_value("training", training)
    global_state.set_global_attribute(_CALL_CTX, context)
    try:
        yield
    finally:
        global_state.set_global_attribute(_CALL_CTX, previous)


def call_context_args(operation):
    return getattr(operation, "_call_context_args", ())


def current_training():
    """The `training` value of the Keras call in progress (None outside one)."""
    context = global_state.get_global_attribute(_CALL_CTX)
    return None if context is None else context.get_value("training")


def adopt_call_signature(alias, layer):
    """Make Keras's `alias.__call__` read its arguments as `layer.__call__`
    reads them: which is the first argument, which tensors' masks fill
    `mask` / `<name>_mask`, and so what `compute_mask` is handed.

    Without it a `call(*args, **kwargs)` wrapper hands `compute_mask` the
    tuple of all positional arguments and the tuple of their masks (an
    `Attention` behind an alias then failed to validate its inputs, and an
    embedding's `not_equal(inputs, 0)` mask gained a leading dimension).
    """
    for name in ("_call_signature", "call_signature_parameters", "_call_has_training_arg",
                 "_call_has_mask_arg", "_call_context_args", "_call_has_context_arg",
                 "_allow_non_tensor_positional_args"):
        object.__setattr__(alias, name, getattr(layer, name))


def call_takes_training_argument(layer):
    """Whether Keras hands `layer.__call__`'s `training` on to its `call`
    (`_call_has_training_arg`, also what `fit` reads to call a model as
    `model(x, training=True)` or as `model(x)`)."""
    return layer._call_has_training_arg


def set_call_takes_training_argument(layer, value):
    """Set what `call_takes_training_argument` reads (a converted model
    takes it from the model it was converted from)."""
    object.__setattr__(layer, "_call_has_training_arg", value)


def masks_keras_would_pass(layer, args, kwargs):
    """The mask arguments `layer.__call__(*args, **kwargs)` adds before it
    runs `call` (Keras 3.15's `Layer.__call__`, step 6): `mask` from the
    Keras masks of the one tensor argument when `call` takes `mask`, or
    `<name>_mask` for each tensor argument `<name>` when there are several;
    only those the caller left None. Returns `{argument: masks}` to add.

    Expand calls a layer's `call` directly, not through `__call__`, and
    must hand it the masks `__call__` would have.
    """
    from keras import tree
    from keras.src.layers.layer import CallSpec

    import numpy as np
    import keras

    # `__call__` converts arrays to tensors before it reads the arguments
    # (a graph layer's `(x, self.edges)`), and such tensors carry no mask:
    # stand-ins of their specs keep a nest mixing them with KerasTensors,
    # which Keras refuses, as Keras reads it.
    args, kwargs = tree.map_structure(
        lambda leaf: keras.KerasTensor(leaf.shape, dtype=leaf.dtype.name)
        if isinstance(leaf, np.ndarray) else leaf, (args, dict(kwargs)))
    call_spec = CallSpec(layer._call_signature, layer._call_context_args, args, kwargs)
    added = {}
    tensors = call_spec.tensor_arguments_dict
    if len(tensors) == 1:
        if "mask" in call_spec.argument_names and call_spec.arguments_dict["mask"] is None:
            only = next(iter(tensors.values()))
            added["mask"] = tree.map_structure(keras_mask, only)
    elif len(tensors) > 1:
        for name, value in tensors.items():
            mask_name = f"{name}_mask"
            if mask_name in call_spec.argument_names and call_spec.arguments_dict[mask_name] is None:
                added[mask_name] = tree.map_structure(keras_mask, value)
    return added
