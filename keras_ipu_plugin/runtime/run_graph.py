"""The graph a `KipFunctional` runs: kip's own `Graph`, over the model's layers.

`graph_to_run(model)` reads the model once and makes an IR `Graph` whose
nodes are the calls the model makes, in the order Keras runs them, each
holding what running it needs: the operation the model calls (the layer,
or the `LayerAlias` the model calls it through), its arguments with a
`Value` where a tensor flows, its `training` (True / False where the code
pinned it, `FOLLOW` for a layer that follows the model's), and its
annotations (what Outline / Recompute / PipelineStages and any other pass
recorded). The interpreter (`interpreter.py`) and the run-time effects read
these from the nodes only.

This is the one place where the saved form is read: a model keeps its
annotations and pinned `training` values in its config keyed by Keras layer
name (the key a loaded model has; it has no IR of its own), and each node
gets its own here, once.

Example:
    >>> graph = graph_to_run(passed)
    >>> [(node.name, node.annotations) for node in graph.nodes][:2]
    [('stem', {}), ('block_1', {'recompute': True})]
"""

import keras

from keras_ipu_plugin import _compat
from keras_ipu_plugin.ir.graph import FOLLOW
from keras_ipu_plugin.ir.graph import Graph
from keras_ipu_plugin.ir.graph import Node
from keras_ipu_plugin.ir.graph import Value
from keras_ipu_plugin.ir.names import Namespace

#: `node.meta` entry: the Values a node reads, in the order Keras flattens
#: its arguments (what an outlined body's signature and a recomputed
#: segment's inputs follow).
INPUTS = "run_inputs"


def graph_to_run(model):
    """kip's `Graph` of the calls `model` (a `KipFunctional`) makes.

    Example:
        >>> graph = graph_to_run(passed)
        >>> graph.nodes[0].operation is passed.layers[1]
        True
    """
    value_of = {}  # id(KerasTensor) -> Value
    input_values = []
    for tensor in model.inputs:
        value = Value(None, len(input_values), tensor)
        value_of[id(tensor)] = value
        input_values.append(value)
    names = Namespace()
    pinned = model.kip_pinned_training
    nodes = []
    for keras_node in _compat.functional_nodes(model):
        operation = keras_node.operation
        name = getattr(operation, "name", None)
        # Keras's own fill-in, with Values for the tensors: the arguments
        # keep the very structure the model's call gives the operation.
        args, kwargs = _compat.node_fill_in(keras_node, value_of)
        node = Node(names.create(name or type(operation).__name__), operation, tuple(args),
                    dict(kwargs), None, training=_training_of(operation, name, pinned))
        node.meta[INPUTS] = [value_of[id(t)] for t in _compat.node_input_tensors(keras_node)]
        node.annotations = dict(model.kip_annotations.get(name, {}))
        for index, tensor in enumerate(_compat.node_outputs(keras_node)):
            value = Value(node, index, tensor)
            value_of[id(tensor)] = value
            node.outputs.append(value)
        nodes.append(node)
    outputs = [value_of[id(tensor)] for tensor in model.outputs]
    return Graph(list(model.inputs), input_values, nodes, outputs, name=model.name)


def _training_of(operation, name, pinned):
    if not isinstance(operation, keras.layers.Layer):
        return None
    return pinned[name] if name is not None and name in pinned else FOLLOW


def inputs_of(node):
    """The Values `node` reads, in Keras's order of its arguments."""
    return node.meta[INPUTS]
