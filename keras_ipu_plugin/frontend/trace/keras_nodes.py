"""The Keras nodes a symbolic call recorded, walked back into IR nodes.

Calling `layer.call(...)` on KerasTensors records one Keras node per
sub-layer or `keras.ops` call made inside it. `collect_nodes` walks them
back from the outputs into `graph.Node`s in topological order: each named by
its attribute path (a `keras.ops` call by its kind, numbered in call
order), the user's layer in place of the view that was called, an opaque
view as an `OpaqueLayer`, an operation with the batch size in a shape as a
`BatchSizedOperation`, the `training` each sub-layer was called with
recorded on its node.

Example:
    >>> nodes, outputs = collect_nodes(outputs, placeholders, "", pinned=False, owner=layer)
"""

import re

import keras

from keras_ipu_plugin import _compat
from keras_ipu_plugin.frontend.trace.attribute_paths import attribute_paths
from keras_ipu_plugin.frontend.trace.attribute_paths import path_of
from keras_ipu_plugin.frontend.trace.attribute_paths import stable_name
from keras_ipu_plugin.frontend.batch.shapes import check_batch_dimensions
from keras_ipu_plugin.frontend.batch.shapes import fixed_batch_reason
from keras_ipu_plugin.frontend.batch.shapes import unknown_dimension_attributes
from keras_ipu_plugin.frontend.idioms.traced_idioms import unknown_sizes
from keras_ipu_plugin.frontend.trace.failures import STATIC_BATCH_HINT
from keras_ipu_plugin.frontend.trace.failures import TraceError
from keras_ipu_plugin.frontend.trace.output_specs import dense_unless_given_sparse
from keras_ipu_plugin.frontend.trace.output_specs import precise_specs
from keras_ipu_plugin.frontend.trace.trace_views import OPAQUE
from keras_ipu_plugin.ir.graph import UNTRACED_MASK
from keras_ipu_plugin.ir.graph import Node
from keras_ipu_plugin.ir.graph import Value
from keras_ipu_plugin.ir.names import Namespace
from keras_ipu_plugin.layers.keras_ops.batch_sized import BatchSizedOperation
from keras_ipu_plugin.layers.state.reads import is_read
from keras_ipu_plugin.layers.tf_calls.tf_random_draw import TFRandomDraw
from keras_ipu_plugin.layers.state.variable_write import is_write_node
from keras_ipu_plugin.layers.views import viewed_layer


def collect_nodes(outputs, placeholders, prefix, pinned, opaque_layers=None, read_names=None,
             anchor=None, none_leaves=None, owner=None):
    """Walk Keras nodes back from `outputs` into Nodes in topological order,
    naming the user's layers where views were called; `opaque_layers`
    collects the OpaqueLayers made (see `_opaque_layer`). An operation with
    the batch size (None) in its shape becomes a `BatchSizedOperation` that
    takes it from `anchor` (a KerasTensor among the placeholders).

    `none_leaves` ({id(Keras node): (it, output structure)}): calls that returned
    None among their outputs; their Nodes keep that structure as
    `output_structure` (output indices, None leaves kept). None leaves of
    `outputs` stay None in the returned structure.

    A layer's node is named by its attribute path from `owner`, the layer
    traced (`attribute_paths`); a keras.ops operation by its kind, numbered
    in call order (`add`, `add_1`): Keras's own names count every call in
    the process, so they change each time a model is built."""
    none_leaves = {} if none_leaves is None else none_leaves
    # A model traced at the top (no prefix) is one given as it is.
    paths = attribute_paths(owner, keras_names=not prefix) if owner is not None else {}
    opaque_layers = {} if opaque_layers is None else opaque_layers
    values = dict(placeholders)  # id(KerasTensor) -> Value
    nodes, names = [], Namespace()
    visited = set()
    batch_sized = []

    def visit_tensor(tensor):
        if id(tensor) in values:
            return
        keras_node, _ = _compat.producing_node(tensor)
        if keras_node is None or _compat.is_input_node(keras_node):
            raise TraceError(
                "`call` uses a tensor that does not come from its inputs "
                f"({tensor!r})"
            )
        visit_node(keras_node)

    def visit_node(keras_node):
        if id(keras_node) in visited:
            return
        visited.add(id(keras_node))
        args, kwargs = _compat.node_arguments(keras_node)
        for tensor in _compat.node_input_tensors(keras_node):
            visit_tensor(tensor)
        operation = viewed_layer(keras_node.operation)
        if operation is None:  # not a view: a Keras layer or operation
            operation = keras_node.operation
        opaque = vars(keras_node.operation).get(OPAQUE)
        if opaque is not None:
            operation = _opaque_layer(operation, *opaque, opaque_layers)
        _reject_variables(operation, (args, kwargs))
        if not isinstance(operation, keras.layers.Layer):
            _reject_unknown_dimensions(operation, (args, kwargs), prefix)
            fixed = fixed_batch_reason(operation, keras.tree.flatten((args, kwargs)),
                                       _compat.node_outputs(keras_node),
                                       prefix + _node_name(operation, paths))
            if fixed is not None:
                raise TraceError(fixed)
            unknown = unknown_dimension_attributes(operation) + unknown_sizes(operation)
            if unknown:
                if anchor is None or not anchor.shape or anchor.shape[0] is not None:
                    raise TraceError(
                        f"`{prefix}{operation.name}` takes a shape with an "
                        f"unknown dimension: {STATIC_BATCH_HINT}"
                    )
                args, kwargs = BatchSizedOperation.arguments(operation, anchor, args, kwargs)
                operation = BatchSizedOperation(operation, unknown, name=operation.name)
                batch_sized.append(operation)
        name = prefix + _node_name(operation, paths)
        if is_read(operation) or is_write_node(operation):  # named by the trace
            name = (read_names or {}).get(id(keras_node), operation.name)
        node = Node(
            # A layer called twice (a shared block) has two nodes: the
            # second is numbered (`shared_1`), as node names are unique.
            name=names.create(name),
            operation=operation,
            args=_to_values(args, values),
            kwargs=_to_values(kwargs, values),
            output_structure=None,
        )
        if opaque is not None:
            node.opaque_reason = operation.reason
        recorded = kwargs.get("training")
        if "training" in _compat.call_context_args(operation):
            node.training = recorded
        node.kwargs.pop("training", None)
        if pinned and node.training is not None:
            node.training = bool(node.training)
        outputs_recorded = _compat.node_outputs(keras_node)
        recorded_node, structure = none_leaves.get(id(keras_node), (None, None))
        if recorded_node is keras_node:
            indices = iter(range(len(outputs_recorded)))
            node.output_structure = keras.tree.map_structure(
                lambda leaf: None if leaf is None else next(indices), structure
            )
        specs = dense_unless_given_sparse(
            precise_specs(operation, args, kwargs, outputs_recorded),
            [values[id(leaf)].spec if isinstance(leaf, keras.KerasTensor) else leaf
             for leaf in keras.tree.flatten((args, kwargs))])
        # Masks are computed from the call's inputs (`compute_mask`): their
        # nodes come before this one, which Expand may put an `AttachMask`
        # of them in place of.
        masks = [mask_value(tensor) for tensor in outputs_recorded]
        for index, (tensor, spec) in enumerate(zip(outputs_recorded, specs)):
            value = Value(node, index, spec, mask=masks[index])
            node.outputs.append(value)
            values[id(tensor)] = value
        nodes.append(node)

    def mask_value(tensor):
        """The Value of the Keras mask `tensor` carries (its operations
        become nodes), None, or UNTRACED_MASK (a concrete mask, or one
        not computed from the call's inputs)."""
        mask = _compat.keras_mask(tensor)
        if mask is None:
            return None
        if not isinstance(mask, keras.KerasTensor):
            return UNTRACED_MASK
        try:
            visit_tensor(mask)
            return values[id(mask)]
        except (TraceError, KeyError):
            return UNTRACED_MASK

    leaves = keras.tree.flatten(outputs)
    if all(tensor is None for tensor in leaves):
        raise TraceError("`call` returns no tensor")
    for tensor in leaves:
        if tensor is None:  # kept as None in the output structure
            continue
        if not isinstance(tensor, keras.KerasTensor):
            raise TraceError(
                f"`call` returns a {type(tensor).__name__}, not a tensor"
            )
        visit_tensor(tensor)
    output_values = keras.tree.map_structure(
        lambda t: None if t is None else values[id(t)], outputs
    )
    if batch_sized:
        check_batch_dimensions(nodes, prefix)
    return nodes, output_values


def _node_name(operation, paths):
    """What a node of `operation` is called in its trace (before numbering)."""
    from keras_ipu_plugin.layers.opaque import OpaqueLayer
    from keras_ipu_plugin.layers.keras_ops.random_draws import RandomDraw

    if isinstance(operation, OpaqueLayer):
        return path_of(operation.layer, paths)
    if isinstance(operation, keras.layers.Layer) and id(operation) in paths:
        return paths[id(operation)]
    if isinstance(operation, keras.layers.Layer) and not isinstance(
            operation, (BatchSizedOperation, RandomDraw)):
        return stable_name(operation)
    return _AUTO_SUFFIX.sub("", operation.name) or "op"


_AUTO_SUFFIX = re.compile(r"_\d+$")


def _opaque_layer(layer, reason, outputs, made):
    """The `OpaqueLayer` standing for `layer`, made once per `Tracer.trace`
    (`made`: id(layer) -> it), as its traces under `training=True` and
    `False` must agree on the node's operation."""
    from keras_ipu_plugin.layers.opaque import OpaqueLayer
    from keras_ipu_plugin.layers.opaque import output_specs_of

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


def _reject_unknown_dimensions(operation, structure, prefix):
    """Raise `TraceError` when a `keras.ops` operation is given a shape with
    an unknown (None) dimension as an argument: `call` passed on a dimension
    that is unknown while tracing (the batch size), and the graph would fail
    when run. (A None in the operation's own shape attributes is filled in
    when the graph runs: `batch_sized.py`.)"""
    if type(operation).__name__ == "GetItem":  # `x[:, None]`: a new axis
        return
    if isinstance(operation, TFRandomDraw) and keras.tree.flatten(structure[1].get("batch_of")):
        return  # its None is the batch size of `batch_of` (`tf_random_draw.py`)
    for value in _sequences_in(structure):
        if any(item is None for item in value):
            raise TraceError(
                f"`{prefix}{operation.name}` ({type(operation).__name__}) is "
                f"given the shape {tuple(value)} with an unknown dimension: "
                f"{STATIC_BATCH_HINT}"
            )


def _sequences_in(structure):
    """Lists and tuples inside the arguments of `structure = (args, kwargs)`
    (where a shape argument would be; not the argument lists themselves,
    in which None is an omitted argument)."""
    args, kwargs = structure
    found = []

    def visit(item):
        if isinstance(item, (list, tuple)):
            found.append(item)
            for child in item:
                visit(child)
        elif isinstance(item, dict):
            for child in item.values():
                visit(child)

    for argument in list(args) + list(kwargs.values()):
        visit(argument)
    return found
