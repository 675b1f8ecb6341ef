"""Trace each kind of block once: `CallTemplates` replays a traced call over
another block of the same kind.

A model of 200 identical residual blocks would otherwise trace 200 `call`s
that give the same graph up to which of the block's objects each node
uses; tracing is most of what converting and expanding such a model costs.
Two calls are of one kind when their blocks have the same signature
(`signatures.block_signature`: class, attributes, sub-layers, weights'
shapes, which objects are shared) and their inputs the same
(`signatures.call_signature`: shapes, dtypes, Keras masks, which inputs are
one value, the other arguments), under the same `training`. Their traces
then differ only in the objects each node uses, and a replay makes each
node again with the other block's counterpart (`objects`, position for
position):

- a sub-layer call: the other block's sub-layer;
- a variable read (`VariableRead`): the read of the other block's variable
  (the graph's one read layer for it, `ReadLayers`);
- a random draw (`RandomDraw`): the same draw from the other block's own
  seed generator (an int seed, or None, as it is);
- a `keras.ops` operation or a TensorFlow function (`TFFunction`), batch
  sized or not: a new operation with the same arguments;
- a held constant (`HeldConstant`): a new one holding the same values;

and each value's Keras mask points at the counterpart of its mask. The
check is made on the trace: a template is kept only where every node is
one of those, reads no object but the block's own (a layer made inside
`call`, a module-level layer, a sub-layer kept whole as opaque: the call is
traced every time) and holds only plain data in its other arguments. It is
kept under the kind the block had before it was traced.

Example:
    >>> templates = CallTemplates()
    >>> replayed = templates.replay(node, reads)          # None: not seen yet
    >>> templates.record(node, new_nodes, outputs, reads)  # after tracing it
"""

import keras
import numpy as np
import tensorflow as tf

from keras_ipu_plugin import _compat
from keras_ipu_plugin.frontend.replay.signatures import PLAIN
from keras_ipu_plugin.frontend.replay.signatures import Unknown
from keras_ipu_plugin.frontend.replay.signatures import block_signature
from keras_ipu_plugin.frontend.replay.signatures import call_signature
from keras_ipu_plugin.frontend.replay.signatures import frozen_tensor_arguments
from keras_ipu_plugin.frontend.replay.signatures import layer_signature
from keras_ipu_plugin.ir.graph import UNTRACED_MASK
from keras_ipu_plugin.ir.graph import Node
from keras_ipu_plugin.ir.graph import Value
from keras_ipu_plugin.ir.graph import map_values
from keras_ipu_plugin.layers.keras_ops.batch_sized import BatchSizedOperation
from keras_ipu_plugin.layers.keras_ops.random_draws import RandomDraw
from keras_ipu_plugin.layers.state.reads import HeldConstant
from keras_ipu_plugin.layers.state.reads import VariableRead
from keras_ipu_plugin.layers.tf_calls.tf_function import TFFunction


def output_specs_key(layer, args, kwargs, training):
    """A key for the output specs of `layer.call(*args, **kwargs)` on
    KerasTensors under `training`: equal keys, equal output specs (None:
    unknown). What converting uses to run each kind of block's `call` once
    for its output shapes.

    Example:
        >>> output_specs_key(block, (keras.KerasTensor((None, 4)),), {}, None)
    """
    signature = layer_signature(layer)
    if signature is None:
        return None
    try:
        return (signature, frozen_tensor_arguments((args, kwargs)), training)
    except (Unknown, TypeError):
        return None


class CallTemplates:
    """Traced calls by kind (see the module docstring), for one expansion.

    `traced` / `replayed` count the calls each way (what the tests check).
    """

    def __init__(self):
        self._templates = {}  # kind -> _Template, or None: traced each time
        self._before = {}  # node -> its kind, read before it was traced
        self.traced = 0
        self.replayed = 0

    def replay(self, node, reads):
        """`(new nodes, flat outputs)` for the call at `node`, replayed from
        a recorded call of the same kind; None when there is none (trace it,
        then `record`). `reads`: the graph's `ReadLayers`."""
        signed = _kind(node)
        if signed is None:
            return None
        key, objects, inputs = signed
        try:
            template = self._templates.get(key)
        except TypeError:  # an unhashable value in the key
            return None
        if template is None:
            self._before[node] = signed
            return None
        if len(template.outputs) != len(node.outputs):
            return None  # traced, it says why (`inline._trace`)
        self.replayed += 1
        return template.replay(node, objects, inputs, reads)

    def record(self, node, new_nodes, outputs, reads):
        """Keep the trace of the call at `node` (`new_nodes`, its flat
        `outputs`) for calls of the same kind, where it can be replayed."""
        self.traced += 1
        before = self._before.pop(node, None)
        if before is None:
            return
        # The kind read before tracing: `call` runs on a view of the block,
        # but what the view shares with it (a dict attribute) it may change,
        # and the trace is that of the block as it was.
        key, objects, inputs = before
        if key in self._templates:
            return
        try:
            self._templates[key] = _Template(node, objects, inputs, new_nodes, outputs, reads)
        except (Unknown, KeyError):  # KeyError: a value not from this call
            self._templates[key] = None  # traced each time


def _kind(node):
    """`(key, the block's objects, the call's input Values)`, or None."""
    block = block_signature(node.operation)
    if block is None:
        return None
    call = call_signature(node)
    if call is None:
        return None
    (block_key, objects), (call_key, inputs) = block, call
    return (block_key, call_key, node.training), objects, inputs


class _Ref:
    """Where a template's node finds a value: input `index` of the call
    (`node` None), or output `index` of its `node`-th node."""

    __slots__ = ("node", "index")

    def __init__(self, node, index):
        self.node, self.index = node, index


class _Template:
    """One traced call, node by node: how to make its operation for another
    block (`_maker`), its arguments with Values as `_Ref`s, its name after
    the call's prefix, training mode, output specs and structure; and each
    output's Keras mask as a `_Ref`."""

    def __init__(self, node, objects, inputs, new_nodes, outputs, reads):
        layer, prefix = node.operation, node.name + "."
        index = {}
        for position, item in enumerate(objects):
            index.setdefault(id(item), position)
        where = {value: _Ref(None, i) for i, value in enumerate(inputs)}
        refer = where.__getitem__  # KeyError: a value not from this call
        self.steps, masks = [], []
        for position, new in enumerate(new_nodes):
            if not new.name.startswith(prefix) or new.meta != _PLAIN_META:
                raise Unknown  # an opaque sub-layer, or a node named otherwise
            args, kwargs = map_values(refer, new.args), map_values(refer, new.kwargs)
            _check_constants((args, kwargs))
            self.steps.append((
                _maker(new, layer, index, reads), new.name[len(prefix):],
                args, kwargs, new.training, [value.spec for value in new.outputs],
                new.output_structure,
            ))
            for output_index, value in enumerate(new.outputs):
                where[value] = _Ref(position, output_index)
        for position, new in enumerate(new_nodes):
            for output_index, value in enumerate(new.outputs):
                if value.mask is not None:
                    mask = UNTRACED_MASK if value.mask is UNTRACED_MASK else refer(value.mask)
                    masks.append((position, output_index, mask))
        self.masks = masks
        self.outputs = [refer(value) for value in outputs]

    def replay(self, node, objects, inputs, reads):
        layer, prefix = node.operation, node.name + "."
        made = []

        def resolve(ref):
            return inputs[ref.index] if ref.node is None else made[ref.node].outputs[ref.index]

        for make, suffix, args, kwargs, training, specs, structure in self.steps:
            name = prefix + suffix
            new = Node(name, make(objects, layer, name, reads),
                       _resolved(resolve, args), _resolved(resolve, kwargs),
                       output_structure=structure, training=training)
            new.outputs = [Value(new, i, spec) for i, spec in enumerate(specs)]
            made.append(new)
        for position, output_index, mask in self.masks:
            made[position].outputs[output_index].mask = (
                mask if mask is UNTRACED_MASK else resolve(mask))
        return made, [resolve(ref) for ref in self.outputs]


_PLAIN_META = Node("", None, (), {}, None).meta  # what a traced node starts with


def _maker(node, layer, index, reads):
    """`make(objects, layer, name, reads)`: the operation of a node like
    `node` (of the trace of `layer`) for the block whose objects are
    `objects`, named `name`. Raises `Unknown` for a node it cannot make."""
    operation = node.operation
    own = index.get(id(operation))
    if own is not None:
        if own == 0 or not isinstance(operation, keras.layers.Layer):
            raise Unknown  # the block calling itself
        return lambda objects, layer, name, reads: objects[own]
    if isinstance(operation, VariableRead):
        place = index.get(id(operation.variable))
        if place is None or not reads.gives(operation, operation.variable, like=layer):
            raise Unknown  # not a variable of the block, or not read as it reads
        return lambda objects, layer, name, reads: reads.variable_read(
            objects[place], like=layer, name=name)
    if isinstance(operation, HeldConstant):
        if operation.name != node.name:
            raise Unknown
        value = operation.value
        return lambda objects, layer, name, reads: HeldConstant(value, name=name)
    if isinstance(operation, RandomDraw):
        return _draw_maker(operation, index)
    if isinstance(operation, BatchSizedOperation):
        inner = _operation_maker(operation.operation)
        attributes, multiples = operation.attributes, dict(operation.multiples)
        offsets, divisors = dict(operation.offsets), dict(operation.divisors)
        op_name = operation.name  # renamed after its node once inlined
        return lambda objects, layer, name, reads: BatchSizedOperation(
            inner(), attributes, multiples=multiples, offsets=offsets, divisors=divisors,
            name=op_name)
    if isinstance(operation, keras.layers.Layer):
        raise Unknown  # a layer not the block's (made in `call`, a global, opaque)
    make = _operation_maker(operation)
    return lambda objects, layer, name, reads: make()


def _draw_maker(draw, index):
    seed = draw.seed_generator
    if isinstance(seed, keras.random.SeedGenerator):
        place = index.get(id(seed))
        if place is None:
            raise Unknown  # a generator not the block's own
        seed_of = lambda objects: objects[place]  # noqa: E731
    elif seed is None or (isinstance(seed, int) and not isinstance(seed, bool)):
        seed_of = lambda objects: seed  # noqa: E731
    else:
        raise Unknown
    fields = (draw.distribution, draw.draw_shape, dict(draw.arguments), draw.draw_dtype,
              draw.name)

    def make(objects, layer, name, reads):
        distribution, shape, arguments, dtype, draw_name = fields
        return RandomDraw(distribution, shape, dict(arguments), seed=seed_of(objects),
                          draw_dtype=dtype, name=draw_name)

    return make


def _operation_maker(operation):
    """`make()`: a new operation like `operation` (a `keras.ops` one or a
    `TFFunction`), as it is now (it is renamed after its node later)."""
    if isinstance(operation, keras.layers.Layer):
        raise Unknown
    if isinstance(operation, TFFunction):
        function, name = operation.function, operation.name
        return lambda: TFFunction(function, name=name)
    module = type(operation).__module__ or ""
    if not module.startswith(_compat.KERAS_OPERATION_MODULES):
        raise Unknown  # a user's operation may hold anything
    for attribute, value in vars(operation).items():
        if attribute not in _compat.OPERATION_BOOKKEEPING:
            _check_constants(value)
    prototype = _compat.copied_operation(operation)  # keeps its name as now
    return lambda: _compat.copied_operation(prototype)


_CONSTANTS = PLAIN + (slice, type(Ellipsis), np.ndarray, np.generic, np.dtype, tf.DType)


def _check_constants(structure):
    """Raise `Unknown` unless every leaf of `structure` other than a `_Ref`
    is data two blocks' nodes may share (numbers, strings, slices, arrays,
    TensorFlow constants), never an object of a block."""
    if isinstance(structure, _Ref) or isinstance(structure, _CONSTANTS):
        return
    if isinstance(structure, (list, tuple)):
        for item in structure:
            _check_constants(item)
        return
    if isinstance(structure, dict):
        for key, item in structure.items():
            _check_constants(key)
            _check_constants(item)
        return
    if isinstance(structure, tf.Tensor) and not isinstance(structure, keras.KerasTensor):
        return  # a concrete tensor (not a variable: those fail the trace)
    raise Unknown


def _resolved(resolve, structure):
    if isinstance(structure, _Ref):
        return resolve(structure)
    if isinstance(structure, dict):
        return {key: _resolved(resolve, item) for key, item in structure.items()}
    if isinstance(structure, tuple) and hasattr(structure, "_fields"):
        return type(structure)(*(_resolved(resolve, item) for item in structure))
    if isinstance(structure, (list, tuple)):
        return type(structure)(_resolved(resolve, item) for item in structure)
    return structure


__all__ = ["CallTemplates", "layer_signature", "output_specs_key"]
