"""The graph IR: a small, explicit graph that passes transform. One concept
over ~600 lines: `Graph`, `Node`, `Value` and the primitives that keep them
consistent.

A `Graph` holds its inputs, its `nodes` in topological order and its
outputs. Each `Node` is one call of one Keras operation (a layer, or a
`keras.ops` operation): its `args` / `kwargs` hold `Value`s where tensors
flowed, and `outputs` the values it produces. `runtime.rebuild.rebuild(graph)` turns
the IR back into a functional Keras model that calls the very same layer
objects, so every variable not replaced by a pass is shared.

Passes edit a graph with its primitives, as in torch.fx, never by
rewiring lists by hand (a miswired node is a silently wrong model):

- every `Value` knows its `users` (the nodes of the graph reading it),
  kept in sync when a node's `args` / `kwargs` are set;
- `insert_before` / `insert_after` / `append` add nodes, naming them in
  the graph's one namespace (`graph.names`): a name already taken is
  numbered (`block_1.dense_1`);
- `replace_all_uses_with(old, new)` points every user, and the graph's
  outputs, at another value;
- `erase_node` removes a node nothing reads any more;
- `lint()` checks the graph is well formed (what `apply_passes` runs after
  every pass while the tests run).

Each node has one metadata dict, `node.meta` (the pass annotations, why it
is opaque, the blocks it was inlined from...), copied with the graph.

This module is one concept, the IR and its editing primitives, and stays
one file although it is over 600 lines: the primitives keep `Value.users`
and masks consistent with each other, which is easier to check side by side.

Example:
    ```python
    graph = converted.kip_graph
    [node.name for node in graph.nodes]
    # -> ['embedding', 'block_1', 'head']
    head = graph.node("head")
    [user.name for user in graph.node("block_1").users]
    # -> ['head']
    rebuilt = rebuild(graph)     # keras_ipu_plugin.runtime.rebuild
    ```

One way to make names unique: `Namespace`.

Node names in a graph, the Keras layer names of a rebuilt model, the names
of the layers Replace makes and of the reads a trace records all follow the
same rule: a name is used as it is when free, else numbered `name_1`,
`name_2`, ... (the first number free). One class, so that the rule is the
same everywhere, and numbering stays linear: a counter per base name means
the 500th `dense` does not try the 499 taken numbers before it.

What a graph's inputs are: `InputSpec`s, and the check that data fits them.

Example:
    ```python
    spec = InputSpec(name="tokens", shape=(16,), dtype="int32")
    spec.keras_input()
    # -> <KerasTensor shape=(None, 16), dtype=int32, ...>
    ```
"""

from dataclasses import dataclass

import keras
import numpy as np

from keras_ipu_plugin.errors import InputDataError


#: `Node.training` when the call follows the model's `training` argument.
FOLLOW = "follow"


class GraphError(ValueError):
    """A graph edit that would leave the graph malformed, or a malformed
    graph found by `Graph.lint` (the message names the node and value)."""


#: `Value.mask` when Keras attaches a mask to the tensor that the trace
#: could not express as a Value of the graph.
UNTRACED_MASK = "untraced"


class Value:
    """A tensor of the graph: output `index` of `producer` (None: an input).

    `users`: the nodes of a graph that read it, in the order they started
    to (a dict used as an ordered set; the graph's outputs are not nodes
    and are not listed).

    `mask`: the Value of the Keras mask this tensor carries when the graph
    runs (`_keras_mask`, which Keras hands to the `mask` argument of the
    layers it feeds), None when it carries none, or `UNTRACED_MASK`.
    `masked`: the Values carrying this one as their mask (kept in sync when
    `mask` is set), so that `Graph.replace_all_uses_with` moves them too: a
    mask left on a replaced value would be a dangling reference.
    """

    __slots__ = ("producer", "index", "spec", "users", "_mask", "masked")

    def __init__(self, producer, index, spec, mask=None):
        self.producer = producer
        self.index = index
        self.spec = spec  # a KerasTensor with the shape and dtype
        self.users = {}
        self.masked = {}  # Values whose `mask` is this one (an ordered set)
        self._mask = None
        self.mask = mask

    @property
    def mask(self):
        return self._mask

    @mask.setter
    def mask(self, mask):
        if isinstance(self._mask, Value):
            self._mask.masked.pop(self, None)
        self._mask = mask
        if isinstance(mask, Value):
            mask.masked[self] = None

    def __repr__(self):
        where = self.producer.name if self.producer else "input"
        return f"Value({where}[{self.index}], shape={self.spec.shape})"


class InlinedBlock:
    """A layer that Expand inlined at one call site: its node `path` and the
    `layer`. Every node the expansion made lists it in `from_blocks`, so a
    target naming the block, or its class, still finds it (see
    `passes.infra.base.matched_blocks`). One object per call site: a layer
    inlined at two sites gives two blocks with the same path."""

    __slots__ = ("path", "layer")

    def __init__(self, path, layer):
        self.path = path
        self.layer = layer

    def __repr__(self):
        return f"InlinedBlock({self.path!r}, {type(self.layer).__name__})"


def _new_meta():
    return {"annotations": {}, "opaque_reason": None, "made_by_pass": False,
            "from_blocks": []}


def _copy_meta(meta):
    # One level deep: a copied graph's passes must not change the
    # annotations (a dict) or blocks (a list) of the graph it came from.
    return {key: (dict(item) if isinstance(item, dict)
                  else list(item) if isinstance(item, list) else item)
            for key, item in meta.items()}


class Node:
    """One call of `operation` in the graph.

    `training` is None when the operation takes no `training` argument,
    `FOLLOW` when it follows the model's `training`, or True / False when the
    original code pinned it. `meta` is the node's one metadata dict; its
    usual entries read as attributes: `annotations` (what passes recorded:
    `"recompute"`, `"outline"`, `"stage"`), `opaque_reason` (why a layer
    could not be traced into sub-layers, when it could not), `made_by_pass`
    (a layer a pass created, not the user's) and `from_blocks` (the
    `InlinedBlock`s it was expanded from, outermost first). A pass may keep
    its own entries there too; they are copied with the graph.

    `graph` is the graph the node is in (None until inserted). Setting
    `args` / `kwargs` of a node in a graph updates its inputs' `users`.
    """

    def __init__(
        self, name, operation, args, kwargs, output_structure, training=None
    ):
        self.graph = None
        self.name = name
        self.operation = operation
        self._args = args
        self._kwargs = kwargs
        self.output_structure = output_structure  # nest of output indices
        self.outputs = []
        self.training = training
        self.meta = _new_meta()

    # -- inputs, kept in sync with their users ----------------------------
    @property
    def args(self):
        return self._args

    @args.setter
    def args(self, args):
        self._set_inputs(args, self._kwargs)

    @property
    def kwargs(self):
        return self._kwargs

    @kwargs.setter
    def kwargs(self, kwargs):
        self._set_inputs(self._args, kwargs)

    def _set_inputs(self, args, kwargs):
        if self.graph is None:
            self._args, self._kwargs = args, kwargs
            return
        old = self.input_values
        self._args, self._kwargs = args, kwargs
        new = self.input_values
        kept = set(new)
        for value in old:
            if value not in kept:
                value.users.pop(self, None)
        for value in new:
            value.users[self] = None

    @property
    def input_values(self):
        return values_in((self._args, self._kwargs))

    def replace_input_with(self, old, new):
        """Read Value `new` wherever this node read `old`."""
        swap = lambda value: new if value is old else value  # noqa: E731
        self._set_inputs(map_values(swap, self._args), map_values(swap, self._kwargs))

    @property
    def users(self):
        """The nodes that read any output of this one (each once)."""
        found = {}
        for value in self.outputs:
            found.update(value.users)
        return list(found)

    # -- metadata ----------------------------------------------------------
    @property
    def annotations(self):
        return self.meta["annotations"]

    @annotations.setter
    def annotations(self, annotations):
        self.meta["annotations"] = annotations

    @property
    def opaque_reason(self):
        return self.meta["opaque_reason"]

    @opaque_reason.setter
    def opaque_reason(self, reason):
        self.meta["opaque_reason"] = reason

    @property
    def made_by_pass(self):
        return self.meta["made_by_pass"]

    @made_by_pass.setter
    def made_by_pass(self, made):
        self.meta["made_by_pass"] = made

    @property
    def from_blocks(self):
        return self.meta["from_blocks"]

    @from_blocks.setter
    def from_blocks(self, blocks):
        self.meta["from_blocks"] = blocks

    @property
    def is_layer(self):
        return isinstance(self.operation, keras.layers.Layer)

    def __repr__(self):
        return f"Node({self.name!r}, {type(self.operation).__name__})"


class Graph:
    """Inputs, nodes in topological order, outputs.

    Tracing makes one (`frontend.trace.tracer.trace_model`), as does reading a
    functional model (`passes.infra.manager.graph_of`); `runtime.rebuild.rebuild`
    turns it back into a model. Passes edit it with the primitives below
    (see the module docstring).

    Example:
        ```python
        node = graph.node("block_1")
        graph.insert_after(node, Node("block_1.extra", layer, (node.outputs[0],), {}, None))
        graph.lint()
        ```
    """

    def __init__(self, input_specs, input_values, nodes, outputs, name="model"):
        self.input_specs = input_specs  # nest of inputs.InputSpec
        self.input_values = input_values  # same nest, of Values
        self.name = name
        self._nodes = []
        self._last_position = 0  # where `_position` found a node last (a hint)
        self.names = Namespace()  # the names of the nodes, one namespace
        self.nodes = nodes
        self.outputs = outputs  # nest of Values
        self.replaced = []  # (old layer, new layer) pairs made by Replace
        # The `Tracer` a pass traces more of this graph with (Expand inlining
        # a node, a target reached by expanding): the one `apply_passes` was
        # given, handed to each pass on the graph it edits; None where a pass
        # runs on a graph outside `apply_passes` (the tracer in use then).
        self.tracer = None
        # {id(old layer): new layer} made by an earlier run of the same
        # passes (an earlier conversion of the same model), for Replace to
        # use again: a new one would start from the old layer's untrained
        # weights, and from no optimizer state.
        self.reusable = {}
        # the per-replica rows of the first batch, for planning passes (None: unknown)
        self.batch_rows = None
        # None, or where the model returns another structure in each
        # `training` mode: `{"outputs": {mode: nest of indices into the flat
        # outputs}, "none_means": mode}` (`layers/opaque.py`)
        self.output_modes = None

    # -- the node list -----------------------------------------------------
    @property
    def nodes(self):
        """The nodes in topological order (edit through the methods below;
        assigning a whole new list is allowed too)."""
        return self._nodes

    @nodes.setter
    def nodes(self, nodes):
        nodes = list(nodes)
        kept = set(nodes)
        for node in self._nodes:
            if node not in kept:
                self._detach(node)
        for node in nodes:
            if node.graph is not None and node.graph is not self:
                raise GraphError(
                    f"Node `{node.name}` is in graph `{node.graph.name}`; erase it "
                    f"there before putting it in `{self.name}`."
                )
        self._nodes = nodes
        self.names = Namespace(node.name for node in nodes)
        for node in nodes:
            if node.graph is None:
                self._attach(node)

    def _attach(self, node):
        node.graph = self
        for value in node.input_values:
            value.users[node] = None

    def _detach(self, node):
        for value in node.input_values:
            value.users.pop(node, None)
        node.graph = None

    def _position(self, node):
        self._check_in_graph(node)
        # Edits come in order (Expand walks the graph front to back, each
        # inlining next to the last): searching from the last position found
        # keeps an expansion of N blocks linear, where `index` from the
        # start made it quadratic. The position is always the list's own.
        nodes, start = self._nodes, self._last_position
        if start < len(nodes) and nodes[start] is node:
            return start
        try:
            index = nodes.index(node, start)
        except ValueError:
            index = nodes.index(node)
        self._last_position = index
        return index

    def _check_in_graph(self, node):
        if node.graph is not self:
            raise GraphError(f"Node `{node.name}` is not in graph `{self.name}`.")

    # -- editing -------------------------------------------------------------
    def insert_before(self, anchor, nodes):
        """Put `nodes` (a Node or a list, in order) just before `anchor`.
        Each is named in the graph's namespace: its name, numbered if
        taken (`dense` -> `dense_1`). Returns the nodes."""
        return self._insert(self._position(anchor), nodes)

    def insert_after(self, anchor, nodes):
        """Put `nodes` just after `anchor` (see `insert_before`)."""
        return self._insert(self._position(anchor) + 1, nodes)

    def append(self, nodes):
        """Put `nodes` at the end (see `insert_before`)."""
        return self._insert(len(self._nodes), nodes)

    def _insert(self, index, nodes):
        nodes = [nodes] if isinstance(nodes, Node) else list(nodes)
        for node in nodes:
            if node.graph is not None:
                raise GraphError(
                    f"Node `{node.name}` is already in graph `{node.graph.name}`; "
                    "a node is in one graph at one place."
                )
            node.name = self.names.create(node.name)
            self._attach(node)
        self._nodes[index:index] = nodes
        return nodes

    def replace_all_uses_with(self, old, new):
        """Make every node reading Value `old`, and the graph's outputs,
        read Value `new` instead; every value carrying `old` as its Keras
        mask carries `new`. Returns the nodes changed."""
        if old is new:
            return []
        users = list(old.users)
        for user in users:
            user.replace_input_with(old, new)
        for carrier in list(old.masked):
            carrier.mask = new
        self.outputs = map_values(lambda value: new if value is old else value, self.outputs)
        return users

    def erase_node(self, node):
        """Remove `node`, which nothing may read any more (replace its uses
        first): erasing a node still read would leave a dangling input."""
        position = self._position(node)
        users = node.users
        if users:
            raise GraphError(
                f"Cannot erase node `{node.name}` of graph `{self.name}`: "
                f"{', '.join(f'`{user.name}`' for user in users)} still read its outputs "
                "(replace_all_uses_with first)."
            )
        outputs = set(values_in(self.outputs))
        if any(value in outputs for value in node.outputs):
            raise GraphError(
                f"Cannot erase node `{node.name}` of graph `{self.name}`: it computes "
                "an output of the graph (replace_all_uses_with first)."
            )
        for value in node.outputs:
            carriers = [carrier for carrier in value.masked
                        if carrier.producer is not node and carrier.producer is not None
                        and carrier.producer.graph is self]
            if carriers:
                raise GraphError(
                    f"Cannot erase node `{node.name}` of graph `{self.name}`: its output "
                    f"{value.index} is the Keras mask of {carriers[0]!r} "
                    "(replace_all_uses_with first)."
                )
        self._detach(node)
        del self._nodes[position]
        self.names.discard(node.name)
        for value in node.outputs:  # its masks no longer refer to it
            value.mask = None

    def rename_nodes(self, names):
        """Give nodes new names at once (`{node: name}`; names may swap):
        the names must stay unique."""
        for node, name in names.items():
            self._check_in_graph(node)
            node.name = name
        taken = Namespace()
        for node in self._nodes:
            if node.name in taken:
                raise GraphError(f"Two nodes of graph `{self.name}` would be named `{node.name}`.")
            taken.add(node.name)
        self.names = taken

    # -- checks ------------------------------------------------------------
    def lint(self):
        """Raise `GraphError` unless the graph is well formed: each node once,
        in this graph, under a unique name of its namespace; every value a
        node reads is an input of the graph or an output of a node before
        it; outputs know their producer; `users` list exactly the nodes of
        the graph that read a value; the graph's outputs are defined.
        Linear in the size of the graph.

        Example:
            ```python
            graph.lint()   # silent when well formed
            ```
        """
        def fail(message):
            raise GraphError(f"Graph `{self.name}` is malformed: {message}")

        defined = set()
        for value in values_in(self.input_values):
            if value.producer is not None:
                fail(f"input {value!r} has a producer, `{value.producer.name}`")
            defined.add(value)
        position = {}
        for index, node in enumerate(self._nodes):
            if node in position:
                fail(f"node `{node.name}` appears twice")
            position[node] = index
        names, reads = set(), {}
        for index, node in enumerate(self._nodes):
            if node.graph is not self:
                fail(f"node `{node.name}` is in the node list but not in the graph "
                     "(the list was changed by hand)")
            if node.name in names:
                fail(f"two nodes are named `{node.name}`")
            if node.name not in self.names:
                fail(f"node `{node.name}` was renamed outside the graph's namespace")
            names.add(node.name)
            reads[node] = inputs = set(node.input_values)
            for value in inputs:
                if value not in defined:
                    fail(f"node `{node.name}` reads {value!r}, which "
                         + _why_undefined(value, index, position))
                if node not in value.users:
                    fail(f"node `{node.name}` reads {value!r}, whose users do not list it")
            # `output_structure` places the outputs in what the call returns;
            # None leaves stand for the Nones it returned (no Value).
            if node.output_structure is not None:
                leaves = [leaf for leaf in _structure_leaves(node.output_structure)
                          if leaf is not None]
                if sorted(leaves) != list(range(len(node.outputs))):
                    fail(f"the output structure of node `{node.name}` places outputs "
                         f"{leaves}, but the node has {len(node.outputs)}")
            for output_index, value in enumerate(node.outputs):
                if value.producer is not node or value.index != output_index:
                    fail(f"output {output_index} of node `{node.name}` says it is "
                         f"output {value.index} of "
                         f"`{getattr(value.producer, 'name', None)}`")
                defined.add(value)
        for value in defined:
            mask = value.mask
            if isinstance(mask, Value):
                if mask not in defined:
                    fail(f"{value!r} carries the Keras mask {mask!r}, which "
                         + _why_undefined(mask, len(self._nodes), position))
                if value not in mask.masked:
                    fail(f"{value!r} carries the Keras mask {mask!r}, which does not "
                         "list it among the values it masks")
            elif mask is not None and mask != UNTRACED_MASK:
                fail(f"{value!r} has a mask that is no Value: {mask!r}")
            for user in value.users:
                if user not in position:
                    fail(f"{value!r} lists user `{user.name}`, which is not in the graph")
                if value not in reads[user]:
                    fail(f"{value!r} lists user `{user.name}`, which does not read it")
        for value in values_in(self.outputs):
            if value not in defined:
                fail(f"the graph's output {value!r} "
                     + _why_undefined(value, len(self._nodes), position))

    # -- queries ---------------------------------------------------------
    def consumers(self, node):
        """Nodes that read any output of `node`, in graph order."""
        users = set(node.users)
        return [other for other in self._nodes if other in users]

    def node(self, name):
        for node in self._nodes:
            if node.name == name:
                return node
        raise KeyError(f"No node named {name!r} in graph {self.name!r}.")

    def layers(self):
        seen, layers = set(), []
        for node in self._nodes:
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
            values[value] = new
            return new

        input_values = map_values(lambda v: copy_value(v, None), self.input_values)
        nodes = []
        for node in self._nodes:
            new = Node(
                node.name, node.operation,
                map_values(values.__getitem__, node.args),
                map_values(values.__getitem__, node.kwargs),
                node.output_structure, training=node.training,
            )
            new.meta = _copy_meta(node.meta)
            new.outputs = [copy_value(v, new) for v in node.outputs]
            nodes.append(new)
        # Masks once every Value is copied (a mask may come from a later
        # output of the same node); UNTRACED_MASK is kept as it is.
        for old, new in values.items():
            if old.mask is not None:
                new.mask = values[old.mask] if isinstance(old.mask, Value) else old.mask
        outputs = map_values(values.__getitem__, self.outputs)
        graph = Graph(self.input_specs, input_values, nodes, outputs, self.name)
        graph.replaced = list(self.replaced)
        graph.tracer = self.tracer
        graph.reusable = dict(self.reusable)
        graph.batch_rows = self.batch_rows
        graph.output_modes = self.output_modes
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
            for node in self._nodes
        ]

    def __repr__(self):
        lines = [f"Graph {self.name!r}: {len(self._nodes)} nodes"]
        for node in self._nodes:
            inputs = ", ".join(
                v.producer.name if v.producer else "input" for v in node.input_values
            )
            lines.append(f"  {node.name} = {type(node.operation).__name__}({inputs})")
        return "\n".join(lines)


def _why_undefined(value, index, position):
    producer = value.producer
    if producer is None:
        return "is not an input of this graph"
    if producer in position:
        return (f"comes from `{producer.name}`, later in the node list "
                "(not in topological order)" if position[producer] >= index
                else f"`{producer.name}` does not list among its outputs")
    return f"comes from `{producer.name}`, which is not in the graph (erased?)"


def _structure_leaves(structure):
    """The leaves of an output structure, None leaves (a None the call
    returned) kept."""
    leaves = []
    map_leaves(leaves.append, structure)
    return leaves


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
    _gather_values(structure, found)
    return found


def _gather_values(structure, found):
    # `map_leaves`'s walk, without building the mapped nest: every edit of
    # a graph asks for the values a node reads.
    if isinstance(structure, Value):
        found.append(structure)
    elif isinstance(structure, dict):
        for item in structure.values():
            _gather_values(item, found)
    elif isinstance(structure, (list, tuple)):
        for item in structure:
            _gather_values(item, found)


def map_values(fn, structure):
    """Apply `fn` to every Value in a nest, keeping other leaves."""
    return map_leaves(lambda leaf: fn(leaf) if isinstance(leaf, Value) else leaf, structure)


class Namespace:
    """A set of taken names that hands out free ones.

    Example:
        >>> names = Namespace(["dense"])
        >>> names.create("dense"), names.create("dense"), names.create("norm")
        ('dense_1', 'dense_2', 'norm')
    """

    __slots__ = ("_taken", "_next")

    def __init__(self, names=()):
        self._taken = set(names)
        self._next = {}  # base name -> the first number that may be free

    def __contains__(self, name):
        return name in self._taken

    def __len__(self):
        return len(self._taken)

    def create(self, base):
        """`base` if free, else `base_<n>` for the first free n; taken."""
        if base not in self._taken:
            self._taken.add(base)
            return base
        count = self._next.get(base, 1)
        while f"{base}_{count}" in self._taken:
            count += 1
        self._next[base] = count + 1
        name = f"{base}_{count}"
        self._taken.add(name)
        return name

    def add(self, name):
        """Take `name` as it is (a name chosen elsewhere, known to be free)."""
        self._taken.add(name)

    def discard(self, name):
        """Free `name` (its node left the graph)."""
        self._taken.discard(name)


@dataclass(frozen=True)
class InputSpec:
    """Shape (without batch), dtype and name of one model input."""

    name: str
    shape: tuple
    dtype: str
    batch_size: object = None  # None, or the static per-replica batch

    def keras_input(self):
        return keras.Input(
            shape=self.shape,
            batch_size=self.batch_size,
            dtype=self.dtype,
            name=self.name,
        )


def dtype_kind(dtype):
    """`"float"`, `"int"`, `"bool"`, `"string"` or `"complex"`: what a cast
    between two dtypes of different kinds would change (it truncates floats
    to ints, turns numbers into True / False, fails on strings).

    Example:
        ```python
        dtype_kind("uint8"), dtype_kind(tf.float16), dtype_kind(np.dtype("<U3"))
        # -> ('int', 'float', 'string')
        ```
    """
    if isinstance(dtype, np.dtype) and dtype.kind in "USO":
        return "string"
    name = keras.backend.standardize_dtype(dtype)
    for kind in ("bool", "string", "complex", "int", "float"):
        if kind in name:
            return kind
    return name


def check_dtype_kinds(model_name, expected, given):
    """Raise `InputDataError` when a leaf of `given` has another dtype kind
    than the model input it feeds (`expected`, KerasTensors in the same
    order). Keras would cast it silently: a float batch fed to an input
    converted as int32 would be truncated. Same kind, other width (float64
    data for a float32 input) is Keras's usual cast, and is kept.

    Example:
        ```python
        check_dtype_kinds("net", converted.inputs, [np.zeros((2, 3), "int32")])
        ```
    """
    for tensor, leaf in zip(expected, given):
        if leaf is None:
            continue
        dtype = getattr(leaf, "dtype", None)
        if dtype is None:
            dtype = np.asarray(leaf).dtype
        if dtype_kind(dtype) != dtype_kind(tensor.dtype):
            got = dtype if isinstance(dtype, np.dtype) and dtype.kind in "USO" else (
                keras.backend.standardize_dtype(dtype))
            raise InputDataError(
                f"Input `{tensor.name}` of `{model_name}` was converted as "
                f"{tensor.dtype} (from the first batch), but this batch gives it "
                f"{got}. Keras would cast {got} to {tensor.dtype} without a "
                "word and change the values; cast the data yourself if that is "
                "meant, or convert the model on data of this dtype."
            )
