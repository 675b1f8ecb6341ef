"""`ModeSwitch`: one graph node holding a layer's computation in each `training` mode.

A layer whose `call` branches on `training` in Python (stochastic depth:
`if training: ... keras.random.uniform(...) ...; return x`) computes one
graph in training and another in inference. The tracer traces both
(`frontend/trace/training_modes.py`) and puts this layer in the layer's place:
it runs the graph of the mode it is called with, and only that one, so a
random draw of the training branch advances its seed generator exactly when
the original's would.

The graphs are kept in one functional model, `body` (a `KipFunctional`:
its inputs are the layer's tensor inputs, its outputs those of every mode,
one after the other), so a sub-layer both modes call is one layer with one
set of weights, saved and loaded once. `outputs[mode]` says which of the
body's outputs are that mode's. Each mode runs a functional model over the
body's tensors that computes its own outputs alone.

`training=None` (not passed, and no mode set by an outer call) means what
it meant to the original layer: its `call`'s default, as Keras would fill
it in; `none_means` names the mode that stands for it (`"default"` where
the original computes a third thing with None).

Passes see into the modes through `branch_graphs` (the IR of each mode,
`passes/infra/base.py` runs a pass over them and makes a new switch with
`from_branch_graphs`).

Example:
    ```python
    switch = ModeSwitch.from_branch_graphs(
        {"training": graph_t, "inference": graph_f}, none_means="inference",
        name="blocks.0.drop_path")
    switch([x], training=True)     # graph_t's outputs
    ```
"""

import keras
import numpy as np

from keras_ipu_plugin.ir.graph import Graph
from keras_ipu_plugin.ir.graph import Value
from keras_ipu_plugin.ir.graph import map_values
from keras_ipu_plugin.ir.graph import Namespace
from keras_ipu_plugin.layers import saved_values

#: The modes a switch may hold, by the `training` value each stands for.
MODES = {"training": True, "inference": False, "default": None}


@keras.saving.register_keras_serializable(package="keras_ipu_plugin")
class ModeSwitch(keras.layers.Layer):
    """Runs the computation of the `training` mode it is called with.

    Args:
        body: a `KipFunctional` whose inputs are the switch's inputs (a flat
            list) and whose outputs are those of every mode.
        outputs: `{mode: [index of the body's output, ...]}` for each mode
            held (`"training"` and `"inference"`, and `"default"` where
            `training=None` computes a third thing).
        none_means: the mode `training=None` runs.
        paths: `{mode: {node path: Keras layer name}}` of each mode's
            graph, so a loaded switch's modes are named by path again.
        of_layer: the name of the user's layer the switch stands for.
    """

    def __init__(self, body, outputs, none_means="inference", paths=None, of_layer=None,
                 **kwargs):
        # The body's inputs are the dtypes the call was traced with: a
        # mixed precision policy must not cast them on the way in.
        kwargs.setdefault("autocast", False)
        super().__init__(**kwargs)
        entry = f"ModeSwitch `{self.name}`"
        _check_outputs(outputs, None, entry)  # before any layer of the file is made
        if none_means not in outputs:
            saved_values.refuse(entry, "none_means", f"one of {', '.join(outputs)}", none_means)
        if isinstance(body, dict):  # loaded: a saved KipFunctional (checked by from_config)
            from keras_ipu_plugin.runtime.functional import KipFunctional

            _check_body_class(body, entry)
            body = saved_values.saved_keras_object(
                body, entry, "body", KipFunctional, modules=(KipFunctional.__module__,))
        _check_outputs(outputs, len(body.outputs), entry)
        self.body = body
        self.mode_outputs = {mode: list(indices) for mode, indices in outputs.items()}
        self.none_means = none_means
        self.paths = {mode: dict(p) for mode, p in (paths or {}).items()}
        self.of_layer = of_layer
        # The IR of each mode (None when loaded: read from `mode_model`).
        object.__setattr__(self, "branch_graphs", None)
        # One model per mode over the body's tensors, not tracked: the body
        # owns the layers (and the weights are saved once, under it).
        object.__setattr__(self, "kip_mode_models", {
            mode: self._model_of(mode) for mode in self.mode_outputs})
        self.built = True

    # -- building -------------------------------------------------------------------
    @classmethod
    def from_branch_graphs(cls, graphs, none_means, name, of_layer=None):
        """A switch running `graphs[mode]` (IR graphs of one call, whose
        inputs are the switch's inputs, in order) in each mode."""
        from keras_ipu_plugin.runtime.rebuild import rebuild

        union, outputs = union_graph(graphs, name)
        body = rebuild(union, name=f"{name}.modes")
        paths = _mode_paths(graphs, union, body)
        switch = cls(body, outputs, none_means=none_means, paths=paths, of_layer=of_layer,
                     name=name)
        object.__setattr__(switch, "branch_graphs", dict(graphs))
        return switch

    def with_branch_graphs(self, graphs):
        """A new switch, of the same name, running these graphs."""
        return type(self).from_branch_graphs(graphs, self.none_means, self.name,
                                             of_layer=self.of_layer)

    def _model_of(self, mode):
        from keras_ipu_plugin.runtime.functional import KipFunctional

        body = self.body
        outputs = [body.outputs[i] for i in self.mode_outputs[mode]]
        return KipFunctional(
            body.inputs, outputs, name=f"{self.name}.{mode}",
            kip_pinned_training=body.kip_pinned_training,
            kip_node_training=self._pinned_training_of(mode),
            kip_annotations=body.kip_annotations,
            kip_layer_paths=dict(self.paths.get(mode, {})),
        )

    def _pinned_training_of(self, mode):
        """`{branch node path: True / False}`: the `training` the code pinned
        at each call site of `mode`, read per call site from the body. By
        Keras layer name it would be one value for a layer both modes call
        (a Dropout called with `training=training`: True in one mode, False
        in the other). The body's nodes are the modes' nodes, mode after mode
        (`from_branch_graphs`), so a layer's k-th call in the body is its k-th
        call counted across the modes in that order."""
        from keras_ipu_plugin.runtime.interpreter import graph_of

        pinned = {node.name: node.training for node in graph_of(self.body).nodes
                  if node.training in (True, False)}
        body_paths = {}
        for path, name in self.body.kip_layer_paths.items():
            body_paths.setdefault(name, []).append(path)
        calls, found = {}, {}
        for each_mode, branch in self.paths.items():
            for branch_path, name in branch.items():
                index = calls.get(name, 0)
                calls[name] = index + 1
                paths = body_paths.get(name, [])
                if each_mode == mode and index < len(paths) and paths[index] in pinned:
                    found[branch_path] = pinned[paths[index]]
        return found

    def mode_model(self, mode):
        """The functional model that computes `mode`'s outputs."""
        return self.kip_mode_models[mode]

    # -- running --------------------------------------------------------------------
    def mode_for(self, training):
        """The mode a call with this `training` value runs."""
        if training is None:
            return self.none_means
        if isinstance(training, (bool, np.bool_)):
            return "training" if training else "inference"
        raise TypeError(
            f"`{self.name}` stands for `{self.of_layer or self.name}`, whose `call` "
            "chooses its computation by `training` in Python; it needs a Python "
            f"True / False / None, not {type(training).__name__} {training!r}.")

    def call(self, inputs, training=None):
        mode = self.mode_for(training)
        outputs = self.kip_mode_models[mode](list(inputs), training=MODES[mode])
        outputs = outputs if isinstance(outputs, (list, tuple)) else [outputs]
        return outputs[0] if len(outputs) == 1 else list(outputs)

    def compute_output_spec(self, inputs, training=None):
        body = self.body
        specs = [keras.KerasTensor(body.outputs[i].shape, dtype=body.outputs[i].dtype)
                 for i in self.mode_outputs["inference"]]
        return specs[0] if len(specs) == 1 else specs

    # -- saving ---------------------------------------------------------------------
    def get_config(self):
        config = super().get_config()
        config.update(
            body=keras.saving.serialize_keras_object(self.body),
            outputs={mode: list(i) for mode, i in self.mode_outputs.items()},
            none_means=self.none_means,
            paths={mode: dict(p) for mode, p in self.paths.items()},
            of_layer=self.of_layer,
        )
        return config

    @classmethod
    def from_config(cls, config):
        _check_saved_config(config)
        return cls(**config)


#: The keys of the switch's own that `get_config` writes.
_OWN_KEYS = ("body", "outputs", "none_means", "paths", "of_layer")


def _check_saved_config(config):
    """Every value of a saved switch's config is of the kind `get_config`
    writes (a `kip.LoadError` naming the key otherwise), checked before
    anything is made from it: the body's class is read from the file, so a
    body of another class (a `PluginModel` whose passes name a path) is
    refused before Keras makes it."""
    entry = f"ModeSwitch `{config.get('name') if isinstance(config, dict) else None}`"
    saved_values.saved_layer_config(config, entry, _OWN_KEYS)
    outputs = config.get("outputs")
    if not (isinstance(outputs, dict) and outputs and set(outputs) <= set(MODES)
            and {"training", "inference"} <= set(outputs)):
        saved_values.refuse(entry, "outputs", "a mapping of training / inference "
                            "(/ default) to output indices", outputs)
    _check_outputs(outputs, None, entry)
    none_means = config.get("none_means", "inference")
    if not isinstance(none_means, str) or none_means not in outputs:
        saved_values.refuse(entry, "none_means", f"one of {', '.join(outputs)}",
                            config.get("none_means"))
    paths = config.get("paths") or {}
    if not (isinstance(paths, dict) and set(paths) <= set(MODES) and all(
            isinstance(p, dict) and all(isinstance(k, str) and isinstance(v, str)
                                        for k, v in p.items())
            for p in paths.values())):
        saved_values.refuse(entry, "paths", "a mapping of modes to {path: layer name}",
                            paths)
    if config.get("of_layer") is not None:
        saved_values.saved_str(config["of_layer"], entry, "of_layer")
    _check_body_class(config.get("body"), entry)


def _check_body_class(body, entry):
    """A body read from a file names the class `KipFunctional` (by its
    module and registered name), or is refused before Keras makes it."""
    from keras_ipu_plugin.runtime.functional import KipFunctional

    registered = keras.saving.get_registered_name(KipFunctional)
    if not (isinstance(body, dict) and body.get("class_name") == KipFunctional.__name__
            and body.get("module") == KipFunctional.__module__
            and body.get("registered_name") == registered
            and isinstance(body.get("config"), dict)):
        shown = body.get("class_name") if isinstance(body, dict) else body
        saved_values.refuse(entry, "body", "a saved KipFunctional", shown)


def _check_outputs(outputs, count, entry):
    if not (isinstance(outputs, dict) and outputs and all(
            mode in MODES and isinstance(indices, list) and indices and all(
                isinstance(i, int) and not isinstance(i, bool) and 0 <= i
                and (count is None or i < count)
                for i in indices)
            for mode, indices in outputs.items())):
        below = "" if count is None else f" below {count}"
        saved_values.refuse(entry, "outputs", f"a mapping of modes to indices{below}", outputs)
    lengths = {len(indices) for indices in outputs.values()}
    if len(lengths) != 1:
        saved_values.refuse(entry, "outputs", "as many outputs in every mode", outputs)


def union_graph(graphs, name):
    """`(graph, {mode: output indices})`: one IR graph computing every
    mode's graph from shared inputs (the first mode's input values and
    specs), its outputs those of each mode in turn. The nodes are copies
    (the branch graphs stay as they are), renamed where two modes use one
    path (`block.dense_1`): the names are the body's own."""
    modes = list(graphs)
    first = graphs[modes[0]]
    copies = {mode: graphs[mode].copy() for mode in modes}
    inputs = list(copies[modes[0]].input_values)
    nodes, outputs, indices = [], [], {}
    names = Namespace()
    for mode in modes:
        graph = copies[mode]
        swap = dict(zip(graph.input_values, inputs))
        for node in list(graph.nodes):
            node.args = map_values(lambda v: swap.get(v, v), node.args)
            node.kwargs = map_values(lambda v: swap.get(v, v), node.kwargs)
        members = list(graph.nodes)
        graph.nodes = []  # detached, to join the union
        for node in members:
            node.name = names.create(node.name)
            nodes.append(node)
        leaves = [swap.get(v, v) for v in _flat(graph.outputs)]
        indices[mode] = list(range(len(outputs), len(outputs) + len(leaves)))
        outputs.extend(leaves)
    union = Graph(list(first.input_specs), inputs, nodes, outputs, name=name)
    for node in nodes:
        if not isinstance(node.operation, keras.layers.Layer) or _is_kip_operation(node):
            # Our own operations (a keras.ops call, a draw) take their node's
            # name: a functional model's operations need distinct names.
            node.operation.name = node.name
    return union, indices


def _is_kip_operation(node):
    from keras_ipu_plugin.layers.keras_ops.batch_sized import BatchSizedOperation
    from keras_ipu_plugin.layers.keras_ops.random_draws import RandomDraw

    return isinstance(node.operation, (BatchSizedOperation, RandomDraw))


def _mode_paths(graphs, union, body):
    """`{mode: {branch node path: Keras layer name in the body}}`: the
    union's nodes are the branches' nodes, in order."""
    paths, start = {}, 0
    for mode, graph in graphs.items():
        paths[mode] = {
            node.name: body.kip_layer_paths.get(copy.name, copy.operation.name)
            for node, copy in zip(graph.nodes, union.nodes[start:start + len(graph.nodes)])
            if node.is_layer
        }
        start += len(graph.nodes)
    return paths


def _flat(structure):
    found = []
    map_values(found.append, structure)
    return found


def branch_input_graph(nodes, input_values, outputs, input_specs, name):
    """An IR graph of traced `nodes` reading `input_values` (Values of the
    graph the call is in), with inputs of its own: each becomes a new Value
    read in its place. `outputs`: a flat list of Values."""
    fresh = [Value(None, 0, value.spec) for value in input_values]
    swap = dict(zip(input_values, fresh))
    for node in nodes:
        node.args = map_values(lambda v: swap.get(v, v), node.args)
        node.kwargs = map_values(lambda v: swap.get(v, v), node.kwargs)
    outputs = [swap.get(v, v) for v in outputs]
    return Graph(list(input_specs), fresh, list(nodes), outputs, name=name)


__all__ = ["MODES", "ModeSwitch", "branch_input_graph", "union_graph"]

