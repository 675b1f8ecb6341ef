"""What every pass shares: the `Pass` interface, target matching (inside
`ModeSwitch` branches too), and the registry that makes a pass known to
configs and saving. One concept: a pass and where its targets are.

A target is a layer name (the layer's own name, or its node path such as
`"block_1.dense"`), a layer class (subclasses match too), a `Chain` of
layers and `keras.ops` calls (`patterns.py`: each run it matches is one
unit, as an expanded block is), or `"all"`.
A name or class target also matches a block that Expand inlined (its path,
its layer's name or its class): the block's nodes, which the annotation
passes treat as one (a checkpoint after its last node, say).

Targets inside the `training` modes of `ModeSwitch` nodes: a layer whose `call` branches on `training` in Python becomes a
`ModeSwitch` node holding one graph per mode (`runtime/mode_switch.py`).
A pass that reaches inside (Expand, Replace, Recompute) runs on each of
those graphs for the targets found there, and the node gets a new switch
made from the graphs it returned (`in_branches`); a pass that does not
(Outline, PipelineStages by targets) raises `refuse_inside`'s error when
a target is found only inside a switch, never skipping it silently.

Example:
    ```python
    here, inside = split_targets(graph, ["blocks.0.drop_path.dense"])
    in_branches(graph, lambda branch, mode: Expand(inside).run(branch, report))
    ```
"""

import difflib
import inspect

import keras

from keras_ipu_plugin import _compat
from keras_ipu_plugin.errors import ConfigError, PassError, short_repr
from keras_ipu_plugin.frontend.trace.attribute_paths import attribute_paths, path_of
from keras_ipu_plugin.frontend.trace.tracer import TraceError, trace_model, tracer_of
from keras_ipu_plugin.ir.graph import InputSpec
from keras_ipu_plugin.layers.layer_kinds import is_expandable
from keras_ipu_plugin.passes.infra.layer_class_names import class_named, name_of_class
from keras_ipu_plugin.passes.infra.patterns import Chain, Match, names_a_path
from keras_ipu_plugin.runtime.mode_switch import ModeSwitch

__all__ = [
    "branch_graphs",
    "in_branches",
    "run_inside",
    "reachable_here",
    "reachable_inside",
    "refuse_inside",
    "split_targets",
    "switch_nodes",
]


ALL = "all"

# What a pass promises about the model it returns; `apply_passes` verifies it.
EQUAL = "equal"  # the same outputs, and gradients for every variable it keeps
RUNS = "runs"  # may change what the model computes; only that it runs is checked


class Pass:
    """A graph transformation: `run(graph, report) -> graph`.

    Subclasses set `step` (the name the report uses) and implement `run`;
    to be saved and named in configs they are registered (`register_pass`)
    and define `get_config` / `from_config` (and `from_user_config` for a
    friendlier config form than their `get_config`).
    """

    step = "pass"
    config_key = None  # set by register_pass
    config_order = None
    # EQUAL unless the pass changes what the model computes on purpose (a
    # subclass that does says RUNS, so apply_passes does not call it wrong).
    claim = EQUAL

    def run(self, graph, report):  # pragma: no cover - interface
        raise NotImplementedError

    def __repr__(self):
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({fields})"

    def __eq__(self, other):
        return type(self) is type(other) and vars(self) == vars(other)

    # -- configs and saving (see register_pass) ---------------------------------
    def get_config(self):
        """The pass as JSON-able data; `from_config` makes it again."""
        raise PassError(
            f"{type(self).__name__} cannot be saved: it defines no get_config()."
        )

    @classmethod
    def from_config(cls, config):
        """The pass `get_config` described (by default `cls(**config)`)."""
        if not isinstance(config, dict):
            raise PassError(
                f"{cls.__name__}.from_config takes a mapping; got {short_repr(config)}."
            )
        try:
            inspect.signature(cls).bind(**config)
        except TypeError as error:
            raise PassError(
                f"{cls.__name__}.from_config({short_repr(config)}): {error}."
            ) from error
        return cls(**config)

    @classmethod
    def from_user_config(cls, value, path, reader):
        """The pass a user's config gives under its key (`value`, at `path`).

        `reader` reads targets and classes the way configs name them:
        `reader.targets(value, path)` (one target or a list; a string naming
        a class is that class), `reader.layer_class(name, path)`. Errors are
        `kip.ConfigError(path, message)`. By default `value` is a mapping of
        keyword arguments, given to `from_config`.
        """
        if not isinstance(value, dict):
            raise ConfigError(
                path, f"expected a mapping of {cls.__name__}'s arguments; got {short_repr(value)}"
            )
        return cls.from_config(value)


class LayerName(str):
    """A target string that is a layer name or path even when it spells a
    layer class (what a saved pass holds: classes are saved as
    `{"class": name}`).

    Example:
        ```python
        kip.passes.Recompute(kip.passes.LayerName("Dense"))  # the layer named "Dense"
        ```
    """


def as_targets(targets):
    """A tuple of targets from one target or a list of them. A string that
    names a layer class (`"LayerNormalization"`, `"keras_hub>LlamaLayerNorm"`)
    is that class, as in configs.

    Example:
        ```python
        as_targets("LayerNormalization")
        # -> (<class 'keras.src.layers.normalization.layer_normalization.LayerNormalization'>,)
        ```
    """
    if isinstance(targets, (list, tuple, set, frozenset)):
        targets = tuple(targets)
    else:
        targets = (targets,)
    targets = tuple(_class_or_name(target) for target in targets)
    for target in targets:
        if not (isinstance(target, (str, Chain)) or _is_layer_class(target)):
            raise PassError(
                f"A target must be a layer name, a layer class, a kip.passes.Chain "
                f"or 'all'; got {target!r}."
            )
    return targets


def _class_or_name(target):
    if type(target) is str and target != ALL:
        cls = class_named(target)
        if cls is not None:
            return cls
    return target


def matches(node, target, aliases=True):
    """Whether graph `node` is matched by one `target` (a chain matches runs
    of nodes, not one: `matched_blocks`). A name matches the node's path,
    and with `aliases` its layer's Keras name (False where the name is a
    path of the graph: `names_a_path`)."""
    if isinstance(target, Chain):
        return False
    if target == ALL:
        return node.is_layer
    if isinstance(target, str):
        return target == node.name or (aliases and target in _names_of(node.operation))
    return isinstance(node.operation, target)


def contains(node, target, aliases=True):
    """Whether `target` (a `parent.child` path, with `aliases` a Keras layer
    name, or a class) is a sub-layer of the layer of `node`."""
    if isinstance(target, str) and target.startswith(node.name + "."):
        return True
    for sub in _compat.sub_layers(node.operation):
        if isinstance(target, str):
            if aliases and target == sub.name:
                return True
        elif isinstance(sub, target):
            return True
    return False


def _names_of(operation):
    name = getattr(operation, "name", None)
    return (name,) if name is not None else ()


def nodes_matching(graph, target):
    """The nodes `target` matches, in graph order. A name matches the node
    of that path and every other call site of the same layer object: a
    layer shared between call sites is one layer (node paths are unique, so
    the second site of `shared.dense` is `shared_1.dense`), and a pass that
    reached only one site would silently un-share it."""
    aliases = not names_a_path(graph, target)
    hits = [node for node in graph.nodes if matches(node, target, aliases)]
    if not isinstance(target, str) or target == ALL:
        return hits
    layers = {id(node.operation) for node in hits if node.is_layer}
    return [node for node in graph.nodes
            if node in hits or (node.is_layer and id(node.operation) in layers)]


def matched_nodes(graph, targets, step):
    """Nodes matched by any of `targets`; a target matching none is an error."""
    found = []
    for target in targets:
        hits = nodes_matching(graph, target)
        if not hits:
            raise unmatched_target(step, target, graph)
        found.extend(node for node in hits if node not in found)
    return [node for node in graph.nodes if node in found]


def matches_block(block, target, aliases=True):
    """Whether `target` names the inlined `block` (its path or, with
    `aliases`, its layer's Keras name) or is its class; `"all"` matches
    layers, not blocks."""
    if target == ALL or isinstance(target, Chain):
        return False
    if isinstance(target, str):
        return target == block.path or (aliases and target == block.layer.name)
    return isinstance(block.layer, target)


def matched_blocks(graph, target):
    """`[(block, nodes)]`: each block Expand inlined that `target` matches,
    with its nodes in graph order; blocks in the order they start. For a
    `Chain`, each run of nodes it matches, as a `patterns.Match`."""
    if isinstance(target, Chain):
        return [(Match(run), run) for run in target.matches(graph)]
    found, aliases = {}, not names_a_path(graph, target)
    for node in graph.nodes:
        for block in node.from_blocks:
            if matches_block(block, target, aliases):
                found.setdefault(id(block), (block, []))[1].append(node)
    return list(found.values())


def matched_nodes_and_blocks(graph, targets, step):
    """`(nodes, blocks)`: the nodes `targets` match, in graph order, and the
    inlined blocks they match (see `matched_blocks`). A target matching
    neither is an error."""
    nodes, blocks, seen = set(), [], set()
    for target in targets:
        hits = nodes_matching(graph, target)
        inlined = matched_blocks(graph, target)
        if not hits and not inlined:
            raise unmatched_target(step, target, graph)
        nodes.update(id(node) for node in hits)
        for block, block_nodes in inlined:
            if id(block) not in seen:
                seen.add(id(block))
                blocks.append((block, block_nodes))
    return [node for node in graph.nodes if id(node) in nodes], blocks


def block_label(block):
    """How the report names a unit of nodes a target matched: an expanded
    block or a chain's match."""
    if isinstance(block, Match):
        return f"chain match `{block.path}`"
    return f"expanded `{block.path}`"


def describe(target):
    if isinstance(target, Chain):
        return target.describe()
    if isinstance(target, str):
        return repr(target)
    return f"class {target.__name__}"


def unmatched_target(step, target, graph):
    """The error for a target matching nothing: the layers' paths (nested
    layers of blocks not expanded too) and classes nearest to it, or the
    first of them."""
    paths, classes = [], []
    for node in graph.nodes:
        if not node.is_layer:
            continue
        paths.append(node.name)
        classes.append(type(node.operation).__name__)
        inner = attribute_paths(node.operation)  # the paths a target may name
        for layer in _compat.sub_layers(node.operation):
            paths.append(f"{node.name}.{path_of(layer, inner)}")
            classes.append(type(layer).__name__)
    classes = list(dict.fromkeys(classes))
    wanted = target if isinstance(target, str) else getattr(target, "__name__", "")
    near_paths = difflib.get_close_matches(wanted, paths, n=5, cutoff=0.5)
    near_classes = difflib.get_close_matches(wanted, classes, n=3, cutoff=0.5)
    if near_paths or near_classes:
        hint = "nearest: " + ", ".join([*near_paths, *(f"class {c}" for c in near_classes)])
    else:
        hint = "layers: " + ", ".join(paths[:12]) + (", ..." if len(paths) > 12 else "")
        hint += "; classes: " + ", ".join(classes[:8]) + (", ..." if len(classes) > 8 else "")
    return PassError(
        f"{step}: target {describe(target)} matches no layer of the model `{graph.name}` "
        f"({hint}). A target is a layer's path or name, a layer class (or its name), "
        "or a kip.passes.Chain."
    )


def _is_layer_class(target):
    return isinstance(target, type) and issubclass(target, keras.layers.Layer)


# -- the registry: passes known to configs and to saving ------------------------
_PASSES = {}  # config key -> pass class


def register_pass(key, *, order=None):
    """Class decorator: make a pass known to configs under `key`, and savable.

    In a config that is a mapping, passes run by `order` (lower first; the
    built-in ones are 0-4, a pass without `order` runs after them, in the
    order passes were registered); a config that is a list runs them in its
    own order.

    Example:
        ```python
        @kip.passes.register_pass("tag")
        class Tag(kip.passes.Pass):
            def __init__(self, targets): self.targets = as_targets(targets)
            def get_config(self): return {"targets": targets_config(self.targets, "Tag")}
            @classmethod
            def from_config(cls, config):
                return cls(targets_from_config(config["targets"], "Tag"))
            def run(self, graph, report): ...
        kip.passes_from_config([{"expand": "all"}, {"tag": {"targets": ["block_1"]}}])
        ```
    """
    if not (isinstance(key, str) and key.isidentifier()):
        raise PassError(f"register_pass: a pass key is an identifier; got {key!r}.")

    def register(cls):
        if not (isinstance(cls, type) and issubclass(cls, Pass)):
            raise PassError(f"register_pass({key!r}) decorates a kip Pass class; got {cls!r}.")
        taken = _PASSES.get(key)
        # The same class defined again (a notebook cell run twice) replaces
        # itself; another class would silently take over the key.
        if taken is not None and _qualified(taken) != _qualified(cls):
            raise PassError(
                f"register_pass: the key {key!r} is taken by {_qualified(taken)}; "
                f"choose another for {_qualified(cls)}."
            )
        cls.config_key = key
        cls.config_order = order
        _PASSES[key] = cls
        return cls

    return register


def registered_passes():
    """{config key: pass class}, in the order a mapping config runs them."""
    keys = list(_PASSES)
    return {
        key: _PASSES[key]
        for key in sorted(keys, key=lambda k: (_PASSES[k].config_order is None,
                                              _PASSES[k].config_order or 0, keys.index(k)))
    }


def serialize_pass(one_pass):
    """`{"pass": key, "config": one_pass.get_config()}`, what a saved model holds."""
    cls = type(one_pass)
    if _PASSES.get(cls.config_key) is not cls:
        raise PassError(
            f"{cls.__name__} cannot be saved: it is not registered; decorate it with "
            "@kip.passes.register_pass('a_key')."
        )
    return {"pass": cls.config_key, "config": one_pass.get_config()}


def deserialize_pass(saved):
    """The pass `serialize_pass` described."""
    if not (isinstance(saved, dict) and set(saved) == {"pass", "config"}):
        raise PassError(
            f"A saved pass is {{'pass': key, 'config': {{...}}}}; got {short_repr(saved)}."
        )
    cls = _PASSES.get(saved["pass"])
    if cls is None:
        raise PassError(
            f"Unknown pass {short_repr(saved['pass'])} (known: {', '.join(_PASSES)}); "
            "import the module that registers it before loading."
        )
    return cls.from_config(saved["config"])


def saved_config(config, owner, required, optional=()):
    """`config` (what `get_config` wrote), checked: a mapping with the
    `required` keys and no others than those and `optional`."""
    if not isinstance(config, dict):
        raise PassError(f"{owner}.from_config takes a mapping; got {short_repr(config)}.")
    missing = [key for key in required if key not in config]
    unknown = [key for key in config if key not in required and key not in optional]
    if missing or unknown:
        raise PassError(
            f"{owner}.from_config: " + (f"missing {missing[0]!r}" if missing
                                        else f"unknown key {short_repr(unknown[0])}")
            + f" (keys: {', '.join(list(required) + list(optional))})."
        )
    return config


def targets_config(targets, owner):
    """Targets as JSON-able data: a name stays a string, a class becomes
    `{"class": name}` (an error names `owner` if the class has no name)."""
    return [target if isinstance(target, str)
            else target.get_config(owner) if isinstance(target, Chain)
            else {"class": name_of_class(target, owner)}
            for target in targets]


def targets_from_config(value, owner):
    """The targets `targets_config` wrote: a string is always a layer name
    here (in a user's config a string that names a class is that class)."""
    if isinstance(value, (str, dict)):
        value = [value]
    if not isinstance(value, (list, tuple)):
        raise PassError(f"{owner}: saved targets are a list; got {short_repr(value)}.")
    return tuple(_target_from_config(item, owner) for item in value)


def _target_from_config(value, owner):
    if isinstance(value, str):
        return value if value == ALL else LayerName(value)
    if isinstance(value, dict) and set(value) == {"chain"}:
        return Chain.from_config(value, owner)
    if isinstance(value, dict) and set(value) == {"class"} and isinstance(value["class"], str):
        cls = class_named(value["class"])
        if cls is None:
            raise PassError(
                f"{owner}: unknown layer class {short_repr(value['class'])}; register it with "
                "kip.register_layer or @keras.saving.register_keras_serializable() before loading."
            )
        return cls
    raise PassError(
        f"{owner}: a saved target is a string or {{'class': name}}; got {short_repr(value)}."
    )


def config_value(value, where):
    """`value` (a layer parameter, an outlining option) as JSON-able data.

    Keras objects (an initializer, a regularizer) are saved the way Keras
    saves them, as their config; layer configs take that form too. A
    function or any other Python object cannot be saved: an error names it.
    """
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    if isinstance(value, (list, tuple)):
        return [config_value(item, f"{where}[{i}]") for i, item in enumerate(value)]
    if isinstance(value, dict) and all(isinstance(key, str) for key in value):
        return {key: config_value(item, f"{where}.{key}") for key, item in value.items()}
    if hasattr(value, "get_config") and not isinstance(value, type):
        return keras.saving.serialize_keras_object(value)
    raise PassError(
        f"{where} is {short_repr(value)} ({type(value).__name__}), which cannot be saved "
        "(only data and Keras objects can); save the weights only (save_weights)."
    )


def _qualified(cls):
    return f"{cls.__module__}.{cls.__qualname__}"


def switch_nodes(graph):
    """The `ModeSwitch` nodes of `graph` (not those nested inside them)."""
    return [node for node in graph.nodes if isinstance(node.operation, ModeSwitch)]


def branch_graphs(switch, tracer=None):
    """`{mode: IR graph}` of a switch, copies a pass may edit: the graphs
    it was made from, or (a loaded switch) read from each mode's model.
    `tracer`: the `Tracer` of the graph holding the switch, handed to each
    copy (`graph.tracer`)."""
    if switch.branch_graphs is None:
        object.__setattr__(switch, "branch_graphs", {
            mode: _graph_of_mode(switch, mode, tracer) for mode in switch.mode_outputs})
    copies = {mode: graph.copy() for mode, graph in switch.branch_graphs.items()}
    for graph in copies.values():
        graph.tracer = tracer
    return copies


def _graph_of_mode(switch, mode, tracer):
    from keras_ipu_plugin.runtime.functional import KipFunctional

    model = switch.mode_model(mode)
    plain = KipFunctional(model.inputs, model.outputs, name=model.name,
                          kip_pinned_training=model.kip_pinned_training)
    specs = [InputSpec(name=t.name, shape=tuple(t.shape[1:]), dtype=t.dtype,
                       batch_size=t.shape[0]) for t in model.inputs]
    try:
        graph = trace_model(plain, specs, tracer=tracer)
    except TraceError as error:  # pragma: no cover - functional models trace
        raise PassError(f"Cannot read the `{mode}` graph of `{switch.name}`: {error.reason}")
    annotations = model.kip_annotations
    paths = switch.paths.get(mode, {})
    by_layer = {}
    for path, name in paths.items():
        by_layer.setdefault(name, []).append(path)
    renamed = {}
    for node in graph.nodes:
        node.annotations.update(annotations.get(getattr(node.operation, "name", None), {}))
        if node.is_layer and len(by_layer.get(node.operation.name, ())) == 1:
            renamed[node] = by_layer[node.operation.name][0]
    graph.rename_nodes(renamed)
    return graph


def in_branches(graph, run, wanted=None):
    """Run `run(branch_graph, mode)` (returning the graph to keep) on the
    graph of each mode of each switch of `graph` (those `wanted(branch)`
    accepts, when given), and put a switch made from the results in each
    node whose graphs it ran on. Returns the `(old, new)` layer pairs
    Replace made inside, also added to `graph.replaced`."""
    replaced = []
    for node in switch_nodes(graph):
        switch = node.operation
        branches = branch_graphs(switch, graph.tracer)
        if wanted is not None and not any(map(wanted, branches.values())):
            continue  # nothing to do inside: the switch stays as it is
        graphs = {}
        for mode, branch in branches.items():
            result = run(branch, mode) if wanted is None or wanted(branch) else branch
            graphs[mode] = result
            replaced.extend(pair for pair in result.replaced if pair not in replaced)
        node.operation = switch.with_branch_graphs(graphs)
    known = {(id(old), id(new)) for old, new in graph.replaced}
    for old, new in replaced:
        if (id(old), id(new)) not in known:
            graph.replaced.append((old, new))
            known.add((id(old), id(new)))
    return replaced


def run_inside(graph, targets, run_for):
    """Run the pass `run_for(targets)` returns (`fn(branch) -> graph`) on
    each mode's graph of each switch of `graph` where some of `targets`
    are found, with those targets."""
    def found(branch):
        return [t for t in targets
                if t == ALL or reachable_here(branch, t) or reachable_inside(branch, t)]

    return in_branches(graph, lambda branch, mode: run_for(found(branch))(branch),
                       wanted=lambda branch: bool(found(branch)))


def reachable_here(graph, target):
    """Whether `target` matches a node or an inlined block of `graph`, or a
    sub-layer of a layer `graph` could expand to reach it."""
    if target == ALL or isinstance(target, Chain):
        return True
    if nodes_matching(graph, target) or matched_blocks(graph, target):
        return True
    return any(is_expandable(node.operation, tracer_of(graph).is_user_code)
               and contains(node, target)
               for node in graph.nodes)


def reachable_inside(graph, target):
    """Whether `target` is reachable in the graph of a mode of a switch of
    `graph` (at any depth)."""
    if isinstance(target, Chain):
        return False
    for node in switch_nodes(graph):
        for branch in branch_graphs(node.operation, graph.tracer).values():
            if target == ALL or reachable_here(branch, target) or reachable_inside(branch, target):
                return True
    return False


def split_targets(graph, targets):
    """`(here, inside)`: the targets to match in `graph` itself (those found
    here, and those found nowhere, whose pass then says so) and those
    found inside its switches (a class may be in both)."""
    here, inside = [], []
    for target in targets:
        in_switch = reachable_inside(graph, target)
        if in_switch:
            inside.append(target)
        if not in_switch or reachable_here(graph, target):
            here.append(target)
    return here, inside


def refuse_inside(graph, targets, step):
    """Raise `PassError` for a target found only inside a switch: `step`
    does not reach into the modes of a layer that branches on `training`."""
    for target in targets:
        if target != ALL and not reachable_here(graph, target) and reachable_inside(graph, target):
            node = next(node for node in switch_nodes(graph)
                        if any(reachable_here(b, target) or reachable_inside(b, target)
                               for b in branch_graphs(node.operation, graph.tracer).values()))
            raise PassError(
                f"{step}: target {describe(target)} is inside `{node.name}`, which holds "
                f"the `training` modes of `{node.operation.of_layer or node.name}` (its "
                f"`call` branches on `training` in Python) as one node; {step} does not "
                "reach into the modes: name the whole node instead")
