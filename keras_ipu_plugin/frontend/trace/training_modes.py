"""Which nodes of a trace follow the model's `training` (training-mode detection).

`training` is traced twice, under an outer `training=True` and `False`: a
sub-layer whose recorded value changes with it follows the model's
`training` (`FOLLOW`); one that does not was pinned by the code
(`bn(x, training=False)`). A `call` whose source never names `training`
nor forwards `**kwargs` is traced once. If the two traces differ in which
layers they call, `call` branches on `training` in Python: one `ModeSwitch`
node holds both traces (`training_branches.py`), or the layer stays whole
with the lines that branch in its reason.

Example:
    >>> nodes, outputs = trace_modes(trace)   # each node's `training` set
"""

import functools
import inspect
import io
import os
import textwrap
import tokenize

from keras_ipu_plugin.frontend.trace import training_branches
from keras_ipu_plugin.frontend.trace.call_trace import trace_once
from keras_ipu_plugin.frontend.trace.failures import ModeStructureError
from keras_ipu_plugin.frontend.trace.failures import TraceError
from keras_ipu_plugin.ir.graph import FOLLOW
from keras_ipu_plugin.ir.graph import map_leaves
from keras_ipu_plugin.layers.keras_ops.batch_sized import BatchSizedOperation
from keras_ipu_plugin.layers.state.reads import HeldConstant
from keras_ipu_plugin.layers.state.variable_write import is_write_node


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
        default = training_branches.default_training(layer)
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
            return training_branches.switch_node(
                layer, trace.prefix[:-1] if trace.prefix else layer.name, runs, none_means)
        except training_branches.BranchError as error:
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
