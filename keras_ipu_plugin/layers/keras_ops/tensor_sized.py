"""`TensorSizedOperation`: a `keras.ops` call given a graph tensor where
Keras takes a Python size.

keras.io's graph attention network normalises per target node with
`ops.segment_sum(scores, targets, num_segments=ops.max(targets) + 1)` and
`ops.repeat(sums, ops.bincount(targets))`. Run on TensorFlow tensors, Keras
hands the size straight to TensorFlow, which takes a tensor there; on
symbolic tensors, Keras keeps it in the operation (`SegmentSum.num_segments`)
and fails working out the output shape ("Cannot convert ... to a shape").
While tracing, such a call is recorded as this operation
(`frontend/idioms.py`): it holds the Keras operation with those
attributes empty, takes their tensors as graph inputs, and when the graph
runs calls the very same Keras operation with them filled in, so the result
is Keras's own (TensorFlow's shape inference gives the output spec: a size
only the data knows is None). Which operations and attributes may be given
tensors is one explicit table (`_compat.tensor_size_attributes`); a saved
model naming anything else fails to load.

Example:
    ```python
    op = TensorSizedOperation(SegmentSum(None), ["num_segments"])
    op(num_segments, data, segment_ids).shape   # num_segments: a graph scalar
    # -> (None, 4)
    ```
"""

import copy

import keras

from keras_ipu_plugin import _compat
from keras_ipu_plugin.layers import saved_values


@keras.saving.register_keras_serializable(package="keras_ipu_plugin")
class TensorSizedOperation(keras.Operation):
    """Runs `operation` (a `keras.ops` operation) with each of its
    `attributes` set to the tensor given for it: the call's first
    `len(attributes)` arguments, in that order; the rest are the
    operation's own."""

    def __init__(self, operation, attributes, name=None):
        super().__init__(name=name)
        self.operation = operation
        self.attributes = tuple(attributes)

    def _filled(self, sizes):
        operation = copy.copy(self.operation)
        for attribute, size in zip(self.attributes, sizes):
            setattr(operation, attribute, size)
        return operation

    def call(self, *args, **kwargs):
        saved_values.refuse_constant_call(self, args, kwargs)
        count = len(self.attributes)
        return self._filled(args[:count]).call(*args[count:], **kwargs)

    # `compute_output_spec`: Keras's default, `call` run on placeholders in
    # a scratch graph (TensorFlow's shape inference; a data-dependent size
    # is None).

    def get_config(self):
        return {"operation": keras.saving.serialize_keras_object(self.operation),
                "attributes": list(self.attributes), "name": self.name}

    @classmethod
    def from_config(cls, config):
        entry = f"TensorSizedOperation `{config.get('name')}`"
        saved_values.saved_keys(config, entry, ("operation", "attributes", "name"))
        operation = saved_values.saved_keras_object(
            config.get("operation"), entry, "operation", keras.Operation,
            modules=_compat.KERAS_OPERATION_MODULES)
        allowed = _compat.tensor_size_attributes().get(type(operation))
        if allowed is None:
            saved_values.refuse(entry, "operation",
                                "a keras.ops operation that takes a size as a tensor",
                                type(operation).__name__)
        attributes = config.get("attributes")
        if not isinstance(attributes, list) or not attributes or not all(
                isinstance(name, str) and name in allowed for name in attributes):
            saved_values.refuse(entry, "attributes",
                                f"a list of {type(operation).__name__}'s {sorted(allowed)}",
                                attributes)
        name = config.get("name")
        if name is not None and not isinstance(name, str):
            saved_values.refuse(entry, "name", "a string", name)
        return cls(operation, attributes, name=name)


__all__ = ["TensorSizedOperation"]
