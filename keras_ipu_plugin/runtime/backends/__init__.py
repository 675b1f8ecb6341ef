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
    ```python
    kip.backend()
    # -> 'portable'
    ```

`recompute_grad`: gradient checkpointing that keeps gradients as they are.

TensorFlow's `tf.recompute_grad` changes two things an optimizer sees, with
the gradient values unchanged: an input the segment does not use gets zeros
instead of `None` (its unconnected gradients are asked for as ZERO), and a
sparse gradient (`tf.IndexedSlices`, from an embedding lookup) comes out as a
dense tensor (its gradient runs through a nested custom gradient whose
identity ops densify it). Keras's optimizers treat both differently: a
variable with a `None` gradient is skipped (AdamW does not decay it), and a
sparse gradient takes another update path (in a traced step, Adam's weights
ended 2e-2 apart after four steps of a small embedding model). Through
`tf.recompute_grad` Adam/AdamW ended three steps of a BERT-like model 3e-3
away from plain Keras.

This version recomputes the same way (the forward pass runs untaped, the
backward pass runs it again under its own tape, with a data dependency on the
incoming gradient so that XLA cannot hoist the recomputation into the forward
pass) and hands back exactly what the tape gave: `None` and `IndexedSlices`
included.

What it cannot keep is every last bit. The forward pass and the
recomputation run the layers' own ops in the same order (eagerly the results
are bit for bit plain Keras's), but a compiled step is rewritten first, and
the rewrites depend on how many ops read each intermediate tensor:
Grappler's arithmetic optimiser regroups a chain of multiplications by
constants (gelu's `0.5 * x * erfc(-x / sqrt(2))`) and its remapper fuses
matmul, bias and activation only where no other op reads the intermediate,
and XLA fuses (and contracts multiply-adds) by the same count. In plain
Keras the backward pass reads the forward pass's intermediates; here the
forward pass's copy has no such reader and the recomputed copy feeds the
backward pass alone, so each is rewritten otherwise: a segment holding a
gelu Dense gave outputs 2e-7 and gradients 1e-7 (relative) apart, which
all earlier layers' gradients inherit. With Grappler's arithmetic
optimiser and remapper off (graph mode), or XLA's fusion pass off
(`jit_compile`), the gradients are equal, measured on such a model; a
segment of ops no rewrite touches (a Dense without activation) is equal as
it is. Training is then plain Keras's to float rounding, and a weight
whose true gradient is zero (a Dense bias before BatchNormalization, an
attention key bias), whose gradient is rounding noise in both, may take
different Adam steps, of the order of the learning rate each (measured
1e-6 after three steps at 1e-3).
"""

import contextlib
import functools
import importlib

import tensorflow as tf

from keras_ipu_plugin import _compat
from keras_ipu_plugin.errors import IpuError
from keras_ipu_plugin.runtime.backends.ipu import IpuBackend


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
        ```python
        missing_devices(["/CPU:0", "/GPU:7"])  # on a machine without GPUs
        # -> ['/GPU:7']
        ```
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
        ```python
        kip.backend()
        # -> 'portable'
        ```
    """
    return get_backend().name


def recompute_grad(fn, anchored=None):
    """Wrap `fn(*tensors) -> list of tensors` so that its activations are
    recomputed in the backward pass instead of being kept.

    `anchored`: how many leading arguments the recomputation starts from
    (None: all). They are copied behind the incoming gradients (see
    `_after`); the others (a segment's weights, read in the forward pass)
    are passed on as they are: a copy of every weight of the segment, held
    while it recomputes, measured 10 MiB over the plan on a block of six
    Dense(768), and the recomputation waits for the anchored ones anyway.

    Example:
        ```python
        segment = recompute_grad(lambda x, w: [tf.tanh(x @ w)])
        with tf.GradientTape() as tape:
            (y,) = segment(x, w)
        tape.gradient(y, w)   # runs `fn` again
        ```
    """

    @tf.custom_gradient
    def checkpointed(*args):
        with _compat.stop_gradient_recording():
            results = list(fn(*args))

        def gradient(*output_gradients, variables=None):
            variables = list(variables or [])
            with tf.GradientTape() as tape:
                count = len(args) if anchored is None else anchored
                inputs = (_after(output_gradients, args[:count])
                          + [tf.identity(x) for x in args[count:]])
                tape.watch([x for x in inputs if _differentiable(x)])
                tape.watch(variables)
                recomputed = list(fn(*inputs))
            targets, seeds = [], []
            for output, seed in zip(recomputed, output_gradients):
                if seed is not None and _differentiable(output):
                    targets.append(output)
                    seeds.append(seed)
            grads = tape.gradient(targets, list(inputs) + variables, output_gradients=seeds)
            return grads[:len(inputs)], grads[len(inputs):]

        return results, gradient

    return checkpointed


def _dense(gradient):
    return gradient.values if isinstance(gradient, tf.IndexedSlices) else gradient


def _differentiable(tensor):
    return tensor.dtype.is_floating or tensor.dtype.is_complex


def _after(output_gradients, args):
    """Copies of `args` that depend on the incoming gradients, so the
    recomputation runs only once the backward pass reaches the segment
    (XLA ignores control dependencies; a data dependency it must keep).

    It depends on every output's gradient, not only the first: a segment
    that ends inside a residual block also passes on the block's input,
    whose gradient arrives as soon as the block's final add runs backward,
    long before the backward pass reaches the segment. Anchored on that
    one, TensorFlow recomputed the segment early and held its activations
    alongside the later segments' (a 48-layer residual MLP's step peak
    measured 1.5x its plan's estimate)."""
    # Gradients of floating outputs: a segment may also pass on a boolean
    # mask or integer ids, whose incoming "gradient" is a boolean or
    # integer tensor that reduce_max refuses (a segment ending in a Keras
    # mask failed its backward pass so).
    anchors = [_dense(g) for g in output_gradients
               if g is not None and _differentiable(_dense(g))]
    if not anchors or tf.executing_eagerly():
        return [tf.identity(x) for x in args]
    # Always zero (a NaN cast to bool is True too), but computed from the
    # gradients, as `tf.recompute_grad` does; an empty gradient gives -inf.
    firsts = [tf.cast(tf.reduce_max(tf.reshape(tf.math.real(g) if g.dtype.is_complex else g,
                                               [-1])[:1]), tf.float32)
              for g in anchors]
    as_bool = tf.cast(tf.add_n(firsts), tf.bool)
    zero = tf.where(as_bool == as_bool, 0.0, float("nan"))
    return [
        x + tf.cast(zero, x.dtype) if (x.dtype.is_floating or x.dtype.is_integer) else tf.identity(x)
        for x in args
    ]
