"""Graph nodes for the variable writes a layer's `call` makes.

keras.io's PixelCNN masks its kernel on every call,
`self.conv.kernel.assign(self.conv.kernel * self.mask)`, then calls the
conv; a step counter does `self.count.assign_add(1)`; an EMA codebook
`self.ema.assign(decay * self.ema + (1 - decay) * stats)`. Traced, such a
write is recorded as a node (`frontend/trace/writes.py`), as a read is
(`reads.py`):

- `VariableWrite(value, after=[...])` makes the write when the graph runs
  (`variable.assign(value)`, `assign_add`, `assign_sub`: Keras's own methods,
  so shape checks and dtype conversion are the original's) and returns the
  variable's value after it. It holds the very variable object, as a
  `VariableRead` does. `after` are tensors that must exist before the write
  is made (the reads and layer calls that came before it in `call`, which
  must see the old value); the node ignores their values.
- `AfterWrites(x, writes)` returns `x` once `writes` (outputs of
  `VariableWrite` nodes) are computed: a layer that uses the variable after
  the write in `call` (the PixelCNN's conv) is called on it, so it runs
  after the write.

The order is in the graph as data dependencies: Keras runs a functional
model's nodes in an order that respects them, and in a `tf.function`
TensorFlow orders the operations on one variable as they were made.
A write is never differentiated: `assign` has no gradient, and reads after
it get the gradient, as in the original.

Example:
    >>> write = VariableWrite(layer.count, "assign_add", like=layer, name="count.assign_add")
    >>> new_count = write(np.ones(()), after=[])
    >>> y = AfterWrites(name="after_writes")(x, [new_count])   # x, once written
"""

import keras
import tensorflow as tf

from keras_ipu_plugin.layers import saved_values
from keras_ipu_plugin.layers.state.added_loss import AddedLoss
from keras_ipu_plugin.layers.state.reads import HoldsVariable
from keras_ipu_plugin.layers.state.reads import ReadTensor

#: The write methods a node can make (the names of `keras.Variable`'s).
METHODS = ("assign", "assign_add", "assign_sub")


@keras.saving.register_keras_serializable(package="keras_ipu_plugin")
class VariableWrite(HoldsVariable, keras.layers.Layer):
    """Writes `variable` (the same object) with `method` when called on
    `value`; returns the variable's value after the write.

    `like`: the layer whose `call` made the write; the node takes its dtype
    policy and `autocast`, so the value read after the write is cast as a
    read in that `call` would be.

    Example:
        >>> write = VariableWrite(conv.kernel, "assign", like=block, name="conv.kernel.assign")
        >>> masked = write(kernel * mask, after=[read_of_kernel])
    """

    def __init__(self, variable=None, method="assign", like=None, *, variable_shape=None,
                 variable_dtype=None, variable_trainable=True, variable_owner=None, **kwargs):
        if method not in METHODS:
            raise ValueError(f"Unknown write method {method!r}: one of {', '.join(METHODS)}.")
        if like is not None:
            kwargs.setdefault("dtype", like.dtype_policy)
            kwargs.setdefault("autocast", like.autocast)
            kwargs.setdefault("trainable", like.trainable)
        super().__init__(**kwargs)
        self._hold(variable, variable_shape, variable_dtype, variable_trainable, variable_owner)
        self.method = method
        self.built = True

    def call(self, value, after=()):
        del after  # only orders the write after them
        getattr(self.variable, self.method)(value)
        return tf.identity(self.variable.value)

    def compute_output_spec(self, value, after=()):
        del value, after
        return ReadTensor(self.variable)

    def get_config(self):
        config = super().get_config()
        config.update(autocast=self.autocast, method=self.method, **self._variable_config())
        return config

    @classmethod
    def from_config(cls, config):
        entry = f"VariableWrite `{config.get('name')}`"
        saved_values.saved_layer_config(config, entry, (
            "method", "variable_shape", "variable_dtype", "variable_trainable",
            "variable_owner"))
        method = config.get("method")
        if method not in METHODS:
            saved_values.refuse(entry, "method", f"one of {', '.join(METHODS)}", method)
        cls.check_variable_config(config, entry)
        return cls(**config)


@keras.saving.register_keras_serializable(package="keras_ipu_plugin")
class AfterWrites(keras.layers.Layer):
    """Returns `x` (with its Keras mask) once `writes` are computed.

    Example:
        >>> x_after = AfterWrites(name="after_writes")(x, [written_kernel])
    """

    def __init__(self, **kwargs):
        # `x` passes through as it is: never cast by a policy.
        kwargs["autocast"] = False
        super().__init__(**kwargs)
        self.supports_masking = True
        self.built = True

    def call(self, x, writes):
        with tf.control_dependencies(list(writes)):
            return tf.identity(x)

    def compute_output_spec(self, x, writes):
        del writes
        return keras.KerasTensor(x.shape, dtype=x.dtype)

    def compute_mask(self, x, mask=None):
        return mask

    def get_config(self):
        config = super().get_config()
        config.pop("autocast", None)
        return config

    @classmethod
    def from_config(cls, config):
        saved_values.saved_layer_config(config, f"AfterWrites `{config.get('name')}`")
        return cls(**config)


def is_write_node(operation):
    """Whether `operation` is one of the layers above, or a loss `call`
    added (`AddedLoss`): a node a trace makes for an effect of `call`,
    named by the trace, never expanded, run as itself."""
    return isinstance(operation, (VariableWrite, AfterWrites, AddedLoss))


__all__ = ["METHODS", "VariableWrite", "AfterWrites", "is_write_node"]
