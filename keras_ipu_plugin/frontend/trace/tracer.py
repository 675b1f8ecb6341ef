"""The `Tracer`: it traces a `call`, and says where tracing stops, which
`call`s take `training`, and when a failed trace is tried again; and the
entry of a trace for a whole model (`trace_model`: a model into a `Graph`).

`Tracer.trace` traces one call of a layer on symbolic inputs into IR
nodes. The trace in progress is a `CallTrace` (`call_trace.py`); what makes
the graph is `Tracer.traces`, the one overridable retry policy: the call
traced under both `training` modes, and where that fails on the unknown
batch size, at two batch sizes (multiples of what it divides the batch
by), or at sizes of each input's own (`batch/traces.py`). A finished trace
is checked: no weight frozen into it, no variable write lost.

As torch.fx's `Tracer.is_leaf_module`, one overridable method says where
tracing stops: `is_user_code(layer)`. A layer of user code is traced
through: its `call` runs inline on the symbolic tensors while the model is
traced, and Expand inlines its node into the nodes of its `call`. A layer
that is not (Keras's own layers; what a subclass says to keep whole) is a
leaf: one node that calls the layer. `takes_training(layer)` says whether
a layer's `call` is handed `training`. The defaults are the package's one
rule and one probe (`layers/user_code.py`).

`convert_to_functional`, `apply_passes` and `PluginModel` take a tracer
(`tracer=`); by default the one in use on the thread (`with
tracer.tracing():`), `DEFAULT_TRACER` otherwise. A `PluginModel` keeps the
one it was made with for every later conversion.

Example:
    ```python
    class KeepAttention(Tracer):
        def is_user_code(self, layer):
            return not isinstance(layer, MyAttention) and super().is_user_code(layer)
    expanded = kip.apply_passes(model, [kip.passes.Expand("all")],
                                tracer=KeepAttention())
    # every MyAttention is one node of `expanded`, the rest is expanded
    plugin = kip.PluginModel(MyModel(), passes=[kip.passes.Expand("all")],
                             tracer=KeepAttention())   # and at every rebuild
    ```

Tracing a whole model: calling `layer.call(...)` (not `layer(...)`) on
KerasTensors records one Keras node per sub-layer or `keras.ops` call made
inside it. We walk those nodes
back from the outputs into `graph.Node`s, then undo the node bookkeeping on
the user's layers: the IR is the only record kept, and `runtime.rebuild.rebuild`
makes the final functional model.

`trace_model` is the entry for a whole model; a layer's call is traced by
`Tracer.trace`. The other parts of a trace are each a module of their own:

- `call_trace.py`: one symbolic call (`trace_once`), the trace in progress
  (`CallTrace`: reads, held constants, random draws, writes) and the Keras
  nodes it recorded walked back into IR nodes (`collect_nodes`);
- `writes.py`: the variable writes a `call` makes, seen as they happen and
  recorded as graph nodes;
- `trace_views.py`: the classes of the views called instead of the user's
  layers, how their output shapes are worked out (as precise as the inputs
  allow) and the losses their `add_loss` records;
- `training_modes.py`: tracing under both `training` modes to tell which
  nodes follow the model's `training`;
- `../batch/`: batch generalisation (traces at two batch sizes made one
  graph; shapes replayed to check the batch size);
- `failures.py`: `TraceError` and the reason text of each failure;
- `../idioms.py`: the symbolic idioms Keras rejects, followed
  while tracing (`ops.tile` with the batch size, `x[None]`, NumPy scalars, draws).

What `call` holds rather than receives is a node too (`layers/state.py`): the
variables the traced layer keeps as attributes are read through
`VariableRead` nodes, and a direct sub-layer called on concrete tensors only
(`self.embedding(ops.arange(n))`) is called on `HeldConstant` nodes holding
them, rather than run eagerly with its weights frozen into the result. A
concrete tensor that still ends up in the graph and was computed from the
layer's weights fails the trace (a GradientTape shows it): never a frozen
weight.
"""

import contextlib
import threading

import keras
import tensorflow as tf

from keras_ipu_plugin.frontend.batch.traces import (
    TRIAL_BATCH_SIZES,
    divided_trial_sizes,
    one_graph_for_any_batch,
    per_input_traces,
    trace_at_two_batch_sizes,
)
from keras_ipu_plugin.frontend.trace import writes as writes_lib
from keras_ipu_plugin.frontend.trace.call_trace import CallTrace, Traces
from keras_ipu_plugin.frontend.trace.failures import (
    ModeStructureError,
    TraceError,
    writes_reason,
    essential_message,
)
from keras_ipu_plugin.frontend.trace.training_modes import with_branch_nodes
from keras_ipu_plugin.frontend.trace.training_modes import trace_modes
from keras_ipu_plugin.ir.graph import Value, map_leaves, Graph
from keras_ipu_plugin.layers import user_code
from keras_ipu_plugin.layers.layer_kinds import note_writes_variables
from keras_ipu_plugin.layers.opaque import OpaqueLayer
from keras_ipu_plugin.layers.state import ReadLayers
from keras_ipu_plugin.runtime.variables import owning_strategy

__all__ = [
    "Tracer",
    "DEFAULT_TRACER",
    "current_tracer",
    "tracer_of",
    "TraceError",
    "Tracer",
    "essential_message",
    "trace_model",
    "writes_reason",
]


class Tracer:
    """The hooks of a trace; subclass it and override them (see the module
    docstring). The default instance is `DEFAULT_TRACER`."""

    def is_user_code(self, layer):
        """Whether tracing goes through `layer` (True), or keeps it as one
        node, a leaf (False). Default: the one rule, `user_code.is_user_layer`
        (its class is not one `keras.layers` exports nor the plugin's own).
        A nested functional model is inlined by Expand whatever this says of
        it: its graph is no code of anyone's to trace."""
        return user_code.is_user_layer(layer)

    def takes_training(self, layer):
        """Whether `layer`'s `call` is handed the `training` mode. Default:
        it has a `training` parameter (`user_code.takes_training`, as Keras
        decides)."""
        return user_code.takes_training(layer)

    def traced_call(self, layer):
        """The `call` tracing runs inline for `layer` (its class's, when
        written in user code: `user_code.user_call`), or None for a leaf;
        override `is_user_code`, not this."""
        return user_code.user_call(layer, self.is_user_code, through_overrides=True)

    def trace(self, layer, args, kwargs, placeholders, *, training, prefix, reads=None):
        """Trace `layer.call(*args, **kwargs)`; KerasTensors in `args` /
        `kwargs` must be keys (by id) of `placeholders`, mapping them to
        graph Values. `training`: None to follow the caller's mode, or the
        one mode to trace in.

        Variables `call` reads from the layer's attributes become
        `VariableRead` nodes (taken from `reads`, one per variable in a
        graph); a sub-layer called on concrete tensors made inside `call` is
        called on `HeldConstant` nodes holding them. A tensor computed from
        the layer's weights outside the graph (it would be frozen), or a
        write the graph would lose, raises `TraceError`.

        Returns `(nodes, outputs)`: new Nodes named `prefix + layer name`
        and the output structure in terms of Values.

        Example:
            ```python
            nodes, outputs = DEFAULT_TRACER.trace(
                layer, (x,), {}, {id(x): value}, training=None, prefix="block.")
            ```
        """
        # In use while it traces: the traces made inside (Expand's, the
        # modes') ask it too.
        with self.tracing():
            call = CallTrace(layer, args, kwargs, placeholders, prefix,
                             ReadLayers() if reads is None else reads,
                             training=training, tracer=self)
            variables = _tf_variables(layer)
            log = writes_lib.WriteLog()
            # The tape sees only eager work: a weight read outside the graph
            # (a variable reached other than as an attribute, a sub-layer
            # called on a tensor computed from weights) would be frozen into
            # it. The log sees the variable writes `call` makes as it runs
            # (see `writes.py`).
            with log.recording(), \
                    tf.GradientTape(persistent=True, watch_accessed_variables=False) as tape:
                tape.watch(variables)
                traces = self.traces(call)
            for trace, (nodes, _) in traces.runs:
                nodes = with_branch_nodes(nodes)
                _reject_frozen_variables(nodes, trace, tape, variables)
                _reject_lost_writes(layer, nodes, log)
            if traces.trial is None:
                return traces.runs[0][1]
            return one_graph_for_any_batch(traces)

    def traces(self, call):
        """The retry policy: the `Traces` of `call` (a `CallTrace`, symbolic)
        its graph is made of. Override to trace a call otherwise.

        The call is traced under both `training` modes (`trace_modes`);
        where that trace reads an input's unknown leading size while two or
        more inputs have one, again at sizes of each input's own
        (`per_input_traces`). Where the symbolic trace fails (on the
        unknown batch size), the call is traced at two batch sizes:
        `TRIAL_BATCH_SIZES`, or multiples of what `call` divides the batch
        size by (`divided_trial_sizes`: Swin's `ops.shape(x)[0] // k`), each
        input at sizes of its own first where their leading sizes may
        differ (`trace_at_two_batch_sizes`). Raises `TraceError`.
        """
        try:
            traced = trace_modes(call)  # the main trace: symbolic, in both modes
            return per_input_traces(Traces(((call, traced),)))
        except ModeStructureError:
            raise  # the same at any batch size
        except TraceError as error:
            sizes = divided_trial_sizes(call, error) or TRIAL_BATCH_SIZES
            return trace_at_two_batch_sizes(call, error, sizes)

    @contextlib.contextmanager
    def tracing(self):
        """Make this the tracer in use on this thread while the context lasts."""
        stack = _in_use.__dict__.setdefault("stack", [])
        stack.append(self)
        try:
            yield self
        finally:
            stack.pop()


def _reject_frozen_variables(nodes, trace, tape, variables):
    """Raise `TraceError` when a traced node holds a concrete tensor that was
    computed from the traced layer's variables (it would never change),
    naming the variables and, where the tensor was met as a sub-layer's or
    operation's input, the line of the user's code that computed it."""
    lifted = trace.lifted
    constants = [
        (leaf, None) for node in nodes
        for leaf in _leaves((node.args, node.kwargs))
        if tf.is_tensor(leaf) and not isinstance(leaf, (keras.KerasTensor, Value))
    ]
    constants += [(lifted[id(node.operation)], trace.lift_sites.get(id(node.operation)))
                  for node in nodes if id(node.operation) in lifted]
    for constant, site in constants:
        if not constant.dtype.is_floating:
            continue
        gradients = tape.gradient(constant, variables)
        used = [variable for variable, gradient in zip(variables, gradients)
                if gradient is not None]
        if used:
            names = ", ".join(f"`{_variable_name(variable)}`" for variable in used[:4])
            at = f" (`{site}`)" if site else ""
            raise TraceError(
                f"`call` computes a tensor from the weight {names} outside the graph{at}: "
                "the weight is read eagerly (not through the layer's attribute while traced: "
                "a variable the layer does not hold, one captured before `call`, or an "
                "operation on it run eagerly), so the traced graph would hold its value "
                "frozen; compute it with `keras.ops` from a weight the layer holds as an "
                "attribute for the layer to expand"
            )


def _variable_name(variable):
    return getattr(variable, "path", None) or str(getattr(variable, "name", variable)).split(":")[0]


def _reject_lost_writes(layer, nodes, log):
    """Raise `TraceError` when `call` wrote a variable that the graph of
    `nodes` would not write again: a write made by `call`'s own code (run
    once, at tracing, on the real variable), or inside a sub-layer that is
    no node of the graph. A sub-layer that is a node runs its own `call`,
    writes included."""
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


DEFAULT_TRACER = Tracer()

_in_use = threading.local()


def current_tracer():
    """The tracer in use on this thread (`Tracer.tracing`), else `DEFAULT_TRACER`."""
    stack = getattr(_in_use, "stack", None)
    return stack[-1] if stack else DEFAULT_TRACER


def tracer_of(graph):
    """The `Tracer` that traces more of `graph` (a pass expanding one of its
    nodes): the one it was handed (`graph.tracer`, set by `apply_passes`),
    else the one in use on the thread.

    Example:
        ```python
        tracer_of(graph).is_user_code(node.operation)
        ```
    """
    return current_tracer() if graph.tracer is None else graph.tracer


def trace_model(model, input_specs, training=None, tracer=None):
    """Trace `model.call` on inputs shaped by `input_specs` into a `Graph`;
    `tracer` (a `Tracer`) says where tracing stops, the one in use
    (`current_tracer`) by default.

    Raises `TraceError` when `call` cannot be captured symbolically.

    Example:
        ```python
        graph = trace_model(model, first_batch(x).specs)
        [node.name for node in graph.nodes]
        # -> ['embedding', 'blocks.0', 'blocks.1', 'head']
        ```
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
    tracer = current_tracer() if tracer is None else tracer
    nodes, outputs = tracer.trace(model, (inputs,), {}, placeholders, training=training,
                                  prefix="")
    if any(leaf is None for leaf in keras.tree.flatten(outputs)):
        raise TraceError(
            "`call` returns None among its outputs, which a functional model "
            "cannot return; return the tensors only"
        )
    return Graph(input_specs, input_values, nodes, outputs, name=model.name)
