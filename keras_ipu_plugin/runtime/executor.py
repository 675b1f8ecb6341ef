"""Run a `KipFunctional` with its annotations taking effect.

The model's calls become kip's `Graph` (`run_graph.graph_to_run`: each node
with its operation, `training` and annotations), which the `Interpreter`
runs with the registered run-time effects: recompute segments, outlined
bodies and stage placement (`runtime/effects/`), and those of any other
pass (`interpreter.register_run_effect`).

Example:
    >>> executor = executor_for(passed, get_backend())
    >>> outputs = executor(inputs, training=True, context={"training": True})
"""

import keras
import tensorflow as tf

from keras_ipu_plugin import _compat
from keras_ipu_plugin.runtime import effects  # noqa: F401 (registers the built-in effects)
from keras_ipu_plugin.runtime.distribution import strategy_owning
from keras_ipu_plugin.runtime.interpreter import Interpreter
from keras_ipu_plugin.runtime.run_graph import graph_to_run


def executor_for(model, backend):
    """The `Interpreter` running `model` (a `KipFunctional`) on `backend`;
    made once per model, on its first call that needs it.

    Example:
        >>> executor_for(passed, get_backend()).steps[0].recompute
        True
    """
    return Interpreter(graph_to_run(model), backend, owner=model,
                       stage_devices=model.kip_stage_devices,
                       output_structure=_compat.output_structure(model))


def train_graph_ops(model):
    """Number of ops in a traced training step of `model` (forward pass in
    training mode and the gradients of its outputs): what outlining shrinks.

    Example:
        >>> train_graph_ops(passed)
        144
    """
    specs = keras.tree.map_structure(
        lambda tensor: tf.TensorSpec(tensor.shape, tensor.dtype), model.input
    )

    strategy = strategy_owning(model.trainable_variables)

    def one_replica(inputs):
        # Under a scope of its own, as Keras's `fit` calls the model: a
        # model's root scope may not start with `_` (a class `_Net`).
        with tf.GradientTape() as tape, tf.name_scope("train_step"):
            outputs = model(inputs, training=True)
            loss = tf.add_n([
                tf.reduce_sum(tf.cast(output, "float32"))
                for output in keras.tree.flatten(outputs)
                if output.dtype.is_floating
            ])
        return tape.gradient(loss, model.trainable_variables)

    @tf.function(autograph=False)
    def step(inputs):
        # Mirrored variables can only be read inside a replica.
        return strategy.run(one_replica, args=(inputs,))

    return len(step.get_concrete_function(specs).graph.get_operations())
