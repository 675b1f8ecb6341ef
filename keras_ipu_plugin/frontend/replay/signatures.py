"""Block signatures: when two calls of two blocks trace to the same graph.

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
    >>> block_signature(model.blocks[0])[0] == block_signature(model.blocks[1])[0]
    True
"""

import functools
import inspect
import io
import textwrap
import tokenize
import weakref

import keras
import numpy as np

from keras_ipu_plugin import _compat
from keras_ipu_plugin.ir.graph import Value
from keras_ipu_plugin.layers.user_code import LIBRARY_PACKAGES


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
        >>> key, objects = block_signature(model.blocks[0])
        >>> objects[0] is model.blocks[0]
        True
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
        >>> layer_signature(model.blocks[0]) == layer_signature(model.blocks[1])
        True
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
        >>> class Tagged(keras.layers.Layer):
        ...     def call(self, x):
        ...         return x * 2 if self.name.endswith("_double") else x
        >>> reads_identity(Tagged)
        True
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
        >>> key, inputs = call_signature(graph.node("blocks.0"))
        >>> inputs[0].producer.name
        'embedding'
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


__all__ = ["Unknown", "block_signature", "layer_signature", "call_signature",
           "frozen_tensor_arguments", "reads_identity"]
