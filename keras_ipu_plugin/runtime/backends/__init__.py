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
- pipeline stages: a stage index per layer (`model.kip_layer_stages`), and
  `tf.device` placement when the model is given stage devices.

IPU (Graphcore's Poplar SDK, `backends.ipu.IpuBackend`): written against
SDK 3.4 but never run on an IPU -- that SDK's TensorFlow 2.6 / Keras 2.6
cannot import this Keras 3 library (see the README, "The IPU backend").

Example:
    >>> kip.backend()
    'portable'
"""

import contextlib
import functools
import importlib

import tensorflow as tf

from keras_ipu_plugin.errors import IpuError
from keras_ipu_plugin.runtime.backends.ipu import IpuBackend
from keras_ipu_plugin.runtime.recompute_grad import recompute_grad


class PortableBackend:
    """Recompute by checkpointed segments (`recompute.recompute_grad`),
    outline by shared `tf.function`s, stages by `tf.device`."""

    name = "portable"
    recomputes_segments = True
    static_batch = False

    def checkpoint_segment(self, fn, anchored=None):
        return recompute_grad(fn, anchored)

    def checkpoint_outputs(self, tensors):  # pragma: no cover - not used
        return tensors

    def outline(self, fn, **kwargs):
        return tf.function(fn, autograph=False, reduce_retracing=True)

    def stage_scope(self, stage, devices):
        if not devices:
            return contextlib.nullcontext()
        return tf.device(devices[stage % len(devices)])

    def check_stage_devices(self, names, where):
        """`ValueError` naming the devices in `names` this process does not
        have (`where` names the setting that gave them): TensorFlow's soft
        placement would run such a stage elsewhere without a word."""
        missing = missing_devices(names or ())
        if missing:
            have = ", ".join(device.name for device in tf.config.list_logical_devices())
            raise ValueError(
                f"{where} places stages on {', '.join(map(repr, missing))}, which this "
                f"process does not have (its devices: {have}); give devices it has, or "
                "leave devices out to pipeline over the visible GPUs.")

    def assign_stages(self, model, stages):
        """Portable stages are the `kip_layer_stages` mapping on the model."""
        return stages

    def ipu_layers(self):
        """No IPU layers here: the IPU Replace preset is empty."""
        return None

    def configure(self, *, recomputes=False, configure_system=True, **ipu_options):
        """Nothing to configure; IPU-only options are refused, not ignored."""
        given = sorted(key for key, value in ipu_options.items() if value is not None)
        if given:
            raise IpuError(
                f"kip.scope: {', '.join(given)} configure the IPU, but the backend "
                "here is portable (tensorflow.python.ipu does not import)."
            )

    def default_strategy(self):
        return tf.distribute.get_strategy()


def missing_devices(names):
    """The names in `names` that match no device of this process.

    TensorFlow's soft placement would run a stage placed on a device that
    does not exist on the current one without a word, and the report would
    still say where each stage runs: such names are an error instead. A name
    with a job (`/job:worker/task:1/device:GPU:0`) is another process's
    device, which this process cannot list, so it is taken as given.

    Example:
        >>> missing_devices(["/CPU:0", "/GPU:7"])  # on a machine without GPUs
        ['/GPU:7']
    """
    local = set()
    for device in tf.config.list_logical_devices():
        spec = tf.DeviceSpec.from_string(device.name)
        local.add((spec.device_type.upper(), spec.device_index))
    missing = []
    for name in names:
        try:
            spec = tf.DeviceSpec.from_string(name)
        except (ValueError, TypeError):
            missing.append(name)
            continue
        if spec.job is not None:
            continue
        if spec.device_type is None or (spec.device_type.upper(), spec.device_index or 0) not in local:
            missing.append(name)
    return missing


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
