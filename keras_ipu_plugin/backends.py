"""Backends: how annotated passes take effect on the hardware at hand.

`kip.backend()` names the backend chosen once per process: `"ipu"` where
Graphcore's `tensorflow.python.ipu` imports, `"portable"` everywhere else.
Passes and the model executor ask the backend object (`get_backend()`);
nothing else in the library branches on the hardware.

Portable (CPU / GPU / TPU):
- recompute: graph segments between checkpoints run under
  `recompute.recompute_grad` (TensorFlow's `tf.recompute_grad`, but keeping
  `None` and sparse gradients as the optimizer would see them without it),
  so their activations are recomputed in the backward pass (works in graph
  mode and under XLA: no keyword arguments cross the custom gradient);
- outline: layers of identical config and input signature share one
  `tf.function` body, their weights passed in as arguments;
- pipeline stages: a stage index per layer (`model.kip_stages`), and
  `tf.device` placement when the model is given stage devices.

IPU (Graphcore SDK): `ipu.pipelining_ops.recomputation_checkpoint` on
checkpointed outputs, `ipu.outlined_function` around outlined calls, the
pipeline stage assignment through Graphcore's Keras API, and layer
replacements from `ipu_tensorflow_addons.keras.layers`.

Example:
    >>> kip.backend()
    'portable'
"""

import contextlib
import functools
import importlib

import tensorflow as tf

from keras_ipu_plugin.recompute import recompute_grad

#: The documented default IPU replacement mapping: Keras layer class name ->
#: `ipu_tensorflow_addons.keras.layers` class name. Dense -> SerialDense only
#: when asked for (`ipu_replacements(serial_dense=True)`), since it changes
#: the memory / cycles trade-off rather than just the implementation.
IPU_REPLACEMENTS = {
    "Dropout": "Dropout",
    "LayerNormalization": "LayerNormalization",
    "Embedding": "Embedding",
    "LSTM": "PopnnLSTM",
    "GRU": "PopnnGRU",
}


class PortableBackend:
    """Recompute by checkpointed segments (`recompute.recompute_grad`),
    outline by shared `tf.function`s, stages by `tf.device`."""

    name = "portable"
    recomputes_segments = True

    def checkpoint_segment(self, fn):
        return recompute_grad(fn)

    def checkpoint_outputs(self, tensors):  # pragma: no cover - not used
        return tensors

    def outline(self, fn, **kwargs):
        return tf.function(fn, autograph=False, reduce_retracing=True)

    def stage_scope(self, stage, devices):
        if not devices:
            return contextlib.nullcontext()
        return tf.device(devices[stage % len(devices)])

    def assign_stages(self, model, stages):
        """Portable stages are the `kip_stages` mapping on the model."""
        return stages

    def replacements(self, serial_dense=False):
        return {}

    def default_strategy(self):
        return tf.distribute.get_strategy()


class IpuBackend:
    """The passes through Graphcore's IPU APIs (needs the Poplar SDK)."""

    name = "ipu"
    recomputes_segments = False

    def __init__(self, ipu, addons_layers=None):
        self.ipu = ipu
        self.addons_layers = addons_layers

    def checkpoint_segment(self, fn):  # pragma: no cover - not used on IPU
        return fn

    def checkpoint_outputs(self, tensors):
        checkpoint = self.ipu.pipelining_ops.recomputation_checkpoint
        return [checkpoint(tensor) for tensor in tensors]

    def outline(self, fn, **kwargs):
        return self.ipu.outlined_function(fn, **kwargs)

    def stage_scope(self, stage, devices):
        return contextlib.nullcontext()

    def assign_stages(self, model, stages):
        """Assign stages through Graphcore's Keras API where the model has it."""
        if not hasattr(model, "get_pipeline_stage_assignment"):
            return stages
        assignments = model.get_pipeline_stage_assignment()
        for assignment in assignments:
            assignment.pipeline_stage = stages[assignment.layer.name]
        model.set_pipeline_stage_assignment(assignments)
        return stages

    def default_strategy(self):
        """An IPUStrategy (Graphcore's), unless another strategy is active."""
        if tf.distribute.has_strategy():
            return tf.distribute.get_strategy()
        return self.ipu.ipu_strategy.IPUStrategy()

    def replacements(self, serial_dense=False):
        """`{keras layer class name: addons class}` for the Replace pass."""
        if self.addons_layers is None:
            return {}
        mapping = {
            keras_name: getattr(self.addons_layers, addons_name)
            for keras_name, addons_name in IPU_REPLACEMENTS.items()
            if hasattr(self.addons_layers, addons_name)
        }
        if serial_dense and hasattr(self.addons_layers, "SerialDense"):
            mapping["Dense"] = self.addons_layers.SerialDense
        return mapping


@functools.lru_cache(maxsize=None)
def get_backend():
    """The backend object for this process, chosen once."""
    try:
        ipu = importlib.import_module("tensorflow.python.ipu")
    except ImportError:
        return PortableBackend()
    try:
        addons = importlib.import_module("ipu_tensorflow_addons.keras.layers")
    except ImportError:
        addons = None
    return IpuBackend(ipu, addons)


def backend():
    """`"ipu"` or `"portable"`: the backend the passes use here.

    Example:
        >>> kip.backend()
        'portable'
    """
    return get_backend().name


def ipu_replacements(serial_dense=False):
    """The default IPU `Replace` pass (empty off IPU).

    Example:
        >>> passes = [kip.passes.Expand(), *kip.ipu_replacements()]
    """
    import keras

    from keras_ipu_plugin.passes.replace import Replace
    from keras_ipu_plugin.passes.replace import Replacement

    mapping = get_backend().replacements(serial_dense=serial_dense)
    if not mapping:
        return []
    # Weights copy by name where the IPU layer keeps Keras's weight layout;
    # Dropout has none, and Popnn LSTM / GRU keep their gates differently.
    copied = {"LayerNormalization", "Embedding", "Dense"}
    return [Replace({getattr(keras.layers, name): Replacement(cls, copy_weights=name in copied)
                     for name, cls in mapping.items()})]
