"""A layer's own sub-layers, losses, variables, constructor arguments and Keras's bookkeeping attributes.

Part of `_compat`, the one package that touches private Keras / TensorFlow
APIs (see its `__init__`)."""

import functools

from keras.src.utils import naming as _naming


def all_layers(layer):
    """`layer` and every layer inside it, each once."""
    return layer._flatten_layers(include_self=True, recursive=True)


def sub_layers(layer, recursive=True):
    """The layers inside `layer` (all of them, or only its direct ones)."""
    return layer._flatten_layers(include_self=False, recursive=recursive)


def clear_own_losses(layer):
    """Forget the losses `layer` itself added (`add_loss`), as Keras does at
    the outermost call of a model (`layers/state/added_loss.py`: a graph's loss
    node replaces what its previous run added); nothing in a stateless
    scope, whose losses are the scope's (a recomputed segment: the executor
    adds them to the layer afterwards). No public API clears them."""
    from keras.src import backend

    if backend.in_stateless_scope():
        return
    layer._losses.clear()
    layer._loss_ids.clear()


def own_losses(layer):
    """The losses `layer` itself added (`add_loss`), not its sub-layers'
    (`training/session/step_losses.py`). No public API tells them apart."""
    return layer._get_own_losses()


def own_variables(layer):
    """The variables `layer` made itself (`add_weight`), not its
    sub-layers': what `layer.weights` adds to theirs, without walking them
    (comparing the blocks of a model reads every layer's)."""
    return [*layer._trainable_variables, *layer._non_trainable_variables]


def auto_layer_name_base(layer):
    """The name Keras gives `layer` when its constructor is given none,
    before its process-wide counter is appended (`Dense` -> `dense`)."""
    return _naming.to_snake_case(type(layer).__name__)


# Instance attributes Keras's own Layer / TensorFlow's Trackable code keeps on
# every layer while building and calling it: restoring the user's plain
# Python attributes after a conversion must leave these as Keras set them.
LAYER_BOOKKEEPING = frozenset({"built", "_called", "_path", "_parent_path", "_lock"})
TRACKABLE_PREFIX = "_self_"


def constructor_config(layer):
    """The arguments `layer` was constructed with, as Keras recorded them
    for its automatic `get_config` (a dict), or None where it did not
    (far cheaper than `get_config()`, which serializes every initializer)."""
    config = getattr(layer, "_auto_config", None)
    return None if config is None else dict(config.config)


# Modules of model code that ships inside Keras, written with its layers as
# a user's code is (ConvNeXt's `LayerScale`); the rest of Keras is its library.
KERAS_MODEL_CODE_MODULES = ("keras.src.applications.",)


def is_keras_model_code(module):
    """Whether `module` (a `__module__` string) is model code shipped inside
    Keras rather than Keras's layer library."""
    return module.startswith(KERAS_MODEL_CODE_MODULES)


#: Where Keras defines its `keras.ops` operation classes (what a saved
#: `BatchSizedOperation` may hold; Keras saves them by this module).
KERAS_OPERATION_MODULES = ("keras.src.ops",)
#: Where a saved `keras.random.SeedGenerator` says it is from.
SEED_GENERATOR_MODULES = ("keras.random", "keras.src.random")


@functools.lru_cache(maxsize=None)
def layer_bookkeeping_attributes():
    """The instance attributes every Keras layer has (`_layers`, `_tracked`,
    node lists, ...): Keras's, never a user's attribute."""
    import keras

    return frozenset(vars(keras.layers.Layer(name="kip_bare"))) | {"_tracked"}


def added_loss(layer, loss):
    """Whether `layer` added `loss` (`add_loss`, or its activity
    regularizer) inside the current `keras.StatelessScope`: Keras keeps the
    ids of the losses a layer added there, and no public accessor."""
    return id(loss) in getattr(layer, "_loss_ids", ())
