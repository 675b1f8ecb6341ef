"""The train / test / predict functions the plugin gives a model.

`StepFunction` is the `train_function` / `test_function` that `fit` /
`evaluate` call (Keras honours one set before the first step): it runs the
step (the user's override, or Keras's own) on the converted graphs of a
`TrainingSession` (`session.py`), converting what the step calls at its first
occurrence (a dry run where the step is the user's), and rebuilding when
the step meets new variables. `PredictFunction` is `predict`'s.
`install` / `installed_session` give a model these functions (the callback
and `kip.scope`) and find the session they run on.

Example:
    ```python
    install(model, TrainingSession(model, model, passes=[]))
    isinstance(model.train_function, StepFunction)
    # -> True
    ```
"""

import contextlib
import weakref

import keras
import tensorflow as tf

from keras_ipu_plugin import _compat
from keras_ipu_plugin.errors import ConversionError
from keras_ipu_plugin.frontend.inputs import without_autotuning
from keras_ipu_plugin.runtime.variables import check_trains_under
from keras_ipu_plugin.training.session.calls import CallArguments
from keras_ipu_plugin.training.session.new_variables import NeedsExtension
from keras_ipu_plugin.training.session.new_variables import NewVariablesError
from keras_ipu_plugin.training.session.new_variables import describe_new_variables
from keras_ipu_plugin.training.session.new_variables import extend_optimizer
from keras_ipu_plugin.training.pipelined.step import pipelined_train_step
from keras_ipu_plugin.training.session.session import NeedsConversion
from keras_ipu_plugin.training.session.session import describe_structure_change

_MAX_REBUILDS_PER_STEP = 8


class StepFunction:
    """A `train_function` / `test_function` running `step(self_, data)`.

    `step` is the unbound step method to run (the user's override, or
    Keras's own), e.g. `type(model).train_step`.
    """

    def __init__(self, session, step, trains=False):
        self.session = session
        self.step = step
        self.trains = trains  # fit's train_function
        self.function = None
        self._last_iterator = _no_iterator
        # The compiled functions by the element spec of the iterators they
        # run on (see `_function_for`); `_spec`: the current one's.
        self._functions = {}
        self._spec = None

    @property
    def calls_self_on_x(self):
        return calls_self_on_x(self.session, self.step)

    def __call__(self, iterator):
        session = self.session
        if self.function is None:
            if self.trains:
                check_trains_under(session.subject, getattr(session.owner, "optimizer", None),
                                   session.strategy)
            data = _next(iterator)
            self._last_iterator = _weak(iterator)
            self._spec = _spec_key(iterator)
            if self.calls_self_on_x:
                session.convert(_first_x(session.owner, data))
            elif not session.owner.run_eagerly:
                convert_calls(session, self.step, data)  # eager steps convert as they call
            self._build_optimizer_before_the_trace()
            self._make()
            # The first execution trains on as many batches as every other
            # (`steps_per_execution`): the one read to convert from, and the
            # ones Keras's loop would have read after it.
            return self._run_batches(iterator, [data, *self._read(iterator, more=True)])
        if iterator is not self._last_iterator():  # a new epoch: a new iterator
            self._last_iterator = _weak(iterator)
            if session.structure_changed():
                if not session.rebuild_on_new_variables:
                    # Training on would run the old graph: the switched
                    # branch would silently never run.
                    raise NewVariablesError(describe_structure_change(session))
                session.rebuild("a Python attribute switched a branch of `call`")
                self._make()
            self._function_for(iterator)
        if session.owner.run_eagerly:
            return self._run_each(self._read(iterator))
        return self._run(iterator)

    def _read(self, iterator, more=False):
        """The batches one execution of Keras's loop reads from `iterator`:
        `steps_per_execution` of them, fewer where the data ends (`more`:
        the rest of an execution whose first batch was read already).
        Raises StopIteration where there is none."""
        count = max(int(self.session.owner.steps_per_execution or 1), 1) - int(more)
        batches = []
        for _ in range(count):
            try:
                batches.append(_next(iterator))
            except StopIteration:
                if not batches and not more:
                    raise
                break
        return batches

    def _run_batches(self, iterator, batches):
        """One execution on `batches` (read from `iterator` already), as
        Keras's compiled loop runs it: the step traced with the shapes
        `iterator` gives, every batch trained on once, in order."""
        if self.session.owner.run_eagerly:
            return self._run_each(batches)
        source = _batches_as_iterated(iterator, batches)
        return self._run_each(batches) if source is None else self._run(source)

    def _run_each(self, batches):
        """Run `batches` one step at a time (a list handed to Keras's
        function runs each as its own step). One at a time, a batch that
        needs a conversion is converted and trained on after the batches
        before it, never before them nor twice."""
        outputs = None
        for batch in batches:
            outputs = self._run([batch])
        return outputs

    def _build_optimizer_before_the_trace(self):
        """Build the optimizer on the variables Keras's own `train_step` will
        hand it, before the step is traced.

        Keras (to at least 3.15, no strategy) builds it inside the first
        traced step; TensorFlow then traces the step again because variables
        were made in it. Built here on the same list, in the same order, the
        step is traced once. A custom step may train another list: it is left
        to build its optimizer as it does alone.
        """
        session = self.session
        if self.step is not keras.Model.train_step or not self.calls_self_on_x or (
                session.owner.run_eagerly):
            return
        proxy = session.step_self()
        optimizer = getattr(proxy, "optimizer", None)
        variables = list(proxy.trainable_weights)
        if optimizer is None or optimizer.built or not variables:
            return
        with session.strategy.scope():
            optimizer.build(variables)

    def _function_for(self, iterator):
        """Run on a function traced for `iterator`'s element spec.

        Keras's one function, given an iterator of another spec (a later
        `fit` on sequences of another length), traces again with the
        differing dimensions relaxed to unknown. A call traced with its
        sequence length unknown reads None for `ops.shape(ids)[1]`, where the
        model slices `self.pos[:ops.shape(ids)[1]]`: its conversion would
        then fail (or Expand would) on the data. A function per spec traces
        the step with the dimensions the data has, as the first `fit` did,
        and converts the call for them.
        """
        key = _spec_key(iterator)
        if key == self._spec:
            return
        self._spec = key
        function = self._functions.get(key)
        if function is None:
            self._make(keep_others=True)
        else:
            self.function = function

    def _make(self, keep_others=False):
        """A new compiled function for the current spec (a conversion or a
        rebuild happened: the functions traced for other specs ran the old
        graphs, and are dropped unless `keep_others`)."""
        if not keep_others:
            self._functions = {}
        self.function = self._new_function()
        self._functions[self._spec] = self.function

    def _new_function(self):
        session, step = self.session, self.step
        proxy = session.step_self()

        across_workers = _compat.reduces_across_workers(session.strategy)
        # PipelineStages(microbatches=M): the pipelined step replaces Keras's
        # train_step (training/pipelined/step.py); None otherwise.
        pipelined = pipelined_train_step(session, step)

        def run_step(batch):
            session.traces += 1
            # Runs in Python only while the step is traced (or eagerly): the
            # watch sees every variable the step tries to create, at no cost
            # to compiled steps.
            with session.watch.watching(), session.tracing_step():
                logs = step(proxy, batch) if pipelined is None else pipelined(proxy, batch)
            if across_workers:
                # Keras (to at least 3.15) reduces step outputs across workers
                # with `strategy.reduce("MEAN", v, axis=0)`, which fails on
                # the scalar logs ("Invalid reduction dimension 0 for input
                # with 0 dimensions"); a length-1 axis reduces to the mean.
                logs = tf.nest.map_structure(_with_leading_axis, logs)
            return logs

        jit_compile = None if pipelined is None else pipelined.jit_compile(
            session.owner.jit_compile, session.jit_compile_asked)
        return _compat.make_step_function(session.owner, run_step, jit_compile)

    def _run(self, source):
        session = self.session
        eager = session.owner.run_eagerly
        for _ in range(_MAX_REBUILDS_PER_STEP):
            traces = session.traces
            session.watch.take()
            try:
                # In graph mode variables can only appear while the step is
                # traced, which `session.traces` counts: the compiled steps
                # pay nothing. Eager steps run under the watch's creator scope.
                with session.watch.watching() if eager else contextlib.nullcontext():
                    outputs = self.function(source)
            except NeedsExtension as need:
                # Met while tracing (or in a replica): nothing ran; extend the
                # optimizer outside, under its strategy, and trace anew.
                added = extend_optimizer(need.optimizer, need.variables)
                for conversion in session.conversions:
                    conversion.model.kip_report.add(
                        "rebuild", need.optimizer.name, "optimizer extended",
                        ", ".join(v.path for v in added))
                self._make()
                continue
            except NeedsConversion as need:
                # Met while tracing: nothing ran. The batches the execution
                # would have read are read now; the first shows the concrete
                # arguments, and all are then trained on as usual (a list
                # holds one batch: see `_run_each`).
                batches = source if isinstance(source, list) else self._read(source)
                for callee, signature in need.misses:
                    convert_calls(session, self.step, batches[0], callee, signature)
                self._make()
                if isinstance(source, list):
                    source = batches
                    continue
                source = _batches_as_iterated(source, batches)
                if source is None:
                    return self._run_each(batches)
                continue
            except Exception as error:
                if not session.watch.refused:
                    raise  # the user's own error, as it was raised
                # A variable creation failed: variables created on a later
                # trace of the tf.function than its first.
                if not session.rebuild_on_new_variables:
                    raise NewVariablesError(describe_new_variables(
                        session.new_variables(), session.subject)) from error
                session.rebuild("variables created while tracing")
                self._make()
                continue
            created = session.watch.changed if eager else session.traces != traces
            new = session.new_variables() if created else []
            if new:
                if not session.rebuild_on_new_variables:
                    raise NewVariablesError(describe_new_variables(new, session.subject))
                session.rebuild("variables created in a step")
                self._make()
            return outputs
        raise RuntimeError(
            f"keras_ipu_plugin: model `{session.subject.name}` kept creating "
            "variables or calls to convert; gave up after repeated rebuilds in one step."
        )


class PredictFunction:
    """Keras's `predict_function`, converting first a call its trace meets
    without a conversion (predicting at a new image size: Keras traces the
    function again with the size left open)."""

    def __init__(self, session, step, function):
        self.session = session
        self.step = step
        self.function = function

    def __call__(self, data):
        for _ in range(_MAX_REBUILDS_PER_STEP):
            try:
                return self.function(data)
            except NeedsConversion as need:
                # Keras hands over the batches of one execution, concrete.
                for callee, signature in need.misses:
                    convert_calls(self.session, self.step, data[0], callee, signature)
        raise RuntimeError(
            f"keras_ipu_plugin: predicting with `{self.session.subject.name}` kept "
            "meeting calls to convert; gave up."
        )


def calls_self_on_x(session, step):
    """Keras's own steps call `self(x)` with the batch's `x`, and nothing
    else unless the model's own `compute_loss` / `compute_metrics` do."""
    cls = type(session.subject)
    own = (keras.Model.train_step, keras.Model.test_step, keras.Model.predict_step)
    return step in own and (
        cls.compute_loss is keras.Model.compute_loss
        and cls.compute_metrics is keras.Model.compute_metrics
    )


def convert_calls(session, step, data, callee=None, signature=None):
    """Convert the calls `step` makes on `data`: all of them, or the one to
    `callee` that `signature` (from a trace) describes."""
    if callee is session.subject and calls_self_on_x(session, step):
        x = _first_x(session.owner, data)
        session.add_conversion(callee, CallArguments(x), signature)
        return
    examples = session.record_calls(step, data)
    if callee is None:
        for made_by, call in examples:
            if session.find(made_by, call) is None:
                session.add_conversion(made_by, call)
        return
    example = next((call for made_by, call in examples
                    if made_by is callee and signature.accepts(call.signature())), None)
    if example is None:
        raise ConversionError(
            f"The step calls `{callee.name}` on {signature.describe()} when "
            "traced, but made no such call when run on a batch, so there is "
            "nothing to convert it from. Does the step branch on something "
            "that differs between tracing and running?"
        )
    session.add_conversion(callee, example, signature)


def _with_leading_axis(value):
    value = tf.convert_to_tensor(value)
    return tf.reshape(value, [1]) if value.shape.rank == 0 else value


def _next(iterator):
    if isinstance(iterator, (tf.data.Iterator, tf.distribute.DistributedIterator)):
        try:
            return iterator.get_next()
        except tf.errors.OutOfRangeError:
            raise StopIteration
    return next(iter(iterator))


def _batches_as_iterated(iterator, batches):
    """An iterator over `batches` (read from `iterator`, to convert from)
    with the shapes `iterator` gives, or None where it cannot be made (a
    distributed iterator: the batches are then run one at a time).

    Handed over concrete (a list), a batch would trace the compiled step
    with its static shapes (`(4, 8, 8, 3)`), where `fit` traces it with the
    iterator's (`(None, 8, 8, 3)`). TensorFlow optimises the two graphs
    differently, so the first step rounds differently from plain Keras: a
    gradient that is zero but for rounding (a bias before a softmax) then
    takes another Adam step, and training differs. An iterator whose
    elements have the original iterator's shapes traces the graph `fit`
    traces, and Keras's loop over it runs one step per batch, as many as
    `steps_per_execution` allows.

    Example:
        ```python
        source = _batches_as_iterated(iterator, [first, second])
        _next(source) is not None   # `first`, with `iterator`'s shapes
        # -> True
        ```
    """
    spec = getattr(iterator, "element_spec", None)
    if not isinstance(iterator, tf.data.Iterator) or not all(
        isinstance(leaf, tf.TensorSpec) for leaf in tf.nest.flatten(spec)
    ):
        return None
    try:
        for batch in batches:
            tf.nest.assert_same_structure(batch, spec)
    except (TypeError, ValueError):
        return None

    def as_iterated(batch):
        return tf.nest.map_structure(
            lambda tensor, leaf: tf.compat.v1.placeholder_with_default(tensor, leaf.shape),
            batch, spec,
        )

    # One dataset per batch, concatenated: batches of the execution may
    # differ in shape (a partial last batch).
    single = None
    for batch in batches:
        one = tf.data.Dataset.from_tensors((batch,)).map(as_iterated)
        single = one if single is None else single.concatenate(one)
    return iter(without_autotuning(single))


def _spec_key(iterator):
    """What tells iterators that trace the step differently apart: their
    element spec (a list of batches, run eagerly: one key for all)."""
    spec = getattr(iterator, "element_spec", None)
    if spec is None:
        return None
    key = (str(tf.nest.map_structure(lambda _: 0, spec)), tuple(tf.nest.flatten(spec)))
    try:
        hash(key)
    except TypeError:  # a spec TensorFlow does not hash: its description
        return repr(spec)
    return key


def _no_iterator():
    return None


def _weak(iterator):
    """A callable giving `iterator` back while it lives.

    The step function only compares the iterator `fit` hands it with the
    last one; holding it would keep the epoch's iterator (and its tf.data
    threads) alive as long as the model, to be deleted by Python's cyclic
    collector at some later, unrelated moment.
    """
    try:
        return weakref.ref(iterator)
    except TypeError:  # a list of batches (an eager step): nothing to free
        return lambda: iterator


def _first_x(model, data):
    """`x` of one replica's share of a (possibly distributed) batch."""
    strategy = model.distribute_strategy
    local = tf.nest.map_structure(
        lambda v: strategy.experimental_local_results(v)[0], data
    )
    return keras.utils.unpack_x_y_sample_weight(local)[0]


def installed_session(model):
    """The session whose train / test functions `model` holds now (given by
    `kip.scope` or a callback; a later `compile` resets them), or None."""
    for attribute in ("train_function", "test_function"):
        function = vars(model).get(attribute)
        if isinstance(function, StepFunction) and function.session.owner is model:
            return function.session
    return None


def install(model, session):
    """Give `model` plugin train / test functions (what the callback and
    `kip.scope` do), keeping ones already given for the same session so a
    second `fit` does not trace the step again."""
    for attribute, step in (("train_function", "train_step"), ("test_function", "test_step")):
        current = getattr(model, attribute, None)
        if not (isinstance(current, StepFunction) and current.session is session):
            setattr(model, attribute, StepFunction(
                session, getattr(type(model), step), trains=step == "train_step"))
