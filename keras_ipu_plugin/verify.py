"""Check that a converted model computes what the original computes.

Compares outputs, and the gradients of a fixed random projection of the
outputs with respect to every trainable variable of the original, on one
batch, in inference mode (so nothing stateful — BatchNormalization moving
statistics, RNG — changes the models while checking).
"""

import keras
import numpy as np
import tensorflow as tf

from keras_ipu_plugin.errors import ConversionError
from keras_ipu_plugin.state import replay_state


def check_equivalent(
    original, converted, x, *, rtol=1e-4, atol=1e-5, what="converted", gradients=True
):
    """Raise `ConversionError` naming the first output or variable that differs.

    With `gradients=False` only outputs are compared (for a model whose
    layers a pass replaced, so the variables differ).

    Example:
        >>> check_equivalent(model, converted, x)   # silent when they match
    """
    variables = list(original.trainable_variables) if gradients else []
    # Both runs start from the same variable state, put back afterwards: a
    # model drawing random numbers at inference (a VAE's sampling layer)
    # sees the same draws in each, and verifying moves no counter.
    with replay_state(original, converted) as replay:
        reference, reference_grads = _outputs_and_gradients(original, x, variables)
        replay()
        result, result_grads = _outputs_and_gradients(converted, x, variables)

    ref_paths = keras.tree.flatten_with_path(reference)
    res_leaves = keras.tree.flatten(result)
    if len(ref_paths) != len(res_leaves):
        raise ConversionError(
            f"The {what} model returns {len(res_leaves)} outputs; the original "
            f"returns {len(ref_paths)}."
        )
    for (path, expected), actual in zip(ref_paths, res_leaves):
        name = ".".join(str(p) for p in path) or "output"
        _compare(f"output `{name}`", expected, actual, rtol, atol, what)
    for variable, expected, actual in zip(variables, reference_grads, result_grads):
        if expected is None and actual is None:
            continue
        if expected is None or actual is None:
            raise ConversionError(
                f"The gradient w.r.t. variable `{variable.path}` is "
                f"{'missing' if actual is None else 'present'} in the {what} "
                f"model but {'present' if actual is None else 'missing'} in the "
                "original."
            )
        _compare(f"the gradient w.r.t. variable `{variable.path}`",
                 expected, actual, rtol, atol, what)


def _outputs_and_gradients(model, x, variables):
    """Outputs and gradients, computed in a replica context.

    Under a `tf.distribute` strategy scope the caller is in the cross-replica
    context, where a mirrored variable has no single handle to differentiate
    against; the computation then runs as one replica's step (every replica
    sees the whole batch, so the first replica's result is the answer).
    """
    strategy = tf.distribute.get_strategy()
    if not (tf.distribute.has_strategy() and tf.distribute.in_cross_replica_context()):
        return _outputs_and_gradients_here(model, x, variables)
    per_replica = strategy.run(
        _outputs_and_gradients_here, args=(model, x, variables)
    )

    def first_replica(value):
        return None if value is None else strategy.experimental_local_results(value)[0]

    outputs, gradients = per_replica
    return (
        keras.tree.map_structure(first_replica, outputs),
        [first_replica(g) for g in gradients],
    )


def _outputs_and_gradients_here(model, x, variables):
    with tf.GradientTape() as tape:
        outputs = model(x, training=False)
        scalar = _projection(outputs)
    gradients = tape.gradient(scalar, [_tf_variable(v) for v in variables])
    return outputs, gradients


def _tf_variable(variable):
    return getattr(variable, "value", variable)


def _projection(outputs):
    total = tf.constant(0.0)
    for index, tensor in enumerate(keras.tree.flatten(outputs)):
        tensor = tf.convert_to_tensor(tensor)
        if not tensor.dtype.is_floating:
            continue
        weights = np.random.RandomState(index).uniform(
            0.5, 1.5, size=[d or 1 for d in tensor.shape]
        )
        total += tf.reduce_sum(tf.cast(tensor, tf.float32) * weights.astype("float32"))
    return total


def _compare(label, expected, actual, rtol, atol, what):
    expected = np.asarray(tf.convert_to_tensor(expected))
    actual = np.asarray(tf.convert_to_tensor(actual))
    if expected.shape != actual.shape:
        raise ConversionError(
            f"{label} has shape {actual.shape} in the {what} model and "
            f"{expected.shape} in the original."
        )
    if expected.dtype.kind in "fc":
        scale = max(float(np.max(np.abs(expected))) if expected.size else 0.0, 1.0)
        close = np.allclose(actual, expected, rtol=rtol, atol=atol * scale, equal_nan=True)
    else:
        close = np.array_equal(actual, expected)
    if not close:
        difference = (
            float(np.max(np.abs(actual.astype("float64") - expected.astype("float64"))))
            if expected.dtype.kind in "fciub" and expected.size else "n/a"
        )
        raise ConversionError(
            f"{label} differs between the original and the {what} model "
            f"(max abs difference {difference})."
        )
