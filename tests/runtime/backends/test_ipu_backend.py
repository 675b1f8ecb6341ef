"""The IPU backend, call for call, against a stand-in for Graphcore's SDK.

There is no IPU and no Poplar SDK here, and the SDK's TensorFlow 2.6 / Keras
2.6 could not import this library: nothing here runs on an IPU. These tests
install `tests/ipu_standin.py` -- a stand-in written for this project that
imitates the signatures and argument conventions of Graphcore's SDK 3.4 and
fails where it would (its docstring lists what it enforces and where each
rule comes from) -- and check which SDK functions the backend calls, with
what, and what it refuses. The backend follows these files of Graphcore's
code (branch r2.6/sdk-release-3.4):

- graphcore/tensorflow tensorflow/python/ipu/ops/functional_ops.py
  (`outlined_function`), ops/pipelining_ops.py (`recomputation_checkpoint`,
  `RecomputationMode`), config.py (`IPUConfig`, `configure_ipu_system`),
  ipu_strategy.py (`IPUStrategyV1`);
- graphcore/keras keras/ipu/extensions/functional_extensions.py
  (`get/set_pipeline_stage_assignment`, `set_pipelining_options`,
  `set_gradient_accumulation_options`, `_validate_call_function`),
  extensions_base.py (the RuntimeError for an overridden
  `make_train_function`), pipeline_stage_assignment.py, data_adapter.py;
- graphcore/ipu_tensorflow_addons keras/layers/ dropout.py,
  normalization.py, embedding_lookup.py, dense.py (`SerialDense`), rnn.py
  (`PopnnLSTM`, `PopnnGRU` and rnn_test.py's weight copies);
- graphcore/examples nlp/bert/tensorflow2 keras_extensions/model_transformations.py
  (outlining a layer by closing over it) and run_pretraining.py (stage
  assignment, then `set_pipelining_options(..., recomputation_mode=...)`).
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import ipu_standin
import keras_ipu_plugin as kip
from keras_ipu_plugin.runtime import backends as backend_lib
import models  # tests/models.py (tests/ is on sys.path under pytest)


class Tower(models.NormTower):
    def __init__(self, depth=3, width=16):
        super().__init__(depth=depth, width=width)


def _data(n=32, features=8):
    return models.regression_data(n, features)


class MaskedTower(models.MaskedTower):
    def __init__(self):
        super().__init__(depth=2)


MaskedBlock = models.MaskedAttentionBlock
Block = models.NormBlock



@pytest.fixture
def standin(monkeypatch):
    """Graphcore's SDK replaced by the stand-in, for this test only."""
    installed = ipu_standin.install(monkeypatch)
    backend_lib.get_backend.cache_clear()
    yield installed
    backend_lib.get_backend.cache_clear()


def _gradients(model, x):
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(model(x, training=True))
    return tape.gradient(loss, model.trainable_variables)


def _assert_same_model(original, passed, x):
    np.testing.assert_allclose(passed(x), original(x), atol=1e-5)
    for a, e in zip(_gradients(passed, x), _gradients(original, x)):
        np.testing.assert_allclose(a, e, atol=1e-4)


# -- 1. outlined calls -------------------------------------------------------------------


def test_outlined_calls_pass_only_tensors_positionally(standin):
    x, _ = _data()
    model = Tower()
    converted = kip.convert_to_functional(model, x)
    outlined = kip.apply_passes(converted, [kip.passes.Outline(Block)])
    standin.recorder.calls.clear()
    _assert_same_model(model, outlined, x)
    calls = standin.recorder.named("outlined_function")
    # One function per block call (the Poplar compiler, not Python, shares
    # identical bodies): 3 blocks, called for the outputs and for the gradients.
    assert len(calls) == 2 * 3
    for _, kwargs, shapes in calls:
        assert kwargs == {"unique_sharding": False, "keep_input_layouts": None, "name": "function"}
        # the Dense kernel and bias, the LayerNormalization gamma and beta, the input
        assert sorted(shapes) == sorted([(16, 16), (16,), (16,), (16,), (32, 16)])


def test_outline_accepts_only_the_keywords_outlined_function_has(standin):
    with pytest.raises(kip.PassError, match="maximum_num_reuses.*unique_sharding, keep_input_layouts, name"):
        kip.passes.Outline(Block, maximum_num_reuses=4)
    with pytest.raises(kip.PassError, match="unique_sharding"):
        kip.passes.Outline(Block, unique_sharding="yes")
    x, _ = _data()
    converted = kip.convert_to_functional(Tower(depth=1), x)
    outlined = kip.apply_passes(converted, [
        kip.passes.Outline(Block, unique_sharding=True, keep_input_layouts=False, name="block")])
    standin.recorder.calls.clear()
    outlined(x)
    [(_, kwargs, _)] = standin.recorder.named("outlined_function")
    assert kwargs == {"unique_sharding": True, "keep_input_layouts": False, "name": "block"}


def test_outlined_tensor_keyword_arguments_become_positional_tensors(standin):
    ids = np.random.default_rng(0).integers(1, 20, size=(4, 6))
    ids[:, 4:] = 0
    model = MaskedTower()
    converted = kip.convert_to_functional(model, ids)
    outlined = kip.apply_passes(converted, [kip.passes.Outline(MaskedBlock)])
    standin.recorder.calls.clear()
    np.testing.assert_allclose(outlined(ids), model(ids), atol=1e-5)
    calls = standin.recorder.named("outlined_function")
    assert len(calls) == 2
    # the attention mask (4, 1, 6) is one of the positional tensors
    assert all((4, 1, 6) in shapes for _, _, shapes in calls)


def test_recompute_puts_one_checkpoint_on_each_checkpointed_layers_outputs(standin):
    x, _ = _data()
    converted = kip.convert_to_functional(Tower(), x)
    passed = kip.apply_passes(converted, [kip.passes.Recompute(["block_0", "block_2"])])
    standin.recorder.calls.clear()
    passed(x)
    assert standin.recorder.named("recomputation_checkpoint") == [
        ("recomputation_checkpoint", [(32, 16)]), ("recomputation_checkpoint", [(32, 16)])]


# -- 2. and 5. replacement layers ------------------------------------------------------------


class DenseNet(keras.Model):
    def __init__(self):
        super().__init__()
        self.hidden = keras.layers.Dense(32, activation="relu", name="hidden")
        self.head = keras.layers.Dense(4, name="head")

    def call(self, x):
        return self.head(self.hidden(x))


def test_serial_dense_gets_its_two_required_arguments(standin):
    x, _ = _data(n=8)
    model = DenseNet()
    converted = kip.convert_to_functional(model, x, static_batch=True)
    passed = kip.apply_passes(converted, kip.ipu_replacements(
        serial_dense=True, serialization_factor=2, serialization_dimension="kernel_rows"))
    serial = [layer for layer in passed.layers if isinstance(layer, standin.addons.SerialDense)]
    assert len(serial) == 2
    assert all(layer.serialization_factor == 2 for layer in serial)
    assert all(layer.serialization_dimension == "kernel_rows" for layer in serial)
    np.testing.assert_allclose(passed(x), model(x), atol=1e-5)


def test_serial_dense_without_its_arguments_or_with_a_bad_factor_is_refused(standin):
    with pytest.raises(kip.PassError, match="serialization_factor"):
        kip.ipu_replacements(serial_dense=True)
    with pytest.raises(kip.PassError, match="serialization_dimension.*input_columns"):
        kip.ipu_replacements(serial_dense=True, serialization_factor=2, serialization_dimension="rows")
    x, _ = _data(n=8)
    converted = kip.convert_to_functional(DenseNet(), x, static_batch=True)
    with pytest.raises(kip.PassError, match="`hidden`.*serialization_factor=3 does not divide units \\(32\\)"):
        kip.apply_passes(converted, kip.ipu_replacements(
            serial_dense=True, serialization_factor=3, serialization_dimension="kernel_rows"))


class Recurrent(keras.Model):
    def __init__(self, reset_after=True):
        super().__init__()
        self.embed = keras.layers.Embedding(20, 6)
        self.lstm = keras.layers.LSTM(5, return_sequences=True)
        self.gru = keras.layers.GRU(4, reset_after=reset_after)
        self.norm = keras.layers.LayerNormalization()
        self.drop = keras.layers.Dropout(0.2)
        self.head = keras.layers.Dense(1)

    def call(self, ids):
        return self.head(self.drop(self.norm(self.gru(self.lstm(self.embed(ids))))))


@pytest.mark.parametrize("reset_after", [True, False])
def test_lstm_and_gru_weights_are_copied_into_the_popnn_layouts(standin, reset_after):
    ids = np.random.default_rng(0).integers(0, 20, size=(4, 7))
    model = Recurrent(reset_after)
    converted = kip.convert_to_functional(model, ids, static_batch=True)
    passed = kip.apply_passes(converted, kip.ipu_replacements())
    kinds = {type(layer).__name__ for layer in passed.layers}
    assert {"PopnnLSTM", "PopnnGRU", "Embedding", "LayerNormalization", "Dropout"} <= kinds
    lstm = next(layer for layer in passed.layers if isinstance(layer, standin.addons.PopnnLSTM))
    np.testing.assert_array_equal(lstm.biases.numpy(), model.lstm.cell.bias.numpy())
    np.testing.assert_allclose(passed(ids), model(ids), atol=1e-5)


class Limited(keras.Model):
    def __init__(self, layer, sequence=False):
        super().__init__()
        self.embed = keras.layers.Embedding(20, 6)
        self.limited = layer
        self.sequence = sequence
        self.head = keras.layers.Dense(1)

    def call(self, ids):
        x = self.limited(self.embed(ids))
        return self.head(x if not self.sequence else x[:, -1])


@pytest.mark.parametrize("layer, sequence, static, message", [
    (keras.layers.Dropout(0.1, seed=3, name="limited"), True, True, "`limited`.*seed=3.*pair of int32"),
    (keras.layers.LayerNormalization(beta_regularizer="l2", name="limited"), True, True,
     "`limited`.*beta_regularizer"),
    (keras.layers.LayerNormalization(rms_scaling=True, name="limited"), True, True, "`limited`.*rms_scaling"),
    (keras.layers.LSTM(3, recurrent_dropout=0.1, name="limited"), False, True, "`limited`.*recurrent_dropout"),
    (keras.layers.GRU(3, activation="linear", name="limited"), False, True, "`limited`.*activation='linear'"),
    (keras.layers.LSTM(3, dropout=0.1, seed=5, name="limited"), False, True, "`limited`.*dropout_seed is a pair"),
    (keras.layers.LayerNormalization(name="limited"), True, False, "`limited`.*static shapes.*static_batch=True"),
])
def test_replacement_limits_raise_errors_that_name_the_layer(standin, layer, sequence, static, message):
    ids = np.random.default_rng(0).integers(0, 20, size=(4, 7))
    converted = kip.convert_to_functional(Limited(layer, sequence), ids, static_batch=static)
    with pytest.raises(kip.PassError, match=message):
        kip.apply_passes(converted, kip.ipu_replacements())


class MaskedLSTM(keras.Model):
    def __init__(self):
        super().__init__()
        self.embed = keras.layers.Embedding(20, 6, mask_zero=True, name="embedding")
        self.lstm = keras.layers.LSTM(3, name="lstm")

    def call(self, ids):
        return self.lstm(self.embed(ids))


def test_masks_and_mask_zero_are_refused_by_name(standin):
    ids = np.random.default_rng(0).integers(1, 20, size=(4, 7))
    ids[:, 5:] = 0
    converted = kip.convert_to_functional(MaskedLSTM(), ids, static_batch=True)
    with pytest.raises(kip.PassError, match="`embed`.*mask_zero"):
        kip.apply_passes(converted, kip.ipu_replacements())
    lstm_only = kip.passes.Replace({keras.layers.LSTM: kip.ipu_replacements()[0].mapping[keras.layers.LSTM]})
    with pytest.raises(kip.PassError, match="`lstm`.*receives a mask"):
        kip.apply_passes(converted, [type(kip.ipu_replacements()[0])(lstm_only.mapping)])


# -- 3. pipeline stages -------------------------------------------------------------------------


def _stage_calls(standin):
    return standin.recorder.named("set_pipeline_stage_assignment")


def test_stages_on_a_model_without_graphcores_pipeline_api_raise(standin):
    x, _ = _data()
    # Converted outside any IPUStrategy scope: Graphcore's Keras would not
    # have given the model its pipeline API (a Keras 3 model never has it).
    converted = kip.convert_to_functional(Tower(depth=2), x, static_batch=True)
    with pytest.raises(ValueError, match="get_pipeline_stage_assignment.*Keras 3 model never has it"):
        kip.apply_passes(converted, [kip.passes.PipelineStages([["block_0"], ["block_1"]])])


def test_stage_assignment_on_a_real_apply_passes_result_then_pipelining_options(standin):
    x, _ = _data()
    with kip.scope(gradient_accumulation_steps=4,
                   recomputation_mode="RecomputeAndBackpropagateInterleaved"):
        converted = kip.convert_to_functional(Tower(depth=2), x, static_batch=True)
        staged = kip.apply_passes(converted, [kip.passes.PipelineStages([["block_0"], ["block_1"]])])
    names = [call[0] for call in standin.recorder.calls]
    assert names.index("set_pipeline_stage_assignment") < names.index("set_pipelining_options")
    [(_, model_name, assigned)] = _stage_calls(standin)
    assert model_name == staged.name
    assert [stage for _, _, stage in assigned] == [
        staged.kip_layer_stages[name] for name, _, _ in assigned]
    assert {stage for _, _, stage in assigned} == {0, 1}
    [(_, _, options)] = standin.recorder.named("set_pipelining_options")
    modes = standin.ipu.pipelining_ops.RecomputationMode
    assert options == {"gradient_accumulation_steps_per_replica": 4, "device_mapping": None,
                       "recomputation_mode": modes.RecomputeAndBackpropagateInterleaved}


def test_pipelined_model_needs_gradient_accumulation_steps(standin):
    x, _ = _data()
    with kip.scope():
        converted = kip.convert_to_functional(Tower(depth=2), x, static_batch=True)
        with pytest.raises(ValueError, match="gradient_accumulation_steps"):
            kip.apply_passes(converted, [kip.passes.PipelineStages([["block_0"], ["block_1"]])])


def test_device_mapping_comes_from_kip_stage_devices(standin):
    x, _ = _data()
    with kip.scope(gradient_accumulation_steps=2, num_ipus=2):
        converted = kip.convert_to_functional(Tower(depth=3), x, static_batch=True)
        converted.kip_stage_devices = ["/device:IPU:1", 0]
        kip.apply_passes(converted, [kip.passes.PipelineStages([["block_0"], ["block_1"], ["block_2"]])])
        [(_, _, options)] = standin.recorder.named("set_pipelining_options")
        assert options["device_mapping"] == [1, 0, 1]
        converted.kip_stage_devices = ["/gpu:0"]
        with pytest.raises(ValueError, match="kip_stage_devices\\[0\\] = '/gpu:0' names no IPU"):
            kip.apply_passes(converted, [kip.passes.PipelineStages([["block_0"], ["block_1"]])])


class WithNested(keras.Model):
    def __init__(self, inner):
        super().__init__()
        self.stem = keras.layers.Dense(16, name="stem")
        self.inner = inner
        self.head = keras.layers.Dense(1, name="head")

    def call(self, x):
        return self.head(self.inner(self.stem(x)))


def test_a_nested_models_layers_take_the_stage_of_its_node(standin):
    x, _ = _data()
    with kip.scope(gradient_accumulation_steps=2):
        inputs = keras.Input((16,), batch_size=32)
        inner = keras.Model(inputs, keras.layers.Dense(16, name="inner_dense")(inputs), name="inner")
        converted = kip.convert_to_functional(WithNested(inner), x, static_batch=True)
        staged = kip.apply_passes(converted, [kip.passes.PipelineStages([["stem"], ["inner", "head"]])])
    [(_, _, assigned)] = _stage_calls(standin)
    nested = [entry for entry in assigned if isinstance(entry[2], list)]
    assert nested, assigned
    for name, _, inner_assignments in nested:
        assert {stage for _, _, stage in inner_assignments} == {staged.kip_layer_stages[name]} == {1}


class SharedTwice(keras.Model):
    def __init__(self):
        super().__init__()
        self.shared = keras.layers.Dense(8, name="shared")
        self.middle = keras.layers.Dense(8, name="middle")
        self.after = keras.layers.Dense(8, name="after")

    def call(self, x):
        # the second call of `shared` follows `after`, so it lands in stage 1
        return self.shared(self.after(self.middle(self.shared(x))))


def test_a_shared_layer_called_in_two_stages_is_refused(standin):
    x = np.ones((4, 8), "float32")
    with kip.scope(gradient_accumulation_steps=2):
        converted = kip.convert_to_functional(SharedTwice(), x, static_batch=True)
        with pytest.raises(ValueError, match="layer `shared` is called at .*stage 0.*stage 1"):
            kip.apply_passes(converted, [kip.passes.PipelineStages([["middle"], ["after"]])])


# -- 4. training under IPUStrategy ------------------------------------------------------------


def _dataset(n=32, batch=8, drop_remainder=True):
    x, y = _data(n)
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(batch, drop_remainder=drop_remainder)


def test_plugin_model_fit_hands_the_converted_model_to_graphcores_fit(standin):
    passes = [kip.passes.Outline(Block), kip.passes.Recompute(["block_0"])]
    with kip.scope(passes=passes, gradient_accumulation_steps=2):
        model = kip.PluginModel(Tower(depth=2), passes=passes)
        model.compile(optimizer="sgd", loss="mse", steps_per_execution=2)
    model.convert(_dataset())
    before = [v.numpy().copy() for v in model.wrapped.trainable_variables]
    history = model.fit(_dataset(), epochs=1, verbose=0)
    converted = model.converted
    assert all(not np.array_equal(b, v.numpy()) for b, v in zip(before, model.wrapped.trainable_variables))
    assert ("configure_ipu_system", {"allow_recompute": True, "auto_select_ipus": 1}) in standin.recorder.calls
    assert ("fit", converted.name) in standin.recorder.calls
    assert ("set_gradient_accumulation_options", converted.name,
            {"gradient_accumulation_steps_per_replica": 2}) in standin.recorder.calls
    assert standin.recorder.named("outlined_function") and standin.recorder.named("recomputation_checkpoint")
    assert converted.inputs[0].shape[0] == 8  # static batch
    assert model._kip_session.traces == 0  # the wrapper's own train function never ran
    assert np.isfinite(history.history["loss"]).all()
    assert "fit by Graphcore's Keras" in str(converted.kip_report)


class OwnStep(Tower):
    def train_step(self, data):
        return super().train_step(data)


def test_plugin_model_whose_model_overrides_train_step_is_refused(standin):
    with kip.scope():
        model = kip.PluginModel(OwnStep(depth=1))
        model.compile(optimizer="sgd", loss="mse")
    with pytest.raises(ValueError, match="overrides `train_step`.*RuntimeError"):
        model.fit(_dataset(), verbose=0)


def test_plugin_callback_is_refused_on_the_ipu(standin):
    with pytest.raises(ValueError, match="PluginCallback.*never reads model.train_function"):
        kip.PluginCallback()


def test_scope_refuses_models_graphcores_fit_would_train_without_the_plugin(standin):
    with pytest.raises(ValueError, match="kip.scope \\(model `tower.*never reads model.train_function"):
        with kip.scope(passes=[kip.passes.Expand()]):
            model = Tower(depth=1)
            model.compile(optimizer="sgd", loss="mse")


def test_partial_or_dynamic_batches_are_refused(standin):
    with kip.scope():
        model = kip.PluginModel(Tower(depth=1))
        model.compile(optimizer="sgd", loss="mse")
    with pytest.raises(ValueError, match="drop_remainder=True"):
        model.fit(_dataset(n=30, drop_remainder=False), verbose=0)
    x, y = _data(30)
    with pytest.raises(ValueError, match="30 rows do not split into batches of 8"):
        model.fit(x, y, batch_size=8, verbose=0)


def test_steps_per_execution_must_be_a_multiple_of_the_accumulation_steps(standin):
    with kip.scope(gradient_accumulation_steps=4):
        model = kip.PluginModel(Tower(depth=1))
        model.compile(optimizer="sgd", loss="mse", steps_per_execution=2)
    with pytest.raises(ValueError, match="steps_per_execution=2 is not a multiple of gradient_accumulation_steps=4"):
        model.fit(_dataset(), verbose=0)


def test_pipelined_plugin_model_fit_is_refused_with_the_reason(standin):
    with kip.scope(gradient_accumulation_steps=2):
        model = kip.PluginModel(Tower(depth=2), passes=[kip.passes.PipelineStages([["block_0"], ["block_1"]])])
        model.compile(optimizer="sgd", loss="mse", steps_per_execution=2)
    with pytest.raises(ValueError, match="pipelined.*refuses one whose `call` is overridden"):
        model.fit(_dataset(), verbose=0)
    # the stages did reach Graphcore's API when the passes ran
    assert _stage_calls(standin) and standin.recorder.named("set_pipelining_options")


def test_recompute_on_a_system_configured_without_allow_recompute_raises(standin):
    with kip.scope():  # no Recompute pass given to the scope: allow_recompute=False
        model = kip.PluginModel(Tower(depth=2), passes=[kip.passes.Recompute(["block_0"])])
        model.compile(optimizer="sgd", loss="mse")
    with pytest.raises(ValueError, match="allow_recompute=False"):
        model.fit(_dataset(), verbose=0)


# -- wiring of kip.scope -------------------------------------------------------------------------


def test_scope_configures_the_ipu_system_then_enters_an_ipu_strategy(standin):
    with kip.scope(num_ipus=2) as strategy:
        assert tf.distribute.get_strategy() is strategy
    assert isinstance(strategy, standin.ipu.ipu_strategy.IPUStrategyV1)
    names = [call[0] for call in standin.recorder.calls]
    assert names == ["configure_ipu_system", "IPUStrategy"]
    assert standin.recorder.calls[0][1] == {"allow_recompute": False, "auto_select_ipus": 2}
    with pytest.raises(ValueError, match="recomputation_mode='Sometimes'"):
        with kip.scope(recomputation_mode="Sometimes"):
            pass


def test_ipu_options_on_the_portable_backend_raise():
    assert kip.backend() == "portable"
    with pytest.raises(ValueError, match="gradient_accumulation_steps, num_ipus configure the IPU"):
        with kip.scope(num_ipus=2, gradient_accumulation_steps=4):
            pass


# -- the stand-in fails where the SDK would ---------------------------------------------------------


def test_standin_enforces_the_sdks_signatures(standin):
    ipu = standin.ipu
    with pytest.raises(TypeError, match="unexpected keyword argument 'maximum_num_reuses'"):
        ipu.outlined_function(lambda x: x, maximum_num_reuses=4)
    with pytest.raises(TypeError, match="argument 0 is a list"):
        ipu.outlined_function(lambda x: x)([tf.ones(2)])
    config = ipu.config.IPUConfig()
    with pytest.raises(ValueError, match="not a valid attribute"):
        config.allow_recomputation = True
    with pytest.raises(TypeError):
        config.allow_recompute = 1
    strategy = ipu.ipu_strategy.IPUStrategy()
    with pytest.raises(RuntimeError, match="not configured"):
        with strategy.scope():
            pass
    layers = standin.addons
    with pytest.raises(TypeError, match="serialization_factor"):
        layers.SerialDense(4)
    with pytest.raises(NotImplementedError, match="mask_zero"):
        layers.Embedding(10, 4, mask_zero=True)
    with pytest.raises(ValueError, match="recurrent_dropout"):
        layers.PopnnLSTM(4, recurrent_dropout=0.1)
    with pytest.raises(NotImplementedError, match="regularizer"):
        layers.LayerNormalization(beta_regularizer="l2")
