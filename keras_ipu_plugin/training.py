"""Route a compiled model's `fit` / `evaluate` through its converted graph.

One `Runtime` per model holds what every entry point shares (the converter,
the converted model, the `VariableWatch`); `StepFunction` is the
`train_function` / `test_function` that `fit` / `evaluate` call (Keras
honours one set before the first step). At its first call it reads the
first batch from the iterator `fit` passes, converts, runs that batch, and
from then on runs the model's own `train_step` with the forward pass going
through the converted graph.

New variables: a step that creates variables, an optimizer that meets
variables it does not know, or a model whose layer sequence changed at an
epoch boundary leads to a rebuild of the converted graph and of the step
function; the optimizer gains state for the new variables only.
"""

import contextlib
import types

import keras
import tensorflow as tf

from keras_ipu_plugin import _keras_internals
from keras_ipu_plugin.apply import apply_passes
from keras_ipu_plugin.convert import Converter
from keras_ipu_plugin.distribution import check_built_under
from keras_ipu_plugin.dynamic import NeedsExtension
from keras_ipu_plugin.dynamic import NewVariablesError
from keras_ipu_plugin.dynamic import OptimizingFacade
from keras_ipu_plugin.dynamic import VariableWatch
from keras_ipu_plugin.dynamic import describe_new_variables
from keras_ipu_plugin.dynamic import extend_optimizer
from keras_ipu_plugin.dynamic import union_of_variables
from keras_ipu_plugin.errors import InputDataError
from keras_ipu_plugin.inputs import input_specs
from keras_ipu_plugin.opaque import OpaqueLayer
from keras_ipu_plugin.tracing import TraceError
from keras_ipu_plugin.tracing import trace_model
from keras_ipu_plugin.views import LIBRARY_PACKAGES

_MAX_REBUILDS_PER_STEP = 8


class Runtime:
    """Conversion state shared by the train and test functions of a model.

    `subject` is the model converted (the user's model); `owner` is the
    model whose attributes a train step sees as `self` (the user's model,
    or the PluginModel wrapping it).
    """

    def __init__(self, subject, owner, passes, verify=True, rebuild_on_new_variables=True):
        self.subject = subject
        self.owner = owner
        self.passes = passes
        self.verify = verify
        self.rebuild_on_new_variables = rebuild_on_new_variables
        self.watch = VariableWatch()
        self.converted = None
        self.first_x = None
        self.rebuilds = 0
        self.traces = 0  # Python runs of a step: traces, in graph mode
        self._known = set()
        self._layer_sequence = None
        self._fingerprint = None

    @property
    def strategy(self):
        return self.owner.distribute_strategy

    def convert(self, x):
        """Convert once, from the first batch `x`."""
        if self.converted is None:
            self.first_x = x
            self._convert()
        return self.converted

    def _convert(self, report_entries=()):
        check_built_under(self.subject, _keras_internals.model_strategy(self.owner))
        with self.strategy.scope(), self.watch.watching():
            converted = Converter(verify=self.verify).convert(self.subject, self.first_x)
            self._layer_sequence = _layer_sequence(converted)
            if self.passes:
                converted = apply_passes(converted, self.passes)
        self.watch.take()
        for entry in report_entries:
            converted.kip_report.add(*entry)
        self.converted = converted
        self._known = {id(v) for v in self.subject.variables}
        self._fingerprint = _attribute_fingerprint(self.subject)

    def rebuild(self, reason):
        """Convert again (the model's variables or layers changed)."""
        new = [v for v in self.subject.variables if id(v) not in self._known]
        entries = [("rebuild", self.subject.name, reason,
                    ", ".join(v.path for v in new) or "no new variables")]
        self.rebuilds += 1
        try:
            self._convert(report_entries=entries)
        except InputDataError as error:
            # The first batch was accepted when the model was converted; if
            # `call` fails on it now, the fault is the user's code, mid-
            # training: raise its own error, not one blaming the data.
            if error.__cause__ is None:
                raise
            raise error.__cause__

    def structure_changed(self):
        """Whether `call` now reaches other layers than at the last conversion
        (a Python attribute switched a branch). Checked at epoch boundaries:
        the model is traced again only when the plain Python attributes of
        its layers (flags, counts, names) changed since the last look."""
        if self._layer_sequence is None or _is_opaque(self.converted):
            return False
        fingerprint = _attribute_fingerprint(self.subject)
        if fingerprint == self._fingerprint:
            return False
        specs = input_specs(self.first_x)
        with self.strategy.scope(), self.watch.watching():
            try:
                graph = trace_model(self.subject, specs)
            except TraceError:
                return True
        if [id(layer) for layer in graph.layers()] != self._layer_sequence:
            return True  # the fingerprint is taken again by the rebuild
        self._fingerprint = fingerprint
        return False

    def new_variables(self):
        """Model variables created since the last conversion. Walks the
        model's variables: called only after a trace, or after an eager step
        in which the watch saw a variable being created."""
        self.watch.take()
        return [v for v in self.subject.trainable_variables if id(v) not in self._known]


class ForwardProxy:
    """Stands in for the model as `self` of its `train_step` / `test_step`:
    calling it runs the converted graph; optimizers are wrapped so that new
    variables are learnt; every other attribute is the model's own.

    Example:
        >>> proxy = ForwardProxy(runtime)
        >>> type(model).train_step(proxy, data)   # forward through the graph
    """

    def __init__(self, runtime):
        object.__setattr__(self, "_kip_runtime", runtime)

    def __call__(self, *args, **kwargs):
        return self._kip_runtime.converted(*args, **kwargs)

    def __getattr__(self, name):
        runtime = self._kip_runtime
        if name in _VARIABLE_VIEWS:
            # Layers a Replace pass created live only in the converted model.
            return union_of_variables(getattr(runtime.owner, name), getattr(runtime.converted, name))
        value = getattr(runtime.owner, name)
        if isinstance(value, keras.optimizers.Optimizer):
            return OptimizingFacade(value, runtime.rebuild_on_new_variables, runtime.subject)
        if _is_user_method(value, runtime):
            # A helper of the model's own class called from its train step
            # (`self.losses_of(x)`) must see the proxy as `self` too, so its
            # `self(x)` also runs the converted graph.
            return types.MethodType(value.__func__, self)
        return value

    def __setattr__(self, name, value):
        setattr(self._kip_runtime.owner, name, value)


class StepFunction:
    """A `train_function` / `test_function` running `step(proxy, data)`.

    `step` is the unbound step method to run (the user's override, or
    Keras's own), e.g. `type(model).train_step`.
    """

    def __init__(self, runtime, step):
        self.runtime = runtime
        self.step = step
        self.function = None
        self._iterator = None

    def __call__(self, iterator):
        runtime = self.runtime
        if runtime.converted is None or self.function is None:
            data = _next(iterator)
            self._iterator = iterator
            runtime.convert(_first_x(runtime.owner, data))
            self._make()
            return self._run([data])
        if iterator is not self._iterator:  # a new epoch: a new iterator
            self._iterator = iterator
            if runtime.structure_changed():
                if not runtime.rebuild_on_new_variables:
                    # Training on would run the old graph: the switched
                    # branch would silently never run.
                    raise NewVariablesError(describe_structure_change(runtime))
                runtime.rebuild("layers reached by `call` changed")
                self._make()
        if runtime.owner.run_eagerly:
            return self._run([_next(iterator)])
        return self._run(iterator)

    def _make(self):
        runtime, step = self.runtime, self.step
        proxy = ForwardProxy(runtime)

        across_workers = _keras_internals.reduces_across_workers(runtime.strategy)

        def run_step(batch):
            runtime.traces += 1
            # Runs in Python only while the step is traced (or eagerly): the
            # watch sees every variable the step tries to create, at no cost
            # to compiled steps.
            with runtime.watch.watching():
                logs = step(proxy, batch)
            if across_workers:
                # Keras (to at least 3.15) reduces step outputs across workers
                # with `strategy.reduce("MEAN", v, axis=0)`, which fails on
                # the scalar logs ("Invalid reduction dimension 0 for input
                # with 0 dimensions"); a length-1 axis reduces to the mean.
                logs = tf.nest.map_structure(_with_leading_axis, logs)
            return logs

        self.function = _keras_internals.make_step_function(runtime.owner, run_step)

    def _run(self, source):
        runtime = self.runtime
        eager = runtime.owner.run_eagerly
        for _ in range(_MAX_REBUILDS_PER_STEP):
            traces = runtime.traces
            runtime.watch.take()
            try:
                # In graph mode variables can only appear while the step is
                # traced, which `runtime.traces` counts: the compiled steps
                # pay nothing. Eager steps run under the watch's creator scope.
                with runtime.watch.watching() if eager else contextlib.nullcontext():
                    outputs = self.function(source)
            except NeedsExtension as need:
                # Met while tracing (or in a replica): nothing ran; extend the
                # optimizer outside, under its strategy, and trace anew.
                added = extend_optimizer(need.optimizer, need.variables)
                runtime.converted.kip_report.add(
                    "rebuild", need.optimizer.name, "optimizer extended",
                    ", ".join(v.path for v in added))
                self._make()
                continue
            except Exception as error:
                if not runtime.watch.refused:
                    raise  # the user's own error, as it was raised
                # A variable creation failed: variables created on a later
                # trace of the tf.function than its first.
                if not runtime.rebuild_on_new_variables:
                    raise NewVariablesError(describe_new_variables(
                        runtime.new_variables(), runtime.subject)) from error
                runtime.rebuild("variables created while tracing")
                self._make()
                continue
            created = runtime.watch.changed if eager else runtime.traces != traces
            new = runtime.new_variables() if created else []
            if new:
                if not runtime.rebuild_on_new_variables:
                    raise NewVariablesError(describe_new_variables(new, runtime.subject))
                runtime.rebuild("variables created in a step")
                self._make()
            return outputs
        raise RuntimeError(
            f"keras_ipu_plugin: model `{runtime.subject.name}` kept creating "
            "variables; gave up after repeated rebuilds in one step."
        )


def describe_structure_change(runtime):
    new = runtime.new_variables()
    what = describe_new_variables(new, runtime.subject) if new else (
        "The layers that `call` of model "
        f"`{runtime.subject.name}` reaches changed since it was converted (a "
        "Python attribute switched a branch). Pass rebuild_on_new_variables=True "
        "(the default) to kip.PluginModel / kip.PluginCallback to rebuild the graph."
    )
    return what


_VARIABLE_VIEWS = frozenset({
    "variables", "trainable_variables", "non_trainable_variables",
    "weights", "trainable_weights", "non_trainable_weights",
})


_PLAIN = (bool, int, float, str, type(None))


def _attribute_fingerprint(model):
    """The plain Python attributes of every layer of `model` (and the
    lengths of its containers): what a Python branch in `call` can read."""
    parts = []
    for layer in _keras_internals.all_layers(model):
        for name, value in vars(layer).items():
            if isinstance(value, _PLAIN):
                parts.append((id(layer), name, value))
            elif isinstance(value, (list, tuple, dict)) and not name.startswith("_"):
                parts.append((id(layer), name, len(value)))
    return hash(tuple(parts))


def _is_user_method(value, runtime):
    if not isinstance(value, types.MethodType):
        return False
    if value.__self__ is not runtime.subject and value.__self__ is not runtime.owner:
        return False
    module = getattr(value.__func__, "__module__", "") or ""
    return module.split(".")[0] not in LIBRARY_PACKAGES


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


def _first_x(model, data):
    """`x` of one replica's share of a (possibly distributed) batch."""
    strategy = model.distribute_strategy
    local = tf.nest.map_structure(
        lambda v: strategy.experimental_local_results(v)[0], data
    )
    return keras.utils.unpack_x_y_sample_weight(local)[0]


def _layer_sequence(converted):
    graph = converted.kip_graph
    return None if graph is None else [id(layer) for layer in graph.layers()]


def _is_opaque(converted):
    graph = getattr(converted, "kip_graph", None)
    return graph is not None and any(isinstance(n.operation, OpaqueLayer) for n in graph.nodes)


def install(model, runtime):
    """Give `model` plugin train / test functions (what the callback and
    `kip.scope` do), keeping ones already given for the same runtime so a
    second `fit` does not trace the step again."""
    for attribute, step in (("train_function", "train_step"), ("test_function", "test_step")):
        current = getattr(model, attribute, None)
        if not (isinstance(current, StepFunction) and current.runtime is runtime):
            setattr(model, attribute, StepFunction(runtime, getattr(type(model), step)))
