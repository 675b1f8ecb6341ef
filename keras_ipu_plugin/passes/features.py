"""`create_feature_extractor`: the outputs of inner layers, after any pass.

The request Keras users make most about subclassed models is the output of
an inner layer (Grad-CAM, feature maps, embeddings for retrieval). On a
converted or passed model `keras.Model(model.inputs, layer.output)` does not
work: `layer.output` is the output of the layer's *first* call, which may
belong to the original model or to the model a pass started from, and after
Expand a block is no longer one layer at all. This builds the model from the
graph instead, as torchvision's `create_feature_extractor` builds one from a
torch.fx graph: the same layer objects (the same variables), with the
outputs of the nodes asked for, and only the nodes they need.

A path is what the report shows: a node's path (`"stem"`,
`"blocks.1.dense"`), a layer's Keras name, or the path of a block Expand
inlined, which stands for the block's output (the values its nodes hand
to the rest of the graph). A path inside a block kept whole
(`"units.2.proj"`, the `proj` layer of the node `units.2`) is reached as
torchvision reaches any module: the blocks on the way to it are expanded
(only those; the result verified as every pass is).

Example:
    ```python
    features = kip.create_feature_extractor(passed, ["blocks.1", "head"])
    outputs = features(x)          # {"blocks.1": ..., "head": ...}
    ```
"""

import difflib

import keras

from keras_ipu_plugin.errors import PassError
from keras_ipu_plugin.errors import short_repr
from keras_ipu_plugin.ir.graph import values_in
from keras_ipu_plugin.passes.infra.manager import apply_passes
from keras_ipu_plugin.passes.infra.manager import graph_of_model
from keras_ipu_plugin.passes.expand import Expand
from keras_ipu_plugin.runtime.functional import graph_model
from keras_ipu_plugin.runtime.rebuild import rebuild


def create_feature_extractor(model, return_nodes):
    """A functional `keras.Model` sharing `model`'s layers whose outputs are
    the outputs of the nodes named in `return_nodes`: a list of paths (the
    outputs are then a dict keyed by path) or a dict `{path: output name}`.

    `model` is a converted model, the result of `apply_passes` (any
    functional model works too) or a `PluginModel` that has seen a batch
    (its converted graph). Annotations of passes (recompute checkpoints,
    stages, outlining) stay on the nodes kept. A path inside a block kept
    whole expands the blocks on the way to it (see the module docstring).

    Example:
        ```python
        converted = kip.convert_to_functional(model, x)
        features = kip.create_feature_extractor(converted, {"block": "feature_map"})
        features(x)["feature_map"].shape
        ```
    """
    names = _output_names(return_nodes)
    model = _expanded_to_reach(graph_model(model, "create_feature_extractor"), list(names))
    graph = graph_of_model(model, "create_feature_extractor")
    outputs = {name: _value_at(graph, path) for path, name in names.items()}
    needed = _ancestors(values_in(outputs))
    graph.nodes = [node for node in graph.nodes if node in needed]
    graph.outputs = outputs
    graph.lint()
    return rebuild(graph, name=f"{model.name}_features")


_MAX_LEVELS = 32  # blocks nested in blocks expanded on the way to a path


def _expanded_to_reach(model, paths):
    """`model` with the blocks kept whole on the way to `paths` expanded,
    one level at a time (`apply_passes` verifies each), or `model` itself
    when every path names a node or an expanded block already."""
    for _ in range(_MAX_LEVELS):
        graph = graph_of_model(model, "create_feature_extractor")
        blocks = sorted({
            node.name for path in paths if _lookup(graph, path) is None
            for node in graph.nodes if node.is_layer and path.startswith(node.name + ".")})
        if not blocks:
            return model
        expanded = apply_passes(model, [Expand(blocks)])
        still_whole = [name for name in blocks
                       if any(node.name == name for node in expanded.kip_graph.nodes)]
        if still_whole:
            reasons = expanded.kip_report.opaque if expanded.kip_report is not None else {}
            raise PassError(
                "create_feature_extractor: cannot reach inside "
                + ", ".join(f"`{name}`" + (f" ({reasons[name]})" if name in reasons else "")
                            for name in still_whole)
                + ": it stays one node, so its inner layers' outputs are not in the graph.")
        model = expanded
    return model


def _output_names(return_nodes):
    if isinstance(return_nodes, str):
        return_nodes = [return_nodes]
    if isinstance(return_nodes, dict):
        names = dict(return_nodes)
    elif isinstance(return_nodes, (list, tuple)):
        names = {path: path for path in return_nodes}
    else:
        raise PassError(
            "create_feature_extractor: return_nodes is a list of node paths or a dict "
            f"{{path: output name}}; got {short_repr(return_nodes)}."
        )
    if not names:
        raise PassError("create_feature_extractor: return_nodes names no node.")
    for path, name in names.items():
        if not isinstance(path, str) or not isinstance(name, str):
            raise PassError(
                "create_feature_extractor: paths and output names are strings; got "
                f"{short_repr(path)}: {short_repr(name)}."
            )
    if len(set(names.values())) != len(names):
        raise PassError("create_feature_extractor: two nodes have the same output name.")
    return names


def _lookup(graph, path):
    """The Value (or tuple of Values) `path` names in `graph`, or None."""
    node = next((n for n in graph.nodes if n.name == path), None)
    if node is None:  # a Keras layer name, used as an alias
        named = [n for n in graph.nodes
                 if n.is_layer and getattr(n.operation, "name", None) == path]
        if len(named) > 1:
            raise PassError(
                f"create_feature_extractor: the layer `{path}` is called at "
                f"{len(named)} nodes ({', '.join(n.name for n in named[:4])}); name one by "
                "its path."
            )
        node = named[0] if named else None
    if node is not None:
        return node.outputs[0] if len(node.outputs) == 1 else tuple(node.outputs)
    block = _block_outputs(graph, path)
    if block:
        return block[0] if len(block) == 1 else tuple(block)
    return None


def _value_at(graph, path):
    """The Value (or tuple of Values) `path` names in `graph`; `PassError`
    with the nearest paths otherwise."""
    found = _lookup(graph, path)
    if found is not None:
        return found
    known = [n.name for n in graph.nodes] + sorted(
        {b.path for n in graph.nodes for b in n.from_blocks})
    near = difflib.get_close_matches(path, known, n=5, cutoff=0.5)
    raise PassError(
        f"create_feature_extractor: `{graph.name}` has no node or expanded block at "
        f"path {path!r} ({'nearest: ' + ', '.join(near) if near else 'paths such as: ' + ', '.join(known[:8])})."
    )


def _block_outputs(graph, path):
    """The values the nodes of the block Expand inlined at `path` hand to
    nodes outside it (or return from the graph), in graph order."""
    inside = [n for n in graph.nodes if any(b.path == path for b in n.from_blocks)]
    if not inside:
        return []
    members = set(inside)
    graph_outputs = {id(v) for v in values_in(graph.outputs)}
    found = []
    for node in inside:
        for value in node.outputs:
            if id(value) in graph_outputs or any(user not in members for user in value.users):
                found.append(value)
    return found


def _ancestors(values):
    """The nodes `values` are computed from (masks they carry included)."""
    needed, stack = set(), list(values)
    while stack:
        value = stack.pop()
        if isinstance(value.mask, type(value)):
            stack.append(value.mask)
        node = value.producer
        if node is None or node in needed:
            continue
        needed.add(node)
        stack.extend(node.input_values)
    return needed


__all__ = ["create_feature_extractor", "graph_model"]
