"""What each node of the graph costs: memory its backward pass keeps, forward
FLOPs, parameters, and (on request) measured time. The planning passes
(`Recompute(auto=True)`, `PipelineStages(num_stages=...)`) plan from these.

A node is profiled by tracing it alone, on its recorded input shapes with
the first batch's size (per replica), forward and backward, in a
`tf.function` that is never run: the forward tensors that the backward ops
read are what it keeps for the backward pass. Its weights come in as
arguments (through a `keras.StatelessScope`), so no variable of the user's
model is read or written and no strategy is involved. Identical layers on
identical inputs (the blocks of a tower) are traced once.

Example:
    ```python
    profiles = profile_nodes(graph, batch=64)
    profiles[0].kept_bytes, profiles[0].flops
    # -> (262144, 1.6e7)
    ```
"""

import re
import statistics
import time
from dataclasses import dataclass
from dataclasses import field

import keras
import numpy as np
import tensorflow as tf

from keras_ipu_plugin import _compat
from keras_ipu_plugin.runtime.variables import strategy_owning
from keras_ipu_plugin.runtime.interpreter import call_arguments
from keras_ipu_plugin.runtime.interpreter import output_tensors
from keras_ipu_plugin.ir.graph import FOLLOW
from keras_ipu_plugin.ir.graph import map_values
from keras_ipu_plugin.layers.layer_kinds import note_writes_variables
from keras_ipu_plugin.layers.layer_kinds import seed_states


@dataclass
class NodeProfile:
    """One node's costs. Bytes at the planning batch; `kept_inputs[k]` is the
    bytes of input value k (`node.input_values[k]`) its backward keeps."""

    node: object
    internal: int = 0  # kept intermediates: neither its inputs nor its outputs
    kept_output: int = 0
    kept_inputs: list = field(default_factory=list)
    flops: float = 0.0
    output_bytes: int = 0
    output_elements: int = 0  # per example, as the executor counts them
    params: int = 0  # weights of its layer, counted at its first node
    grad_bytes: int = 0  # gradients of its trainable weights, at its first node
    weight_bytes: int = 0  # all its layer's weights, at its first node
    backward_bytes: int = 0  # the most its backward's temporaries hold at once
    fixed: bool = False  # forward state: never recomputed
    writes: bool = False  # its run writes a variable other than a seed state
    note: str = ""  # why the figures are only shape estimates, when they are
    key: object = None  # equal keys: identical layer on identical inputs
    #: the same figures with its activation recomputed from its kept
    #: pre-activation (`activation_remat`), for a Dense that may be split
    split: "SplitProfile | None" = None

    @property
    def kept_bytes(self):
        """All it keeps for the backward pass, inputs and outputs included."""
        return self.internal + self.kept_output + sum(self.kept_inputs)


@dataclass(frozen=True)
class SplitProfile:
    """What a Dense keeps when its activation is recomputed from its kept
    pre-activation (the `activation_remat` note), traced as it runs so: its
    kept intermediates and outputs, its backward's working memory, and the
    FLOPs its backward recomputes (the activation's)."""

    internal: int
    kept_output: int
    kept_inputs: tuple
    backward_bytes: int
    recompute_flops: float

    @property
    def kept_bytes(self):
        return self.internal + self.kept_output + sum(self.kept_inputs)


# -- the batch and the order ----------------------------------------------------------
def first_batch_rows(model, input_specs):
    """The per-replica batch the planning passes plan for: a static batch
    dimension where the graph has one, else the rows of the first batch
    `convert_to_functional` kept, divided among the replicas of the strategy
    that owns the model's variables. None when neither is known."""
    static = [spec.batch_size for spec in keras.tree.flatten(input_specs)
              if getattr(spec, "batch_size", None)]
    if static:
        return int(static[0])
    x = getattr(model, "kip_first_batch", None)
    if x is None:
        return None
    leaves = keras.tree.flatten(x)
    if not leaves or not getattr(leaves[0], "shape", None):
        return None
    rows = int(leaves[0].shape[0])
    replicas = strategy_owning(model.variables).num_replicas_in_sync
    return max(1, -(-rows // replicas))


# -- profiling ----------------------------------------------------------------------
def profile_nodes(graph, batch):
    """A `NodeProfile` per node of `graph` (in graph order), at `batch` rows."""
    traced = {}
    profiles, counted = [], set()
    for node in graph.nodes:
        profile = _profile(node, batch, traced)
        operation = node.operation
        if profile.writes and isinstance(operation, keras.layers.Layer):
            note_writes_variables(operation)  # the executor keeps it out of segments too
        if isinstance(operation, keras.layers.Layer) and id(operation) not in counted:
            counted.add(id(operation))
            profile.params = int(sum(np.prod(v.shape) for v in operation.weights))
            profile.grad_bytes = int(sum(
                np.prod(v.shape) * _itemsize(v.dtype) for v in operation.trainable_weights))
            profile.weight_bytes = int(sum(
                np.prod(v.shape) * _itemsize(v.dtype) for v in operation.weights))
        profile.fixed = _has_forward_state(operation)
        if not profile.fixed and not profile.note:
            profile.split = _split_profile(node, batch, profile.key, traced)
        profiles.append(profile)
    return profiles


def _split_profile(node, batch, key, traced):
    """The node's `SplitProfile` when its layer may run split (see
    `effects.splittable`), else None; traced once per key."""
    from keras_ipu_plugin.runtime import effects
    from keras_ipu_plugin.runtime.backends import recompute_grad

    if not effects.splittable(node.operation) or len(node.input_values) != 1:
        return None
    split_key = None if key is None else (key, "split")
    if split_key is not None and split_key in traced:
        return traced[split_key]
    operation = node.operation

    def split(x, training=None):  # Dense ignores `training`
        return effects.split_call(operation, x, recompute_grad)

    try:
        result = _trace(node, batch, call=split)
        layer = getattr(operation, "aliased_layer", operation)
        spec = tf.TensorSpec(*_shape_and_dtype(node.outputs[0].spec, batch))
        activation = tf.function(lambda z: layer.activation(z), autograph=False)
        graph = activation.get_concrete_function(spec).graph
        flops = sum(_op_flops(op) for op in graph.get_operations() if op.type != "Placeholder")
        found = SplitProfile(result.internal, result.kept_output, tuple(result.kept_inputs),
                             result.backward_bytes, float(flops))
    except Exception:  # noqa: BLE001 - not traced split: planned as it runs unsplit
        found = None
    if split_key is not None:
        traced[split_key] = found
    return found


def _has_forward_state(operation):
    from keras_ipu_plugin.runtime.effects import has_forward_state as executor_rule

    return executor_rule(operation)


def _profile(node, batch, traced):
    outputs = [_shape_and_dtype(value.spec, batch) for value in node.outputs]
    output_bytes = sum(_bytes(shape, dtype) for shape, dtype in outputs)
    elements = sum(_elements_per_example(value.spec) for value in node.outputs)
    key = _trace_key(node, batch)
    if key is None or key not in traced:
        try:
            result = _trace(node, batch)
        except Exception as error:  # noqa: BLE001 - user layers may fail anywhere
            result = _ShapeEstimate(node, batch, f"{type(error).__name__}: {error}")
        if key is not None:
            traced[key] = result
    else:
        result = traced[key]
    return NodeProfile(
        node=node, internal=result.internal, kept_output=result.kept_output,
        writes=getattr(result, "writes", False),
        kept_inputs=list(result.kept_inputs), flops=result.flops,
        backward_bytes=result.backward_bytes,
        output_bytes=output_bytes, output_elements=elements, note=result.note, key=key,
    )


@dataclass
class _Traced:
    internal: int
    kept_output: int
    kept_inputs: list
    flops: float
    note: str
    function: object = None  # the concrete function (for timing)
    specs: tuple = ()
    backward_bytes: int = 0
    writes: bool = False  # the node's run writes a variable (not a seed)


def _ShapeEstimate(node, batch, reason):
    """What a node keeps when it cannot be traced alone: its inputs, as most
    layers do (no intermediates known), and its output size as FLOPs."""
    inputs = [_bytes(*_shape_and_dtype(v.spec, batch)) for v in node.input_values]
    flops = sum(int(np.prod(_shape_and_dtype(v.spec, batch)[0])) for v in node.outputs)
    return _Traced(0, 0, inputs, float(flops), f"estimated from shapes ({reason})")


def _trace_key(node, batch):
    """Nodes with equal keys keep and cost the same: same layer class and
    config (its name aside), same input signature and call arguments."""
    from keras_ipu_plugin.runtime.effects import outline_config

    operation = node.operation
    if not isinstance(operation, keras.layers.Layer):
        return None
    config, _ = outline_config(operation)
    if config is None:
        return None
    signature = tuple(
        (_shape_and_dtype(value.spec, batch)) for value in node.input_values)
    static = map_values(lambda value: "tensor", (node.args, node.kwargs))
    try:
        return (type(operation), repr(sorted(config.items())), signature,
                repr(static), node.training)
    except Exception:  # noqa: BLE001 - an unprintable config: trace it alone
        return None


#: The call context a node is measured in: a training step's.
TRAINING = {"training": True}


def _trace(node, batch, call=None):
    """The node traced forward and backward alone; `call`: what runs
    instead of its operation (the same arguments), when given."""
    operation = node.operation
    run = operation if call is None else call
    values = node.input_values
    weights = list(operation.weights) if isinstance(operation, keras.layers.Layer) else []
    trainable = {id(v) for v in getattr(operation, "trainable_weights", [])}
    input_specs = [tf.TensorSpec(*_shape_and_dtype(v.spec, batch)) for v in values]
    weight_specs = [tf.TensorSpec(v.shape, v.dtype) for v in weights]
    float_outputs = [v for v in node.outputs if _floating(v.spec.dtype)]
    upstream_specs = [tf.TensorSpec(*_shape_and_dtype(v.spec, batch)) for v in float_outputs]
    seen = {}
    seeds = {id(state) for state in seed_states(operation)} if isinstance(
        operation, keras.layers.Layer) else set()

    def forward_and_backward(inputs, weight_values, upstream):
        tensors = dict(zip(values, inputs))
        sources = [x for x in inputs if _floating(x.dtype)] + [
            w for v, w in zip(weights, weight_values) if id(v) in trainable]
        with tf.GradientTape() as tape:
            tape.watch(sources)
            with _compat.stateless_scope(list(zip(weights, weight_values)),
                                                  collect_losses=True) as scope:
                args, kwargs = call_arguments(node, tensors, TRAINING)
                outputs = output_tensors(node, run(*args, **kwargs))
                # A write the node's own run makes (a block whose sub-layer
                # masks its kernel, which a conversion's trace kept as one
                # node): a recomputation could not replay it.
                seen["writes"] = any(
                    id(v) not in seeds and scope.get_current_value(v) is not w
                    for v, w in zip(weights, weight_values))
        graph = tf.compat.v1.get_default_graph()
        seen.update(first_backward=len(graph.get_operations()), inputs=list(inputs),
                    weights=list(weight_values), upstream=list(upstream), outputs=outputs)
        floats = [o for o in outputs if _floating(o.dtype)]
        if not sources or not floats:
            return []
        gradients = tape.gradient(floats, sources, output_gradients=list(upstream)[:len(floats)],
                                  unconnected_gradients=tf.UnconnectedGradients.NONE)
        return [g.values if isinstance(g, tf.IndexedSlices) else g
                for g in gradients if g is not None]

    function = tf.function(forward_and_backward, autograph=False)
    concrete = function.get_concrete_function(input_specs, weight_specs, upstream_specs)
    kept_inputs, kept_output, internal, flops = _read_trace(concrete.graph, seen)
    return _Traced(internal, kept_output, kept_inputs, flops, "", concrete,
                   (input_specs, weight_specs, upstream_specs),
                   _backward_peak(concrete.graph, seen["first_backward"]),
                   writes=seen.get("writes", False))


def _read_trace(graph, seen):
    """(bytes kept per input, kept outputs, kept intermediates, forward
    FLOPs) from a traced forward-and-backward graph."""
    operations = graph.get_operations()
    forward = operations[:seen["first_backward"]]
    forward_set = set(forward)
    inputs = {t.ref(): k for k, t in enumerate(seen["inputs"])}
    outputs = {t.ref() for t in seen["outputs"]}
    weights = {t.ref() for t in seen["weights"]}
    upstream = {t.ref() for t in seen["upstream"]}
    kept = {}
    for op in operations[seen["first_backward"]:]:
        for tensor in op.inputs:
            if tensor.op in forward_set and tensor.ref() not in weights | upstream:
                kept[tensor.ref()] = tensor
    kept_inputs = [0] * len(seen["inputs"])
    kept_output = internal = 0
    for ref, tensor in kept.items():
        if tensor.dtype in (tf.resource, tf.variant) or _from_weights_only(tensor, weights):
            continue
        size = _bytes(tensor.shape, tensor.dtype)
        if ref in inputs:
            kept_inputs[inputs[ref]] = size
        elif ref in outputs:
            kept_output += size
        else:
            internal += size
    flops = sum(_op_flops(op) for op in forward if op.type != "Placeholder")
    return kept_inputs, kept_output, internal, float(flops)


def _backward_peak(graph, first_backward):
    """The most bytes the backward ops' own results hold at once, run in
    graph order, each freed after its last reader: the working memory of a
    node's backward beyond what its forward kept. An attention layer's
    backward holds gradients of its (batch, heads, query, key) scores; left
    out, planned segments around it measured half as much again as
    estimated on the gallery transformer."""
    operations = graph.get_operations()[first_backward:]
    last_read = {}
    for index, op in enumerate(operations):
        for tensor in op.inputs:
            last_read[tensor.ref()] = index
    live, peak, frees = 0, 0, {}
    for index, op in enumerate(operations):
        for tensor in op.outputs:
            # Results no backward op reads are the gradients it returns,
            # counted already (its weight gradients, the next node's
            # incoming gradient); aliases hold no memory of their own.
            if (tensor.ref() not in last_read or op.type in _ALIASES
                    or tensor.dtype in (tf.resource, tf.variant)):
                continue
            size = _bytes(tensor.shape, tensor.dtype)
            live += size
            frees.setdefault(last_read[tensor.ref()], []).append(size)
        peak = max(peak, live)
        live -= sum(frees.pop(index, []))
    return peak


_ALIASES = {"Identity", "IdentityN", "Reshape", "Squeeze", "ExpandDims", "StopGradient",
            "Shape", "ShapeN", "Const"}


def _from_weights_only(tensor, weights):
    """A weight read or cast (a copy of a weight, not an activation)."""
    if tensor.ref() in weights:
        return True
    return bool(tensor.op.inputs) and all(
        t.ref() in weights or _from_weights_only(t, weights) for t in tensor.op.inputs)


_NO_FLOPS = {"Const", "Placeholder", "Identity", "IdentityN", "Shape", "ShapeN", "Size", "Rank",
             "ReadVariableOp", "NoOp", "StopGradient", "Reshape", "Squeeze", "ExpandDims"}


def _op_flops(op):
    """Forward FLOPs of one op: multiply-adds for contractions, one per
    output element for the rest (a proxy for memory-bound ops)."""
    if op.type in _NO_FLOPS:
        return 0
    out = sum(_known_elements(t.shape) for t in op.outputs)
    try:
        if op.type == "MatMul":
            a = op.inputs[0].shape
            depth = a[-2] if op.get_attr("transpose_a") else a[-1]
            return 2 * out * (depth or 1)
        if op.type.startswith("BatchMatMul"):
            a = op.inputs[0].shape
            depth = a[-2] if op.get_attr("adj_x") else a[-1]
            return 2 * out * (depth or 1)
        if op.type in ("Conv2D", "Conv3D"):
            return 2 * out * _known_elements(op.inputs[1].shape[:-1])
        if op.type == "DepthwiseConv2dNative":
            return 2 * out * _known_elements(op.inputs[1].shape[:2])
        if op.type == "Einsum":
            return 2 * _einsum_size(op)
    except (ValueError, TypeError, IndexError):
        pass
    return out


def _einsum_size(op):
    """The product of every index's size in an einsum (its multiply-adds)."""
    equation = op.get_attr("equation")
    equation = equation.decode() if isinstance(equation, bytes) else equation
    operands = equation.split("->")[0].split(",")
    sizes = {}
    for letters, tensor in zip(operands, op.inputs):
        letters = re.sub(r"\.\.\.", "", letters)
        dims = tensor.shape.as_list()
        for letter, dim in zip(letters[::-1], dims[::-1]):
            sizes[letter] = dim or 1
    size = 1
    for dim in sizes.values():
        size *= dim
    return size


# -- timing -----------------------------------------------------------------------------
def time_nodes(graph, batch, repeats=5, profiles=None):
    """The median seconds of each node's forward and backward pass (in graph
    order), run alone on random data of its recorded shapes at `batch` rows,
    less the cost of calling an empty function; None for a node that cannot
    run alone. Identical layers on identical inputs are timed once.

    The nodes are timed in interleaved rounds (every node once per round,
    after two warm-up rounds): timed one after the other, a node that ran
    while the machine was busy came out several times slower than its
    neighbours, and the stages balanced on it were not balanced.

    Example:
        ```python
        time_nodes(graph, batch=32)[:2]
        # -> [0.00121, 0.00034]
        ```
    """
    runnable, keys = {}, []
    rng = np.random.default_rng(0)
    for index, node in enumerate(graph.nodes):
        key = profiles[index].key if profiles else _trace_key(node, batch)
        key = key if key is not None else ("node", index)
        keys.append(key)
        if key in runnable:
            continue
        try:
            traced = _trace(node, batch)
            if traced.function is None:
                raise ValueError("not traced")
            arguments = tuple([_random(spec, rng) for spec in specs] for specs in traced.specs)
            _run_once(traced.function, arguments)  # fails here if it cannot run alone
            runnable[key] = (traced.function, arguments, [])
        except Exception:  # noqa: BLE001 - a node that cannot run alone
            runnable[key] = None
    overhead = _call_overhead(repeats)
    timed = [entry for entry in runnable.values() if entry is not None]
    for attempt in range(repeats + 1):  # one more warm-up round (one ran above)
        for function, arguments, runs in timed:
            seconds = _run_once(function, arguments)
            if attempt >= 1:
                runs.append(seconds)
    return [None if runnable[key] is None
            else max(0.0, statistics.median(runnable[key][2]) - overhead) for key in keys]


def _run_once(function, arguments):
    start = time.perf_counter()
    for result in function(*arguments):
        result.numpy()  # wait for it
    return time.perf_counter() - start


def _call_overhead(repeats):
    function = tf.function(lambda x: [x * 1.0], autograph=False).get_concrete_function(
        tf.TensorSpec((1,), tf.float32))
    x = tf.zeros((1,))
    runs = []
    for attempt in range(repeats * 4 + 2):
        start = time.perf_counter()
        function(x)[0].numpy()
        if attempt >= 2:
            runs.append(time.perf_counter() - start)
    return statistics.median(runs)


def _random(spec, rng):
    shape = [dim or 1 for dim in spec.shape]
    dtype = spec.dtype
    if dtype.is_floating or dtype.is_complex:
        return tf.constant(rng.normal(size=shape) * 0.1, dtype=dtype)
    if dtype == tf.string:
        return tf.fill(shape, "")
    return tf.zeros(shape, dtype)  # integers: index 0 is valid for any table


# -- sizes -------------------------------------------------------------------------------
def _shape_and_dtype(spec, batch):
    """The static shape of a value at `batch` rows (a leading unknown
    dimension is the batch; other unknown dimensions count as 1)."""
    shape = list(spec.shape)
    if shape and shape[0] is None:
        shape[0] = batch
    return tuple(dim if dim is not None else 1 for dim in shape), tf.as_dtype(spec.dtype)


def value_bytes(value, batch):
    """Bytes of graph value `value` at `batch` rows."""
    return _bytes(*_shape_and_dtype(value.spec, batch))


def variable_bytes(variable):
    """Bytes of a Keras variable's value."""
    return int(np.prod(variable.shape)) * _itemsize(variable.dtype)


def _elements_per_example(spec):
    """As `executor._activation_size` counts them (unknown dims as 1)."""
    size = 1
    for dim in tuple(spec.shape)[1:]:
        size *= dim or 1
    return size


def _known_elements(shape):
    try:
        dims = tf.TensorShape(shape).as_list()
    except ValueError:
        return 0
    size = 1
    for dim in dims:
        size *= dim or 1
    return size


def _bytes(shape, dtype):
    return _known_elements(shape) * _itemsize(dtype)


def _itemsize(dtype):
    dtype = tf.as_dtype(dtype)
    if dtype in (tf.string, tf.resource, tf.variant):
        return 0
    return dtype.size


def _floating(dtype):
    dtype = tf.as_dtype(dtype)
    return dtype.is_floating or dtype.is_complex
