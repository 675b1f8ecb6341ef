"""The graph IR: a small, explicit graph that passes transform.

A `Graph` holds its inputs, its `nodes` in topological order and its
outputs. Each `Node` is one call of one Keras operation (a layer, or a
`keras.ops` operation): its `args` / `kwargs` hold `Value`s where tensors
flowed, and `outputs` the values it produces. `Graph.rebuild()` turns the IR
back into a functional Keras model that calls the very same layer objects, so
every variable not replaced by a pass is shared.

Example:
    >>> graph = kip.graph.Graph.from_model(converted)
    >>> [node.name for node in graph.nodes]
    ['embedding', 'block_1', 'head']
    >>> rebuilt = graph.rebuild()
"""

import keras

from keras_ipu_plugin import _keras_internals
from keras_ipu_plugin.functional import KipFunctional

#: `Node.training` when the call follows the model's `training` argument.
FOLLOW = "follow"


class Value:
    """A tensor of the graph: output `index` of `producer` (None: an input)."""

    __slots__ = ("producer", "index", "spec")

    def __init__(self, producer, index, spec):
        self.producer = producer
        self.index = index
        self.spec = spec  # a KerasTensor with the shape and dtype

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

    Build one with `Graph.from_model(functional_model)` or from a trace
    (`tracing.trace_graph`); turn it back into a model with `rebuild()`.
    """

    def __init__(self, input_specs, input_values, nodes, outputs, name="model"):
        self.input_specs = input_specs  # nest of inputs.InputSpec
        self.input_values = input_values  # same nest, of Values
        self.nodes = list(nodes)
        self.outputs = outputs  # nest of Values
        self.name = name
        self.replaced = []  # (old layer, new layer) pairs made by Replace
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
            new = Value(producer, value.index, value.spec)
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
        outputs = map_values(lambda v: values[id(v)], self.outputs)
        graph = Graph(self.input_specs, input_values, nodes, outputs, self.name)
        graph.replaced = list(self.replaced)
        graph.batch_rows = self.batch_rows
        return graph

    # -- back to Keras -------------------------------------------------------
    def rebuild(self, name=None):
        """A `KipFunctional` model running this graph, with the same layers."""
        inputs = keras.tree.map_structure(
            lambda spec: spec.keras_input(), self.input_specs
        )
        tensors = {
            id(value): tensor
            for value, tensor in zip(
                keras.tree.flatten(self.input_values), keras.tree.flatten(inputs)
            )
        }

        def resolve(leaf):
            if isinstance(leaf, Value):
                return tensors[id(leaf)]
            return leaf

        pinned, annotations = {}, {}
        named = _UniqueNames()
        for node in self.nodes:
            operation = named.operation_for(node)
            args = map_leaves(resolve, node.args)
            kwargs = map_leaves(resolve, node.kwargs)
            kwargs.pop("training", None)
            if node.training in (True, False):
                kwargs["training"] = node.training
                pinned[operation.name] = node.training
            if node.made_by_pass:
                # A new layer may compute other shapes than the one it
                # replaced: let Keras work them out.
                with _keras_internals.call_context(operation, None):
                    outputs = keras.tree.flatten(operation(*args, **kwargs))
                for value, tensor in zip(node.outputs, outputs):
                    value.spec = tensor
            else:
                outputs = _keras_internals.record_call(
                    operation, args, kwargs, [value.spec for value in node.outputs]
                )
            for value, tensor in zip(node.outputs, outputs):
                tensors[id(value)] = tensor
            if node.annotations:
                annotations.setdefault(operation.name, {}).update(node.annotations)
        outputs = map_leaves(resolve, self.outputs)
        model = KipFunctional(
            inputs,
            outputs,
            name=name or self.name,
            kip_pinned_training=pinned,
            kip_annotations=annotations,
        )
        model.kip_graph = self
        object.__setattr__(model, "kip_replaced", tuple(self.replaced))
        return model

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


class _UniqueNames:
    """Names the rebuilt model's layers after their nodes.

    A layer inlined by Expand has the node name `parent.child`; the user's
    layer object keeps its own name (the plugin does not rename user
    objects), so the rebuilt model calls it through a `LayerAlias` with the
    node's name. That also gives every layer the distinct name a functional
    model needs when blocks share sub-layer names (`conv1` in every block).
    A layer called at several nodes gets one alias, named after the first.
    Layers a pass created (Replace) are ours and keep the name they were
    given.
    """

    def __init__(self):
        self.taken = set()
        self.chosen = {}  # id(layer) -> the layer or its alias

    def operation_for(self, node):
        operation = node.operation
        if not isinstance(operation, keras.layers.Layer):
            return operation  # keras.ops operations: ours, already named
        if id(operation) in self.chosen:
            return self.chosen[id(operation)]
        own_name = node.name == operation.name or node.made_by_pass
        if own_name and operation.name not in self.taken:
            chosen = operation
        else:
            from keras_ipu_plugin.alias import LayerAlias

            name, count = node.name, 0
            while name in self.taken:
                count += 1
                name = f"{node.name}_{count}"
            chosen = LayerAlias(operation, name=name)
        self.taken.add(chosen.name)
        self.chosen[id(operation)] = chosen
        return chosen


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
