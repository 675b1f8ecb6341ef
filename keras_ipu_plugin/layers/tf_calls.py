"""Layers for TensorFlow called on graph tensors: a TensorFlow function
(`TFFunction`) and a TensorFlow random draw (`TFRandomDraw`), both resolved
only from the one explicit table of public, side-effect-free entries below.

The TensorFlow functions a graph may call: one explicit table.

A `TFFunction` node calls a TensorFlow function named by its public path
(`"math.square"`), and a saved model holds that path as text. Text read
from a file must never become arbitrary code: `tf` reaches `os.system`,
`eval`, `tf.load_library`, file writes and more by walking attributes.
So a path is resolved only when it is an entry of this table, and the table
is exactly what the tracer records (`frontend/idioms.py` registers
these functions and no others): what one run recorded, another loads, and
nothing else loads.

Every entry is public and computes a tensor from tensors, with no effect
outside that computation and no random state (a draw would not keep its
seed). Namespaces with effects (file and process I/O, `raw_ops`, `compat`,
printing, summaries, debugging, `py_function`, ...) are refused with the
reason, before the table is consulted.

Example:
    ```python
    function_at("math.square", "dist.tf_square") is tf.math.square
    # -> True
    function_at("io.write_file", "evil")
    ```
    Traceback (most recent call last):
    keras_ipu_plugin.errors.LoadError: TFFunction `evil`: `tf.io.write_file` ...

`TFFunction`: a TensorFlow function called on graph tensors, as a graph
operation.

Keras 3 records `keras.ops` calls on symbolic tensors but refuses
TensorFlow's own functions (`tf.square(a - b)`, `tf.nn.relu(x)`,
`tf.reduce_sum(x, -1)`): "A KerasTensor cannot be used as input to a
TensorFlow function". Code written for Keras 2 is full of them, and every
layer using one stayed a black box to Expand. While tracing, the tracer
records such a call as this operation (`frontend/idioms.py`), which
calls the very same TensorFlow function when the graph runs: its gradient
is TensorFlow's, its output shapes are TensorFlow's shape inference, and it
saves by the function's public name (`"math.square"`). A name is resolved
only from the table of functions the tracer records (`RECORDED`, below):
a saved model naming anything else fails to load, before anything runs.


`TFRandomDraw`: a TensorFlow random draw a layer's `call` makes, as a
graph operation.

Code written for TensorFlow samples with its stateful functions:
keras.io's VAE as often written, `epsilon = tf.random.normal(shape=(batch,
dim))` with `batch = tf.shape(z_mean)[0]`. On Keras 3's symbolic tensors
such a call raises, so the layer used to run whole. While tracing, the
tracer records it as this operation instead (`frontend/idioms.py`):
when the graph runs it makes the very same call (`tf.random.normal` with
the same shape tensors, mean, stddev, dtype and op-level seed, or none), so
it draws as the original does, from TensorFlow's own random state: the
same numbers for the same op seed in a `tf.function`, fresh numbers for an
unseeded draw. Verification replays the original's draws in the converted
run (`frontend/verify/runs.py`'s `taped_stateful_draws`), as it does for a layer kept whole.

A draw advances its kernel's state: it is no pure function, so it is not
a `TFFunction` (whose table holds side-effect free functions only), and a
node drawing is never recomputed (`draws_statefully`): a recomputation
would draw other numbers than the forward pass used. The function is
resolved only from `RANDOM_DRAWS`, also when loading.

Example:
    ```python
    draw = TFRandomDraw("random.normal", name="tf_normal")
    draw((tf_shape_0, 2), seed=1337).shape   # tf_shape_0: a symbolic int
    # -> (None, 2)
    ```
"""

import functools
import inspect

import keras
import tensorflow as tf

from keras_ipu_plugin.errors import LoadError, short_repr
from keras_ipu_plugin.layers.saved_values import refuse_constant_call, saved_function_config

__all__ = [
    "ELEMENTWISE",
    "RANDOM_DRAWS",
    "RECORDED",
    "TENSOR_PARAMETERS",
    "draw_function_at",
    "function_at",
    "refused_reason",
    "TFFunction",
    "public_name_of",
    "TFRandomDraw",
    "draws_statefully",
]


# TensorFlow's elementwise functions (those it lists for its elementwise
# dispatch), by the public path kip saves them under; random ones left out.
ELEMENTWISE = frozenset({
    # unary
    "as_string", "bitwise.invert", "cast", "clip_by_value", "image.adjust_brightness",
    "image.adjust_gamma", "image.convert_image_dtype", "math.abs", "math.acos", "math.acosh",
    "math.angle", "math.asin", "math.asinh", "math.atan", "math.atanh", "math.bessel_i0",
    "math.bessel_i0e", "math.bessel_i1", "math.bessel_i1e", "math.ceil", "math.conj",
    "math.cos", "math.cosh", "math.digamma", "math.erf", "math.erfc", "math.erfcinv",
    "math.erfinv", "math.exp", "math.expm1", "math.floor", "math.imag", "math.is_finite",
    "math.is_inf", "math.is_nan", "math.lgamma", "math.log", "math.log1p", "math.log_sigmoid",
    "math.logical_not", "math.ndtri", "math.negative", "math.nextafter", "math.real",
    "math.reciprocal", "math.reciprocal_no_nan", "math.rint", "math.round", "math.rsqrt",
    "math.sigmoid", "math.sign", "math.sin", "math.sinh", "math.softplus", "math.softsign",
    "math.sqrt", "math.square", "math.tan", "math.tanh", "nn.elu", "nn.gelu",
    "nn.leaky_relu", "nn.relu", "nn.relu6", "nn.selu", "nn.silu", "ones_like",
    "saturate_cast", "zeros_like",
    # binary
    "bitwise.bitwise_and", "bitwise.bitwise_or", "bitwise.bitwise_xor", "bitwise.left_shift",
    "bitwise.right_shift", "complex", "math.add", "math.atan2", "math.divide",
    "math.divide_no_nan", "math.equal", "math.floordiv", "math.floormod", "math.greater",
    "math.greater_equal", "math.less", "math.less_equal", "math.logical_and",
    "math.logical_or", "math.logical_xor", "math.maximum", "math.minimum", "math.multiply",
    "math.multiply_no_nan", "math.not_equal", "math.pow", "math.scalar_mul",
    "math.squared_difference", "math.subtract", "math.truediv", "math.xdivy",
    "math.xlog1py", "math.xlogy", "math.zeta", "nn.sigmoid_cross_entropy_with_logits",
    "realdiv", "truncatediv", "truncatemod",
})

# The other functions recorded, with the parameters that make a call on a
# symbolic tensor (one of them must be one; "*name": a list of them).
TENSOR_PARAMETERS = {
    # reductions and scans
    "math.reduce_sum": ("input_tensor",), "math.reduce_mean": ("input_tensor",),
    "math.reduce_max": ("input_tensor",), "math.reduce_min": ("input_tensor",),
    "math.reduce_prod": ("input_tensor",), "math.reduce_logsumexp": ("input_tensor",),
    "math.reduce_std": ("input_tensor",), "math.reduce_variance": ("input_tensor",),
    "math.reduce_any": ("input_tensor",), "math.reduce_all": ("input_tensor",),
    "math.reduce_euclidean_norm": ("input_tensor",), "norm": ("tensor",),
    "math.argmax": ("input",), "math.argmin": ("input",), "math.top_k": ("input",),
    "math.cumsum": ("x",), "math.cumprod": ("x",), "nn.moments": ("x",),
    "math.l2_normalize": ("x",), "clip_by_norm": ("t",),
    "math.unsorted_segment_sum": ("data", "segment_ids", "num_segments"),
    "math.segment_sum": ("data", "segment_ids"), "math.segment_mean": ("data", "segment_ids"),
    "math.segment_max": ("data", "segment_ids"),
    # neural network functions
    "nn.softmax": ("logits",), "nn.log_softmax": ("logits",),
    "nn.bias_add": ("value", "bias"), "nn.conv1d": ("input", "filters"),
    "nn.conv2d": ("input", "filters"), "nn.depth_to_space": ("input",),
    "nn.space_to_depth": ("input",), "linalg.matmul": ("a", "b"),
    # `tf.einsum(equation, *inputs)`: its inputs are a var-positional
    # parameter, which TensorFlow's type-based dispatch does not take; it is
    # recorded through its fallback dispatch (`frontend/idioms.py`)
    "linalg.einsum": ("*inputs",),
    "linalg.band_part": ("input",), "sequence_mask": ("lengths",),
    "image.resize": ("images",), "image.extract_patches": ("images",),
    # image computations (keras.io's augmentation and preprocessing layers
    # written with `tf.image`): each a deterministic function of its
    # tensors. Left out: the `random_*` and `stateless_random_*` draws,
    # `extract_glimpse` (draws its noise), the codecs and `draw_bounding_boxes`
    # (not a model's computation), `non_max_suppression` (sizes from the data)
    "image.crop_to_bounding_box": ("image",), "image.pad_to_bounding_box": ("image",),
    "image.central_crop": ("image",), "image.resize_with_crop_or_pad": ("image",),
    "image.resize_with_pad": ("image",), "image.crop_and_resize": ("image", "boxes", "box_indices"),
    "image.flip_left_right": ("image",), "image.flip_up_down": ("image",),
    "image.rot90": ("image",), "image.transpose": ("image",),
    "image.adjust_contrast": ("images",), "image.adjust_saturation": ("image",),
    "image.adjust_hue": ("image",), "image.per_image_standardization": ("image",),
    "image.rgb_to_grayscale": ("images",), "image.grayscale_to_rgb": ("images",),
    "image.rgb_to_hsv": ("images",), "image.hsv_to_rgb": ("images",),
    "image.rgb_to_yuv": ("images",), "image.yuv_to_rgb": ("images",),
    "image.rgb_to_yiq": ("images",), "image.yiq_to_rgb": ("images",),
    "image.image_gradients": ("image",), "image.sobel_edges": ("image",),
    "image.total_variation": ("images",),
    # shapes, indexing, joining
    "reshape": ("tensor", "shape"), "transpose": ("a",), "expand_dims": ("input",),
    "squeeze": ("input",), "tile": ("input", "multiples"), "broadcast_to": ("input", "shape"),
    "pad": ("tensor",), "shape": ("input",), "size": ("input",), "slice": ("input_",),
    "gather": ("params", "indices"), "gather_nd": ("params", "indices"),
    "one_hot": ("indices",), "where": ("condition", "x", "y"),
    # `tf.range(tf.shape(x)[-1])`: positions from a size computed in the graph
    "range": ("start", "limit", "delta"),
    # gradients: the straight-through estimator (VQ-VAE), targets held fixed
    "stop_gradient": ("input",),
    "split": ("value",), "unstack": ("value",),
    "concat": ("*values",), "stack": ("*values",), "math.add_n": ("*inputs",),
}

RECORDED = ELEMENTWISE | frozenset(TENSOR_PARAMETERS)

# TensorFlow's stateful random draws a graph may make (`TFRandomDraw`,
# `layers/tf_calls.py`), with the parameters that make a call on a
# symbolic tensor (`tf.random.normal(shape=(tf.shape(x)[0], dim))`). Kept
# apart from `RECORDED`: a draw is not side-effect free (it advances its
# kernel's state), so a `TFFunction` never calls one, and a graph node
# drawing is never recomputed.
RANDOM_DRAWS = {
    "random.normal": ("shape", "mean", "stddev"),
    "random.uniform": ("shape", "minval", "maxval"),
    "random.truncated_normal": ("shape", "mean", "stddev"),
    "random.categorical": ("logits", "num_samples"),
    "random.gamma": ("shape", "alpha", "beta"),
    "random.poisson": ("shape", "lam"),
    "random.shuffle": ("value",),
}

# Path parts that are never a pure tensor computation: refused whatever the
# table says, with the reason (a second line of defence, and a clearer error
# than "not in the table" for what an attacker would try first).
_REFUSED_PARTS = {
    "io": "file I/O", "gfile": "file I/O", "saved_model": "file I/O",
    "load_library": "loads native code", "load_op_library": "loads native code",
    "raw_ops": "raw operations, file and process I/O among them",
    "compat": "TensorFlow 1 APIs, file I/O among them",
    "print": "writes to a stream or a file", "summary": "writes summaries",
    "debugging": "debugging operations with effects", "py_function": "runs Python",
    "numpy_function": "runs Python", "py_func": "runs Python", "random": "draws random numbers",
    "experimental": "experimental APIs", "data": "input pipelines", "distribute": "runtime state",
    "config": "runtime state", "train": "checkpoints and state", "autograph": "converts code",
    "function": "compiles Python", "Variable": "creates state", "sysconfig": "runtime state",
}


def refused_reason(path):
    """Why `path` can never be a recorded function, or None."""
    if not isinstance(path, str):
        return f"a function path is a string; got {short_repr(path)}"
    parts = path.split(".")
    if not all(part.isidentifier() for part in parts):
        return "not a dotted path of names"
    for part in parts:
        if part.startswith("_"):
            return "it has a private part"
        if part in _REFUSED_PARTS:
            return f"`{part}`: {_REFUSED_PARTS[part]}"
    return None


def function_at(path, entry):
    """The TensorFlow function at table entry `path`; `kip.LoadError` naming
    `entry` (the node or layer holding the path) for anything else.

    Example:
        ```python
        function_at("nn.relu", "block.tf_relu") is tf.nn.relu
        # -> True
        ```
    """
    reason = refused_reason(path)
    if reason is None and path not in RECORDED:
        reason = "not one of the TensorFlow functions kip records"
    function = None if reason else _resolve(path)
    if function is None:
        reason = reason or "this TensorFlow has no such function"
        raise LoadError(
            f"TFFunction `{entry}`: refusing `tf.{path}` as a graph function ({reason}). "
            "kip calls only the public, side-effect free TensorFlow functions its tracer "
            "records (keras_ipu_plugin.layers.tf_calls.RECORDED)."
            if isinstance(path, str) else
            f"TFFunction `{entry}`: {reason}."
        )
    return function


def draw_function_at(path, entry):
    """The TensorFlow random function at `RANDOM_DRAWS` entry `path`;
    `kip.LoadError` naming `entry` for anything else.

    Example:
        ```python
        draw_function_at("random.normal", "sampling.tf_normal") is tf.random.normal
        # -> True
        ```
    """
    function = _resolve(path) if isinstance(path, str) and path in RANDOM_DRAWS else None
    if function is None:
        raise LoadError(
            f"TFRandomDraw `{entry}`: refusing {short_repr(path)} as a random draw: kip draws "
            f"only with {', '.join('tf.' + name for name in sorted(RANDOM_DRAWS))} "
            "(keras_ipu_plugin.layers.tf_calls.RANDOM_DRAWS)."
        )
    return function


def _resolve(path):
    # Only ever reached with a path of the table above, never a file's text.
    value = tf
    for part in path.split("."):
        value = getattr(value, part, None)
        if value is None:
            return None
    return value if callable(value) else None


# The public namespaces a function is saved by, in the order its name is
# looked for (`tf.square` is saved as "math.square"). "image" comes after
# the top level, so a function exported at both keeps its shorter name; a
# namespace missing here made every function in it unrecordable
# (`tf.image.extract_patches` in keras.io's ViT left its layer whole).
_NAMESPACES = ("math", "nn", "linalg", "bitwise", "", "image")


@keras.saving.register_keras_serializable(package="keras_ipu_plugin")
class TFFunction(keras.Operation):
    """Calls the TensorFlow function with public name `function` (a path
    under `tf`, such as `"math.square"` or `"reshape"`, one of the table
    `RECORDED`) on its arguments.

    Example:
        >>> square = TFFunction("math.square")
        >>> square(keras.KerasTensor((None, 4))).shape
        (None, 4)
    """

    def __init__(self, function, name=None):
        if name is not None and not isinstance(name, str):
            raise LoadError(f"TFFunction: a name is a string; got {short_repr(name)}.")
        # Checked before the operation exists: nothing named runs otherwise.
        callable_ = function_at(function, name or "(unnamed)")
        super().__init__(name=name)
        self.function = function
        self._tf_callable = callable_

    def call(self, *args, **kwargs):
        refuse_constant_call(self, args, kwargs)
        return self._tf_callable(*args, **kwargs)

    def compute_output_spec(self, *args, **kwargs):
        # Keras calls the product of a symbolic tensor and a concrete one
        # sparse (`ops.multiply` takes what is not a KerasTensor for sparse:
        # DDPM's `TimeEmbedding`, `inputs[:, None] * self.emb[None, :]`),
        # and TensorFlow's shape inference on a SparseTensor placeholder then
        # fails ("Failed to convert elements of SparseTensor") or loses the
        # shape. The tensors a kip graph carries are dense: sparse inputs
        # are refused (`frontend/inputs.py`) and traced specs are made dense
        # where no argument is sparse (`trace_views.dense_unless_given_sparse`).
        args, kwargs = keras.tree.map_structure(_dense_spec, (args, kwargs))
        return super().compute_output_spec(*args, **kwargs)

    def get_config(self):
        return {"function": self.function, "name": self.name}

    @classmethod
    def from_config(cls, config):
        function, name = saved_function_config(cls.__name__, config)
        return cls(function, name=name)


def _dense_spec(leaf):
    if isinstance(leaf, keras.KerasTensor) and leaf.sparse:
        return keras.KerasTensor(leaf.shape, dtype=leaf.dtype, ragged=leaf.ragged)
    return leaf


def public_name_of(function):
    """The public path under `tf` of `function` (or of a function it wraps),
    or None when TensorFlow does not export it.

    Example:
        >>> public_name_of(tf.square)
        'math.square'
    """
    return _public_names().get(id(function))


@functools.lru_cache(maxsize=None)
def _public_names():
    names = {}
    for namespace in _NAMESPACES:
        module = getattr(tf, namespace) if namespace else tf
        for attribute in sorted(dir(module)):
            if attribute.startswith("_"):
                continue
            try:
                value = getattr(module, attribute)
            except Exception:  # a lazily loaded module that cannot load here (tf.keras)
                continue
            if not callable(value) or inspect.isclass(value):
                continue
            path = f"{namespace}.{attribute}" if namespace else attribute
            # TensorFlow wraps its ops (dispatch, weak types): the function
            # handed to a dispatcher is one of the layers inside.
            for layer in _wrapped_chain(value):
                names.setdefault(id(layer), path)
    return names


def _wrapped_chain(function):
    seen = []
    while function is not None and all(function is not s for s in seen):
        seen.append(function)
        function = getattr(function, "__wrapped__", None)
    return seen


@keras.saving.register_keras_serializable(package="keras_ipu_plugin")
class TFRandomDraw(keras.Operation):
    """Calls the TensorFlow random function `function` (a path under `tf`
    of `RANDOM_DRAWS`, such as `"random.normal"`) on its
    arguments each time the graph runs.

    Example:
        ```python
        draw = TFRandomDraw("random.uniform")
        draw((None, 2), minval=0.9, maxval=1.1, batch_of=x).shape   # x: (4, 3)
        # -> (4, 2)
        ```
    """

    def __init__(self, function, name=None):
        if name is not None and not isinstance(name, str):
            raise LoadError(f"TFRandomDraw: a name is a string; got {short_repr(name)}.")
        # Checked before the operation exists: nothing named runs otherwise.
        callable_ = draw_function_at(function, name or "(unnamed)")
        super().__init__(name=name)
        self.function = function
        self._tf_callable = callable_

    def call(self, *args, batch_of=None, **kwargs):
        # `batch_of`: a graph tensor whose batch size each None of the
        # draw's `shape` is (`tf.random.normal(ops.shape(x))`, traced while
        # the batch size was unknown).
        refuse_constant_call(self, args, dict(kwargs, batch_of=batch_of))
        if batch_of is not None:
            bound = self._signature().bind(*args, **kwargs).arguments
            batch = tf.shape(batch_of)[0]
            bound["shape"] = [batch if dim is None else dim for dim in bound["shape"]]
            return self._tf_callable(**bound)
        return self._tf_callable(*args, **kwargs)

    def compute_output_spec(self, *args, batch_of=None, **kwargs):
        if batch_of is None:
            return super().compute_output_spec(*args, **kwargs)
        bound = self._signature().bind(*args, **kwargs).arguments
        dtype = bound.get("dtype") or "float32"
        return keras.KerasTensor(
            tuple(batch_of.shape[0] if dim is None else dim for dim in bound["shape"]),
            dtype=keras.backend.standardize_dtype(dtype))

    def _signature(self):
        return inspect.signature(self._tf_callable)

    def get_config(self):
        return {"function": self.function, "name": self.name}

    @classmethod
    def from_config(cls, config):
        function, name = saved_function_config(cls.__name__, config)
        return cls(function, name=name)


def draws_statefully(operation):
    """Whether `operation` is a TensorFlow random draw: its run advances a
    kernel's state, which a recomputation would advance again (drawing
    other numbers than the forward pass used), so it never sits in a
    recomputed segment.

    Example:
        ```python
        draws_statefully(TFRandomDraw("random.normal")), draws_statefully(keras.layers.Dense(2))
        # -> (True, False)
        ```
    """
    return isinstance(operation, TFRandomDraw)
