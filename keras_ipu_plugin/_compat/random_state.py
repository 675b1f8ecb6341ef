"""TensorFlow's stateful random draws and global random state.

Part of `_compat`, the one package that touches private Keras / TensorFlow
APIs (see its `__init__`)."""

import contextlib
import threading

import tensorflow as tf


# `tf.random.normal(shape)` with no seed generator (a VAE's sampling layer
# written with TensorFlow) draws from a stateful kernel: two runs of the same
# model see other numbers, and no public API replays them. TensorFlow's
# public functions call its generated ops by module attribute (`random_ops`
# calls `gen_random_ops.random_standard_normal`, `tf.random.Generator`
# calls `gen_stateful_random_ops.stateful_standard_normal_v2`), so putting a
# recorder in their place covers every public spelling. On other threads, in
# graph mode and outside the context they draw as they always do; Keras's
# own `keras.random` uses stateless ops, untouched.
_STATEFUL_DRAW_OPS = {
    "tensorflow.python.ops.gen_random_ops": (
        "random_standard_normal", "random_uniform", "random_uniform_int", "truncated_normal",
        "parameterized_truncated_normal", "random_gamma", "random_poisson_v2", "multinomial",
        "random_shuffle"),
    "tensorflow.python.ops.gen_stateful_random_ops": (
        "stateful_standard_normal_v2", "stateful_uniform", "stateful_uniform_int",
        "stateful_uniform_full_int", "stateful_truncated_normal", "stateful_random_binomial"),
}
_draws_state = threading.local()
_draws_lock = threading.Lock()
_draws_users = [0]
_draws_patches = []  # (module, name, original)


class DrawTape:
    """The stateful random draws of the run being recorded, handed out in
    the same order to the run being replayed (`record()` / `replay()`
    before each run). A replayed draw that is not the recorded one (another
    op or shape) draws afresh and is counted in `mismatches`."""

    def __init__(self):
        self.mode = None
        self.draws = []  # (op name, argument signature, value)
        self.position = 0
        self.mismatches = 0
        self.drew = False  # whether a TensorFlow kernel drew while taped

    def record(self):
        self.mode, self.draws, self.mismatches = "record", [], 0

    def replay(self):
        self.mode, self.position = "replay", 0

    def stop(self):
        self.mode = None

    @property
    def recorded(self):
        return len(self.draws)

    def draw(self, name, original, args, kwargs):
        signature = _draw_signature(args, kwargs)
        if self.mode == "record":
            self.drew = True
            value = original(*args, **kwargs)
            self.draws.append((name, signature, value))
            return value
        if self.mode == "replay" and self.position < len(self.draws):
            recorded_name, recorded_signature, value = self.draws[self.position]
            self.position += 1
            if (recorded_name, recorded_signature) == (name, signature):
                return value
        if self.mode == "replay":
            self.mismatches += 1
        self.drew = True
        return original(*args, **kwargs)


def _draw_signature(args, kwargs):
    """What tells one draw from another: the ops' arguments, tensors by
    shape and dtype, small integer tensors (a shape) by value; seeds left
    out (an unseeded draw gets a new op seed each time)."""
    import numpy as np

    def part(value):
        if tf.is_tensor(value) and not isinstance(value, tf.Variable):
            if value.dtype.is_integer and value.shape.rank is not None and value.shape.rank <= 1:
                try:
                    return ("int", tuple(np.asarray(value).reshape(-1).tolist()))
                except Exception:  # a symbolic tensor: graph mode, not taped
                    return ("tensor", str(value.dtype))
            return ("tensor", tuple(value.shape), str(value.dtype))
        if isinstance(value, (list, tuple)):
            return tuple(part(v) for v in value)
        return repr(value) if isinstance(value, (int, float, str, bool, type(None))) else type(value).__name__

    kept = {k: v for k, v in kwargs.items() if k not in ("seed", "seed2", "name")}
    return tuple(part(a) for a in args), tuple(sorted((k, part(v)) for k, v in kept.items()))


def _taped(name, original):
    def draw(*args, **kwargs):
        tape = getattr(_draws_state, "tape", None)
        if tape is None or tape.mode is None or not tf.executing_eagerly():
            return original(*args, **kwargs)
        return tape.draw(name, original, args, kwargs)

    draw.__name__ = name
    return draw


@contextlib.contextmanager
def taped_stateful_draws():
    """A `DrawTape` for TensorFlow's stateful random draws on this thread
    while the context lasts; TensorFlow's global random state (the eager
    op-seed sequence of `tf.random.set_seed`, the global `tf.random.Generator`
    when one exists) is put back as it was when the context ends, so that
    the runs made inside it leave the user's random numbers as they were.

    Example:
        >>> with taped_stateful_draws() as tape:
        ...     tape.record(); a = tf.random.normal((2,))
        ...     tape.replay(); b = tf.random.normal((2,))
        >>> bool(tf.reduce_all(a == b))
        True
    """
    import importlib

    saved = _global_random_state()
    with _draws_lock:
        if _draws_users[0] == 0:
            for module_name, names in _STATEFUL_DRAW_OPS.items():
                module = importlib.import_module(module_name)
                for name in names:
                    original = getattr(module, name, None)
                    if original is not None:
                        _draws_patches.append((module, name, original))
                        setattr(module, name, _taped(name, original))
        _draws_users[0] += 1
    outer = getattr(_draws_state, "tape", None)
    tape = _draws_state.tape = DrawTape()
    try:
        yield tape
    finally:
        _draws_state.tape = outer
        with _draws_lock:
            _draws_users[0] -= 1
            if _draws_users[0] == 0:
                while _draws_patches:
                    module, name, original = _draws_patches.pop()
                    setattr(module, name, original)
        _put_back_global_random_state(saved, tape.drew)


def _global_random_state():
    from tensorflow.python.eager import context
    from tensorflow.python.ops import stateful_random_ops

    rng = getattr(context.context(), "_rng", None)
    generator = stateful_random_ops.global_generator  # None until first asked for
    return (rng, rng.getstate() if rng is not None else None,
            generator, None if generator is None else generator.state.numpy())


def _put_back_global_random_state(saved, drew):
    """The op-seed sequence and the global generator as they were; where a
    kernel drew, TensorFlow's kernels are reset too (as `tf.random.set_seed`
    resets them): the op seeds handed out again would otherwise find the
    kernels the taped runs advanced, and draw other numbers than without
    those runs. (A kernel with an explicit op seed that drew before the
    context then restarts its sequence, as after `tf.random.set_seed`.)"""
    from tensorflow.python.eager import context

    rng, rng_state, generator, generator_state = saved
    if rng is not None:
        rng.setstate(rng_state)
    if generator is not None:
        generator.state.assign(generator_state)
    if drew:
        context.context().clear_kernel_cache()
