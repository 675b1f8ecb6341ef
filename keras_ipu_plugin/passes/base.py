"""What every pass shares: the `Pass` interface and target matching.

A target is a layer name (the layer's own name, or its node path such as
`"block_1.dense"`), a layer class (subclasses match too), or `"all"`.
A name or class target also matches a block that Expand inlined (its path,
its layer's name or its class): the block's nodes, which the annotation
passes treat as one (a checkpoint after its last node, say).
"""


import keras

from keras_ipu_plugin.errors import PassError

ALL = "all"


class Pass:
    """A graph transformation: `run(graph, report) -> graph`.

    Subclasses set `step` (the name the report uses) and implement `run`.
    """

    step = "pass"

    def run(self, graph, report):  # pragma: no cover - interface
        raise NotImplementedError

    def __repr__(self):
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({fields})"

    def __eq__(self, other):
        return type(self) is type(other) and vars(self) == vars(other)


def as_targets(targets):
    """A tuple of targets from one target or a list of them."""
    if isinstance(targets, (list, tuple, set, frozenset)):
        targets = tuple(targets)
    else:
        targets = (targets,)
    for target in targets:
        if not (isinstance(target, str) or _is_layer_class(target)):
            raise PassError(
                f"A target must be a layer name, a layer class or 'all'; got "
                f"{target!r}."
            )
    return targets


def matches(node, target):
    """Whether graph `node` is matched by one `target`."""
    if target == ALL:
        return node.is_layer
    if isinstance(target, str):
        return target == node.name or target in _names_of(node.operation)
    return isinstance(node.operation, target)


def _names_of(operation):
    name = getattr(operation, "name", None)
    return (name,) if name is not None else ()


def matched_nodes(graph, targets, step):
    """Nodes matched by any of `targets`; a target matching none is an error."""
    found = []
    for target in targets:
        hits = [node for node in graph.nodes if matches(node, target)]
        if not hits:
            raise PassError(
                f"{step}: target {describe(target)} matches no layer of the "
                f"model `{graph.name}` (layers: {_layer_names(graph)})."
            )
        found.extend(node for node in hits if node not in found)
    return [node for node in graph.nodes if node in found]


def matches_block(block, target):
    """Whether `target` names the inlined `block` (its path or its layer's
    name) or is its class; `"all"` matches layers, not blocks."""
    if target == ALL:
        return False
    if isinstance(target, str):
        return target in (block.path, block.layer.name)
    return isinstance(block.layer, target)


def matched_blocks(graph, target):
    """`[(block, nodes)]`: each block Expand inlined that `target` matches,
    with its nodes in graph order; blocks in the order they start."""
    found = {}
    for node in graph.nodes:
        for block in node.from_blocks:
            if matches_block(block, target):
                found.setdefault(id(block), (block, []))[1].append(node)
    return list(found.values())


def matched_nodes_and_blocks(graph, targets, step):
    """`(nodes, blocks)`: the nodes `targets` match, in graph order, and the
    inlined blocks they match (see `matched_blocks`). A target matching
    neither is an error."""
    nodes, blocks, seen = set(), [], set()
    for target in targets:
        hits = [node for node in graph.nodes if matches(node, target)]
        inlined = matched_blocks(graph, target)
        if not hits and not inlined:
            raise PassError(
                f"{step}: target {describe(target)} matches no layer of the "
                f"model `{graph.name}` (layers: {_layer_names(graph)})."
            )
        nodes.update(id(node) for node in hits)
        for block, block_nodes in inlined:
            if id(block) not in seen:
                seen.add(id(block))
                blocks.append((block, block_nodes))
    return [node for node in graph.nodes if id(node) in nodes], blocks


def describe(target):
    if isinstance(target, str):
        return repr(target)
    return f"class {target.__name__}"


def _layer_names(graph):
    names = [node.name for node in graph.nodes if node.is_layer]
    text = ", ".join(names[:12])
    return text + (", ..." if len(names) > 12 else "")


def _is_layer_class(target):
    return isinstance(target, type) and issubclass(target, keras.layers.Layer)
