"""A call that branches on `training` in Python and computes with the batch
size: its `ModeSwitch` nodes, traced at two batch sizes, made one.

keras_hub's Mixtral MoE block adds its load-balancing loss in training
only (`if training:`, a `ModeSwitch` holding a graph per mode,
`training_branches.py`), and recovers the batch size there as
`ops.shape(router_logits)[0] // seq_len`, which fails on the unknown batch
size: the block is traced at two batch sizes (`batch_traces.py`), and each
trace holds a switch of its own. The two switches are one where each
mode's two graphs are one graph for any batch size
(`batch_generalization.generalize_batch`, applied to them in turn, their
inputs matched one for one); the switch is then rebuilt of those graphs,
each checked to follow the batch size (`batch_shapes.check_batch_dimensions`).

Example:
    >>> operation = general_switch(node_s, node_l, inputs, (1, 3), anchor, same, "moe.",
    ...                            generalize_batch, general_spec)
"""

from keras_ipu_plugin.frontend.batch.errors import NotBatchGeneral
from keras_ipu_plugin.frontend.batch.shapes import check_batch_dimensions
from keras_ipu_plugin.frontend.trace.failures import TraceError
from keras_ipu_plugin.ir.graph import Graph
from keras_ipu_plugin.ir.specs import InputSpec
from keras_ipu_plugin.runtime.mode_switch import ModeSwitch


def are_switches(node_a, node_b):
    """Whether two traces' nodes are `ModeSwitch`es standing for one
    layer's call, with the same modes."""
    a, b = node_a.operation, node_b.operation
    return (isinstance(a, ModeSwitch) and isinstance(b, ModeSwitch)
            and a.of_layer == b.of_layer and a.none_means == b.none_means
            and set(a.mode_outputs) == set(b.mode_outputs)
            and a.branch_graphs is not None and b.branch_graphs is not None)


def general_switch(node_s, node_l, inputs, batch_sizes, anchor, same_operation, prefix,
                   generalize_batch, general_spec):
    """A `ModeSwitch` for any batch size, made of the switches of two traces
    at `batch_sizes` (`node_s`, `node_l`). `inputs`: the switch's inputs
    (Values of the small trace's graph); `anchor`: the Value whose leading
    size is the batch size there. `generalize_batch` and `general_spec`:
    `batch_generalization`'s, for each mode's graph and its inputs' specs
    (that module calls this one). Raises `NotBatchGeneral`."""
    switch_s, switch_l = node_s.operation, node_l.operation
    if not isinstance(batch_sizes[0], int):
        raise NotBatchGeneral(
            f"`{node_s.name}` branches on `training` in Python, and its inputs' leading "
            "sizes are independent of each other, which its graphs cannot follow")
    place = next((i for i, value in enumerate(inputs) if value is anchor), None)
    graphs = {}
    for mode, graph_s in switch_s.branch_graphs.items():
        graph_l = switch_l.branch_graphs[mode]
        if len(graph_s.input_values) != len(graph_l.input_values):
            raise NotBatchGeneral(f"`{node_s.name}` reads other inputs in {mode}")
        known = dict(zip(map(id, graph_l.input_values), graph_s.input_values))
        specs = []
        for spec, value_s, value_l in zip(graph_s.input_specs, graph_s.input_values,
                                          graph_l.input_values):
            value_s.spec = general_spec(value_s.spec, value_l.spec, batch_sizes, node_s.name)
            shape = tuple(value_s.spec.shape)
            specs.append(InputSpec(name=spec.name, shape=shape[1:], dtype=spec.dtype,
                                   batch_size=shape[0]))
        inner = graph_s.input_values[place] if place is not None else next(
            (value for value in graph_s.input_values
             if value.spec.shape and value.spec.shape[0] is None), None)
        if inner is None:
            raise NotBatchGeneral(
                f"`{node_s.name}` branches on `training` in Python, and reads no input "
                "whose leading size is the batch size")
        nodes, outputs = generalize_batch(
            (graph_s.nodes, graph_s.outputs), (graph_l.nodes, graph_l.outputs), batch_sizes,
            inner, same_operation, prefix, known=known)
        try:
            check_batch_dimensions(nodes, prefix, multiples=True, scale=batch_sizes[0])
        except TraceError as error:
            raise NotBatchGeneral(f"in {mode}, {error.reason}") from None
        graph_s.nodes = []  # detached: the small trace's switch is done with
        graphs[mode] = Graph(specs, list(graph_s.input_values), nodes, list(outputs),
                             name=graph_s.name)
    return switch_s.with_branch_graphs(graphs)


__all__ = ["are_switches", "general_switch"]
