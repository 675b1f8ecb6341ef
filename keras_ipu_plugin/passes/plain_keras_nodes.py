"""kip's own node kinds written with Keras's classes only, for `to_keras`.

A traced graph holds a few node kinds of kip's own: a layer reading its own
weight (`VariableRead`), a fixed tensor (`HeldConstant`), a `keras.ops` call
sized by the batch (`BatchSizedOperation`), a TensorFlow function
(`TFFunction`). Where Keras's own classes compute exactly the same values,
`to_keras` writes the node with them, so the file loads without kip:

- a weight read: a Keras `Embedding` holding the weight's values (reshaped
  to `(rows, columns)`: the first dimension, then the others), called on
  the indices `0 .. rows - 1` and reshaped back. A lookup copies values
  exactly; its dtype policy gives the read's dtype, and it trains the
  weight as the read did. A weight another node also holds (a tied
  embedding) is refused: the file would hold two copies that train apart.
- a fixed tensor: `ops.where(True, value, value)`, the value kept in the
  file's config.
- a batch-sized `reshape`: the batch dimension written as -1, where the
  element counts make that exact for every batch size; a batch-sized
  `broadcast_to` / `tile` of a tensor whose batch dimension is 1: the
  tensor selected by `ops.where` under a mask of the batch's size.
- a TensorFlow function: the `keras.ops` function of `TF_AS_KERAS_OPS`
  whose TensorFlow implementation is that very function (an explicit
  table, with the argument mapping of each entry).

Indices and masks come from a graph tensor (`ops.ones_like`, `ops.all`): a
functional model needs every node reachable from its inputs, and their
values never depend on the tensor's values. Every written node's dtype is
checked against the graph's; anything else is named in `to_keras`'s error.

Example:
    ```python
    form = keras_form(node, GraphFacts(graph))   # a writer, or why not
    outputs = form(args, kwargs, masks) if callable(form) else None
    ```
"""

import inspect
import math

import keras
import numpy as np
from keras import ops

from keras_ipu_plugin.errors import PassError
from keras_ipu_plugin.ir.graph import Value
from keras_ipu_plugin.ir.graph import map_leaves
from keras_ipu_plugin.ir.graph import values_in
from keras_ipu_plugin.layers.keras_ops.batch_sized import BatchSizedOperation
from keras_ipu_plugin.layers.state import HeldConstant
from keras_ipu_plugin.layers.state import VariableRead
from keras_ipu_plugin.layers.tf_calls import TFFunction
from keras_ipu_plugin.layers.tf_calls import function_at
from keras_ipu_plugin.layers.user_code import is_keras_module


class Masks:
    """What the written nodes of one plain model share: tensors computed
    from a graph tensor's shape only, made once per tensor (`true(x)`: a
    scalar True; `batch(x, rank)`: True of shape `(batch, 1, ..., 1)`;
    `indices(x, n)`: the int32 indices `0 .. n - 1`), one layer per kip
    layer (`layer(operation, make)`: a read called at several nodes is one
    Embedding called at each), and `name(path)`, the model's unique layer
    name for a node path."""

    def __init__(self, name):
        self._made = {}
        self.name = name

    def layer(self, operation, make):
        return self._once(("layer", id(operation)), make)

    def _once(self, key, make):
        if key not in self._made:
            self._made[key] = make()
        return self._made[key]

    def _ones(self, x):
        return self._once(("ones", id(x)), lambda: ops.ones_like(x, dtype="bool"))

    def true(self, x):
        return self._once(("true", id(x)), lambda: ops.all(self._ones(x)))

    def batch(self, x, rank):
        def make():
            mask = self._ones(x)
            if len(x.shape) > 1:
                mask = ops.all(mask, axis=tuple(range(1, len(x.shape))))
            return ops.reshape(mask, (-1,) + (1,) * (rank - 1))
        return self._once(("batch", id(x), rank), make)

    def indices(self, x, count):
        def make():
            zero = ops.zeros_like(self.true(x), dtype="int32")
            return ops.add(zero, np.arange(count, dtype="int32"))
        return self._once(("indices", id(x), count), make)


class GraphFacts:
    """What writing one node needs to know of the rest of `graph`:
    `holders` (`{id(variable): {id(layer): first node calling it}}`, the
    layers holding each variable) and `shape_at(value, batch)`, the shape of
    a graph tensor when the graph runs on a batch of `batch` (None where
    that cannot be worked out), from the operations' own output specs."""

    def __init__(self, graph):
        self.graph = graph
        self.holders = {}
        for node in graph.nodes:
            operation = node.operation
            if isinstance(operation, keras.layers.Layer):
                for variable in operation.weights:
                    self.holders.setdefault(id(variable), {}).setdefault(id(operation), node.name)
        self._shapes = {}  # batch -> {id(value): shape or None}

    def shape_at(self, value, batch):
        shapes = self._shapes.setdefault(batch, {})
        if id(value) not in shapes:
            self._work_out(value, batch, shapes)
        return shapes[id(value)]

    def _work_out(self, value, batch, shapes):
        needed, stack = set(), [value]
        while stack:  # the producers `value` depends on, not yet worked out
            current = stack.pop()
            producer = current.producer
            if id(current) in shapes or producer is None or id(producer) in needed:
                continue
            needed.add(id(producer))
            stack.extend(values_in((producer.args, producer.kwargs)))
        for spec, input_value in zip(keras.tree.flatten(self.graph.input_specs),
                                     keras.tree.flatten(self.graph.input_values)):
            if id(input_value) not in shapes:
                shape = (batch,) + tuple(spec.shape)
                shapes[id(input_value)] = None if None in shape else shape
        for node in self.graph.nodes:
            if id(node) in needed:
                self._node_shapes(node, shapes)

    def _node_shapes(self, node, shapes):
        known = True

        def spec(leaf):
            nonlocal known
            if not isinstance(leaf, Value):
                return leaf
            shape = shapes.get(id(leaf))
            known = known and shape is not None
            return keras.KerasTensor(shape or leaf.spec.shape, leaf.spec.dtype)

        args, kwargs = map_leaves(spec, node.args), map_leaves(spec, node.kwargs)
        kwargs.pop("training", None)
        outputs = None
        if known:
            try:
                outputs = keras.tree.flatten(node.operation.compute_output_spec(*args, **kwargs))
            except Exception:  # noqa: BLE001 - then its sizes are not known
                outputs = None
        for index, output in enumerate(node.outputs):
            shape = None
            if outputs is not None and index < len(outputs) and len(
                    outputs[index].shape) == len(output.spec.shape):
                # A size the graph knows holds at every batch size; an output
                # spec may leave it unknown (EinsumDense's partial shapes).
                shape = tuple(known if dim is None else dim
                              for dim, known in zip(outputs[index].shape, output.spec.shape))
            shapes[id(output)] = None if shape is None or None in shape else shape


def keras_form(node, facts):
    """A function `write(args, kwargs, masks)` computing `node`'s outputs
    with Keras's own classes (args and kwargs: the node's, graph tensors
    given as Keras tensors), or a string saying why there is none (None
    where the node is not one of kip's kinds written here)."""
    operation = node.operation
    if isinstance(operation, VariableRead):
        return _read_form(node, facts.holders)
    if isinstance(operation, HeldConstant):
        return _constant_form(node)
    if isinstance(operation, BatchSizedOperation):
        return _batch_sized_form(node, facts)
    if isinstance(operation, TFFunction):
        return _tf_function_form(node)
    return None


def checked_outputs(node, outputs):
    """`outputs` (the written node's Keras tensors), once their dtypes are
    the graph's and their known sizes agree; a `kip.PassError` naming the
    node otherwise."""
    outputs = keras.tree.flatten(outputs)
    expected = [value.spec for value in node.outputs]
    problem = None
    if len(outputs) != len(expected):
        problem = f"{len(outputs)} outputs where the graph has {len(expected)}"
    for got, spec in zip(outputs, expected):
        if problem:
            break
        if keras.backend.standardize_dtype(got.dtype) != keras.backend.standardize_dtype(
                spec.dtype):
            problem = f"dtype {got.dtype} where the graph has {spec.dtype}"
        elif len(got.shape) != len(spec.shape) or any(
                a is not None and b is not None and a != b
                for a, b in zip(got.shape, spec.shape)):
            problem = f"shape {got.shape} where the graph has {spec.shape}"
    if problem:
        raise PassError(
            f"to_keras: `{node.name}` ({type(node.operation).__name__}) written with Keras's "
            f"classes gives {problem}; it cannot be written exactly without kip.")
    return outputs


# -- a weight read ------------------------------------------------------------------
def _read_form(node, holders):
    read = node.operation
    variable = read.variable
    others = [name for layer, name in holders.get(id(variable), {}).items()
              if layer != id(read)]
    if others:
        return (f"reads the weight `{variable.path}` that `{others[0]}` also holds: a file of "
                "Keras's classes would hold two copies, which train apart")
    stored = keras.backend.standardize_dtype(variable.dtype)
    given = keras.backend.standardize_dtype(node.outputs[0].spec.dtype)
    if given == stored:
        policy = stored
    elif stored == "float32" and given in ("float16", "bfloat16"):
        policy = f"mixed_{given}"
    else:
        return f"reads a {stored} weight as {given}, which no Keras dtype policy does"
    trainable = bool(read.trainable and variable.trainable)
    if "float" not in stored and ("int" not in stored or trainable):
        return (f"reads a {'trainable ' if trainable else ''}{stored} weight (a Keras "
                "Embedding holds floating-point weights, or integers it does not train)")
    shape = tuple(variable.shape)
    rows = shape[0] if len(shape) >= 2 else 1
    columns = math.prod(shape) // rows if rows else 0
    if not rows or not columns:
        return f"reads the empty weight `{variable.path}`"

    def make(name):
        layer = keras.layers.Embedding(
            rows, columns, dtype=policy, embeddings_initializer="zeros",
            trainable=trainable, name=name)
        layer.build((rows,))
        layer.set_weights([np.asarray(variable.numpy()).reshape(rows, columns)])
        return layer

    def write(args, kwargs, masks):
        del kwargs
        layer = masks.layer(read, lambda: make(masks.name(node.name)))
        return ops.reshape(layer(masks.indices(args[0], rows)), shape)

    return write


# -- a fixed tensor -----------------------------------------------------------------
def _constant_form(node):
    value = np.asarray(node.operation.value)
    if value.dtype.kind not in "biuf":
        return f"holds a constant of dtype {value.dtype} (Keras configs hold numbers)"

    def write(args, kwargs, masks):
        del kwargs
        return ops.where(masks.true(args[0]), value, value)

    return write


# -- a keras.ops call sized by the batch -------------------------------------------
def _batch_sized_form(node, facts):
    sized = node.operation
    operation = sized.operation
    name = type(operation).__name__
    if not is_keras_module(type(operation).__module__):
        return f"sizes a {name} by the batch"
    steps = {attribute: (sized.multiples.get(attribute), sized.offsets.get(attribute),
                         sized.divisors.get(attribute)) for attribute in sized.attributes}
    if name == "Reshape" and list(sized.attributes) == ["newshape"]:
        return _batch_reshape_form(node, facts, operation, steps)
    if name in ("BroadcastTo", "Tile") and len(sized.attributes) == 1:
        attribute = sized.attributes[0]
        return _batch_broadcast_form(node, operation, attribute, *steps[attribute])
    return f"sizes `{name}`'s {', '.join(sized.attributes)} by the batch"


def _only_first(values, default):
    """Whether a per-dimension list of multiples/offsets/divisors (or None)
    is `default` everywhere but perhaps at the first dimension."""
    return values is None or all(v == default for v in list(values)[1:])


def _batch_reshape_form(node, facts, operation, steps):
    newshape = list(operation.newshape)
    why = "reshapes to a batch-sized shape that -1 does not write exactly"
    if len(node.args) < 2 or newshape.count(None) != 1 or newshape.count(-1) > 1:
        return why
    anchor, source = node.args[0], node.args[1]
    if [dim for dim in source.spec.shape if dim is None] != [None]:
        return why
    step = math.lcm(*[divisor for _, _, divisors in steps.values()
                      for divisor in keras.tree.flatten(divisors or [1])])
    # The source's unknown dimension and the target's are each linear in the
    # batch size (as traced): a written reshape giving the target's shape at
    # two batch sizes gives it at every one.
    sizes = (2 * step, 3 * step)
    shapes = [(facts.shape_at(source, batch), facts.shape_at(anchor, batch)) for batch in sizes]
    if any(shape is None for pair in shapes for shape in pair):
        return why + " (its sizes could not be worked out)"
    expected = [tuple(node.operation.compute_output_spec(
        keras.KerasTensor(anchor_shape, anchor.spec.dtype),
        keras.KerasTensor(source_shape, source.spec.dtype)).shape)
        for source_shape, anchor_shape in shapes]
    fill = None
    if -1 in newshape:
        at = newshape.index(-1)
        fill = expected[0][at]
        if expected[1][at] != fill:
            return why
    written = tuple(-1 if dim is None else fill if dim == -1 else dim for dim in newshape)
    unknown = written.index(-1)
    others = math.prod(dim for dim in written if dim != -1)
    for (source_shape, _), want in zip(shapes, expected):
        count = math.prod(source_shape)
        got = written[:unknown] + (count // others,) + written[unknown + 1:]
        if count % others or got != want:
            return why

    def write(args, kwargs, masks):
        return ops.reshape(args[1], written)

    return write


def _batch_broadcast_form(node, operation, attribute, multiples, offsets, divisors):
    shape = list(getattr(operation, attribute))
    source = node.args[1].spec if len(node.args) > 1 else None
    why = f"{type(operation).__name__}s to a batch-sized shape other than a batch of one repeated"
    if (source is None or shape[:1] != [None] or None in shape[1:]
            or not _only_first(multiples, 1) or not _only_first(offsets, 0)
            or not _only_first(divisors, 1)
            or (multiples or [1])[0] != 1 or (offsets or [0])[0] != 0
            or (divisors or [1])[0] != 1):
        return why
    rank = len(shape)
    tile = type(operation).__name__ == "Tile"
    # The source's dimension the batch fills must be one (or missing, for
    # broadcast_to): the batch repeats it.
    aligned = list(source.shape) if tile else [None] * (rank - len(source.shape)) + list(
        source.shape)
    if len(aligned) != rank or aligned[0] not in (None, 1) or (tile and aligned[0] != 1) or (
            aligned[0] is None and len(source.shape) == rank):
        return why

    def write(args, kwargs, masks):
        x = args[1]
        one = ops.tile(x, [1] + shape[1:]) if tile else ops.broadcast_to(x, [1] + shape[1:])
        mask = masks.batch(args[0], rank)
        return ops.where(mask, one, one)

    return write


# -- a TensorFlow function ----------------------------------------------------------
def _unary(keras_function):
    return lambda a: keras_function(a["x"])


def _binary(keras_function):
    return lambda a: keras_function(a["x"], a["y"])


def _static_ints(value):
    """Whether `value` is an int or a (nested) list of ints, not tensors."""
    return all(isinstance(leaf, (int, np.integer)) and not isinstance(leaf, bool)
               for leaf in keras.tree.flatten(value))


def _reshape(a):
    if not _static_ints(a["shape"]):
        return "reshapes to a shape computed in the graph"
    return ops.reshape(a["tensor"], tuple(keras.tree.flatten(a["shape"])))


def _softmax(a):
    axis = -1 if a["axis"] is None else a["axis"]
    return ops.softmax(a["logits"], axis=axis)


def _crop(a):
    image, top, left, height, width = (a["image"], a["offset_height"], a["offset_width"],
                                       a["target_height"], a["target_width"])
    if not _static_ints([top, left, height, width]) or len(image.shape) not in (3, 4):
        return "crops at offsets or sizes computed in the graph"
    rows = slice(top, top + height)
    columns = slice(left, left + width)
    key = (rows, columns) if len(image.shape) == 3 else (slice(None), rows, columns)
    return image[key]


def _pad(a):
    image, top, left, height, width = (a["image"], a["offset_height"], a["offset_width"],
                                       a["target_height"], a["target_width"])
    rank = len(image.shape)
    if not _static_ints([top, left, height, width]) or rank not in (3, 4):
        return "pads to offsets or sizes computed in the graph"
    rows, columns = image.shape[rank - 3], image.shape[rank - 2]
    if rows is None or columns is None:
        return "pads an image of unknown size"
    widths = [[top, height - top - rows], [left, width - left - columns], [0, 0]]
    return ops.pad(image, ([[0, 0]] if rank == 4 else []) + widths)


def _patches(a):
    """`tf.image.extract_patches` of patches that tile the image (sizes equal
    to strides, rates 1, "VALID"): the same values moved by reshapes and a
    transpose (each patch's values in row, column, channel order, as
    TensorFlow's), where Keras's own `extract_patches` convolves (a product
    with 0 turns an inf into NaN)."""
    images, sizes, strides, rates = a["images"], a["sizes"], a["strides"], a["rates"]
    padding = a["padding"]
    if not (_static_ints([sizes, strides, rates]) and len(images.shape) == 4
            and isinstance(padding, str) and padding.upper() == "VALID"
            and list(sizes) == list(strides) and len(sizes) == 4
            and sizes[0] == sizes[3] == 1 and list(rates) == [1, 1, 1, 1]
            and None not in images.shape[1:]):
        return "extracts patches other than ones tiling an image of known size"
    _, height, width, channels = images.shape
    rows, columns = sizes[1], sizes[2]
    across, down = width // columns, height // rows
    if not across or not down:
        return "extracts patches larger than the image"
    if (down * rows, across * columns) != (height, width):
        images = images[:, :down * rows, :across * columns, :]
    patches = ops.reshape(images, (-1, down, rows, across, columns, channels))
    patches = ops.transpose(patches, (0, 1, 3, 2, 4, 5))
    return ops.reshape(patches, (-1, down, across, rows * columns * channels))


#: A TensorFlow function (by the path `TFFunction` saves) -> (the arguments
#: the Keras form reads, a function of the bound arguments giving the
#: Keras tensor, or a string saying why not). Each `keras.ops` function here
#: runs that very TensorFlow function on the TensorFlow backend (after a
#: cast to the result dtype, a no-op where the dtypes are TensorFlow's), so
#: the values are equal; any other argument given a value that is not its
#: default leaves the node to kip. `checked_outputs` checks the dtype.
TF_AS_KERAS_OPS = {
    "math.square": (("x",), _unary(ops.square)),
    "math.exp": (("x",), _unary(ops.exp)),
    "math.log": (("x",), _unary(ops.log)),
    "math.sqrt": (("x",), _unary(ops.sqrt)),
    "math.sin": (("x",), _unary(ops.sin)),
    "math.cos": (("x",), _unary(ops.cos)),
    "math.tanh": (("x",), _unary(ops.tanh)),
    "math.negative": (("x",), _unary(ops.negative)),
    "math.sigmoid": (("x",), _unary(ops.sigmoid)),
    "nn.relu": (("features",), lambda a: ops.relu(a["features"])),
    "math.logical_not": (("x",), _unary(ops.logical_not)),
    "math.logical_and": (("x", "y"), _binary(ops.logical_and)),
    "math.logical_or": (("x", "y"), _binary(ops.logical_or)),
    "math.add": (("x", "y"), _binary(ops.add)),
    "math.subtract": (("x", "y"), _binary(ops.subtract)),
    "math.multiply": (("x", "y"), _binary(ops.multiply)),
    "math.maximum": (("x", "y"), _binary(ops.maximum)),
    "math.minimum": (("x", "y"), _binary(ops.minimum)),
    "concat": (("values", "axis"), lambda a: ops.concatenate(list(a["values"]), axis=a["axis"])),
    "reshape": (("tensor", "shape"), _reshape),
    "transpose": (("a", "perm"), lambda a: ops.transpose(a["a"], axes=a["perm"])),
    "expand_dims": (("input", "axis"), lambda a: ops.expand_dims(a["input"], a["axis"])),
    "cast": (("x", "dtype"), lambda a: ops.cast(a["x"], keras.backend.standardize_dtype(
        a["dtype"]))),
    "stop_gradient": (("input",), lambda a: ops.stop_gradient(a["input"])),
    "nn.softmax": (("logits", "axis"), _softmax),
    "image.crop_to_bounding_box": (
        ("image", "offset_height", "offset_width", "target_height", "target_width"), _crop),
    "image.pad_to_bounding_box": (
        ("image", "offset_height", "offset_width", "target_height", "target_width"), _pad),
    "image.extract_patches": (("images", "sizes", "strides", "rates", "padding"), _patches),
}


def _tf_function_form(node):
    path = node.operation.function
    entry = TF_AS_KERAS_OPS.get(path)
    if entry is None:
        return f"calls `tf.{path}`, which has no exact keras.ops form in to_keras's table"
    read, build = entry
    signature = inspect.signature(function_at(path, node.name))
    try:
        bound = signature.bind(*node.args, **node.kwargs)
    except TypeError as error:
        return f"calls `tf.{path}` with arguments its signature does not take ({error})"
    for name, value in bound.arguments.items():
        default = signature.parameters[name].default
        if name not in read and name != "name" and value is not default and not (
                _static_ints(value) and value == default):
            return f"calls `tf.{path}` with `{name}` set, which its keras.ops form does not take"

    def write(args, kwargs, masks):
        del masks
        call = signature.bind(*args, **kwargs)
        call.apply_defaults()
        result = build(call.arguments)
        if isinstance(result, str):
            raise PassError(f"to_keras: `{node.name}` (TFFunction) {result}; it needs kip.")
        return result

    # What depends on values the graph holds (a shape given as a list) is
    # decided now, so the error lists it with the others.
    probe = signature.bind(*node.args, **node.kwargs)
    probe.apply_defaults()
    static = map_leaves(lambda leaf: leaf.spec if isinstance(leaf, Value) else leaf,
                        dict(probe.arguments))
    try:
        result = build(static)
    except Exception as error:  # noqa: BLE001 - Keras refuses what the call gives
        result = f"its keras.ops form refuses the arguments ({type(error).__name__}: {error})"
    if isinstance(result, str):
        return f"calls `tf.{path}` and {result}"
    return write


__all__ = ["GraphFacts", "Masks", "TF_AS_KERAS_OPS", "checked_outputs", "keras_form"]
