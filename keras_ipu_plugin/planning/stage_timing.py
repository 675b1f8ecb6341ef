"""Timing whole pipeline stages: what `PipelineStages(balance="time")`
checks its plan against.

A stage's time is not the sum of its nodes' times measured alone: run
together, TensorFlow fuses ops across nodes (a convolution with the batch
normalization and ReLU after it) and pays its per-call costs once. On the
gallery ResNet the nodes of a stage, timed alone, summed to 2.5x the
stage's time, and not evenly: its early blocks' nodes came out relatively
cheaper than they run together, so a split balanced on node times measured
1.25 largest / mean for 2 stages. Each stage here runs as one `tf.function`
on random inputs of its recorded shapes at the planning batch: its nodes'
forward pass under a tape, then the backward pass from random output
gradients to its inputs and weights. Weights come in as arguments (through
a `keras.StatelessScope`), so no variable of the user's model is read or
written, as in `node_costs`.

Example:
    ```python
    time_stages(graph, 32, [[(0, 12), (13, 38)]])
    # -> [[0.041, 0.039]]
    ```
"""

import statistics

import keras
import numpy as np
import tensorflow as tf

from keras_ipu_plugin import _compat
from keras_ipu_plugin.planning import node_costs
from keras_ipu_plugin.runtime.interpreter import call_arguments
from keras_ipu_plugin.runtime.interpreter import output_tensors


def time_stages(graph, batch, partitions, repeats=5):
    """For each partition (a list of `(first, last)` node ranges of
    `graph.nodes`), the median seconds of each stage's forward and backward
    pass at `batch` rows. The stages of all partitions are timed in
    interleaved rounds (every stage once per round, after two warm-up
    rounds), so that a busy spell of the machine hits them alike.

    Example:
        ```python
        time_stages(graph, 32, [[(0, 3), (4, 9)], [(0, 4), (5, 9)]])
        # -> [[0.012, 0.013], [0.014, 0.011]]
        ```
    """
    rng = np.random.default_rng(0)
    built = {}
    for partition in partitions:
        for first, last in partition:
            if (first, last) not in built:
                built[(first, last)] = (_stage_function(graph, first, last, batch, rng), [])
    for attempt in range(repeats + 2):
        for (function, arguments), runs in built.values():
            seconds = node_costs._run_once(function, arguments)
            if attempt >= 2:
                runs.append(seconds)
    return [[statistics.median(built[stage][1]) for stage in partition]
            for partition in partitions]


def stage_forward_and_backward(nodes, inputs, weights, trainable, outputs):
    """`f(input_tensors, weight_values, upstream)`: the forward pass of
    `nodes` under a tape on `input_tensors` (for the Values `inputs`) and
    `weight_values` (for the variables `weights`, through a StatelessScope),
    then the backward pass from `upstream` (gradients of the Values
    `outputs`) to the floating inputs and the `trainable` weights (ids).
    Returns the gradients and the outputs, for a caller to wait on."""

    def forward_and_backward(input_tensors, weight_values, upstream):
        tensors = dict(zip(inputs, input_tensors))
        sources = [t for t in input_tensors if node_costs._floating(t.dtype)] + [
            w for v, w in zip(weights, weight_values) if id(v) in trainable]
        with tf.GradientTape() as tape:
            tape.watch(sources)
            with _compat.stateless_scope(list(zip(weights, weight_values)),
                                         collect_losses=True):
                for node in nodes:
                    args, kwargs = call_arguments(node, tensors, node_costs.TRAINING)
                    results = output_tensors(node, node.operation(*args, **kwargs))
                    tensors.update(zip(node.outputs, results))
        ends = [tensors[value] for value in outputs]
        if not sources or not ends:
            return ends or [tf.zeros(())]
        gradients = tape.gradient(ends, sources, output_gradients=list(upstream),
                                  unconnected_gradients=tf.UnconnectedGradients.NONE)
        return [g.values if isinstance(g, tf.IndexedSlices) else g
                for g in gradients if g is not None] + ends

    return forward_and_backward


def _stage_function(graph, first, last, batch, rng):
    """(a traced forward-and-backward of `graph.nodes[first:last + 1]`, its
    random arguments)."""
    nodes = graph.nodes[first:last + 1]
    produced = {id(value) for node in nodes for value in node.outputs}
    inputs, seen = [], set()
    for node in nodes:
        for value in node.input_values:
            if id(value) not in produced and id(value) not in seen:
                seen.add(id(value))
                inputs.append(value)
    read_later = {id(value) for node in graph.nodes[last + 1:] for value in node.input_values}
    read_later |= {id(value) for value in keras.tree.flatten(graph.outputs)}
    outputs = [value for node in nodes for value in node.outputs
               if id(value) in read_later and node_costs._floating(value.spec.dtype)]
    weights, trainable = [], set()
    for node in nodes:
        operation = node.operation
        for variable in getattr(operation, "weights", []):
            if all(variable is not known for known in weights):
                weights.append(variable)
        trainable |= {id(v) for v in getattr(operation, "trainable_weights", [])}

    forward_and_backward = stage_forward_and_backward(nodes, inputs, weights, trainable, outputs)

    specs = (
        [tf.TensorSpec(*node_costs._shape_and_dtype(v.spec, batch)) for v in inputs],
        [tf.TensorSpec(v.shape, v.dtype) for v in weights],
        [tf.TensorSpec(*node_costs._shape_and_dtype(v.spec, batch)) for v in outputs],
    )
    function = tf.function(forward_and_backward, autograph=False).get_concrete_function(*specs)
    arguments = tuple([node_costs._random(spec, rng) for spec in group] for group in specs)
    return function, arguments
