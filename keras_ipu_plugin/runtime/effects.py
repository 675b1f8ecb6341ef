"""The run-time effects of the built-in annotation passes, registered with the
interpreter (`register_run_effect`): Recompute (segments under checkpoints, and
a Dense's activation recomputed alone), Outline (shared bodies), PipelineStages
(stage placement). One concept, one section per annotation.

What the Recompute pass's annotations do when the graph runs.

The plan is made once per model: nodes in the graph's run order, grouped
into recompute segments (portable backend) that end at each checkpointed
layer (`"recompute"`). Layers that carry other state updated in the forward
pass (moving statistics) never sit inside a segment: recomputing them would
update that state twice, silently changing results. The seeds of random
draws (Dropout) may: a segment reads its seed states once, in the forward
pass, with its weights, so the recomputation draws the very same numbers,
and writes the advanced seeds back once. A segment whose layers draw from
a seed generator none of them owns (a random layer the model calls but does
not own, Keras's global generator) runs without recomputation: its seed
state cannot be handed to the recomputation, which would draw other numbers,
and inside the segment's stateless scope the advance would never reach it.

A recomputed segment reads its variables once, in the forward pass, and runs
(also when recomputed) on those values through a `keras.StatelessScope`. Had
the recomputation read the variables itself, it would read them in the
backward pass, where TensorFlow's graph optimiser (Grappler's dependency
optimisation) let an optimizer's update of a variable run before such a read
in about one step in five: gradients then came from half-updated weights.

Two more annotations refine a plan (`Recompute(auto=True)` writes them),
under the key `remat`:

- `"keep"`: the layer runs normally and ends the segment before it (its
  activations are kept), so a recomputed segment may start right after it;
- `"inside"`: the layer is recomputed from its own inputs: it runs under its
  own checkpoint, so its internal tensors (a Dense's pre-activation, gelu's
  intermediates, attention scores) are dropped and its outputs kept, what
  `keras.RematScope("larger_than")` does to a layer. Inside a recomputed
  segment it nests: the segment's recomputation keeps only its outputs.

A backend that does not recompute segments (the IPU's) checkpoints the
outputs of each `"recompute"` layer instead (`checkpoint_outputs`).

Example:
    ```python
    segments = make_plan(passed, get_backend())
    [segment.recompute for segment in segments]
    # -> [True, False]
    ```

Recomputing a Dense layer's activation alone: the note `activation_remat`.

A `keras.layers.Dense(768, activation="gelu")` keeps, for its backward pass,
its pre-activation `z` and gelu's intermediates (about three tensors the
size of its output), besides its input. With this note the layer's linear
part (`matmul`, bias) runs as usual and its activation runs under a
checkpoint: the backward pass keeps `z` only and recomputes the activation
from it, an elementwise op that costs a few percent of the matmul. This is
PyTorch's selective activation checkpointing (save the matmul's output,
recompute the pointwise ops), for one layer; `Recompute(auto=True)` writes
the note where the traced backward shows it saves memory
(`planning.node_costs`), in any kind of plan (a node kept, or recomputed in a
segment, still drops its activation's intermediates).

The split computes exactly what `Dense.call` computes, `activation(matmul(x,
kernel) + bias)`, with the same ops on the same values. So it is applied only
where that is all the layer's call does: a layer of class `Dense` itself
(not a subclass, whose `call` may differ), without LoRA, quantization, an
activity regularizer or a mixed-precision policy (whose casts `__call__`
makes), called on one tensor. Any other layer carrying the note runs as it
is (the note is a memory choice; results are the same either way).

Example:
    ```python
    passed.kip_annotations["blocks.0.dense.1"] = {"activation_remat": True}
    passed(x, training=True)   # that Dense keeps z, recomputes gelu(z)
    ```

What the Outline pass's annotation does when the graph runs: layers of a
group share one compiled body (the backend's `outline`: a `tf.function`
here, `ipu.outlined_function` on the IPU), called on each layer's own
weights.

Layers share a body when their class, config (but the name), symbolic
input signature and the call's keyword values are equal; the training mode
is part of what they share unless nothing in the layer reads it. A write
node runs as itself: an outlined body runs on the weights passed in, in a
stateless scope that would keep the write.

Example:
    ```python
    outlined = kip.apply_passes(converted, [kip.passes.Outline(Block)])
    outlined(x)
    len(outlined.kip_interpreter().effects["outline"].bodies)   # one per group
    # -> 1
    ```

What the PipelineStages pass's annotation does when the graph runs: each
layer is called in its stage's scope (`backend.stage_scope`): on the
portable backend the device `kip_stage_devices[stage]` names (a model
without devices runs as it is); the IPU backend places stages through
Graphcore's pipeline API instead (`backends.ipu.assign_stages`), so its
scope is empty. A layer without a stage annotation is in stage 0.

Example:
    ```python
    staged = kip.apply_passes(converted, [kip.passes.PipelineStages(num_stages=2)])
    staged.kip_stage_devices = ["/cpu:0", "/cpu:0"]
    staged(x)      # each layer runs under tf.device of its stage
    ```
"""

import inspect
from dataclasses import dataclass, field

import keras
import tensorflow as tf

from keras_ipu_plugin import _compat
from keras_ipu_plugin.ir.graph import Node
from keras_ipu_plugin.layers.alias import LayerAlias
from keras_ipu_plugin.layers.layer_kinds import seed_states, writes_variables, training_agnostic
from keras_ipu_plugin.layers.state import is_write_node
from keras_ipu_plugin.layers.tf_calls import draws_statefully
from keras_ipu_plugin.runtime.interpreter import graph_of
from keras_ipu_plugin.runtime.interpreter import RunEffect, register_run_effect
from keras_ipu_plugin.runtime.variables import union_of_variables


#: `Run.state` entry: the node running under its own checkpoint.
_OWN_CHECKPOINT = "recompute.own_checkpoint"


@dataclass(eq=False)
class Segment:
    """Nodes run together; `recompute` segments run under the backend's
    checkpointing. `inputs` / `outputs` are the `Value`s crossing it."""

    nodes: list
    recompute: bool = False
    inputs: list = field(default_factory=list)
    outputs: list = field(default_factory=list)
    variables: list = field(default_factory=list)
    # Found on its first run: its layers write a variable it holds no value
    # for (a seed generator no layer of it owns); it then runs as it is.
    writes_elsewhere: bool = False

    def run(self, interpreter, run):
        if self.recompute:
            interpreter.effects[Recompute.name].run_recomputed(self, run)
        else:
            for node in self.nodes:
                interpreter.run_node(node, run)


def make_plan(model, backend):
    """The segments `model` (a `KipFunctional`) runs in with `backend`.

    Example:
        ```python
        [s.recompute for s in make_plan(passed, get_backend())]
        # -> [True, False, False]
        ```
    """
    graph = graph_of(model)
    return segments_of(graph.nodes, graph.outputs, backend)


def segments_of(nodes, outputs, backend):
    """`nodes` (in run order) cut into `Segment`s; `outputs`: the Values the
    graph returns."""
    segments, current = [], []
    for node in nodes:
        notes = node.annotations
        if (not backend.recomputes_segments or has_forward_state(node.operation)
                or notes.get("remat") == "keep"):
            if current:
                segments.append(Segment(current, recompute=False))
                current = []
            segments.append(Segment([node]))
            continue
        current.append(node)
        if notes.get("recompute"):
            segments.append(Segment(current, recompute=True))
            current = []
    if current:
        segments.append(Segment(current))
    _keep_last_segment(segments)
    wire_segments(segments, outputs)
    return segments


def _keep_last_segment(segments):
    """Run the last recomputed segment normally when little follows it.

    The backward pass starts with the layers after the last checkpoint and
    then needs that segment's activations at once: recomputing it only saves
    memory while the tail's own activations are alive. The peak is
    `max(tail, segment)` with recomputation and `tail + segment` without, so
    when the tail keeps less than the segment's largest single activation,
    recomputing costs a forward pass of the segment for nothing.
    """
    recomputed = [i for i, segment in enumerate(segments) if segment.recompute]
    if not recomputed:
        return
    last = recomputed[-1]
    tail = [node for segment in segments[last + 1:] for node in segment.nodes]
    largest = max(_activation_size([node]) for node in segments[last].nodes)
    if _activation_size(tail) < largest:
        segments[last].recompute = False


def _activation_size(nodes):
    """Elements per example in the outputs of `nodes` (unknown dims as 1)."""
    total = 0
    for node in nodes:
        for value in node.outputs:
            size = 1
            for dim in value.spec.shape[1:]:
                size *= dim or 1
            total += size
    return total


def has_forward_state(operation):
    """Whether the layer updates state in its forward pass that a
    recomputation could not replay: anything but its random seeds (a
    non-trainable variable, or any variable its `call` was seen writing:
    PixelCNN's masked kernel). A TensorFlow random draw's state is its
    kernel's: a recomputation would draw other numbers.

    Example:
        ```python
        has_forward_state(keras.layers.BatchNormalization())
        # -> True
        ```
    """
    if not isinstance(operation, keras.layers.Layer):
        return draws_statefully(operation)
    if writes_variables(operation):
        return True
    seeds = {id(state) for state in seed_states(operation)}
    return any(id(v) not in seeds for v in operation.non_trainable_variables)


def _refuse_writes_in_segment(node, variables, given, scope):
    """Raise when the layer at `node` wrote a variable other than a seed
    state inside a recomputed segment: the write would stay in the
    segment's stateless scope (never reaching the variable), and what read
    it next would be differentiated through the write. Layers a trace saw
    writing run outside segments; this catches one it did not see."""
    seeds = {id(v) for v in variables if not v.trainable}
    for variable in variables:
        if id(variable) not in seeds and scope.get_current_value(variable) is not given[id(variable)]:
            raise ValueError(
                f"Layer `{getattr(node.operation, 'name', node.operation)}` writes variable "
                f"`{variable.path}` in its forward pass, inside a recomputed segment: "
                "recomputation cannot replay a write. Convert the model with "
                "kip.convert_to_functional (whose trace sees the write and keeps the layer "
                "out of recomputed segments), or leave this layer out of Recompute's targets.")


class _WritesElsewhere(Exception):
    """A recomputed segment's layers wrote a variable the segment holds no
    value for (see `Segment.writes_elsewhere`)."""


def wire_segments(segments, outputs):
    """Fill each segment's crossing Values (`segments` in run order;
    `outputs`: the Values the graph returns)."""
    later_needs = set(keras.tree.flatten(outputs))
    for segment in reversed(segments):
        produced = {value for node in segment.nodes for value in node.outputs}
        needed = []
        for node in segment.nodes:
            for value in node.input_values:
                if value not in produced and value not in needed:
                    needed.append(value)
        segment.outputs = [value for node in segment.nodes
                           for value in node.outputs if value in later_needs]
        segment.inputs = needed
        segment.variables = _variables_of(segment.nodes) if segment.recompute else []
        later_needs |= set(needed)


def _variables_of(nodes):
    """The Keras variables of the layers run by `nodes`, each once."""
    return union_of_variables(
        [v for node in nodes for v in getattr(node.operation, "variables", [])], []
    )


@register_run_effect
class Recompute(RunEffect):
    """Recompute segments, layers recomputed under their own checkpoint
    (`remat="inside"`), and the IPU's output checkpoints."""

    name = "recompute"
    keys = ("recompute", "remat")
    order = 0  # outermost: an IPU checkpoint takes the outputs as the call gave them

    def __init__(self, interpreter):
        super().__init__(interpreter)
        self.inside = {}  # node -> its own Segment (the remat="inside" note)

    def plan(self, steps):
        if not all(isinstance(step, Node) for step in steps):
            raise TypeError(
                "Recompute cuts the graph's nodes into segments, but an effect before it "
                "regrouped them already: give that effect a higher `order`.")
        return segments_of(steps, self.interpreter.graph.outputs, self.backend)

    def run_node(self, node, run, proceed):
        if (node.annotations.get("remat") == "inside" and self.backend.recomputes_segments
                and run.state.get(_OWN_CHECKPOINT) is not node
                and not has_forward_state(node.operation)):
            return self._run_inside(node, run)
        return proceed(run)

    def call(self, node, run, args, kwargs, proceed):
        outputs = proceed(args, kwargs)
        if self.backend.recomputes_segments or not node.annotations.get("recompute"):
            return outputs
        flat = keras.tree.flatten(outputs)
        kept = self.backend.checkpoint_outputs(flat)
        for before, after in zip(flat, kept):  # a checkpoint's copies keep masks
            if _compat.keras_mask(before) is not None:
                _compat.set_keras_mask(after, _compat.keras_mask(before))
        return keras.tree.pack_sequence_as(outputs, kept)

    def _run_inside(self, node, run):
        """Run `node` under its own checkpoint (the `remat="inside"` note):
        its outputs are kept, its internal tensors recomputed."""
        segment = self.inside.get(node)
        if segment is None:
            segment = Segment([node], recompute=True)
            segment.inputs = list(dict.fromkeys(node.input_values))
            segment.outputs = list(node.outputs)
            segment.variables = _variables_of([node])
            self.inside[node] = segment
        self.run_recomputed(segment, run, inside=node)

    def run_recomputed(self, segment, run, inside=None):
        """Run `segment` under the backend's checkpoint; `inside`: the node
        it runs under its own checkpoint, if that is what it is."""
        interpreter = self.interpreter
        if segment.writes_elsewhere:
            self._run_as_it_is(segment, run, inside)
            return
        try:
            self._run_checkpointed(segment, run, inside)
        except _WritesElsewhere:
            segment.writes_elsewhere = True
            self._run_as_it_is(segment, run, inside)

    def _run_as_it_is(self, segment, run, inside):
        """Run `segment`'s nodes without recomputation (a node recomputed
        under its own checkpoint just runs)."""
        if inside is not None:
            run = run.with_env(run.env, **{_OWN_CHECKPOINT: inside})
        for node in segment.nodes:
            self.interpreter.run_node(node, run)

    def _run_checkpointed(self, segment, run, inside):
        interpreter = self.interpreter
        tensors = run.env
        count = len(segment.inputs)
        loss_owners = []
        # Seed states (the only non-trainable variables a segment holds) come
        # in as values like the weights; the advanced seeds go out, and are
        # written back once: the recomputation's own advance is dropped.
        seeds = [v for v in segment.variables if not v.trainable]

        # The Keras masks the inputs carry (a padding mask on an embedding's
        # output) go in as arguments and are put back on the segment's own
        # copies, and the outputs' masks come out as outputs: the tensors
        # crossing the segment's boundary are new ones, without the
        # `_keras_mask` Keras reads to pass a layer its `mask` (lost, a
        # masked encoder computed other outputs).
        masked = [i for i in segment.inputs if _compat.keras_mask(tensors[i]) is not None]
        masks_out = []  # the outputs that carry a mask, in order

        def body(*flat):
            local = dict(zip(segment.inputs, flat[:count]))
            weights = len(segment.variables)
            state = list(zip(segment.variables, flat[count:count + weights]))
            for i, mask in zip(masked, flat[count + weights:]):
                local[i] = tf.identity(local[i])
                _compat.set_keras_mask(local[i], mask)
            local_run = run.with_env(local, **{_OWN_CHECKPOINT: inside})
            owners = []
            # Losses added inside (activity regularizers) become outputs of
            # the segment, so that they get gradients too.
            with _compat.stateless_scope(state, collect_losses=True) as scope:
                given = {id(v): scope.get_current_value(v) for v in segment.variables}
                for node in segment.nodes:
                    before = len(scope.losses)
                    interpreter.run_node(node, local_run)
                    owners += [node.operation] * (len(scope.losses) - before)
                    _refuse_writes_in_segment(node, segment.variables, given, scope)
                if _compat.writes_other_variables(scope, segment.variables):
                    raise _WritesElsewhere()
            loss_owners[:] = owners
            advanced = [scope.get_current_value(v) for v in seeds]
            # The first run fixes which outputs carry a mask; the
            # recomputation gives the same structure.
            if not masks_out:
                masks_out[:] = [i for i in segment.outputs
                                if _compat.keras_mask(local[i]) is not None] or [None]
            masks = [_compat.keras_mask(local[i]) for i in masks_out if i is not None]
            return ([local[i] for i in segment.outputs] + advanced + list(scope.losses)
                    + masks)

        results = self.backend.checkpoint_segment(body, anchored=count)(
            *[tensors[i] for i in segment.inputs],
            *[_compat.current_value(v) for v in segment.variables],
            *[_compat.keras_mask(tensors[i]) for i in masked],
        )
        mask_ids = [i for i in masks_out if i is not None]
        if mask_ids:
            results, masks = results[:-len(mask_ids)], results[-len(mask_ids):]
        else:
            masks = []
        outputs = len(segment.outputs)
        tensors.update(zip(segment.outputs, results[:outputs]))
        for i, mask in zip(mask_ids, masks):
            _compat.set_keras_mask(tensors[i], mask)
        for variable, value in zip(seeds, results[outputs:outputs + len(seeds)]):
            variable.assign(value)
        for layer, loss in zip(loss_owners, results[outputs + len(seeds):]):
            layer.add_loss(loss)


#: The annotation key (its value: True).
ACTIVATION_REMAT = "activation_remat"


def splittable(layer):
    """Whether `layer`'s call is `activation(matmul(x, kernel) + bias)` and
    nothing more, with an activation other than the identity (see the
    module docstring).

    Example:
        ```python
        splittable(keras.layers.Dense(4, activation="gelu"))
        # -> True
        splittable(keras.layers.Dense(4))
        # -> False
        ```
    """
    layer = getattr(layer, "aliased_layer", layer)
    if type(layer) is not keras.layers.Dense or not layer.built:
        return False
    activation = layer.activation
    if activation is None or activation is keras.activations.linear:
        return False
    if getattr(layer, "lora_enabled", False) or getattr(layer, "quantization_mode", None):
        return False
    if layer.activity_regularizer is not None:
        return False
    policy = layer.dtype_policy
    return policy.compute_dtype == policy.variable_dtype


def split_call(layer, inputs, checkpoint):
    """`layer(inputs)` for a `splittable` layer, its activation run under
    `checkpoint(fn, anchored=1)` (a backend's `checkpoint_segment`): the
    pre-activation is kept, the activation recomputed. A Keras mask on
    `inputs` goes on to the output, as Dense's `__call__` passes it.

    Example:
        ```python
        y = split_call(dense, x, get_backend().checkpoint_segment)
        ```
    """
    layer = getattr(layer, "aliased_layer", layer)
    pre = keras.ops.matmul(inputs, layer.kernel)
    if layer.bias is not None:
        pre = keras.ops.add(pre, layer.bias)
    activation = layer.activation
    (outputs,) = checkpoint(lambda z: [activation(z)], anchored=1)(pre)
    mask = _compat.keras_mask(inputs)
    if mask is not None:
        _compat.set_keras_mask(outputs, mask)
    return outputs


def _single_tensor_call(args, kwargs):
    """The call is `layer(x)` (a `training` keyword aside, which Dense
    ignores)."""
    extra = {key for key in kwargs if key != "training"}
    return len(args) == 1 and not extra and keras.ops.is_tensor(args[0])


@register_run_effect
class ActivationRemat(RunEffect):
    """A Dense layer's activation recomputed from its kept pre-activation."""

    name = "activation_remat"
    keys = (ACTIVATION_REMAT,)
    order = 30  # innermost: it replaces the layer's own call (an outlined body wins)

    def applies(self, node):
        return node.annotations.get(ACTIVATION_REMAT) is True

    def call(self, node, run, args, kwargs, proceed):
        if (not self.backend.recomputes_segments or not splittable(node.operation)
                or not _single_tensor_call(args, kwargs)):
            return proceed(args, kwargs)
        return split_call(node.operation, args[0], self.backend.checkpoint_segment)


@register_run_effect
class Outline(RunEffect):
    """Outlined bodies shared between the layers of a group."""

    name = "outline"
    keys = ("outline",)
    order = 20  # innermost: the body replaces the layer's own call

    def __init__(self, interpreter):
        super().__init__(interpreter)
        self.bodies = {}  # key -> shared function

    def applies(self, node):
        # A write node runs as itself (see the module docstring).
        operation = node.operation
        return ("outline" in node.annotations and isinstance(operation, keras.layers.Layer)
                and not is_write_node(getattr(operation, "aliased_layer", operation)))

    def call(self, node, run, args, kwargs, proceed):
        return self._outlined_call(node, node.annotations["outline"], args, kwargs,
                                   run.context.get("training"))

    def _outlined_call(self, node, outline_kwargs, args, kwargs, training):
        # An expanded layer runs behind an alias whose config holds the
        # layer's own name: grouped by the alias, no two would share.
        layer = getattr(node.operation, "aliased_layer", node.operation)
        # Only what `call` takes (`__call__` would drop an unused `training`
        # itself; kept, it would split the layers into two groups).
        accepted = inspect.signature(layer.call).parameters
        if not any(p.kind is p.VAR_KEYWORD for p in accepted.values()):
            kwargs = {k: v for k, v in kwargs.items() if k in accepted}
        # Tensors (a mask, an attention mask) are arguments of the shared
        # body; other values are part of what makes two calls share it.
        tensor_kwargs = {k: v for k, v in kwargs.items() if tf.is_tensor(v)}
        static_kwargs = {k: v for k, v in kwargs.items() if k not in tensor_kwargs}
        # The body is traced once per key: the model's training mode is part
        # of it unless nothing in the layer reads it, since sub-layers that
        # take it from the context (a Dropout in a block whose `call` has no
        # `training`) bake it into the trace.
        if training_agnostic(layer):
            static_kwargs.pop("training", None)
            mode = None
        else:
            mode = _training_key(training)
        key = _outline_key(layer, node, static_kwargs) + (tuple(sorted(tensor_kwargs)), mode)
        shared = self.bodies.get(key)
        if shared is None:
            body = _shared_body(layer, static_kwargs, self.interpreter.owner, training)
            shared = self.backend.outline(body, **outline_kwargs)
            self.bodies[key] = shared
        outputs, new_state, losses = shared(
            [_compat.current_value(v) for v in layer.trainable_variables],
            [_compat.current_value(v) for v in layer.non_trainable_variables],
            tensor_kwargs,
            *args,
        )
        for variable, value in zip(layer.non_trainable_variables, new_state):
            variable.assign(value)
        for loss in losses:
            layer.add_loss(loss)
        return outputs


def _shared_body(representative, kwargs, model, training):
    """One body for every layer of a group: the representative layer called
    (through `__call__`, as the model calls it) on the weights passed in, so
    N layers share it.

    Not `stateless_call`: that runs `call` bare, skipping what `__call__`
    does around it — casting the inputs to the compute dtype and reading the
    weights in it under a mixed precision policy (an outlined Dense under
    `mixed_float16` computed in float32 on float16-rounded weights), the
    activity regularizer and the masks. Weights come in stored, uncast:
    `__call__` casts them as it would the variables.
    """
    kwargs = dict(kwargs)

    def body(trainable, non_trainable, tensor_kwargs, *args):
        mapping = list(zip(representative.trainable_variables, trainable)) + list(
            zip(representative.non_trainable_variables, non_trainable)
        )
        # Under a scope of its own: the body may be traced in a graph of its
        # own, where the layer's would be a root scope, which TensorFlow
        # refuses for a name starting with `_` (a layer of a class `_Conv`).
        with _compat.stateless_scope(mapping, collect_losses=True) as scope, \
                tf.name_scope("outlined"):
            with _compat.call_context(model, training):
                outputs = representative(*args, **kwargs, **tensor_kwargs)
        new_state = [
            scope.get_current_value(v) for v in representative.non_trainable_variables
        ]
        return outputs, new_state, list(scope.losses)

    return body


def _training_key(training):
    if training is None or isinstance(training, bool):
        return training
    return "tensor"


def _outline_key(layer, node, kwargs):
    """Layers share a body when class, config (but the name), the symbolic
    input signature and the call's keyword values are equal. A layer whose
    config cannot be read shares with none (see `outline_config`)."""
    config, _ = outline_config(layer)
    config = ("alone", id(layer)) if config is None else repr(sorted(config.items()))
    signature = tuple(
        (tuple(value.spec.shape), value.spec.dtype) for value in node.input_values
    )
    return (type(layer), config, signature, repr(sorted(kwargs.items())))


def outline_config(layer):
    """`(config, None)`: what must be equal for two layers of one class to
    share an outlined body (the config but the name); `(None, error)` when
    the layer's own `get_config` fails (keras_hub 0.32's
    `LlamaTransformerDecoder` reads an attribute it never sets): nothing
    then shows two such layers equal, so the layer is outlined alone.

    Example:
        ```python
        outline_config(keras.layers.Dense(3, name="a"))[0]["units"]
        # -> 3
        ```
    """
    inner = layer.layer if isinstance(layer, LayerAlias) else layer
    try:
        config = dict(inner.get_config())
    except Exception as error:  # user code: any failure means "unknown"
        return None, error
    config.pop("name", None)
    return config, None


@register_run_effect
class Stages(RunEffect):
    """Every call in its pipeline stage's scope."""

    name = "stages"
    keys = ("stage",)
    order = 10  # inside Recompute's output checkpoints, around an outlined body

    def active(self):
        # Stages change nothing without devices to place them on.
        devices = self.interpreter.stage_devices
        if devices:
            self.backend.check_stage_devices(devices, f"The model's kip_stage_devices {devices!r}")
        return bool(devices)

    def applies(self, node):
        return True  # a layer without a stage is in stage 0

    def call(self, node, run, args, kwargs, proceed):
        stage = node.annotations.get("stage", 0)
        with self.backend.stage_scope(stage, self.interpreter.stage_devices):
            return proceed(args, kwargs)
