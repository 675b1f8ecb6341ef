"""Variable writes a `call` makes, seen as they happen.

Tracing runs `call`'s Python on symbolic inputs. A write whose value does not
depend on the inputs — keras.io's PixelCNN masking its kernel on every call,
`self.conv.kernel.assign(self.conv.kernel * self.mask)`, or a counter's
`assign_add(1)` — runs at once, on the real variable, and leaves nothing in
the graph: a graph of the layer's sub-layers would never make it again.
`WriteLog` records every write made on this thread while it records (through
TensorFlow's op callbacks, `_compat.op_callback`), to a variable that existed
before (not the initial value of a variable built meanwhile), with the layer
call it happened inside (`inline(layer)`): a write made inside a sub-layer
that is a node of the graph is made again by that node, any other is lost.
(A write the traced layer's own code makes on a Keras variable it holds, or
on one of a Keras sub-layer's, is a graph node instead: `write_nodes.py`.
Inside a sub-layer run inline, `deferred` keeps the writes to Keras
variables from the variables and logs them here.)

Example:
    >>> log = WriteLog()
    >>> with log.recording():
    ...     model.conv.kernel.assign(model.conv.kernel * 0.5)
    >>> [write.method for write in log.writes]
    ['assign']
"""

import contextlib
import threading
from dataclasses import dataclass

import keras
import tensorflow as tf

from keras_ipu_plugin import _compat
from keras_ipu_plugin.runtime.distribution import owning_strategy

_METHODS = {
    "AssignVariableOp": "assign",
    "AssignAddVariableOp": "assign_add",
    "AssignSubVariableOp": "assign_sub",
    "ResourceStridedSliceAssign": "a sliced assign",
}


def _method(op_type):
    """The Python method that makes an op of `op_type`, for a write op; None otherwise."""
    if op_type in _METHODS:
        return _METHODS[op_type]
    if op_type.startswith("ResourceScatter"):
        return "scatter_" + op_type[len("ResourceScatter"):].lower()
    if op_type.startswith(("ResourceApply", "ResourceSparseApply")):
        return "an optimizer update"
    return None


_local = threading.local()  # .frames: the layers whose inline call is running


def _frames():
    return _local.__dict__.setdefault("frames", [])


@contextlib.contextmanager
def inline(layer):
    """Mark writes made inside as made by `layer`'s call (a sub-layer run
    inline while a trace works out its output shapes)."""
    frames = _frames()
    frames.append(layer)
    try:
        yield
    finally:
        frames.pop()


@contextlib.contextmanager
def deferred(layer):
    """Run `layer`'s inline call (as `inline`) with the writes it makes to
    Keras variables kept in a `keras.StatelessScope`: never made on the
    variables (a trace works out shapes; PixelCNN's masking sub-layer would
    otherwise mask the real kernel each time a block holding it is traced),
    and logged as made inside `layer`'s call, as the writes it makes to
    TensorFlow variables are."""
    with inline(layer), keras.StatelessScope() as scope:
        yield
        if not scope.state_mapping:  # no write: the common case, cheap
            return
        written = [v for v in layer.variables if scope.get_current_value(v) is not None]
        for log in _logs():
            for variable in written:
                for handle in handles_of(variable)[:1]:
                    log.note(handle, "assign", layer)


def _logs():
    return _local.__dict__.setdefault("logs", [])


@dataclass
class Write:
    handle: object  # the variable's resource tensor
    method: str  # "assign", "assign_add", ...
    within: object  # the outermost layer call (since recording began) it was made in, or None


class WriteLog:
    """The variable writes made on this thread while `recording()`."""

    def __init__(self):
        self.writes = []
        self._created = []  # handles of variables created while recording
        self._depth = 0

    @contextlib.contextmanager
    def recording(self):
        self._depth = len(_frames())
        logs = _logs()
        logs.append(self)
        try:
            with _compat.op_callback(self._seen):
                yield self
        finally:
            logs.remove(self)

    def note(self, handle, method, layer):
        """A write `deferred` kept from the variable, made within `layer`."""
        frames = _frames()
        within = frames[self._depth] if len(frames) > self._depth else layer
        self.writes.append(Write(handle, method, within))

    def _seen(self, op_type, inputs, attrs, outputs, op_name=None, graph=None):
        if graph is not None:
            return None  # an op added to a graph (a scratch trace): nothing ran
        if isinstance(op_type, bytes):  # as TensorFlow's eager execution names it
            op_type = op_type.decode("utf-8", "replace")
        if op_type == "VarHandleOp":
            self._created.extend(outputs or ())
            return None
        method = _method(op_type)
        if method is None or not inputs:
            return None
        handle = inputs[0]
        if any(handle is created for created in self._created):
            return None  # a variable built meanwhile, given its initial value
        frames = _frames()
        within = frames[self._depth] if len(frames) > self._depth else None
        self.writes.append(Write(handle, method, within))
        return None


def handles_of(variable):
    """The resource tensors behind a Keras or TensorFlow variable (one per
    device for a distributed one)."""
    backing = _compat.backing_variable(variable)
    strategy = owning_strategy(variable)
    parts = strategy.experimental_local_results(backing) if strategy is not None else [backing]
    found = []
    for part in parts:
        try:
            found.append(part.handle)
        except (AttributeError, ValueError, RuntimeError):
            continue
    return found


def variable_names(layer):
    """`{id(resource tensor): name}` for the variables under `layer`: Keras
    variables by path, TensorFlow variables held as attributes (alone, or in
    a list or dict) by `layer_name.attribute`; and Keras's global seed
    generator state."""
    names = {}
    for variable in layer.variables:
        for handle in handles_of(variable):
            names.setdefault(id(handle), variable.path)
    for sub in _compat.all_layers(layer):
        for attribute, value in list(vars(sub).items()):
            if attribute.startswith(_compat.TRACKABLE_PREFIX):
                continue  # TensorFlow's tracking lists the same variables
            values = (value.items() if isinstance(value, dict) else
                      enumerate(value) if isinstance(value, (list, tuple)) else [(None, value)])
            for key, item in values:
                if isinstance(item, tf.Variable) and not isinstance(item, keras.Variable):
                    where = f"{sub.name}.{attribute}" + ("" if key is None else f"[{key!r}]")
                    for handle in handles_of(item):
                        names.setdefault(id(handle), where)
    seed = _compat.global_seed_generator_state()
    if seed is not None:
        for handle in handles_of(seed):
            names.setdefault(id(handle), "Keras's global seed generator state")
    return names


def describe_writes(writes, layer):
    """`` `name` (`method`)`` for each variable `writes` wrote, once each."""
    names = variable_names(layer)
    described = []
    for write in writes:
        name = names.get(id(write.handle), "a variable not held by the layer")
        text = f"`{name}` (`{write.method}`)"
        if text not in described:
            described.append(text)
    return ", ".join(described[:4]) + (f" and {len(described) - 4} more" if len(described) > 4 else "")


__all__ = ["WriteLog", "Write", "inline", "deferred", "handles_of", "variable_names",
           "describe_writes"]
