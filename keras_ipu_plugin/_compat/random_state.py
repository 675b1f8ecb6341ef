"""TensorFlow's stateful random draws and global random state: the ops a
recorder takes the place of, and the state put back after runs that drew
(`frontend/verify/runs.py`'s `taped_stateful_draws` is the recorder).

Part of `_compat`, the one package that touches private Keras / TensorFlow
APIs (see its `__init__`)."""

import importlib


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


def swap_stateful_draw_ops(wrap):
    """Put `wrap(name, original)` in place of each of TensorFlow's stateful
    random draw ops, where its public functions call them; returns
    `[(module, name, original)]` for `restore_stateful_draw_ops`."""
    swapped = []
    for module_name, names in _STATEFUL_DRAW_OPS.items():
        module = importlib.import_module(module_name)
        for name in names:
            original = getattr(module, name, None)
            if original is not None:
                swapped.append((module, name, original))
                setattr(module, name, wrap(name, original))
    return swapped


def restore_stateful_draw_ops(swapped):
    """Put back what `swap_stateful_draw_ops` replaced (emptying `swapped`)."""
    while swapped:
        module, name, original = swapped.pop()
        setattr(module, name, original)


def global_random_state():
    """TensorFlow's global random state, for `put_back_global_random_state`."""
    from tensorflow.python.eager import context
    from tensorflow.python.ops import stateful_random_ops

    rng = getattr(context.context(), "_rng", None)
    generator = stateful_random_ops.global_generator  # None until first asked for
    return (rng, rng.getstate() if rng is not None else None,
            generator, None if generator is None else generator.state.numpy())


def put_back_global_random_state(saved, drew):
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
