"""`BatchSizedOperation`: a `keras.ops` call whose shape holds the batch size.

While tracing, the batch dimension of every tensor is unknown, so
`ops.shape(x)[0]` gives None, and code such as
`ops.broadcast_to(self.cls_token, (ops.shape(x)[0], 1, dim))` records an
operation with None in its target shape, which would fail when the graph
runs. The tracer records such a call as this layer instead: it holds the
operation and fills each None with the batch size of a graph tensor
(`anchor`, an input of the traced call) when the graph runs, so the graph
works for any batch size. The tracer checks first that every unknown
dimension in that call's trace is that batch size (`tracing.py`).

Example:
    >>> op = keras.src.ops.numpy.BroadcastTo(shape=(None, 1, 8))
    >>> layer = BatchSizedOperation(op, ["shape"], name="broadcast_to")
    >>> layer(x, cls_token).shape   # x: (batch, ...), cls_token: (1, 1, 8)
    (batch, 1, 8)
"""

import copy

import keras
import numpy as np

from keras_ipu_plugin import _compat
from keras_ipu_plugin.layers import saved_values


@keras.saving.register_keras_serializable(package="keras_ipu_plugin")
class BatchSizedOperation(keras.layers.Layer):
    """Runs `operation` with each None in its shape `attributes` set to the
    batch size of `anchor` (the first argument; the others are the
    operation's own).

    Example:
        >>> BatchSizedOperation(reshape_op, ["newshape"])(x, y)
    """

    def __init__(self, operation, attributes, multiples=None, offsets=None, **kwargs):
        # The operation's inputs keep their dtypes, as they did in `call`.
        kwargs.setdefault("autocast", False)
        super().__init__(**kwargs)
        if isinstance(operation, dict):  # loaded: checked by from_config
            operation = keras.saving.deserialize_keras_object(operation)
        self.operation = operation
        self.attributes = tuple(attributes)
        # {attribute: the batch size's multiple at each None of it (an int
        # for a one-dimension attribute)}; absent: the batch size itself.
        # Swin's windows are `batch * windows` rows (`window_reverse`).
        self.multiples = dict(multiples or {})
        # {attribute: the constant added to that multiple at each None (an
        # int for a one-dimension attribute)}; absent: none. `ops.zeros(
        # (ops.shape(x)[0] + 1, d))`, `ops.slice(x, [1, 0], [batch - 1, d])`.
        self.offsets = dict(offsets or {})
        self.built = True

    @staticmethod
    def arguments(operation, anchor, args, kwargs):
        """`(args, kwargs)` of a call of this layer for a call of `operation`:
        `anchor` first, then the operation's tensors; an argument that is
        not a tensor goes by its name. A Keras layer takes only tensors
        positionally, and a nested argument mixing both, as `*args` is,
        not at all: `ops.slice(x, [0, 1, 0], shape)` gives its start indices
        positionally, and the graph failed when it ran."""
        import inspect

        args = tuple(args)
        first_data = next((i for i, arg in enumerate(args) if not _holds_tensors(arg)), len(args))
        if first_data < len(args):
            try:
                bound = inspect.signature(operation.call).bind(*args, **kwargs)
            except TypeError:
                bound = None
            names = list(bound.arguments)[first_data:len(args)] if bound is not None else []
            if bound is not None and len(names) == len(args) - first_data and all(
                bound.signature.parameters[name].kind
                == inspect.Parameter.POSITIONAL_OR_KEYWORD for name in names
            ):
                kwargs = {**kwargs, **{name: bound.arguments[name] for name in names}}
                args = args[:first_data]
        return (anchor,) + args, kwargs

    def with_batch_size(self, batch_size):
        """A copy of the operation whose unknown dimensions are `batch_size`
        (an attribute is a shape, or one dimension such as `ops.repeat`'s
        `repeats`)."""
        operation = copy.copy(self.operation)
        for name in self.attributes:
            shape = getattr(operation, name)
            multiples = self.multiples.get(name)
            offsets = self.offsets.get(name)
            if shape is None:
                setattr(operation, name, batch_size * (multiples or 1) + (offsets or 0))
                continue
            multiples = multiples or [1] * len(shape)
            offsets = offsets or [0] * len(shape)
            filled = [batch_size * multiple + offset if dim is None else dim
                      for dim, multiple, offset in zip(shape, multiples, offsets)]
            setattr(operation, name, type(shape)(filled))
        return operation

    def call(self, anchor, *args, **kwargs):
        batch_size = keras.ops.shape(anchor)[0]
        return self.with_batch_size(batch_size).call(*args, **kwargs)

    def compute_output_spec(self, anchor, *args, **kwargs):
        batch_size = anchor.shape[0]
        if batch_size is not None:
            return self.with_batch_size(batch_size).compute_output_spec(*args, **kwargs)
        try:
            return self.operation.compute_output_spec(*args, **kwargs)
        except Exception:
            # Keras's `Tile` cannot multiply an unknown repeat into its
            # output shape (the functional model is rebuilt on a batch of
            # None): the spec at two batch sizes shows which dimensions
            # follow it.
            return self._spec_at_two_batch_sizes(*args, **kwargs)

    def _spec_at_two_batch_sizes(self, *args, **kwargs):
        two, three = (self.with_batch_size(size).compute_output_spec(*args, **kwargs)
                      for size in (2, 3))
        return keras.tree.map_structure(
            lambda a, b: keras.KerasTensor(
                tuple(x if x == y else None for x, y in zip(a.shape, b.shape)),
                dtype=a.dtype, sparse=a.sparse,
            ),
            two, three,
        )

    def get_config(self):
        config = super().get_config()
        config.update(
            operation=keras.saving.serialize_keras_object(self.operation),
            attributes=list(self.attributes),
        )
        if self.multiples:
            config["multiples"] = self.multiples
        if self.offsets:
            config["offsets"] = self.offsets
        return config

    @classmethod
    def from_config(cls, config):
        entry = f"BatchSizedOperation `{config.get('name')}`"
        operation = saved_values.saved_keras_object(
            config.get("operation"), entry, "operation", keras.Operation,
            modules=_compat.KERAS_OPERATION_MODULES)
        if isinstance(operation, keras.layers.Layer):
            saved_values.refuse(entry, "operation", "a keras.ops operation",
                                type(operation).__name__)
        shapes = operation.get_config()
        attributes = config.get("attributes")
        if not isinstance(attributes, list) or not all(
                isinstance(name, str) and name in shapes and not name.startswith("_")
                and name != "name" for name in attributes):
            saved_values.refuse(entry, "attributes",
                                f"a list of {type(operation).__name__}'s shape arguments",
                                attributes)
        multiples = config.get("multiples") or {}
        if not isinstance(multiples, dict):
            saved_values.refuse(entry, "multiples", "a mapping", multiples)
        for name, multiple in multiples.items():
            if name not in attributes or not (
                    _is_size(multiple) or (isinstance(multiple, list)
                                           and all(_is_size(m) for m in multiple))):
                saved_values.refuse(entry, f"multiples.{name}",
                                    "a positive int (or a list of them) for an attribute",
                                    multiple)
        offsets = config.get("offsets") or {}
        if not isinstance(offsets, dict):
            saved_values.refuse(entry, "offsets", "a mapping", offsets)
        for name, offset in offsets.items():
            if name not in attributes or not (
                    _is_offset(offset) or (isinstance(offset, list)
                                           and all(_is_offset(o) for o in offset))):
                saved_values.refuse(entry, f"offsets.{name}",
                                    "an int (or a list of them) for an attribute", offset)
        return cls(**{**config, "operation": operation})


def _is_size(value):
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _is_offset(value):
    return isinstance(value, int) and not isinstance(value, bool)


def unknown_dimension_attributes(operation):
    """Names of `operation`'s shape attributes (lists / tuples of
    dimensions) that hold None."""
    return [
        name for name, value in vars(operation).items()
        if not name.startswith("_") and isinstance(value, (list, tuple))
        and any(item is None for item in value)
        and all(item is None or isinstance(item, int) for item in value)
    ]




class NotBatchGeneral(Exception):
    """Two traces at different batch sizes differ other than by it."""


def generalize_batch(small, large, batch_sizes, anchor, same_operation, prefix=""):
    """One graph for any batch size from two traces of the same call, made
    with its inputs' batch size set to `batch_sizes = (s, l)`.

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

    Returns `(nodes, outputs)` of `small`, generalized (its Nodes are
    reused; new ones are named `prefix + ...`).
    """
    from keras_ipu_plugin.ir.graph import Node
    from keras_ipu_plugin.ir.graph import Value
    from keras_ipu_plugin.layers.reads import HeldConstant

    (nodes_s, outputs_s), (nodes_l, outputs_l) = small, large
    if len(nodes_s) != len(nodes_l):
        raise NotBatchGeneral("the two traces call different layers")
    value_of = {}  # id(Value of the large trace) -> Value of the small one
    result = []

    def broadcast_node(constant, node_name):
        """Nodes making `constant` (a broadcast of one slice along its batch
        dimensions) in the graph; returns the Value of the broadcast."""
        base = node_name[len(prefix):] if node_name.startswith(prefix) else node_name
        held = HeldConstant(constant.slice, name=f"{prefix}{base}_slice")
        held_node = Node(held.name, held, (anchor,), {}, output_structure=None)
        held_node.outputs = [Value(held_node, 0, keras.KerasTensor(
            constant.slice.shape, dtype=str(constant.slice.dtype)))]
        shape = {"shape": tuple(constant.shape)}
        broadcast = BatchSizedOperation(
            _compat.broadcast_to_operation(_with_none(constant.shape)), ["shape"],
            multiples=_multiples_of(shape), offsets=_offsets_of(shape),
            name=f"{base}_broadcast",
        )
        node = Node(prefix + broadcast.name, broadcast, (anchor, held_node.outputs[0]), {},
                    output_structure=None)
        node.outputs = [Value(node, 0, keras.KerasTensor(
            _with_none(constant.shape), dtype=str(constant.slice.dtype)))]
        result.extend([held_node, node])
        return node.outputs[0]

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
        if not same_operation(node_s, node_l):
            raise NotBatchGeneral(f"`{node_s.name}` is not called in both traces")
        if len(node_s.outputs) != len(node_l.outputs):
            raise NotBatchGeneral(f"`{node_s.name}` has other outputs")
        args = argument(node_s.args, node_l.args, node_s.name)
        kwargs = argument(node_s.kwargs, node_l.kwargs, node_s.name)
        operation = node_s.operation
        if isinstance(operation, HeldConstant):
            constant = _general_constant(operation.value, node_l.operation.value,
                                         batch_sizes, node_s.name)
            if constant is not None:  # a lifted tensor with the batch in it
                value = broadcast_node(constant, node_s.name)
                value_of[id(node_l.outputs[0])] = value
                value_of[id(node_s.outputs[0])] = value
                continue
        elif not isinstance(operation, keras.layers.Layer):
            shapes = _general_attributes(operation, node_l.operation, batch_sizes, node_s.name)
            if shapes:
                multiples, offsets = _multiples_of(shapes), _offsets_of(shapes)
                shapes = {key: _with_none(shape) for key, shape in shapes.items()}
                operation = BatchSizedOperation(
                    _rebuilt_with(operation, shapes, node_s.name), list(shapes),
                    multiples=multiples, offsets=offsets, name=operation.name)
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


def fixed_batch_reason(operation, arguments, outputs, name):
    """Why the call of `operation` (a reshape or broadcast) at node `name`
    runs at one batch size only, or None: it takes a tensor whose batch
    size is unknown (None) to a shape that is all constants, so the batch
    size is one of them (keras.io's Switch Transformer reshapes to
    `[num_tokens_per_batch, embed_dim]`, a Python int from the data's
    batch size). `arguments`: the call's arguments, flattened."""
    kind = type(operation).__name__
    function = getattr(operation, "function", None)
    if kind == "TFFunction" and function in ("reshape", "broadcast_to"):
        kind = "Reshape" if function == "reshape" else "BroadcastTo"
    if kind not in ("Reshape", "BroadcastTo"):
        return None
    given = next((t for t in arguments if isinstance(t, keras.KerasTensor)), None)
    if given is None or not given.shape or given.shape[0] is not None or None in given.shape[1:]:
        return None
    if len(outputs) != 1 or not outputs[0].shape or None in tuple(outputs[0].shape):
        return None
    shape, fixed = tuple(given.shape), tuple(outputs[0].shape)
    rows = int(np.prod(fixed)) / max(int(np.prod(shape[1:])), 1)
    batch = f"the batch size {int(rows)}" if rows == int(rows) else "a batch size"
    verb = "reshapes" if kind == "Reshape" else "broadcasts"
    return (
        f"`{name}` {verb} a tensor whose batch size is unknown, of shape {shape}, to the "
        f"fixed shape {fixed}: the code holds {batch} as a constant, so it runs at that "
        "batch size only; write that dimension as -1 (`ops.reshape(x, (-1, "
        f"{', '.join(map(str, fixed[1:]))}))`) or from `ops.shape(x)[0]` (times what it "
        "multiplies) for the layer to expand and run at any batch size, or convert with "
        "static_batch=True"
    )


def has_offsets(nodes):
    """Whether a `BatchSizedOperation` among `nodes` adds a constant to a
    multiple of the batch size."""
    return any(isinstance(node.operation, BatchSizedOperation) and node.operation.offsets
               for node in nodes)


def batch_signature(nodes):
    """How `nodes` compute with the batch size: per `BatchSizedOperation`,
    its operation's kind, shapes, multiples and offsets; two generalizations
    of the same call made from other batch sizes have the same."""
    return [
        (type(node.operation.operation).__name__,
         {name: getattr(node.operation.operation, name) for name in node.operation.attributes},
         node.operation.multiples, node.operation.offsets)
        for node in nodes if isinstance(node.operation, BatchSizedOperation)
    ]


def _holds_tensors(value):
    """Whether `value` is, or holds only, tensors (graph Values included) or
    None, which Keras takes positionally."""
    return all(
        not isinstance(leaf, (int, float, bool, str, np.ndarray, np.generic))
        for leaf in keras.tree.flatten(value))


class _BatchConstant:
    """A constant repeated along its batch dimensions: `slice` (size 1
    there) broadcast to `shape` (None there)."""

    def __init__(self, slice_, shape):
        self.slice, self.shape = slice_, shape


def _is_array(value):
    import tensorflow as tf

    return isinstance(value, np.ndarray) or (
        tf.is_tensor(value) and not isinstance(value, keras.KerasTensor)
    )


class BatchMultiple:
    """A dimension that is `multiple` times the batch size plus `offset`
    (Swin's windows: `batch * windows` rows; `batch + 1`, `batch - 1`), in
    a shape attribute of a traced operation."""

    def __init__(self, multiple, offset=0):
        self.multiple = multiple
        self.offset = offset

    def at(self, batch_size):
        return self.multiple * batch_size + self.offset


def _batch_dimension(a, b, batch_sizes, name, multiples=False):
    """None where `(a, b)` are the two batch sizes, the size where they are
    equal; with `multiples`, a `BatchMultiple` where they are the same
    multiple of both; `NotBatchGeneral` otherwise."""
    if a == b:
        return a
    small, large = batch_sizes
    if (a, b) == (small, large):
        return None
    if (multiples and _is_int(a) and _is_int(b) and a > 0 and a % small == 0
            and b == a // small * large):
        return BatchMultiple(a // small)
    if multiples and _is_int(a) and _is_int(b) and b > a and (b - a) % (large - small) == 0:
        # `batch + 1`, `2 * batch - 1`: a multiple of the batch size plus a
        # constant, which a third trace confirms (`confirm_batch_general`).
        multiple = (b - a) // (large - small)
        return BatchMultiple(multiple, int(a - multiple * small))
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


def _with_none(shape):
    """`shape` with each `BatchMultiple` unknown (None)."""
    if isinstance(shape, (list, tuple)):
        return type(shape)(None if isinstance(dim, BatchMultiple) else dim for dim in shape)
    return None if isinstance(shape, BatchMultiple) else shape


def _general_constant(a, b, batch_sizes, name):
    """None when the constants are equal; a `_BatchConstant` when they are
    one slice repeated along their batch dimensions."""
    a, b = np.asarray(a), np.asarray(b)
    if a.dtype != b.dtype or a.ndim != b.ndim:
        raise NotBatchGeneral(f"`{name}` holds other constants")
    if a.shape == b.shape:
        if not np.array_equal(a, b):
            raise NotBatchGeneral(f"`{name}` holds other constants")
        return None
    shape = tuple(_batch_dimension(x, y, batch_sizes, name, multiples=True)
                  for x, y in zip(a.shape, b.shape))
    index = tuple(slice(0, 1) if dim is None or isinstance(dim, BatchMultiple) else slice(None)
                  for dim in shape)
    slice_ = a[index]
    if not (np.array_equal(np.broadcast_to(slice_, a.shape), a)
            and np.array_equal(np.broadcast_to(slice_, b.shape), b)):
        raise NotBatchGeneral(f"`{name}` holds a constant that varies along the batch")
    return _BatchConstant(slice_, shape)


def _general_attributes(a, b, batch_sizes, name):
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
        if _is_int(value) and _is_int(other):
            # One dimension (`ops.repeat(table, ops.shape(x)[0], axis=0)`).
            shapes[key] = _batch_dimension(value, other, batch_sizes, name, multiples=True)
            continue
        if (isinstance(value, (list, tuple)) and type(value) is type(other)
                and len(value) == len(other)
                and all(isinstance(x, int) and isinstance(y, int) for x, y in zip(value, other))):
            shapes[key] = type(value)(
                _batch_dimension(x, y, batch_sizes, name, multiples=True)
                for x, y in zip(value, other))
            continue
        raise NotBatchGeneral(f"`{name}` is given {value!r} and {other!r} ({key})")
    return shapes


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


__all__ = ["BatchSizedOperation", "NotBatchGeneral", "batch_signature", "fixed_batch_reason",
           "generalize_batch",
           "has_offsets", "unknown_dimension_attributes"]
