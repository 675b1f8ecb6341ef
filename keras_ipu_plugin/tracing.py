"""Trace a layer's `call` on symbolic inputs into the graph IR.

Calling `layer.call(...)` (not `layer(...)`) on KerasTensors records one Keras
node per sub-layer or `keras.ops` call made inside it. We walk those nodes
back from the outputs into `graph.Node`s, then undo the node bookkeeping on
the user's layers: the IR is the only record kept, and `Graph.rebuild()`
makes the final functional model.

`training` is traced twice, under an outer `training=True` and `False`:
a sub-layer whose recorded value changes with it follows the model's
`training`; one that does not was pinned by the code (`bn(x, training=False)`).
If the two traces differ in which layers they call, `call` branches on
`training` in Python and cannot be captured by one graph.

`call` runs on a view of the layer (`views.layer_view`) whose user-written
sub-layers work out their output shapes by running their own `call` inline
on the KerasTensors. Keras would otherwise trace each custom block's `call`
in a scratch TensorFlow graph (`compute_output_spec`), several times slower.
A block whose `call` does not run on KerasTensors (TensorFlow ops on them)
falls back to Keras's own way. A block that fails that way too (Python
control flow on a tensor's value) but runs once AutoGraph has converted it
becomes one opaque node (`OpaqueLayer`), so the rest of the model is still
traced. Nodes recorded on views name the user's layers.
"""

import functools
import inspect
import io
import re
import textwrap
import tokenize

import keras
import tensorflow as tf

from keras_ipu_plugin import _keras_internals
from keras_ipu_plugin.graph import FOLLOW
from keras_ipu_plugin.graph import Graph
from keras_ipu_plugin.graph import Node
from keras_ipu_plugin.graph import Value
from keras_ipu_plugin.views import layer_view
from keras_ipu_plugin.views import viewed_layer


class TraceError(Exception):
    """`call` cannot be captured as a graph of Keras layers; `reason` says why."""

    def __init__(self, reason):
        self.reason = reason
        super().__init__(reason)


def accepts_training(layer):
    """Whether `layer.call` has a `training` parameter."""
    return "training" in inspect.signature(layer.call).parameters


def trace_model(model, input_specs, training=None):
    """Trace `model.call` on inputs shaped by `input_specs` into a `Graph`.

    Raises `TraceError` when `call` cannot be captured symbolically.
    """
    inputs = keras.tree.map_structure(lambda spec: spec.keras_input(), input_specs)
    input_values = keras.tree.map_structure(
        lambda tensor: Value(None, 0, tensor), inputs
    )
    placeholders = {
        id(tensor): value
        for tensor, value in zip(
            keras.tree.flatten(inputs), keras.tree.flatten(input_values)
        )
    }
    nodes, outputs = trace_call(
        model, (inputs,), {}, placeholders, training=training, prefix=""
    )
    return Graph(input_specs, input_values, nodes, outputs, name=model.name)


def trace_call(layer, args, kwargs, placeholders, *, training, prefix):
    """Trace `layer.call(*args, **kwargs)`; KerasTensors in `args` / `kwargs`
    must be keys (by id) of `placeholders`, mapping them to graph Values.

    Returns `(nodes, outputs)`: new Nodes named `prefix + layer name` and the
    output structure in terms of Values.
    """
    made = {}  # id(user layer) -> the OpaqueLayer standing for it
    if training is not None:
        return _trace_once(layer, args, kwargs, placeholders, training, prefix, True, made)
    if not _call_mentions_training(type(layer).call):
        # `call` neither reads `training` nor passes it on: every sub-layer
        # takes it from the context, so one trace under `training=True`
        # tells them all (each records True: it follows the model's).
        nodes, outputs = _trace_once(
            layer, args, kwargs, placeholders, True, prefix, False, made
        )
        for node in nodes:
            if node.training is True:
                node.training = FOLLOW
        return nodes, outputs
    nodes_t, outputs_t = _trace_once(
        layer, args, kwargs, placeholders, True, prefix, False, made
    )
    nodes_f, outputs_f = _trace_once(
        layer, args, kwargs, placeholders, False, prefix, False, made
    )
    if list(map(_identity, nodes_t)) != list(map(_identity, nodes_f)):
        only = {n.name for n in nodes_t} ^ {n.name for n in nodes_f}
        raise TraceError(
            "`call` branches on `training` in Python (layers called in one "
            f"mode only: {', '.join(sorted(only)) or 'order differs'})"
        )
    for node_t, node_f in zip(nodes_t, nodes_f):
        node_t.training = _training_mode(node_t, node_f)
    return nodes_t, outputs_t


@functools.lru_cache(maxsize=None)
def _call_mentions_training(function):
    """Whether the source of a `call` uses the name `training` or forwards
    `**kwargs` (unknown source counts as yes)."""
    if any(p.kind is inspect.Parameter.VAR_KEYWORD
           for p in inspect.signature(function).parameters.values()):
        return True
    try:
        source = textwrap.dedent(inspect.getsource(function))
        tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    except (OSError, TypeError, tokenize.TokenError, IndentationError):
        return True
    return any(t.type == tokenize.NAME and t.string == "training" for t in tokens)


def _identity(node):
    # Layers are the user's objects; `keras.ops` operations are created anew
    # at each call, so only their kind can be compared.
    if node.opaque_reason is not None:
        return id(node.operation.layer)
    if node.is_layer:
        return id(node.operation)
    return type(node.operation).__name__


def _training_mode(node_true, node_false):
    in_training, in_inference = node_true.training, node_false.training
    if in_training is None and in_inference is None:
        return None
    if in_training is True and in_inference is False:
        return FOLLOW
    if in_training == in_inference:
        return in_training
    raise TraceError(
        f"layer `{node_true.name}` is called with `training` set against the "
        "model's own training mode"
    )


def _trace_once(layer, args, kwargs, placeholders, training, prefix, pinned, opaque_layers):
    kwargs = dict(kwargs)
    if accepts_training(layer):
        kwargs["training"] = training
    sub_layers = _keras_internals.all_layers(layer)
    view = layer_view(layer, _inline_view_class)
    with _keras_internals.node_lists_snapshot(sub_layers, always=True):
        with _keras_internals.call_context(layer, training):
            try:
                outputs = type(layer).call(view, *args, **kwargs)
            except TraceError:
                raise
            except Exception as error:  # user code failing on symbols
                raise TraceError(_describe_failure(error)) from error
        return _collect(outputs, placeholders, prefix, pinned, opaque_layers)


@functools.lru_cache(maxsize=None)
def _inline_view_class(cls, function):
    """A subclass of `cls` whose symbolic calls run `call` inline (see the
    module docstring); classes that say their own output shape keep it."""
    if cls.compute_output_spec is not keras.layers.Layer.compute_output_spec or (
        cls.compute_output_shape is not keras.layers.Layer.compute_output_shape
    ):
        return type(cls.__name__, (cls,), {"__module__": cls.__module__})
    return type(cls.__name__, (cls,), {
        "__module__": cls.__module__,
        "compute_output_spec": _inline_output_spec,
    })


_OPAQUE = "_kip_opaque"  # in a view's dict: (reason, output specs) when opaque


def _inline_output_spec(self, *args, **kwargs):
    """Output KerasTensors of `self.call(*args, **kwargs)`, run on the
    KerasTensors themselves; Keras's scratch-graph way if that fails, and
    AutoGraph's (the view then stands for an opaque node) if that fails."""
    layers = _keras_internals.all_layers(self)
    try:
        with _keras_internals.node_lists_snapshot(layers, always=True):
            outputs = self.call(*args, **kwargs)
            return keras.tree.map_structure(_fresh_keras_tensor, outputs)
    except Exception:
        pass
    try:
        return super(type(self), self).compute_output_spec(*args, **kwargs)
    except Exception as error:
        layer = viewed_layer(self)  # only views have this method
        try:
            outputs = _autograph_output_spec(layer, args, kwargs)
        except Exception:
            raise error from None
        vars(self)[_OPAQUE] = (_describe_failure(error, default=layer.name), outputs)
        return outputs


def _autograph_output_spec(layer, args, kwargs):
    """Output KerasTensors of `layer`'s call run as an `OpaqueLayer` runs it
    in graph mode (AutoGraph-converted), traced in a scratch graph."""
    from keras_ipu_plugin.opaque import autograph_call

    symbols = [leaf for leaf in keras.tree.flatten((args, kwargs))
               if isinstance(leaf, keras.KerasTensor)]

    def run(*tensors):
        supply = iter(tensors)
        filled_args, filled_kwargs = keras.tree.map_structure(
            lambda leaf: next(supply) if isinstance(leaf, keras.KerasTensor) else leaf,
            (args, kwargs),
        )
        return autograph_call(layer, filled_args, filled_kwargs)

    function = tf.function(run, autograph=False)
    traced = function.get_concrete_function(
        *[tf.TensorSpec(t.shape, t.dtype) for t in symbols]
    )
    return keras.tree.map_structure(
        lambda t: keras.KerasTensor(t.shape, dtype=t.dtype), traced.structured_outputs
    )


def _fresh_keras_tensor(tensor):
    if not isinstance(tensor, keras.KerasTensor):
        raise TypeError(f"`call` returned a {type(tensor).__name__}")
    return keras.KerasTensor(tensor.shape, dtype=tensor.dtype, sparse=tensor.sparse,
                             ragged=tensor.ragged)


def _collect(outputs, placeholders, prefix, pinned, opaque_layers=None):
    """Walk Keras nodes back from `outputs` into Nodes in topological order,
    naming the user's layers where views were called; `opaque_layers`
    collects the OpaqueLayers made (see `_opaque_layer`)."""
    opaque_layers = {} if opaque_layers is None else opaque_layers
    values = dict(placeholders)  # id(KerasTensor) -> Value
    nodes = []
    visited = set()

    def visit_tensor(tensor):
        if id(tensor) in values:
            return
        keras_node, _ = _keras_internals.producing_node(tensor)
        if keras_node is None or _keras_internals.is_input_node(keras_node):
            raise TraceError(
                "`call` uses a tensor that does not come from its inputs "
                f"({tensor!r})"
            )
        visit_node(keras_node)

    def visit_node(keras_node):
        if id(keras_node) in visited:
            return
        visited.add(id(keras_node))
        args, kwargs = _keras_internals.node_arguments(keras_node)
        for tensor in keras_node.arguments.keras_tensors:
            visit_tensor(tensor)
        operation = viewed_layer(keras_node.operation)
        if operation is None:  # not a view: a Keras layer or operation
            operation = keras_node.operation
        opaque = vars(keras_node.operation).get(_OPAQUE)
        if opaque is not None:
            operation = _opaque_layer(operation, *opaque, opaque_layers)
        _reject_variables(operation, (args, kwargs))
        node = Node(
            name=prefix + operation.name,
            operation=operation,
            args=_to_values(args, values),
            kwargs=_to_values(kwargs, values),
            output_structure=None,
        )
        if opaque is not None:
            node.opaque_reason = operation.reason
        recorded = kwargs.get("training")
        if "training" in _keras_internals.call_context_args(operation):
            node.training = recorded
        node.kwargs.pop("training", None)
        if pinned and node.training is not None:
            node.training = bool(node.training)
        for index, tensor in enumerate(_keras_internals.node_outputs(keras_node)):
            value = Value(node, index, tensor)
            node.outputs.append(value)
            values[id(tensor)] = value
        nodes.append(node)

    for tensor in keras.tree.flatten(outputs):
        if not isinstance(tensor, keras.KerasTensor):
            raise TraceError(
                f"`call` returns a {type(tensor).__name__}, not a tensor"
            )
        visit_tensor(tensor)
    output_values = keras.tree.map_structure(lambda t: values[id(t)], outputs)
    return nodes, output_values


def _opaque_layer(layer, reason, outputs, made):
    """The `OpaqueLayer` standing for `layer`, made once per `trace_call`
    (`made`: id(layer) -> it), as its traces under `training=True` and
    `False` must agree on the node's operation."""
    from keras_ipu_plugin.opaque import OpaqueLayer
    from keras_ipu_plugin.opaque import output_specs_of

    if id(layer) not in made:
        # Named as the layer: it stands for it in the graph, and the layer
        # itself sits inside it, not beside it in the functional model.
        made[id(layer)] = OpaqueLayer(
            layer, output_specs_of(outputs, None, False), reason=reason, name=layer.name
        )
    return made[id(layer)]


def _to_values(structure, values):
    def convert(leaf):
        if isinstance(leaf, keras.KerasTensor):
            return values[id(leaf)]
        return leaf

    return keras.tree.map_structure(convert, structure) if structure else structure


def _reject_variables(operation, structure):
    for leaf in keras.tree.flatten(structure):
        if isinstance(leaf, keras.Variable):
            raise TraceError(
                f"`call` uses the variable `{leaf.path}` directly (in "
                f"`{operation.name}`) rather than through a sub-layer"
            )


def _describe_failure(error, default=None):
    where = _failing_layer(error) or default
    text = f"{type(error).__name__}: {essential_message(error, limit=300)}"
    return f"{text} (in `{where}`)" if where else text


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def essential_message(error, limit=600):
    """The part of a Keras error that says what is wrong.

    Keras wraps errors from `call` in a banner ("Exception encountered when
    calling ...") with ANSI bold codes and appends every argument's value,
    which for a batch is the whole tensor printed out.
    """
    # str(KeyError) is the repr of its message, escapes and all.
    raw = str(error.args[0]) if isinstance(error, KeyError) and error.args else str(error)
    text = _ANSI.sub("", raw)
    text = text.split("Arguments received by")[0]
    # Keras's "Could not automatically infer the output shape / dtype of
    # ... Error encountered:" wraps the error that says what happened.
    text = text.split("Error encountered:")[-1]
    lines = [
        line.strip()
        for line in text.splitlines()
        if line.strip() and not line.startswith("Exception encountered when calling")
    ]
    text = " ".join(lines) or type(error).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _failing_layer(error):
    """Name of the innermost layer whose `call` raised, from the traceback."""
    name = None
    tb = error.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        owner = frame.f_locals.get("self")
        if frame.f_code.co_name == "call" and isinstance(owner, keras.layers.Layer):
            name = owner.name
        tb = tb.tb_next
    return name
