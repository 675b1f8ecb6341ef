"""Trace a layer's `call` on symbolic inputs into the graph IR.

Calling `layer.call(...)` (not `layer(...)`) on KerasTensors records one Keras
node per sub-layer or `keras.ops` call made inside it. We walk those nodes
back from the outputs into `graph.Node`s, then undo the node bookkeeping on
the user's layers: the IR is the only record kept, and `runtime.rebuild.rebuild`
makes the final functional model.

`training` is traced twice, under an outer `training=True` and `False`:
a sub-layer whose recorded value changes with it follows the model's
`training`; one that does not was pinned by the code (`bn(x, training=False)`).
If the two traces differ in which layers they call, `call` branches on
`training` in Python: one `ModeSwitch` node holds both traces
(`training_branches.py`).

`call` runs on a view of the layer (`views.layer_view`) whose user-written
sub-layers work out their output shapes by running their own `call` inline
on the KerasTensors. Keras would otherwise trace each custom block's `call`
in a scratch TensorFlow graph (`compute_output_spec`), several times slower.
A block whose `call` does not run on KerasTensors (TensorFlow ops on them)
falls back to Keras's own way. A block that fails that way too (Python
control flow on a tensor's value) but runs once AutoGraph has converted it
becomes one opaque node (`OpaqueLayer`), so the rest of the model is still
traced. Nodes recorded on views name the user's layers.

What `call` holds rather than receives is a node too (`reads.py`): the
variables the traced layer keeps as attributes are read through
`VariableRead` nodes (their symbolic reads stand in the view's attributes),
and a direct sub-layer called on concrete tensors only (`self.embedding(
ops.arange(n))`) is called on `HeldConstant` nodes holding them, rather than
run eagerly with its weights frozen into the result. A concrete tensor that
still ends up in the graph and was computed from the layer's weights fails
the trace (a GradientTape shows it): never a frozen weight.

The batch size is unknown (None) while tracing. An operation given it in a
shape (`ops.broadcast_to(cls, (ops.shape(x)[0], 1, d))`) becomes a
`BatchSizedOperation` that reads it when the graph runs; a `call` that needs
it as a number (`ops.broadcast_to` on a concrete mask) is traced at two batch
sizes and the two graphs are made one (`batch_sized.generalize_batch`). Both
are checked by replaying the shapes at two other batch sizes; what fails
stays whole, with a reason saying to pass `static_batch=True`.
"""

import contextlib
import functools
import inspect
import io
import os
import re
import textwrap
import threading
import tokenize

import keras
import numpy as np
import tensorflow as tf

from keras_ipu_plugin import _compat
from keras_ipu_plugin.frontend import failures
from keras_ipu_plugin.frontend import tf_functions
from keras_ipu_plugin.frontend import training_branches
from keras_ipu_plugin.frontend import write_nodes
from keras_ipu_plugin.frontend import writes as writes_lib
from keras_ipu_plugin.runtime.layer_kinds import accepts_training
from keras_ipu_plugin.frontend.losses import traced_add_loss
from keras_ipu_plugin.runtime.layer_kinds import note_writes_variables
from keras_ipu_plugin.runtime.batch_sized import BatchSizedOperation
from keras_ipu_plugin.runtime.batch_sized import NotBatchGeneral
from keras_ipu_plugin.runtime.batch_sized import batch_signature
from keras_ipu_plugin.runtime.batch_sized import fixed_batch_reason
from keras_ipu_plugin.runtime.batch_sized import has_offsets
from keras_ipu_plugin.runtime.batch_sized import generalize_batch
from keras_ipu_plugin.runtime.batch_sized import unknown_dimension_attributes
from keras_ipu_plugin.runtime.distribution import owning_strategy
from keras_ipu_plugin.ir.graph import FOLLOW
from keras_ipu_plugin.ir.graph import UNTRACED_MASK
from keras_ipu_plugin.ir.graph import Graph
from keras_ipu_plugin.ir.graph import Node
from keras_ipu_plugin.ir.graph import Value
from keras_ipu_plugin.ir.graph import map_leaves
from keras_ipu_plugin.ir.graph import map_values
from keras_ipu_plugin.frontend.attribute_paths import attribute_paths
from keras_ipu_plugin.frontend.attribute_paths import path_of
from keras_ipu_plugin.ir.names import Namespace
from keras_ipu_plugin.frontend.replay import output_specs_key
from keras_ipu_plugin.runtime.reads import HeldConstant
from keras_ipu_plugin.runtime.tf_random_draw import TFRandomDraw
from keras_ipu_plugin.runtime.reads import ReadLayers
from keras_ipu_plugin.runtime.reads import is_read
from keras_ipu_plugin.runtime.variable_write import is_write_node
from keras_ipu_plugin.runtime.views import layer_view
from keras_ipu_plugin.runtime.views import shallow_view
from keras_ipu_plugin.runtime.views import viewed_layer


class TraceError(Exception):
    """`call` cannot be captured as a graph of Keras layers; `reason` says why."""

    def __init__(self, reason):
        self.reason = reason
        super().__init__(reason)


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
    if any(leaf is None for leaf in keras.tree.flatten(outputs)):
        raise TraceError(
            "`call` returns None among its outputs, which a functional model "
            "cannot return; return the tensors only"
        )
    return Graph(input_specs, input_values, nodes, outputs, name=model.name)


def trace_call(layer, args, kwargs, placeholders, *, training, prefix, reads=None):
    """Trace `layer.call(*args, **kwargs)`; KerasTensors in `args` / `kwargs`
    must be keys (by id) of `placeholders`, mapping them to graph Values.

    Variables `call` reads from the layer's attributes become `VariableRead`
    nodes (taken from `reads`, one per variable in a graph); a sub-layer
    called on concrete tensors made inside `call` is called on
    `HeldConstant` nodes holding them. A tensor computed from the layer's
    weights outside the graph (it would be frozen) raises `TraceError`.

    Returns `(nodes, outputs)`: new Nodes named `prefix + layer name` and the
    output structure in terms of Values.
    """
    reads = ReadLayers() if reads is None else reads
    variables = _tf_variables(layer)
    log = writes_lib.WriteLog()
    # The tape sees only eager work: a weight read outside the graph (a
    # variable reached other than as an attribute, a sub-layer called on
    # a tensor computed from weights) would be frozen into it. The log sees
    # the variable writes `call` makes as it runs (see `writes.py`).
    with log.recording(), \
            tf.GradientTape(persistent=True, watch_accessed_variables=False) as tape:
        tape.watch(variables)
        trace = _Trace(layer, args, kwargs, placeholders, prefix, reads)
        try:
            runs = [(trace, _trace_modes(trace, training))]
        except TraceError as error:
            runs = _trace_at_two_batch_sizes(
                layer, args, kwargs, placeholders, prefix, reads, training, error
            )
    for trace, (nodes, _) in runs:
        nodes = training_branches.with_branch_nodes(nodes)
        _reject_frozen_variables(nodes, trace.lifted, tape, variables)
        _reject_lost_writes(layer, nodes, log)
    if len(runs) == 1:
        return runs[0][1]
    try:
        nodes, outputs = _generalized(runs, _TRIAL_BATCH_SIZES, prefix)
        if has_offsets(nodes):
            # `batch + 1`: two traces fit any line through their sizes (the
            # batch squared too); a third, at another batch size, confirms it.
            again = _trace_at_two_batch_sizes(layer, args, kwargs, placeholders, prefix,
                                              reads, training, None, _CONFIRMING_BATCH_SIZES)
            if batch_signature(_generalized(again, _CONFIRMING_BATCH_SIZES, prefix)[0]) != \
                    batch_signature(nodes):
                raise NotBatchGeneral(
                    "and a trace at batch size 2 shows a size that is no multiple of the "
                    "batch size plus a constant")
        _check_batch_dimensions(nodes, prefix, multiples=True)
    except NotBatchGeneral as mismatch:
        raise TraceError(
            f"{runs[0][0].failure}; traced at two batch sizes instead, {mismatch}"
        ) from None
    return nodes, outputs


# The batch sizes a call is traced at when its symbolic trace fails on the
# unknown batch size (see `_trace_at_two_batch_sizes`). One of them is 1, so
# that Python code branching on the batch size (`if ops.shape(x)[0] > 1`)
# takes different branches in the two traces and is refused, not baked in.
# A size with a constant added to the batch's (`batch + 1`) is confirmed by
# traces at the second pair.
_TRIAL_BATCH_SIZES = (1, 3)
_CONFIRMING_BATCH_SIZES = (1, 2)


def _generalized(runs, batch_sizes, prefix):
    """`generalize_batch` of the two traces `runs` made at `batch_sizes`."""
    (first, small), (_, large) = runs
    return generalize_batch(small, large, batch_sizes, first.placeholders[id(first.anchor)],
                            _same_operation, prefix)


def _trace_at_two_batch_sizes(layer, args, kwargs, placeholders, prefix, reads,
                              training, error, batch_sizes=_TRIAL_BATCH_SIZES):
    """Trace `call` with its inputs' unknown batch size set to each of
    `_TRIAL_BATCH_SIZES`, for `call`s that need a concrete batch size
    (`ops.broadcast_to(mask, (ops.shape(x)[0], n, n))` on a concrete mask,
    as keras_hub's decoders build their causal masks). `generalize_batch`
    then makes one graph of the two that works for any batch size, or says
    why it cannot. Re-raises `error` when the inputs' batch size is known.

    Returns `[(trace, (nodes, outputs))]` for each batch size.
    """
    symbols = [leaf for leaf in keras.tree.flatten((args, kwargs))
               if isinstance(leaf, keras.KerasTensor)]
    anchor = _anchor_of((args, kwargs))
    batched = [t for t in symbols if t.shape and t.shape[0] is None]
    if not any(t is anchor for t in batched) or any(
        None in tuple(t.shape)[1:] for t in symbols
    ):
        raise error  # no unknown batch size to set, or other unknown sizes
    runs = []
    for batch_size in batch_sizes:
        concrete = {
            id(t): keras.KerasTensor((batch_size,) + tuple(t.shape)[1:], dtype=t.dtype)
            for t in batched
        }
        swap = lambda leaf: concrete.get(id(leaf), leaf)  # noqa: E731
        for tensor in batched:  # the masks the inputs carry, at this batch size
            mask = _compat.keras_mask(tensor)
            if isinstance(mask, keras.KerasTensor):
                _compat.set_keras_mask(concrete[id(tensor)], swap(mask))
        trace = _Trace(
            layer, keras.tree.map_structure(swap, args), keras.tree.map_structure(swap, kwargs),
            {id(swap(t)): placeholders[id(t)] for t in symbols},
            prefix, reads, anchor=concrete[id(anchor)],
        )
        trace.failure = error.reason if error is not None else None
        try:
            runs.append((trace, _trace_modes(trace, training)))
        except TraceError as failure:
            if error is None:  # confirming a generalization: that failure says why not
                raise NotBatchGeneral(f"and at batch size {batch_size} {failure.reason}") from None
            if failure.reason == error.reason:
                raise error from None
            # What stops the trace at a known batch size is the cause to fix
            # (Mixtral's MoE block: `add_loss` in training, after `B*T // T`).
            raise TraceError(f"{error.reason}; traced at batch size {batch_size} instead, "
                             f"{failure.reason}") from None
    return runs


def _trace_modes(trace, training):
    """Trace under the `training` modes needed to tell which nodes follow
    the model's `training` (see the module docstring)."""
    layer = trace.layer
    made = {}  # id(user layer) -> the OpaqueLayer standing for it
    if training is not None:
        return _trace_once(trace, training, True, made)
    if not _call_mentions_training(type(layer).call):
        # `call` neither reads `training` nor passes it on: every sub-layer
        # takes it from the context, so one trace under `training=True`
        # tells them all (each records True: it follows the model's).
        nodes, outputs = _trace_once(trace, True, False, made)
        for node in nodes:
            if node.training is True:
                node.training = FOLLOW
        return nodes, outputs
    nodes_t, outputs_t = _trace_once(trace, True, False, made)
    nodes_f, outputs_f = _trace_once(trace, False, False, made)
    if not _same_calls(nodes_t, nodes_f):
        # `call` branches on `training` in Python: one node holds the graph
        # of each mode and runs the one it is called in (`training_branches`).
        try:
            return training_branches.switch_node(
                layer, trace.prefix[:-1] if trace.prefix else layer.name,
                {"training": (nodes_t, outputs_t), "inference": (nodes_f, outputs_f)},
                lambda: _trace_once(trace, None, False, made), _same_calls)
        except training_branches.BranchError as error:
            lines = _training_branch_lines(type(layer).call)
            at = f" (at `{'`, `'.join(lines)}`)" if lines else ""
            raise TraceError(
                f"{error.reason}{at}: the two modes cannot be held as one node, so "
                "the layer runs whole (it still trains)") from None
    for node_t, node_f in zip(nodes_t, nodes_f):
        node_t.training = _training_mode(node_t, node_f)
    return nodes_t, outputs_t


def _same_calls(nodes_a, nodes_b):
    return list(map(_identity, nodes_a)) == list(map(_identity, nodes_b))


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


def _training_branch_lines(function):
    """`file:line: source` of each line of `function` that tests `training`
    in an `if` (a statement or an `a if training else b`), for the reason a
    layer branching on it stays whole; [] where the source is unknown."""
    try:
        source_lines, first = inspect.getsourcelines(function)
        tokens = list(tokenize.generate_tokens(
            io.StringIO(textwrap.dedent("".join(source_lines))).readline))
        filename = os.path.basename(inspect.getsourcefile(function) or "")
    except (OSError, TypeError, tokenize.TokenError, IndentationError):
        return []
    found, after_if = [], {}
    for token in tokens:
        if token.type == tokenize.NAME and token.string in ("if", "elif"):
            after_if[token.start[0]] = True
        elif (token.type == tokenize.NAME and token.string == "training"
              and after_if.get(token.start[0])):
            line = token.start[0]
            text = source_lines[line - 1].strip()
            entry = f"{filename}:{first + line - 1}: {text}"
            if entry not in found:
                found.append(entry)
    return found


def _same_operation(node_a, node_b):
    """Whether two traces called the same thing at these nodes (opaque ones
    are kept out: their recorded output shapes hold a trial batch size)."""
    return node_a.opaque_reason is None and _identity(node_a) == _identity(node_b)


def _identity(node):
    # Layers are the user's objects; `keras.ops` operations are created anew
    # at each call, so only their kind can be compared.
    if node.opaque_reason is not None:
        return id(node.operation.layer)
    if isinstance(node.operation, HeldConstant) or is_write_node(node.operation):
        return node.name  # made anew at each trace
    if isinstance(node.operation, BatchSizedOperation):
        return type(node.operation.operation).__name__
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


def _trace_once(trace, training, pinned, opaque_layers):
    layer = trace.layer
    kwargs = dict(trace.kwargs)
    if accepts_training(layer):
        kwargs["training"] = training
    sub_layers = _compat.all_layers(layer)
    view = layer_view(layer, _inline_view_class)
    with _compat.node_lists_snapshot(sub_layers, always=True), trace.active():
        if viewed_layer(view) is not None and trace.anchor is not None:
            trace.hold_attributes(view)
        with _compat.call_context(layer, training):
            try:
                outputs = type(layer).call(view, *trace.args, **kwargs)
                # every write `call` made is before an output (`write_nodes.py`)
                outputs = trace.writes.finish(outputs)
            except TraceError:
                raise
            except write_nodes.WriteError as error:  # a write no graph can hold
                # (without the banner Keras puts on it when raised in `ops.cond`)
                raise TraceError(essential_message(error, limit=2000)) from error
            except Exception as error:  # user code failing on symbols
                raise TraceError(_describe_failure(error)) from error
            outputs = _lifted_outputs(trace, outputs, layer)
        return _collect(outputs, trace.placeholders, trace.prefix, pinned,
                        opaque_layers, trace.read_names, trace.anchor,
                        trace.none_leaves, owner=layer)


def _lifted_outputs(trace, outputs, layer):
    """`outputs` with each concrete tensor `call` returns held by a
    `HeldConstant` node: keras_hub's `DeiTEncoder` returns
    `ops.empty((0, length, dim))` for the hidden states it was not asked
    for, and the block stayed whole ("returns a EagerTensor")."""
    leaves = keras.tree.flatten(outputs)
    if trace.anchor is None or not any(_is_concrete(leaf) for leaf in leaves):
        return outputs
    return trace.lift(outputs, {}, layer, role="output")[0]


class _Trace:
    """The trace of one `call` in progress: the graph values that `call`
    holds rather than receives (see `reads.py`).

    `hold_attributes(view)` puts the symbolic read of each variable the
    traced layer keeps as an attribute (alone, or in a list or dict) in the
    view's attributes, so `keras.ops` on it stay in the graph; and marks its
    direct sub-layers (made views, Keras's own layers too) to be called on
    `HeldConstant` nodes when `call` hands them only concrete tensors. The
    reads take a graph tensor of the call (`anchor`), which they ignore.
    """

    _active = threading.local()

    def __init__(self, layer, args, kwargs, placeholders, prefix, reads, anchor=None):
        self.layer = layer
        self.args, self.kwargs = args, kwargs
        self.placeholders = placeholders
        self.prefix = prefix
        self.reads = reads
        self.anchor = _anchor_of((args, kwargs)) if anchor is None else anchor
        self.failure = None  # why the symbolic trace failed, for a retry
        self.lift_for = set()  # ids of the views whose concrete calls are lifted
        self.read_names = {}  # id(Keras node of a read) -> its node name
        # id(Keras node) -> (the node, its output structure, None leaves and
        # all) for a call that returned None among its outputs (`_tensors_only`)
        self.none_leaves = {}
        self.lifted = {}  # id(HeldConstant) -> the eager tensor it holds
        self.output_specs = {}  # replay.output_specs_key -> output KerasTensors
        self._names = Namespace()  # the node names this trace gave
        self._new_reads = []
        self._draws = []  # the RandomDraw layers, the same in every mode traced
        self._draws_made, self._drawn_from = 0, set()
        # the variable writes `call` makes, as nodes (`write_nodes.py`)
        self.writes = write_nodes.WriteRecorder(self)

    @classmethod
    def current(cls):
        stack = getattr(cls._active, "stack", None)
        return stack[-1] if stack else None

    @contextlib.contextmanager
    def active(self):
        """Make this the trace in progress (one per mode traced)."""
        stack = self._active.__dict__.setdefault("stack", [])
        self._names, self._new_reads = Namespace(), []
        self._draws_made, self._drawn_from = 0, set()
        self.writes.reset()
        stack.append(self)
        try:
            # The read layers outlive the trace (a graph keeps them): leave
            # none of the trace's Keras nodes on them. Public code's
            # `ops.tile(t, (ops.shape(x)[0], 1, 1))` and `table[None]` are
            # followed (`_compat.traced_idioms`), and TensorFlow functions
            # on symbolic tensors are recorded (`tf_functions.recorded`).
            with _compat.node_lists_snapshot(self.reads.layers(), always=True), \
                    _compat.traced_idioms(self.record_draw), \
                    tf_functions.recorded(batch_anchor=self.batch_anchor), \
                    self.writes.recording():
                yield
        finally:
            stack.pop()
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

    read = _read  # for `write_nodes`: a read of a sub-layer's variable

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
            layer = shallow_view(layer, _builtin_view_class(
                type(layer), write_nodes.variable_attributes(layer)))
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
            if not _is_concrete(leaf):
                return leaf
            name = self._names.create(f"{self.prefix}{stem}")
            held = HeldConstant(keras.ops.convert_to_numpy(leaf), name=name)
            self._new_reads.append(held)
            self.lifted[id(held)] = leaf
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
        from keras_ipu_plugin.runtime.random_draws import RandomDraw

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


@functools.lru_cache(maxsize=None)
def _inline_view_class(cls, function):
    """A subclass of `cls` whose symbolic calls run `call` inline (see the
    module docstring); classes that say their own output shape keep it."""
    # `add_loss` of a symbolic loss is a graph node (`frontend/losses.py`).
    if _states_own_output_shape(cls):
        return type(cls.__name__, (cls,), {"__module__": cls.__module__,
                                           "compute_output_spec": _own_output_spec,
                                           "__call__": _lifting_call,
                                           "add_loss": traced_add_loss})
    return type(cls.__name__, (cls,), {
        "__module__": cls.__module__,
        "compute_output_spec": _inline_output_spec,
        "__call__": _lifting_call,
        "add_loss": traced_add_loss,
    })


_NONE_LEAVES = "_kip_none_leaves"  # in a view's dict: see `_tensors_only`


def _tensors_only(view, outputs):
    """`outputs` for Keras's node: a layer may return None among its outputs
    (keras_hub's attention returns `(output, None)` when given no cache),
    which a Keras node rejects. The node then records the tensors alone, and
    the structure with its None leaves is kept on the view until its
    `__call__` (`_lifting_call`) hands it back to the calling code."""
    leaves = keras.tree.flatten(outputs)
    if not any(leaf is None for leaf in leaves):
        return outputs
    if all(leaf is None for leaf in leaves):
        raise TraceError(f"`{viewed_layer(view).name}` returns no tensor, only None")
    vars(view)[_NONE_LEAVES] = outputs
    return [leaf for leaf in leaves if leaf is not None]


def _own_output_spec(self, *args, **kwargs):
    """The class's own `compute_output_spec`, with None outputs kept aside
    (`_tensors_only`), handed `training` only if it takes it: Keras passes
    the mode of the trace on to every layer whose `call` takes it, and
    keras_hub's `DINOV2Embedding.compute_output_spec(inputs)` does not."""
    compute_output_spec = super(type(self), self).compute_output_spec
    if "training" in kwargs and not _takes_argument(compute_output_spec, "training"):
        kwargs = {key: value for key, value in kwargs.items() if key != "training"}
    return _tensors_only(self, compute_output_spec(*args, **kwargs))


def _takes_argument(function, name):
    try:
        parameters = inspect.signature(function).parameters
    except (TypeError, ValueError):
        return True
    return name in parameters or any(
        p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())


def _states_own_output_shape(cls):
    """Whether `cls` defines its output shape for the `call` it has: a
    `compute_output_spec` / `compute_output_shape` of its own, not only one
    inherited from a class whose `call` it overrides. (keras_hub's
    `CachedMultiHeadAttention` adds `cache` to `MultiHeadAttention.call`,
    whose `compute_output_spec` knows no `cache` argument.)"""
    def owner(name):
        return next(klass for klass in cls.__mro__ if name in vars(klass))

    call_owner = owner("call")
    for name in ("compute_output_spec", "compute_output_shape"):
        spec_owner = owner(name)
        if spec_owner in (keras.layers.Layer, _compat.Operation):
            continue
        if issubclass(spec_owner, call_owner):
            return True
    return False


_OPAQUE = "_kip_opaque"  # in a view's dict: (reason, output specs) when opaque


def _inline_output_spec(self, *args, **kwargs):
    """Output KerasTensors of `self.call(*args, **kwargs)`, run on the
    KerasTensors themselves; Keras's scratch-graph way if that fails, and
    AutoGraph's (the view then stands for an opaque node) if that fails."""
    # Blocks of one kind (`replay.output_specs_key`) give the same output
    # specs: their `call` runs once per trace, not once per block.
    trace = _Trace.current()
    key = None if trace is None else output_specs_key(
        viewed_layer(self), args, kwargs, _compat.current_training())
    if key is not None and key in trace.output_specs:
        return _tensors_only(
            self, keras.tree.map_structure(_fresh_keras_tensor, trace.output_specs[key]))
    layers = _compat.all_layers(self)
    # A failure of the layer's own code (a TraceError too: a draw the graph
    # cannot order) makes this layer opaque, not the one calling it; only
    # `_tensors_only`'s refusal (a layer returning no tensor) goes up.
    try:
        with _compat.node_lists_snapshot(layers, always=True), \
                writes_lib.deferred(viewed_layer(self)):
            outputs = keras.tree.map_structure(_fresh_keras_tensor, self.call(*args, **kwargs))
    except Exception:
        pass
    else:
        if key is not None:
            trace.output_specs[key] = outputs
        return _tensors_only(self, outputs)
    try:
        outputs = super(type(self), self).compute_output_spec(*args, **kwargs)
    except Exception as error:
        layer = viewed_layer(self)  # only views have this method
        try:
            outputs = _scratch_graph_output_spec(self, args, kwargs)
        except Exception:
            try:
                outputs = _autograph_output_spec(layer, args, kwargs)
            except Exception:
                raise error from None
            vars(self)[_OPAQUE] = (_describe_failure(error, default=layer.name), outputs)
    return _tensors_only(self, outputs)


def _scratch_graph_output_spec(view, args, kwargs):
    """Output KerasTensors of `view.call` run on symbolic TensorFlow tensors
    in a scratch graph, as Keras runs a layer stating no output shape.

    A class here inherits its `compute_output_spec` from a class whose `call`
    it overrides (keras_hub's XLNet `TwoStreamRelativeAttention`, a
    `MultiHeadAttention` called with `content_stream=...`), so that one
    refuses the arguments; and `call` on KerasTensors can fail where a
    sub-layer's own spec is less precise than TensorFlow's shape inference
    (an `EinsumDense(output_shape=(None, heads, dim))` leaving the sequence
    length unknown, which `call` then computes with)."""
    if _states_own_output_shape(type(viewed_layer(view))):
        raise TypeError("the class states its own output shape")
    return _compat.Operation.compute_output_spec(view, *args, **kwargs)


def _autograph_output_spec(layer, args, kwargs):
    """Output KerasTensors of `layer`'s call run as an `OpaqueLayer` runs it
    in graph mode (AutoGraph-converted), traced in a scratch graph."""
    from keras_ipu_plugin.runtime.opaque import autograph_call

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


def _lifting_call(self, *args, **kwargs):
    """`__call__` of a view: a direct sub-layer of the traced layer called
    on concrete tensors only (`self.embedding(ops.arange(n))`) would run
    eagerly and its output, computed from its weights, would be frozen into
    the graph; it is called on `HeldConstant` nodes holding them instead."""
    trace = _Trace.current()
    if trace is not None and id(self) in trace.lift_for:
        leaves = keras.tree.flatten((args, kwargs))
        if not any(isinstance(leaf, keras.KerasTensor) for leaf in leaves) and any(
            _is_concrete(leaf) for leaf in leaves
        ):
            args, kwargs = trace.lift(args, kwargs, viewed_layer(self))
    if trace is None:
        outputs = super(type(self), self).__call__(*args, **kwargs)
    else:  # ordered among the writes `call` makes (`write_nodes.py`)
        args, kwargs = trace.writes.before_call(self, args, kwargs)
        outputs = None
        try:
            outputs = super(type(self), self).__call__(*args, **kwargs)
        finally:
            trace.writes.after_call(self, outputs)
    structure = vars(self).pop(_NONE_LEAVES, None)
    if structure is None:
        return outputs
    # Keras recorded the tensors alone (`_tensors_only`); the calling code
    # gets the structure it returned, None leaves and all, holding the very
    # tensors Keras recorded (and set masks on).
    if trace is not None:
        # The Keras node is kept with the entry: a node of an inline
        # computation is dropped once it ends, and its id can come back as
        # another node's.
        keras_node = _compat.producing_node(outputs[0])[0]
        trace.none_leaves[id(keras_node)] = (keras_node, structure)
    return structure


@functools.lru_cache(maxsize=None)
def _builtin_view_class(cls, variable_names=frozenset()):
    """A subclass of a Keras layer class whose calls on concrete tensors are
    lifted (`_lifting_call`), whose output shapes are as precise as its
    inputs allow (`_precise_output_spec`) and whose variables
    `variable_names` read as graph values from the traced `call`'s own code
    (`write_nodes.reading_members`); everything else is the class's own."""
    return type(cls.__name__, (cls,), {"__module__": cls.__module__,
                                       "__call__": _lifting_call,
                                       "compute_output_spec": _precise_output_spec,
                                       **write_nodes.reading_members(cls, variable_names)})


def _precise_output_spec(self, *args, **kwargs):
    """The layer's own output spec, made precise by `_precise_specs` where
    it leaves a dimension unknown that its inputs know: the code after it
    in `call` reads it (keras_hub's Gemma attention reshapes to
    `ops.shape(q)` after an `EinsumDense(output_shape=(None, heads, dim))`,
    whose own spec leaves the sequence length out; a None there would be
    taken for the batch size)."""
    outputs = super(type(self), self).compute_output_spec(*args, **kwargs)
    flat = keras.tree.flatten(outputs)
    if not all(isinstance(t, keras.KerasTensor) for t in flat):
        return outputs
    precise = _precise_specs(self, args, kwargs, flat)
    if precise is flat:
        return outputs
    return keras.tree.pack_sequence_as(outputs, precise)


def _is_concrete(leaf):
    return isinstance(leaf, np.ndarray) or (
        tf.is_tensor(leaf) and not isinstance(leaf, (keras.KerasTensor, keras.Variable))
        and not isinstance(leaf, tf.Variable)
    )


def _only_the_batch_is_unknown(trace):
    """Whether the traced call's inputs know every dimension but the
    batch size, and `trace.anchor` has it unknown: a None in a shape made
    inside `call` is then the batch size."""
    symbols = [leaf for leaf in keras.tree.flatten((trace.args, trace.kwargs))
               if isinstance(leaf, keras.KerasTensor)]
    anchor_shape = tuple(trace.anchor.shape)
    return bool(anchor_shape) and anchor_shape[0] is None and not any(
        None in tuple(t.shape)[1:] for t in symbols)


def _anchor_of(structure):
    """The graph tensor read nodes hang from, and `BatchSizedOperation`s
    read the batch size of: the first KerasTensor of the call's inputs,
    preferring a numeric one whose batch size is unknown."""
    tensors = [leaf for leaf in keras.tree.flatten(structure)
               if isinstance(leaf, keras.KerasTensor)]
    numeric = [t for t in tensors if t.dtype != "string"]
    batched = [t for t in numeric if t.shape and t.shape[0] is None]
    return (batched or numeric or tensors or [None])[0]


# What every Keras layer / model holds (its variable lists among them): not
# the user's attributes, never replaced by reads.
_KERAS_ATTRIBUTES = frozenset(vars(keras.layers.Layer())) | frozenset(vars(keras.Model()))


def _reject_frozen_variables(nodes, lifted, tape, variables):
    """Raise `TraceError` when a traced node holds a concrete tensor that was
    computed from the traced layer's variables (it would never change)."""
    constants = [
        leaf for node in nodes
        for leaf in _leaves((node.args, node.kwargs))
        if tf.is_tensor(leaf) and not isinstance(leaf, (keras.KerasTensor, Value))
    ]
    constants += [lifted[id(node.operation)] for node in nodes if id(node.operation) in lifted]
    constants = [c for c in constants if c.dtype.is_floating]
    for constant in constants:
        if any(g is not None for g in tape.gradient(constant, variables)):
            raise TraceError(
                "`call` computes a tensor from the layer's weights outside the "
                "graph (a variable not held as an attribute of the layer, or "
                "an operation on one before the graph starts); traced, it "
                "would be frozen"
            )


def _reject_lost_writes(layer, nodes, log):
    """Raise `TraceError` when `call` wrote a variable that the graph of
    `nodes` would not write again: a write made by `call`'s own code (run
    once, at tracing, on the real variable), or inside a sub-layer that is
    no node of the graph. A sub-layer that is a node runs its own `call`,
    writes included."""
    from keras_ipu_plugin.runtime.opaque import OpaqueLayer

    kept = set()
    for node in nodes:
        operation = node.operation
        kept.add(id(operation.layer if isinstance(operation, OpaqueLayer) else operation))
    lost = [write for write in log.writes if write.within is None or id(write.within) not in kept]
    for write in log.writes:
        if write.within is not None and id(write.within) in kept:
            note_writes_variables(write.within)  # never recomputed
    if lost:
        note_writes_variables(layer)
        raise TraceError(writes_reason(layer, lost))


def writes_reason(layer, lost):
    """Why a layer whose `call` writes variables (`lost`: `writes.Write`s)
    is kept whole."""
    return (
        f"`call` of `{layer.name}` writes the variable "
        f"{writes_lib.describe_writes(lost, layer)} itself: a graph of its "
        "sub-layers would lose the write (it ran once, at tracing), so the "
        "layer runs whole (it still trains). A write is recorded in the graph "
        "when it is made on a Keras variable the layer holds, as its attribute "
        "(`self.v = self.add_weight(...)`, then `self.v.assign(...)`) or as one "
        "of a Keras sub-layer's (`self.conv.kernel.assign(...)`)"
    )


def _tf_variables(layer):
    """The TensorFlow variables under `layer`'s Keras variables, trainable
    or not (a frozen moving mean is as stale as a frozen kernel); for a
    distributed variable, its per-replica components (an eager read outside
    a replica context reads one of them)."""
    found = []
    for variable in layer.weights:
        strategy = owning_strategy(variable)
        variable = getattr(variable, "value", variable)
        if not variable.dtype.is_floating:
            continue
        if strategy is not None:
            found.extend(strategy.experimental_local_results(variable))
        else:
            found.append(variable)
    return found


def _leaves(structure):
    found = []
    map_leaves(found.append, structure)
    return found


def _fresh_keras_tensor(tensor):
    if tensor is None:  # kept aside by `_tensors_only`
        return None
    if not isinstance(tensor, keras.KerasTensor):
        raise TypeError(f"`call` returned a {type(tensor).__name__}")
    return _compat.keras_tensor_like(tensor)


def _collect(outputs, placeholders, prefix, pinned, opaque_layers=None, read_names=None,
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
    paths = attribute_paths(owner) if owner is not None else {}
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
        opaque = vars(keras_node.operation).get(_OPAQUE)
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
            unknown = unknown_dimension_attributes(operation)
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
        specs = _dense_unless_given_sparse(
            _precise_specs(operation, args, kwargs, outputs_recorded),
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
        _check_batch_dimensions(nodes, prefix)
    return nodes, output_values


def _dense_unless_given_sparse(specs, structure):
    """`specs` with `sparse=False` where no argument is sparse. Keras's
    `ops.multiply` calls its output sparse when either argument is not a
    tensor of its own (`x * ops.cast(scale, x.dtype)` in keras_hub's Gemma
    embedding); a layer later rebuilt on such a spec is traced on a
    SparseTensor and fails (or computes sparse). `structure`: the
    arguments, a KerasTensor given as the spec recorded for it."""
    if not any(spec.sparse for spec in specs) or any(
        getattr(leaf, "sparse", False) is True or isinstance(leaf, tf.SparseTensor)
        for leaf in keras.tree.flatten(structure)
    ):
        return specs
    return [
        keras.KerasTensor(spec.shape, dtype=spec.dtype, ragged=spec.ragged) if spec.sparse else spec
        for spec in specs
    ]


def _precise_specs(operation, args, kwargs, outputs):
    """The output specs of a layer's call: as recorded, or, where Keras
    left a dimension other than the batch unknown although the inputs
    know theirs (`EinsumDense(output_shape=(None, heads, dim))` leaves the
    sequence length out), as TensorFlow's shape inference on the layer's
    `call` works them out. Later traces of the graph start from these
    shapes, and code such as `ops.arange(ops.shape(x)[1])` needs them."""
    if not isinstance(operation, keras.layers.Layer) or is_read(operation) or all(
        None not in tuple(t.shape)[1:] for t in outputs
    ):
        return outputs
    inputs = [leaf for leaf in keras.tree.flatten((args, kwargs))
              if isinstance(leaf, keras.KerasTensor)]
    if any(None in tuple(t.shape)[1:] for t in inputs):
        return outputs
    try:  # `call` run on symbolic TensorFlow tensors, not the layer's formula
        inferred = [t for t in keras.tree.flatten(
            _compat.Operation.compute_output_spec(operation, *args, **kwargs)
        ) if t is not None]
    except Exception:  # the recorded shapes are right, only less precise
        return outputs
    if len(inferred) != len(outputs):
        return outputs
    precise = []
    for recorded, better in zip(outputs, inferred):
        shape, known = tuple(recorded.shape), tuple(better.shape)
        if len(shape) != len(known) or any(
            a is not None and a != b for a, b in zip(shape[1:], known[1:])
        ):
            return outputs
        precise.append(keras.KerasTensor(
            shape[:1] + known[1:], dtype=recorded.dtype, sparse=recorded.sparse))
    return precise


def _node_name(operation, paths):
    """What a node of `operation` is called in its trace (before numbering)."""
    from keras_ipu_plugin.runtime.opaque import OpaqueLayer
    from keras_ipu_plugin.runtime.random_draws import RandomDraw

    if isinstance(operation, OpaqueLayer):
        return path_of(operation.layer, paths)
    if isinstance(operation, keras.layers.Layer) and id(operation) in paths:
        return paths[id(operation)]
    if isinstance(operation, keras.layers.Layer) and not isinstance(
            operation, (BatchSizedOperation, RandomDraw)):
        return operation.name
    return _AUTO_SUFFIX.sub("", operation.name) or "op"


_AUTO_SUFFIX = re.compile(r"_\d+$")


def _opaque_layer(layer, reason, outputs, made):
    """The `OpaqueLayer` standing for `layer`, made once per `trace_call`
    (`made`: id(layer) -> it), as its traces under `training=True` and
    `False` must agree on the node's operation."""
    from keras_ipu_plugin.runtime.opaque import OpaqueLayer
    from keras_ipu_plugin.runtime.opaque import output_specs_of

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


STATIC_BATCH_HINT = (
    "`ops.shape(x)[0]` is None while tracing, the batch size being unknown; "
    "pass static_batch=True to trace with the per-replica batch"
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


def _check_batch_dimensions(nodes, prefix, multiples=False):
    """Raise `TraceError` unless every unknown dimension in `nodes` is the
    batch size of the traced call's inputs (what a `BatchSizedOperation`
    fills in when the graph runs).

    The nodes are replayed with the inputs' batch size set to 3 and then 7:
    each dimension of each output must then be the same in both (a fixed
    size, matching the trace where it knew it) or 3 and 7 (the batch size).
    A dimension that merely stood where the batch size did (the batch times
    the sequence, after a reshape) would take a wrong value, and fails here.
    With `multiples` (a graph made from traces at two batch sizes, whose
    operations hold each multiple of the batch size they compute with,
    `batch_sized.BatchMultiple`), a dimension may be a fixed multiple of
    the batch size too (3k and 7k: Swin's `batch * windows` rows).
    The outputs' shapes are then set to what the replay showed.
    """
    shapes = [_replayed_shapes(nodes, prefix, batch_size) for batch_size in (3, 7)]
    for node in nodes:
        for value in node.outputs:
            small, large = shapes[0][id(value)], shapes[1][id(value)]
            recorded = tuple(value.spec.shape)
            if len(small) != len(recorded) or not all(
                (a == b and c in (None, a))  # a fixed size
                or ((a, b) == (3, 7) and c is None)  # the batch size
                or (multiples and a % 3 == 0 and b == a // 3 * 7 and c is None)
                # a multiple plus a constant (`batch + 1`), confirmed by a trace
                or (multiples and b > a and (b - a) % 4 == 0 and c is None)
                for a, b, c in zip(small, large, recorded)
            ):
                raise TraceError(_unknown_dimension_reason(node.name, value))
            # What the trace did not know (reshape to `(batch, -1, ...)`)
            # the replay showed: later traces of the graph start from it.
            value.spec = keras.KerasTensor(
                tuple(None if a != b else a for a, b in zip(small, large)),
                dtype=value.spec.dtype, sparse=value.spec.sparse,
            )


def _replayed_shapes(nodes, prefix, batch_size):
    """`{id(Value): shape}` of `nodes`' outputs, worked out by Keras with the
    inputs' (leading, unknown) batch dimension set to `batch_size`."""
    replayed, shapes = {}, {}

    def known(value):
        if id(value) not in replayed:  # an input of the traced call
            shape = tuple(value.spec.shape)
            if any(dim is None for dim in shape[1:]):
                raise TraceError(_unknown_dimension_reason(prefix.rstrip("."), value))
            if shape and shape[0] is None:
                shape = (batch_size,) + shape[1:]
            replayed[id(value)] = keras.KerasTensor(shape, dtype=value.spec.dtype)
        return replayed[id(value)]

    for node in nodes:
        args = map_values(known, node.args)
        kwargs = map_values(known, node.kwargs)
        operation = node.operation
        compute_output_spec = operation.compute_output_spec
        if isinstance(operation, keras.layers.Layer) and not _states_own_output_shape(
            type(operation)
        ):  # its `call` run in a scratch graph; not `Layer.compute_output_spec`,
            # which asks an inherited `compute_output_shape` (one output, where
            # keras_hub's `ESMRotaryEmbedding.call` returns two)
            compute_output_spec = functools.partial(
                _compat.Operation.compute_output_spec, operation)
        try:
            # A None among a layer's outputs (T5's attention without a cache)
            # is no Value of its node (`Node.output_structure` keeps it).
            outputs = [t for t in keras.tree.flatten(compute_output_spec(*args, **kwargs))
                       if t is not None]
        except Exception as error:
            raise TraceError(
                f"{STATIC_BATCH_HINT} (the graph uses the batch size, and the "
                f"shapes of `{node.name}` cannot be checked to follow it: "
                f"{type(error).__name__}: {essential_message(error, limit=200)})"
            ) from error
        # As in the trace (`_collect`): a layer that leaves a dimension
        # unknown although its inputs know theirs (`EinsumDense(output_shape=
        # (None, f))` leaves the sequence out) is asked TensorFlow's shape
        # inference, or the replay could not tell that dimension is fixed.
        outputs = _precise_specs(operation, args, kwargs, outputs)
        if len(outputs) != len(node.outputs):
            raise TraceError(
                f"{STATIC_BATCH_HINT} (the graph uses the batch size, and the shapes "
                f"of `{node.name}` cannot be checked to follow it: it makes "
                f"{len(outputs)} outputs at another batch size, {len(node.outputs)} in the trace)")
        for value, tensor in zip(node.outputs, outputs):
            replayed[id(value)] = tensor
            shapes[id(value)] = tuple(tensor.shape)
    return shapes


def _unknown_dimension_reason(where, value):
    return (
        f"{STATIC_BATCH_HINT} (the graph computes with the batch size, but "
        f"`{where or 'the input'}` has a tensor of shape {tuple(value.spec.shape)} "
        "whose unknown dimension is not the batch size alone)"
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


def _at(error, where):
    """` (`file:line: source`) in `layer`` for a reason: the user's line
    that failed (when found) and the layer it failed in."""
    line = _user_source_line(error)
    return (f" (`{line}`)" if line else "") + (f" in `{where}`" if where else "")


def _describe_failure(error, default=None):
    where = _failing_layer(error) or default
    written = _variable_written_in(error)
    if written is not None:
        # Keras's own words would be about a TensorFlow function on a
        # symbolic tensor; the cause is the write.
        variable, method = written
        name = getattr(variable, "path", None) or variable.name
        return (
            f"`call` writes the variable `{name}` (`{method}`) with a value computed "
            f"from its inputs{_at(error, where)}: a graph of Keras layers cannot hold "
            "the write, so the layer runs whole (it still trains)"
        )
    if _compat.raised_in_tf_random_function(error):
        return (
            f"`call` draws random numbers with a TensorFlow function{_at(error, where)}: "
            "a graph records the draws of `tf.random.normal`, `uniform`, `truncated_normal`, "
            "`categorical`, `gamma`, `poisson` and `shuffle` only, their shape given as "
            "tensors (`tf.shape(x)`, `(tf.shape(x)[0], dim)`) or with the unknown batch size "
            "alone written as None (`ops.shape(x)`), so the layer runs whole (it "
            "still trains; verification replays its draws); give the shape as "
            "`tf.shape(x)`, or draw with `keras.random.normal(shape, "
            "seed=self.seed_generator)` and a `keras.random.SeedGenerator` the layer "
            "holds, for the layer to expand"
        )
    if _TF_ON_SYMBOL in str(error):
        # Keras's message lists what a KerasTensor is; say which line of the
        # user's code did it, and what to write instead.
        return (
            f"`call` applies a TensorFlow function to a symbolic tensor{_at(error, where)}"
            ": only `keras.ops` and Keras "
            "layers trace into a graph; write it with `keras.ops` (e.g. "
            "`ops.square` for `tf.square`) for the layer to expand"
        )
    if _SYMBOLIC_SHAPE.search(str(error)):
        return (
            f"`call` gives an operation a shape or size computed from tensor "
            f"values{_at(error, where)}: the output's shape "
            "then depends on the data, which a Keras graph cannot hold; give it "
            "a Python number or a static dimension for the layer to expand"
        )
    if _TENSOR_AS_BOOL in str(error):
        # Python control flow on a tensor's value: one graph cannot hold both
        # branches. Say which line branches (keras_hub's RoFormer-v2
        # positional embedding) rather than only Keras's words.
        return (
            f"`call` uses a tensor's value as a boolean in Python control flow (`if`, `while`, "
            f"`and`/`or`){_at(error, where)}: the branch taken "
            "depends on the data, which one graph cannot hold; the layer runs whole "
            "(it still trains); computing both results and choosing with `ops.where` lets it expand"
        )
    known = failures.known_failure(essential_message(error, limit=2000), _at(error, where))
    if known is not None:
        return known
    text = f"{type(error).__name__}: {essential_message(error, limit=300)}"
    text = f"{text} (in `{where}`)" if where else text
    if _NONE_VALUE.search(text):
        # Almost always a shape built from `ops.shape(x)[0]`: say what helps.
        return f"{text}; {STATIC_BATCH_HINT}, or write a reshape's batch dimension as -1"
    if _TO_NUMPY.search(text):
        return f"{text}; {NUMPY_OPERAND_HINT}"
    # Never TensorFlow's or Keras's words alone: say what happened, then
    # what they said, then what to write.
    line = _user_source_line(error)
    return (
        f"`call` fails when run on symbolic tensors{f' (`{line}`)' if line else ''}: "
        f"{text}. The layer runs whole (it still trains); write that computation with "
        "`keras.ops` and Keras layers, which trace, for the layer to expand"
    )


_WRITE_METHODS = frozenset({"assign", "assign_add", "assign_sub", "scatter_update",
                            "scatter_add", "scatter_sub", "scatter_nd_update"})


def _variable_written_in(error):
    """`(variable, method)` when `error` was raised inside a write to a
    Keras or TensorFlow variable (`kernel.assign(symbolic)`), else None."""
    tb = error.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        owner = frame.f_locals.get("self")
        if frame.f_code.co_name in _WRITE_METHODS and isinstance(owner, (keras.Variable, tf.Variable)):
            return owner, frame.f_code.co_name
        tb = tb.tb_next
    return None


_NONE_VALUE = re.compile(r"value \(None\)|NoneType")
_TF_ON_SYMBOL = "A KerasTensor cannot be used as input to a TensorFlow function"
_TENSOR_AS_BOOL = "A symbolic KerasTensor cannot be used as a boolean"
_SYMBOLIC_SHAPE = re.compile(r"Cannot convert .*KerasTensor.* to a shape", re.DOTALL)
_LIBRARY_PATHS = re.compile(r"[/\\](tensorflow|keras|keras_ipu_plugin|optree)[/\\]")


def _user_source_line(error):
    """`file:line: source` of the innermost frame of user code (not
    TensorFlow's, Keras's or ours) in `error`'s traceback, or None."""
    found = None
    tb = error.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        if not _LIBRARY_PATHS.search(code.co_filename):
            found = (code.co_filename, tb.tb_lineno)
        tb = tb.tb_next
    if found is None:
        return None
    import linecache

    source = linecache.getline(*found).strip()
    return f"{found[0].rsplit('/', 1)[-1]}:{found[1]}: {source}"


_TO_NUMPY = re.compile(r"KerasTensor is symbolic.*NumPy array")

NUMPY_OPERAND_HINT = (
    "a NumPy array on the left of an operator (`np.ones(n) * x`) or given to a "
    "NumPy function (`np.exp(x)`) turns the tensor into a NumPy array, which a "
    "traced tensor cannot be (NumPy scalars are followed): write it with "
    "`keras.ops` (`ops.convert_to_tensor(array) * x`)"
)


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
