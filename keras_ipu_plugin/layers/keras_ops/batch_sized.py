"""`BatchSizedOperation`: a `keras.ops` call whose shape holds the batch size.

While tracing, the batch dimension of every tensor is unknown, so
`ops.shape(x)[0]` gives None, and code such as
`ops.broadcast_to(self.cls_token, (ops.shape(x)[0], 1, dim))` records an
operation with None in its target shape, which would fail when the graph
runs. The tracer records such a call as this layer instead: it holds the
operation and fills each None with the batch size of a graph tensor
(`anchor`, an input of the traced call) when the graph runs, so the graph
works for any batch size. The tracer checks first that every unknown
dimension in that call's trace is that batch size (`frontend/batch/shapes.py`).

Example:
    ```python
    op = keras.src.ops.numpy.BroadcastTo(shape=(None, 1, 8))
    layer = BatchSizedOperation(op, ["shape"], name="broadcast_to")
    layer(x, cls_token).shape   # x: (batch, ...), cls_token: (1, 1, 8)
    # -> (batch, 1, 8)
    ```
"""

import copy

import keras
import numpy as np

from keras_ipu_plugin import _compat
from keras_ipu_plugin.layers import saved_values


@keras.saving.register_keras_serializable(package="keras_ipu_plugin")
class BatchSizedOperation(keras.layers.Layer):
    """Runs `operation` with each None in its shape `attributes` set to the
    batch size of `anchor` (the first argument; the others are the
    operation's own).

    Example:
        ```python
        BatchSizedOperation(reshape_op, ["newshape"])(x, y)
        ```
    """

    def __init__(self, operation, attributes, multiples=None, offsets=None, divisors=None,
                 **kwargs):
        # The operation's inputs keep their dtypes, as they did in `call`.
        kwargs.setdefault("autocast", False)
        super().__init__(**kwargs)
        if isinstance(operation, dict):  # loaded: checked by from_config
            operation = keras.saving.deserialize_keras_object(operation)
        self.operation = operation
        self.attributes = tuple(attributes)
        # {attribute: the batch size's multiple at each None of it (an int
        # for a one-dimension attribute)}; absent: the batch size itself.
        # Swin's windows are `batch * windows` rows (`window_reverse`).
        self.multiples = dict(multiples or {})
        # {attribute: the constant added to that multiple at each None (an
        # int for a one-dimension attribute)}; absent: none. `ops.zeros(
        # (ops.shape(x)[0] + 1, d))`, `ops.slice(x, [1, 0], [batch - 1, d])`.
        self.offsets = dict(offsets or {})
        # {attribute: the divisor at each None of it (an int for a
        # one-dimension attribute)}; absent: 1. The dimension is then
        # `batch // divisor * multiple + offset`, and a batch size that is
        # no multiple of the divisor raises: keras_hub's Swin divides its
        # `batch * windows` rows by the windows (`B_ // num_win`), traced
        # at multiples of it (`batch/divisions.py`).
        self.divisors = dict(divisors or {})
        self.built = True

    def __call__(self, *args, **kwargs):
        # Before Keras converts arrays to tensors: a call on constants only
        # is a node of an edited file.
        saved_values.refuse_constant_call(self, args, kwargs)
        return super().__call__(*args, **kwargs)

    @staticmethod
    def arguments(operation, anchor, args, kwargs):
        """`(args, kwargs)` of a call of this layer for a call of `operation`:
        `anchor` first, then the operation's tensors; an argument that is
        not a tensor goes by its name. A Keras layer takes only tensors
        positionally, and a nested argument mixing both, as `*args` is,
        not at all: `ops.slice(x, [0, 1, 0], shape)` gives its start indices
        positionally, and the graph failed when it ran."""
        import inspect

        args = tuple(args)
        first_data = next((i for i, arg in enumerate(args) if not _holds_tensors(arg)), len(args))
        if first_data < len(args):
            try:
                bound = inspect.signature(operation.call).bind(*args, **kwargs)
            except TypeError:
                bound = None
            names = list(bound.arguments)[first_data:len(args)] if bound is not None else []
            if bound is not None and len(names) == len(args) - first_data and all(
                bound.signature.parameters[name].kind
                == inspect.Parameter.POSITIONAL_OR_KEYWORD for name in names
            ):
                kwargs = {**kwargs, **{name: bound.arguments[name] for name in names}}
                args = args[:first_data]
        return (anchor,) + args, kwargs

    def with_batch_size(self, batch_size):
        """A copy of the operation whose unknown dimensions are `batch_size`
        (an attribute is a shape, or one dimension such as `ops.repeat`'s
        `repeats`)."""
        operation = copy.copy(self.operation)
        for name in self.attributes:
            shape = getattr(operation, name)
            multiples = self.multiples.get(name)
            offsets = self.offsets.get(name)
            divisors = self.divisors.get(name)
            if shape is None:
                setattr(operation, name, self._dimension(
                    batch_size, multiples or 1, offsets or 0, divisors or 1, name))
                continue
            multiples = multiples or [1] * len(shape)
            offsets = offsets or [0] * len(shape)
            divisors = divisors or [1] * len(shape)
            filled = [self._dimension(batch_size, multiple, offset, divisor, name)
                      if dim is None else dim
                      for dim, multiple, offset, divisor in zip(shape, multiples, offsets,
                                                                divisors)]
            setattr(operation, name, type(shape)(filled))
        return operation

    def _dimension(self, batch_size, multiple, offset, divisor, attribute):
        """`batch_size // divisor * multiple + offset`, refusing a batch size
        that is no multiple of `divisor`: the graph was traced at multiples
        of it only, and the floor of a division is not what a graph made
        from those traces computes elsewhere."""
        if divisor == 1:
            return batch_size * multiple + offset
        message = (
            f"`{self.name}` computes its {attribute} from the batch size divided by "
            f"{divisor}, and is called with a batch size that is no multiple of {divisor}; "
            f"its layer was traced at multiples of {divisor}, where the division is exact, "
            "and what its `call` computes at other batch sizes the graph does not know: "
            f"call it with multiples of {divisor}, leave that layer out of Expand's "
            "targets, or convert with static_batch=True")
        if isinstance(batch_size, (int, np.integer)):
            if batch_size % divisor:
                raise ValueError(f"{message} (batch size {int(batch_size)})")
            return batch_size // divisor * multiple + offset
        import tensorflow as tf

        # A batch size known only when the graph runs (a `tf.function` of an
        # unknown batch): checked then.
        check = tf.debugging.assert_equal(
            tf.math.floormod(batch_size, divisor), tf.zeros_like(batch_size), message=message)
        with tf.control_dependencies([check]):
            return tf.identity(batch_size) // divisor * multiple + offset

    def call(self, anchor, *args, **kwargs):
        batch_size = keras.ops.shape(anchor)[0]
        return self.with_batch_size(batch_size).call(*args, **kwargs)

    def compute_output_spec(self, anchor, *args, **kwargs):
        batch_size = anchor.shape[0]
        if batch_size is not None:
            return self.with_batch_size(batch_size).compute_output_spec(*args, **kwargs)
        try:
            return self.operation.compute_output_spec(*args, **kwargs)
        except Exception:
            # Keras's `Tile` cannot multiply an unknown repeat into its
            # output shape (the functional model is rebuilt on a batch of
            # None): the spec at two batch sizes shows which dimensions
            # follow it.
            return self._spec_at_two_batch_sizes(*args, **kwargs)

    def _spec_at_two_batch_sizes(self, *args, **kwargs):
        step = int(np.lcm.reduce([1] + [d for d in keras.tree.flatten(self.divisors)]))
        two, three = (self.with_batch_size(size * step).compute_output_spec(*args, **kwargs)
                      for size in (2, 3))
        return keras.tree.map_structure(
            lambda a, b: keras.KerasTensor(
                tuple(x if x == y else None for x, y in zip(a.shape, b.shape)),
                dtype=a.dtype, sparse=a.sparse,
            ),
            two, three,
        )

    def get_config(self):
        config = super().get_config()
        config.update(
            operation=keras.saving.serialize_keras_object(self.operation),
            attributes=list(self.attributes),
        )
        if self.multiples:
            config["multiples"] = self.multiples
        if self.offsets:
            config["offsets"] = self.offsets
        if self.divisors:
            config["divisors"] = self.divisors
        return config

    @classmethod
    def from_config(cls, config):
        operation = _checked_saved_operation(config)
        return cls(**{**config, "operation": operation})


#: The keys `get_config` writes (Keras's base layer's and this layer's).
_SAVED_KEYS = ("name", "trainable", "dtype", "operation", "attributes", "multiples", "offsets",
               "divisors")


def _checked_saved_operation(config):
    """The operation of a saved `BatchSizedOperation` config, made once
    every value is of the kind `get_config` writes (a `kip.LoadError`
    naming the node and the key otherwise): a `keras.ops` operation (found
    without importing anything) whose `attributes` are shapes (lists of
    sizes and None) or one size, so that the node runs as saved, never a
    Keras `TypeError` at its first call."""
    entry = f"BatchSizedOperation `{config.get('name') if isinstance(config, dict) else None}`"
    saved_values.saved_keys(config, entry, _SAVED_KEYS)
    saved_values.saved_str(config.get("name"), entry, "name")
    operation = saved_values.saved_keras_object(
        config.get("operation"), entry, "operation", keras.Operation,
        modules=_compat.KERAS_OPERATION_MODULES)
    if isinstance(operation, keras.layers.Layer):
        saved_values.refuse(entry, "operation", "a keras.ops operation",
                            type(operation).__name__)
    shapes = operation.get_config()
    attributes = config.get("attributes")
    if not isinstance(attributes, list) or not attributes or not all(
            isinstance(name, str) and name in shapes and not name.startswith("_")
            and name != "name" for name in attributes):
        saved_values.refuse(entry, "attributes",
                            f"a list of {type(operation).__name__}'s shape arguments",
                            attributes)
    for name in attributes:
        value = getattr(operation, name, None)
        if not (value is None or _is_offset(value) or (isinstance(value, (list, tuple)) and all(
                dim is None or _is_offset(dim) for dim in value))):
            saved_values.refuse(entry, f"operation.{name}", "a shape (ints and null), a size "
                                "or null", value)
    for key, is_value, what in (
            ("multiples", _is_size, "a positive int (or a list of them) for an attribute"),
            ("offsets", _is_offset, "an int (or a list of them) for an attribute"),
            ("divisors", _is_size, "a positive int (or a list of them) for an attribute")):
        _check_per_attribute(entry, config, key, attributes, is_value, what)
    return operation


def _check_per_attribute(entry, config, key, attributes, is_value, what):
    """Refuse a saved `config[key]` that is not a mapping from one of
    `attributes` to a value (or a list of values) `is_value` accepts."""
    values = config.get(key) or {}
    if not isinstance(values, dict):
        saved_values.refuse(entry, key, "a mapping", values)
    for name, value in values.items():
        if name not in attributes or not (
                is_value(value) or (isinstance(value, list) and all(is_value(v) for v in value))):
            saved_values.refuse(entry, f"{key}.{name}", what, value)


def _is_size(value):
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _is_offset(value):
    return isinstance(value, int) and not isinstance(value, bool)


def _holds_tensors(value):
    """Whether `value` is, or holds only, tensors (graph Values included) or
    None, which Keras takes positionally."""
    return all(
        not isinstance(leaf, (int, float, bool, str, np.ndarray, np.generic))
        for leaf in keras.tree.flatten(value))


__all__ = ["BatchSizedOperation"]
