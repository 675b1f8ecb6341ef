"""Trace a layer's `call` on symbolic inputs into the graph IR.

Calling `layer.call(...)` (not `layer(...)`) on KerasTensors records one Keras
node per sub-layer or `keras.ops` call made inside it. We walk those nodes
back from the outputs into `graph.Node`s, then undo the node bookkeeping on
the user's layers: the IR is the only record kept, and `runtime.rebuild.rebuild`
makes the final functional model.

This module is the entry for a whole model (`trace_model`); a layer's call
is traced by `Tracer.trace`. The concepts it puts together are each a
module of their own:

- `tracer.py`: the `Tracer`: `trace` (one call into IR nodes, and the checks
  on a finished trace: no weight frozen, no write lost), the retry policy
  (`traces`), and the hooks that say where tracing stops (which layers are
  user code it traces through) and which `call`s take `training`;
- `call_trace.py`: one symbolic call (`trace_once`) and the trace in
  progress (`CallTrace`: reads, held constants, random draws, writes);
- `trace_views.py`: the classes of the views called instead of the user's
  layers, and how their output shapes are worked out;
- `keras_nodes.py`: the Keras nodes a call recorded, walked into IR nodes;
- `training_modes.py`: tracing under both `training` modes to tell which
  nodes follow the model's `training`;
- `../batch/`: batch generalisation (traces at two batch sizes made one
  graph; shapes replayed to check the batch size);
- `output_specs.py`: output specs as precise as the inputs allow;
- `failures.py`: `TraceError` and the reason text of each failure;
- `../idioms/traced_idioms.py`: the symbolic idioms Keras rejects, followed
  while tracing (`ops.tile` with the batch size, `x[None]`, NumPy scalars, draws).

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

from keras_ipu_plugin.frontend.trace.failures import TraceError
from keras_ipu_plugin.frontend.trace.failures import essential_message  # noqa: F401 (re-exported)
from keras_ipu_plugin.frontend.trace.failures import writes_reason  # noqa: F401 (re-exported)
from keras_ipu_plugin.frontend.trace.tracer import Tracer  # noqa: F401 (re-exported)
from keras_ipu_plugin.frontend.trace.tracer import current_tracer
from keras_ipu_plugin.ir.graph import Graph
from keras_ipu_plugin.ir.graph import Value


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
    tracer = current_tracer() if tracer is None else tracer
    nodes, outputs = tracer.trace(model, (inputs,), {}, placeholders, training=training,
                                  prefix="")
    if any(leaf is None for leaf in keras.tree.flatten(outputs)):
        raise TraceError(
            "`call` returns None among its outputs, which a functional model "
            "cannot return; return the tensors only"
        )
    return Graph(input_specs, input_values, nodes, outputs, name=model.name)


__all__ = ["TraceError", "Tracer", "essential_message", "trace_model", "writes_reason"]
