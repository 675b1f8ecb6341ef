"""`TrainingSession`: what a model's train / test / predict functions run on,
routing a compiled model's `fit` / `evaluate` through converted graphs. One
concept over ~600 lines: the session's state and its rebuilds belong
together.

One `TrainingSession` per model holds what every entry point shares: the
conversions made so far (one per kind of call a step makes, see
`calls.py`), the `VariableWatch`, the step's `self` (`step_self.py`).
`StepFunction` (`step_functions.py`) is the `train_function` /
`test_function` that `fit` / `evaluate` call (Keras honours one set before
the first step); this module is what it runs on.

What is converted is what the step calls, with the arguments it passes:
`self(x)` for Keras's own steps, but also `self([source, target[:, :-1]])`
built from a dict batch, a GAN's `self.generator(z)`, `self(x, mask=m)`.
A call is converted at its first occurrence, from concrete arguments:

- eagerly (`run_eagerly=True`, or `plugin(x)`), right where it is made;
- in a compiled step, calls are seen while the step is traced, on
  symbolic tensors. So before the first compiled step of a step of the
  model's own, the step runs once as a *dry run* on the first batch: a
  `tf.function` running the original models that returns the arguments of
  every call made (optimizers apply nothing, though they and the metrics
  are built there; every variable it changed is put back, every metric it
  built reset). Each call is converted from those concrete arguments.
- a call met later in a trace with no conversion (a new image size, a
  padded batch of another length) stops the trace at once, before anything
  runs (`NeedsConversion`); the step function takes the batch the step
  would have read, converts that call from it (a dry run shows its
  arguments) with the shapes the trace saw (a dimension unknown there stays
  unknown), and trains on that same batch.

No batch is skipped or read twice. Keras's own `train_step` / `test_step`
(with Keras's `compute_loss` / `compute_metrics`) call `self(x)` with fit's
`x`: those are converted from the batch directly, without a dry run.

New variables: a step that creates variables, an optimizer that meets
variables it does not know, or a model whose layer sequence changed at an
epoch boundary leads to a rebuild of the converted graphs and of the step
function; the optimizer gains state for the new variables only.
"""

import contextlib
import threading

import keras
import tensorflow as tf

from keras_ipu_plugin import _compat
from keras_ipu_plugin.passes.infra.manager import apply_passes
from keras_ipu_plugin.runtime.backends import get_backend
from keras_ipu_plugin.training.session.calls import CallArguments
from keras_ipu_plugin.training.session.calls import CallConversion
from keras_ipu_plugin.training.session.calls import convert_call
from keras_ipu_plugin.frontend.convert import one_conversion_at_a_time
from keras_ipu_plugin.frontend.convert import assigned_outside
from keras_ipu_plugin.runtime.variables import check_built_under
from keras_ipu_plugin.training.session.new_variables import VariableWatch
from keras_ipu_plugin.training.session.new_variables import describe_new_variables
from keras_ipu_plugin.runtime.variables import union_of_variables
from keras_ipu_plugin.errors import ConversionError
from keras_ipu_plugin.errors import InputDataError
from keras_ipu_plugin.layers.opaque import OpaqueLayer
from keras_ipu_plugin.frontend.state import guarded
from keras_ipu_plugin.frontend.state import VariableValues
from keras_ipu_plugin.training.session.step_self import CalleeStandIn
from keras_ipu_plugin.training.session.step_self import step_self
from keras_ipu_plugin.training.session.step_self import StepLosses
from keras_ipu_plugin.frontend.trace.tracer import TraceError
from keras_ipu_plugin.frontend.trace.tracer import current_tracer
from keras_ipu_plugin.frontend.trace.tracer import trace_model
from keras_ipu_plugin.frontend.verify.runs import verifying_on
from keras_ipu_plugin.training.session.new_variables import hand_over_optimizer_state
from keras_ipu_plugin.training.session.new_variables import replaced_variable_pairs
from keras_ipu_plugin.passes.replace import copy_weights_by_name
from keras_ipu_plugin.passes.infra.base import serialize_pass
from keras_ipu_plugin.errors import PassError


class NeedsConversion(Exception):
    """Raised at the end of a step's trace: these calls have no conversion."""

    def __init__(self, misses):
        self.misses = misses
        super().__init__(", ".join(f"{callee.name}({sig.describe()})" for callee, sig in misses))


class TrainingSession:
    """Conversion state shared by the train and test functions of a model.

    `subject` is the model converted (the user's model); `owner` is the
    model whose `fit` runs (the user's model, or the PluginModel wrapping
    it). `owner_names` are the attributes a step reads from the owner
    rather than the subject (what Keras's `compile` set on a wrapper).
    """

    def __init__(self, subject, owner, passes, verify=True, rebuild_on_new_variables=True,
                 static_batch=False, tracer=None):
        self.subject = subject
        # Every conversion and rebuild of the subject traces with this
        # `Tracer`, the one in use where the runtime is made by default:
        # never the one in use where a later `fit` happens to run.
        self.tracer = current_tracer() if tracer is None else tracer
        self.owner = owner
        self.passes = passes
        self.verify = verify
        self.rebuild_on_new_variables = rebuild_on_new_variables
        self.static_batch = static_batch
        self.watch = VariableWatch()
        self.conversions = []  # CallConversion, oldest first
        self.owner_names = frozenset()
        self.rebuilds = 0
        # fit's `verbose` (set by PluginModel.fit and PluginCallback): a
        # conversion made while it is on prints one line per step it timed.
        self.verbose = 0
        # What `compile` was given for jit_compile ("auto", True or False)
        # where the plugin saw it (PluginModel.compile); None: not seen (the
        # callback and kip.scope meet a model compiled already).
        self.jit_compile_asked = None
        self.traces = 0  # Python runs of a step: traces, in graph mode
        self._known = set()
        self._fingerprint = None
        self._local = threading.local()  # per replica thread: misses, recording
        self._stand_ins = {}
        # the conversions each thread ran, for the losses their graphs added
        self.step_losses = StepLosses()
        self._builds_after_the_dry_run = {}  # id(optimizer) -> (optimizer, variables)

    #: What an entry point asks for when it is given nothing: a second entry
    #: point given these defers to the session that already trains the model.
    DEFAULTS = {"verify": True, "rebuild_on_new_variables": True, "static_batch": False}

    def check_serves(self, entry_point, serving, passes=(), **settings):
        """Raise unless this session (`serving`: who made it, "PluginModel
        `p`") already gives what `entry_point` asks for, so that the model
        converts once and trains as it does alone.

        An entry point given passes, or a setting other than its default,
        that differ from this session's would be silently ignored: that is
        an error naming both, not a guess.

        Example:
            ```python
            plugin._kip_session.check_serves("PluginCallback", "PluginModel `p`")
            ```
        """
        asked = []
        if passes and not _same_passes(passes, self.passes):
            asked.append(
                f"passes {_describe_passes(passes)} (it has {_describe_passes(self.passes)})")
        for name, value in settings.items():
            if value != self.DEFAULTS[name] and value != getattr(self, name):
                asked.append(f"{name}={value!r} (it has {getattr(self, name)!r})")
        if asked:
            raise ValueError(
                f"{entry_point} was given {', '.join(asked)}, but model "
                f"`{self.owner.name}` already trains through {serving}, which "
                "converts it once and runs its own passes and settings. Give "
                f"them to {serving.split(' ')[0]} instead, or leave them out of "
                f"{entry_point}."
            )

    @property
    def strategy(self):
        return self.owner.distribute_strategy

    @property
    def converted(self):
        """The subject's latest conversion (its functional model), or None."""
        for conversion in reversed(self.conversions):
            if conversion.callee is self.subject:
                return conversion.model
        return None

    @property
    def report(self):
        """The subject's latest conversion report; for a model whose steps
        call only sub-models (a GAN), theirs, one after the other."""
        converted = self.converted
        if converted is not None or not self.conversions:
            return None if converted is None else converted.kip_report
        report = self.conversions[0].model.kip_report.copy()
        for conversion in self.conversions[1:]:
            report.extend(conversion.model.kip_report)
        return report

    # -- the step's view of the model -----------------------------------------
    def step_self(self):
        return step_self(self)

    def model_attribute(self, name):
        """An attribute as the step's `self` sees it (see `step_self`)."""
        if name in self.owner_names:
            return getattr(self.owner, name)
        try:
            return getattr(self.subject, name)
        except AttributeError:
            if self.owner is self.subject:
                raise
            return getattr(self.owner, name)

    def callee_stand_in(self, model):
        if id(model) not in self._stand_ins:
            self._stand_ins[id(model)] = CalleeStandIn(self, model)
        return self._stand_ins[id(model)]

    # -- conversions --------------------------------------------------------
    def convert(self, x):
        """The subject's conversion for `subject(x)` (made now if none serves)."""
        call = CallArguments(x)
        if self.find(self.subject, call) is None:
            self.add_conversion(self.subject, call)
        return self.converted

    def find(self, callee, call):
        signature = call.signature()
        for conversion in reversed(self.conversions):
            if conversion.callee is callee and conversion.signature.accepts(signature):
                return conversion
        return None

    def add_conversion(self, callee, call, signature=None, report_entries=(), reuse=None):
        """Convert `callee` for calls like `call` (concrete), under the
        strategy that owns the model, and apply the passes.

        The layers Replace made in earlier conversions (`reuse`, default
        those of the conversions kept) are used again, trained as they are.
        """
        check_built_under(self.subject, _compat.model_strategy(self.owner))
        signature = signature or call.signature()
        reuse = self.replaced_layers() if reuse is None else reuse
        # Verified on `call`'s batch: after the first conversion, a later one.
        batch_words = "this batch" if self.conversions else "the first batch"
        # A conversion keeps one Keras node per call on the model's layers
        # (its functional model's); one given up on (its passes fail, or
        # Ctrl-C before it is kept in `conversions`) must not: every fit
        # tried again would add more. A plain `try`, so that nothing runs
        # between keeping the conversion and leaving it.
        with one_conversion_at_a_time():
            nodes = _compat.node_lists_snapshot(_compat.all_layers(callee))
            try:
                with self.strategy.scope(), self.watch.watching(), verifying_on(batch_words):
                    # The IPU backend needs static shapes (static_batch=True there).
                    graph_model = convert_call(
                        callee, call, verify=self.verify, signature=signature,
                        static_batch=self.static_batch or get_backend().static_batch,
                        tracer=self.tracer)
                    if self.passes:
                        with _replaced_layers_in_sync(reuse):
                            model = apply_passes(graph_model, self.passes, verify=self.verify,
                                                 reuse_replacements=reuse, tracer=self.tracer)
                    else:
                        model = graph_model
                self.watch.take()
                for entry in report_entries:
                    model.kip_report.add(*entry)
                if model.kip_replaced:
                    self._hand_over_optimizer_state(model)
                conversion = CallConversion(callee, signature, model, call, graph_model)
                conversion.layer_sequence = _layer_sequence(graph_model)
                known = {id(v) for v in self.subject.variables}
                fingerprint = _attribute_fingerprint(self.subject)
                # Last, together: the conversion is kept, with its nodes.
                self._known, self._fingerprint = known, fingerprint
                self.conversions.append(conversion)
            except BaseException:
                nodes.restore()
                raise
        if self.verbose:
            for line in model.kip_report.progress_lines():
                _compat.print_msg(line)
        return conversion

    def rebuild(self, reason):
        """Convert every call again (the model's variables or layers changed).

        The layers Replace made are kept, with their trained weights and
        their optimizer state: only layers new to the model get new
        replacements.
        """
        new = [v for v in self.subject.variables if id(v) not in self._known]
        entries = [("rebuild", self.subject.name, reason,
                    ", ".join(v.path for v in new) or "no new variables")]
        self.rebuilds += 1
        previous, self.conversions = self.conversions, []
        reuse = self.replaced_layers(previous)
        try:
            # Conversions made before one that fails are dropped with it:
            # their nodes go too (see add_conversion).
            with _compat.node_lists_snapshot(_compat.all_layers(self.subject)):
                for conversion in previous:
                    self.add_conversion(conversion.callee, conversion.example,
                                        conversion.signature, report_entries=entries,
                                        reuse=reuse)
        except InputDataError as error:
            # These arguments were accepted when first converted; if `call`
            # fails on them now, the fault is the user's code, mid-training:
            # raise its own error, not one blaming the data.
            if error.__cause__ is None:
                raise
            raise error.__cause__
        except BaseException:
            self.conversions = previous
            raise

    def replaced_layers(self, conversions=None):
        """`(old layer, new layer)` pairs Replace made in `conversions` (by
        default the conversions kept), each pair once, oldest first."""
        pairs, seen = [], set()
        for conversion in self.conversions if conversions is None else conversions:
            for old, new in conversion.model.kip_replaced:
                if (id(old), id(new)) not in seen:
                    seen.add((id(old), id(new)))
                    pairs.append((old, new))
        return pairs

    def in_use(self, variables, name):
        """`variables` (a model's `name`: "variables", "trainable_weights",
        ...) as the converted graphs use them, followed by the conversions'
        own `name` not among them: a variable of a replaced layer stands
        replaced by its replacement's of the same weight name, or is left
        out (the replaced layers no longer run, so never train). The
        optimizer Keras builds over these then holds the replacement's
        state where the wrapped model's layout has the replaced layer's,
        which is where a saved model's optimizer state loads it back."""
        pairs = self.replaced_layers()
        unused = {id(v) for old, _ in pairs for v in getattr(old, name)}
        stand_ins = {id(old): new for old, new in replaced_variable_pairs(pairs)}
        mine = [stand_ins.get(id(v), v) for v in variables
                if id(v) not in unused or id(v) in stand_ins]
        theirs = [v for conversion in self.conversions for v in getattr(conversion.model, name)]
        return union_of_variables(mine, theirs)

    def _hand_over_optimizer_state(self, model):
        """The optimizers already built over the layers `model`'s Replace
        passes replaced (a model loaded with its optimizer state; `fit`
        building before a callback converts) hand their state over to the
        replacements; see `dynamic.hand_over_optimizer_state`."""
        for optimizer in self._optimizers():
            handed = hand_over_optimizer_state(optimizer, model.kip_replaced)
            if handed:
                model.kip_report.add(
                    "replace", optimizer.name, "optimizer state handed over",
                    ", ".join(f"{old.path} -> {new.path}" for old, new in handed))

    def _optimizers(self):
        """The optimizers a step may apply: the owner's, and any kept as an
        attribute of the owner or the model (a GAN's `d_optimizer`)."""
        found = []
        for model in (self.owner, self.subject):
            for value in list(vars(model).values()):
                if (isinstance(value, keras.optimizers.Optimizer)
                        and all(value is not other for other in found)):
                    found.append(value)
        return found

    def structure_changed(self):
        """Whether the model must be converted again because a Python
        attribute may have switched a branch of `call`: it now reaches other
        layers than at the last conversion, or assigns a variable itself, or
        runs opaque (its traced step holds the old branch). Checked at epoch
        boundaries: the model is traced again only when the plain Python
        attributes of its layers (flags, counts, names) changed since the
        last look."""
        if not self.conversions:
            return False
        fingerprint = _attribute_fingerprint(self.subject)
        if fingerprint == self._fingerprint:
            return False
        for conversion in self.conversions:
            if _is_opaque(conversion.graph_model):
                # An opaque node runs `call` as traced into the step
                # function, with the attribute values of that trace: the
                # branch a flag now switches on would never run in graph
                # mode. Rebuild and retrace.
                return True
            if not conversion.simple:
                continue
            specs = keras.tree.map_structure(
                _spec_of_input, conversion.graph_model.input)
            traced = self._trace_again(conversion.callee, specs)
            if traced is None:
                return True
            graph, assigns = traced
            if assigns or [id(layer) for layer in graph.layers()] != conversion.layer_sequence:
                return True  # the fingerprint is taken again by the rebuild
        self._fingerprint = fingerprint
        return False

    def _trace_again(self, callee, specs):
        """`(graph, assigns)` of a new trace of `callee` (assigns: a branch
        now assigns a variable itself, which makes the conversion opaque, see
        convert.py), or None when it no longer traces. The trace runs
        `call`'s Python: what it changes on the model (a counter assigned in
        `call`) does not stay behind."""
        with one_conversion_at_a_time(), self.strategy.scope(), self.watch.watching():
            def trace(state):
                before = VariableValues(self.subject.non_trainable_variables)
                graph = trace_model(callee, specs, tracer=self.tracer)
                return graph, bool(assigned_outside(graph, before))

            try:
                return guarded(self.subject, trace)
            except TraceError:
                return None  # the model put back by `guarded`

    def new_variables(self):
        """Model variables created since the last conversion. Walks the
        model's variables: called only after a trace, or after an eager step
        in which the watch saw a variable being created."""
        self.watch.take()
        return [v for v in self.subject.trainable_variables if id(v) not in self._known]

    # -- calls made by a step -------------------------------------------------
    def call(self, callee, args, kwargs):
        """`callee(*args, **kwargs)` as a step (or the wrapper) makes it: the
        converted graph for that call, converting it first where it can."""
        call = CallArguments.of(callee, args, kwargs)
        recorded = getattr(self._local, "recorded", None)
        if recorded is not None:  # a dry run: note the call, run the original
            recorded.append((callee, call))
            return callee(*args, **kwargs)
        conversion = self.find(callee, call)
        if conversion is not None:
            return self.step_losses.record(callee, conversion.model, conversion(call))
        if call.is_symbolic() or _compat.in_shape_inference():
            # Keras working out shapes (a symbolic build, on KerasTensors or
            # in its scratch graph): the original gives the same ones.
            return callee(*args, **kwargs)
        if tf.executing_eagerly() and call.is_concrete():
            if _in_a_replica_of_many():
                # Replicas run in threads here: convert outside them.
                raise NeedsConversion([(callee, call.signature())])
            conversion = self.add_conversion(callee, call)
            return self.step_losses.record(callee, conversion.model, conversion(call))
        if getattr(self._local, "in_step", False):
            # Stop the trace right here: anything created further on (an
            # optimizer's slots) would be left half-made by the aborted trace.
            raise NeedsConversion([(callee, call.signature())])
        raise ConversionError(
            f"`{callee.name}` is called on {call.signature().describe()} inside a "
            "tf.function that the plugin does not run, and has no conversion for "
            "arguments like these. Call it once eagerly on such a batch first "
            "(e.g. `plugin(x)`), or train / evaluate through fit / evaluate."
        )

    @contextlib.contextmanager
    def tracing_step(self):
        self._local.in_step = True
        try:
            yield
        finally:
            self._local.in_step = False

    def dry_running(self):
        return getattr(self._local, "recorded", None) is not None

    def build_after_the_dry_run(self, optimizer, variables):
        """Note that the dry run's step applied `optimizer`, not built yet,
        to `variables`: `record_calls` builds it on them after the run.

        Built inside the run, its variables would be made while TensorFlow
        traces the run, and TensorFlow then traces the run a second time
        (a custom step's dry run cost two traces of the step, not one).
        The first list an optimizer is applied to is the one it is built
        on, as when it builds at its first `apply`.
        """
        self._builds_after_the_dry_run.setdefault(id(optimizer), (optimizer, variables))

    def record_calls(self, step, data):
        """Run `step` once on `data` as a dry run; return the concrete
        `(callee, CallArguments)` of every call it made (one replica's).

        Optimizers apply nothing (they are built, if they were not); every
        variable the run may change (metric totals, RNG seeds, counters) is
        put back afterwards, and metrics built in it are reset.
        """
        strategy = self.strategy
        proxy = self.step_self()
        structures = []
        lock = threading.Lock()

        def replica(batch):
            self._local.recorded = []
            try:
                step(proxy, batch)
                recorded = self._local.recorded
            finally:
                self._local.recorded = None
            with lock:
                if not structures:
                    structures.append(recorded)
            return [t for _, call in recorded for t in call.tensors().values()]

        # As Keras runs steps: traced without AutoGraph (Keras marks its
        # step functions `do_not_convert`), so Python in the step means what
        # it means in `fit`.
        function = tf.function(
            lambda batch: strategy.run(replica, args=(batch,)), autograph=False)
        snapshot = VariableValues(self._state_variables())
        self._builds_after_the_dry_run.clear()
        try:
            with strategy.scope():
                flat = function(data)
                for optimizer, variables in self._builds_after_the_dry_run.values():
                    if not optimizer.built:
                        optimizer.build(variables)
        finally:
            self._builds_after_the_dry_run.clear()
            snapshot.restore()
            # Metrics not seen before the run (built in it: Keras's compiled
            # metrics before their first step) still hold its update.
            for metric in self._metrics():
                if any(id(v) not in snapshot.ids for v in metric.variables):
                    metric.reset_state()
        local = [
            strategy.experimental_local_results(t)[0]
            if isinstance(t, tf.distribute.DistributedValues) else t
            for t in flat
        ]
        supply = iter(local)
        found = []
        for callee, call in structures[0] if structures else []:
            tensors = {name: next(supply) for name in call.tensors()}
            found.append((callee, _with_tensors(call, tensors)))
        return found

    def _metrics(self):
        metrics = []
        for model in (self.owner, self.subject):
            metrics += [m for m in model.metrics if all(m is not n for n in metrics)]
        return metrics

    def _state_variables(self):
        variables = list(self.subject.variables) + list(self.owner.variables)
        for model in {id(self.subject): self.subject, id(self.owner): self.owner}.values():
            variables += list(model.metrics_variables)
        variables += _compat.global_seed_variables()
        return union_of_variables(variables, [])


def _same_passes(mine, theirs):
    """The same passes, in the same order: the same objects, or passes of
    the same class saving the same config."""
    if len(mine) != len(theirs):
        return False
    for a, b in zip(mine, theirs):
        if a is b:
            continue
        try:
            if serialize_pass(a) != serialize_pass(b):
                return False
        except PassError:  # an unregistered pass: the same object only
            return False
    return True


def _describe_passes(passes):
    return "[" + ", ".join(type(p).__name__ for p in passes) + "]"


@contextlib.contextmanager
def _replaced_layers_in_sync(replaced_layers):
    """Within: each replaced layer holds the weights of the layer that
    replaces it (by weight name, as PluginModel copies them before saving);
    after: its own again.

    A conversion that reuses trained replacement layers is verified against
    the model's own layers, which stopped training when they were replaced:
    compared as they are, a Replace with copied weights would "differ" by
    everything learnt since. A pair whose weights do not match by name and
    shape (a replacement with other parameters) is left as it is: what its
    pass claims is checked on it unchanged.
    """
    pairs = [(old, new) for old, new in replaced_layers if _same_weights_by_name(old, new)]
    saved = VariableValues([v for old, _ in pairs for v in old.weights])
    try:
        for old, new in pairs:
            copy_weights_by_name(new, old)
        yield
    finally:
        saved.restore()


def _same_weights_by_name(old, new):
    mine = {v.name: (tuple(v.shape), v.dtype) for v in old.weights}
    theirs = {v.name: (tuple(v.shape), v.dtype) for v in new.weights}
    return len(mine) == len(old.weights) and mine == theirs


def _with_tensors(call, tensors):
    """`call` with its tensors replaced by `tensors` (a dict by name)."""
    from keras_ipu_plugin.training.session.calls import BoundCall

    return BoundCall.fill(call, tensors)


def _in_a_replica_of_many():
    strategy = tf.distribute.get_strategy()
    return strategy.num_replicas_in_sync > 1 and not tf.distribute.in_cross_replica_context()


_PLAIN = (bool, int, float, str, type(None))


def _attribute_fingerprint(model):
    """The plain Python attributes of every layer of `model` (and the
    lengths of its containers): what a Python branch in `call` can read."""
    parts = []
    for layer in _compat.all_layers(model):
        for name, value in vars(layer).items():
            if isinstance(value, _PLAIN):
                parts.append((id(layer), name, value))
            elif isinstance(value, (list, tuple, dict)) and not name.startswith("_"):
                parts.append((id(layer), name, len(value)))
    return hash(tuple(parts))


def describe_structure_change(session):
    new = session.new_variables()
    if new:
        return describe_new_variables(new, session.subject)
    return (
        f"The layers that `call` of model `{session.subject.name}` reaches "
        "changed since it was converted (a Python attribute switched a "
        "branch). Pass rebuild_on_new_variables=True (the default) to "
        "kip.PluginModel / kip.PluginCallback to rebuild the graph."
    )


def _spec_of_input(tensor):
    from keras_ipu_plugin.ir.graph import InputSpec

    return InputSpec(name=tensor.name, shape=tuple(tensor.shape[1:]), dtype=tensor.dtype)


def _layer_sequence(converted):
    graph = converted.kip_graph
    return None if graph is None else [id(layer) for layer in graph.layers()]


def _is_opaque(converted):
    graph = getattr(converted, "kip_graph", None)
    return graph is not None and any(isinstance(n.operation, OpaqueLayer) for n in graph.nodes)


__all__ = ["NeedsConversion", "TrainingSession", "describe_structure_change"]
