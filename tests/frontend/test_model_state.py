"""Converting leaves the user's model as it found it, on success and on
failure, and is safe across threads.

What a conversion may change is building the model (as Keras's own first
call would); see `keras_ipu_plugin.frontend.state.ModelState` for what exactly is
put back.
"""

import gc
import signal
import sys
import threading

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_ipu_plugin as kip

import models as zoo  # tests/models.py (tests/ is on sys.path under pytest)


def _counter(layer, name="count"):
    return layer.add_weight(shape=(), dtype="int32", initializer="zeros",
                            trainable=False, name=name)


class CountingModel(keras.Model):
    """Counts its calls in an int variable and in a Python attribute."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(3)
        self.count = _counter(self)
        self.calls = 0

    def call(self, inputs):
        self.count.assign_add(1)
        self.calls += 1
        return self.dense(inputs)


class PythonCountingModel(keras.Model):
    """Traceable: counts its calls in Python only, and runs a
    BatchNormalization pinned to training mode (its statistics move at
    every call, inference included)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(3)
        self.bn = keras.layers.BatchNormalization()
        self.calls = 0
        self.last = "none"

    def call(self, inputs):
        self.calls += 1
        self.last = "called"
        return self.bn(self.dense(inputs), training=True)


class BuildsItsCounter(keras.Model):
    """Creates its counter when built (the usual Keras pattern)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(3)
        self.calls = 0

    def build(self, input_shape):
        self.count = _counter(self)
        self.dense.build(input_shape)

    def call(self, inputs):
        self.count.assign_add(1)
        self.calls += 1
        return self.dense(inputs)


class CountingBlock(keras.layers.Layer):
    """A custom block whose `call` counts in its own variable."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(3)
        self.count = _counter(self)

    def call(self, inputs):
        self.count.assign_add(1)
        return self.dense(inputs)


class ModelWithCountingBlock(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.block = CountingBlock()
        self.head = keras.layers.Dense(2)

    def call(self, inputs):
        return self.head(self.block(inputs))


def _x(rows=4, features=5):
    return np.random.RandomState(0).normal(size=(rows, features)).astype("float32")


def _values(variables):
    return {v.path: np.array(v.numpy(), copy=True) for v in variables}


def _assert_values(variables, before):
    now = _values(variables)
    assert set(now) == set(before)
    for path, value in before.items():
        np.testing.assert_array_equal(now[path], value, err_msg=path)


# -- item 1: a successful conversion leaves the model's own state alone ---------
@pytest.mark.parametrize("verify", [True, False])
def test_successful_conversion_leaves_an_int_counter_and_python_attributes_unchanged(verify):
    model, x = CountingModel(), _x()
    model(x)
    model(x)
    count, calls = int(model.count.numpy()), model.calls
    kip.convert_to_functional(model, x, verify=verify)
    assert int(model.count.numpy()) == count
    assert model.calls == calls


def test_successful_conversion_leaves_batchnorm_statistics_and_python_attributes_unchanged():
    model, x = PythonCountingModel(), _x()
    model(x)
    before = _values(model.non_trainable_variables)
    assert not np.array_equal(before[model.bn.moving_mean.path], np.zeros(3))
    calls = model.calls
    model.last = "set by the user"
    converted = kip.convert_to_functional(model, x)
    assert converted.kip_report.opaque == {}
    _assert_values(model.non_trainable_variables, before)
    assert model.calls == calls
    assert model.last == "set by the user"


def test_plain_attributes_a_conversion_adds_are_removed():
    class SetsAnAttribute(keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(2)

        def call(self, inputs):
            self.seen_rows = int(inputs.shape[0] or -1)
            return self.dense(inputs)

    model, x = SetsAnAttribute(), _x()
    model.build((None, 5))  # built, never called: no `seen_rows` yet
    kip.convert_to_functional(model, x)
    assert "seen_rows" not in vars(model)
    assert model.built


def test_converting_an_unbuilt_model_is_one_building_call_and_new_counters_start_at_zero():
    model, x = BuildsItsCounter(), _x()
    converted = kip.convert_to_functional(model, x)
    assert model.built and model.dense.built
    # The counter exists (building created it) and holds its initial value:
    # the conversion's calls counted nothing.
    assert int(model.count.numpy()) == 0
    # Python attributes are as the building call (Keras's first call) left them.
    assert model.calls == 1
    before = int(model.count.numpy())
    converted(x)
    assert int(model.count.numpy()) == before + 1


def test_rebuild_after_new_variables_leaves_the_counter_at_the_steps_run():
    model, x = CountingModel(), _x(8)
    model(x)
    model.count.assign(0)
    plugin = kip.PluginModel(model)
    plugin.compile(optimizer="sgd", loss="mse")
    plugin.fit(x, np.zeros((8, 3), "float32"), batch_size=4, epochs=1, verbose=0)
    assert int(model.count.numpy()) == 2
    plugin._kip_session.rebuild("test: convert again")
    assert int(model.count.numpy()) == 2


# -- a call that assigns a variable itself is not dropped by the graph ------------
def test_call_that_assigns_a_variable_itself_keeps_the_write_as_a_node():
    """It once ran whole (opaque): the write is now a
    `VariableWrite` node of the graph (tests/layers/test_variable_write_nodes.py)."""
    from keras_ipu_plugin.layers.state import VariableWrite

    model, x = CountingModel(), _x()
    model(x)
    converted = kip.convert_to_functional(model, x)
    assert converted.kip_report.opaque == {}
    writes = [node.operation for node in converted.kip_graph.nodes
              if isinstance(node.operation, VariableWrite)]
    assert len(writes) == 1 and writes[0].variable is model.count
    before = int(model.count.numpy())
    for _ in range(3):
        converted(x)
    assert int(model.count.numpy()) == before + 3
    np.testing.assert_allclose(converted(x), model(x), atol=1e-6)


def test_custom_block_that_counts_stays_a_traced_node_and_keeps_counting():
    """A sub-layer that is a node of the graph runs its own `call`: its
    update is kept, so the model need not run opaque."""
    model, x = ModelWithCountingBlock(), _x()
    model(x)
    converted = kip.convert_to_functional(model, x)
    assert converted.kip_report.opaque == {}
    before = int(model.block.count.numpy())
    for _ in range(3):
        converted(x)
    assert int(model.block.count.numpy()) == before + 3


# -- item 2: random draws at inference ---------------------------------------------
class Sampling(keras.layers.Layer):
    """A VAE's reparameterisation: z = mean + exp(log_var / 2) * eps,
    drawn at inference too."""

    def __init__(self, source="seeded", **kwargs):
        super().__init__(**kwargs)
        self.source = source
        self.seed_generator = keras.random.SeedGenerator(1337)

    def call(self, inputs):
        z_mean, z_log_var = inputs
        shape = keras.ops.shape(z_mean)
        if self.source == "seeded":
            epsilon = keras.random.normal(shape, seed=self.seed_generator)
        elif self.source == "keras_global":
            epsilon = keras.random.normal(shape)
        elif self.source == "numpy":  # nothing TensorFlow could replay
            epsilon = np.random.normal(size=tuple(z_mean.shape)).astype("float32")
        else:
            epsilon = tf.random.normal(shape)
        return z_mean + keras.ops.exp(0.5 * z_log_var) * epsilon


class VAE(keras.Model):
    def __init__(self, source="seeded", **kwargs):
        super().__init__(**kwargs)
        self.encoder = keras.layers.Dense(8, activation="relu")
        self.z_mean = keras.layers.Dense(2)
        self.z_log_var = keras.layers.Dense(2)
        self.sampling = Sampling(source)
        self.decoder = keras.layers.Dense(5)

    def call(self, inputs):
        hidden = self.encoder(inputs)
        z = self.sampling([self.z_mean(hidden), self.z_log_var(hidden)])
        return self.decoder(z)


def test_vae_sampling_with_a_seed_generator_verifies_and_keeps_its_seed_state():
    model, x = VAE("seeded"), _x(8)
    model(x)
    state = model.sampling.seed_generator.state
    before = state.numpy().copy()
    converted = kip.convert_to_functional(model, x, verify=True)
    np.testing.assert_array_equal(state.numpy(), before)
    # Same draws from the same seed state: the converted model computes the original.
    reference = model(x).numpy()
    state.assign(before)
    np.testing.assert_allclose(converted(x), reference, rtol=1e-5, atol=1e-6)


def test_unseeded_keras_random_verifies_and_keeps_the_global_seed_generator_state():
    model, x = VAE("keras_global"), _x(8)
    model(x)  # creates Keras's global seed generator
    from keras_ipu_plugin._compat import global_seed_generator_state

    global_state = global_seed_generator_state()
    assert global_state is not None
    before = global_state.numpy().copy()
    kip.convert_to_functional(model, x, verify=True)
    np.testing.assert_array_equal(global_state.numpy(), before)


def test_unseeded_tensorflow_draws_are_replayed_and_the_drawing_layer_expands():
    """Verification hands the original's `tf.random` draws to
    the converted run, and the draw is a graph node (its shape
    `ops.shape(z_mean)`, the batch size None while traced, taken from the
    graph when it runs): the model converts, the drawing layer expands, and
    the model's state is as before."""
    model, x = VAE("tensorflow"), _x(8)
    model(x)
    before = _values(model.weights)
    converted = kip.convert_to_functional(model, x, verify=True)
    expanded = kip.apply_passes(converted, [kip.passes.Expand("all")])
    assert expanded.kip_report.opaque == {}
    assert "sampling.tf_normal" in [node.name for node in expanded.kip_graph.nodes]
    for batch in (3, 16):
        assert expanded(_x(batch)).shape == model(_x(batch)).shape
    _assert_values(model.weights, before)


def test_random_numbers_verification_cannot_replay_are_refused_clearly():
    model, x = VAE("numpy"), _x(8)
    model(x)
    before = _values(model.weights)
    with pytest.raises(kip.ConversionError, match="random numbers verification cannot replay") as info:
        kip.convert_to_functional(model, x, verify=True)
    assert "keras.random.SeedGenerator" in str(info.value)
    assert isinstance(info.value.__cause__, kip.ConversionError)  # the mismatch itself
    _assert_values(model.weights, before)


# -- item 3: rollback with TensorFlow's tracked containers -------------------------
def _functional_encoder():
    inputs = keras.Input((5,))
    return keras.Model(inputs, keras.layers.Dense(3)(inputs))


class HoldsAFunctionalModel(keras.Model):
    """Holds a called functional sub-model (TensorFlow wraps its attributes
    in `_DictWrapper` / `ListWrapper`) and computes something else when
    traced than when run, so verification fails."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.encoder = _functional_encoder()
        self.head = keras.layers.Dense(2)

    def call(self, inputs):
        y = self.head(self.encoder(inputs))
        if isinstance(inputs, keras.KerasTensor):
            return y * 2.0
        return y


def _wrapper_contents(layer):
    return {name: list(value) if isinstance(value, list) else dict(value)
            for name, value in vars(layer).items()
            if type(value).__name__ in ("ListWrapper", "_DictWrapper")}


def test_failed_conversion_of_a_model_holding_a_functional_model_raises_the_real_error(tmp_path):
    model, x = HoldsAFunctionalModel(), _x()
    model(x)
    wrappers = _wrapper_contents(model.encoder)
    assert wrappers, "the sub-model should hold TensorFlow's tracked containers"
    with pytest.raises(kip.ConversionError, match="differs"):
        kip.convert_to_functional(model, x)
    assert _wrapper_contents(model.encoder) == wrappers
    # The wrappers saw nothing behind their back: a TensorFlow checkpoint
    # (which refuses a wrapper changed behind its back) still saves.
    tf.train.Checkpoint(model=model).write(str(tmp_path / "after_failure"))
    model.save_weights(str(tmp_path / "after_failure.weights.h5"))
    converted = kip.convert_to_functional(model, x, verify=False)
    assert converted(x).shape == (4, 2)


def test_a_restore_step_that_fails_is_noted_on_the_original_error(monkeypatch):
    def broken_restore(self, index):
        raise RuntimeError("injected restore failure")

    from keras_ipu_plugin.frontend import state as state_module

    monkeypatch.setattr(state_module._ObjectsState, "restore_object", broken_restore)
    model, x = HoldsAFunctionalModel(), _x()
    model(x)
    with pytest.raises(kip.ConversionError, match="differs") as info:
        kip.convert_to_functional(model, x)
    notes = " ".join(getattr(info.value, "__notes__", []))
    assert "injected restore failure" in notes and "partly changed" in notes


# -- item 6: a failed conversion puts BatchNormalization statistics back ------------
class MovesStatisticsThenFails(keras.Model):
    """Runs opaque (a Python `if` on a tensor value), with a
    BatchNormalization in training mode at every call: the conversion's
    eager call of the model moves the statistics, and any call after that
    one raises, so the conversion fails after the statistics moved (and
    outside verification, which puts back what its own runs move)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(3)
        self.bn = keras.layers.BatchNormalization(momentum=0.5)
        self.eager_calls = [0]  # a list: shared with the views conversion calls

    def call(self, inputs):
        if self.eager_calls[0]:
            raise RuntimeError("called again after an eager call")
        y = self.bn(self.dense(inputs), training=True)
        if keras.ops.sum(y) > 1e9:
            y = y * 2.0
        if tf.executing_eagerly() and not isinstance(inputs, keras.KerasTensor):
            self.eager_calls[0] += 1
        return y


def test_failed_conversion_restores_batchnorm_moving_statistics_exactly():
    model, x = MovesStatisticsThenFails(), _x(8) * 3.0 + 1.0
    model(x)
    model.eager_calls[0] = 0
    before = _values(model.non_trainable_variables)
    with pytest.raises(RuntimeError, match="called again after an eager call"):
        kip.convert_to_functional(model, x)
    _assert_values(model.non_trainable_variables, before)
    assert model.eager_calls == [0]
    # The statistics do move at an eager call: the check above could fail.
    model(x)
    assert not np.array_equal(model.bn.moving_mean.numpy(), before[model.bn.moving_mean.path])


# -- item 4: N steps across rebuilds count N ------------------------------------------
class CountingGrowingModel(keras.Model):
    """Counts its steps in a variable; grows a head when `grow` is set."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.grow = False
        self.base = keras.layers.Dense(4, activation="tanh")
        self.extra = keras.layers.Dense(4, name="extra")
        self.out = keras.layers.Dense(1)
        self.steps = _counter(self, "steps")

    def call(self, inputs, training=None):
        if training:
            self.steps.assign_add(1)
        x = self.base(inputs)
        if self.grow:
            x = x + self.extra(x)
        return self.out(x)


class GrowAt(keras.callbacks.Callback):
    def __init__(self, model, epoch):
        super().__init__()
        self.target, self.epoch = model, epoch

    def on_epoch_begin(self, epoch, logs=None):
        if epoch == self.epoch:
            self.target.grow = True


@pytest.mark.parametrize("entry", ["plugin_model", "callback"])
@pytest.mark.parametrize("run_eagerly", [False, True], ids=["graph", "eager"])
def test_a_step_counter_reads_the_number_of_steps_across_rebuilds(entry, run_eagerly):
    x = np.random.RandomState(2).normal(size=(64, 3)).astype("float32")
    y = np.sin(x.sum(axis=1, keepdims=True))
    model = CountingGrowingModel()
    model(x[:1])
    callbacks = [GrowAt(model, 2)]
    if entry == "plugin_model":
        trained = kip.PluginModel(model)
        trained.compile(optimizer="sgd", loss="mse", run_eagerly=run_eagerly)
    else:
        model.compile(optimizer="sgd", loss="mse", run_eagerly=run_eagerly)
        callbacks.append(kip.PluginCallback())
        trained = model
    trained.fit(x, y, batch_size=16, epochs=4, shuffle=False, verbose=0, callbacks=callbacks)
    assert int(model.steps.numpy()) == 16
    session = model.train_function.session if entry == "callback" else trained._kip_session
    assert session.rebuilds >= 1
    # The head grown at epoch 2 was built and trained, in graph mode too.
    assert model.extra.built


class CountsOnceSwitchedOn(keras.Model):
    """Traceable until a flag switches on a counter that `call` assigns."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.count_steps = False
        self.dense = keras.layers.Dense(1)
        self.steps = _counter(self, "steps")

    def call(self, inputs, training=None):
        if self.count_steps and training:
            self.steps.assign_add(1)
        return self.dense(inputs)


class SwitchOnCounting(keras.callbacks.Callback):
    def __init__(self, model, epoch):
        super().__init__()
        self.target, self.epoch = model, epoch

    def on_epoch_begin(self, epoch, logs=None):
        if epoch == self.epoch:
            self.target.count_steps = True


@pytest.mark.parametrize("run_eagerly", [False, True], ids=["graph", "eager"])
def test_a_flag_that_switches_on_a_variable_update_is_not_dropped(run_eagerly):
    """The same layers are reached before and after the switch, but `call`
    now assigns a variable itself: the model is converted again (the write
    a node of the new graph), not left on a graph without the update."""
    x = np.random.RandomState(5).normal(size=(64, 3)).astype("float32")
    y = x[:, :1]
    model = CountsOnceSwitchedOn()
    model(x[:1])
    plugin = kip.PluginModel(model)
    plugin.compile(optimizer="sgd", loss="mse", run_eagerly=run_eagerly)
    plugin.fit(x, y, batch_size=16, epochs=4, shuffle=False, verbose=0,
               callbacks=[SwitchOnCounting(model, 2)])
    assert int(model.steps.numpy()) == 8  # epochs 2 and 3, 4 steps each
    # The branch on `training` is one ModeSwitch node and the
    # counter's write a node of its training graph: traced, not opaque.
    assert model.name not in plugin.kip_report.opaque


class MirroredCountingGrowingModel(CountingGrowingModel):
    """Its counter counts the first replica's calls (one per step)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.steps = self.add_weight(shape=(), dtype="int32", initializer="zeros",
                                     trainable=False, name="steps",
                                     aggregation="only_first_replica")


@pytest.mark.parametrize("run_eagerly", [False, True], ids=["graph", "eager"])
def test_a_step_meeting_new_variables_under_mirrored_runs_once(mirrored, run_eagerly):
    """Under a multi-replica strategy an eager step that meets variables its
    optimizer does not know must not be run a second time (its forward pass
    has already run by then): the optimizer is extended from the replica."""
    x = np.random.RandomState(4).normal(size=(64, 3)).astype("float32")
    y = np.sin(x.sum(axis=1, keepdims=True))
    with mirrored.scope():
        model = MirroredCountingGrowingModel()
        model(x[:1])
        plugin = kip.PluginModel(model)
        plugin.compile(optimizer="sgd", loss="mse", run_eagerly=run_eagerly)
    plugin.fit(x, y, batch_size=16, epochs=4, shuffle=False, verbose=0,
               callbacks=[GrowAt(model, 2)])
    assert int(model.steps.numpy()) == 16
    assert plugin._kip_session.rebuilds >= 1
    assert model.extra.built


def test_opaque_model_runs_the_branch_a_flag_switches_on_in_graph_mode():
    """A model's `call` is traced with the flag's value of that trace (its
    branch on `training` one ModeSwitch node, its counter a write node):
    flipping the flag between epochs must retrace, not be ignored."""
    x = np.random.RandomState(3).normal(size=(64, 3)).astype("float32")
    y = np.sin(x.sum(axis=1, keepdims=True))
    model = CountingGrowingModel()
    model(x[:1])
    plugin = kip.PluginModel(model)
    plugin.compile(optimizer="sgd", loss="mse")
    plugin.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0,
               callbacks=[GrowAt(model, 1)])
    assert model.name not in plugin.kip_report.opaque
    assert model.extra.built
    kernel = model.extra.kernel.numpy().copy()
    plugin.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    assert not np.array_equal(model.extra.kernel.numpy(), kernel), "the grown head does not train"


# -- item 5: threads -------------------------------------------------------------
def _in_threads(work, count):
    barrier = threading.Barrier(count)
    results = [None] * count

    def run(index):
        barrier.wait()
        try:
            results[index] = work(index)
        except Exception as error:  # reported below, with its type
            results[index] = error

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    errors = [f"{type(r).__name__}: {r}" for r in results if isinstance(r, Exception)]
    assert not errors, errors
    return results


def test_twenty_concurrent_conversions_of_one_model_all_succeed_and_agree():
    model, x = zoo.make_cnn()
    model(x)
    expected = model(x).numpy()
    converted = _in_threads(lambda _: kip.convert_to_functional(model, x), 20)
    for one in converted:
        np.testing.assert_allclose(one(x), expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(model(x), expected, rtol=1e-6, atol=1e-6)


class SharedEncoderHead(keras.Model):
    def __init__(self, encoder, **kwargs):
        super().__init__(**kwargs)
        self.encoder = encoder
        self.head = keras.layers.Dense(2)

    def call(self, inputs, training=None):
        return self.head(self.encoder(inputs, training=training))


def test_concurrent_conversions_of_models_sharing_a_layer_all_succeed():
    encoder, x = zoo.make_cnn()
    models = [SharedEncoderHead(encoder) for _ in range(3)]
    for model in models:
        model(x)
    expected = [model(x).numpy() for model in models]
    converted = _in_threads(lambda i: kip.convert_to_functional(models[i % 3], x), 12)
    for index, one in enumerate(converted):
        np.testing.assert_allclose(one(x), expected[index % 3], rtol=1e-5, atol=1e-6)


def test_concurrent_apply_passes_over_one_model_all_succeed_and_agree():
    model, x = zoo.make_cnn()
    converted = kip.convert_to_functional(model, x)
    expected = converted(x).numpy()
    passed = _in_threads(lambda _: kip.apply_passes(converted, [kip.passes.Expand()]), 8)
    for one in passed:
        np.testing.assert_allclose(one(x), expected, rtol=1e-5, atol=1e-6)


# -- the undo snapshot's cost -------------------------------------------------------
class _Block(keras.layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(4)
        self.norm = keras.layers.LayerNormalization()

    def call(self, x):
        return x + self.norm(self.dense(x))


class _Blocks(keras.Model):
    def __init__(self, n, **kwargs):
        super().__init__(**kwargs)
        self.blocks = [_Block() for _ in range(n)]

    def call(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def _tracked_objects():
    gc.collect()
    return len(gc.get_objects())


def test_the_undo_snapshot_allocates_no_object_per_container():
    # A layer holds some 25 Keras containers (variable and node lists,
    # trackers' dicts and sets). A copy or a tuple for each made the
    # snapshots of a convert + Expand of 500 blocks 240,000 objects, enough
    # to set off a full collection of Python's cyclic collector over all of
    # TensorFlow's objects, which cost more than the rest of the conversion.
    from keras_ipu_plugin.frontend.state import ModelState

    model = _Blocks(40)
    model(np.zeros((2, 4), "float32"))
    before = _tracked_objects()
    snapshot = ModelState(model)
    made = _tracked_objects() - before
    # What stays is a few objects per user-written layer (its plain
    # attributes, kept apart to restore after success: 41 here) and a few
    # flat lists; a copy per container was over 100 per block.
    assert made < 10 * 41, made
    del snapshot


class _Holder:
    """A plain object with containers, one of them shared and one holding itself."""


def test_the_undo_snapshot_puts_back_nested_shared_and_self_holding_containers():
    from keras_ipu_plugin.frontend.state import _ObjectsState

    shared = [1, 2]
    first, second = _Holder(), _Holder()
    first.items = [shared, {"a": [3], "b": {4}}]
    first.loop = []
    first.loop.append(first.loop)
    first.name = "first"
    second.shared = shared
    second.table = {"x": shared}
    snapshot = _ObjectsState([first, second])
    expected = (repr(vars(first)), repr(vars(second)))

    shared.append(99)
    first.items[1]["a"].clear()
    first.items[1]["b"].add(5)
    first.items[1]["c"] = "new"
    first.loop.append(1)
    first.name = "changed"
    first.extra = True
    second.table.pop("x")
    for index in range(2):
        snapshot.restore_object(index)
    assert (repr(vars(first)), repr(vars(second))) == expected
    assert second.shared is shared and first.items[0] is shared
    assert first.loop[0] is first.loop and not hasattr(first, "extra")


# -- an interrupt (Ctrl-C) in a conversion leaves the model as it was -------------
from graph_checks import Snapshot  # noqa: E402  (tests/ is on sys.path)
from keras_ipu_plugin import _compat  # noqa: E402


def _node_counts(model):
    return {layer.name: (len(layer._inbound_nodes), len(layer._outbound_nodes))
            for layer in _compat.all_layers(model)}


_EAGER_AND_SYMBOLIC_CALLS = []  # outside the model: the undo puts its containers back


class InterruptedOnCall(keras.layers.Layer):
    """Raises KeyboardInterrupt on its `at`-th call, as Ctrl-C would."""

    def __init__(self, at, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(3)
        self.at = at

    def call(self, inputs):
        _EAGER_AND_SYMBOLIC_CALLS.append(self.name)
        if _EAGER_AND_SYMBOLIC_CALLS.count(self.name) == self.at:
            raise KeyboardInterrupt
        return self.dense(inputs)


class WithInterruptedBlock(keras.Model):
    def __init__(self, at, **kwargs):
        super().__init__(**kwargs)
        self.stem = keras.layers.Dense(4)
        self.block = InterruptedOnCall(at)
        self.head = keras.layers.Dense(2)

    def call(self, inputs):
        return self.head(self.block(self.stem(inputs)))


def _interrupt_after(monkeypatch, module, name, nth=1):
    """Make `module.name` raise KeyboardInterrupt right after its `nth` call
    returns (so what that call did is there to be undone)."""
    original, count = getattr(module, name), [0]

    def interrupted(*args, **kwargs):
        result = original(*args, **kwargs)
        count[0] += 1
        if count[0] == nth:
            raise KeyboardInterrupt
        return result

    monkeypatch.setattr(module, name, interrupted)
    return count


@pytest.mark.parametrize("at", [1, 2, 3, 4])  # tracing both modes, then verifying
def test_a_keyboard_interrupt_from_a_layer_leaves_the_model_as_it_was(at):
    model, x = WithInterruptedBlock(at=0), _x()
    model(x)
    calls = lambda: _EAGER_AND_SYMBOLIC_CALLS.count(model.block.name)  # noqa: E731
    model.block.at = calls() + at
    snapshot, nodes = Snapshot(model), _node_counts(model)
    with pytest.raises(KeyboardInterrupt):
        kip.convert_to_functional(model, x)
    assert calls() == model.block.at  # it did run that far
    assert _node_counts(model) == nodes
    snapshot.assert_unchanged()
    model.block.at = 0
    converted = kip.convert_to_functional(model, x)
    np.testing.assert_allclose(converted(x), model(x), rtol=1e-6)


@pytest.mark.parametrize("module, name, nth", [
    ("keras_ipu_plugin.frontend.convert", "rebuild", 1),  # the converted model's nodes made
    ("keras_ipu_plugin.frontend.verify.equivalence", "run_model", 2),  # in verification
    ("keras_ipu_plugin.frontend.convert", "_verify", 1),  # all done but putting state back
])
def test_a_keyboard_interrupt_late_in_a_conversion_leaves_the_model_as_it_was(
        monkeypatch, module, name, nth):
    import importlib

    model, x = zoo.make_transformer()
    model(x)
    snapshot, nodes = Snapshot(model), _node_counts(model)
    count = _interrupt_after(monkeypatch, importlib.import_module(module), name, nth)
    with pytest.raises(KeyboardInterrupt):
        kip.convert_to_functional(model, x)
    assert count[0] == nth
    assert _node_counts(model) == nodes
    snapshot.assert_unchanged()
    monkeypatch.undo()
    kip.convert_to_functional(model, x)


@pytest.mark.parametrize("entry", ["model", "callback"])
@pytest.mark.parametrize("error", [KeyboardInterrupt, kip.PassError])
def test_an_interrupted_or_failed_pass_in_fit_leaves_no_node_on_the_model(
        monkeypatch, entry, error):
    # Before: the conversion fit made before its passes kept one Keras node
    # per call on every layer of the model, each fit interrupted adding more.
    from keras_ipu_plugin.training.session import session as steps

    def failing(*args, **kwargs):
        raise error("injected") if error is not KeyboardInterrupt else error

    model, x = zoo.make_nested()
    model(x)
    y = np.zeros(tuple(model(x).shape), "float32")
    snapshot, nodes = Snapshot(model), _node_counts(model)
    monkeypatch.setattr(steps, "apply_passes", failing)

    def fit():
        fitted, callbacks = model, []
        if entry == "model":
            fitted = kip.PluginModel(model, passes=[kip.passes.Expand()])
        else:
            callbacks = [kip.PluginCallback(passes=[kip.passes.Expand()])]
        fitted.compile(optimizer="sgd", loss="mse")
        return fitted.fit(x, y, epochs=1, verbose=0, callbacks=callbacks)

    for _ in range(2):
        with pytest.raises(error):
            fit()
        assert _node_counts(model) == nodes
    if entry == "model":
        snapshot.assert_unchanged()  # compile changes the model itself otherwise
    monkeypatch.undo()
    assert fit().history["loss"]


def test_an_interrupt_while_undoing_still_undoes_the_rest(monkeypatch):
    # A second Ctrl-C while the first one's undo runs: the undo finishes, and
    # the interrupt is raised after it.
    from keras_ipu_plugin.frontend import state as state_module

    original, calls = state_module._ObjectsState.restore_object, [0]

    def interrupted_once(self, index):
        calls[0] += 1
        if calls[0] == 1:
            raise KeyboardInterrupt
        return original(self, index)

    model, x = HoldsAFunctionalModel(), _x()
    model(x)
    snapshot, nodes = Snapshot(model), _node_counts(model)
    monkeypatch.setattr(state_module._ObjectsState, "restore_object", interrupted_once)
    with pytest.raises(KeyboardInterrupt) as raised:
        kip.convert_to_functional(model, x)  # fails verification, then undoes
    assert calls[0] > 1
    assert isinstance(raised.value.__context__, kip.ConversionError)
    assert _node_counts(model) == nodes
    snapshot.assert_unchanged()


def test_node_bookkeeping_kept_on_success_also_inside_an_except_clause():
    # The snapshot once asked sys.exc_info() whether the block failed, which
    # inside an `except` clause (a rebuild after a caught error) is the
    # caught error: the nodes of a success were dropped.

    layer = keras.layers.Dense(2)
    inputs = keras.Input((3,))
    try:
        raise ValueError("caught")
    except ValueError:
        with _compat.node_lists_snapshot([layer]):
            layer(inputs)
    assert len(layer._inbound_nodes) == 1
    with pytest.raises(KeyboardInterrupt):
        with _compat.node_lists_snapshot([layer]):
            layer(inputs)
            raise KeyboardInterrupt
    assert len(layer._inbound_nodes) == 1


def test_plain_attribute_filter_learns_types_not_values():
    # The fast filter remembers types none of whose values is plain; a tuple
    # of objects must not make a later tuple of numbers count as not plain.
    from keras_ipu_plugin.frontend import state as state_lib

    assert not state_lib._is_plain((object(),))
    assert not state_lib._is_plain([1])
    assert tuple not in state_lib._NOT_PLAIN_TYPES
    assert list in state_lib._NOT_PLAIN_TYPES
    assert state_lib._is_plain((1, "a", None))
    assert state_lib._is_plain(np.float32(1.0))


# -- a Ctrl-C at any moment of a conversion ------------------------------------------
class _InterruptAtCall:
    """A trace function (`sys.settrace`) raising KeyboardInterrupt as `code`
    (a function's code object) is entered for the `at`-th time — a resumed
    generator counts too: the interpreter delivers a real Ctrl-C at such
    points. With `code=None` it records the functions entered instead, and
    where the first call of `within` (a code object) starts and ends. Python
    drops a trace function that raises, so a run is interrupted once, as by
    one Ctrl-C."""

    def __init__(self, code=None, at=None, within=None):
        self.code, self.at, self.seen, self.entered = code, at, 0, []
        self.within, self.window = within, []

    def __call__(self, frame, event, arg):
        if self.code is None:
            self.entered.append(frame.f_code)
            if frame.f_code is self.within and not self.window:
                self.window.append(len(self.entered) - 1)
                return self._leaving
        elif frame.f_code is self.code:
            self.seen += 1
            if self.seen == self.at:
                raise KeyboardInterrupt
        return None  # no tracing inside the frame

    def _leaving(self, frame, event, arg):
        if event == "return":
            self.window.append(len(self.entered))
            return None
        return self._leaving

    def run(self, function, *args):
        previous = sys.gettrace()  # (a coverage tool's)
        sys.settrace(self)
        try:
            return function(*args)
        finally:
            sys.settrace(previous)


def _interrupt_moments(convert, model, x, points, tail, within=None):
    """`(code, n)` pairs: the entries of the plugin's functions (`_ours`) in
    a run of `convert(model, x)` (of its first call of `within`, if given)
    at `points` moments spread
    over it and at each of its last `tail` entries (where the conversion is
    done but for handing its result back). Named by function and count, not
    by position: the number of calls drifts a little from run to run (lists
    the conversion walks grow)."""
    convert(model, x)  # warm: later runs make the same calls
    recorder = _InterruptAtCall(within=within)
    recorder.run(convert, model, x)
    entered = recorder.entered
    start, end = recorder.window if within is not None else (0, len(entered))
    wanted = set(range(start, end, max(1, (end - start) // points)))
    wanted |= set(range(max(start, end - tail), end))
    counts, moments = {}, []
    for position, code in enumerate(entered[:end]):
        counts[code] = counts.get(code, 0) + 1
        if position in wanted and _ours(code):
            moments.append((code, counts[code]))
    return moments


def _ours(code):
    """Whether an interrupt entering `code` is one the plugin must survive:
    entering the plugin's functions or this file's (the user's model).
    Entering TensorFlow's own functions is left out: a `KeyboardInterrupt`
    between a `GradientTape`'s push and its `try` leaves the tape recording
    on the thread for good, whatever its caller does (every later `fit` in
    the process then fails to differentiate its data iterator)."""
    return "keras_ipu_plugin" in code.co_filename or code.co_filename == __file__


def _interrupt_sweep(convert, x, make_model, points=25, tail=30, within=None,
                     whole_model=True):
    """Interrupt `convert(model, x)` at each of `_interrupt_moments`. Each
    interrupted run must leave the model as it was, no Keras node added to
    its layers; a run the interrupt missed (Python ignores one raised in a
    finaliser) returns a working model. `whole_model=False` checks the
    node lists only (`compile` with a callback changes the model itself).
    Returns (interrupted runs, moments missed)."""
    model = make_model()
    moments = _interrupt_moments(convert, model, x, points, tail, within)
    interrupted, missed = 0, []
    for code, at in moments:
        model = make_model()
        snapshot, nodes = Snapshot(model), _node_counts(model)
        try:
            converted = _InterruptAtCall(code, at).run(convert, model, x)
        except KeyboardInterrupt:
            interrupted += 1
            where = f"interrupted entering {code.co_name} ({code.co_filename}) the {at}th time"
            assert _node_counts(model) == nodes, where
            if whole_model:
                try:
                    snapshot.assert_unchanged()
                except AssertionError as error:
                    raise AssertionError(where) from error
        else:
            missed.append(f"{code.co_name} ({code.co_filename}) the {at}th time")
            if isinstance(converted, keras.Model):
                np.testing.assert_allclose(converted(x), model(x), rtol=1e-6)
    return interrupted, missed


@pytest.mark.parametrize("called_first", [True, False])
def test_a_keyboard_interrupt_at_any_moment_of_a_conversion_leaves_the_model_as_it_was(
        called_first):
    """A Ctrl-C anywhere in `convert_to_functional`, up to the moment it
    returns, leaves no Keras node on the user's layers (each would stay for
    good, one per layer per interrupt) and the model as it was: built or not,
    the same attributes, variables and node lists."""
    # (A name of its own: Keras's default from the class, "__blocks", is
    # no valid TensorFlow root name scope, which a first call leaves open.)
    x = _x(features=4)
    built = _Blocks(3, name="blocks")
    built(x)
    if called_first:
        # One model throughout: an interrupted run leaves it as it was.
        interrupted, missed = _interrupt_sweep(kip.convert_to_functional, x, lambda: built)
    else:
        # Building the model is undone too: each run converts a new one.
        interrupted, missed = _interrupt_sweep(
            kip.convert_to_functional, x, lambda: _Blocks(2, name="blocks"), points=8, tail=8)
    # A moment is a function's n-th call: runs differ a little (TensorFlow's
    # caches fill), so a few moments of a run never come.
    assert len(missed) <= (interrupted + len(missed)) // 5, missed


@pytest.mark.skipif(not hasattr(signal, "setitimer"), reason="needs POSIX interval timers")
def test_a_real_interrupt_signal_late_in_a_conversion_leaves_no_node_on_the_model():
    """A Ctrl-C delivered by the operating system half way through to the
    very end of converting a 30-block model (a timer signal handled as
    SIGINT is, by raising KeyboardInterrupt) leaves the model as it was; a
    conversion it came too late for has returned its result."""
    import time

    x = _x(features=4)
    model = _Blocks(30, name="blocks")
    model(x)
    kip.convert_to_functional(model, x)  # warm
    start = time.perf_counter()
    kip.convert_to_functional(model, x)
    took = time.perf_counter() - start
    previous = signal.signal(signal.SIGALRM, signal.default_int_handler)
    try:
        for fraction in (0.5, 0.8, 0.95):
            snapshot, nodes = Snapshot(model), _node_counts(model)
            converted = None
            try:
                try:
                    signal.setitimer(signal.ITIMER_REAL, took * fraction)
                    converted = kip.convert_to_functional(model, x)
                finally:
                    signal.setitimer(signal.ITIMER_REAL, 0)
            except KeyboardInterrupt:
                if converted is None:
                    assert _node_counts(model) == nodes, fraction
                    snapshot.assert_unchanged()
    finally:
        signal.signal(signal.SIGALRM, previous)


@pytest.mark.parametrize("entry", ["model", "callback"])
def test_a_keyboard_interrupt_at_any_moment_of_a_conversion_in_fit_leaves_no_node(entry):
    """A Ctrl-C anywhere in the conversion `fit` makes for a `PluginModel` or
    a `PluginCallback` (converting, applying the passes, keeping the result)
    leaves no Keras node on the user's layers: each fit tried again after
    one would add a node to every layer."""
    from keras_ipu_plugin.training.session.session import TrainingSession

    x = _x(features=4)
    y = np.zeros((4, 4), "float32")

    def fit(model, x):
        fitted, callbacks = model, []
        if entry == "model":
            fitted = kip.PluginModel(model, passes=[kip.passes.Expand()])
        else:
            callbacks = [kip.PluginCallback(passes=[kip.passes.Expand()])]
        fitted.compile(optimizer="sgd", loss="mse")
        return fitted.fit(x, y, epochs=1, verbose=0, callbacks=callbacks)

    def make_model():
        model = _Blocks(2, name="blocks")
        model(x)
        # Wrapping a model sets TensorFlow's checkpoint bookkeeping on it
        # (`_self_...` attributes): as any tracking object does, before the
        # conversion.
        kip.PluginModel(model)
        return model

    interrupted, missed = _interrupt_sweep(
        fit, x, make_model, points=6, tail=12,
        within=TrainingSession.add_conversion.__code__, whole_model=entry == "model")
    assert len(missed) <= (interrupted + len(missed)) // 5, missed


def test_variable_values_see_every_bit_and_put_back_what_changed_in_one_pass():
    """What verification puts back between its runs: a change is any
    change of bits (-0.0 is not 0.0; a NaN left as it was is no change),
    in any dtype, and `changed_values(put_back=True)` returns what was
    written while putting the saved values back."""
    from keras_ipu_plugin.frontend.state import VariableValues

    floats = keras.Variable(np.array([0.0, np.nan, 1.5], "float32"), name="floats")
    halves = keras.Variable(np.array([[1.0, 2.0]], "float16"), name="halves")
    count = keras.Variable(np.int64(3), name="count", trainable=False)
    flag = keras.Variable(np.array([True, False]), name="flag", trainable=False)
    values = VariableValues([floats, halves, count, flag])
    floats.assign(np.array([0.0, np.nan, 1.5], "float32"))  # the same bits
    assert values.changed_values() == {}
    floats.assign(np.array([-0.0, np.nan, 1.5], "float32"))
    halves.assign(np.array([[1.0, 2.5]], "float16"))
    count.assign(4)
    flag.assign(np.array([True, True]))
    changed = values.changed_values(put_back=True)
    assert {variable.name for variable, _ in changed.values()} == {
        "floats", "halves", "count", "flag"}
    assert np.signbit(changed[id(floats)][1][0]) and changed[id(count)][1] == 4
    assert values.changed_values() == {}
    assert not np.signbit(floats.numpy()[0]) and int(count.numpy()) == 3
    np.testing.assert_array_equal(flag.numpy(), [True, False])
