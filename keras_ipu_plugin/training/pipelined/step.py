"""The pipelined training step: microbatches through stages on devices.
One concept over ~600 lines: one train step, its schedule and its gradient
sums read best in one place (the microbatch split is `microbatches.py`).

With `PipelineStages(microbatches=M, devices=..., schedule=...)` among a
session's passes, the train function of PluginModel, PluginCallback and
kip.scope runs this step instead of Keras's `train_step`:

1. the batch (x, y, sample weights; class weights are sample weights by
   then) of B rows is split into M microbatches of consecutive rows, as
   equal as possible (the first B % M one row longer: a partial last batch
   trains; a batch of fewer than M rows leaves microbatches empty, which
   change nothing, or is an error naming both where its size is known as
   the step is traced: `microbatches.batch_rows`);
2. for each microbatch, each stage s runs its forward pass under its own
   `tf.GradientTape` inside `tf.device(devices[s])`; the loss of the
   microbatch (Keras's `compute_loss`, weight regularization included) is
   taken on the last stage's device, weighted by the microbatch's share of
   the batch's rows (the loss is a mean over the batch);
3. the backward pass of each stage is its own `tape.gradient(stage outputs,
   [stage inputs] + weights, output_gradients=...)`, on the stage's device:
   a stage's forward and backward ops sit on its device and only the tensors
   crossing a stage boundary (and their gradients) go between devices, but
   for the stage's weights, read once a step onto its device (the
   variables stay where Keras made them, where the optimizer updates them);
4. the gradients of all microbatches are summed and the optimizer applies
   them once; the metrics are the whole batch's.

Schedules: `"gpipe"`, every forward of a stage before its backwards (each
stage's backward waits on its last forward); `"1f1b"`, one forward, one
backward: a stage's forward of microbatch m waits on its backward of
microbatch m - (S - s), so at most S - s microbatches' activations are
alive on stage s. In graph mode TensorFlow's executor runs independent ops
on different devices at once, which is where stages overlap. Under XLA
(`jit_compile=True`) the step compiles to one cluster on one device: the
results are the same, the placement and overlap are not (a warning says
so). Keras's `jit_compile="auto"` would pick XLA wherever there is a GPU:
for stages on several devices the step runs in graph mode instead
(`PipelinedStep.jit_compile`).

Equal to the unpipelined step (up to float rounding) for losses that are
means over the batch (Keras's default reduction), with sample and class
weights, weight regularizers and Keras's activity regularizers. Not equal:
layers whose result depends on the whole batch (BatchNormalization: batch
statistics over a microbatch, moving statistics updated M times), and
random draws (each microbatch draws its own Dropout mask). Refused with a
clear error: a custom `train_step` / `compute_loss` / `compute_metrics`, a
strategy with several replicas, a loss reduction that is not a mean over the
batch, an output carrying a Keras mask, a layer that adds a loss of its own
(`add_loss`) or writes a trainable weight in its forward pass.

Example:
    ```python
    model = kip.PluginModel(MyModel(), passes=[kip.passes.PipelineStages(
        num_stages=2, microbatches=4, devices=["/GPU:0", "/GPU:1"])])
    model.compile("adam", "mse"); model.fit(x, y, batch_size=32)
    ```
"""

import contextlib
import warnings

import keras
import tensorflow as tf

from keras_ipu_plugin import _compat
from keras_ipu_plugin.layers.user_code import takes_training
from keras_ipu_plugin.passes.annotate import PipelineStages
from keras_ipu_plugin.passes.microbatching import pipelines
from keras_ipu_plugin.runtime.backends import get_backend
from keras_ipu_plugin.runtime.pipeline import StagedModel
from keras_ipu_plugin.runtime.pipeline import stage_devices
from keras_ipu_plugin.runtime.variables import union_of_variables
from keras_ipu_plugin.training.session.calls import CallArguments
from keras_ipu_plugin.training.session.session import NeedsConversion
from keras_ipu_plugin.training.pipelined import microbatches

#: Loss reductions that are means over the batch's entries: the whole
#: batch's loss is the sum of the microbatches' losses, each weighed by its
#: share of the batch's rows.
MEAN_REDUCTIONS = ("sum_over_batch_size", "mean")
#: Activity regularizers that add over a layer's output entries; Keras
#: divides their value by the batch size, so they are means over the batch.
ADDITIVE_REGULARIZERS = (keras.regularizers.L1, keras.regularizers.L2, keras.regularizers.L1L2)


def pipeline_settings(passes):
    """`(microbatches, devices or None, schedule)` of the one
    `PipelineStages` pass in `passes` that asks for pipelined training, or
    None when none does."""
    found = [p for p in passes or () if isinstance(p, PipelineStages)
             and pipelines(p.pipeline_settings)]
    if len(found) > 1:
        raise ValueError("Two PipelineStages passes ask for pipelined training (microbatches "
                         "or devices); give those settings to one of them.")
    return found[0].pipeline_settings if found else None


def pipelined_train_step(session, step):
    """The step to run instead of `step` (a train function's `train_step`),
    or None when the session's passes ask for no pipeline or `step` is not
    a training step.

    Example:
        ```python
        step = pipelined_train_step(session, keras.Model.train_step)
        logs = step(session.step_self(), (x, y))
        ```
    """
    settings = pipeline_settings(session.passes)
    if settings is None or getattr(step, "__name__", None) != "train_step":
        return None
    _refuse_unsupported(session, step, settings[0])
    return PipelinedStep(session, settings)


def _refuse_unsupported(session, step, microbatches):
    name = session.subject.name
    owner = f"PipelineStages(microbatches={microbatches})"
    cls = type(session.subject)
    if step is not keras.Model.train_step:
        overridden = "train_step"
    elif cls.compute_loss is not keras.Model.compute_loss:
        overridden = "compute_loss"
    elif cls.compute_metrics is not keras.Model.compute_metrics:
        overridden = "compute_metrics"
    else:
        overridden = None
    if overridden:
        raise ValueError(
            f"{owner}: model `{name}` overrides `{overridden}`. The pipelined step runs "
            "each stage's forward and backward passes itself, in place of Keras's own "
            "train_step, so a custom one is not supported yet. Leave microbatches and "
            "devices out of PipelineStages to train it with its own step.")
    replicas = session.strategy.num_replicas_in_sync
    if replicas > 1:
        raise ValueError(
            f"{owner}: model `{name}` trains under a strategy with {replicas} replicas "
            f"({type(session.strategy).__name__}); pipelined training with several "
            "replicas is not supported yet. Train it under one replica, or leave "
            "microbatches and devices out of PipelineStages.")
    if get_backend().name != "portable":
        raise ValueError(
            f"{owner}: the pipelined step is the portable backend's; on the "
            f"{get_backend().name} backend the stages go to its own pipeline.")


class PipelinedStep:
    """`step(proxy, data) -> logs`: the pipelined train step (module doc)."""

    def __init__(self, session, settings):
        self.session = session
        self.microbatches, self.devices, self.schedule = settings
        self._staged = {}  # id(converted model) -> (model, StagedModel)
        self.training = True if takes_training(type(session.subject).call) else None

    def jit_compile(self, compiled, asked):
        """Whether the step compiles with XLA: `compiled` is the model's
        resolved `jit_compile`, `asked` what its compile was given ("auto",
        True, False; None where the plugin did not see it).

        XLA compiles the step into one cluster on one device, so stages on
        several devices would neither be placed nor overlap. As Keras turns
        `"auto"` off under a distribution strategy, the pipeline turns it
        off where its stages span devices (Keras's auto picks XLA wherever
        there is a GPU), and the report says so. XLA asked for explicitly
        is kept (the same results), with a warning that the stages will
        share one device. Unseen (PluginCallback, kip.scope), a True that
        `"auto"` would give too counts as auto.

        Example:
            ```python
            step.jit_compile(compiled=True, asked="auto")   # stages on 2 GPUs
            # -> False
            ```
        """
        if not compiled:
            return False
        model = self.session.converted
        if model is None:
            # Nothing converted yet: the trace stops to convert (NeedsConversion)
            # and the function is made again, deciding then, before any step runs.
            return True
        devices = self.stage_devices(model)
        if len({device for device in devices if device}) < 2:
            return True  # one device: XLA loses nothing
        explicit = asked is True or (
            asked is None and not _compat.auto_jit_compile(self.session.owner))
        where = ", ".join(dict.fromkeys(device for device in devices if device))
        if explicit:
            warnings.warn(
                f"PipelineStages(microbatches={self.microbatches}): model "
                f"`{self.session.subject.name}` is compiled with jit_compile=True. XLA "
                "compiles the train step into one cluster on one device, so its stages "
                f"will not run on {where} nor overlap (the results are the same). Compile "
                "with jit_compile=False to pipeline them.", stacklevel=2)
            model.kip_report.add_once(
                "PipelineStages", model.name, "train step under XLA",
                f"jit_compile=True: one cluster on one device, the stages not placed on {where}")
            return True
        model.kip_report.add_once(
            "PipelineStages", model.name, "train step in graph mode",
            f"jit_compile='auto' would compile it with XLA into one cluster on one device; "
            f"the stages run on {where}")
        return False

    def stage_devices(self, model):
        """The device of each stage of `model` (a converted model; None: the
        current device)."""
        return stage_devices(self.devices, model.kip_stage_devices,
                             self.staged(model).num_stages)

    def staged(self, model):
        kept = self._staged.get(id(model))
        if kept is None or kept[0] is not model:
            kept = (model, StagedModel(model, get_backend()))
            self._staged[id(model)] = kept
        return kept[1]

    def __call__(self, proxy, data):
        session = self.session
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        call = CallArguments(x, training=self.training)
        conversion = session.find(session.subject, call)
        if conversion is None:
            # As `TrainingSession.call` does: stop here, the step function converts.
            raise NeedsConversion([(session.subject, call.signature())])
        if not conversion.simple:
            raise ValueError(f"PipelineStages: model `{session.subject.name}` is called with "
                             "arguments other than its inputs; the pipelined step takes `x`.")
        _check_loss_reductions(proxy, self.microbatches)
        run = _Run(self, proxy, conversion.model, x, y, sample_weight)
        return run.step()


class _Run:
    """One traced (or eager) pipelined step."""

    def __init__(self, owner, proxy, model, x, y, sample_weight):
        self.owner, self.proxy, self.model = owner, proxy, model
        self.staged = owner.staged(model)
        self.count = owner.microbatches
        self.num_stages = self.staged.num_stages
        self.devices = owner.stage_devices(model)
        self.x, self.y, self.sample_weight = x, y, sample_weight
        self.rows = microbatches.batch_rows(x, self.count)
        self.sizes = microbatches.slice_sizes(self.rows, self.count)
        # Where a microbatch may be empty (the batch size known only when
        # the step runs, or smaller than the microbatches), each
        # microbatch's contributions are kept only if it has rows, so that
        # an empty one changes nothing.
        self.nonempty = (None if isinstance(self.rows, int)
                         else [tf.greater(size, 0) for size in self.sizes])
        self.xs = microbatches.split(x, self.sizes, "x")
        self.ys = microbatches.split(y, self.sizes, "y")
        self.ws = microbatches.split(sample_weight, self.sizes, "sample_weight")
        self.trainable = list(proxy.trainable_weights)
        self.state = union_of_variables(
            list(session_variables(owner.session)) + list(model.variables),
            _compat.global_seed_variables())
        self.values = [self.staged.input_tensors(xm) for xm in self.xs]
        self.forward = {}  # (stage position, m) -> (tape, watched ids, outputs, losses)
        self.weights = {}  # stage position -> [(trainable variable, its value on the stage's device)]
        self.produced_in, self.read_in = _crossings(self.staged)
        self.seeds = [dict() for _ in range(self.count)]  # tensor id -> gradient
        self.loss_seeds = {}  # (stage position, m) -> gradients of its added losses
        self.done = {}  # (kind, stage position, m) -> tensors to wait on
        self.grads = [[] for _ in self.trainable]
        self.losses = [None] * self.count
        self.y_preds = [None] * self.count

    def step(self):
        for kind, s, m in schedule_order(self.num_stages, self.count, self.owner.schedule):
            if kind == "F":
                self._forward(s, m)
                if s == self.num_stages - 1:
                    self._loss(m)
            else:
                self._backward(s, m)
        proxy = self.proxy
        total = tf.add_n(self.losses)
        first = next(leaf for leaf in tf.nest.flatten(self.x) if leaf is not None)
        _compat.loss_tracker(proxy).update_state(total, sample_weight=tf.shape(first)[0])
        if self.trainable:
            rows = {id(leaf) for xm in self.xs for leaf in tf.nest.flatten(xm)}
            gradients = [microbatches.summed(parts, rows) for parts in self.grads]
            proxy.optimizer.apply_gradients(zip(gradients, self.trainable))
        else:
            warnings.warn("The model does not have any trainable weights.")
        with _on(self.devices[-1]):
            y_pred = tf.nest.map_structure(lambda *parts: tf.concat(parts, axis=0),
                                           *self.y_preds)
        return proxy.compute_metrics(self.x, self.y, y_pred, sample_weight=self.sample_weight)

    # -- forward ---------------------------------------------------------------
    def _forward(self, s, m):
        stage = self.staged.stages[s]
        # A stage runs one microbatch at a time, as a device would: its
        # forward of m after its forward of m - 1 (else TensorFlow starts
        # several at once, holding their activations and taking the other
        # stage's threads).
        waits = list(self.done.get(("F", s, m - 1), []))
        if self.owner.schedule == "1f1b" and m >= self.num_stages - s:
            waits += self.done.get(("B", s, m - (self.num_stages - s)), [])
        tensors = {i: self.values[m][i] for i in stage.inputs}
        # The gradients a backward pass sends are those of the activations
        # from earlier stages; the model's inputs need none.
        watched = [i for i in stage.inputs
                   if i in self.produced_in and _differentiable(tensors[i])]
        weights = self._stage_weights(s)
        with _on(self.devices[s]), tf.name_scope(f"F{s}_{m}"), tf.control_dependencies(waits):
            with tf.GradientTape() as tape:
                for i in watched:
                    tape.watch(tensors[i])
                for _, value in weights:
                    tape.watch(value)
                with _compat.stateless_scope(weights, collect_losses=True) as scope:
                    self.staged.run_stage(stage, tensors, self.owner.training)
                losses = list(scope.losses)
            self._write_back(scope, f"stage {stage.index}", m, weights)
        self._check_added_losses(losses, stage)
        outputs = {i: tensors[i] for i in stage.outputs}
        arrived = []
        for i in stage.outputs:
            self.values[m][i] = self._hand_over(tensors[i], s, self.read_in[i], f"F{s}_{m}")
            if self.values[m][i] is not tensors[i]:
                arrived.append(self.values[m][i])
        self.forward[(s, m)] = (tape, watched, outputs, losses)
        self.done[("F", s, m)] = list(outputs.values()) + losses + arrived

    def _hand_over(self, tensor, s, reader, what):
        """`tensor` (computed on stage s's device) copied to the device of
        the stage that reads it first.

        The copy is an op of its own, and the stage's next pass waits on
        it (`done`): a stage hands its microbatch over before it starts the
        next. Left implicit, TensorFlow sends it when the producing device
        has nothing else to run: a device of one thread (a device's
        executor keeps running a chain of dependent ops inline) sent a
        stage's four forward outputs only after computing all four, so the
        next stage waited for all of them (profiled: docs/benchmarks.md, "Pipelined training")."""
        source, target = self.devices[s], self.devices[reader]
        if target is None or target == source or not isinstance(tensor, tf.Tensor):
            return tensor
        with _on(target), tf.name_scope(f"{what}_to_{reader}"):
            return tf.identity(tensor)

    def _stage_weights(self, s):
        """`(variable, value)` for the trainable weights of stage s's
        layers, each read once a step onto the stage's device: every
        microbatch's forward and backward pass runs on that value, so a
        weight crosses from the device holding it once a step, not once
        per microbatch. Its gradient is taken with respect to the value
        (and to the variable, which an op reading it directly would reach)."""
        if s not in self.weights:
            trainable = {id(v) for v in self.trainable}
            stage = self.staged.stages[s]
            owned = union_of_variables(
                [v for segment in stage.segments for node in segment.nodes
                 for v in getattr(node.operation, "trainable_variables", ())
                 if id(v) in trainable], [])
            # Read before any of the schedule's waits: the reads depend on
            # nothing but the variables.
            with _on(self.devices[s]), tf.name_scope(f"W{s}"), tf.control_dependencies(None):
                self.weights[s] = [(v, tf.identity(_compat.stored_value(v))) for v in owned]
        return self.weights[s]

    def _loss(self, m):
        """Microbatch m's loss on the last stage's device; its gradients
        with respect to the outputs and added losses seed the backward pass."""
        y_pred = self.staged.outputs(self.values[m])
        self.y_preds[m] = y_pred
        ids = list(dict.fromkeys(keras.tree.flatten(self.staged.graph.outputs)))  # Values
        for i in ids:
            if _compat.keras_mask(self.values[m][i]) is not None:
                raise ValueError(
                    f"PipelineStages(microbatches={self.count}): an output of "
                    f"`{self.model.name}` (of `{self.staged.tensor_names()[i]}`) carries a "
                    "Keras mask; a masked loss is a mean over the batch's unmasked entries, "
                    "which differ between microbatches, so the pipelined step would not "
                    "equal the whole batch's. Not supported yet.")
        outputs = [i for i in ids if _differentiable(self.values[m][i])]
        added = [loss for s in range(self.num_stages) for loss in self.forward[(s, m)][3]]
        with _on(self.devices[-1]), tf.name_scope(f"L_{m}"), \
                tf.variable_creator_scope(_off_the_stage_device):
            with tf.GradientTape() as tape:
                for i in outputs:
                    tape.watch(self.values[m][i])
                for loss in added:
                    tape.watch(loss)
                # A scope of its own, so that `compute_loss` reads none of the
                # losses the layers hold from other calls, only the weight
                # regularizers' (which read their weights from the scope).
                regularized = [(v, _compat.current_value(v)) for v in self.trainable
                               if getattr(v, "regularizer", None) is not None]
                with _compat.stateless_scope(regularized, collect_losses=True) as scope:
                    loss = self.proxy.compute_loss(
                        x=self.xs[m], y=self.ys[m], y_pred=y_pred,
                        sample_weight=self.ws[m], training=True)
                if added:
                    loss = loss + tf.add_n([tf.cast(a, loss.dtype) for a in added])
                share = loss * self._fraction(m, loss.dtype)
                if self.nonempty is not None:
                    share = tf.where(self.nonempty[m], share, tf.zeros_like(share))
                scaled = share
                if self.proxy.optimizer is not None:
                    scaled = self.proxy.optimizer.scale_loss(share)
            self._write_back(scope, "the loss", m, regularized, trackers=True)
            sources = [self.values[m][i] for i in outputs] + added + self.trainable
            gradients = tape.gradient(scaled, sources)
            self._accumulate(gradients[len(outputs) + len(added):], m)
        self.losses[m] = share
        for i, g in zip(outputs, gradients):
            self._seed(m, i, g)
        self._add_loss_seeds(m, gradients[len(outputs):len(outputs) + len(added)])

    # -- backward --------------------------------------------------------------
    def _backward(self, s, m):
        stage = self.staged.stages[s]
        tape, watched, outputs, losses = self.forward.pop((s, m))
        targets, seeds = [], []
        for i, tensor in outputs.items():
            if self.seeds[m].get(i) is not None:
                targets.append(tensor)
                seeds.append(self.seeds[m][i])
        for loss, g in zip(losses, self.loss_seeds.pop((s, m), [])):
            if g is not None:
                targets.append(loss)
                seeds.append(g)
        if not targets:
            self.done[("B", s, m)] = []
            return
        # One backward at a time per stage too (each holds its weight
        # gradients until they are summed), after the forward the schedule
        # puts before it.
        waits = list(self.done.get(("B", s, m - 1), []))
        if self.owner.schedule == "gpipe":  # all of this stage's forwards first
            waits += self.done[("F", s, self.count - 1)]
        else:
            waits += self.done[("F", s, min(m + self.num_stages - s - 1, self.count - 1))]
        tensors = self.values[m]
        weights = self.weights.get(s, [])
        with _on(self.devices[s]), tf.name_scope(f"B{s}_{m}"), tf.control_dependencies(waits):
            sources = ([tensors[i] for i in watched] + [value for _, value in weights]
                       + self.trainable)
            gradients = tape.gradient(targets, sources, output_gradients=seeds)
            arrived = []
            for i, g in zip(watched, gradients):
                moved = self._hand_over(g, s, self.produced_in[i], f"B{s}_{m}")
                if moved is not g:
                    arrived.append(moved)
                self._seed(m, i, moved)
            merged = microbatches.per_variable(
                self.trainable, weights, gradients[len(watched):len(watched) + len(weights)],
                gradients[len(watched) + len(weights):])
            sums = self._accumulate(merged, m)
            if m == self.count - 1 and arrived:
                self._hold_sums_until(arrived, merged)
        # The stage's next backward waits on the sums too: one microbatch's
        # weight gradients are added in before the next one's are made.
        self.done[("B", s, m)] = ([g for g in gradients if isinstance(g, tf.Tensor)] + arrived
                                  + sums)

    def _hold_sums_until(self, arrived, gradients):
        """After a stage's last backward: its weight-gradient sums (of the
        variables `gradients` has one for) wait until the input gradient it
        hands back has arrived (`arrived`, on the stage before's device).

        The sums go to the variables' device for the optimizer, which runs
        after every stage's backward anyway. Sent as they were made, their
        copies took the stage's one thread between the input-gradient
        matmuls and delayed the hand-over the stage before waits on: held,
        the MLP of benchmarks/pipeline_throughput.py stepped 5 to 7 % faster
        at M = 1 and 4 to 6 % faster under GPipe at M = 4."""
        with tf.control_dependencies(arrived), tf.name_scope("sums_after_hand_over"):
            for parts, gradient in zip(self.grads, gradients):
                if gradient is not None and parts and isinstance(parts[-1], tf.Tensor):
                    parts[-1] = tf.identity(parts[-1])

    def _seed(self, m, i, gradient):
        if gradient is None:
            return
        gradient = tf.convert_to_tensor(gradient)
        known = self.seeds[m].get(i)
        self.seeds[m][i] = gradient if known is None else known + gradient

    def _add_loss_seeds(self, m, gradients):
        gradients = list(gradients)
        for s in range(self.num_stages):
            count = len(self.forward[(s, m)][3])
            self.loss_seeds[(s, m)], gradients = gradients[:count], gradients[count:]

    def _accumulate(self, gradients, m):
        """Add a stage's (or the loss's) weight gradients of microbatch m to
        the sums, on its device. Dense ones are summed as they come, so one
        gradient per weight stays alive rather than one per microbatch;
        IndexedSlices are kept to be joined as the whole batch's would be
        (`microbatches.summed`). Returns the sums it made."""
        sums = []
        for parts, g in zip(self.grads, gradients):
            if g is None:
                continue
            g = self._if_rows(m, g)
            if isinstance(g, tf.IndexedSlices) or not parts or isinstance(
                    parts[-1], tf.IndexedSlices):
                parts.append(g)
            else:
                parts[-1] = parts[-1] + g
                sums.append(parts[-1])
        return sums

    def _fraction(self, m, dtype):
        """Microbatch m's share of the batch's rows, by which its loss (a
        mean over its rows) is weighed: the weighed losses add up to the
        mean over the batch, and a weight regularizer's term, the same in
        each microbatch's loss, to itself once."""
        if isinstance(self.rows, int):
            return tf.constant(self.sizes[m] / self.rows, dtype)
        return tf.cast(self.sizes[m], dtype) / tf.cast(self.rows, dtype)

    def _if_rows(self, m, value, otherwise=None):
        """`value` where microbatch m has rows, else `otherwise` (zeros):
        only a batch size unknown until the step runs, under XLA (which
        drops the assertion refusing a batch smaller than the microbatches),
        can leave a microbatch empty (`self.nonempty`)."""
        if self.nonempty is None:
            return value
        if isinstance(value, tf.IndexedSlices):
            return tf.IndexedSlices(self._if_rows(m, value.values), value.indices,
                                    value.dense_shape)
        value = tf.convert_to_tensor(value)
        otherwise = tf.zeros_like(value) if otherwise is None else otherwise
        return tf.where(self.nonempty[m], value, otherwise)

    # -- state -----------------------------------------------------------------
    def _write_back(self, scope, where, m, given=(), trackers=False):
        """Assign what a stage (or the loss) wrote for microbatch m inside
        its stateless scope: moving statistics, seed states, loss trackers.
        `given`: the `(variable, value)` pairs the scope was made with (no
        writes). An empty microbatch writes nothing (`_if_rows`).

        `trackers`: the writes are the compiled loss's per-output `Mean`
        trackers. Keras weighs each update by the batch's static row count,
        or by 1 where the shape is unknown (a partial last batch in a
        traced `fit`): so where the microbatches' sizes are unknown too,
        each microbatch's update (value and count) is weighed by its share
        of the batch's rows, and together they make the batch's one update."""
        given = {id(variable): value for variable, value in given}
        for variable in self.state:
            value = scope.get_current_value(variable)
            if value is None or value is given.get(id(variable)):
                continue
            if variable.trainable:
                raise ValueError(
                    f"PipelineStages(microbatches={self.count}): {where} of "
                    f"`{self.model.name}` writes the trainable variable `{variable.path}` in "
                    "its forward pass; the pipelined step does not support that yet.")
            if self.nonempty is not None:
                old = _compat.stored_value(variable)
                value = tf.convert_to_tensor(value, old.dtype)
                if trackers and old.dtype.is_floating:  # Keras's Mean: total, count
                    value = old + (value - old) * self._fraction(m, old.dtype)
                value = self._if_rows(m, value, old)
            variable.assign(value)

    def _check_added_losses(self, losses, stage):
        """Losses added in the forward pass are taken as means over the batch
        (what Keras's activity regularizers are); a layer's own `add_loss`
        may be anything: refused, naming it."""
        if not losses:
            return
        layers = _compat.all_layers(self.model)
        for loss in losses:
            owner = next((layer for layer in layers if _compat.added_loss(layer, loss)), None)
            regularizer = getattr(owner, "activity_regularizer", None)
            if owner is None or type(regularizer) not in ADDITIVE_REGULARIZERS:
                who = f"layer `{owner.name}`" if owner is not None else "a layer"
                raise ValueError(
                    f"PipelineStages(microbatches={self.count}): {who} of stage "
                    f"{stage.index} adds a loss in its forward pass (add_loss, or an activity "
                    "regularizer other than keras.regularizers L1 / L2 / L1L2). How it "
                    "aggregates over the batch is unknown, so the microbatches' losses "
                    "cannot be weighed to equal the whole batch's. Not supported yet.")


def session_variables(session):
    """Every variable a step may write: the model's, and the metrics' (the
    compiled loss's per-output trackers are written inside `compute_loss`)."""
    found = list(session.subject.variables)
    for model in (session.owner, session.subject):
        found += list(model.metrics_variables)
    return found


def schedule_order(num_stages, count, schedule):
    """The order in which the step builds (and eagerly runs) forward `F`
    and backward `B` passes `(kind, stage, microbatch)`: each stage's own
    sequence (GPipe: all forwards then all backwards; 1F1B: S - s - 1
    forwards, then one forward and one backward in turn), interleaved one
    action per stage per round as their inputs are ready.

    Example:
        ```python
        schedule_order(2, 2, "1f1b")
        # -> [('F', 0, 0), ('F', 1, 0), ('F', 0, 1), ('B', 1, 0), ('B', 0, 0), ('F', 1, 1), ...]
        ```
    """
    queues = []
    for s in range(num_stages):
        if schedule == "gpipe":
            queue = [("F", s, m) for m in range(count)] + [("B", s, m) for m in range(count)]
        else:
            warmup = min(num_stages - s - 1, count)
            queue = [("F", s, m) for m in range(warmup)]
            for k in range(count - warmup):
                queue += [("F", s, warmup + k), ("B", s, k)]
            queue += [("B", s, m) for m in range(count - warmup, count)]
        queues.append(queue)
    done, order = set(), []

    def ready(action):
        kind, s, m = action
        if kind == "F":
            return all(("F", t, m) in done for t in range(s))
        return ("F", num_stages - 1, m) in done and all(
            ("B", t, m) in done for t in range(s + 1, num_stages))

    while any(queues):
        progressed = False
        for queue in queues:
            if queue and ready(queue[0]):
                action = queue.pop(0)
                done.add(action)
                order.append(action)
                progressed = True
        if not progressed:  # a bug in the queues above, never the user's
            raise RuntimeError(f"pipeline schedule {schedule!r} deadlocked: {queues}")
    return order


def _crossings(staged):
    """`(produced_in, read_in)`: for each Value a stage sends on, the
    position of the stage producing it and that of the first later stage
    reading it (the last stage's for the model's outputs, which the loss
    reads there)."""
    produced_in, read_in = {}, {}
    for position, stage in enumerate(staged.stages):
        for i in stage.inputs:
            if i in produced_in and i not in read_in:
                read_in[i] = position
        for i in stage.outputs:
            produced_in[i] = position
    last = staged.num_stages - 1
    for i in produced_in:
        read_in.setdefault(i, last)
    return produced_in, read_in


def _check_loss_reductions(proxy, count):
    for loss in keras.tree.flatten(getattr(proxy, "loss", None)):
        reduction = getattr(loss, "reduction", "sum_over_batch_size")
        if isinstance(loss, keras.losses.Loss) and reduction not in MEAN_REDUCTIONS:
            raise ValueError(
                f"PipelineStages(microbatches={count}): loss `{loss.name}` has "
                f"reduction={reduction!r}; the pipelined step weighs each microbatch's "
                "loss by its share of the batch, which equals the whole batch's loss only "
                f"for means over the batch ({', '.join(map(repr, MEAN_REDUCTIONS))}).")


def _differentiable(tensor):
    return tf.is_tensor(tensor) and (tensor.dtype.is_floating or tensor.dtype.is_complex)


def _off_the_stage_device(next_creator, **kwargs):
    """A variable made inside a stage's device scope where Keras would make
    it: the compiled loss makes its per-output loss trackers in its first
    call, which the pipelined step makes on the last stage's device; pinned
    there, XLA (one cluster on one device) cannot reach them."""
    with tf.device(None):
        return next_creator(**kwargs)


def _on(device):
    return tf.device(device) if device else contextlib.nullcontext()


__all__ = ["PipelinedStep", "pipeline_settings", "pipelined_train_step", "schedule_order"]
