"""`graph_of(model)`: the IR graph a `KipFunctional` runs.

A model made by conversion or by `apply_passes` holds the graph the passes
produced (`model.kip_graph`), and that graph is what runs: each node with
its operation, its arguments, its `training` and its annotations (what
Outline / Recompute / PipelineStages and any other pass recorded), per
call site. A model without one (loaded from a file, or the model of one
`training` mode of a `ModeSwitch`) has its graph read once from its Keras
nodes, here, the one place the saved form is read:

- each call site gets its node path back from `kip_layer_paths`
  (`{path: Keras layer name}`, written in call order; a layer called at
  two sites has two paths, matched to its calls in the order Keras made
  them, which loading keeps);
- its annotations from `kip_node_annotations` (`{path: notes}`, per call
  site); a file without them (written before annotations were saved per
  call site) has `kip_annotations` (`{Keras layer name: notes}`), which
  hold for every call of the layer;
- its `training`: True / False where the code pinned it at that call site
  (`kip_node_training`, `{path: bool}`; a file without it has
  `kip_pinned_training`, by Keras layer name), else the model's. (Not from
  the Keras node's own arguments: loading records a `training=False` on
  calls that had none.)

Example:
    >>> graph = graph_of(keras.models.load_model("passed.keras"))
    >>> [(node.name, node.annotations) for node in graph.nodes][:2]
    [('stem', {}), ('blocks.0', {'recompute': True})]
"""

import keras

from keras_ipu_plugin import _compat
from keras_ipu_plugin.ir.graph import FOLLOW
from keras_ipu_plugin.ir.graph import Graph
from keras_ipu_plugin.ir.graph import Node
from keras_ipu_plugin.ir.graph import Value
from keras_ipu_plugin.ir.graph import Namespace


def graph_of(model):
    """The graph `model` (a `KipFunctional`) runs: `model.kip_graph`, or,
    where it has none, the graph read from its Keras nodes (once).

    Example:
        >>> graph_of(passed) is passed.kip_graph
        True
    """
    if model.kip_graph is not None:
        return model.kip_graph
    read = getattr(model, "_kip_read_graph", None)
    if read is None:
        read = _read_graph(model)
        object.__setattr__(model, "_kip_read_graph", read)
    return read


def _read_graph(model):
    value_of = {}  # id(KerasTensor) -> Value
    input_values = []
    for tensor in model.inputs:
        value = Value(None, len(input_values), tensor)
        value_of[id(tensor)] = value
        input_values.append(value)
    keras_nodes = _compat.functional_nodes(model)
    paths = _call_site_paths(model, keras_nodes)
    by_path = model.kip_node_annotations
    by_name = model.kip_saved_layer_annotations
    pinned_by_path = model.kip_node_training
    pinned_by_name = model.kip_pinned_training
    names = Namespace()
    nodes = []
    for keras_node in keras_nodes:
        operation = keras_node.operation
        name = getattr(operation, "name", None)
        path = paths.get(id(keras_node)) or name or type(operation).__name__
        args, kwargs = _compat.node_fill_in(keras_node, value_of)
        kwargs = dict(kwargs)
        kwargs.pop("training", None)
        training = None
        if isinstance(operation, keras.layers.Layer):
            pinned = (pinned_by_path.get(path) if pinned_by_path is not None
                      else pinned_by_name.get(name))
            training = FOLLOW if pinned is None else pinned
        node = Node(names.create(path), operation, tuple(args), kwargs, None, training=training)
        notes = by_path.get(path) if by_path is not None else by_name.get(name)
        node.annotations = dict(notes or {})
        for index, tensor in enumerate(_compat.node_outputs(keras_node)):
            value = Value(node, index, tensor)
            value_of[id(tensor)] = value
            node.outputs.append(value)
        nodes.append(node)
    unplaced = sorted((set(by_path or ()) | set(pinned_by_path or ()))
                      - {node.name for node in nodes})
    if unplaced:
        raise ValueError(
            f"`{model.name}` holds annotations or a pinned `training` for {', '.join(map(repr, unplaced))}, which "
            "name no call site of its graph (the paths of its layers: "
            f"{', '.join(sorted(model.kip_layer_paths)[:8]) or 'none'}). The saved "
            "annotations do not belong to this model: save it again from the model they "
            "were made on.")
    outputs = [value_of[id(tensor)] for tensor in model.outputs]
    return Graph(list(model.inputs), input_values, nodes, outputs, name=model.name)


def _call_site_paths(model, keras_nodes):
    """`{id(Keras node): node path}`: the paths `kip_layer_paths` lists for
    a Keras layer name, given to that layer's calls in this model in the
    order Keras made them (where the counts agree: a mode's model of a
    `ModeSwitch` runs only some of its body's calls)."""
    listed = {}
    for path, name in model.kip_layer_paths.items():
        listed.setdefault(name, []).append(path)
    own = {id(keras_node) for keras_node in keras_nodes}
    found = {}
    for keras_node in keras_nodes:
        operation = keras_node.operation
        name = getattr(operation, "name", None)
        if name not in listed or id(operation) in found:
            continue
        calls = [n for n in _compat.inbound_nodes(operation) if id(n) in own]
        found[id(operation)] = calls
    paths = {}
    for calls in found.values():
        name = calls[0].operation.name
        if len(calls) == len(listed[name]):
            paths.update((id(call), path) for call, path in zip(calls, listed[name]))
    return paths
