"""Why a `call` cannot be traced, in words: `TraceError` and its reasons.

A layer whose `call` cannot be traced stays whole, and the report says why.
The message of the error alone ("`add_loss()` can only be called from inside
`build()` or `call()`, on a tensor input", "Failed to convert elements of
SparseTensor") says neither what happened in the user's code nor what to
write instead. `describe_failure` frames an error raised by the user's code
on symbolic tensors: which line failed (`user_source_line`), in which layer
(`failing_layer`), what it means and what to write instead;
`known_failure` maps the errors whose cause is known to a reason that
says it; `essential_message` strips Keras's banner from a message.

Example:
    >>> known_failure("`add_loss()` can only be called ...", " in `vq`")
    '`call` adds a loss computed from its inputs (`self.add_loss(...)`) in `vq`: ...'
"""

import inspect
import linecache
import re

import keras
import tensorflow as tf

from keras_ipu_plugin import _compat
from keras_ipu_plugin.frontend.trace import writes as writes_lib
from keras_ipu_plugin.layers.user_code import is_user_source


# (pattern of the error's message, reason; `{at}`: where, as
# ` (`file:line: source`) in `layer``)
_KNOWN_FAILURES = (
    (re.compile(r"`add_loss\(\)` can only be called"),
     "`call` adds a loss computed from its inputs (`self.add_loss(...)`){at}: a graph of "
     "Keras layers has no node for it, so the layer runs whole (it still trains, with its "
     "loss); to expand it, return the loss as an output and add it in `train_step` or "
     "`compute_loss`"),
    (re.compile(r"Failed to convert elements of SparseTensor"),
     "`call` gives a TensorFlow function a tensor Keras marked sparse{at} (the product of "
     "a symbolic tensor and a concrete `tf.Tensor` is marked sparse): the layer runs whole "
     "(it still trains); hold the concrete tensor as a NumPy array or a Keras weight, or "
     "write the function with `keras.ops`, for the layer to expand"),
)


def known_failure(message, at):
    """The reason for an error whose `message` tells the cause, else None;
    `at` says where it happened."""
    for pattern, reason in _KNOWN_FAILURES:
        if pattern.search(message):
            return reason.format(at=at)
    return None


class TraceError(Exception):
    """`call` cannot be captured as a graph of Keras layers; `reason` says why.
    `mixed`: traced with its inputs at leading sizes of their own, the
    graph would read one input's size for another's (no retry at one
    shared batch size may hide it)."""

    def __init__(self, reason, *, mixed=False):
        self.reason = reason
        self.mixed = mixed
        super().__init__(reason)


class ModeStructureError(TraceError):
    """A `call` returns another output structure in training than in
    inference. No node inside a traced call can hold that (the call's
    code reads one structure), so it goes up to the model, which then runs
    whole and returns each mode's structure (`convert.opaque_graph`), or
    conversion refuses where it cannot learn them. `structures`: how the
    modes' structures differ, and where, in words (the reason says what
    follows too)."""

    def __init__(self, reason, *, structures):
        super().__init__(reason)
        self.structures = structures


STATIC_BATCH_HINT = (
    "`ops.shape(x)[0]` is None while tracing, the batch size being unknown; "
    "pass static_batch=True to trace with the per-replica batch"
)


NUMPY_OPERAND_HINT = (
    "a NumPy array on the left of an operator (`np.ones(n) * x`) or given to a "
    "NumPy function (`np.exp(x)`) turns the tensor into a NumPy array, which a "
    "traced tensor cannot be (NumPy scalars are followed): write it with "
    "`keras.ops` (`ops.convert_to_tensor(array) * x`)"
)


def _at(error, where):
    """` (`file:line: source`) in `layer`` for a reason: the user's line
    that failed (when found) and the layer it failed in."""
    line = _user_source_line(error)
    return (f" (`{line}`)" if line else "") + (f" in `{where}`" if where else "")


def describe_failure(error, default=None):
    where = failing_layer(error) or default
    written = _variable_written_in(error)
    if written is not None:
        # Keras's own words would be about a TensorFlow function on a
        # symbolic tensor; the cause is the write.
        variable, method = written
        name = getattr(variable, "path", None) or variable.name
        return (
            f"`call` writes the variable `{name}` (`{method}`) with a value computed "
            f"from its inputs{_at(error, where)}: a graph of Keras layers cannot hold "
            "the write, so the layer runs whole (it still trains)"
        )
    if _compat.raised_in_tf_random_function(error):
        return (
            f"`call` draws random numbers with a TensorFlow function{_at(error, where)}: "
            "a graph records the draws of `tf.random.normal`, `uniform`, `truncated_normal`, "
            "`categorical`, `gamma`, `poisson` and `shuffle` only, their shape given as "
            "tensors (`tf.shape(x)`, `(tf.shape(x)[0], dim)`) or with the unknown batch size "
            "alone written as None (`ops.shape(x)`), so the layer runs whole (it "
            "still trains; verification replays its draws); give the shape as "
            "`tf.shape(x)`, or draw with `keras.random.normal(shape, "
            "seed=self.seed_generator)` and a `keras.random.SeedGenerator` the layer "
            "holds, for the layer to expand"
        )
    if _TF_ON_SYMBOL in str(error):
        # Keras's message lists what a KerasTensor is; say which line of the
        # user's code did it, and what to write instead.
        return (
            f"`call` applies a TensorFlow function to a symbolic tensor{_at(error, where)}"
            ": only `keras.ops` and Keras "
            "layers trace into a graph; write it with `keras.ops` (e.g. "
            "`ops.square` for `tf.square`) for the layer to expand"
        )
    if _SYMBOLIC_SHAPE.search(str(error)):
        return (
            f"`call` gives an operation a shape or size computed from tensor "
            f"values{_at(error, where)}: the output's shape "
            "then depends on the data, which a Keras graph cannot hold; give it "
            "a Python number or a static dimension for the layer to expand"
        )
    if _TENSOR_AS_BOOL in str(error):
        # Python control flow on a tensor's value: one graph cannot hold both
        # branches. Say which line branches (keras_hub's RoFormer-v2
        # positional embedding) rather than only Keras's words.
        return (
            f"`call` uses a tensor's value as a boolean in Python control flow (`if`, `while`, "
            f"`and`/`or`){_at(error, where)}: the branch taken "
            "depends on the data, which one graph cannot hold; the layer runs whole "
            "(it still trains); computing both results and choosing with `ops.where` lets it expand"
        )
    known = known_failure(essential_message(error, limit=2000), _at(error, where))
    if known is not None:
        return known
    text = f"{type(error).__name__}: {essential_message(error, limit=300)}"
    text = f"{text} (in `{where}`)" if where else text
    if _NONE_VALUE.search(text):
        # Almost always a shape built from `ops.shape(x)[0]`: say where, and
        # what helps.
        line = _user_source_line(error)
        return (f"{text}{f' at `{line}`' if line else ''}; {STATIC_BATCH_HINT}, or write a "
                "reshape's batch dimension as -1")
    if _TO_NUMPY.search(text):
        return f"{text}; {NUMPY_OPERAND_HINT}"
    # Never TensorFlow's or Keras's words alone: say what happened, then
    # what they said, then what to write.
    line = _user_source_line(error)
    return (
        f"`call` fails when run on symbolic tensors{f' (`{line}`)' if line else ''}: "
        f"{text}. The layer runs whole (it still trains); write that computation with "
        "`keras.ops` and Keras layers, which trace, for the layer to expand"
    )


_WRITE_METHODS = frozenset({"assign", "assign_add", "assign_sub", "scatter_update",
                            "scatter_add", "scatter_sub", "scatter_nd_update"})


def _variable_written_in(error):
    """`(variable, method)` when `error` was raised inside a write to a
    Keras or TensorFlow variable (`kernel.assign(symbolic)`), else None."""
    tb = error.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        owner = frame.f_locals.get("self")
        if frame.f_code.co_name in _WRITE_METHODS and isinstance(owner, (keras.Variable, tf.Variable)):
            return owner, frame.f_code.co_name
        tb = tb.tb_next
    return None


_NONE_VALUE = re.compile(r"value \(None\)|NoneType")


_TF_ON_SYMBOL = "A KerasTensor cannot be used as input to a TensorFlow function"


_TENSOR_AS_BOOL = "A symbolic KerasTensor cannot be used as a boolean"


_SYMBOLIC_SHAPE = re.compile(r"Cannot convert .*KerasTensor.* to a shape", re.DOTALL)


def user_stack_line():
    """`file:line: source` of the innermost frame of user code on the
    current stack (the line of `call` running now), or None."""
    frame = inspect.currentframe().f_back
    while frame is not None:
        code = frame.f_code
        if is_user_source(code.co_filename):
            source = linecache.getline(code.co_filename, frame.f_lineno).strip()
            return f"{code.co_filename.rsplit('/', 1)[-1]}:{frame.f_lineno}: {source}"
        frame = frame.f_back
    return None


def _user_source_line(error):
    """`file:line: source` of the innermost frame of user code (not
    TensorFlow's, Keras's or ours) in `error`'s traceback, or None."""
    found = None
    tb = error.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        if is_user_source(code.co_filename):
            found = (code.co_filename, tb.tb_lineno)
        tb = tb.tb_next
    if found is None:
        return None
    source = linecache.getline(*found).strip()
    return f"{found[0].rsplit('/', 1)[-1]}:{found[1]}: {source}"


_TO_NUMPY = re.compile(r"KerasTensor is symbolic.*NumPy array")


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def essential_message(error, limit=600):
    """The part of a Keras error that says what is wrong.

    Keras wraps errors from `call` in a banner ("Exception encountered when
    calling ...") with ANSI bold codes and appends every argument's value,
    which for a batch is the whole tensor printed out.
    """
    # str(KeyError) is the repr of its message, escapes and all.
    raw = str(error.args[0]) if isinstance(error, KeyError) and error.args else str(error)
    text = _ANSI.sub("", raw)
    text = text.split("Arguments received by")[0]
    # Keras's "Could not automatically infer the output shape / dtype of
    # ... Error encountered:" wraps the error that says what happened.
    text = text.split("Error encountered:")[-1]
    lines = [
        line.strip()
        for line in text.splitlines()
        if line.strip() and not line.startswith("Exception encountered when calling")
    ]
    text = " ".join(lines) or type(error).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def failing_layer(error):
    """Name of the innermost layer whose `call` raised, from the traceback."""
    name = None
    tb = error.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        owner = frame.f_locals.get("self")
        if frame.f_code.co_name == "call" and isinstance(owner, keras.layers.Layer):
            name = owner.name
        tb = tb.tb_next
    return name


def writes_reason(layer, lost):
    """Why a layer whose `call` writes variables (`lost`: `writes.Write`s)
    is kept whole."""
    return (
        f"`call` of `{layer.name}` writes the variable "
        f"{writes_lib.describe_writes(lost, layer)} itself: a graph of its "
        "sub-layers would lose the write (it ran once, at tracing), so the "
        "layer runs whole (it still trains). A write is recorded in the graph "
        "when it is made on a Keras variable the layer holds, as its attribute "
        "(`self.v = self.add_weight(...)`, then `self.v.assign(...)`) or as one "
        "of a Keras sub-layer's (`self.conv.kernel.assign(...)`)"
    )


__all__ = ["TraceError", "ModeStructureError", "STATIC_BATCH_HINT", "NUMPY_OPERAND_HINT", "describe_failure",
           "essential_message", "failing_layer", "known_failure", "writes_reason"]
