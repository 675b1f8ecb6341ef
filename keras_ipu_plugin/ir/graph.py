"""The graph IR: a small, explicit graph that passes transform.

A `Graph` holds its inputs, its `nodes` in topological order and its
outputs. Each `Node` is one call of one Keras operation (a layer, or a
`keras.ops` operation): its `args` / `kwargs` hold `Value`s where tensors
flowed, and `outputs` the values it produces. `runtime.rebuild.rebuild(graph)` turns
the IR back into a functional Keras model that calls the very same layer
objects, so every variable not replaced by a pass is shared.

Example:
    >>> graph = converted.kip_graph
    >>> [node.name for node in graph.nodes]
    ['embedding', 'block_1', 'head']
    >>> rebuilt = rebuild(graph)     # keras_ipu_plugin.runtime.rebuild
"""

import keras


#: `Node.training` when the call follows the model's `training` argument.
FOLLOW = "follow"


#: `Value.mask` when Keras attaches a mask to the tensor that the trace
#: could not express as a Value of the graph.
UNTRACED_MASK = "untraced"


class Value:
    """A tensor of the graph: output `index` of `producer` (None: an input).

    `mask`: the Value of the Keras mask this tensor carries when the graph
    runs (`_keras_mask`, which Keras hands to the `mask` argument of the
    layers it feeds), None when it carries none, or `UNTRACED_MASK`.
    """

    __slots__ = ("producer", "index", "spec", "mask")

    def __init__(self, producer, index, spec, mask=None):
        self.producer = producer
        self.index = index
        self.spec = spec  # a KerasTensor with the shape and dtype
        self.mask = mask

    def __repr__(self):
        where = self.producer.name if self.producer else "input"
        return f"Value({where}[{self.index}], shape={self.spec.shape})"


class InlinedBlock:
    """A layer that Expand inlined at one call site: its node `path` and the
    `layer`. Every node the expansion made lists it in `from_blocks`, so a
    target naming the block, or its class, still finds it (see
    `passes.base.matched_blocks`). One object per call site: a layer
    inlined at two sites gives two blocks with the same path."""

    __slots__ = ("path", "layer")

    def __init__(self, path, layer):
        self.path = path
        self.layer = layer

    def __repr__(self):
        return f"InlinedBlock({self.path!r}, {type(self.layer).__name__})"


class Node:
    """One call of `operation` in the graph.

    `training` is None when the operation takes no `training` argument,
    `FOLLOW` when it follows the model's `training`, or True / False when the
    original code pinned it. `annotations` hold what passes recorded
    (`"recompute"`, `"outline"`, `"stage"`); `opaque_reason` says why a layer
    could not be traced into sub-layers, when it could not; `from_blocks`
    the `InlinedBlock`s it was expanded from, outermost first.
    """

    def __init__(
        self, name, operation, args, kwargs, output_structure, training=None
    ):
        self.name = name
        self.operation = operation
        self.args = args
        self.kwargs = kwargs
        self.output_structure = output_structure  # nest of output indices
        self.outputs = []
        self.training = training
        self.annotations = {}
        self.opaque_reason = None
        self.made_by_pass = False  # a layer a pass created, not the user's
        self.from_blocks = []

    @property
    def input_values(self):
        return values_in((self.args, self.kwargs))

    @property
    def is_layer(self):
        return isinstance(self.operation, keras.layers.Layer)

    def __repr__(self):
        return f"Node({self.name!r}, {type(self.operation).__name__})"


class Graph:
    """Inputs, nodes in topological order, outputs.

    Tracing makes one (`frontend.tracing.trace_model`), as does reading a
    functional model (`passes.manager.graph_of`); `runtime.rebuild.rebuild`
    turns it back into a model.
    """

    def __init__(self, input_specs, input_values, nodes, outputs, name="model"):
        self.input_specs = input_specs  # nest of inputs.InputSpec
        self.input_values = input_values  # same nest, of Values
        self.nodes = list(nodes)
        self.outputs = outputs  # nest of Values
        self.name = name
        self.replaced = []  # (old layer, new layer) pairs made by Replace
        # {id(old layer): new layer} made by an earlier run of the same
        # passes (an earlier conversion of the same model), for Replace to
        # use again: a new one would start from the old layer's untrained
        # weights, and from no optimizer state.
        self.reusable = {}
        # the per-replica rows of the first batch, for planning passes (None: unknown)
        self.batch_rows = None

    # -- queries ---------------------------------------------------------
    def consumers(self, node):
        """Nodes that read any output of `node`, in graph order."""
        produced = {id(v) for v in node.outputs}
        return [
            other
            for other in self.nodes
            if any(id(v) in produced for v in other.input_values)
        ]

    def node(self, name):
        for node in self.nodes:
            if node.name == name:
                return node
        raise KeyError(f"No node named {name!r} in graph {self.name!r}.")

    def layers(self):
        seen, layers = set(), []
        for node in self.nodes:
            if node.is_layer and id(node.operation) not in seen:
                seen.add(id(node.operation))
                layers.append(node.operation)
        return layers

    def copy(self):
        """A graph with new Nodes and Values over the same operations, so that
        passes can edit it without touching this one."""
        values = {}

        def copy_value(value, producer):
            # `mask` is the old graph's Value until every Value is copied.
            new = Value(producer, value.index, value.spec, value.mask)
            values[id(value)] = new
            return new

        input_values = keras.tree.map_structure(
            lambda v: copy_value(v, None), self.input_values
        )
        nodes = []
        for node in self.nodes:
            new = Node(
                node.name, node.operation,
                map_values(lambda v: values[id(v)], node.args),
                map_values(lambda v: values[id(v)], node.kwargs),
                node.output_structure, training=node.training,
            )
            new.annotations = dict(node.annotations)
            new.opaque_reason = node.opaque_reason
            new.made_by_pass = node.made_by_pass
            new.from_blocks = list(node.from_blocks)
            new.outputs = [copy_value(v, new) for v in node.outputs]
            nodes.append(new)
        for value in values.values():
            if isinstance(value.mask, Value):
                value.mask = values[id(value.mask)]
        outputs = map_values(lambda v: values[id(v)], self.outputs)
        graph = Graph(self.input_specs, input_values, nodes, outputs, self.name)
        graph.replaced = list(self.replaced)
        graph.reusable = dict(self.reusable)
        graph.batch_rows = self.batch_rows
        return graph

    def summary_rows(self):
        """`(node, layer class, training, annotations, opaque reason)` rows."""
        return [
            (
                node.name,
                type(node.operation).__name__,
                "" if node.training in (None, FOLLOW) else str(node.training),
                ", ".join(f"{k}={v}" for k, v in sorted(node.annotations.items())),
                node.opaque_reason or "",
            )
            for node in self.nodes
        ]

    def __repr__(self):
        lines = [f"Graph {self.name!r}: {len(self.nodes)} nodes"]
        for node in self.nodes:
            inputs = ", ".join(
                v.producer.name if v.producer else "input" for v in node.input_values
            )
            lines.append(f"  {node.name} = {type(node.operation).__name__}({inputs})")
        return "\n".join(lines)


def map_leaves(fn, structure):
    """Map `fn` over a nest whose leaves may be Values (keras.tree would
    descend into our objects' attributes otherwise)."""
    if isinstance(structure, Value):
        return fn(structure)
    if isinstance(structure, dict):
        return {key: map_leaves(fn, item) for key, item in structure.items()}
    if isinstance(structure, tuple) and hasattr(structure, "_fields"):
        return type(structure)(*(map_leaves(fn, item) for item in structure))
    if isinstance(structure, (list, tuple)):
        return type(structure)(map_leaves(fn, item) for item in structure)
    return fn(structure)


def values_in(structure):
    """The Values among the leaves of a nest, in order."""
    found = []
    map_leaves(lambda leaf: found.append(leaf) if isinstance(leaf, Value) else None, structure)
    return found


def map_values(fn, structure):
    """Apply `fn` to every Value in a nest, keeping other leaves."""
    return map_leaves(lambda leaf: fn(leaf) if isinstance(leaf, Value) else leaf, structure)
