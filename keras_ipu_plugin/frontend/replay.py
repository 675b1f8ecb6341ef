"""Trace each kind of block once and replay it over the others: block
signatures (when two calls trace to the same graph) and call templates (a
traced call replayed over another block). One concept: replay.

Block signatures: when two calls of two blocks trace to the same graph.

Tracing `call` runs the user's Python; what it records can depend on the
block only through what that Python reads. Two blocks have the same
signature (`block_signature`) when everything a `call` may read of them is
equal, so that tracing either gives the same graph up to which of the
block's own objects (sub-layers, variables, seed generators) each node
uses:

- a user-written layer: its class, its plain attributes (numbers, strings,
  tuples, lists and dicts of them, small NumPy arrays by value, functions
  by identity), its dtype policy, trainable flag and `autocast`, the
  shapes and dtypes of its weights, and those of its sub-layers, seed
  generators and variables, recursively. Keras's own bookkeeping is left
  out: the same for blocks of one kind, or never read by `call`, with one
  exception: a class whose code reads a layer's `name` or `path` (or its
  identity: `id`, `getattr`, `vars`, `__dict__`) has the block's name and
  path in its signature, so each block of it is traced;
- one of Keras's layers: its class, its constructor config without the
  name, the shapes of its weights and the classes of its sub-layers.

The signature also holds which of the block's objects are the same object
(`objects` lists them in the order the signature met them; a block holding
one Dense twice is not one holding two). A value of any other kind (an
object of the user's, a large array) makes the signature unknown (None),
and the block is traced every time.

`call_signature(node)`: the same for the inputs of one call: the shapes,
dtypes and Keras masks of its graph values, which of them are the same
value, and its other arguments as they are.

What no signature can see is Python state outside the block (a global
`call` branches on, a counter it increments): `call` is assumed to compute
from its block and its arguments, as converting assumes of it anyway.

Example:
    ```python
    block_signature(model.blocks[0])[0] == block_signature(model.blocks[1])[0]
    # -> True
    ```

Trace each kind of block once: `CallTemplates` replays a traced call over
another block of the same kind.

A model of 200 identical residual blocks would otherwise trace 200 `call`s
that give the same graph up to which of the block's objects each node
uses; tracing is most of what converting and expanding such a model costs.
Two calls are of one kind when their blocks have the same signature
(`block_signature`: class, attributes, sub-layers, weights'
shapes, which objects are shared) and their inputs the same
(`call_signature`: shapes, dtypes, Keras masks, which inputs are
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
    ```python
    templates = CallTemplates()
    replayed = templates.replay(node, reads)          # None: not seen yet
    templates.record(node, new_nodes, outputs, reads)  # after tracing it
    ```
"""

import functools
import inspect
import io
import textwrap
import tokenize
import weakref

import keras
import numpy as np
import tensorflow as tf

from keras_ipu_plugin import _compat
from keras_ipu_plugin.ir.graph import Value, UNTRACED_MASK, Node, map_values
from keras_ipu_plugin.layers.keras_ops.batch_sized import BatchSizedOperation
from keras_ipu_plugin.layers.keras_ops.random_draws import RandomDraw
from keras_ipu_plugin.layers.state import HeldConstant, VariableRead
from keras_ipu_plugin.layers.tf_calls import TFFunction
from keras_ipu_plugin.layers.user_code import LIBRARY_PACKAGES

__all__ = [
    "Unknown",
    "block_signature",
    "layer_signature",
    "call_signature",
    "frozen_tensor_arguments",
    "reads_identity",
    "CallTemplates",
    "layer_signature",
    "output_specs_key",
]


class Unknown(Exception):
    """The signature cannot be told from what is cheap to compare."""


PLAIN = (bool, int, float, complex, str, bytes, type(None))
_FUNCTION_TYPES = (type(len), type(lambda: None))
# Keras's own attributes of every layer: the same for blocks of one kind,
# or not read by `call` (node lists, trackers, the name and path); less
# `_COMPARED` (see `_skipped`).
_SKIPPED = None
# Of those, the ones a `call` (or its recorded nodes) depends on.
_COMPARED = ("_dtype_policy", "_trainable", "autocast", "built", "_supports_masking")
# The largest NumPy attribute compared by value (bigger ones: unknown).
_LARGEST_ARRAY = 1 << 16


def block_signature(layer):
    """`(key, objects)` for `layer` (see the module docstring): `key` is
    hashable, equal for blocks whose `call` traces alike; `objects` are the
    block's layers, variables and seed generators in the order the
    signature met them (the same positions in two blocks with equal keys
    are counterparts). None when not known.

    Example:
        ```python
        key, objects = block_signature(model.blocks[0])
        objects[0] is model.blocks[0]
        # -> True
        ```
    """
    objects = []
    try:
        key = _signature(layer, objects, set())
    except (Unknown, TypeError, RecursionError):  # TypeError: an unhashable value
        return None
    # Which objects are one object: `first[i]` is where object i was met first.
    seen, first = {}, []
    for index, item in enumerate(objects):
        first.append(seen.setdefault(id(item), index))
    return (key, tuple(first)), objects


def layer_signature(layer):
    """The key of `block_signature(layer)`, or None when not known.

    Example:
        ```python
        layer_signature(model.blocks[0]) == layer_signature(model.blocks[1])
        # -> True
        ```
    """
    signed = block_signature(layer)
    return None if signed is None else signed[0]


def _signature(layer, objects, active):
    if not layer.built:
        raise Unknown  # building it may still change it
    if id(layer) in active:
        raise Unknown  # a layer holding its own parent
    objects.append(layer)
    cls = type(layer)
    # Not the user-code rule (`user_code.is_user_module`) on purpose: a class
    # of a library package, Keras's applications included, is described by
    # its config; the rule's exception for applications is about tracing
    # through their `call`, not about what tells two of them apart.
    if (cls.__module__ or "").split(".")[0] in LIBRARY_PACKAGES:
        inner = _compat.sub_layers(layer)
        objects.extend(inner)
        weights = tuple(map(_compat.variable_signature,
                            layer.weights if inner else _compat.own_variables(layer)))
        return (cls, _library_config(layer), weights, layer.dtype_policy.name,
                layer.trainable, tuple(map(type, inner)))
    # Its own variables: its sub-layers' are in their own signatures.
    weights = tuple(map(_compat.variable_signature, _compat.own_variables(layer)))
    skipped = _skipped()
    active.add(id(layer))
    try:
        items = tuple(
            (name, _value_signature(value, objects, active))
            for name, value in vars(layer).items()
            if name not in skipped and not name.startswith("_self_")
        )
    finally:
        active.discard(id(layer))
    identity = (layer.name, getattr(layer, "path", None)) if reads_identity(cls) else None
    return (cls, items, weights, identity)


def _library_config(layer):
    """A Keras layer's constructor arguments (cheap), else its config."""
    try:
        return _CONSTRUCTOR_CONFIGS[layer]
    except (KeyError, TypeError):
        pass
    for config in (_compat.constructor_config(layer), None):
        try:
            frozen = _frozen(dict(layer.get_config()) if config is None else config,
                             leave_out="name")
        except TypeError:  # an argument that cannot be hashed: the full config
            continue
        except NotImplementedError:
            # Keras has no config of a layer made with an argument it cannot
            # serialize (keras_hub's DINOv2: `layers.Identity(dtype=self.dtype_policy)`):
            # a block holding one has no signature and is traced on its own
            raise Unknown from None
        if config is not None:
            # Kept: the arguments a layer was made with never change (its
            # full config may, with its attributes: read every time).
            try:
                _CONSTRUCTOR_CONFIGS[layer] = frozen
            except TypeError:  # a layer that cannot be a weak key
                pass
        return frozen
    raise Unknown


_CONSTRUCTOR_CONFIGS = weakref.WeakKeyDictionary()  # layer -> its frozen constructor config


def _skipped():
    """The attribute names a signature leaves out: Keras's own but those
    in `_COMPARED`."""
    global _SKIPPED
    if _SKIPPED is None:
        _SKIPPED = (_compat.layer_bookkeeping_attributes() | {
            "_auto_config", "_build_shapes_dict", "build", "quantize",
            "_call_signature", "call_signature_parameters", "_called",
            "_convert_input_args", "_allow_non_tensor_positional_args",
        }) - frozenset(_COMPARED)
    return _SKIPPED


def _value_signature(value, objects, active):
    if isinstance(value, PLAIN):
        return (type(value), value)
    if isinstance(value, keras.layers.Layer):
        return ("layer", _signature(value, objects, active))
    if isinstance(value, keras.Variable):
        objects.append(value)
        return ("variable", *_compat.variable_signature(value))
    if isinstance(value, keras.random.SeedGenerator):
        # Its seed and state are its numbers, not the graph: a draw from it
        # is a node holding the generator (each block its own).
        objects.append(value)
        return ("seed generator", type(value))
    if isinstance(value, keras.DTypePolicy):
        return ("policy", value.name)
    if isinstance(value, dict):
        return ("dict", type(value), tuple(
            ((type(key), key), _value_signature(item, objects, active))
            for key, item in value.items()))
    if isinstance(value, (list, tuple)):
        return ("sequence", type(value),
                tuple(_value_signature(item, objects, active) for item in value))
    if isinstance(value, _FUNCTION_TYPES):
        return ("function", value)
    if isinstance(value, np.ndarray) and value.size <= _LARGEST_ARRAY and value.dtype.kind in "biufc":
        return ("array", value.dtype.str, value.shape, value.tobytes())
    raise Unknown


def _frozen(config, leave_out=None):
    if isinstance(config, dict):
        return tuple((key, _frozen(item)) for key, item in config.items() if key != leave_out)
    if isinstance(config, (list, tuple)):
        return tuple(_frozen(item) for item in config)
    hash(config)
    return config


# What a class's code may reach a layer's identity by: its name and path,
# or a lookup that could reach them.
_IDENTITY_ATTRIBUTES = frozenset({"name", "path", "_name", "_path", "_parent_path", "__dict__"})
_IDENTITY_CALLS = frozenset({"id", "getattr", "vars", "hash"})
# Methods that do not run when a built layer is called.
_NOT_CALLED = frozenset({"__init__", "build", "get_config", "from_config",
                         "compute_output_shape", "get_build_config", "build_from_config"})


@functools.lru_cache(maxsize=None)
def reads_identity(cls):
    """Whether the code of `cls` (its own methods and those of its user
    base classes, but those that do not run in a call) may read a layer's
    name or path: `.name`, `.path`, `id(...)`, `getattr(...)`, `vars(...)`,
    `__dict__`. Unknown source counts as yes.

    Example:
        ```python
        class Tagged(keras.layers.Layer):
            def call(self, x):
                return x * 2 if self.name.endswith("_double") else x
        reads_identity(Tagged)
        # -> True
        ```
    """
    for klass in cls.__mro__:
        if (klass.__module__ or "").split(".")[0] in LIBRARY_PACKAGES or klass is object:
            continue
        for name, member in vars(klass).items():
            if name in _NOT_CALLED:
                continue
            function = getattr(member, "__func__", member)  # static / class methods
            if isinstance(member, property):
                function = member.fget
            if not inspect.isfunction(function):
                continue
            if _mentions_identity(function):
                return True
    return False


def _mentions_identity(function):
    try:
        source = textwrap.dedent(inspect.getsource(function))
        tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    except (OSError, TypeError, tokenize.TokenError, IndentationError):
        return True
    for before, token, after in zip(tokens, tokens[1:], tokens[2:]):
        if token.type != tokenize.NAME:
            continue
        if token.string in _IDENTITY_ATTRIBUTES and before.string == ".":
            return True
        if token.string in _IDENTITY_CALLS and after.string == "(" and before.string != ".":
            return True
        if token.string == "__dict__":
            return True
    return False


def call_signature(node):
    """`(key, inputs)` for the call at `node`: `inputs` are the graph Values
    it reads, then the Keras masks they carry, each once, in that order;
    `key` holds its arguments with each Value as its place in `inputs`, and
    each input's shape, dtype and mask (its place in `inputs`, None, or
    untraced). None when an argument is not plain data.

    Example:
        ```python
        key, inputs = call_signature(graph.node("blocks.0"))
        inputs[0].producer.name
        # -> 'embedding'
        ```
    """
    places, inputs = {}, []

    def place(value):
        index = places.get(value)
        if index is None:
            index = places[value] = len(inputs)
            inputs.append(value)
        return index

    try:
        arguments = _frozen_arguments((node.args, node.kwargs), place)
    except (Unknown, TypeError):
        return None
    index = 0
    while index < len(inputs):  # the masks, and the masks of masks
        mask = inputs[index].mask
        if isinstance(mask, Value):
            place(mask)
        index += 1
    described = tuple(
        (tuple(value.spec.shape), value.spec.dtype, bool(value.spec.sparse),
         bool(value.spec.ragged),
         places[value.mask] if isinstance(value.mask, Value) else value.mask)
        for value in inputs
    )
    return (arguments, described), inputs


def frozen_tensor_arguments(structure):
    """`structure` (arguments holding KerasTensors) as a hashable key: each
    tensor by its shape, dtype, sparse and ragged flags. Raises `Unknown`
    (or TypeError) when an argument is not plain data."""
    return _frozen_arguments(structure, None)


def _frozen_arguments(structure, place):
    def frozen(item):
        if isinstance(item, Value):
            return ("value", place(item))
        if isinstance(item, keras.KerasTensor):
            return ("tensor", tuple(item.shape), item.dtype, item.sparse, item.ragged)
        if isinstance(item, PLAIN):
            return (type(item), item)
        if isinstance(item, dict):
            return ("dict", tuple((key, frozen(child)) for key, child in item.items()))
        if isinstance(item, (list, tuple)):
            return (type(item).__name__, tuple(frozen(child) for child in item))
        raise Unknown

    return frozen(structure)


def output_specs_key(layer, args, kwargs, training):
    """A key for the output specs of `layer.call(*args, **kwargs)` on
    KerasTensors under `training`: equal keys, equal output specs (None:
    unknown). What converting uses to run each kind of block's `call` once
    for its output shapes.

    Example:
        ```python
        output_specs_key(block, (keras.KerasTensor((None, 4)),), {}, None)
        ```
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
