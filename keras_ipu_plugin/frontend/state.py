"""What converting may change on a user's model, and putting it back.

Converting runs the user's own code: `call` once eagerly to build a model
never called, symbolically to trace it, and twice more to verify it (the
original and the converted model). That code may count its calls in a
variable, advance a seed generator, move BatchNormalization statistics or
set Python attributes. None of it may stay behind:

- `guarded(model, work)` is the one way to run a conversion over a model:
  `ModelState` remembers the model before it and puts it back, everything
  on failure, everything but the building on success.
- `VariableValues` remembers the values of some variables.
- `replay_state` lets two runs start from the same variable values (so a
  model drawing random numbers at inference sees the same draws twice).
"""

import contextlib
import functools

import numpy as np
import tensorflow as tf

from keras_ipu_plugin import _compat
from keras_ipu_plugin.runtime.variables import strategy_owning
from keras_ipu_plugin.layers.user_code import is_user_class
from keras_ipu_plugin.frontend.trace.writes import handles_of


class VariableValues:
    """The values of `variables` now, to compare with or put back later.

    Example:
        ```python
        values = VariableValues(model.non_trainable_variables)
        model(x)
        values.changed()      # the variables `call` assigned
        values.restore()
        ```
    """

    def __init__(self, variables):
        self.ids = set()
        self._values = []
        for variable in variables:
            if id(variable) not in self.ids:
                self.ids.add(id(variable))
                self._values.append((variable, _read(variable)))

    def changed(self):
        return [v for v, value in self._values if not _same(_now(v), value)]

    def handle_ids(self):
        """The ids of the resource tensors behind the variables (what
        TensorFlow's op callbacks see, `UndoneWrites`)."""
        if not hasattr(self, "_handle_ids"):
            self._handle_ids = {id(h) for v, _ in self._values for h in handles_of(v)}
        return self._handle_ids

    def changed_values(self, put_back=False):
        """`{id(variable): (variable, its value now)}` for those changed;
        `put_back`: and put them back (each variable read once, where
        `restore()` after would read every one again)."""
        found = {}
        for variable, value in self._values:
            now = _now(variable)
            if not _same(now, value):
                found[id(variable)] = (variable, np.array(now, copy=True))
                if put_back:
                    with strategy_owning([variable]).scope():
                        variable.assign(value)
        return found

    def restore(self):
        # Only what changed, under the strategy that made the variable: an
        # assignment can itself fail (a mirrored variable outside its
        # strategy's scope).
        for variable, value in self._values:
            if not _same(_now(variable), value):
                with strategy_owning([variable]).scope():
                    variable.assign(value)


class NewVariables:
    """Variables created while `recording()`, with their values at creation.

    Only variables created non-trainable are read (what a call can change:
    counters, statistics, seed-generator state); reading every new weight
    would copy a whole model to the host.
    """

    def __init__(self):
        self._records = []  # [tf variable, value at creation or None]

    @contextlib.contextmanager
    def recording(self):
        with tf.variable_creator_scope(self._creator):
            yield self

    def _creator(self, next_creator, **kwargs):
        variable = next_creator(**kwargs)
        if not kwargs.get("trainable", True):
            # Inside a `tf.function` trace the variable has no value yet:
            # `settle()` reads it once the trace is done.
            value = _read(variable) if tf.executing_eagerly() else None
            self._records.append([variable, value])
        return variable

    def created_any(self):
        """Whether any variable was recorded."""
        return bool(self._records)

    def settle(self):
        """Read the variables created inside a graph trace, whose values
        exist only once the trace is over; call before anything runs them."""
        for record in self._records:
            if record[1] is None:
                record[1] = _read(record[0])

    def restore(self, variables):
        """Put those of `variables` (Keras or TF variables) created while
        recording back to their values at creation."""
        wanted = {id(_compat.backing_variable(v)) for v in variables}
        for variable, value in self._records:
            if id(variable) in wanted and value is not None and not _same(_now(variable), value):
                variable.assign(value)


class UndoneWrites:
    """Puts back every variable that existed before and that a block of
    eager code wrote, the model's or not (a random layer the model calls
    but does not own: its seed generator's state), to the value first read
    from it in the block. Seen through TensorFlow's op callbacks on this
    thread, as `writes.WriteLog` sees writes: a write reads the variable
    first (a seed generator's `next`, a moving average), and that read is
    its value before.

    Example:
        ```python
        with UndoneWrites():
            model(x)            # builds the model; draws nothing that stays
        ```
    """

    def __init__(self):
        self._first_reads = {}  # id(handle) -> (handle, value first read)
        self._written = {}  # id(handle) -> handle
        self._created = set()

    def __enter__(self):
        self._callback = _compat.op_callback(self._seen)
        self._callback.__enter__()
        return self

    def __exit__(self, *exc_info):
        self._callback.__exit__(*exc_info)
        self.put_back()
        self._first_reads.clear()
        return False

    def _restorable(self):
        return [(key, handle) for key, handle in self._written.items()
                if key in self._first_reads and key not in self._created]

    def written_values(self):
        """`{id(handle): NumPy value now}` of the variables written so far
        that existed before (those whose value before is known)."""
        return {key: tf.raw_ops.ReadVariableOp(
                    resource=handle, dtype=self._first_reads[key][1].dtype).numpy()
                for key, handle in self._restorable()}

    def put_back(self):
        """Put the written variables back now (recording goes on)."""
        for key, handle in self._restorable():
            tf.raw_ops.AssignVariableOp(resource=handle, value=self._first_reads[key][1])

    def _seen(self, op_type, inputs, attrs, outputs, op_name=None, graph=None):
        if graph is not None or not inputs:
            return None  # an op added to a graph: nothing ran
        if isinstance(op_type, bytes):
            op_type = op_type.decode("utf-8", "replace")
        if op_type == "VarHandleOp":
            self._created.update(id(h) for h in outputs or ())
        elif op_type == "ReadVariableOp":
            self._first_reads.setdefault(id(inputs[0]), (inputs[0], outputs[0]))
        elif op_type in ("AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp"):
            self._written[id(inputs[0])] = inputs[0]
        return None


class ModelState:
    """A snapshot of what a conversion can change on `model`, to undo it.

    On failure, `undo_after(error)` puts back everything it covers:
      - the instance attributes of the model, of every layer in it and of
        their variable trackers (names and the objects they are bound to:
        a layer built by the conversion is unbuilt again, its new variables
        dropped), and the contents of the lists, dicts and sets reachable
        from those attributes (variable lists, node lists, build shapes),
        TensorFlow's tracking wrappers included;
      - the values of the non-trainable variables (counters,
        BatchNormalization statistics, seed-generator state) and of Keras's
        global seed generator (unseeded `keras.random` calls).
    A step of that which fails is noted on `error`, never raised instead.

    On success, `restore_after_success()` puts back the state the model's
    own code keeps, and keeps the building (the one change a conversion
    makes, as Keras's own first call or `fit` would):
      - every non-trainable variable that existed before holds its value
        from before, and Keras's global seed generator its state;
      - every non-trainable variable the conversion created (building a
        model never called) holds its value at creation (the conversion's
        calls counted nothing, drew nothing);
      - the plain Python attributes (numbers, strings, booleans, None, and
        tuples of them) of the model and of its layers of user-written
        classes hold their values from before the conversion — for a layer
        the conversion built, from right after the call that built it
        (`mark_built`); plain attributes a later call added are removed.
        Keras's own bookkeeping (`built`, ...) is left as Keras set it.
    Not restored on success: trainable variables (nothing in a conversion
    assigns them; copying them would double a model's memory), and the
    contents of containers (Keras's node lists legitimately gain the
    converted model's nodes; a list `call` appends to keeps the entries).

    Used through `guarded(model, work)`.
    """

    def __init__(self, model):
        self.model = model
        objects = []
        for layer in _compat.all_layers(model):
            objects.append(layer)
            tracker = vars(layer).get("_tracker")
            if tracker is not None:
                objects.append(tracker)
        self._objects = _ObjectsState(objects)
        self._values = VariableValues(_state_variables(model))
        self._new = NewVariables()
        self._attributes = {}  # id(layer) -> _PlainAttributes
        self.mark_built()

    def recording(self):
        """Record the variables created inside (their values at creation)."""
        return self._new.recording()

    def mark_built(self):
        """Remember the plain attributes of layers built since the snapshot
        (call right after the call that built the model)."""
        self._new.settle()
        for layer in _compat.all_layers(self.model):
            if id(layer) not in self._attributes and layer.built and _is_user_class(layer):
                self._attributes[id(layer)] = _PlainAttributes(layer)

    def settle(self):
        """See `NewVariables.settle`."""
        self._new.settle()

    def restore_after_success(self):
        self._new.settle()
        self._values.restore()
        if self._new.created_any():  # (listing the model's variables is not free)
            self._new.restore(_state_variables(self.model))
        for attributes in self._attributes.values():
            attributes.restore()

    def undo_after(self, error):
        """Put everything back after `error`; note on it what could not be.
        A KeyboardInterrupt (or other BaseException) while undoing does not
        cut the undo short: it is raised once the rest is put back."""
        steps = [functools.partial(self._objects.restore_object, index)
                 for index in range(len(self._objects.objects))]
        steps += [self._values.restore, lambda: self._new.restore(_state_variables(self.model))]
        interrupt = None
        for step in steps:
            for _ in range(2):
                try:
                    step()
                except BaseException as failure:  # the user's error stays the one raised
                    if not isinstance(failure, Exception) and interrupt is None:
                        # A second Ctrl-C while undoing the first: do that
                        # step again and finish the undo, then stop as asked.
                        interrupt = failure
                        continue
                    error.add_note(
                        f"keras_ipu_plugin: while undoing the conversion of "
                        f"`{self.model.name}` after this error, restoring its state also "
                        f"failed ({type(failure).__name__}: {failure}); the model may be "
                        "left partly changed."
                    )
                break
        if interrupt is not None:
            raise interrupt


def guarded(model, work):
    """`work(state)`, run over `model`, and the model put back: on success,
    all but the building (`ModelState.restore_after_success`); on any error
    or interrupt, everything (`ModelState.undo_after`), then re-raised.
    `state` is the `ModelState` (for `mark_built` and `settle`); the
    variables `work` creates are recorded (`ModelState.recording`). Returns
    what `work` returns.

    A function, not a `with` block: a Ctrl-C can come as a context
    manager's `__exit__` is entered, after the block's last line and
    before anything could undo it, and the result the block made (whose
    Keras nodes are on the user's layers) would be dropped with the model
    left changed. Here, from `work`'s first line to the result handed
    back, every moment is inside this `try`.

    Example:
        ```python
        graph = guarded(model, lambda state: trace_model(model, specs))
        ```
    """
    state = ModelState(model)
    try:
        with state.recording():
            result = work(state)
        state.restore_after_success()
    except BaseException as error:
        state.undo_after(error)
        raise
    return result


def _state_variables(model):
    """What a call can change: the model's non-trainable variables (seed
    generators' state included) and Keras's global seed generator's."""
    variables = list(model.non_trainable_variables)
    global_seed = _compat.global_seed_generator_state()
    if global_seed is not None:
        variables.append(global_seed)
    return variables


@contextlib.contextmanager
def replay_state(*models):
    """Run blocks from the same variable state of `models`: `replay()` puts
    back the values the non-trainable variables (and Keras's global seed
    generator) had on entry; leaving the block puts them back too.

    Example:
        ```python
        with replay_state(original, converted) as replay:
            reference = original(x)
            replay()      # the same random draws, counters, statistics
            result = converted(x)
        ```
    """
    values = VariableValues([v for model in models for v in _state_variables(model)])
    new = NewVariables()

    def replay():
        new.settle()
        values.restore()
        # A global seed generator the first run created starts anew too.
        new.restore([v for model in models for v in _state_variables(model)])

    with new.recording():
        try:
            yield replay
        except BaseException:
            with contextlib.suppress(Exception):  # the block's error is the one to see
                replay()
            raise
    replay()


class _PlainAttributes:
    """A layer's plain Python attributes, and the names it had."""

    def __init__(self, layer):
        self.layer = layer
        current = vars(layer)
        self.names = set(current)
        # Most attributes are Keras's lists and objects: a set lookup turns
        # them away (this runs for every attribute of every user layer).
        not_plain = _NOT_PLAIN_TYPES
        self.values = {name: value for name, value in current.items()
                       if type(value) not in not_plain and _is_users(name, value)}

    def restore(self):
        current = vars(self.layer)
        for name in [n for n in current if n not in self.names and _is_users(n, current[n])]:
            del current[name]
        for name, value in self.values.items():
            if current.get(name, _MISSING) is not value:
                current[name] = value


def _is_users(name, value):
    # The value first: most attributes of a layer are not plain.
    return (_is_plain(value) and name not in _compat.LAYER_BOOKKEEPING
            and not name.startswith(_compat.TRACKABLE_PREFIX))


_PLAIN = (bool, int, float, complex, str, bytes, type(None), np.generic)
_PLAIN_TYPES = frozenset(_PLAIN[:-1])  # exactly these types: a set lookup


#: Types none of whose values is plain (learnt by `_is_plain`): every type
#: but the plain ones and the tuples and frozensets, whose plainness
#: depends on their items.
_NOT_PLAIN_TYPES = set()


def _is_plain(value):
    kind = type(value)
    if kind in _PLAIN_TYPES:
        return True
    if isinstance(value, (tuple, frozenset)):
        return all(_is_plain(item) for item in value)
    if isinstance(value, _PLAIN):
        return True
    _NOT_PLAIN_TYPES.add(kind)
    return False


def _is_user_class(layer):
    # The one rule (`user_code.py`): Keras's applications count as user
    # code, whose plain attributes are put back too (no attribute of theirs
    # changes in a trace; putting one back is a no-op).
    return is_user_class(type(layer))


class _ObjectsState:
    """The `__dict__` of each of `objects`, and the contents of every list /
    dict / set reachable from them through containers only (each container
    once, however many objects reach it).

    It is all kept in a few flat lists. A snapshot of a 500-block model
    covers about 75,000 containers, most of them empty; a copy (or a tuple)
    per container, as the obvious snapshot makes, is 120,000 objects, and
    every object allocated brings Python's cyclic collector closer to a
    full collection, which walks every object of the process (TensorFlow's
    included) and cost more than the rest of the conversion. Here a
    container costs an entry in each of `storages` and `lengths` and its
    items in `items` (a dict's keys, then its values).

    Example:
        ```python
        state = _ObjectsState([layer, vars(layer)["_tracker"]])
        state.restore_object(0)    # the layer's attributes and containers
        ```
    """

    def __init__(self, objects):
        self.objects = list(objects)
        self._attribute_counts, self._names, self._values = [], [], []
        self._container_counts = []
        self._storages = []  # the raw containers (`_compat.raw_container`)
        self._lengths = []  # the number of items of each
        self._items = []  # their items, flat (a dict's keys, then its values)
        self._wrappers = {}  # index in `_storages` -> (TF wrapper, its bookkeeping)
        seen = set()
        for obj in self.objects:
            state = vars(obj)
            self._attribute_counts.append(len(state))
            self._names.extend(state)
            self._values.extend(state.values())
            before = len(self._storages)
            self._remember_all(state.values(), seen)
            self._container_counts.append(len(self._storages) - before)

    def _remember_all(self, values, seen):
        # A set lookup skips the values that are not containers (Keras's
        # node lists hold one Node per call ever made): this runs for every
        # attribute of every layer, twice per conversion.
        never, own = _compat.NEVER_CONTAINERS, _compat.OWN_STORAGE
        storages, lengths, items = self._storages, self._lengths, self._items
        for value in values:
            kind = type(value)
            if kind in never:
                continue
            if kind in own:  # Keras's tracked containers: no wrapper
                storage = value
                if id(storage) in seen:
                    continue
            else:
                storage = _compat.raw_container(value)
                if storage is None or id(storage) in seen:
                    continue
                bookkeeping = _compat.wrapper_bookkeeping(value)
                if bookkeeping:
                    self._wrappers[len(storages)] = (value, bookkeeping)
            seen.add(id(storage))
            storages.append(storage)
            lengths.append(len(storage))
            if not storage:
                continue
            if isinstance(storage, dict):
                items.extend(dict.keys(storage))
                items.extend(dict.values(storage))
                self._remember_all(dict.values(storage), seen)
            else:
                items.extend(storage)
                self._remember_all(storage, seen)

    def restore_object(self, index):
        """Put back the attributes of `objects[index]` and the containers
        first reached from it."""
        first_attribute = sum(self._attribute_counts[:index])
        end = first_attribute + self._attribute_counts[index]
        attributes = dict(zip(self._names[first_attribute:end],
                              self._values[first_attribute:end]))
        current = vars(self.objects[index])
        for name in [name for name in current if name not in attributes]:
            del current[name]
        for name, value in attributes.items():
            if current.get(name, _MISSING) is not value:
                current[name] = value
        first = sum(self._container_counts[:index])
        position = sum(
            length * (2 if isinstance(storage, dict) else 1)
            for storage, length in zip(self._storages[:first], self._lengths[:first])
        )
        # The base-class methods on the raw containers: Keras's and
        # TensorFlow's tracked containers would re-track (and so
        # re-register) every item put back through their own.
        for container in range(first, first + self._container_counts[index]):
            storage, length = self._storages[container], self._lengths[container]
            if isinstance(storage, dict):
                keys = self._items[position:position + length]
                values = self._items[position + length:position + 2 * length]
                position += 2 * length
                dict.clear(storage)
                dict.update(storage, zip(keys, values))
            else:
                items = self._items[position:position + length]
                position += length
                if isinstance(storage, list):
                    list.__setitem__(storage, slice(None), items)
                else:
                    set.clear(storage)
                    set.update(storage, items)
            if container in self._wrappers:
                _compat.restore_wrapper_bookkeeping(*self._wrappers[container])


_MISSING = object()


def _read(variable):
    """A copy of `variable`'s value, to keep."""
    return np.array(variable.numpy(), copy=True)


def _now(variable):
    """`variable`'s value, to compare at once and drop: no copy of its own
    (on a model's worth of weights, compared before every verification
    run, the copies took as long as the runs)."""
    return np.asarray(variable.numpy())


def _same(a, b):
    """Exactly equal, bit for bit: NaN included (a variable holding NaN is
    unchanged)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.dtype.kind == "O":
        return bool(np.array_equal(a, b))
    return bool(np.array_equal(_bits(a), _bits(b)))


def _bits(array):
    """`array`'s bytes as unsigned integers of its item size, a view where
    it is contiguous (comparing them needs no copy, unlike `tobytes`)."""
    flat = np.ascontiguousarray(array).reshape(-1)
    unsigned = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}.get(flat.dtype.itemsize)
    return flat.view(unsigned or np.uint8)


__all__ = ["ModelState", "VariableValues", "NewVariables", "replay_state"]
