"""Trace a layer's `call` on symbolic inputs into the graph IR.

Calling `layer.call(...)` (not `layer(...)`) on KerasTensors records one Keras
node per sub-layer or `keras.ops` call made inside it. We walk those nodes
back from the outputs into `graph.Node`s, then undo the node bookkeeping on
the user's layers: the IR is the only record kept, and `runtime.rebuild.rebuild`
makes the final functional model.

This module is the entry (`trace_model`, `trace_call`) and the checks made
on a finished trace (no weight frozen into it, no variable write lost). The
concepts it puts together are each a module of their own:

- `tracer.py`: the `Tracer`, whose hooks say where tracing stops (which
  layers are user code it traces through) and which `call`s take `training`;
- `call_trace.py`: one symbolic call (`trace_once`) and the trace in
  progress (`CallTrace`: reads, held constants, random draws, writes);
- `trace_views.py`: the classes of the views called instead of the user's
  layers, and how their output shapes are worked out;
- `keras_nodes.py`: the Keras nodes a call recorded, walked into IR nodes;
- `training_modes.py`: tracing under both `training` modes to tell which
  nodes follow the model's `training`;
- `batch_traces.py` / `batch_shapes.py`: batch generalisation (traces at two
  batch sizes made one graph; shapes replayed to check the batch size);
- `output_specs.py`: output specs as precise as the inputs allow;
- `failures.py`: `TraceError` and the reason text of each failure;
- `traced_idioms.py`: the symbolic idioms Keras rejects, followed while
  tracing (`ops.tile` with the batch size, `x[None]`, NumPy scalars, draws).

What `call` holds rather than receives is a node too (`reads.py`): the
variables the traced layer keeps as attributes are read through
`VariableRead` nodes, and a direct sub-layer called on concrete tensors only
(`self.embedding(ops.arange(n))`) is called on `HeldConstant` nodes holding
them, rather than run eagerly with its weights frozen into the result. A
concrete tensor that still ends up in the graph and was computed from the
layer's weights fails the trace (a GradientTape shows it): never a frozen
weight.
"""

import keras
import tensorflow as tf

from keras_ipu_plugin.frontend.trace import training_branches
from keras_ipu_plugin.frontend.trace import writes as writes_lib
from keras_ipu_plugin.frontend.batch.traces import one_graph_for_any_batch
from keras_ipu_plugin.frontend.batch.traces import per_input_runs
from keras_ipu_plugin.frontend.batch.traces import trace_at_two_batch_sizes
from keras_ipu_plugin.frontend.batch.divisions import divided_trial_sizes
from keras_ipu_plugin.frontend.batch.traces import TRIAL_BATCH_SIZES
from keras_ipu_plugin.frontend.trace.call_trace import CallTrace
from keras_ipu_plugin.frontend.trace.failures import TraceError
from keras_ipu_plugin.frontend.trace.failures import ModeStructureError
from keras_ipu_plugin.frontend.trace.failures import essential_message  # noqa: F401 (re-exported)
from keras_ipu_plugin.frontend.trace.failures import writes_reason
from keras_ipu_plugin.frontend.trace.tracer import current_tracer
from keras_ipu_plugin.frontend.trace.tracer import Tracer  # noqa: F401 (re-exported)
from keras_ipu_plugin.frontend.trace.training_modes import trace_modes
from keras_ipu_plugin.ir.graph import Graph
from keras_ipu_plugin.ir.graph import Value
from keras_ipu_plugin.ir.graph import map_leaves
from keras_ipu_plugin.runtime.distribution import owning_strategy
from keras_ipu_plugin.layers.layer_kinds import note_writes_variables
from keras_ipu_plugin.layers.state.reads import ReadLayers


def trace_model(model, input_specs, training=None, tracer=None):
    """Trace `model.call` on inputs shaped by `input_specs` into a `Graph`;
    `tracer` (a `Tracer`) says where tracing stops, the one in use
    (`current_tracer`) by default.

    Raises `TraceError` when `call` cannot be captured symbolically.

    Example:
        >>> graph = trace_model(model, first_batch(x).specs)
        >>> [node.name for node in graph.nodes]
        ['embedding', 'blocks.0', 'blocks.1', 'head']
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
        model, (inputs,), {}, placeholders, training=training, prefix="", tracer=tracer
    )
    if any(leaf is None for leaf in keras.tree.flatten(outputs)):
        raise TraceError(
            "`call` returns None among its outputs, which a functional model "
            "cannot return; return the tensors only"
        )
    return Graph(input_specs, input_values, nodes, outputs, name=model.name)


def trace_call(layer, args, kwargs, placeholders, *, training, prefix, reads=None,
               tracer=None):
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
    tracer = current_tracer() if tracer is None else tracer
    with tracer.tracing():  # for every trace made inside (Expand's, the modes')
        return _trace_call(layer, args, kwargs, placeholders, training, prefix, reads, tracer)


def _trace_call(layer, args, kwargs, placeholders, training, prefix, reads, tracer):
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
        trace = CallTrace(layer, args, kwargs, placeholders, prefix, reads, tracer=tracer)
        try:
            runs = per_input_runs([(trace, trace_modes(trace, training))], layer, args,
                                  kwargs, placeholders, prefix, reads, training, tracer)
        except ModeStructureError:
            raise  # the same at any batch size
        except TraceError as error:
            # `ops.shape(x)[0] // k` (Swin's windows): at multiples of k
            sizes = divided_trial_sizes(layer, args, kwargs, placeholders, prefix, reads,
                                        training, tracer, error)
            runs = trace_at_two_batch_sizes(
                layer, args, kwargs, placeholders, prefix, reads, training, error, tracer,
                batch_sizes=sizes or TRIAL_BATCH_SIZES)
    for trace, (nodes, _) in runs:
        nodes = training_branches.with_branch_nodes(nodes)
        _reject_frozen_variables(nodes, trace, tape, variables)
        _reject_lost_writes(layer, nodes, log)
    if len(runs) == 1:
        return runs[0][1]
    return one_graph_for_any_batch(runs, lambda batch_sizes: trace_at_two_batch_sizes(
        layer, args, kwargs, placeholders, prefix, reads, training, None, tracer, batch_sizes),
        prefix)


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
    from keras_ipu_plugin.layers.opaque import OpaqueLayer

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


__all__ = ["TraceError", "Tracer", "essential_message", "trace_call", "trace_model",
           "writes_reason"]
