"""Keras's trainer: its step functions, `compile`'s settings, the symbolic build under a strategy, its progress output.

Part of `_compat`, the one package that touches private Keras / TensorFlow
APIs (see its `__init__`)."""

import sys

import tensorflow as tf


def make_step_function(model, step_function, jit_compile=None):
    """Keras's own train/test function maker (`TensorFlowTrainer._make_function`)
    around `step_function`: distribution, `jit_compile`, `steps_per_execution`
    and `run_eagerly` behave exactly as in `fit` / `evaluate`.

    `jit_compile`: XLA or not for this function where it differs from the
    model's compiled setting (None: the model's). The model is not changed:
    Keras's maker reads the setting from a view of it."""
    if jit_compile is None or bool(jit_compile) == bool(model.jit_compile):
        return model._make_function(step_function)
    return type(model)._make_function(_JitCompileView(model, bool(jit_compile)), step_function)


class _JitCompileView:
    """`model` as Keras's function maker reads it, but for `jit_compile`:
    every other attribute is the model's, read when the function reads it
    (`steps_per_execution` at each call, as on the model)."""

    def __init__(self, model, jit_compile):
        self.__dict__["_model"] = model
        self.__dict__["jit_compile"] = jit_compile

    def __getattr__(self, name):
        return getattr(self.__dict__["_model"], name)


def auto_jit_compile(model):
    """What Keras's `compile(jit_compile="auto")` resolves to for `model` on
    this machine (XLA where there is a GPU and no distribution strategy)."""
    return bool(model._resolve_auto_jit_compile())


def model_strategy(model):
    """The strategy `model` was created under, or None (Keras keeps it in a
    private attribute; `model.distribute_strategy` falls back to the current
    one, which hides whether the model was built inside a scope)."""
    return getattr(model, "_distribute_strategy", None)


def symbolic_build_from_one_replica(model, iterator=None, data_batch=None):
    """Keras's `_maybe_symbolic_build`, shaping the build from one replica's
    share of the first batch.

    Keras 3 (to at least 3.15) reduces a distributed first batch with
    `strategy.reduce("MEAN", ...)`, which fails under
    MultiWorkerMirroredStrategy ("Attempt to convert a value (PerReplica...)");
    only its shapes and dtypes matter here, so one replica's values do.
    """
    strategy = getattr(model, "_distribute_strategy", None)
    if strategy is None:
        return
    if iterator is not None:
        for _, _, epoch_iterator in iterator:
            batch = next(epoch_iterator)
            data_batch = tf.nest.map_structure(
                lambda v: strategy.experimental_local_results(v)[0]
                if isinstance(v, tf.distribute.DistributedValues) else v,
                batch,
            )
            break
    with strategy.scope():
        model._symbolic_build(data_batch=data_batch)


class OneReplicaSymbolicBuild:
    """A mixin for a `keras.Model` subclass of ours whose symbolic build
    takes one replica's batch (see `symbolic_build_from_one_replica`).

    Overriding Keras's private `_maybe_symbolic_build` is private access, so
    it lives here, in the one module allowed it.
    """

    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        symbolic_build_from_one_replica(self, iterator, data_batch)


def reduces_across_workers(strategy):
    """Whether Keras reduces step outputs with a collective across workers
    (MultiWorkerMirroredStrategy with more than one worker)."""
    extended = getattr(strategy, "extended", None)
    return isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy) and bool(
        getattr(extended, "_in_multi_worker_mode", lambda: False)()
    )


def compile_arguments(model):
    """The keyword arguments `model.compile` was last called with (Keras keeps
    them only in a private attribute), or None before `compile`."""
    config = getattr(model, "_compile_config", None)
    return None if config is None else dict(config.config)


def compile_config(model):
    """The object Keras keeps for `model`'s last `compile` call (a new one at
    each call), or None before `compile`."""
    return getattr(model, "_compile_config", None)


def saving_to_hdf5():
    """Whether Keras's legacy HDF5 writer (`model.save("m.h5")`,
    `keras.saving.save_model(model, "m.h5")`) is on the stack: it reads a
    model's config under its own names, which `load_model` cannot resolve
    for the plugin's registered classes."""
    frame = sys._getframe(1)
    while frame is not None:
        if (frame.f_code.co_name == "save_model_to_hdf5"
                and frame.f_globals.get("__name__", "").startswith("keras.src.legacy.saving")):
            return True
        frame = frame.f_back
    return False


def print_msg(message):
    """Print as Keras's progress bar does (`io_utils.print_msg`: to stdout,
    or to absl logging when interactive logging is off)."""
    from keras.src.utils import io_utils

    io_utils.print_msg(message)


def loss_tracker(model):
    """The `Mean` metric Keras's own `train_step` feeds the loss to (no
    public accessor; `model.metrics` lists it without saying which it is).
    The pipelined step (`training/pipelined/step.py`) feeds it the same."""
    return model._loss_tracker
