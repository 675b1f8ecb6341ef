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

from keras_ipu_plugin import _keras_internals
from keras_ipu_plugin import inputs as inputs_lib
from keras_ipu_plugin.errors import InputDataError
from keras_ipu_plugin.errors import InputTypeError
from keras_ipu_plugin.functional import mask_semantics
from keras_ipu_plugin.graph import Graph
from keras_ipu_plugin.graph import Node
from keras_ipu_plugin.graph import Value
from keras_ipu_plugin.opaque import OpaqueLayer
from keras_ipu_plugin.opaque import output_specs_of
from keras_ipu_plugin.report import Report
from keras_ipu_plugin.tracing import TraceError
from keras_ipu_plugin.tracing import essential_message
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

    def convert(self, model, data, specs=None):
        """`specs` (a nest like `x` of `inputs.InputSpec`) overrides the input
        shapes taken from the batch: a dimension the caller knows to vary
        (None) stays unknown in the graph."""
        _check_model(model)
        batch = inputs_lib.first_batch(data)
        x = as_tensors(batch.x)
        if specs is None:
            specs = inputs_lib.input_specs(
                x, static_batch=self.static_batch, already_per_replica=batch.per_replica
            )
        # Calling, tracing and verifying build layers and record nodes on
        # the user's objects; a failure part way must not leave any of that
        # behind (a half-built Dense would reject the right data later).
        state = ModelState(model)
        try:
            graph, report = self.trace(model, x, specs)
            converted = graph.rebuild(name=f"{model.name}_functional")
            converted.kip_original_mask = mask_semantics(model)
            if self.verify:
                check_equivalent(model, converted, x)
        except BaseException:
            state.restore()
            raise
        converted.kip_report = report
        return converted

    def trace(self, model, x, specs):
        """The graph IR of `model` and the conversion report."""
        # A model never called is built by one eager call on the batch, which
        # also tells a batch the model rejects (a clear InputDataError) from
        # code that cannot be traced. An already built model is traced
        # straight away: the eager call is then needed only if tracing fails.
        outputs = None if model.built else _call_original(model, x)
        report = Report()
        try:
            graph = trace_model(model, specs, training=self.training)
        except TraceError as error:
            if outputs is None:
                outputs = _call_original(model, x)
            graph = opaque_graph(
                model, specs, outputs, error.reason,
                batch_size=inputs_lib.batch_size_of(x), static_batch=self.static_batch,
            )
            report.add_opaque(model.name, error.reason)
        for node in graph.nodes:
            report.add("convert", node.name, "traced", type(node.operation).__name__)
            if isinstance(node.operation, OpaqueLayer):
                # The whole model, or a dynamic sub-layer kept whole.
                report.add_opaque(node.operation.layer.name, node.opaque_reason)
        return graph, report


class ModelState:
    """A snapshot of what a conversion can change on `model`, to undo it.

    Covers the instance attributes of the model and of every layer in it
    (and of their variable trackers), the contents of the lists, dicts and
    sets those attributes hold (variable lists, node lists, build shapes),
    and the values of non-trainable variables (BatchNormalization moving
    statistics, RNG seeds: a call can change those; nothing in a conversion
    assigns trainable weights).

    Example:
        >>> state = ModelState(model)
        >>> try:
        ...     risky(model)
        ... except Exception:
        ...     state.restore()
        ...     raise
    """

    def __init__(self, model):
        self._objects = []
        for layer in _keras_internals.all_layers(model):
            self._objects.append(_ObjectState(layer))
            tracker = vars(layer).get("_tracker")
            if tracker is not None:
                self._objects.append(_ObjectState(tracker))
        self._values = [
            (variable, np.array(variable.numpy(), copy=True))
            for variable in model.non_trainable_variables
        ]

    def restore(self):
        for state in self._objects:
            state.restore()
        for variable, value in self._values:
            # Only what changed: an assignment can itself fail (a mirrored
            # variable outside its strategy's scope), hiding the real error.
            if not np.array_equal(variable.numpy(), value):
                variable.assign(value)


class _ObjectState:
    """One object's `__dict__`, and the contents of every list / dict / set
    reachable from it through containers only."""

    def __init__(self, obj):
        self.obj = obj
        self.attributes = dict(vars(obj))
        self.containers = []
        seen = set()
        for value in self.attributes.values():
            self._remember(value, seen)

    def _remember(self, value, seen):
        if not isinstance(value, (list, dict, set)) or id(value) in seen:
            return
        seen.add(id(value))
        if isinstance(value, dict):
            self.containers.append((value, dict(value)))
            children = value.values()
        else:
            self.containers.append((value, list(value)))
            children = value
        for child in list(children):
            self._remember(child, seen)

    def restore(self):
        current = vars(self.obj)
        for name in [name for name in current if name not in self.attributes]:
            del current[name]
        for name, value in self.attributes.items():
            if current.get(name, _MISSING) is not value:
                current[name] = value
        # The base-class methods: Keras's tracked containers would re-track
        # (and so re-register) every item put back through their own.
        for container, contents in self.containers:
            if isinstance(container, list):
                list.__setitem__(container, slice(None), contents)
            elif isinstance(container, dict):
                dict.clear(container)
                dict.update(container, contents)
            else:
                set.clear(container)
                set.update(container, contents)


_MISSING = object()


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


def as_tensors(x):
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
            f"({_describe_structure(x)}): {type(error).__name__}: "
            f"{essential_message(error)}"
        ) from error




def _describe_structure(x):
    if isinstance(x, dict):
        return "a dict with keys " + ", ".join(repr(k) for k in x)
    if isinstance(x, (list, tuple)):
        return f"a {type(x).__name__} of {len(x)} tensors"
    return f"one tensor of shape {tuple(x.shape)}"
