"""Tests of verification.

Verification must never report "equal" on data that cannot show a
difference: a first batch of NaN or of 0 rows, variables Keras cannot see,
zero gradients presented as a check of training. It must catch a small real
difference in any output (the last one too, integers too), cost no more
than a training step (a few rows of the batch where that is the same
computation), say in the report what it compared, and guard `apply_passes`
as it guards conversion.
"""

import json
from types import SimpleNamespace

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_ipu_plugin as kip
import models as zoo  # tests/models.py (tests/ is on sys.path under pytest)
from keras_ipu_plugin.passes import Expand
from keras_ipu_plugin.passes import Replace
from keras_ipu_plugin.passes import Replacement
from keras_ipu_plugin.passes.infra.base import Pass
from keras_ipu_plugin.passes.infra.base import matched_nodes


def _rand(*shape, seed=0):
    return np.random.RandomState(seed).normal(size=shape).astype("float32")


def verify_rows(model):
    """The report rows that verification added."""
    return [e for e in model.kip_report.entries if e.step == "verify"]


class TwoFaced(keras.Model):
    """Computes something else when traced than when run: the converted
    model differs from the original, which verification exists to catch."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(2)

    def call(self, inputs):
        y = self.dense(inputs)
        if isinstance(inputs, keras.KerasTensor):
            return y * 2.0
        return y


class Plain(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(3)

    def call(self, inputs):
        return self.dense(inputs)


# -- batches that cannot show a difference ----------------------------------------
def test_a_first_batch_whose_every_row_holds_nan_is_refused_not_verified():
    x = _rand(8, 3)
    x[:, 1] = np.nan
    with pytest.raises(kip.InputDataError, match=r"every row of input `x` contains NaN"):
        kip.convert_to_functional(TwoFaced(), x)


def test_a_dict_batch_without_a_finite_row_names_the_inputs():
    x = {"a": _rand(4, 3), "b": _rand(4, 3, seed=1)}
    x["a"][:2, 0] = np.nan
    x["b"][2:, 0] = np.inf
    a, b = keras.Input((3,), name="a"), keras.Input((3,), name="b")
    model = keras.Model({"a": a, "b": b}, keras.layers.Add()([a, b]))
    with pytest.raises(kip.InputDataError, match=r"`a` has NaN or Inf in rows 0, 1.*`b`.*2, 3"):
        kip.frontend.verify.equivalence.check_equivalent(model, model, x)


def test_a_first_batch_with_zero_rows_is_refused_not_verified():
    with pytest.raises(kip.InputDataError, match="0 rows"):
        kip.convert_to_functional(TwoFaced(), _rand(0, 3))


def test_nan_rows_are_left_out_and_the_rest_verified():
    x = _rand(8, 3)
    x[3, 1] = np.nan
    converted = kip.convert_to_functional(Plain(), x)  # was: tolerance NaN, refused
    (row,) = verify_rows(converted)
    assert "rows 3 left out" in row.detail
    # The finite rows still show a real difference.
    with pytest.raises(kip.ConversionError, match="output"):
        kip.convert_to_functional(TwoFaced(), x)


class NanOutput(keras.Model):
    """Finite inputs, NaN outputs on every row: log of a negative number."""

    def __init__(self, traced_factor=2.0, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(2)
        self.traced_factor = traced_factor

    def call(self, inputs):
        y = -keras.ops.abs(self.dense(inputs)) - 1.0
        if isinstance(inputs, keras.KerasTensor):
            y = y * self.traced_factor  # the converted model differs
        return keras.ops.log(y)


def test_outputs_that_are_nan_on_every_row_are_refused_not_compared_equal():
    with pytest.raises(kip.InputDataError, match=r"output `output` holds NaN or Inf on every row"):
        kip.convert_to_functional(NanOutput(), _rand(6, 3))


def test_nan_where_the_original_is_finite_is_a_mismatch():
    inputs = keras.Input((3,))
    dense = keras.layers.Dense(2)
    original = keras.Model(inputs, dense(inputs))
    poisoned = keras.Model(inputs, keras.layers.Lambda(
        lambda y: y * np.array([1.0, np.nan], "float32"))(dense(inputs)))
    with pytest.raises(kip.ConversionError, match=r"NaN in one and not in the other"):
        kip.frontend.verify.equivalence.check_equivalent(original, poisoned, _rand(4, 3), gradients=False)


# -- variables Keras cannot see ---------------------------------------------------
class RawVariable(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(3)
        self.scale = tf.Variable(tf.ones((3, 3)), name="raw_scale")  # Keras 3 ignores it

    def call(self, inputs):
        return tf.matmul(self.dense(inputs), self.scale)


class HiddenLayer(keras.Model):
    """A layer kept inside an object Keras does not look into."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(3)
        self.holder = SimpleNamespace(head=keras.layers.Dense(2))

    def call(self, inputs):
        return self.holder.head(self.dense(inputs))


class ForeignModule(tf.Module):
    """A module from another framework: TensorFlow variables, no Keras."""

    def __init__(self):
        super().__init__()
        self.w = tf.Variable(tf.random.normal((3, 2), seed=1), name="foreign_w")

    def __call__(self, x):
        return tf.matmul(x, self.w)


class WrapsForeign(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(3)
        self.foreign = {"module": ForeignModule()}

    def call(self, inputs):
        return self.foreign["module"](self.dense(inputs))


class RawVariableCell(keras.layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.tau = tf.Variable(tf.ones((3,)), name="raw_tau")  # Keras 3 ignores it

    def call(self, inputs):
        return inputs * self.tau


class InFunctional(keras.Model):
    """The cell inside a functional sub-model: its path goes through the
    sub-model's layers, not Keras's private `_layers` list."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        inputs = keras.Input((3,))
        self.body = keras.Model(inputs, RawVariableCell(name="cell")(keras.layers.Dense(3)(inputs)))

    def call(self, inputs):
        return self.body(inputs)


def _functional_given_as_it_is():
    """A functional model converted itself: its layers are named as its
    graph's nodes are, by name, or by class where Keras named them."""
    inputs = keras.Input((3,))
    return keras.Model(inputs, RawVariableCell()(keras.layers.Dense(3)(inputs)))


def _sequential_given_as_it_is():
    return keras.Sequential([keras.Input((3,)), keras.layers.Dense(3), RawVariableCell()])


class HoldsASequential(keras.Model):
    """A Sequential inside a list: its Keras-named layers by position, as
    the graph's node paths name them (`parts.0.1`)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.parts = [_sequential_given_as_it_is()]

    def call(self, inputs):
        return self.parts[0](inputs)


@pytest.mark.parametrize("model_class, named", [
    (RawVariable, r"`scale` \(tf.Variable 'raw_scale:0'\)"),
    (InFunctional, r"`body.cell.tau` \(tf.Variable 'raw_tau:0'\)"),
    (_functional_given_as_it_is, r"`raw_variable_cell.tau` \(tf.Variable 'raw_tau:0'\)"),
    (_sequential_given_as_it_is, r"`raw_variable_cell.tau` \(tf.Variable 'raw_tau:0'\)"),
    (HoldsASequential, r"`parts.0.1.tau` \(tf.Variable 'raw_tau:0'\)"),
    (HiddenLayer, r"`holder.head.\w*kernel`"),
    (WrapsForeign, r"`foreign.module.w` \(tf.Variable 'foreign_w:0'\)"),
])
def test_variables_keras_does_not_track_are_refused_by_name(model_class, named):
    model = model_class()
    x = _rand(4, 3)
    model(x)
    before = [np.array(v.numpy()) for v in model.weights]
    with pytest.raises(kip.ConversionError, match="does not track") as info:
        kip.convert_to_functional(model, x)
    assert __import__("re").search(named, str(info.value)), str(info.value)
    for variable, value in zip(model.weights, before):
        np.testing.assert_array_equal(variable.numpy(), value)


class NormalizationOnly(keras.Model):
    def __init__(self, norm, **kwargs):
        super().__init__(**kwargs)
        self.norm = norm

    def call(self, inputs):
        return self.norm(inputs)


class StoppedGradient(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(2)

    def call(self, inputs):
        return keras.ops.stop_gradient(self.dense(inputs))


def test_zero_compared_gradients_convert_and_the_report_says_so():
    x = _rand(8, 3)
    norm = keras.layers.Normalization()
    norm.adapt(x)
    converted = kip.convert_to_functional(NormalizationOnly(norm), x)
    (row,) = verify_rows(converted)
    assert row.action == "outputs equal"
    assert "gradients of 0 of 0 trainable variable(s)" in row.detail
    assert "the model has no trainable variable" in row.detail
    converted = kip.convert_to_functional(StoppedGradient(), x)
    (row,) = verify_rows(converted)
    assert row.action == "outputs equal"
    assert "gradients of 0 of 2 trainable variable(s)" in row.detail
    assert "no float output depends on a trainable variable" in row.detail


# -- a small real difference is caught -----------------------------------------------
def _mlp_and_twin(factor):
    """A functional model and one over the same layers whose output is
    `factor` times larger (a graph that is `factor - 1` off)."""
    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(8, activation="tanh")(inputs)
    head = keras.layers.Dense(3)
    outputs = head(hidden)
    original = keras.Model(inputs, outputs)
    twin = keras.Model(inputs, keras.layers.Rescaling(factor)(outputs))
    return original, twin


def test_an_output_half_a_percent_off_is_rejected():
    """Fails if the tolerance is made 100 times looser (rtol 1e-2 admits
    0.5%)."""
    original, twin = _mlp_and_twin(1.005)
    with pytest.raises(kip.ConversionError, match=r"output `output` differs"):
        kip.frontend.verify.equivalence.check_equivalent(original, twin, _rand(8, 6), gradients=False)


class GradientSkew(keras.Model):
    """Same value as its dense layer, gradient `factor` times larger."""

    def __init__(self, dense, factor, **kwargs):
        super().__init__(**kwargs)
        self.dense = dense
        self.factor = factor

    def call(self, inputs):
        y = self.dense(inputs)
        return self.factor * y - (self.factor - 1.0) * keras.ops.stop_gradient(y)


def test_a_gradient_half_a_percent_off_is_rejected():
    dense = keras.layers.Dense(3)
    x = _rand(8, 4)
    plain, skewed = GradientSkew(dense, 1.0), GradientSkew(dense, 1.005)
    plain(x)
    with pytest.raises(kip.ConversionError, match=r"gradient w.r.t. variable .*kernel"):
        kip.frontend.verify.equivalence.check_equivalent(plain, skewed, x)


def _three_outputs(last):
    """Three outputs over shared layers; `last(y)` makes the last one."""
    inputs = keras.Input((4,))
    y = keras.layers.Dense(5)(inputs)
    first = keras.layers.Dense(2)(y)
    second = keras.layers.Activation("tanh")(y)
    return inputs, y, [first, second, last(y)]


@pytest.mark.parametrize("kind", ["shifted", "int", "bool"])
def test_a_difference_in_the_last_of_several_outputs_is_rejected(kind):
    makers = {
        "shifted": (lambda y: keras.layers.Activation("linear")(y),
                    lambda y: keras.layers.Lambda(lambda t: t + 0.5)(y)),
        "int": (lambda y: keras.layers.Lambda(lambda t: keras.ops.argmax(t, axis=-1))(y),
                lambda y: keras.layers.Lambda(lambda t: keras.ops.argmin(t, axis=-1))(y)),
        "bool": (lambda y: keras.layers.Lambda(lambda t: t > 0.0)(y),
                 lambda y: keras.layers.Lambda(lambda t: t <= 0.0)(y)),
    }
    same, different = makers[kind]
    inputs, y, outputs = _three_outputs(same)
    original = keras.Model(inputs, outputs)
    other = keras.Model(inputs, outputs[:2] + [different(y)])
    x = _rand(16, 4)
    kip.frontend.verify.equivalence.check_equivalent(original, keras.Model(inputs, outputs), x)
    with pytest.raises(kip.ConversionError, match=r"output `2` differs"):
        kip.frontend.verify.equivalence.check_equivalent(original, other, x)


# -- tolerances follow the dtype the layers compute in ---------------------------------
@pytest.fixture
def dtype_policy(request):
    """The global dtype policy `request.param` for the test, float32 after."""
    keras.config.set_dtype_policy(request.param)
    try:
        yield request.param
    finally:
        keras.config.set_dtype_policy("float32")


@pytest.mark.parametrize("dtype_policy", ["mixed_float16", "mixed_bfloat16"], indirect=True)
def test_a_real_difference_is_still_refused_under_mixed_precision(dtype_policy):
    """Under a mixed policy the tolerance is float16's or bfloat16's (an
    output a tenth of a percent off, a unit in their last place, is
    accepted), not none: an output 20% off, a gradient 20% off, a pass that swaps tanh for
    sigmoid are refused, and the message names the tolerance and the policy."""
    compute_dtype = keras.mixed_precision.Policy(dtype_policy).compute_dtype
    # A tenth of a percent is rounding in half precision: accepted (bfloat16
    # outputs were compared exactly, as if they were integers).
    original, twin = _mlp_and_twin(1.001)
    kip.frontend.verify.equivalence.check_equivalent(original, twin, _rand(8, 6), gradients=False)
    original, twin = _mlp_and_twin(1.2)
    with pytest.raises(kip.ConversionError, match=r"output `output` differs") as info:
        kip.frontend.verify.equivalence.check_equivalent(original, twin, _rand(8, 6), gradients=False)
    assert (f"the tolerance for {compute_dtype} computation, dtype policy `{dtype_policy}`"
            in str(info.value))
    assert "allowed: " in str(info.value)

    dense = keras.layers.Dense(3)
    x = _rand(8, 4)
    plain, skewed = GradientSkew(dense, 1.0), GradientSkew(dense, 1.2)
    plain(x)
    with pytest.raises(kip.ConversionError, match=r"gradient w.r.t. variable .*kernel"):
        kip.frontend.verify.equivalence.check_equivalent(plain, skewed, x)

    converted = kip.convert_to_functional(WithBlock(), _rand(8, 4))
    with pytest.raises(kip.PassError, match=rf"after pass SwapActivation: .*{dtype_policy}"):
        kip.apply_passes(converted, [Expand(), SwapActivation("block_act")])


@pytest.mark.parametrize("dtype_policy, expected", [
    ("float64", "float64"), ("float32", "float32"), ("mixed_float16", "float16"),
    ("mixed_bfloat16", "bfloat16"),
], indirect=["dtype_policy"])
def test_the_tolerance_follows_the_least_precise_compute_dtype(dtype_policy, expected):
    """A model computing in float64 is held to float64's tolerance, one
    with a float16 layer among float32 ones to float16's."""
    original, twin = _mlp_and_twin(1.0)
    tolerance = kip.frontend.verify.compare.tolerance_for(original, twin)
    assert tolerance.dtype == expected
    if dtype_policy == "float32":
        keras.config.set_dtype_policy("mixed_float16")
        half = keras.Sequential([keras.Input((6,)), keras.layers.Dense(3, dtype="float32"),
                                 keras.layers.Dense(3)])
        assert kip.frontend.verify.compare.tolerance_for(half).dtype == "float16"


@pytest.mark.parametrize("dtype_policy", ["float64"], indirect=True)
def test_a_float64_model_is_held_to_float64_rounding(dtype_policy):
    """An output a millionth off is within float32's tolerance, but far
    outside what float64 computation rounds to: refused."""
    original, twin = _mlp_and_twin(1.0 + 1e-6)
    with pytest.raises(kip.ConversionError, match=r"for float64 computation"):
        kip.frontend.verify.equivalence.check_equivalent(original, twin, _rand(8, 6), gradients=False)
    keras.config.set_dtype_policy("float32")
    original, twin = _mlp_and_twin(1.0 + 1e-6)
    kip.frontend.verify.equivalence.check_equivalent(original, twin, _rand(8, 6), gradients=False)


# -- cost: a few rows where that is the same computation ----------------------------------
class RecordsBatchSizes(keras.layers.Layer):
    """Records the batch size of every eager call (the traced graph does not)."""

    def __init__(self, sizes, **kwargs):
        super().__init__(**kwargs)
        self.note_size = sizes.append  # a list attribute would be copied by Keras

    def call(self, inputs):
        if not isinstance(inputs, keras.KerasTensor) and tf.executing_eagerly():
            self.note_size(int(inputs.shape[0]))
        return inputs


class Recording(keras.Model):
    def __init__(self, sizes, mix_rows=False, **kwargs):
        super().__init__(**kwargs)
        self.record = RecordsBatchSizes(sizes)
        self.dense = keras.layers.Dense(3)
        self.mix_rows = mix_rows

    def call(self, inputs):
        y = self.dense(self.record(inputs))
        if self.mix_rows:  # inference mode too: rows depend on each other
            y = y - keras.ops.mean(y, axis=0, keepdims=True)
        return y


def test_verification_differentiates_a_few_rows_when_rows_are_independent():
    sizes = []
    model = Recording(sizes)
    x = _rand(32, 4)
    model(x)
    del sizes[:]
    converted = kip.convert_to_functional(model, x)
    # A probe of twice the verified rows forward once (the original, no
    # tape: it shows those rows compute as in a batch), then 1/8 of the
    # batch through each model with gradients, then the same rows through
    # each model in a training step (forward only); never the whole batch.
    assert sizes == [8, 4, 4, 4, 4]
    (row,) = verify_rows(converted)
    assert row.detail.startswith("4 of 32 rows")


def test_verification_uses_the_whole_batch_when_rows_depend_on_each_other():
    sizes = []
    converted = kip.convert_to_functional(Recording(sizes, mix_rows=True), _rand(32, 4))
    (row,) = verify_rows(converted)
    assert row.detail.startswith("32 of 32 rows")
    assert "depend on the other rows" in row.detail


BATCH = 16  # a module constant, as keras.io's Switch Transformer writes its batch size


class ConstantBatchRouter(keras.layers.Layer):
    """Flattens the batch's tokens with the batch size written as a constant:
    runs on a batch of BATCH rows only."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(8)

    def call(self, inputs):
        tokens = keras.ops.reshape(self.dense(inputs), (BATCH * 4, 8))
        return keras.ops.reshape(keras.ops.relu(tokens), (BATCH, -1, 8))


class ConstantBatch(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.router = ConstantBatchRouter()
        self.head = keras.layers.Dense(1)

    def call(self, inputs):
        return self.head(keras.ops.mean(self.router(inputs), axis=1))


def test_a_batch_size_written_as_a_constant_is_verified_on_the_whole_batch():
    # Was refused: "the original model fails on the batch", when it failed on
    # the rows verification chose.
    x = _rand(BATCH, 4, 3)
    model = ConstantBatch()
    converted = kip.convert_to_functional(model, x)
    (row,) = verify_rows(converted)
    assert row.detail.startswith(f"{BATCH} of {BATCH} rows")
    assert "the original fails on 4 of the 16 rows" in row.detail
    np.testing.assert_allclose(converted(x), model(x), rtol=1e-6)
    passed = kip.apply_passes(converted, [Expand()])  # verified on the kept batch alike
    assert verify_rows(passed)[-1].detail.startswith(f"{BATCH} of {BATCH} rows")


@pytest.mark.parametrize("entry", ["model", "callback"])
def test_a_batch_size_written_as_a_constant_trains_through_the_plugin_as_plain_fit(entry):
    x, y = _rand(3 * BATCH, 4, 3), _rand(3 * BATCH, 1, seed=1)

    def fit(entry):
        keras.utils.set_random_seed(0)
        model, callbacks = ConstantBatch(), []
        model(x[:BATCH])
        if entry == "model":
            model = kip.PluginModel(model)
        elif entry == "callback":
            callbacks = [kip.PluginCallback()]
        model.compile(optimizer="sgd", loss="mse")
        model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=callbacks)
        return [v.numpy() for v in model.weights]

    for actual, expected in zip(fit(entry), fit("plain")):
        np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-6)


def test_a_model_that_fails_on_the_whole_batch_is_still_refused_as_failing():
    model = ConstantBatch()
    converted = kip.convert_to_functional(model, _rand(BATCH, 4, 3))
    with pytest.raises(kip.InputDataError, match="the original model `.*` fails on the batch"):
        kip.frontend.verify.equivalence.check_equivalent(model, converted, _rand(2 * BATCH, 4, 3))


class GraphModeOnly(keras.layers.Layer):
    """Runs in graph mode only, as an op with no eager kernel does (the
    channels-first Conv2D on a CPU that once failed eagerly; on this TensorFlow with oneDNN
    it runs eagerly too, so the missing kernel is written out): plain `fit`
    trains it, since it runs the step in a `tf.function`."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(3)

    def call(self, inputs):
        if tf.executing_eagerly() and not isinstance(inputs, keras.KerasTensor):
            raise tf.errors.UnimplementedError(None, None, "no eager kernel for this op")
        return self.dense(inputs)


class WithGraphModeOnly(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.block = GraphModeOnly()
        self.norm = keras.layers.BatchNormalization()
        self.head = keras.layers.Dense(1)

    def call(self, inputs, training=None):
        return self.head(self.norm(self.block(inputs), training=training))


def _built_in_graph_mode(model, x):
    tf.function(lambda t: model(t))(tf.constant(x))
    return model


@pytest.mark.parametrize("built", [True, False], ids=["built", "unbuilt"])
def test_a_model_that_runs_in_graph_mode_only_converts_verified_in_graph_mode(built):
    # Was refused: "the original model fails on the batch" (verification ran
    # it eagerly, fit does not).
    x = _rand(32, 4)
    model = WithGraphModeOnly()
    if built:
        _built_in_graph_mode(model, x)
    converted = kip.convert_to_functional(model, x)
    (row,) = verify_rows(converted)
    assert row.detail.startswith("4 of 32 rows")  # still a few rows
    assert "verified in graph mode, as fit runs the model: it fails eagerly" in row.detail
    run = lambda m: tf.function(lambda t: m(t, training=False))(tf.constant(x))  # noqa: E731
    np.testing.assert_allclose(run(converted), run(model), rtol=1e-6)
    passed = kip.apply_passes(converted, [Expand()])
    assert "verified in graph mode" in verify_rows(passed)[-1].detail


def test_a_model_that_runs_in_graph_mode_only_trains_through_the_plugin_as_plain_fit():
    x, y = _rand(32, 4), _rand(32, 1, seed=1)

    def fit(entry):
        keras.utils.set_random_seed(0)
        model = _built_in_graph_mode(WithGraphModeOnly(), x)
        callbacks = []
        if entry == "model":
            model = kip.PluginModel(model)
        elif entry == "callback":
            callbacks = [kip.PluginCallback()]
        model.compile(optimizer="sgd", loss="mse")
        history = model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0,
                            callbacks=callbacks)
        return history.history["loss"], [v.numpy() for v in model.weights]

    losses, weights = fit("plain")
    for entry in ("model", "callback"):
        entry_losses, entry_weights = fit(entry)
        np.testing.assert_allclose(entry_losses, losses, rtol=1e-5, err_msg=entry)
        for actual, expected in zip(entry_weights, weights):
            np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-6, err_msg=entry)


def test_a_model_compiled_to_run_eagerly_is_verified_eagerly():
    # run_eagerly=True trains it eagerly, where it fails: so does verification.
    x = _rand(16, 4)
    model = _built_in_graph_mode(WithGraphModeOnly(), x)
    model.compile(optimizer="sgd", loss="mse", run_eagerly=True)
    with pytest.raises(kip.InputDataError, match="fails on the batch.*no eager kernel"):
        kip.convert_to_functional(model, x)


class DropsTheRowMixing(Recording):
    """The original mixes rows (so it is verified on the whole batch); its
    trace does not."""

    def call(self, inputs):
        y = self.dense(self.record(inputs))
        if isinstance(inputs, keras.KerasTensor):
            return y
        return y - 0.01 * keras.ops.mean(y, axis=0, keepdims=True)


def test_a_converted_model_that_drops_a_mix_of_rows_is_still_rejected():
    with pytest.raises(kip.ConversionError, match="differs"):
        kip.convert_to_functional(DropsTheRowMixing([]), _rand(32, 4))


# -- the report -------------------------------------------------------------------------
def test_the_report_says_what_verification_compared():
    model, x = zoo.make_dict_model(batch=16)
    converted = kip.convert_to_functional(model, x)
    (row,) = verify_rows(converted)
    assert row.layer == model.name
    assert row.action == "outputs and gradients equal"
    count = len(model.trainable_variables)
    assert row.detail.startswith("2 of 16 rows; 2 output(s), max difference ")
    assert f"gradients of {count} of {count} trainable variable(s), max difference " in row.detail
    assert "verify" in str(converted.kip_report)


@pytest.mark.parametrize("columns", [60, 200])
def test_the_report_follows_the_terminal_width(monkeypatch, columns):
    """Was 140 columns whatever the terminal."""
    monkeypatch.setenv("COLUMNS", str(columns))
    report = kip.Report()
    report.add("convert", "layer", "traced", "a detail " * 40)
    printed = []
    model = kip.convert_to_functional(Plain(), _rand(4, 3))
    model.kip_report = report
    kip.summary(model, print_fn=printed.append)
    for text in (str(report), printed[-1]):
        width = max(len(line) for line in text.splitlines())
        assert columns - 5 <= width <= columns


# -- apply_passes is verified ---------------------------------------------------------------
class SwapActivation(Pass):
    """A faulty pass of one's own: it claims (by default) to keep the model
    the same, but swaps a tanh for a sigmoid."""

    step = "swap"

    def __init__(self, target):
        self.target = target

    def run(self, graph, report):
        for node in matched_nodes(graph, [self.target], self.step):
            node.operation = keras.layers.Activation("sigmoid", name=node.name + "_swapped")
            node.made_by_pass = True
            report.add(self.step, node.name, "swapped")
        return graph


def _functional_with_activation():
    inputs = keras.Input((4,))
    y = keras.layers.Dense(5, name="dense")(inputs)
    y = keras.layers.Activation("tanh", name="act")(y)
    return keras.Model(inputs, keras.layers.Dense(2, name="head")(y))


class Block(keras.layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(5)
        self.act = keras.layers.Activation("tanh", name="block_act")

    def call(self, inputs):
        return self.act(self.dense(inputs))


class WithBlock(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.block = Block(name="block")
        self.head = keras.layers.Dense(2, name="head")

    def call(self, inputs):
        return self.head(self.block(inputs))


def test_apply_passes_rejects_a_pass_whose_result_differs():
    converted = kip.convert_to_functional(WithBlock(), _rand(8, 4))
    with pytest.raises(kip.PassError, match=r"after pass SwapActivation: .*output") as info:
        kip.apply_passes(converted, [Expand(), SwapActivation("block_act")])
    assert "Expand" not in str(info.value).split(":")[1]  # the first failing pass only
    passed = kip.apply_passes(converted, [Expand(), SwapActivation("block_act")], verify=False)
    assert passed is not None


def test_apply_passes_verifies_outputs_and_gradients_and_keeps_the_first_batch():
    x = _rand(16, 4)
    converted = kip.convert_to_functional(WithBlock(), x)
    assert converted.kip_first_batch is not None
    assert "kip_first_batch" not in json.dumps(converted.get_config(), default=str)
    passed = kip.apply_passes(converted, [Expand()])
    np.testing.assert_array_equal(passed.kip_first_batch, x)
    row = verify_rows(passed)[-1]
    count = len(converted.trainable_variables)
    assert row.action == "outputs and gradients equal"
    assert f"gradients of {count} of {count}" in row.detail


class BakedBatch(keras.layers.Dense):
    """Reshapes to a batch size baked in: works on the 2-row batch Replace
    builds it with, fails on the real one."""

    def call(self, inputs):
        return keras.ops.reshape(super().call(inputs), (2, self.units))


def test_apply_passes_names_the_layer_where_the_passed_model_fails():
    converted = kip.convert_to_functional(WithBlock(), _rand(8, 4))
    replace = Replace({"head": Replacement(BakedBatch, params={"name": "baked_head"})})
    with pytest.raises(kip.PassError, match=r"after pass Replace: .*fails .*`baked_head`"):
        kip.apply_passes(converted, [replace])


class Doubled(keras.layers.Dense):
    def call(self, inputs):
        return 2.0 * super().call(inputs)


def test_replace_without_copied_weights_only_has_to_run():
    converted = kip.convert_to_functional(WithBlock(), _rand(8, 4))
    passed = kip.apply_passes(converted, [Replace({"head": Replacement(Doubled)})])
    row = verify_rows(passed)[-1]
    assert row.action == "runs"
    assert "outputs not compared: Replace" in row.detail


def test_replace_with_copied_weights_is_compared_except_the_replaced_variables():
    x = _rand(8, 4)
    model = WithBlock()
    model(x)
    model.head.bias.assign(np.array([0.5, -0.25], "float32"))  # trained-like bias
    converted = kip.convert_to_functional(model, x)
    passed = kip.apply_passes(
        converted, [Replace({"head": Replacement(keras.layers.Dense, copy_weights=True)})])
    row = verify_rows(passed)[-1]
    assert row.action == "outputs and gradients equal"
    kept = len(converted.trainable_variables) - 2
    assert f"gradients of {kept} of {kept}" in row.detail
    assert "2 variable(s) of replaced layers not compared" in row.detail


def test_a_users_functional_model_is_verified_on_a_synthetic_batch():
    model = _functional_with_activation()
    passed = kip.apply_passes(model, [Expand()])
    row = verify_rows(passed)[-1]
    assert "on a synthetic batch" in row.detail
    with pytest.raises(kip.PassError, match="SwapActivation"):
        kip.apply_passes(model, [SwapActivation("act")])


def test_a_string_input_without_a_kept_batch_is_reported_not_verified():
    inputs = keras.Input((1,), dtype="string")
    lookup = keras.layers.StringLookup(vocabulary=["a", "b"])
    model = keras.Model(inputs, keras.layers.Dense(2)(
        keras.layers.Lambda(lambda t: keras.ops.cast(t, "float32"))(lookup(inputs))))
    passed = kip.apply_passes(model, [Expand()])
    row = verify_rows(passed)[-1]
    assert row.action == "not verified"
    assert "string" in row.detail


def test_a_model_with_a_fixed_batch_size_is_verified_on_the_whole_batch():
    converted = kip.convert_to_functional(Plain(), _rand(16, 3), static_batch=True)
    assert converted.inputs[0].shape[0] == 16
    (row,) = verify_rows(converted)
    assert row.detail.startswith("16 of 16 rows")


class Lookup(keras.Model):
    """An embedding and a head; `twisted` doubles the embedding gradient on
    the rows it reads and keeps the outputs."""

    def __init__(self, embedding, head, twisted=False, **kwargs):
        super().__init__(**kwargs)
        self.embedding = embedding
        self.head = head
        self.twisted = twisted

    def call(self, ids):
        e = self.embedding(ids)
        if self.twisted:
            e = 2.0 * e - keras.ops.stop_gradient(e)
        return self.head(e)


def test_a_sparse_embedding_gradient_is_compared_on_the_rows_it_touches():
    ids = np.random.RandomState(0).randint(0, 50, (16, 5)).astype("int32")
    embedding, head = keras.layers.Embedding(50, 4), keras.layers.Dense(1)
    model = Lookup(embedding, head)
    model(ids)
    verification = kip.frontend.verify.equivalence.check_equivalent(model, model, ids)
    assert verification.gradients == 3
    with pytest.raises(kip.ConversionError, match=r"gradient w.r.t. variable .*embeddings"):
        kip.frontend.verify.equivalence.check_equivalent(model, Lookup(embedding, head, twisted=True), ids)


class FreezeDense(Pass):
    """A faulty pass of one's own: puts a same-valued copy of a Dense in
    place of the original, as if its variables had become constants."""

    step = "freeze"

    def __init__(self, target):
        self.target = target

    def run(self, graph, report):
        for node in matched_nodes(graph, [self.target], self.step):
            old = node.operation
            new = keras.layers.Dense(old.units, name=old.name + "_frozen", trainable=False)
            new.build(old.kernel.shape[:1])
            new.set_weights(old.get_weights())
            node.operation = new
            node.made_by_pass = True
        return graph


def test_a_pass_that_drops_a_variable_the_outputs_depend_on_is_rejected():
    converted = kip.convert_to_functional(WithBlock(), _rand(8, 4))
    with pytest.raises(kip.PassError,
                       match=r"FreezeDense.*gradient w.r.t. variable `.*head/kernel` is missing"):
        kip.apply_passes(converted, [FreezeDense("head")])


class WrongShape(Pass):
    """A faulty pass of one's own: puts a Dense built for another input
    width in place of the head."""

    step = "wrong_shape"

    def run(self, graph, report):
        for node in matched_nodes(graph, ["head"], self.step):
            wrong = keras.layers.Dense(2, name="wrong_head")
            wrong.build((None, 7))
            node.operation = wrong
            node.made_by_pass = True
        return graph


def test_a_graph_that_cannot_be_rebuilt_is_a_pass_error():
    """Was Keras's own error from inside the rebuild."""
    with pytest.raises(kip.PassError, match=r"after WrongShape cannot be rebuilt.*wrong_head"):
        kip.apply_passes(_functional_with_activation(), [WrongShape()])


class LogOfFirstFeature(keras.Model):
    """NaN output on the rows whose first feature is negative."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(2)

    def call(self, inputs):
        return self.dense(inputs) * keras.ops.log(inputs[:, :1])


@pytest.mark.parametrize("rows", [2, 32])  # the whole batch, a few of its rows
def test_rows_whose_original_outputs_are_nan_are_left_out_and_named(rows):
    x = np.abs(_rand(rows, 3)) + 0.5
    nan_row = 1 if rows == 2 else 4  # of 32: one the probe of 8 rows holds
    x[nan_row, 0] = -1.0
    converted = kip.convert_to_functional(LogOfFirstFeature(), x)
    (row,) = verify_rows(converted)
    assert (f"rows {nan_row} left out: the original's output `output` holds NaN or Inf "
            "there") in row.detail
    assert row.action == "outputs and gradients equal"


class Float64Dense(keras.layers.Dense):
    """Computes what Dense does, to float32 precision, but hands on float64."""

    def call(self, x):
        return keras.ops.cast(super().call(x), "float64")


def test_a_pass_changing_an_output_dtype_is_refused_even_with_equal_values():
    inputs = keras.Input((3,))
    model = keras.Model(inputs, keras.layers.Dense(2, name="dense")(inputs))
    x = np.random.RandomState(0).normal(size=(4, 3)).astype("float32")
    converted = kip.convert_to_functional(model, x)
    replace = kip.passes.Replace({"dense": kip.passes.Replacement(Float64Dense, copy_weights=True)})
    with pytest.raises(kip.PassError, match="dtype float64 in the passed model and float32"):
        kip.apply_passes(converted, [replace])
