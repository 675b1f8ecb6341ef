"""One symbolic call of a layer's `call` (`trace_once`, `CallTrace`) and the Keras
nodes it recorded walked back into IR nodes (`collect_nodes`). One concept: a
call traced into nodes.

One symbolic call of a layer's `call`, and the trace it makes.

`trace_once` calls `type(layer).call` on a view of the layer
(`trace_views.py`) with KerasTensors, under one `training` mode, and walks
the Keras nodes it recorded into IR nodes (`collect_nodes`, below). `CallTrace`
is the trace in progress: what `call` holds rather than receives becomes a
node too (`layers/state.py`): the variables the traced layer keeps as attributes
are read through `VariableRead` nodes (their symbolic reads stand in the
view's attributes), a direct sub-layer called on concrete tensors only
(`self.embedding(ops.arange(n))`) is called on `HeldConstant` nodes holding
them, a `keras.random` draw is a `RandomDraw` node, and a write is a
`VariableWrite` node (`writes.py`).

Where tracing stops (which sub-layers are traced through, and whether a
layer's `call` is handed `training`) is the `Tracer`'s to say
(`tracer.py`); the trace carries the tracer that makes it.

Example:
    ```python
    trace = CallTrace(layer, (x,), {}, placeholders, "", ReadLayers(), training=None,
                      tracer=Tracer())
    nodes, outputs = trace_once(trace, True, False, {})
    ```

The Keras nodes a symbolic call recorded, walked back into IR nodes.

Calling `layer.call(...)` on KerasTensors records one Keras node per
sub-layer or `keras.ops` call made inside it. `collect_nodes` walks them
back from the outputs into `graph.Node`s in topological order: each named by
its attribute path (a `keras.ops` call by its kind, numbered in call
order), the user's layer in place of the view that was called, an opaque
view as an `OpaqueLayer`, an operation with the batch size in a shape as a
`BatchSizedOperation`, the `training` each sub-layer was called with
recorded on its node.

Example:
    ```python
    nodes, outputs = collect_nodes(outputs, placeholders, "", pinned=False, owner=layer)
    ```
"""

import contextlib
import dataclasses
import functools
import re

import keras
import numpy as np

from keras_ipu_plugin import _compat
from keras_ipu_plugin.frontend.batch.shapes import check_batch_dimensions
from keras_ipu_plugin.frontend import idioms
from keras_ipu_plugin.frontend.idioms import traced_idioms, unknown_sizes
from keras_ipu_plugin.frontend.trace import trace_views, writes as writes_lib
from keras_ipu_plugin.frontend.trace.attribute_paths import attribute_paths, path_of, stable_name
from keras_ipu_plugin.frontend.trace.failures import (
    TraceError,
    describe_failure,
    essential_message,
    user_stack_line,
    STATIC_BATCH_HINT,
)
from keras_ipu_plugin.frontend.trace.trace_views import (
    builtin_view_class,
    inline_view_class,
    is_concrete,
    dense_unless_given_sparse,
    precise_specs,
    OPAQUE,
)
from keras_ipu_plugin.ir.graph import UNTRACED_MASK, Node, Value
from keras_ipu_plugin.ir.graph import Namespace
from keras_ipu_plugin.layers.keras_ops.batch_sized import BatchSizedOperation
from keras_ipu_plugin.layers.state import HeldConstant, is_read
from keras_ipu_plugin.layers.state import is_write_node
from keras_ipu_plugin.layers.tf_calls import TFRandomDraw
from keras_ipu_plugin.layers.user_code import layer_view, shallow_view, viewed_layer


@dataclasses.dataclass(eq=False)
class CallTrace:
    """The trace of one `call` in progress: the call traced (its layer,
    symbolic arguments, the `training` it is traced for, the `Tracer`
    making it) and the graph values that `call` holds rather than receives
    (see `layers/state.py`).

    `hold_attributes(view)` puts the symbolic read of each variable the
    traced layer keeps as an attribute (alone, or in a list or dict) in the
    view's attributes, so `keras.ops` on it stay in the graph; and marks its
    direct sub-layers (made views, Keras's own layers too) to be called on
    `HeldConstant` nodes when `call` hands them only concrete tensors. The
    reads take a graph tensor of the call (`anchor`), which they ignore.
    `at(...)`: the same call traced on other inputs (a trial batch size).
    """

    layer: object
    args: tuple
    kwargs: dict
    placeholders: dict  # id(KerasTensor of the call) -> its graph Value
    prefix: str  # of the names of the nodes the trace makes
    reads: object  # the `ReadLayers` of the graph being made
    training: object = dataclasses.field(kw_only=True)  # None, True or False
    # where tracing stops, and which `call`s take `training` (`tracer.py`)
    tracer: object = dataclasses.field(kw_only=True)
    # the graph tensor reads hang from (`anchor_of` the inputs by default)
    anchor: object = dataclasses.field(default=None, kw_only=True)
    lift_for: set = dataclasses.field(default_factory=set, init=False)  # ids of lifted views
    # id(Keras node of a read) -> its node name
    read_names: dict = dataclasses.field(default_factory=dict, init=False)
    # id(Keras node) -> (the node, its output structure, None leaves and
    # all) for a call that returned None among its outputs (`_tensors_only`)
    none_leaves: dict = dataclasses.field(default_factory=dict, init=False)
    # id(HeldConstant) -> the eager tensor it holds
    lifted: dict = dataclasses.field(default_factory=dict, init=False)
    # id(HeldConstant) -> the user's line that made its tensor
    lift_sites: dict = dataclasses.field(default_factory=dict, init=False)
    # replay.output_specs_key -> output KerasTensors
    output_specs: dict = dataclasses.field(default_factory=dict, init=False)
    # the variable writes `call` makes, as nodes (`writes.py`)
    writes: object = dataclasses.field(init=False)
    _names: Namespace = dataclasses.field(default_factory=Namespace, init=False)
    _new_reads: list = dataclasses.field(default_factory=list, init=False)
    # the RandomDraw layers, the same in every mode traced
    _draws: list = dataclasses.field(default_factory=list, init=False)
    _draws_made: int = dataclasses.field(default=0, init=False)
    _drawn_from: set = dataclasses.field(default_factory=set, init=False)

    def __post_init__(self):
        if self.anchor is None:
            self.anchor = anchor_of((self.args, self.kwargs))
        self.writes = writes_lib.WriteRecorder(self)

    def at(self, args, kwargs, placeholders, anchor):
        """A new trace of the same call on other inputs (`args`, `kwargs`
        with `placeholders` for them), its reads hung from `anchor`."""
        return dataclasses.replace(self, args=args, kwargs=kwargs, placeholders=placeholders,
                                   anchor=anchor)

    @contextlib.contextmanager
    def active(self):
        """Make this the trace in progress (one per mode traced)."""
        self._names, self._new_reads = Namespace(), []
        self._draws_made, self._drawn_from = 0, set()
        self.writes.reset()
        try:
            # The read layers outlive the trace (a graph keeps them): leave
            # none of the trace's Keras nodes on them. Public code's
            # `ops.tile(t, (ops.shape(x)[0], 1, 1))` and `table[None]` are
            # followed (`frontend/idioms.py`), and TensorFlow functions
            # on symbolic tensors are recorded (`idioms.recorded`).
            with trace_views.in_progress(self), \
                    _compat.node_lists_snapshot(self.reads.layers(), always=True), \
                    traced_idioms(self.record_draw), \
                    idioms.recorded(batch_anchor=self.batch_anchor), \
                    self.writes.recording():
                yield
        finally:
            _compat.forget_nodes(self._new_reads)

    def hold_attributes(self, view):
        self.writes.view = view
        state = vars(view)
        for name in list(state):
            if name in _KERAS_ATTRIBUTES or name.startswith("_self_"):
                continue  # Keras's and TensorFlow's own bookkeeping
            state[name] = self._held(state[name], name)

    def _held(self, value, name):
        if isinstance(value, keras.Variable):
            return self._read(value, name)
        if isinstance(value, keras.layers.Layer):
            return self._lifting(value)
        if isinstance(value, (list, tuple)) and value and all(
            isinstance(v, (keras.Variable, keras.layers.Layer)) for v in value
        ):
            items = [self._held(v, f"{name}_{i}") for i, v in enumerate(value)]
            return tuple(items) if isinstance(value, tuple) else items
        if isinstance(value, dict) and value and all(
            isinstance(v, (keras.Variable, keras.layers.Layer)) for v in value.values()
        ):
            return {k: self._held(v, f"{name}_{k}") for k, v in value.items()}
        return value

    def _read(self, variable, name, anchor=None):
        node_name = self._names.create(self.prefix + name)
        known = {id(layer) for layer in self.reads.layers()}
        read = self.reads.variable_read(variable, like=self.layer, name=node_name)
        if id(read) not in known:
            self._new_reads.append(read)
        tensor = read(self.anchor if anchor is None else anchor)
        self.read_names[id(_compat.producing_node(tensor)[0])] = node_name
        self.writes.held(variable, tensor, name)
        return tensor

    read = _read  # for the write recorder: a read of a sub-layer's variable

    def unique_name(self, name):
        """A node name for a graph layer the trace makes (`prefix` + `name`)."""
        return self._names.create(self.prefix + name)

    def record_layer(self, layer, node_name, *args, **kwargs):
        """The output of graph layer `layer` (a write, an ordering: made by
        this trace, named `node_name`) called on graph tensors."""
        self._new_reads.append(layer)
        tensor = layer(*args, **kwargs)
        self.read_names[id(_compat.producing_node(tensor)[0])] = node_name
        return tensor

    def path_of(self, layer):
        return self._path_of(layer)

    def _lifting(self, layer):
        if viewed_layer(layer) is None:  # a Keras layer: called as it is
            if not layer.built or "call" in vars(layer):
                return layer
            # its variables read as graph values from `call`'s own code
            # (`self.conv.kernel`), so writes of them are nodes
            layer = shallow_view(layer, builtin_view_class(
                type(layer), writes_lib.variable_attributes(layer)))
        self.lift_for.add(id(layer))
        return layer

    def lift(self, args, kwargs, consumer, role="input"):
        """`(args, kwargs)` with each concrete tensor replaced by the output
        of a `HeldConstant` node holding it (named `<consumer>_<role>`, the
        consumer by its attribute path: its Keras name changes each build;
        `<role>` alone for the traced layer's own outputs)."""
        stem = self._path_of(consumer)
        stem = f"{stem}_{role}" if stem else role

        def lift(leaf):
            if not is_concrete(leaf):
                return leaf
            name = self._names.create(f"{self.prefix}{stem}")
            held = HeldConstant(keras.ops.convert_to_numpy(leaf), name=name)
            self._new_reads.append(held)
            self.lifted[id(held)] = leaf
            self.lift_sites[id(held)] = user_stack_line()
            return held(self.anchor)

        return keras.tree.map_structure(lift, (args, kwargs))

    def _path_of(self, layer):
        """`layer`'s attribute path in the traced layer (`attribute_paths`),
        None for the traced layer itself."""
        owner = viewed_layer(self.layer) or self.layer
        layer = viewed_layer(layer) or layer
        if layer is owner or layer is self.layer:
            return None
        return path_of(layer, attribute_paths(owner))

    def batch_anchor(self):
        """The graph tensor whose batch size a None in a shape made inside
        `call` is (`ops.shape(x)` while the batch is unknown), or None where
        a None may be another unknown size."""
        if self.anchor is None or not _only_the_batch_is_unknown(self):
            return None
        return self.anchor

    def record_draw(self, distribution, arguments):
        """The graph tensor of a `keras.random` draw `call` makes: the output
        of a `RandomDraw` node (`random_draws.py`) that makes it when the
        graph runs; None (Keras then runs it) where it is given tensors."""
        from keras_ipu_plugin.layers.keras_ops.random_draws import RandomDraw

        arguments = dict(arguments)
        shape, seed = arguments.pop("shape"), arguments.pop("seed")
        dtype = arguments.pop("dtype")
        if (self.anchor is None or not isinstance(shape, (list, tuple))
                or not all(dim is None or isinstance(dim, int) for dim in shape)
                or not all(isinstance(v, (int, float)) for v in arguments.values())
                or not (seed is None or isinstance(seed, (int, keras.random.SeedGenerator)))):
            return None
        what = f"`call` draws `keras.random.{distribution}` of shape {tuple(shape)}"
        if None in shape and not _only_the_batch_is_unknown(self):
            raise TraceError(f"{what}, whose unknown dimension may not be the batch size")
        if not isinstance(seed, int):
            # Two draws from one generator give different numbers in the
            # order they are made; the graph does not order them.
            if id(seed) in self._drawn_from:
                raise TraceError(f"{what} from a seed generator it already drew from: "
                                 "the graph would not keep the order of the draws")
            self._drawn_from.add(id(seed))
        config = (distribution, tuple(shape), arguments, dtype)
        if self._draws_made < len(self._draws):  # the same draw in another mode
            draw = self._draws[self._draws_made]
            if draw.seed_generator is not seed or (
                draw.distribution, draw.draw_shape, draw.arguments, draw.draw_dtype
            ) != config:
                draw = None
        else:
            draw = None
        if draw is None:
            draw = RandomDraw(distribution, shape, arguments, seed=seed, draw_dtype=dtype,
                              name=f"random_{distribution}")
            del self._draws[self._draws_made:]
            self._draws.append(draw)
        self._draws_made += 1
        self._new_reads.append(draw)
        return draw(self.anchor)


@dataclasses.dataclass(frozen=True)
class Traces:
    """The traces of one call its graph is made of: one symbolic trace, or
    traces at trial batch sizes, one per size, and how they were made
    (`trial`: a `batch.traces.BatchTrial`; None for the symbolic trace).
    `runs`: `((CallTrace, (nodes, outputs)), ...)`."""

    runs: tuple
    trial: object = None


# What every Keras layer / model holds (its variable lists among them): not
# the user's attributes, never replaced by reads.
_KERAS_ATTRIBUTES = frozenset(vars(keras.layers.Layer())) | frozenset(vars(keras.Model()))


def anchor_of(structure):
    """The graph tensor read nodes hang from, and `BatchSizedOperation`s
    read the batch size of: the first KerasTensor of the call's inputs,
    preferring a numeric one whose batch size is unknown."""
    tensors = [leaf for leaf in keras.tree.flatten(structure)
               if isinstance(leaf, keras.KerasTensor)]
    numeric = [t for t in tensors if t.dtype != "string"]
    batched = [t for t in numeric if t.shape and t.shape[0] is None]
    return (batched or numeric or tensors or [None])[0]


def _only_the_batch_is_unknown(trace):
    """Whether the traced call's inputs know every dimension but the
    batch size, and `trace.anchor` has it unknown: a None in a shape made
    inside `call` is then the batch size."""
    symbols = [leaf for leaf in keras.tree.flatten((trace.args, trace.kwargs))
               if isinstance(leaf, keras.KerasTensor)]
    anchor_shape = tuple(trace.anchor.shape)
    return bool(anchor_shape) and anchor_shape[0] is None and not any(
        None in tuple(t.shape)[1:] for t in symbols)


def trace_once(trace, training, pinned, opaque_layers):
    """Call `trace.layer`'s `call` once on its symbolic inputs under
    `training` (handed to `call` where it takes it; `pinned`: every
    sub-layer's recorded mode made a bool) and walk what it recorded into
    `(nodes, outputs)`; `opaque_layers` shares the `OpaqueLayer`s made
    between the modes traced. Raises `TraceError` with the reason."""
    layer = trace.layer
    kwargs = dict(trace.kwargs)
    if trace.tracer.takes_training(layer):
        kwargs["training"] = training
    sub_layers = _compat.all_layers(layer)
    view = layer_view(layer, inline_view_class, traced_call=trace.tracer.traced_call)
    with _compat.node_lists_snapshot(sub_layers, always=True), trace.active():
        if viewed_layer(view) is not None and trace.anchor is not None:
            trace.hold_attributes(view)
        with _compat.call_context(layer, training):
            try:
                args, kwargs = _as_call_receives(layer, trace.args, kwargs)
                outputs = _traced_call(layer, view)(*args, **kwargs)
                # every write `call` made is before an output (`writes.py`)
                outputs = trace.writes.finish(outputs)
            except TraceError:
                raise
            except writes_lib.WriteError as error:  # a write no graph can hold
                # (without the banner Keras puts on it when raised in `ops.cond`)
                raise TraceError(essential_message(error, limit=2000)) from error
            except Exception as error:  # user code failing on symbols
                raise TraceError(describe_failure(error)) from error
            outputs = _lifted_outputs(trace, outputs, layer)
        return collect_nodes(outputs, trace.placeholders, trace.prefix, pinned,
                             opaque_layers, trace.read_names, trace.anchor,
                             trace.none_leaves, owner=layer)


def _as_call_receives(layer, args, kwargs):
    """`args` and `kwargs` as Keras's `Layer.__call__` hands them to `call`:
    a floating input cast to the layer's input dtype where the layer
    autocasts (a `mixed_float16` layer's `call` computes in float16 on a
    float32 input), its Keras mask kept. Traced without it, the body of a
    layer with a policy other than its input's computed in the input's
    dtype: the same ops, other rounding."""
    if not _compat.converts_input_args(layer):
        return args, kwargs

    def convert(leaf):
        if not isinstance(leaf, keras.KerasTensor):
            return leaf
        converted = layer.dtype_policy.convert_input(leaf, layer.autocast, layer.input_dtype)
        mask = _compat.keras_mask(leaf)
        if converted is not leaf and mask is not None:
            _compat.set_keras_mask(converted, mask)
        return converted

    return keras.tree.map_structure(convert, args), keras.tree.map_structure(convert, kwargs)


def _traced_call(layer, view):
    """The `call` the trace runs for `layer` on `view`: its class's, but a
    functional model's graph is run calling its layers as
    `trace_views.graph_operation` says (one whose `compute_output_spec`
    takes no `training` is not handed it there)."""
    run = _compat.graph_call_through(view, trace_views.graph_operation)
    if run is not None:
        return run
    return functools.partial(type(layer).call, view)


def _lifted_outputs(trace, outputs, layer):
    """`outputs` with each concrete tensor `call` returns held by a
    `HeldConstant` node: keras_hub's `DeiTEncoder` returns
    `ops.empty((0, length, dim))` for the hidden states it was not asked
    for, and the block stayed whole ("returns a EagerTensor")."""
    leaves = keras.tree.flatten(outputs)
    if trace.anchor is None or not any(is_concrete(leaf) for leaf in leaves):
        return outputs
    return trace.lift(outputs, {}, layer, role="output")[0]


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


def unknown_dimension_attributes(operation):
    """Names of `operation`'s shape attributes (lists / tuples of
    dimensions) that hold None."""
    return [
        name for name, value in vars(operation).items()
        if not name.startswith("_") and isinstance(value, (list, tuple))
        and any(item is None for item in value)
        and all(item is None or isinstance(item, int) for item in value)
    ]


def fixed_batch_reason(operation, arguments, outputs, name):
    """Why the call of `operation` (a reshape or broadcast) at node `name`
    runs at one batch size only, or None: it takes a tensor whose batch
    size is unknown (None) to a shape that is all constants, so the batch
    size is one of them (keras.io's Switch Transformer reshapes to
    `[num_tokens_per_batch, embed_dim]`, a Python int from the data's
    batch size). `arguments`: the call's arguments, flattened."""
    kind = type(operation).__name__
    function = getattr(operation, "function", None)
    if kind == "TFFunction" and function in ("reshape", "broadcast_to"):
        kind = "Reshape" if function == "reshape" else "BroadcastTo"
    if kind not in ("Reshape", "BroadcastTo"):
        return None
    given = next((t for t in arguments if isinstance(t, keras.KerasTensor)), None)
    if given is None or not given.shape or given.shape[0] is not None or None in given.shape[1:]:
        return None
    if len(outputs) != 1 or not outputs[0].shape or None in tuple(outputs[0].shape):
        return None
    shape, fixed = tuple(given.shape), tuple(outputs[0].shape)
    rows = int(np.prod(fixed)) / max(int(np.prod(shape[1:])), 1)
    batch = f"the batch size {int(rows)}" if rows == int(rows) else "a batch size"
    verb = "reshapes" if kind == "Reshape" else "broadcasts"
    return (
        f"`{name}` {verb} a tensor whose batch size is unknown, of shape {shape}, to the "
        f"fixed shape {fixed}: the code holds {batch} as a constant, so it runs at that "
        "batch size only; write that dimension as -1 (`ops.reshape(x, (-1, "
        f"{', '.join(map(str, fixed[1:]))}))`) or from `ops.shape(x)[0]` (times what it "
        "multiplies) for the layer to expand and run at any batch size, or convert with "
        "static_batch=True"
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
        return  # its None is the batch size of `batch_of` (`layers/tf_calls.py`)
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
