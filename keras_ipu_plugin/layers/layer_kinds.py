"""What kind of layer a graph node calls: one Expand may inline (user code,
a nested model; `user_code.py` holds the rule), one whose output never
depends on `training`.

Example:
    ```python
    is_expandable(keras.layers.Dense(2)), is_expandable(MyBlock())
    # -> (False, True)
    ```
"""

import weakref

import keras

from keras_ipu_plugin import _compat
from keras_ipu_plugin.layers.keras_ops.batch_sized import BatchSizedOperation
from keras_ipu_plugin.layers.opaque import OpaqueLayer
from keras_ipu_plugin.layers.keras_ops.random_draws import RandomDraw
from keras_ipu_plugin.layers.state import is_read
from keras_ipu_plugin.layers.user_code import takes_training
from keras_ipu_plugin.layers.user_code import is_user_layer
from keras_ipu_plugin.layers.state import VariableWrite


def is_expandable(operation, is_user_code=is_user_layer):
    """Layers whose node Expand may inline: nested functional / sequential
    models, and layers of user code (`is_user_code(layer)`, by default the
    one rule, `user_code.is_user_layer`: every layer whose class
    `keras.layers` does not export, keras_hub's layers and classes of
    `keras.src.applications` included), except the plugin's own graph
    layers (opaque nodes, batch-sized operations, variable reads).

    Example:
        ```python
        is_expandable(keras.layers.Dense(2)), is_expandable(MyBlock())
        # -> (False, True)
        ```
    """
    if not isinstance(operation, keras.layers.Layer) or isinstance(
        operation, (OpaqueLayer, BatchSizedOperation, RandomDraw)
    ):
        return False
    if is_read(operation):  # a variable or a constant: nothing to inline
        return False
    if isinstance(operation, keras.Model):
        return True
    return is_user_code(operation)


# Built-in layers whose output never depends on `training` (exact classes:
# a subclass may read it). `Dense` / `EinsumDense` take a `training`
# argument, used only when quantized; `training_agnostic` checks that.
_TRAINING_AGNOSTIC = frozenset(
    getattr(keras.layers, name) for name in (
        "Dense", "EinsumDense", "Embedding", "LayerNormalization",
        "GroupNormalization", "UnitNormalization", "RMSNormalization",
        "Conv1D", "Conv2D", "Conv3D", "Conv1DTranspose", "Conv2DTranspose",
        "Conv3DTranspose", "DepthwiseConv1D", "DepthwiseConv2D",
        "SeparableConv1D", "SeparableConv2D",
        "Add", "Subtract", "Multiply", "Average", "Maximum", "Minimum",
        "Concatenate", "Dot", "Activation", "ReLU", "LeakyReLU", "PReLU",
        "ELU", "Softmax", "Identity", "Reshape", "Flatten", "Permute",
        "RepeatVector", "MaxPooling1D", "MaxPooling2D", "MaxPooling3D",
        "AveragePooling1D", "AveragePooling2D", "AveragePooling3D",
        "GlobalMaxPooling1D", "GlobalMaxPooling2D", "GlobalMaxPooling3D",
        "GlobalAveragePooling1D", "GlobalAveragePooling2D",
        "GlobalAveragePooling3D", "ZeroPadding1D", "ZeroPadding2D",
        "ZeroPadding3D", "Cropping1D", "Cropping2D", "Cropping3D",
        "UpSampling1D", "UpSampling2D", "UpSampling3D",
    )
    if hasattr(keras.layers, name)
)


def training_agnostic(layer):
    """Whether `layer.call` computes the same in training and inference:
    a custom layer whose `call` takes no `training` and whose sub-layers are
    all such layers or listed built-in ones. Tracing it once is then enough
    (`training` is otherwise traced both ways to find what follows it)."""
    if type(layer) in _TRAINING_AGNOSTIC:
        return getattr(layer, "quantization_mode", None) is None
    if not is_expandable(layer) or takes_training(layer):
        return False
    return all(
        training_agnostic(sub)
        for sub in _compat.sub_layers(layer, recursive=False)
    )


def seed_states(layer):
    """The state variables of the seed generators that `layer` and its
    sub-layers draw random numbers from (a Dropout's, a RandomDraw's).

    Example:
        ```python
        dropout = keras.layers.Dropout(0.1)
        seed_states(dropout) == [dropout.seed_generator.state]
        # -> True
        ```
    """
    states, seen = [], set()
    for owner in [layer, *_compat.sub_layers(layer)]:
        for value in vars(owner).values():
            if isinstance(value, keras.random.SeedGenerator) and id(value.state) not in seen:
                seen.add(id(value.state))
                states.append(value.state)
    return states


# The classes whose `call` was seen writing a variable while traced
# (`frontend/trace/writes.py`): a recomputation would run the write again (or,
# inside a segment's stateless scope, never on the variable), so such a
# layer runs outside recomputed segments. Kept by class: blocks of one kind
# are traced once for all of them.
_WRITING_CLASSES = weakref.WeakSet()


def note_writes_variables(layer):
    """Remember that `layer`'s `call` writes variables (see `writes_variables`)."""
    _WRITING_CLASSES.add(type(layer))


def writes_variables(operation):
    """Whether a trace saw the `call` of `operation`'s class (or of the
    layer an `OpaqueLayer` runs) write a variable.

    Example:
        ```python
        writes_variables(pixel_cnn.first)   # assigns its masked kernel
        # -> True
        ```
    """
    if isinstance(operation, VariableWrite):  # a write `call` made, as a node
        return True
    layer = operation.layer if isinstance(operation, OpaqueLayer) else operation
    return type(layer) in _WRITING_CLASSES
