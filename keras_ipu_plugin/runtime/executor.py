"""Run a `KipFunctional` graph with its annotations taking effect.

The plan is made once per model: nodes in Keras's execution order, grouped
into recompute segments (portable backend) that end at each checkpointed
layer. Layers that carry other state updated in the forward pass (moving
statistics) never sit inside a segment: recomputing them would update that
state twice, silently changing results. The seeds of random draws (Dropout)
may: a segment reads its seed states once, in the forward pass, with its
weights, so the recomputation draws the very same numbers, and writes the
advanced seeds back once.

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
"""

import inspect
from dataclasses import dataclass
from dataclasses import field

import keras
import tensorflow as tf

from keras_ipu_plugin import _compat
from keras_ipu_plugin.runtime.distribution import strategy_owning
from keras_ipu_plugin.runtime.variables import union_of_variables
from keras_ipu_plugin.runtime.layer_kinds import seed_states
from keras_ipu_plugin.runtime.layer_kinds import training_agnostic
from keras_ipu_plugin.runtime.layer_kinds import writes_variables
from keras_ipu_plugin.runtime.variable_write import is_write_node


@dataclass
class Segment:
    """Nodes run together; `recompute` segments run under the backend's
    checkpointing. `inputs` / `outputs` are KerasTensor ids crossing it."""

    nodes: list
    recompute: bool = False
    inputs: list = field(default_factory=list)
    outputs: list = field(default_factory=list)
    variables: list = field(default_factory=list)


def make_plan(model, backend):
    nodes = _compat.functional_nodes(model)
    checkpoints = {
        name for name, notes in model.kip_annotations.items() if notes.get("recompute")
    }
    segments, current = [], []
    for node in nodes:
        notes = model.kip_annotations.get(getattr(node.operation, "name", None), {})
        if (not backend.recomputes_segments or _has_forward_state(node.operation)
                or notes.get("remat") == "keep"):
            if current:
                segments.append(Segment(current, recompute=False))
                current = []
            segments.append(Segment([node]))
            continue
        current.append(node)
        if getattr(node.operation, "name", None) in checkpoints:
            segments.append(Segment(current, recompute=True))
            current = []
    if current:
        segments.append(Segment(current))
    _keep_last_segment(segments)
    _wire(segments, model)
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
        for tensor in _compat.node_outputs(node):
            size = 1
            for dim in tensor.shape[1:]:
                size *= dim or 1
            total += size
    return total


def _has_forward_state(operation):
    """Whether the layer updates state in its forward pass that a
    recomputation could not replay: anything but its random seeds (a
    non-trainable variable, or any variable its `call` was seen writing:
    PixelCNN's masked kernel)."""
    if not isinstance(operation, keras.layers.Layer):
        return False
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


def _wire(segments, model):
    """Fill each segment's crossing tensors (ids of KerasTensors)."""
    output_ids = {id(t) for t in model.outputs}
    later_needs = set(output_ids)
    for segment in reversed(segments):
        produced = {
            id(t) for node in segment.nodes for t in _compat.node_outputs(node)
        }
        needed = []
        for node in segment.nodes:
            for tensor_id in _compat.node_input_ids(node):
                if tensor_id not in produced and tensor_id not in needed:
                    needed.append(tensor_id)
        segment.outputs = [
            id(t) for node in segment.nodes
            for t in _compat.node_outputs(node) if id(t) in later_needs
        ]
        segment.inputs = needed
        segment.variables = _variables_of(segment.nodes) if segment.recompute else []
        later_needs |= set(needed)


def split_plan(segments, model, part_of):
    """`segments` cut where `part_of(node)` (an int) changes, regrouped by
    part (each part's pieces in plan order, parts ascending) and wired
    again: `[(part, [Segment])]`. A recomputed segment cut in two is two
    recomputed segments. The pipeline runs each part (a stage) alone.

    Example:
        >>> split_plan(executor.segments, model, lambda node: stage_of(model, node))
        [(0, [Segment(...), ...]), (1, [...])]
    """
    pieces = []
    for segment in segments:
        run = []
        for node in segment.nodes:
            if run and part_of(node) != part_of(run[-1]):
                pieces.append(Segment(run, recompute=segment.recompute))
                run = []
            run.append(node)
        if run:
            pieces.append(Segment(run, recompute=segment.recompute))
    parts = sorted({part_of(piece.nodes[0]) for piece in pieces})
    grouped = [(part, [p for p in pieces if part_of(p.nodes[0]) == part]) for part in parts]
    _wire([piece for _, part_pieces in grouped for piece in part_pieces], model)
    return grouped


def _variables_of(nodes):
    """The Keras variables of the layers run by `nodes`, each once."""
    return union_of_variables(
        [v for node in nodes for v in getattr(node.operation, "variables", [])], []
    )


class Executor:
    """Runs one model's plan; made lazily by `KipFunctional`."""

    def __init__(self, model, backend):
        self.model = model
        self.backend = backend
        self.segments = make_plan(model, backend)
        self.outlined = {}  # key -> shared function
        self.inside = {}  # id(node) -> its own Segment (the remat="inside" note)

    def __call__(self, inputs, training, context):
        tensors = {
            id(x): y for x, y in zip(self.model.inputs, keras.tree.flatten(inputs))
        }
        self.run_segments(self.segments, tensors, training, context)
        outputs = [tensors[id(t)] for t in self.model.outputs]
        return keras.tree.pack_sequence_as(_compat.output_structure(self.model), outputs)

    def run_segments(self, segments, tensors, training, context):
        """Run `segments` (this plan's, or a part of `split_plan`'s) on
        `tensors` (KerasTensor id -> value), adding what they produce: the
        pipeline (`runtime/pipeline.py`) runs one stage at a time this way."""
        for segment in segments:
            if segment.recompute:
                self._run_recomputed(segment, tensors, training, context)
            else:
                self._run_nodes(segment.nodes, tensors, training, context)

    def _run_recomputed(self, segment, tensors, training, context, inside=False):
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
        masks_out = []  # ids of the outputs that carry a mask, in order

        def body(*flat):
            local = dict(zip(segment.inputs, flat[:count]))
            weights = len(segment.variables)
            state = list(zip(segment.variables, flat[count:count + weights]))
            for i, mask in zip(masked, flat[count + weights:]):
                local[i] = tf.identity(local[i])
                _compat.set_keras_mask(local[i], mask)
            owners = []
            # Losses added inside (activity regularizers) become outputs of
            # the segment, so that they get gradients too.
            with _compat.stateless_scope(state, collect_losses=True) as scope:
                given = {id(v): scope.get_current_value(v) for v in segment.variables}
                for node in segment.nodes:
                    before = len(scope.losses)
                    self._run_nodes([node], local, training, context, inside=inside)
                    owners += [node.operation] * (len(scope.losses) - before)
                    _refuse_writes_in_segment(node, segment.variables, given, scope)
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

    def _run_inside(self, node, tensors, training, context):
        """Run `node` under its own checkpoint (the `remat="inside"` note):
        its outputs are kept, its internal tensors recomputed."""
        segment = self.inside.get(id(node))
        if segment is None:
            segment = Segment([node], recompute=True)
            segment.inputs = list(dict.fromkeys(_compat.node_input_ids(node)))
            segment.outputs = [id(t) for t in _compat.node_outputs(node)]
            segment.variables = _variables_of([node])
            self.inside[id(node)] = segment
        self._run_recomputed(segment, tensors, training, context, inside=True)

    def _run_nodes(self, nodes, tensors, training, context, inside=False):
        for node in nodes:
            operation = node.operation
            name = getattr(operation, "name", None)
            notes = self.model.kip_annotations.get(name, {})
            if (not inside and notes.get("remat") == "inside"
                    and self.backend.recomputes_segments
                    and not _has_forward_state(operation)):
                self._run_inside(node, tensors, training, context)
                continue
            args, kwargs = _compat.node_fill_in(node, tensors)
            if isinstance(operation, keras.layers.Layer):
                accepted = _compat.call_context_args(operation)
                for key, value in context.items():
                    if value is None or key not in accepted:
                        continue
                    if key == "training" and name in self.model.kip_pinned_training:
                        continue
                    kwargs[key] = value
            with self.backend.stage_scope(notes.get("stage", 0), self.model.kip_stage_devices):
                # A write node runs as itself: an outlined body runs on the
                # weights passed in, in a stateless scope that would keep the write.
                if ("outline" in notes and isinstance(operation, keras.layers.Layer)
                        and not is_write_node(getattr(operation, "aliased_layer", operation))):
                    outputs = self._outlined_call(
                        node, notes["outline"], args, kwargs, context.get("training")
                    )
                else:
                    outputs = operation(*args, **kwargs)
            flat = keras.tree.flatten(outputs)
            if not self.backend.recomputes_segments and notes.get("recompute"):
                kept = self.backend.checkpoint_outputs(flat)
                for before, after in zip(flat, kept):  # a checkpoint's copies keep masks
                    if _compat.keras_mask(before) is not None:
                        _compat.set_keras_mask(after, _compat.keras_mask(before))
                flat = kept
                outputs = keras.tree.pack_sequence_as(outputs, flat)
            for tensor, value in zip(_compat.node_outputs(node), flat):
                tensors[id(tensor)] = value

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
        shared = self.outlined.get(key)
        if shared is None:
            body = _shared_body(layer, static_kwargs, self.model, training)
            shared = self.backend.outline(body, **outline_kwargs)
            self.outlined[key] = shared
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
        with _compat.stateless_scope(mapping, collect_losses=True) as scope:
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
        (tuple(t.shape), t.dtype) for t in _compat.node_input_tensors(node)
    )
    return (type(layer), config, signature, repr(sorted(kwargs.items())))


def outline_config(layer):
    """`(config, None)`: what must be equal for two layers of one class to
    share an outlined body (the config but the name); `(None, error)` when
    the layer's own `get_config` fails (keras_hub 0.32's
    `LlamaTransformerDecoder` reads an attribute it never sets): nothing
    then shows two such layers equal, so the layer is outlined alone.

    Example:
        >>> outline_config(keras.layers.Dense(3, name="a"))[0]["units"]
        3
    """
    from keras_ipu_plugin.runtime.alias import LayerAlias

    inner = layer.layer if isinstance(layer, LayerAlias) else layer
    try:
        config = dict(inner.get_config())
    except Exception as error:  # user code: any failure means "unknown"
        return None, error
    config.pop("name", None)
    return config, None


def train_graph_ops(model):
    """Number of ops in a traced training step of `model` (forward pass in
    training mode and the gradients of its outputs): what outlining shrinks.

    Example:
        >>> train_graph_ops(passed)
        144
    """
    specs = keras.tree.map_structure(
        lambda tensor: tf.TensorSpec(tensor.shape, tensor.dtype), model.input
    )

    strategy = strategy_owning(model.trainable_variables)

    def one_replica(inputs):
        with tf.GradientTape() as tape:
            outputs = model(inputs, training=True)
            loss = tf.add_n([
                tf.reduce_sum(tf.cast(output, "float32"))
                for output in keras.tree.flatten(outputs)
                if output.dtype.is_floating
            ])
        return tape.gradient(loss, model.trainable_variables)

    @tf.function(autograph=False)
    def step(inputs):
        # Mirrored variables can only be read inside a replica.
        return strategy.run(one_replica, args=(inputs,))

    return len(step.get_concrete_function(specs).graph.get_operations())
