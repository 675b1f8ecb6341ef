"""Saved `.keras` files holding every kind of kip node, for the loading tests.

`AllKinds` is a user's model whose conversion and Expand give a graph with
every node kind kip writes: a TensorFlow function, a Keras and a TensorFlow
random draw, batch- and tensor-sized operations, an opaque layer, an alias,
a variable read, write and ordering node, a held constant, an added loss, a
mask attached to an expanded layer's output and a switch between `training`
modes. `saved_files(folder)` saves it converted (`graph.keras`), expanded
(`expanded.keras`) and wrapped in a `PluginModel` with passes
(`plugin.keras`).

Importing this module registers the user's classes (as the user's own code
would before loading); it imports `keras_ipu_plugin` only, nothing inside it.
"""

import pathlib

import keras
import numpy as np
import tensorflow as tf
from keras import ops

import keras_ipu_plugin as kip

PACKAGE = "kip_saved_kinds"

#: Every kip node class `AllKinds` gives a saved graph (expanded, or a PluginModel).
NODE_KINDS = (
    "TFFunction", "RandomDraw", "TFRandomDraw", "BatchSizedOperation", "TensorSizedOperation",
    "OpaqueLayer", "LayerAlias", "VariableRead", "HeldConstant", "VariableWrite", "AfterWrites",
    "AddedLoss", "AttachMask", "ModeSwitch", "KipFunctional",
)


@keras.saving.register_keras_serializable(package=PACKAGE)
class Features(keras.layers.Layer):
    """A variable read, a held constant, a batch-sized broadcast, a Keras
    random draw and TensorFlow functions."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.proj = keras.layers.Dense(4, name="proj")
        self.positions = keras.layers.Embedding(3, 4, name="positions")
        self.seed_generator = keras.random.SeedGenerator(7)

    def build(self, input_shape):
        self.scale = self.add_weight(shape=(4,), initializer="ones", name="scale")
        self.token = self.add_weight(shape=(1, 1, 4), initializer="ones", name="token")

    def call(self, x, training=None):
        h = self.proj(x) * self.scale
        h = h[:, None, :] + self.positions(ops.arange(3))[None]
        token = ops.broadcast_to(self.token, (ops.shape(x)[0], 1, 4))
        h = ops.concatenate([token, h], axis=1)
        noise = keras.random.normal((ops.shape(x)[0], 1, 4), stddev=0.0, seed=self.seed_generator)
        return tf.reduce_sum(tf.square(h + noise), axis=1)


@keras.saving.register_keras_serializable(package=PACKAGE)
class Segments(keras.layers.Layer):
    """A Keras op given a graph tensor where Keras takes a size, and a
    TensorFlow random draw of the batch's shape."""

    def call(self, x):
        ids = ops.cast(ops.argmax(x, axis=-1), "int32")
        sums = ops.segment_sum(x, ids, num_segments=ops.max(ids) + 1)
        jitter = tf.random.normal(tf.shape(x), stddev=0.0)
        return x + ops.sum(sums) * 0.01 + jitter


@keras.saving.register_keras_serializable(package=PACKAGE)
class Dynamic(keras.layers.Layer):
    """Branches in Python on a tensor's value: stays one opaque node."""

    def call(self, x):
        if float(ops.sum(x)) > 1e9:
            return x * 2.0
        return x


@keras.saving.register_keras_serializable(package=PACKAGE)
class Block(keras.layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.proj = keras.layers.Dense(4, name="proj")  # the name of Features.proj: an alias

    def call(self, x):
        return self.proj(x)


@keras.saving.register_keras_serializable(package=PACKAGE)
class Counts(keras.layers.Layer):
    """Counts its calls (a variable write) and adds a loss."""

    def build(self, input_shape):
        self.calls = self.add_weight(shape=(), initializer="zeros", trainable=False,
                                     name="calls")

    def call(self, x):
        self.calls.assign_add(1.0)
        self.add_loss(ops.mean(ops.square(x)) * 0.0)
        return x


@keras.saving.register_keras_serializable(package=PACKAGE)
class DropPath(keras.layers.Layer):
    """Branches on `training` in Python: a switch between modes."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.seed_generator = keras.random.SeedGenerator(3)

    def call(self, x, training=None):
        if training:
            return x + keras.random.uniform(ops.shape(x), maxval=0.0, seed=self.seed_generator)
        return x


@keras.saving.register_keras_serializable(package=PACKAGE)
class Masked(keras.layers.Layer):
    """Gives its output a mask: attached again once expanded."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.supports_masking = True

    def call(self, x):
        return x * 1.0

    def compute_mask(self, x, mask=None):
        return ops.greater(ops.sum(x, axis=-1), -1e9)


@keras.saving.register_keras_serializable(package=PACKAGE)
class AllKinds(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.features, self.segments = Features(), Segments()
        self.dynamic, self.block, self.counts = Dynamic(), Block(), Counts()
        self.drop_path, self.masked = DropPath(), Masked()
        self.head = keras.layers.Dense(1)

    def call(self, x, training=None):
        h = self.segments(self.features(x))
        h = self.counts(self.dynamic(h))
        h = self.masked(self.drop_path(self.block(h), training=training))
        return self.head(h)


@keras.saving.register_keras_serializable(package=PACKAGE)
class Wrapped(keras.Model):
    """A model Keras can build from its saved config (the PluginModel's):
    `AllKinds` holds layers only a concrete batch runs."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.block, self.drop_path, self.head = Block(), DropPath(), keras.layers.Dense(1)

    def call(self, x, training=None):
        return self.head(self.drop_path(self.block(x), training=training))


X = np.random.default_rng(0).random((4, 5)).astype("float32")


def _kinds(config):
    found, stack = set(), [config]
    while stack:
        value = stack.pop()
        if isinstance(value, dict):
            if isinstance(value.get("class_name"), str):
                found.add(value["class_name"])
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)
    return found


def saved_files(folder):
    """`({file name: path}, {file name: model saved})` of the saved models
    in `folder`: `graph.keras` (converted), `expanded.keras` (and passes
    each annotating), `plugin.keras` (a PluginModel with passes, called)."""
    folder = pathlib.Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    converted = kip.convert_to_functional(AllKinds(), X)
    expanded = kip.apply_passes(converted, [kip.passes.Expand()])
    plugin = kip.PluginModel(Wrapped(), passes=[
        kip.passes.Expand(),
        kip.passes.Recompute("head"),
    ])
    plugin(X)
    models = {"graph.keras": converted, "expanded.keras": expanded, "plugin.keras": plugin}
    paths = {}
    for name, model in models.items():
        paths[name] = folder / name
        model.save(paths[name])
    return paths, models


def config_kinds(config):
    """The class names of every serialized object in a saved config."""
    return _kinds(config)
