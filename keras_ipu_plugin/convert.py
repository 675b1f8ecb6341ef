"""`convert_to_functional`: a subclassed model to a functional one.

The first batch shapes the inputs; `model.call` is traced on symbolic inputs
into the graph IR; the IR is rebuilt as a functional model that calls the
same layer objects (so it shares every variable); the two are then checked
equal on that batch. A model whose `call` cannot be traced becomes one
opaque node that runs the original code.
"""

import keras
import numpy as np
import tensorflow as tf

from keras_ipu_plugin import inputs as inputs_lib
from keras_ipu_plugin.errors import InputDataError
from keras_ipu_plugin.errors import InputTypeError
from keras_ipu_plugin.graph import Graph
from keras_ipu_plugin.graph import Node
from keras_ipu_plugin.graph import Value
from keras_ipu_plugin.opaque import OpaqueLayer
from keras_ipu_plugin.opaque import output_specs_of
from keras_ipu_plugin.report import Report
from keras_ipu_plugin.tracing import TraceError
from keras_ipu_plugin.tracing import trace_model
from keras_ipu_plugin.verify import check_equivalent


def convert_to_functional(model, data, *, training=None, verify=True, static_batch=False):
    """Convert `model` to a functional model sharing its variables.

    Args:
        model: a `keras.Model` (subclassed, functional or sequential).
        data: the first batch, or a dataset to read it from (see
            `inputs.first_batch`); only `x` shapes the inputs.
        training: None to follow the `training` the converted model is
            called with, or True / False to fix the graph in that mode.
        verify: compare outputs and gradients with the original on the
            first batch; raise `kip.ConversionError` on a mismatch.
        static_batch: fix the batch dimension to the per-replica batch of
            the active `tf.distribute` strategy.

    Example:
        >>> model = MyModel()
        >>> converted = kip.convert_to_functional(model, np.zeros((8, 16)))
        >>> converted.trainable_variables[0] is model.trainable_variables[0]
        True
        >>> print(converted.kip_report)
    """
    return Converter(training=training, verify=verify, static_batch=static_batch).convert(
        model, data
    )


class Converter:
    """The one conversion routine every entry point shares."""

    def __init__(self, *, training=None, verify=True, static_batch=False):
        if training not in (None, True, False):
            raise ValueError(f"`training` must be None, True or False; got {training!r}.")
        self.training = training
        self.verify = verify
        self.static_batch = static_batch

    def convert(self, model, data):
        _check_model(model)
        batch = inputs_lib.first_batch(data)
        x = _as_tensors(batch.x)
        specs = inputs_lib.input_specs(
            x, static_batch=self.static_batch, already_per_replica=batch.per_replica
        )
        graph, report = self.trace(model, x, specs)
        converted = graph.rebuild(name=f"{model.name}_functional")
        if self.verify:
            check_equivalent(model, converted, x)
        converted.kip_report = report
        return converted

    def trace(self, model, x, specs):
        """The graph IR of `model` and the conversion report."""
        outputs = _call_original(model, x)
        report = Report()
        try:
            graph = trace_model(model, specs, training=self.training)
        except TraceError as error:
            graph = opaque_graph(
                model, specs, outputs, error.reason,
                batch_size=inputs_lib.batch_size_of(x), static_batch=self.static_batch,
            )
            report.add_opaque(model.name, error.reason)
        for node in graph.nodes:
            report.add("convert", node.name, "traced", type(node.operation).__name__)
        return graph, report


def opaque_graph(model, specs, outputs, reason, *, batch_size, static_batch):
    """A graph of one `OpaqueLayer` node that runs `model`'s own code."""
    layer = OpaqueLayer(
        model, output_specs_of(outputs, batch_size, static_batch), reason=reason
    )
    _build_all_branches(layer, specs)
    input_values = keras.tree.map_structure(
        lambda spec: Value(None, 0, keras.KerasTensor(
            (spec.batch_size,) + spec.shape, dtype=spec.dtype, name=spec.name)),
        specs,
    )
    node = Node(layer.name, layer, (input_values,), {}, output_structure=None)
    node.opaque_reason = reason
    output_tensors = layer.compute_output_spec()
    node.outputs = [
        Value(node, i, t) for i, t in enumerate(keras.tree.flatten(output_tensors))
    ]
    outputs_nest = keras.tree.pack_sequence_as(output_tensors, node.outputs)
    return Graph(specs, input_values, [node], outputs_nest, name=model.name)


def _build_all_branches(layer, specs):
    """Trace the opaque call once in graph mode, so that sub-layers used only
    in branches not taken by the first batch create their variables now,
    before an optimizer is built for the model, instead of mid-training."""
    signature = keras.tree.map_structure(
        lambda spec: tf.TensorSpec((None,) + spec.shape, spec.dtype), specs
    )
    probe = tf.function(lambda inputs: layer(inputs, training=False))
    probe.get_concrete_function(signature)


def _check_model(model):
    if not isinstance(model, keras.Model):
        raise InputTypeError(
            f"Expected a keras.Model to convert; got {type(model).__name__}. "
            "Wrap a single layer in a keras.Model subclass first."
        )


def _as_tensors(x):
    def convert(leaf):
        if isinstance(leaf, np.ndarray) and leaf.dtype == np.float64:
            leaf = leaf.astype(keras.config.floatx())
        return tf.convert_to_tensor(leaf)

    return keras.tree.map_structure(convert, x)


def _call_original(model, x):
    try:
        return model(x, training=False)
    except Exception as error:
        raise InputDataError(
            f"`{model.name}.call` rejected the first batch "
            f"({_describe_structure(x)}): {type(error).__name__}: {error}"
        ) from error


def _describe_structure(x):
    if isinstance(x, dict):
        return "a dict with keys " + ", ".join(repr(k) for k in x)
    if isinstance(x, (list, tuple)):
        return f"a {type(x).__name__} of {len(x)} tensors"
    return f"one tensor of shape {tuple(x.shape)}"
