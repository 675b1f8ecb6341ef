"""What the Recompute pass's annotations do when the graph runs.

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
    >>> segments = make_plan(passed, get_backend())
    >>> [segment.recompute for segment in segments]
    [True, False]
"""

from dataclasses import dataclass
from dataclasses import field

import keras
import tensorflow as tf

from keras_ipu_plugin import _compat
from keras_ipu_plugin.ir.graph import Node
from keras_ipu_plugin.layers.layer_kinds import seed_states
from keras_ipu_plugin.layers.layer_kinds import writes_variables
from keras_ipu_plugin.layers.tf_calls.tf_random_draw import draws_statefully
from keras_ipu_plugin.runtime.interpreter import RunEffect
from keras_ipu_plugin.runtime.interpreter import register_run_effect
from keras_ipu_plugin.runtime.graph_of import graph_of
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
        >>> [s.recompute for s in make_plan(passed, get_backend())]
        [True, False, False]
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
        >>> has_forward_state(keras.layers.BatchNormalization())
        True
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
