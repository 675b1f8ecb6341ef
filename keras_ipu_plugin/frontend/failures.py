"""Reasons for failures whose cause TensorFlow's or Keras's message tells.

A layer whose `call` cannot be traced stays whole, and the report says why.
The message of the error alone ("`add_loss()` can only be called from inside
`build()` or `call()`, on a tensor input", "Failed to convert elements of
SparseTensor") says neither what happened in the user's code nor what to
write instead; `known_failure` maps the errors whose cause is known to a
reason that does (`tracing._describe_failure` frames every other error).

Example:
    >>> known_failure("`add_loss()` can only be called ...", " in `vq`")
    '`call` adds a loss computed from its inputs (`self.add_loss(...)`) in `vq`: ...'
"""

import re

# (pattern of the error's message, reason; `{at}`: where, as
# ` (`file:line: source`) in `layer``)
_KNOWN_FAILURES = (
    (re.compile(r"`add_loss\(\)` can only be called"),
     "`call` adds a loss computed from its inputs (`self.add_loss(...)`){at}: a graph of "
     "Keras layers has no node for it, so the layer runs whole (it still trains, with its "
     "loss); to expand it, return the loss as an output and add it in `train_step` or "
     "`compute_loss`"),
    (re.compile(r"Failed to convert elements of SparseTensor"),
     "`call` gives a TensorFlow function a tensor Keras marked sparse{at} (the product of "
     "a symbolic tensor and a concrete `tf.Tensor` is marked sparse): the layer runs whole "
     "(it still trains); hold the concrete tensor as a NumPy array or a Keras weight, or "
     "write the function with `keras.ops`, for the layer to expand"),
)


def known_failure(message, at):
    """The reason for an error whose `message` tells the cause, else None;
    `at` says where it happened."""
    for pattern, reason in _KNOWN_FAILURES:
        if pattern.search(message):
            return reason.format(at=at)
    return None


__all__ = ["known_failure"]
