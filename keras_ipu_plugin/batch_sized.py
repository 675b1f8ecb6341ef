"""`BatchSizedOperation`: a `keras.ops` call whose shape holds the batch size.

While tracing, the batch dimension of every tensor is unknown, so
`ops.shape(x)[0]` gives None, and code such as
`ops.broadcast_to(self.cls_token, (ops.shape(x)[0], 1, dim))` records an
operation with None in its target shape, which would fail when the graph
runs. The tracer records such a call as this layer instead: it holds the
operation and fills each None with the batch size of a graph tensor
(`anchor`, an input of the traced call) when the graph runs, so the graph
works for any batch size. The tracer checks first that every unknown
dimension in that call's trace is that batch size (`tracing.py`).

Example:
    >>> op = keras.src.ops.numpy.BroadcastTo(shape=(None, 1, 8))
    >>> layer = BatchSizedOperation(op, ["shape"], name="broadcast_to")
    >>> layer(x, cls_token).shape   # x: (batch, ...), cls_token: (1, 1, 8)
    (batch, 1, 8)
"""

import copy

import keras


@keras.saving.register_keras_serializable(package="keras_ipu_plugin")
class BatchSizedOperation(keras.layers.Layer):
    """Runs `operation` with each None in its shape `attributes` set to the
    batch size of `anchor` (the first argument; the others are the
    operation's own).

    Example:
        >>> BatchSizedOperation(reshape_op, ["newshape"])(x, y)
    """

    def __init__(self, operation, attributes, **kwargs):
        # The operation's inputs keep their dtypes, as they did in `call`.
        kwargs.setdefault("autocast", False)
        super().__init__(**kwargs)
        if isinstance(operation, dict):
            operation = keras.saving.deserialize_keras_object(operation)
        self.operation = operation
        self.attributes = tuple(attributes)
        self.built = True

    def with_batch_size(self, batch_size):
        """A copy of the operation whose unknown dimensions are `batch_size`."""
        operation = copy.copy(self.operation)
        for name in self.attributes:
            shape = getattr(operation, name)
            filled = [batch_size if dim is None else dim for dim in shape]
            setattr(operation, name, type(shape)(filled))
        return operation

    def call(self, anchor, *args, **kwargs):
        batch_size = keras.ops.shape(anchor)[0]
        return self.with_batch_size(batch_size).call(*args, **kwargs)

    def compute_output_spec(self, anchor, *args, **kwargs):
        return self.with_batch_size(anchor.shape[0]).compute_output_spec(*args, **kwargs)

    def get_config(self):
        config = super().get_config()
        config.update(
            operation=keras.saving.serialize_keras_object(self.operation),
            attributes=list(self.attributes),
        )
        return config


def unknown_dimension_attributes(operation):
    """Names of `operation`'s shape attributes (lists / tuples of
    dimensions) that hold None."""
    return [
        name for name, value in vars(operation).items()
        if not name.startswith("_") and isinstance(value, (list, tuple))
        and any(item is None for item in value)
        and all(item is None or isinstance(item, int) for item in value)
    ]


__all__ = ["BatchSizedOperation", "unknown_dimension_attributes"]
