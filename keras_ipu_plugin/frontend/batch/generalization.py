"""Batch generalisation: one graph for any batch size from two traces of a
call made at two batch sizes (what the tracer does where a call computes
with the batch size, `ops.shape(x)[0]`). One concept, in one module: the
two traces made one graph, node for node, and the `ModeSwitch`es among
them (a call branching on `training` in Python) made one, mode for mode.

A dimension that is the one batch size in one trace and the other in the
other becomes unknown, in output shapes and in operations' shape attributes
(the operation becomes a `layers.batch_sized.BatchSizedOperation`, which
reads the batch size from a graph tensor when the graph runs). A constant
the call made from the batch size is one row repeated along the batch (a
causal mask broadcast to it) or a range along it (`ops.arange(b) * seq_len`,
keras_hub's Gemma 3), made in the graph from the batch size when it runs;
anything else that differs raises `NotBatchGeneral`, with the reason.

keras_hub's Mixtral MoE block adds its load-balancing loss in training
only (`if training:`, a `ModeSwitch` holding a graph per mode,
`trace/training_modes.py`), and recovers the batch size there as
`ops.shape(router_logits)[0] // seq_len`: each of its two traces holds a
switch of its own, and the two are one where each mode's two graphs are
one graph for any batch size (`general_switch`).

Example:
    ```python
    nodes, outputs = generalize_batch((nodes_2, outputs_2), (nodes_3, outputs_3),
                                      (2, 3), anchor)
    ```
"""


from fractions import Fraction

import keras
import numpy as np

from keras_ipu_plugin import _compat
from keras_ipu_plugin.frontend.batch.shapes import check_batch_dimensions
from keras_ipu_plugin.frontend.trace.failures import TraceError
from keras_ipu_plugin.frontend.trace.training_modes import with_branch_nodes
from keras_ipu_plugin.frontend.trace.training_modes import node_identity
from keras_ipu_plugin.ir.graph import Graph
from keras_ipu_plugin.ir.graph import Node
from keras_ipu_plugin.ir.graph import Value
from keras_ipu_plugin.ir.graph import InputSpec
from keras_ipu_plugin.layers.keras_ops.batch_sized import BatchSizedOperation
from keras_ipu_plugin.layers.state import HeldConstant
from keras_ipu_plugin.runtime.mode_switch import ModeSwitch


class NotBatchGeneral(Exception):
    """Two traces at different batch sizes differ other than by it."""


class MixedLeadingSizes(NotBatchGeneral):
    """An operation holds the leading sizes of two inputs whose leading
    dimensions are independent of each other: no one graph tensor gives
    both when the graph runs."""


def same_operation(node_a, node_b):
    """Whether two traces called the same thing at these nodes (opaque ones
    are kept out: their recorded output shapes hold a trial batch size)."""
    return node_a.opaque_reason is None and node_identity(node_a) == node_identity(node_b)


def generalize_batch(small, large, batch_sizes, anchor, prefix="",
                     groups=None, known=None):
    """One graph for any batch size from two traces of the same call, made
    with its inputs' batch size set to `batch_sizes = (s, l)`.

    `groups`: for inputs whose leading sizes are independent of each other
    (a graph's node features and its edge list), `[(anchor, (s, l))]`, one
    per input, each traced at sizes of its own; then `batch_sizes` and
    `anchor` are unused. Each dimension is then matched to the one input
    whose sizes it follows (their ratios differ, so no dimension follows
    two), and an operation reads it from that input's Value; an operation
    holding the sizes of two inputs, or a size that is one plus a constant,
    raises `NotBatchGeneral`.

    `small` / `large`: `(nodes, outputs)` of the two traces. They must match
    node for node (`same_operation(a, b)`), and differ only where the batch
    size was: a dimension that is `s` in one and `l` in the other becomes
    unknown (None) in output shapes and in operations' shape attributes
    (the operation becomes a `BatchSizedOperation` reading it from the
    `anchor` Value); a constant that differs only by its batch dimensions,
    and is the same slice repeated along them (a causal mask broadcast to
    the batch), becomes that slice broadcast to the batch in the graph.
    Anything else raises `NotBatchGeneral`: the call computes with the batch
    size in a way one graph cannot follow.

    A `ModeSwitch` in both (a call branching on `training` in Python) is
    made one of its modes' graphs, each generalized so
    (`general_switch`). `known`: {id(Value of the large trace): Value of
    the small one} for the inputs the two traces read apart (a switch's
    graphs').

    Returns `(nodes, outputs)` of `small`, generalized (its Nodes are
    reused; new ones are named `prefix + ...`).
    """
    (nodes_s, outputs_s), (nodes_l, outputs_l) = small, large
    if groups is None:
        groups = [(anchor, tuple(batch_sizes))]
    anchors = [group_anchor for group_anchor, _ in groups]
    batch_sizes = [tuple(sizes) for _, sizes in groups]

    def anchor_for(used, name):
        """The Value whose leading size the dimensions `used` (group
        indices) follow."""
        if len(used) > 1:
            raise MixedLeadingSizes(
                f"`{name}` holds the leading sizes of {len(used)} inputs whose leading "
                "dimensions are independent of each other, which no one graph tensor "
                "gives when the graph runs; compute it from one input's size, or pass "
                "static_batch=True to trace with the first batch's sizes")
        return anchors[next(iter(used))] if used else anchors[0]
    if len(nodes_s) != len(nodes_l):
        raise NotBatchGeneral("the two traces call different layers")
    value_of = dict(known or {})  # id(Value of the large trace) -> Value of the small one
    result = []

    def held_node(value, name, anchor, progression=False):
        """A node holding the array `value` (`HeldConstant`); its Value.
        `progression`: the start or step of a range over the batch
        (`progression_signature`)."""
        held = HeldConstant(value, name=name)
        node = Node(held.name, held, (anchor,), {}, output_structure=None)
        if progression:
            node.meta["batch_progression"] = True
        node.outputs = [Value(node, 0, keras.KerasTensor(value.shape, dtype=str(value.dtype)))]
        result.append(node)
        return node.outputs[0]

    def operation_node(operation, name, args, shape, dtype):
        """A node calling `operation` on `args`; its Value, of `shape`."""
        node = Node(name, operation, tuple(args), {}, output_structure=None)
        node.outputs = [Value(node, 0, keras.KerasTensor(_with_none(shape), dtype=dtype))]
        result.append(node)
        return node.outputs[0]

    def broadcast_node(constant, node_name):
        """Nodes making `constant` (a broadcast of one slice along its batch
        dimensions, or a range along one: `_BatchProgression`) in the graph;
        returns the Value of the broadcast."""
        base = node_name[len(prefix):] if node_name.startswith(prefix) else node_name
        anchor = anchor_for(constant.groups, node_name)
        if isinstance(constant, _BatchProgression):
            return progression_node(constant, base, anchor)
        held = held_node(constant.slice, f"{prefix}{base}_slice", anchor)
        return operation_node(_batch_sized_broadcast(constant.shape, f"{base}_broadcast"),
                              f"{prefix}{base}_broadcast", (anchor, held), constant.shape,
                              str(constant.slice.dtype))

    def progression_node(constant, base, anchor):
        """`start + index * step`, the index counting along the batch axis:
        the running sum of ones broadcast along it, less those ones."""
        axis, dtype = constant.axis, str(constant.start.dtype)
        index_shape = tuple(dim if i == axis else 1 for i, dim in enumerate(constant.shape))
        operations = _compat.batch_index_operations(axis, dtype)
        start = held_node(constant.start, f"{prefix}{base}_start", anchor, progression=True)
        step = held_node(constant.step, f"{prefix}{base}_step", anchor, progression=True)
        one = held_node(np.ones((1,) * len(index_shape), "int32"), f"{prefix}{base}_one", anchor)
        ones = operation_node(_batch_sized_broadcast(index_shape, f"{base}_ones"),
                              f"{prefix}{base}_ones", (anchor, one), index_shape, "int32")
        count = operation_node(operations["cumsum"], f"{prefix}{base}_count", (ones,),
                               index_shape, "int32")
        index = operation_node(operations["subtract"], f"{prefix}{base}_index", (count, ones),
                               index_shape, "int32")
        if dtype != "int32":
            index = operation_node(operations["cast"], f"{prefix}{base}_index_cast", (index,),
                                   index_shape, dtype)
        scaled = operation_node(operations["multiply"], f"{prefix}{base}_scaled",
                                (index, step), constant.shape, dtype)
        return operation_node(operations["add"], f"{prefix}{base}_range", (scaled, start),
                              constant.shape, dtype)

    def argument(a, b, name):
        if isinstance(a, Value) or isinstance(b, Value):
            expected = value_of.get(id(a), a)
            if not (isinstance(a, Value) and isinstance(b, Value)
                    and value_of.get(id(b), b) is expected):
                raise NotBatchGeneral(f"`{name}` is given other tensors")
            return expected
        if _is_array(a) or _is_array(b):
            constant = _general_constant(a, b, batch_sizes, name)
            return a if constant is None else broadcast_node(constant, name)
        if isinstance(a, (list, tuple)) and type(a) is type(b) and len(a) == len(b):
            return type(a)(argument(x, y, name) for x, y in zip(a, b))
        if isinstance(a, dict) and isinstance(b, dict) and a.keys() == b.keys():
            return {k: argument(a[k], b[k], name) for k in a}
        if type(a) is not type(b) or a != b:
            raise NotBatchGeneral(f"`{name}` is given {a!r} and {b!r}")
        return a

    for node_s, node_l in zip(nodes_s, nodes_l):
        switches = are_switches(node_s, node_l)
        if not switches and not same_operation(node_s, node_l):
            raise NotBatchGeneral(f"`{node_s.name}` is not called in both traces")
        if len(node_s.outputs) != len(node_l.outputs):
            raise NotBatchGeneral(f"`{node_s.name}` has other outputs")
        args = argument(node_s.args, node_l.args, node_s.name)
        kwargs = argument(node_s.kwargs, node_l.kwargs, node_s.name)
        operation = node_s.operation
        if switches:
            inputs = [leaf for leaf in keras.tree.flatten(args) if isinstance(leaf, Value)]
            operation = general_switch(node_s, node_l, inputs,
                                       batch_sizes[0] if len(batch_sizes) == 1 else batch_sizes,
                                       anchors[0], prefix)
        elif isinstance(operation, HeldConstant):
            constant = _general_constant(operation.value, node_l.operation.value,
                                         batch_sizes, node_s.name)
            if constant is not None:  # a lifted tensor with the batch in it
                value = broadcast_node(constant, node_s.name)
                value_of[id(node_l.outputs[0])] = value
                value_of[id(node_s.outputs[0])] = value
                continue
        elif not isinstance(operation, keras.layers.Layer):
            used = set()
            shapes = _general_attributes(operation, node_l.operation, batch_sizes, node_s.name,
                                         used)
            if shapes:
                anchor = anchor_for(used, node_s.name)
                multiples, offsets = _multiples_of(shapes), _offsets_of(shapes)
                divisors = _divisors_of(shapes)
                shapes = {key: _with_none(shape) for key, shape in shapes.items()}
                operation = BatchSizedOperation(
                    _rebuilt_with(operation, shapes, node_s.name), list(shapes),
                    multiples=multiples, offsets=offsets, divisors=divisors,
                    name=operation.name)
                args, kwargs = BatchSizedOperation.arguments(
                    operation.operation, anchor, args, kwargs)
        node_s.operation, node_s.args, node_s.kwargs = operation, args, kwargs
        for value_s, value_l in zip(node_s.outputs, node_l.outputs):
            value_s.spec = _general_spec(value_s.spec, value_l.spec, batch_sizes, node_s.name)
            value_of[id(value_l)] = value_s
        result.append(node_s)

    def same_output(a, b):
        expected = value_of.get(id(a), a)
        if value_of.get(id(b), b) is not expected:
            raise NotBatchGeneral("the two traces return other tensors")
        return expected

    flat_s, flat_l = keras.tree.flatten(outputs_s), keras.tree.flatten(outputs_l)
    outputs = keras.tree.pack_sequence_as(
        outputs_s, [same_output(a, b) for a, b in zip(flat_s, flat_l)])
    return result, outputs


def has_offsets(nodes):
    """Whether a `BatchSizedOperation` among `nodes` (or the graphs of a
    `ModeSwitch` among them) adds a constant to a multiple of the batch
    size, or divides it."""
    return any(isinstance(node.operation, BatchSizedOperation)
               and (node.operation.offsets or node.operation.divisors)
               for node in with_branch_nodes(nodes))


def batch_signature(nodes):
    """How `nodes` compute with the batch size: per `BatchSizedOperation`,
    its operation's kind, shapes, multiples, offsets and divisors; two
    generalizations of the same call made from other batch sizes have the
    same."""
    return [
        (type(node.operation.operation).__name__,
         {name: getattr(node.operation.operation, name) for name in node.operation.attributes},
         node.operation.multiples, node.operation.offsets, node.operation.divisors)
        for node in with_branch_nodes(nodes) if isinstance(node.operation, BatchSizedOperation)
    ]


class _BatchConstant:
    """A constant repeated along its batch dimensions: `slice` (size 1
    there) broadcast to `shape` (None there)."""

    def __init__(self, slice_, shape):
        self.slice, self.shape = slice_, shape


class _BatchProgression:
    """A constant that counts along its one batch dimension `axis`:
    `start + i * step` at row `i` (`ops.arange(ops.shape(x)[0]) * seq_len`,
    as keras_hub's Gemma 3 offsets each example's indices into the
    flattened batch), `start` and `step` (size 1 there) the same at every
    batch size; `shape` has None (or a `BatchMultiple`) there."""

    def __init__(self, start, step, shape, axis):
        self.start, self.step, self.shape, self.axis = start, step, shape, axis


def _batch_sized_broadcast(shape, name):
    """`ops.broadcast_to` to `shape` (a `BatchMultiple` at each batch
    dimension), reading the batch size when the graph runs."""
    shapes = {"shape": tuple(shape)}
    return BatchSizedOperation(
        _compat.broadcast_to_operation(_with_none(shape)), ["shape"],
        multiples=_multiples_of(shapes), offsets=_offsets_of(shapes),
        divisors=_divisors_of(shapes), name=name)


def _progression(a, b, shape, name):
    """`_BatchProgression` of the constants `a` and `b` (the same constant
    traced at two batch sizes, `shape` their general shape), or
    `NotBatchGeneral` where they do not count along one batch dimension
    from the same start by the same step. A range that starts from the
    batch size (`ops.arange(b - 1, -1, -1)`), wraps (`% k`), or spans two
    batch dimensions (`ops.eye(b)`) is no such constant; a third trace at
    larger batch sizes confirms the rest (`traces.one_graph_for_any_batch`)."""
    axes = [i for i, dim in enumerate(shape) if dim is None or isinstance(dim, BatchMultiple)]
    refusal = NotBatchGeneral(
        f"`{name}` holds a constant computed from the batch size whose rows are neither "
        "one row repeated nor `start + i * step` along one batch dimension (from a start "
        "and by a step that do not change with the batch size), which no graph computes "
        "from the batch size")
    if len(axes) != 1 or a.dtype.kind not in "if":  # (unsigned: a step down would wrap)
        raise refusal
    axis = axes[0]
    if b.shape[axis] < 2 or a.shape[axis] < 1:
        raise refusal
    start = np.take(a, [0], axis=axis)
    step = np.take(b, [1], axis=axis) - np.take(b, [0], axis=axis)

    def counts(array):
        index = np.arange(array.shape[axis]).reshape(
            [-1 if i == axis else 1 for i in range(array.ndim)])
        expected = start + index.astype(array.dtype) * step
        if array.dtype.kind == "f":
            scale = max(float(np.max(np.abs(array), initial=0.0)), 1.0)
            return np.allclose(array, expected, rtol=1e-6, atol=1e-6 * scale)
        return np.array_equal(array, expected)

    if not (np.array_equal(start, np.take(b, [0], axis=axis)) and counts(a) and counts(b)):
        raise refusal
    return _BatchProgression(start, step.astype(a.dtype), shape, axis)


def progression_signature(nodes):
    """The start and step of each range over the batch among `nodes` (or
    the graphs of a `ModeSwitch` among them): two generalizations of one
    call, made from other batch sizes, have the same."""
    return [np.asarray(node.operation.value).tolist() for node in with_branch_nodes(nodes)
            if node.meta.get("batch_progression")]


def _is_array(value):
    import tensorflow as tf

    return isinstance(value, np.ndarray) or (
        tf.is_tensor(value) and not isinstance(value, keras.KerasTensor)
    )


class BatchMultiple:
    """A dimension that is `multiple` times the batch size divided by
    `divisor`, plus `offset` (Swin's windows: `batch * windows` rows, and
    `batch_windows // windows`; `batch + 1`, `batch - 1`), in a shape
    attribute of a traced operation."""

    def __init__(self, multiple, offset=0, divisor=1):
        self.multiple = multiple
        self.offset = offset
        self.divisor = divisor

    def at(self, batch_size):
        return batch_size // self.divisor * self.multiple + self.offset


def _fraction_of(ratio, small, offset=0):
    """`BatchMultiple` of `ratio` (a `Fraction`: the dimension over the
    batch size) plus `offset`, where the trial batch size `small` is a
    multiple of its denominator (the batch was traced at multiples of the
    divisor the call divides it by); None where it is not."""
    if ratio <= 0 or small % ratio.denominator:
        return None
    return BatchMultiple(ratio.numerator, offset, divisor=ratio.denominator)


def _size_pairs(batch_sizes):
    """`[(s, l)]`: one pair of trial sizes, or one per independent input."""
    if len(batch_sizes) == 2 and all(_is_int(size) for size in batch_sizes):
        return [tuple(batch_sizes)]
    return [tuple(pair) for pair in batch_sizes]


def _batch_dimension(a, b, batch_sizes, name, multiples=False, used=None):
    """None where `(a, b)` are the two batch sizes, the size where they are
    equal; with `multiples`, a `BatchMultiple` where they are the same
    multiple of both; `NotBatchGeneral` otherwise. `batch_sizes`: `(s, l)`,
    or one such pair per input of independent leading size (see
    `generalize_batch`); the index of the pair matched is added to `used`."""
    if a == b:
        return a
    pairs = _size_pairs(batch_sizes)
    for index, (small, large) in enumerate(pairs):
        if (a, b) == (small, large):
            if used is not None:
                used.add(index)
            return None
    for index, (small, large) in enumerate(pairs):
        if (multiples and _is_int(a) and _is_int(b) and a > 0 and a % small == 0
                and b == a // small * large):
            if used is not None:
                used.add(index)
            return BatchMultiple(a // small)
    if len(pairs) > 1:
        raise NotBatchGeneral(
            f"`{name}` has a dimension {a} in one trace and {b} in the other, which is "
            "no multiple of the leading size of one of its inputs (whose leading "
            "dimensions are independent of each other)")
    small, large = pairs[0]
    if multiples and _is_int(a) and _is_int(b) and a > 0 and a * large == b * small:
        # `batch // windows`, traced at multiples of the windows
        # (`traces.divided_trial_sizes`): a fraction of the batch size,
        # confirmed by a third trace (`has_offsets`).
        found = _fraction_of(Fraction(int(a), int(small)), small)
        if found is not None:
            return found
    if multiples and _is_int(a) and _is_int(b) and b > a and (b - a) % (large - small) == 0:
        # `batch + 1`, `2 * batch - 1`: a multiple of the batch size plus a
        # constant, which a third trace confirms (`confirm_batch_general`).
        multiple = (b - a) // (large - small)
        return BatchMultiple(multiple, int(a - multiple * small))
    if multiples and _is_int(a) and _is_int(b) and b > a:
        # `batch // 2 + 1`, traced at even batch sizes
        ratio = Fraction(int(b - a), int(large - small))
        offset = a - ratio * small
        found = _fraction_of(ratio, small, int(offset)) if offset.denominator == 1 else None
        if found is not None:
            return found
    raise NotBatchGeneral(
        f"`{name}` has a dimension {a} at batch size {small} and {b} at batch size {large}, "
        "which is no multiple of the batch size plus a constant")


def _multiples_of(shapes):
    """{attribute: multiples} for the attributes holding a `BatchMultiple`:
    the multiple at each of its dimensions (1 where it is the batch size,
    unused where it is fixed)."""
    def multiple(dim):
        return dim.multiple if isinstance(dim, BatchMultiple) else 1

    found = {}
    for key, shape in shapes.items():
        if isinstance(shape, (list, tuple)):
            if any(isinstance(dim, BatchMultiple) for dim in shape):
                found[key] = [multiple(dim) for dim in shape]
        elif isinstance(shape, BatchMultiple):
            found[key] = shape.multiple
    return found


def _offsets_of(shapes):
    """{attribute: offsets}, as `_multiples_of`, for the attributes holding
    a `BatchMultiple` with a constant added (0 elsewhere)."""
    def offset(dim):
        return dim.offset if isinstance(dim, BatchMultiple) else 0

    found = {}
    for key, shape in shapes.items():
        if isinstance(shape, (list, tuple)):
            if any(isinstance(dim, BatchMultiple) and dim.offset for dim in shape):
                found[key] = [offset(dim) for dim in shape]
        elif isinstance(shape, BatchMultiple) and shape.offset:
            found[key] = shape.offset
    return found


def _divisors_of(shapes):
    """{attribute: divisors}, as `_multiples_of`, for the attributes holding
    a `BatchMultiple` that divides the batch size (1 elsewhere)."""
    def divisor(dim):
        return dim.divisor if isinstance(dim, BatchMultiple) else 1

    found = {}
    for key, shape in shapes.items():
        if isinstance(shape, (list, tuple)):
            if any(isinstance(dim, BatchMultiple) and dim.divisor != 1 for dim in shape):
                found[key] = [divisor(dim) for dim in shape]
        elif isinstance(shape, BatchMultiple) and shape.divisor != 1:
            found[key] = shape.divisor
    return found


def _with_none(shape):
    """`shape` with each `BatchMultiple` unknown (None)."""
    if isinstance(shape, (list, tuple)):
        return type(shape)(None if isinstance(dim, BatchMultiple) else dim for dim in shape)
    return None if isinstance(shape, BatchMultiple) else shape


def _general_constant(a, b, batch_sizes, name):
    """None when the constants are equal; a `_BatchConstant` when they are
    one slice repeated along their batch dimensions (its `groups`: the
    inputs whose leading sizes those are)."""
    a, b = np.asarray(a), np.asarray(b)
    if a.dtype != b.dtype or a.ndim != b.ndim:
        raise NotBatchGeneral(f"`{name}` holds other constants")
    if a.shape == b.shape:
        if not np.array_equal(a, b):
            raise NotBatchGeneral(f"`{name}` holds other constants")
        return None
    used = set()
    shape = tuple(_batch_dimension(x, y, batch_sizes, name, multiples=True, used=used)
                  for x, y in zip(a.shape, b.shape))
    index = tuple(slice(0, 1) if dim is None or isinstance(dim, BatchMultiple) else slice(None)
                  for dim in shape)
    slice_ = a[index]
    if (np.array_equal(np.broadcast_to(slice_, a.shape), a)
            and np.array_equal(np.broadcast_to(slice_, b.shape), b)):
        constant = _BatchConstant(slice_, shape)
    elif len(_size_pairs(batch_sizes)) == 1:
        constant = _progression(a, b, shape, name)
    else:
        raise NotBatchGeneral(
            f"`{name}` holds a constant that varies along the batch, and its call's inputs "
            "have leading sizes independent of each other")
    constant.groups = used
    return constant


def _general_attributes(a, b, batch_sizes, name, used=None):
    """`{attribute: shape with None}` for the shape attributes of operation
    `a` that hold the batch size (`b`: the same operation in the other trace)."""
    shapes = {}
    public_a = {k: v for k, v in vars(a).items() if not k.startswith("_") and k != "name"}
    public_b = {k: v for k, v in vars(b).items() if not k.startswith("_") and k != "name"}
    if public_a.keys() != public_b.keys():
        raise NotBatchGeneral(f"`{name}` is configured differently")
    for key, value in public_a.items():
        other = public_b[key]
        if _is_array(value) or _is_array(other):
            if _general_constant(value, other, batch_sizes, name) is not None:
                raise NotBatchGeneral(f"`{name}` holds a constant with the batch in it")
            continue
        if value == other:
            continue
        if _same_held_operation(value, other):
            continue  # `TensorSizedOperation.operation`: its sizes are graph tensors
        if _is_int(value) and _is_int(other):
            # One dimension (`ops.repeat(table, ops.shape(x)[0], axis=0)`).
            shapes[key] = _batch_dimension(value, other, batch_sizes, name, multiples=True,
                                           used=used)
            continue
        if (isinstance(value, (list, tuple)) and type(value) is type(other)
                and len(value) == len(other)
                and all(isinstance(x, int) and isinstance(y, int) for x, y in zip(value, other))):
            shapes[key] = type(value)(
                _batch_dimension(x, y, batch_sizes, name, multiples=True, used=used)
                for x, y in zip(value, other))
            continue
        raise NotBatchGeneral(f"`{name}` is given {value!r} and {other!r} ({key})")
    return shapes


def _same_held_operation(a, b):
    """Whether `a` and `b` are `keras.ops` operations configured alike
    (names aside): an operation held by another (`TensorSizedOperation`)."""
    if not (isinstance(a, keras.Operation) and type(a) is type(b)) or isinstance(
            a, keras.layers.Layer):
        return False
    try:
        config_a, config_b = a.get_config(), b.get_config()
    except NotImplementedError:
        return False
    config_a.pop("name", None)
    config_b.pop("name", None)
    return config_a == config_b


def _is_int(value):
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _rebuilt_with(operation, shapes, name):
    """A new operation like `operation`, with `shapes` ({attribute: shape})
    as constructor arguments.

    Setting the attribute on the traced operation would not last: Keras
    copies an operation (`copy.copy`, as `BatchSizedOperation` does for each
    batch size) and saves it from the arguments it was constructed with, so
    a Reshape traced at batch size 1 would go on reshaping to batch 1 (T5's
    attention, seen as a 24 where 8 was due at batch size 3)."""
    config = operation.get_config()
    if not set(shapes) <= set(config):
        raise NotBatchGeneral(
            f"`{name}` holds the batch size in {sorted(set(shapes) - set(config))}, "
            "which its config does not rebuild")
    rebuilt = type(operation).from_config({**config, **shapes})
    if any(_as_tuple(getattr(rebuilt, key)) != _as_tuple(shape) for key, shape in shapes.items()):
        raise NotBatchGeneral(f"`{name}` does not rebuild from its config")
    return rebuilt


def _as_tuple(shape):
    return tuple(shape) if isinstance(shape, (list, tuple)) else (shape,)


def _general_spec(a, b, batch_sizes, name):
    if a.dtype != b.dtype or len(a.shape) != len(b.shape):
        raise NotBatchGeneral(f"`{name}` makes other outputs")
    # A multiple of the batch size is unknown in a spec, as the batch is.
    shape = _with_none(tuple(_batch_dimension(x, y, batch_sizes, name, multiples=True)
                             for x, y in zip(a.shape, b.shape)))
    return keras.KerasTensor(shape, dtype=a.dtype, sparse=a.sparse)


def are_switches(node_a, node_b):
    """Whether two traces' nodes are `ModeSwitch`es standing for one
    layer's call, with the same modes."""
    a, b = node_a.operation, node_b.operation
    return (isinstance(a, ModeSwitch) and isinstance(b, ModeSwitch)
            and a.of_layer == b.of_layer and a.none_means == b.none_means
            and set(a.mode_outputs) == set(b.mode_outputs)
            and a.branch_graphs is not None and b.branch_graphs is not None)


def general_switch(node_s, node_l, inputs, batch_sizes, anchor, prefix):
    """A `ModeSwitch` for any batch size, made of the switches of two traces
    at `batch_sizes` (`node_s`, `node_l`). `inputs`: the switch's inputs
    (Values of the small trace's graph); `anchor`: the Value whose leading
    size is the batch size there. Raises `NotBatchGeneral`."""
    switch_s, switch_l = node_s.operation, node_l.operation
    if not isinstance(batch_sizes[0], int):
        raise NotBatchGeneral(
            f"`{node_s.name}` branches on `training` in Python, and its inputs' leading "
            "sizes are independent of each other, which its graphs cannot follow")
    place = next((i for i, value in enumerate(inputs) if value is anchor), None)
    graphs = {}
    for mode, graph_s in switch_s.branch_graphs.items():
        graph_l = switch_l.branch_graphs[mode]
        if len(graph_s.input_values) != len(graph_l.input_values):
            raise NotBatchGeneral(f"`{node_s.name}` reads other inputs in {mode}")
        known = dict(zip(map(id, graph_l.input_values), graph_s.input_values))
        specs = []
        for spec, value_s, value_l in zip(graph_s.input_specs, graph_s.input_values,
                                          graph_l.input_values):
            value_s.spec = _general_spec(value_s.spec, value_l.spec, batch_sizes, node_s.name)
            shape = tuple(value_s.spec.shape)
            specs.append(InputSpec(name=spec.name, shape=shape[1:], dtype=spec.dtype,
                                   batch_size=shape[0]))
        inner = graph_s.input_values[place] if place is not None else next(
            (value for value in graph_s.input_values
             if value.spec.shape and value.spec.shape[0] is None), None)
        if inner is None:
            raise NotBatchGeneral(
                f"`{node_s.name}` branches on `training` in Python, and reads no input "
                "whose leading size is the batch size")
        nodes, outputs = generalize_batch(
            (graph_s.nodes, graph_s.outputs), (graph_l.nodes, graph_l.outputs), batch_sizes,
            inner, prefix, known=known)
        try:
            check_batch_dimensions(nodes, prefix, multiples=True, scale=batch_sizes[0])
        except TraceError as error:
            raise NotBatchGeneral(f"in {mode}, {error.reason}") from None
        graph_s.nodes = []  # detached: the small trace's switch is done with
        graphs[mode] = Graph(specs, list(graph_s.input_values), nodes, list(outputs),
                             name=graph_s.name)
    return switch_s.with_branch_graphs(graphs)


__all__ = ["MixedLeadingSizes", "NotBatchGeneral", "are_switches", "batch_signature",
           "general_switch", "generalize_batch", "has_offsets", "progression_signature",
           "same_operation"]
