"""Trace each kind of block once: `CallTemplates` replays a traced call over
another block of the same kind.

A model of 200 identical residual blocks would otherwise trace 200 `call`s
that give the same graph up to which layer objects it calls; tracing is
most of what converting and expanding such a model costs. Two calls are
the same kind when their layers have the same `layer_signature` and their
inputs the same shapes, dtypes and non-tensor arguments:

- a user-written layer: its class, its plain attributes (numbers, strings,
  tuples, lists and dicts of them, functions by identity), its dtype
  policy and trainable flag, and those of its sub-layers and variables,
  recursively; its name and Keras's own bookkeeping are left out;
- one of Keras's layers: its class, its config without the name, and the
  shapes of its weights.

An attribute of any other kind (a NumPy array, an object of the user's)
makes the layer's signature unknown, and its calls are traced every time.
A template is kept only where every node of the trace calls a sub-layer of
the traced layer (no `keras.ops` operation, read or held constant, whose
objects a replay would have to copy, no opaque node, and no Keras mask on
its inputs or its values): replaying it calls the other block's sub-layer
at the same place among its layers.

Example:
    >>> templates = CallTemplates()
    >>> replayed = templates.replay(node)          # None: not seen yet
    >>> templates.record(node, new_nodes, outputs)  # after tracing it
"""

import keras

from keras_ipu_plugin import _compat
from keras_ipu_plugin.ir.graph import Node
from keras_ipu_plugin.ir.graph import Value
from keras_ipu_plugin.ir.graph import map_values
from keras_ipu_plugin.ir.graph import values_in
from keras_ipu_plugin.runtime.views import LIBRARY_PACKAGES


class _Unknown(Exception):
    """The signature cannot be told from what is cheap to compare."""


_PLAIN = (bool, int, float, complex, str, bytes, type(None))
_FUNCTION_TYPES = (type(len), type(lambda: None))
# Keras's own attributes of every layer: the same for blocks of one kind,
# or not read by `call` (node lists, trackers, the name and path); less
# `_COMPARED` (see `_skipped`).
_SKIPPED = None
# Of those, the ones a `call` (or its recorded nodes) depends on.
_COMPARED = ("_dtype_policy", "_trainable", "autocast", "built", "_supports_masking")


def layer_signature(layer):
    """A hashable summary of what `layer.call` depends on besides its
    inputs (see the module docstring), or None when not known.

    Example:
        >>> layer_signature(model.blocks[0]) == layer_signature(model.blocks[1])
        True
    """
    try:
        return _signature(layer)
    except (_Unknown, TypeError):  # TypeError: an unhashable value
        return None


def _signature(layer):
    if not layer.built:
        raise _Unknown  # building it may still change it
    cls = type(layer)
    weights = tuple(map(_compat.variable_signature, layer.weights))
    if (cls.__module__ or "").split(".")[0] in LIBRARY_PACKAGES:
        return (cls, _library_config(layer), weights, layer.dtype_policy.name,
                layer.trainable)
    skipped = _skipped()
    items = tuple(
        (name, _value_signature(value)) for name, value in vars(layer).items()
        if name not in skipped and not name.startswith("_self_")
    )
    return (cls, items, weights)


def _library_config(layer):
    """A Keras layer's constructor arguments (cheap), else its config."""
    for config in (_compat.constructor_config(layer), None):
        try:
            config = dict(layer.get_config()) if config is None else config
            config.pop("name", None)
            return _frozen(config)
        except TypeError:  # an argument that cannot be hashed: the full config
            continue
    raise _Unknown


def _skipped():
    """The attribute names a signature leaves out: Keras's own but those
    in `_COMPARED`."""
    global _SKIPPED
    if _SKIPPED is None:
        _SKIPPED = (frozenset(vars(keras.layers.Layer(name="kip_bare"))) | {
            "_auto_config", "_build_shapes_dict", "build", "quantize",
            "_call_signature", "call_signature_parameters", "_called",
            "_convert_input_args", "_allow_non_tensor_positional_args",
        }) - frozenset(_COMPARED)
    return _SKIPPED


def _value_signature(value):
    if isinstance(value, _PLAIN):
        return (type(value), value)
    if isinstance(value, keras.layers.Layer):
        return ("layer", _signature(value))
    if isinstance(value, keras.Variable):
        return ("variable", *_compat.variable_signature(value))
    if isinstance(value, keras.DTypePolicy):
        return ("policy", value.name)
    if isinstance(value, dict):
        return ("dict", tuple((key, _value_signature(item)) for key, item in value.items()))
    if isinstance(value, (list, tuple)):
        return ("sequence", tuple(_value_signature(item) for item in value))
    if isinstance(value, _FUNCTION_TYPES):
        return ("function", value)
    raise _Unknown


def _frozen(config):
    if isinstance(config, dict):
        return tuple((key, _frozen(item)) for key, item in config.items())
    if isinstance(config, (list, tuple)):
        return tuple(_frozen(item) for item in config)
    hash(config)
    return config


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
        return (signature, _frozen_arguments((args, kwargs)), training)
    except (_Unknown, TypeError):
        return None


def _arguments_signature(node):
    """The shapes and dtypes of the node's input Values, and its other
    arguments as they are (None when one of those is not plain data)."""
    try:
        return _frozen_arguments((node.args, node.kwargs))
    except (_Unknown, TypeError):
        return None


def _frozen_arguments(structure):
    def frozen(item):
        if isinstance(item, Value):
            return ("value", tuple(item.spec.shape), item.spec.dtype)
        if isinstance(item, keras.KerasTensor):
            return ("tensor", tuple(item.shape), item.dtype, item.sparse, item.ragged)
        if isinstance(item, _PLAIN):
            return (type(item), item)
        if isinstance(item, dict):
            return ("dict", tuple((key, frozen(child)) for key, child in item.items()))
        if isinstance(item, (list, tuple)):
            return (type(item).__name__, tuple(frozen(child) for child in item))
        raise _Unknown

    return frozen(structure)


class _Ref:
    """Where a template's node finds a value: input `index` of the call
    (`node` None), or output `index` of its `node`-th node."""

    __slots__ = ("node", "index")

    def __init__(self, node, index):
        self.node, self.index = node, index


class _Template:
    """One traced call, by position: each node as (index of its layer among
    the traced layer's layers, its arguments with Values as references,
    its training mode, its output specs)."""

    def __init__(self, layer, inputs, nodes, outputs):
        index = {id(sub): i for i, sub in enumerate(_compat.all_layers(layer))}
        where = {value: _Ref(None, i) for i, value in enumerate(inputs)}
        self.steps = []
        for position, node in enumerate(nodes):
            if (id(node.operation) not in index or node.opaque_reason
                    or node.made_by_pass or node.operation is layer
                    # Keras masks are kept out of templates: a replay would
                    # have to point them at the other call's values.
                    or any(value.mask is not None for value in node.outputs)):
                raise _Unknown
            refer = lambda value: where[value]  # noqa: E731 - KeyError: not from here
            self.steps.append((
                index[id(node.operation)],
                map_values(refer, node.args), map_values(refer, node.kwargs),
                node.training, [value.spec for value in node.outputs],
                node.output_structure,
            ))
            for output_index, value in enumerate(node.outputs):
                where[value] = _Ref(position, output_index)
        self.outputs = [where[value] for value in outputs]
        self.size = len(index)

    def replay(self, layer, inputs):
        layers = _compat.all_layers(layer)
        if len(layers) != self.size:
            return None
        made = []

        def resolve(ref):
            return inputs[ref.index] if ref.node is None else made[ref.node].outputs[ref.index]

        for layer_index, args, kwargs, training, specs, structure in self.steps:
            operation = layers[layer_index]
            node = Node(operation.name, operation,
                        _resolve_nest(resolve, args), _resolve_nest(resolve, kwargs),
                        output_structure=structure, training=training)
            node.outputs = [Value(node, index, spec) for index, spec in enumerate(specs)]
            made.append(node)
        return made, [resolve(reference) for reference in self.outputs]


def _resolve_nest(resolve, structure):
    if isinstance(structure, _Ref):
        return resolve(structure)
    if isinstance(structure, dict):
        return {key: _resolve_nest(resolve, item) for key, item in structure.items()}
    if isinstance(structure, tuple) and hasattr(structure, "_fields"):
        return type(structure)(*(_resolve_nest(resolve, item) for item in structure))
    if isinstance(structure, (list, tuple)):
        return type(structure)(_resolve_nest(resolve, item) for item in structure)
    return structure


class CallTemplates:
    """Traced calls by kind (see the module docstring), for one expansion."""

    def __init__(self):
        self._templates = {}

    def _key(self, node):
        signature = layer_signature(node.operation)
        if signature is None:
            return None
        arguments = _arguments_signature(node)
        if arguments is None:
            return None
        if any(value.mask is not None for value in node.input_values):
            # `call` is handed the masks its inputs carry (see
            # `passes.inline`): such a call is traced every time.
            return None
        return (signature, arguments, node.training)

    def replay(self, node):
        """`(new nodes, flat outputs)` for the call at `node`, replayed from
        a recorded call of the same kind; None when there is none."""
        key = self._key(node)
        template = self._templates.get(key) if key is not None else None
        if template is None:
            return None
        return template.replay(node.operation, values_in((node.args, node.kwargs)))

    def record(self, node, new_nodes, outputs):
        """Keep the trace of the call at `node` (`new_nodes`, its flat
        `outputs`) for calls of the same kind, where it can be replayed."""
        key = self._key(node)
        if key is None or key in self._templates:
            return
        try:
            self._templates[key] = _Template(
                node.operation, values_in((node.args, node.kwargs)), new_nodes, outputs)
        except (_Unknown, KeyError):
            self._templates[key] = None  # traced each time
