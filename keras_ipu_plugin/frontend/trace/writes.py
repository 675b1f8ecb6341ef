"""Variable writes in a traced `call`: seen as they happen (`WriteLog`), and
recorded as graph nodes (`WriteRecorder`). One concept, in its two halves
below.

Variable writes a `call` makes, seen as they happen.

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
on one of a Keras sub-layer's, is a graph node instead: `WriteRecorder`, below.
Inside a sub-layer run inline, `deferred` keeps the writes to Keras
variables from the variables and logs them here.)

Example:
    ```python
    log = WriteLog()
    with log.recording():
        model.conv.kernel.assign(model.conv.kernel * 0.5)
    [write.method for write in log.writes]
    # -> ['assign']
    ```

Record the variable writes a traced `call` makes as graph nodes.

keras.io's PixelCNN (https://keras.io/examples/generative/pixelcnn/) masks
its kernel on every call and then uses it:

    self.conv.kernel.assign(self.conv.kernel * self.mask)
    return self.conv(inputs)

Traced, `self.conv.kernel` is a symbolic read of the kernel (a
`VariableRead` node: the traced layer's own variables are, and so are the
variables of its direct Keras sub-layers read from its own code, through
`reading_members`), `* self.mask` a `keras.ops` node, and the `assign`
a `VariableWrite` node (`layers/state.py`). Its order in `call`
becomes data dependencies, which Expand keeps and passes see:

- a write comes after every read and sub-layer call that came before it in
  `call` and may use the variable (its `after` inputs): they see the old
  value;
- what uses the variable after the write sees the new one: the layer's own
  attribute, and a new read of a sub-layer's variable, is the write's
  output; a sub-layer holding the variable is called on its input passed
  through an `AfterWrites` node; a read of a statistic (a non-trainable
  variable) that a sub-layer called before may have moved comes after that
  call;
- the call's first output comes after every write, so no write is left out
  of the graph (a counter nothing reads).

A write the graph cannot hold faithfully fails the trace with a reason
that names the variable (the layer then runs whole, as it did): one inside
a sub-layer's `call` is that sub-layer's (it runs its own `call`), a value
whose shape depends on the batch size, a write of part of a variable.

Example:
    ```python
    recorder = WriteRecorder(trace)
    with recorder.recording():
        outputs = type(layer).call(view, x)    # writes become nodes
    outputs = recorder.finish(outputs)
    ```
"""

import contextlib
import functools
import threading
from dataclasses import dataclass

import keras
import numpy as np
import tensorflow as tf

from keras_ipu_plugin import _compat
from keras_ipu_plugin.layers.layer_kinds import note_writes_variables
from keras_ipu_plugin.layers import state as state_lib
from keras_ipu_plugin.layers.state import AfterWrites, VariableWrite
from keras_ipu_plugin.layers.user_code import viewed_layer
from keras_ipu_plugin.runtime.variables import owning_strategy

__all__ = [
    "WriteLog",
    "Write",
    "inline",
    "deferred",
    "handles_of",
    "variable_names",
    "describe_writes",
    "WriteRecorder",
    "WriteError",
    "current",
    "reading_members",
    "variable_attributes",
]


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


_recording = threading.local()  # .recorder: the WriteRecorder of the call being traced


class WriteError(Exception):
    """A write the graph cannot hold; `reason` says why (tracing makes it a
    `TraceError`)."""

    def __init__(self, reason):
        self.reason = reason
        super().__init__(reason)


class WriteRecorder:
    """The writes, reads and sub-layer calls of one traced `call` (one mode),
    in the order `call` makes them (see the module docstring). `trace` is
    the `call_trace.CallTrace` in progress: its names, reads and anchor."""

    def __init__(self, trace):
        self.trace = trace
        self.reset()

    def reset(self):
        self.view = None  # the traced layer's view, whose attributes hold reads
        self.accesses = {}  # id(variable) -> reads since its last write
        self.calls = []  # (direct sub-layer, its first output), in call order
        self.since = {}  # id(variable) -> len(self.calls) at its last write
        # id(variable) -> what `call` reads of it now (its last write's output,
        # or a read), until a call of a layer holding it
        self.seen = {}
        self.last_written = {}  # id(variable) -> output of its last VariableWrite
        self.attribute = {}  # id(variable) -> the attribute it was read as
        self.writes = []  # outputs of the VariableWrite nodes made
        self.calling = 0  # sub-layer calls in progress (their own code runs)

    @contextlib.contextmanager
    def recording(self):
        previous = getattr(_recording, "recorder", None)
        _recording.recorder = self
        # where `call`'s own code runs; a branch of `ops.cond` or a loop body
        # runs in a scratch graph of its own
        self._context = _context()
        try:
            with state_lib.recording_writes(self.record):
                yield self
        finally:
            _recording.recorder = previous

    def in_own_context(self):
        """Whether code runs where `call`'s own code does (not in a branch
        of `ops.cond` or a loop body, which run in scratch graphs)."""
        return _context() == self._context

    # -- reads ---------------------------------------------------------------
    def held(self, variable, tensor, attribute):
        """A read of `variable` (as `attribute`) that `call` may use from now."""
        self.accesses.setdefault(id(variable), []).append(tensor)
        self.attribute.setdefault(id(variable), attribute)

    def sub_layer_variable(self, view, name, variable):
        """What `call`'s own code sees as `self.<sub>.<name>`: a symbolic read
        of a direct sub-layer's variable (its value after any write), or the
        variable itself inside a sub-layer's own call."""
        trace = self.trace
        if self.calling or id(view) not in trace.lift_for or trace.anchor is None:
            return variable
        key = id(variable)
        if key in self.seen:  # the write's output, or the read made already
            return self.seen[key]
        anchor = trace.anchor
        # after the last call that may have moved a statistic (a
        # non-trainable variable) since the start of `call`
        moved = [] if variable.trainable else self._calls_holding(variable, 0)[-1:]
        if key in self.last_written:  # and after the write before those
            moved.append(self.last_written[key])
        if moved:
            anchor = self.after(anchor, moved)
        stem = trace.path_of(view)
        attribute = f"{stem}.{name}" if stem else name
        self.seen[key] = trace.read(variable, attribute, anchor=anchor)
        return self.seen[key]

    # -- sub-layer calls -----------------------------------------------------
    def before_call(self, view, args, kwargs):
        """`(args, kwargs)` for a direct sub-layer's call: passed through an
        `AfterWrites` node when `call` wrote a variable it holds."""
        if self.last_written and id(view) in self.trace.lift_for:
            pending = _unique(self.last_written[key] for key in _variable_ids(view)
                              if key in self.last_written)
            if pending:
                args, kwargs = self._gate_first((args, kwargs), pending, viewed_layer(view))
        self.calling += 1
        return args, kwargs

    def after_call(self, view, outputs):
        self.calling -= 1
        if id(view) not in self.trace.lift_for:
            return
        leaf = _first_dense(outputs)
        if leaf is not None:
            self.calls.append((view, leaf))
            # a later read of a variable it holds reads again, after it
            for key in _variable_ids(view) & set(self.seen) if self.seen else ():
                del self.seen[key]

    def _calls_holding(self, variable, start):
        """The first outputs of the direct sub-layer calls from `start` on
        whose layer holds `variable`."""
        return [leaf for view, leaf in self.calls[start:]
                if any(v is variable for v in (viewed_layer(view) or view).variables)]

    # -- writes --------------------------------------------------------------
    def record(self, read, method, value):
        """`read.<method>(value)` in `call`: a `VariableWrite` node; returns
        the variable's value after it."""
        trace = self.trace
        variable = read.variable
        name = f"`{variable.path}`"
        if _context() != self._context:
            raise WriteError(
                f"`call` writes the variable {name} (`{method}`) inside a branch or a "
                "loop (`ops.cond`, `ops.while_loop`, `ops.scan`...), which one write "
                "node cannot hold: write the value chosen outside it, "
                f"`self.v.{method}(ops.where(condition, new_value, "
                f"{'self.v' if method == 'assign' else '0'}))`")
        if self.calling:
            raise WriteError(
                f"`call` hands the read of the variable {name} to a sub-layer, which "
                f"writes it (`{method}`): only the layer whose `call` writes a "
                "variable it holds can be expanded with the write")
        if not any(v is variable for v in trace.layer.variables):
            raise WriteError(
                f"`call` writes the variable {name} (`{method}`), which the layer does "
                "not hold: create it in the layer (`self.add_weight`) or in one of "
                "its sub-layers for the write to be recorded")
        attribute = self.attribute.get(id(variable), variable.name)
        tensor = self._value(variable, method, value, attribute)
        key = id(variable)
        after = _unique(self.accesses.get(key, []) +
                        self._calls_holding(variable, self.since.get(key, 0)) +
                        ([self.last_written[key]] if key in self.last_written else []))
        node_name = trace.unique_name(f"{attribute}.{method}")
        layer = VariableWrite(variable, method, like=trace.layer, name=node_name)
        output = trace.record_layer(layer, node_name, tensor, after=after)
        self.accesses[key] = []
        self.since[key] = len(self.calls)
        self.seen[key] = self.last_written[key] = output
        self.writes.append(output)
        self._refresh_view(variable, output)
        note_writes_variables(trace.layer)  # a node of it is never recomputed
        return output

    def _value(self, variable, method, value, attribute):
        name = f"`{variable.path}` (`{method}`)"
        if isinstance(value, keras.Variable):
            raise WriteError(
                f"`call` writes the variable {name} with the variable `{value.path}` "
                "read outside the graph: read it as an attribute of the layer")
        if isinstance(value, keras.KerasTensor):
            tensor = value
        elif _is_tensor(value):
            # computed while tracing, from neither the inputs nor a variable
            # (`tf.random.uniform(shape)`, `ops.zeros(shape)`): the graph
            # would write that one value on every call
            raise WriteError(
                f"`call` writes the variable {name} with a tensor computed outside the "
                "graph (not from the layer's inputs or variables), which the graph would "
                "write unchanged on every call: compute it with `keras.ops` from the "
                "inputs or the variable (`ops.zeros_like(self.v)`, `keras.random` with a "
                "seed generator), or give a NumPy array or a number")
        else:
            try:
                # a tensor, as the trace lifts them (and checks none is frozen)
                array = keras.ops.convert_to_tensor(np.asarray(value, dtype=variable.dtype))
            except (TypeError, ValueError) as error:
                raise WriteError(f"`call` writes the variable {name} with a value the graph "
                                 f"cannot hold ({type(value).__name__}: {error})") from None
            tensor = self.trace.lift((array,), {}, self.trace.layer,
                                     role=f"{attribute}_{method}_value")[0][0]
        shape, target = tuple(tensor.shape), tuple(variable.shape)
        written = shape if method == "assign" else _broadcast(target, shape)
        if written != target:
            batch = (" (its size depends on the batch size, unknown while tracing: "
                     "pass static_batch=True to trace with the per-replica batch)"
                     if None in shape else "")
            raise WriteError(
                f"`call` writes the variable {name} with a value of shape {shape}, "
                f"not its shape {target}{batch}")
        return tensor

    def _refresh_view(self, variable, output):
        """The traced layer's attributes holding a read of `variable` hold
        the written value from now (alone, or in a list or dict)."""
        if self.view is None:
            return
        state = vars(self.view)

        def fresh(value):
            if isinstance(value, state_lib.ReadTensor) and value.variable is variable:
                return output
            if isinstance(value, list):
                return [fresh(item) for item in value]
            if isinstance(value, tuple) and not hasattr(value, "_fields"):
                return tuple(fresh(item) for item in value)
            if isinstance(value, dict):
                return {key: fresh(item) for key, item in value.items()}
            return value

        for attribute in list(state):
            value = state[attribute]
            if isinstance(value, (state_lib.ReadTensor, list, tuple, dict)):
                state[attribute] = fresh(value)

    # -- ordering ------------------------------------------------------------
    def after(self, tensor, writes):
        """`tensor` passed through an `AfterWrites` node on `writes`."""
        name = self.trace.unique_name("after_writes")
        return self.trace.record_layer(AfterWrites(name=name), name, tensor, list(writes))

    def _gate_first(self, structure, writes, consumer):
        leaf = _first_dense(structure)
        if leaf is None:
            raise WriteError(
                f"`call` wrote a variable that `{consumer.name}` holds, and then calls "
                "it on no dense tensor to order the call after the write")
        return _replace_first(structure, leaf, self.after(leaf, writes))

    def finish(self, outputs):
        """`outputs` with the first one coming after every write not
        already before it (a write nothing reads stays in the graph)."""
        if not self.writes:
            return outputs
        leaf = _first_dense(outputs)
        if leaf is None:
            raise WriteError("`call` writes a variable and returns no dense tensor to "
                             "order the write before")
        missing = [write for write in _unique(self.writes) if not _reaches(leaf, write)]
        if not missing:
            return outputs
        return _replace_first(outputs, leaf, self.after(leaf, missing))


def _replace_first(structure, leaf, replacement):
    """`structure` with its first occurrence of `leaf` replaced."""
    done = []

    def swap(item):
        if item is leaf and not done:
            done.append(True)
            return replacement
        return item

    return keras.tree.map_structure(swap, structure)


def _context():
    return tf.executing_eagerly(), id(tf.compat.v1.get_default_graph())


def current():
    """The `WriteRecorder` of the call being traced on this thread, or None."""
    return getattr(_recording, "recorder", None)


# -- the views of Keras sub-layers whose variables `call` reads -----------------
def variable_attributes(layer):
    """The attribute names under which `layer` holds a Keras variable
    (`kernel`, `bias`, `moving_mean`; properties of its class included)."""
    names = {name for name, value in vars(layer).items()
             if isinstance(value, keras.Variable) and not name.startswith("_")}
    for name in _property_names(type(layer)):
        try:
            value = getattr(layer, name)
        except Exception:  # a property that needs more than a built layer
            continue
        if isinstance(value, keras.Variable):
            names.add(name)
    return frozenset(names)


@functools.lru_cache(maxsize=None)
def _property_names(cls):
    """Public properties `cls` defines below Keras's `Layer` (`kernel`)."""
    names = set()
    for klass in cls.__mro__:
        if klass in (keras.layers.Layer, _compat.Operation, object):
            break
        names.update(name for name, value in vars(klass).items()
                     if isinstance(value, property) and not name.startswith("_"))
    return tuple(sorted(names))


def reading_members(cls, names):
    """Properties for a view class of `cls` whose attributes `names` (the
    variables of the layer, `variable_attributes`) read as
    `WriteRecorder.sub_layer_variable` says while a call is traced."""
    return {name: _reading_property(name, _class_attribute(cls, name)) for name in names}


def _class_attribute(cls, name):
    for klass in cls.__mro__:
        if name in vars(klass):
            return vars(klass)[name]
    return None


def _reading_property(name, original):
    def get(self):
        if isinstance(original, property):
            value = original.__get__(self, type(self))
        else:
            try:
                value = vars(self)[name]
            except KeyError:
                raise AttributeError(name) from None
        recorder = current()
        if recorder is not None and isinstance(value, keras.Variable):
            return recorder.sub_layer_variable(self, name, value)
        return value

    def set(self, value):
        if isinstance(original, property) and original.fset is not None:
            original.fset(self, value)
        else:
            vars(self)[name] = value

    return property(get, set)


# -- helpers -------------------------------------------------------------------
def _variable_ids(view):
    return {id(v) for v in (viewed_layer(view) or view).variables}


def _unique(tensors):
    seen, found = set(), []
    for tensor in tensors:
        if id(tensor) not in seen:
            seen.add(id(tensor))
            found.append(tensor)
    return found


def _first_dense(structure):
    leaves = [leaf for leaf in keras.tree.flatten(structure)
              if isinstance(leaf, keras.KerasTensor) and not leaf.ragged]
    for leaf in leaves:
        if not leaf.sparse:
            return leaf
    # Keras calls the product of a symbolic tensor and a number sparse
    # (`x * 2.0`: `ops.multiply` takes what is not a KerasTensor for
    # sparse); the tensors a kip graph carries are dense (sparse inputs are
    # refused, `inputs.py`), and the tracer makes such specs dense
    # (`trace_views.dense_unless_given_sparse`).
    return leaves[0] if leaves else None


def _is_tensor(value):
    return hasattr(value, "shape") and hasattr(value, "dtype") and not isinstance(
        value, np.ndarray) and keras.ops.is_tensor(value)


def _broadcast(target, shape):
    """The shape of `variable + value` (None where unknown), or None when the
    shapes do not broadcast."""
    if len(shape) > len(target):
        return None
    padded = (1,) * (len(target) - len(shape)) + shape
    result = []
    for a, b in zip(target, padded):
        if b == 1 or b == a:
            result.append(a)
        elif b is None:
            result.append(None)
        else:
            return None
    return tuple(result)


def _reaches(tensor, target):
    """Whether `target` is `tensor` or among the tensors it is computed from."""
    stack, seen = [tensor], set()
    while stack:
        item = stack.pop()
        if item is target:
            return True
        if id(item) in seen:
            continue
        seen.add(id(item))
        history = _compat.keras_history(item)
        if history is None or history[0] is None:  # an input of the traced call
            continue
        node, _ = _compat.producing_node(item)
        if node is None or _compat.is_input_node(node):
            continue
        stack.extend(_compat.node_input_tensors(node))
    return False
