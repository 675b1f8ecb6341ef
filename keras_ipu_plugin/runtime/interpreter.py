"""Run kip's `Graph`: one overridable step per node, and run-time effects.

`Interpreter(graph, backend, owner)` runs the IR graph a model holds
(`graph_of(model)`, below: the graph the passes produced, each node with
its operation, its arguments with `Value`s, its `training` and its
annotations), as torch.fx's `Interpreter`
runs an fx graph: `run` walks the plan, `run_node` runs one node (its
inputs read from the run's values, its outputs written back), and
`call_operation` calls the node's operation; a subclass may override
either.

What an annotation does when the model runs is a `RunEffect`, registered
under a name with `register_run_effect` by the file that defines it (the
built-in ones: recompute segments, outlined bodies and pipeline-stage
placement, in `runtime/effects.py`). An effect may

- `plan(steps)`: regroup the run (recompute segments run several nodes
  under one checkpoint): a step is a `Node` or an object with
  `run(interpreter, run)`;
- `run_node(node, run, proceed)`: run around one node (a node recomputed
  under its own checkpoint runs on other values);
- `call(node, run, args, kwargs, proceed)`: call around the operation
  (placed on a device, an outlined body instead of the layer, its outputs
  checkpointed).

Effects wrap in `order` (lower: further outside); each applies to the
nodes whose annotations hold one of its `keys` unless it says otherwise.
A new pass with a run-time effect is one file: the pass writes its
annotation, its effect reads it from the nodes.

Example:
    ```python
    @register_run_effect
    class Trace(RunEffect):
        name = "trace"
        keys = ("trace",)
        def call(self, node, run, args, kwargs, proceed):
            print("running", node.name)
            return proceed(args, kwargs)
    passed(x)         # a node annotated {"trace": True} prints its name
    ```

`graph_of(model)`: the IR graph a `KipFunctional` runs.

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
    ```python
    graph = graph_of(keras.models.load_model("passed.keras"))
    [(node.name, node.annotations) for node in graph.nodes][:2]
    # -> [('stem', {}), ('blocks.0', {'recompute': True})]
    ```
"""

import keras

from keras_ipu_plugin import _compat
from keras_ipu_plugin.ir.graph import Node, Value, FOLLOW, Graph, Namespace


_EFFECTS = {}  # name -> RunEffect subclass, in registration order


def register_run_effect(cls):
    """Class decorator: `cls` (a `RunEffect` subclass with a `name`) takes
    effect wherever a model's nodes carry one of its `keys`. Registering a
    name again replaces the effect (a module reloaded).

    Example:
        ```python
        @register_run_effect
        class Nothing(RunEffect):
            name = "nothing"
            keys = ("nothing",)
        ```
    """
    if not (isinstance(cls, type) and issubclass(cls, RunEffect)):
        raise TypeError(f"register_run_effect takes a RunEffect subclass, not {cls!r}.")
    if not isinstance(cls.name, str) or not cls.name:
        raise TypeError(f"{cls.__name__}.name must be a non-empty string (its registry name).")
    if not cls.keys or not all(isinstance(key, str) for key in cls.keys):
        raise TypeError(f"{cls.__name__}.keys must name the annotation keys it acts on.")
    _EFFECTS[cls.name] = cls
    return cls


def unregister_run_effect(name):
    """Remove the effect registered as `name` (a test's own effect)."""
    _EFFECTS.pop(name, None)


def registered_run_effects():
    """`{name: RunEffect subclass}`, in registration order.

    Example:
        ```python
        sorted(registered_run_effects())
        # -> ['activation_remat', 'outline', 'recompute', 'stages']
        ```
    """
    return dict(_EFFECTS)


class RunEffect:
    """What an annotation does when the graph runs (see the module
    docstring). One instance per interpreter: it may keep what it made
    (a shared body, a plan) on itself."""

    #: the registry name
    name = None
    #: the annotation keys it gives meaning to
    keys = ()
    #: among the effects on one node: lower wraps further outside
    order = 100

    def __init__(self, interpreter):
        self.interpreter = interpreter

    @property
    def backend(self):
        return self.interpreter.backend

    def active(self):
        """Whether this effect takes part in its interpreter's runs."""
        return any(self.applies(node) for node in self.interpreter.graph.nodes)

    def applies(self, node):
        """Whether `run_node` / `call` of this effect wrap `node`."""
        return any(key in node.annotations for key in self.keys)

    def plan(self, steps):
        return steps

    def run_node(self, node, run, proceed):
        return proceed(run)

    def call(self, node, run, args, kwargs, proceed):
        return proceed(args, kwargs)


class Run:
    """One call of the graph: the values computed so far (`env`, keyed by
    `Value`), the model's `training`, the call context (`training` and the
    other arguments Keras hands to layers that take them), and `state`, a
    dict effects may mark a run with (a node running under its own
    checkpoint)."""

    __slots__ = ("env", "training", "context", "state")

    def __init__(self, env, training, context, state=None):
        self.env = env
        self.training = training
        self.context = context
        self.state = {} if state is None else state

    def with_env(self, env, **state):
        """The same call on other values (a recomputed segment's own)."""
        return Run(env, self.training, self.context, {**self.state, **state})


class Interpreter:
    """Runs `graph` with `backend`; `owner` is the model being run (layers
    see it as the caller), `stage_devices` its `kip_stage_devices`.

    Example:
        ```python
        interpreter = Interpreter(passed.kip_graph, get_backend(), passed)
        interpreter.run(inputs, training=False)
        ```
    """

    def __init__(self, graph, backend, owner=None, stage_devices=(), output_structure=None):
        self.graph = graph
        self.backend = backend
        self.owner = owner
        self.stage_devices = list(stage_devices)
        self.output_structure = output_structure
        effects = [cls(self) for cls in _EFFECTS.values()]
        self.effects = {effect.name: effect for effect in effects if effect.active()}
        ordered = sorted(self.effects.values(), key=lambda effect: effect.order)
        self._wrappers = {node: [e for e in ordered if e.applies(node)] for node in graph.nodes}
        steps = list(graph.nodes)
        for effect in ordered:
            steps = effect.plan(steps)
        self.steps = steps

    def __call__(self, inputs, training, context):
        return self.run(inputs, training, context)

    def run(self, inputs, training=None, context=None):
        """The graph's outputs on `inputs` (a nest in the graph's input order)."""
        env = dict(zip(keras.tree.flatten(self.graph.input_values), keras.tree.flatten(inputs)))
        run = Run(env, training, {"training": training} if context is None else context)
        for step in self.steps:
            if isinstance(step, Node):
                self.run_node(step, run)
            else:
                step.run(self, run)
        outputs = [run.env[value] for value in keras.tree.flatten(self.graph.outputs)]
        if self.output_structure is None:
            return outputs
        return keras.tree.pack_sequence_as(self.output_structure, outputs)

    def run_node(self, node, run):
        """Run `node`: its inputs from `run.env`, its outputs into it,
        through the effects that wrap it."""
        self._run_node_through(self._wrappers.get(node, ()), 0, node, run)

    def _run_node_through(self, wrappers, index, node, run):
        if index == len(wrappers):
            return self.call_node(node, run)
        return wrappers[index].run_node(
            node, run, lambda run: self._run_node_through(wrappers, index + 1, node, run))

    def call_node(self, node, run):
        """Fill in the node's arguments, call it through the effects' `call`,
        and keep its outputs."""
        args, kwargs = call_arguments(node, run.env, run.context)
        outputs = self._call_through(self._wrappers.get(node, ()), 0, node, run, args, kwargs)
        run.env.update(zip(node.outputs, output_tensors(node, outputs)))
        return outputs

    def _call_through(self, wrappers, index, node, run, args, kwargs):
        if index == len(wrappers):
            return self.call_operation(node, args, kwargs)
        return wrappers[index].call(
            node, run, args, kwargs,
            lambda args, kwargs: self._call_through(wrappers, index + 1, node, run, args, kwargs))

    def call_operation(self, node, args, kwargs):
        """Call the node's operation (override to run operations otherwise)."""
        return node.operation(*args, **kwargs)


def interpreter_for(model, backend):
    """The `Interpreter` running `model` (a `KipFunctional`) on `backend`:
    its graph (`graph_of`), its stage devices and its output structure.

    Example:
        ```python
        interpreter_for(passed, get_backend()).steps[0].recompute
        # -> True
        ```
    """
    return Interpreter(graph_of(model), backend, owner=model,
                       stage_devices=model.kip_stage_devices,
                       output_structure=_compat.output_structure(model))


def call_arguments(node, env, context):
    """`(args, kwargs)` to call `node`'s operation with: its arguments with
    each `Value` read from `env` (`{Value: tensor}`), and, for a layer, the
    call context it takes (`context`: `training` and what else Keras hands
    to layers taking it) unless the code pinned `training` at this call
    site (`node.training` True / False, which it is then called with). The
    one way a node is handed its arguments: the interpreter, and the
    planner measuring a node alone, call it.

    Example:
        ```python
        call_arguments(node, {x_value: x}, {"training": True})
        # -> ((<tf.Tensor ...>,), {'training': True})
        ```
    """
    args, kwargs = _filled(node.args, node.kwargs, env)
    operation = node.operation
    if isinstance(operation, keras.layers.Layer):
        accepted = _compat.call_context_args(operation)
        for key, value in context.items():
            if value is not None and key in accepted:
                kwargs[key] = value
        if node.training in (True, False):
            kwargs["training"] = node.training
    return args, kwargs


def output_tensors(node, outputs):
    """The tensors of `outputs` (what `node`'s call returned) in the order of
    `node.outputs`: a call that returned None among them
    (`node.output_structure` places its outputs) has no Value for a None."""
    flat = keras.tree.flatten(outputs)
    if node.output_structure is None:
        return flat
    places = keras.tree.flatten(node.output_structure)
    return [tensor for place, tensor in zip(places, flat) if place is not None]


def _filled(args, kwargs, env):
    # One positional tensor is the usual call: no walk of the structures.
    if not kwargs and len(args) == 1 and isinstance(args[0], Value):
        return (env[args[0]],), {}

    def fill(leaf):
        return env[leaf] if isinstance(leaf, Value) else leaf

    return keras.tree.map_structure(fill, args), keras.tree.map_structure(fill, kwargs)


def graph_of(model):
    """The graph `model` (a `KipFunctional`) runs: `model.kip_graph`, or,
    where it has none, the graph read from its Keras nodes (once).

    Example:
        ```python
        graph_of(passed) is passed.kip_graph
        # -> True
        ```
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
