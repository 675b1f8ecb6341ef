"""A `call` that branches on `training` in Python, held as one `ModeSwitch` node.

`training_modes.trace_modes` traces a `call` under `training=True` and `False`.
When the two traces call different things (stochastic depth draws a mask
in training and returns its input otherwise; a block calls another
sub-layer in each mode), `switch_node` makes one node of the two: a
`runtime.mode_switch.ModeSwitch` holding each trace as a graph of its own,
choosing by the `training` value the node is called with.

In each mode's graph the sub-layers keep the `training` value they were
called with in that trace, pinned: the graph only runs in that mode (Expand
then traces a sub-layer in that mode alone). `training=None` means what it
means to the layer: its `call`'s default when that is True / False, else
what `call` computes given None, traced too; that is the inference (or
training) graph where it is the same computation, sub-layers' `training`
values included, and a third graph otherwise.

What cannot be held stays whole with the reason (`TraceError`): outputs
that differ between the modes in structure, dtype or shape, a None among
them, or a Keras mask on the call's inputs or outputs (the modes' graphs
start from inputs of their own, which would not carry it).

Example:
    >>> nodes, outputs = switch_node(layer, "block", runs, "inference")
    >>> type(nodes[0].operation).__name__
    'ModeSwitch'
"""

import inspect

import keras

from keras_ipu_plugin.ir.graph import FOLLOW
from keras_ipu_plugin.ir.graph import Node
from keras_ipu_plugin.ir.graph import Value
from keras_ipu_plugin.ir.graph import map_leaves
from keras_ipu_plugin.ir.graph import values_in
from keras_ipu_plugin.ir.specs import InputSpec
from keras_ipu_plugin.runtime.mode_switch import ModeSwitch
from keras_ipu_plugin.runtime.mode_switch import branch_input_graph


class BranchError(Exception):
    """The two modes cannot be held in one switch; `reason` says why."""

    def __init__(self, reason, structure=False):
        self.reason = reason
        self.structure = structure  # the modes return other output structures
        super().__init__(reason)


def default_training(layer):
    """The default of `training` in `layer`'s `call` signature (what Keras
    hands `call` when no value is given or set by an outer call)."""
    try:
        parameter = inspect.signature(type(layer).call).parameters.get("training")
    except (TypeError, ValueError):
        return None
    if parameter is None or parameter.default is inspect.Parameter.empty:
        return None
    return parameter.default if isinstance(parameter.default, bool) else None


def switch_node(layer, name, runs, none_means):
    """`(nodes, outputs)`: one `ModeSwitch` node standing for the call
    traced as `runs = {"training": (nodes, outputs), "inference": (...)}`
    (and `"default"`, the call traced with `training=None` where that is a
    mode of its own). `none_means`: the mode `training=None` runs
    ("training", "inference" or "default"). Raises `BranchError`.
    """
    structures = {mode: _structure(outputs, mode, name) for mode, (_, outputs) in runs.items()}
    first = structures["inference"]
    for mode, structure in structures.items():
        if structure != first:
            raise BranchError(
                f"`call` branches on `training` in Python and returns another structure "
                f"in {mode} ({structure}) than in inference ({first})", structure=True)
    flat = {mode: values_in(outputs) for mode, (_, outputs) in runs.items()}
    for index, value in enumerate(flat["inference"]):
        for mode, values in flat.items():
            other = values[index]
            if (other.spec.dtype != value.spec.dtype
                    or tuple(other.spec.shape) != tuple(value.spec.shape)):
                raise BranchError(
                    f"`call` branches on `training` in Python and its output {index} is "
                    f"{other.spec.dtype} {tuple(other.spec.shape)} in {mode} but "
                    f"{value.spec.dtype} {tuple(value.spec.shape)} in inference")
    inputs = _inputs_read(runs)
    _refuse_masks(inputs, flat)
    specs = [_input_spec(value, i, name) for i, value in enumerate(inputs)]
    graphs = {}
    for mode, (nodes, _) in runs.items():
        for node in nodes:
            _pin(node, mode)
        graphs[mode] = branch_input_graph(nodes, inputs, flat[mode], specs, name=f"{name}.{mode}")
    switch = ModeSwitch.from_branch_graphs(graphs, none_means, name=name, of_layer=layer.name)
    node = Node(name, switch, (list(inputs),), {}, output_structure=None, training=FOLLOW)
    node.outputs = [Value(node, i, value.spec) for i, value in enumerate(flat["inference"])]
    outputs = iter(node.outputs)
    structure = map_leaves(lambda leaf: next(outputs) if isinstance(leaf, Value) else leaf,
                           runs["inference"][1])
    return [node], structure


def with_branch_nodes(nodes):
    """`nodes` and, for each `ModeSwitch` among them, the nodes of its
    modes' graphs (recursively): what the checks on a trace look at."""
    found = []
    for node in nodes:
        found.append(node)
        graphs = getattr(node.operation, "branch_graphs", None)
        if isinstance(node.operation, ModeSwitch) and graphs:
            for graph in graphs.values():
                found.extend(with_branch_nodes(graph.nodes))
    return found


def switch_modes(model):
    """The `training` values besides False that verifying `model` must run
    in: True where it holds a `ModeSwitch`, and None too where a switch
    holds a mode of its own for it. [] for a model with no switch."""
    from keras_ipu_plugin import _compat

    if not isinstance(model, keras.layers.Layer):
        return []
    switches = [layer for layer in _compat.sub_layers(model) if isinstance(layer, ModeSwitch)]
    if not switches:
        return []
    return [True] + ([None] if any("default" in s.mode_outputs for s in switches) else [])


def _pin(node, mode):
    """A sub-layer keeps the `training` it was called with in this mode's
    trace; in the True / False graphs pinned, as only that mode runs them."""
    if mode != "default" and node.training is not None and node.training != FOLLOW:
        node.training = bool(node.training)


def _structure(outputs, mode, name):
    def leaf(item):
        if item is None:
            raise BranchError(f"`call` returns None among its outputs in {mode}")
        if not isinstance(item, Value):
            raise BranchError(f"`call` returns a {type(item).__name__} in {mode}, not a tensor")
        return "tensor"

    return repr(map_leaves(leaf, outputs))


def _inputs_read(runs):
    """The Values of the enclosing graph that the traces read (the call's
    inputs, the masks they carry), in the order first read."""
    found, made = [], set()
    for nodes, outputs in runs.values():
        made.update(id(value) for node in nodes for value in node.outputs)
    for nodes, outputs in runs.values():
        for value in [v for node in nodes for v in node.input_values] + values_in(outputs):
            if id(value) not in made and value not in found:
                found.append(value)
    return found


def _refuse_masks(inputs, flat):
    masked = [value for value in inputs if value.mask is not None]
    masked += [value for values in flat.values() for value in values
               if value.mask is not None]
    if masked:
        raise BranchError(
            "`call` branches on `training` in Python, and a Keras mask rides on its "
            "inputs or outputs, which the graph of each mode would not carry")


def _input_spec(value, index, name):
    shape = tuple(value.spec.shape)
    if not shape:
        raise BranchError(
            "`call` branches on `training` in Python and reads a scalar tensor, "
            "which a graph of its own cannot take as an input")
    return InputSpec(name=f"{name}.input_{index}", shape=shape[1:],
                     dtype=value.spec.dtype, batch_size=shape[0])


__all__ = ["BranchError", "default_training", "switch_modes", "switch_node",
           "with_branch_nodes"]
