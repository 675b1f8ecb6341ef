"""`training` in a trace: which nodes follow the model's `training`, and a `call`
that branches on it held as one `ModeSwitch` node.

Which nodes of a trace follow the model's `training` (training-mode detection).

`training` is traced twice, under an outer `training=True` and `False`: a
sub-layer whose recorded value changes with it follows the model's
`training` (`FOLLOW`); one that does not was pinned by the code
(`bn(x, training=False)`). A `call` whose source never names `training`
nor forwards `**kwargs` is traced once. If the two traces differ in which
layers they call, `call` branches on `training` in Python: one `ModeSwitch`
node holds both traces (`switch_node`, below), or the layer stays whole
with the lines that branch in its reason.

Example:
    ```python
    nodes, outputs = trace_modes(trace)   # each node's `training` set
    ```

A `call` that branches on `training` in Python, held as one `ModeSwitch` node.

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
    ```python
    nodes, outputs = switch_node(layer, "block", runs, "inference")
    type(nodes[0].operation).__name__
    # -> 'ModeSwitch'
    ```
"""

import functools
import inspect
import io
import os
import textwrap
import tokenize

import keras

from keras_ipu_plugin.frontend.trace.call_trace import trace_once
from keras_ipu_plugin.frontend.trace.failures import ModeStructureError, TraceError
from keras_ipu_plugin.ir.graph import FOLLOW, map_leaves, Node, Value, values_in
from keras_ipu_plugin.ir.graph import InputSpec
from keras_ipu_plugin.layers.keras_ops.batch_sized import BatchSizedOperation
from keras_ipu_plugin.layers.state import HeldConstant
from keras_ipu_plugin.layers.state import is_write_node
from keras_ipu_plugin.runtime.mode_switch import ModeSwitch, branch_input_graph

__all__ = ["BranchError", "default_training", "switch_modes", "switch_node", "with_branch_nodes"]


def trace_modes(trace):
    """Trace under the `training` modes needed to tell which nodes follow
    the model's `training` (see the module docstring); a trace for one
    mode (`trace.training` True or False) is traced in that mode only."""
    layer, training = trace.layer, trace.training
    made = {}  # id(user layer) -> the OpaqueLayer standing for it
    if training is not None:
        return trace_once(trace, training, True, made)
    if not _call_mentions_training(type(layer).call):
        # `call` neither reads `training` nor passes it on: every sub-layer
        # takes it from the context, so one trace under `training=True`
        # tells them all (each records True: it follows the model's).
        nodes, outputs = trace_once(trace, True, False, made)
        for node in nodes:
            if node.training is True:
                node.training = FOLLOW
        return nodes, outputs
    nodes_t, outputs_t = trace_once(trace, True, False, made)
    nodes_f, outputs_f = trace_once(trace, False, False, made)
    if not _same_calls(nodes_t, nodes_f):
        # `call` branches on `training` in Python: one node holds the graph
        # of each mode and runs the one it is called in (`training_branches`).
        runs = {"training": (nodes_t, outputs_t), "inference": (nodes_f, outputs_f)}
        default = default_training(layer)
        if default is not None:
            none_means = "training" if default else "inference"
        else:  # what `training=None` runs: one of the two, or a mode of its own
            nodes_n, outputs_n = trace_once(trace, None, False, made)
            none_means = next(
                (mode for mode in ("inference", "training")
                 if _same_calls(runs[mode][0], nodes_n) and _modes_given(
                     trace.tracer, runs[mode][0]) == _modes_given(trace.tracer, nodes_n)),
                "default")
            if none_means == "default":
                runs["default"] = (nodes_n, outputs_n)
        try:
            return switch_node(
                layer, trace.prefix[:-1] if trace.prefix else layer.name, runs, none_means)
        except BranchError as error:
            lines = _training_branch_lines(type(layer).call)
            at = f" (at `{'`, `'.join(lines)}`)" if lines else ""
            if error.structure:
                raise ModeStructureError(
                    f"{error.reason}{at}: no node of a graph can return two structures, "
                    "so the model runs whole, returning each mode's structure as the "
                    "original does (it trains)", structures=f"{error.reason}{at}") from None
            raise TraceError(
                f"{error.reason}{at}: the two modes cannot be held as one node, so "
                "the layer runs whole (it still trains)") from None
    if _leaf_structure(outputs_t) != _leaf_structure(outputs_f):
        # The same calls, another structure (a sub-layer's dict with a key
        # more in inference, passed on): one graph cannot return both.
        structures = (f"`call` returns another structure in training "
                      f"({_leaf_structure(outputs_t)}) than in inference "
                      f"({_leaf_structure(outputs_f)})")
        raise ModeStructureError(
            f"{structures}: no node of a graph can return two structures, so the model runs "
            "whole, returning each mode's structure as the original does (it trains)",
            structures=structures)
    for node_t, node_f in zip(nodes_t, nodes_f):
        node_t.training = _training_mode(node_t, node_f)
    return nodes_t, outputs_t


def _modes_given(tracer, nodes):
    """The `training` each node's layer was called with, where its `call`
    takes one as `tracer` says (Keras records a value for other layers too)."""
    return [node.training if node.is_layer and tracer.takes_training(node.operation) else None
            for node in nodes]


def _leaf_structure(outputs):
    """`outputs` with each leaf "tensor" (None kept), to compare structures."""
    return map_leaves(lambda leaf: None if leaf is None else "tensor", outputs)


def _same_calls(nodes_a, nodes_b):
    return list(map(node_identity, nodes_a)) == list(map(node_identity, nodes_b))


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


def node_identity(node):
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
