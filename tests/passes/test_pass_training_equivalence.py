"""Every pass leaves training identical to plain Keras.

Gradient values alone do not show it: an optimizer also sees whether a
gradient is sparse (`tf.IndexedSlices`, from an embedding lookup) or missing
(`None`, for a variable the forward pass never reads), and Adam / AdamW act
differently on each. So these tests train an identical twin with plain Keras
and through `PluginModel` with each pass, and compare the *weights* after
several optimizer steps; and they do so under every mixed precision policy,
with and without `jit_compile`.

Graph optimisers may round differently on either side of a function
boundary (an outlined body): Grappler's arithmetic optimizer reassociates
sums (float32 weights 2e-7 apart after four steps), and under `jit_compile`
XLA keeps values in more precision than bfloat16 / float16 where it fuses
ops (weights 2e-2 apart, as Adam amplifies an ulp of bfloat16). The weights
are compared to `ATOL`, 1e-5, far below what a wrong pass does (1e-3 to
3e-2 here), and `conftest.py` turns XLA's excess precision off
(`--xla_allow_excess_precision=false`, read once when XLA starts).
"""

import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_ipu_plugin as kip
from keras_ipu_plugin.passes import Expand
from keras_ipu_plugin.passes import Outline
from keras_ipu_plugin.passes import PipelineStages
from keras_ipu_plugin.passes import Recompute
from keras_ipu_plugin.passes import Replace
from keras_ipu_plugin.passes import Replacement

layers = keras.layers

VOCAB, LENGTH, WIDTH = 30, 5, 8


class SpareBlock(layers.Layer):
    """A residual block that owns a weight its `call` never reads (as a
    keras_hub embedding with untied reverse weights does)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = layers.Dense(WIDTH, activation="tanh", name="dense")
        self.norm = layers.LayerNormalization(name="norm")

    def build(self, input_shape):
        self.spare = self.add_weight(shape=(WIDTH,), initializer="ones", name="spare")

    def call(self, x):
        return x + self.norm(self.dense(x))


class TextNet(keras.Model):
    """Embedding lookup (sparse gradient), two blocks, a float32 head (as
    the mixed precision guide recommends)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.embed = layers.Embedding(VOCAB, WIDTH, name="embed")
        self.block_0 = SpareBlock(name="block_0")
        self.block_1 = SpareBlock(name="block_1")
        self.pool = layers.GlobalAveragePooling1D(name="pool")
        self.head = layers.Dense(1, dtype="float32", name="head")

    def call(self, ids):
        return self.head(self.pool(self.block_1(self.block_0(self.embed(ids)))))


class CopiedDense(layers.Dense):
    """A Dense subclass that `Replace` swaps in, weights copied."""


def _data(n=32):
    rng = np.random.default_rng(0)
    ids = rng.integers(0, VOCAB, size=(n, LENGTH)).astype("int32")
    return ids, rng.normal(size=(n, 1)).astype("float32")


PASSES = {
    "none": lambda: [],
    "expand": lambda: [Expand()],
    "replace": lambda: [Replace({layers.Dense: Replacement(CopiedDense, copy_weights=True)})],
    "outline": lambda: [Expand(), Outline(layers.Dense)],
    "outline_blocks": lambda: [Outline(SpareBlock)],
    "recompute": lambda: [Recompute(["block_0", "block_1"])],
    "stages": lambda: [PipelineStages([["block_0"], ["block_1"]])],
    "stages_on_devices": lambda: [PipelineStages([["block_0"], ["block_1"]])],
}


def _train(pass_name, optimizer, steps=3, jit_compile=False):
    """Weights (by the wrapped model's paths) after `steps` steps of `fit`
    on a fresh TextNet: plain Keras when `pass_name` is None."""
    ids, y = _data(8 * steps)
    keras.utils.set_random_seed(5)
    model = TextNet(name="text_net")
    model(ids[:2])
    if pass_name is None:
        trained = model
    else:
        # Verification is not what is tested here (it costs a third of a case).
        trained = kip.PluginModel(model, passes=PASSES[pass_name](), verify=False)
        trained.convert(ids[:8])
        if pass_name == "stages_on_devices":
            trained.converted.kip_stage_devices = ["/cpu:0", "/cpu:1"]
    trained.compile(optimizer=optimizer(), loss="mse", jit_compile=jit_compile)
    trained.fit(ids, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    weights = {v.path: v.numpy() for v in model.weights}
    if pass_name is not None:
        # The layers Replace swapped in hold the trained weights of the
        # layers they replaced.
        for old, new in trained.converted.kip_replaced:
            by_name = {v.name: v for v in new.weights}
            for variable in old.weights:
                weights[variable.path] = by_name[variable.name].numpy()
    return weights, trained


ATOL = 1e-5


def _assert_same_weights(actual, expected, case, atol=ATOL):
    assert actual.keys() == expected.keys()
    for path, value in expected.items():
        np.testing.assert_allclose(
            actual[path].astype("float32"), value.astype("float32"), rtol=0, atol=atol,
            err_msg=f"{case}: weight {path} differs from plain Keras",
        )


def _adamw():
    # Weight decay acts on every variable that has a gradient: a zero where
    # plain Keras has None decays a weight that must stay as it is.
    return keras.optimizers.AdamW(learning_rate=0.01, weight_decay=0.1)


@pytest.fixture(scope="module")
def plain_adamw():
    return _train(None, _adamw)[0]


@pytest.mark.parametrize("pass_name", [
    "expand", "replace", "outline", "outline_blocks", "recompute", "stages",
    "stages_on_devices",
])
def test_every_pass_trains_to_the_same_weights_as_plain_keras_with_adamw(
    plain_adamw, pass_name
):
    actual, trained = _train(pass_name, _adamw)
    _assert_same_weights(actual, plain_adamw, pass_name)
    # The spare weights have no gradient in plain Keras: never decayed.
    np.testing.assert_array_equal(actual["text_net/block_0/spare"], np.ones(WIDTH))
    if pass_name == "recompute":
        # The lookup and the block owning the spare weight really are in a
        # recomputed segment (else this test could not fail).
        segments = trained.converted.kip_interpreter().steps
        recomputed = [
            node.operation.name for s in segments if s.recompute for node in s.nodes
        ]
        assert recomputed == ["embed", "block_0"], recomputed


def test_recomputed_segment_keeps_sparse_and_missing_gradients():
    # What the optimizer is handed, directly: an IndexedSlices for the
    # embedding and None for the weight no layer reads, as without Recompute.
    ids, y = _data(8)
    model = TextNet(name="text_net")
    model(ids)
    converted = kip.convert_to_functional(model, ids)
    recomputed = kip.apply_passes(converted, [Recompute(["block_0", "block_1"])])

    def gradients(net):
        @tf.function
        def step():
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean((net(ids, training=True) - y) ** 2)
            return tape.gradient(loss, net.trainable_variables)

        return dict(zip([v.path for v in net.trainable_variables], step()))

    expected, actual = gradients(converted), gradients(recomputed)
    assert isinstance(expected["text_net/embed/embeddings"], tf.IndexedSlices)
    assert expected["text_net/block_0/spare"] is None
    for path, gradient in expected.items():
        assert type(actual[path]) is type(gradient), path
        if gradient is not None:
            np.testing.assert_allclose(
                tf.convert_to_tensor(actual[path]), tf.convert_to_tensor(gradient),
                rtol=1e-6, atol=1e-7,
            )


# -- the mixed precision x jit_compile x pass matrix ------------------------
POLICIES = ["float32", "mixed_float16", "mixed_bfloat16"]
MATRIX_PASSES = ["none", "expand", "outline", "recompute", "stages"]


@pytest.fixture
def policy(request):
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy(request.param)
    yield request.param
    keras.config.set_dtype_policy(previous)


_plain_by_case = {}


def _plain_weights(policy, jit_compile):
    key = (policy, jit_compile)
    if key not in _plain_by_case:
        _plain_by_case[key] = _train(None, _adam, jit_compile=jit_compile)[0]
    return _plain_by_case[key]


def _adam():
    return keras.optimizers.Adam(learning_rate=0.01)


@pytest.mark.parametrize("pass_name", MATRIX_PASSES)
@pytest.mark.parametrize("jit_compile", [False, True])
@pytest.mark.parametrize("policy", POLICIES, indirect=True)
def test_passes_train_identically_under_every_policy_and_jit(policy, jit_compile, pass_name):
    if jit_compile and policy != "float32":
        assert "--xla_allow_excess_precision=false" in os.environ.get("XLA_FLAGS", ""), (
            "conftest.py sets XLA_FLAGS before TensorFlow starts; without it XLA "
            "rounds differently wherever the graph's structure differs"
        )
    expected = _plain_weights(policy, jit_compile)
    actual, trained = _train(pass_name, _adam, jit_compile=jit_compile)
    assert trained.converted.dtype_policy.name == policy
    _assert_same_weights(actual, expected, f"{pass_name} under {policy}, jit={jit_compile}")


# -- verification under mixed precision ---------------------------------------
class GeluMlp(keras.Model):
    """Dense, BatchNormalization, gelu Dense layers with a residual, a
    float32 head: under a mixed policy, verification held an outlined
    version of it to float32's tolerance and refused it."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.d0 = layers.Dense(32, name="d0")
        self.bn = layers.BatchNormalization(name="bn")
        self.d1 = layers.Dense(32, activation="gelu", name="d1")
        self.d2 = layers.Dense(32, activation="gelu", name="d2")
        self.d3 = layers.Dense(32, activation="gelu", name="d3")
        self.head = layers.Dense(1, dtype="float32", name="head")

    def call(self, x):
        h = self.d1(self.bn(self.d0(x)))
        return self.head(h + self.d3(self.d2(h)))


class GeluAttentionNet(keras.Model):
    """GeluMlp's layers around self-attention; the model where a
    `Recompute(auto=True)` plan was refused so. Without attention biases
    unless asked: a key bias's true gradient is zero, what either model
    computes for it is rounding noise, which Adam scales up to steps of the
    learning rate's size (see `test_recompute_auto_trains_as_plain_keras_to_float_rounding`)."""

    def __init__(self, attention_bias=False, **kwargs):
        super().__init__(**kwargs)
        self.d0 = layers.Dense(16, name="d0")
        self.bn = layers.BatchNormalization(name="bn")
        self.d1 = layers.Dense(16, activation="gelu", name="d1")
        self.attention = layers.MultiHeadAttention(2, 8, use_bias=attention_bias,
                                                   name="attention")
        self.d2 = layers.Dense(16, activation="gelu", name="d2")
        self.d3 = layers.Dense(16, activation="gelu", name="d3")
        self.head = layers.Dense(1, dtype="float32", name="head")

    def call(self, x):
        h = self.d1(self.bn(self.d0(x)))
        h = h + self.attention(h, h)
        return self.head(keras.ops.mean(self.d3(self.d2(h)), axis=1))


MIXED_CASES = {
    "outline": (GeluMlp, (12,), lambda: [Outline(layers.Dense)]),
    "recompute_auto": (GeluAttentionNet, (6, 12), lambda: [Recompute(auto=True)]),
}


def _train_mixed(case, passes=True, verify=True):
    """Weights after 3 Adam steps of `MIXED_CASES[case]`'s model (plain
    Keras when `passes` is False), and the model trained."""
    model_class, shape, make_passes = MIXED_CASES[case]
    rng = np.random.default_rng(0)
    x = rng.normal(size=(48,) + shape).astype("float32")
    y = rng.normal(size=(48, 1)).astype("float32")
    keras.utils.set_random_seed(5)
    model = model_class(name="net")
    model(x[:2])
    trained = kip.PluginModel(model, passes=make_passes(), verify=verify) if passes else model
    trained.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
    trained.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    return {v.path: v.numpy() for v in model.weights}, trained


@pytest.mark.parametrize("case", sorted(MIXED_CASES))
@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"], indirect=True)
def test_verification_accepts_passes_under_mixed_precision_that_train_as_plain_keras(
    policy, case
):
    """Under `mixed_float16` / `mixed_bfloat16`, Outline and
    `Recompute(auto=True)` round differently from the original by units in
    float16's / bfloat16's last place: verification accepts them (its
    tolerance follows the dtype the layers compute in) and they train to
    plain Keras's weights."""
    expected, _ = _train_mixed(case, passes=False)
    actual, trained = _train_mixed(case)
    _assert_same_weights(actual, expected, f"{case} under {policy}")
    compute_dtype = keras.mixed_precision.Policy(policy).compute_dtype
    # Verification ran, on outputs and gradients, with the policy's tolerance.
    note = f"tolerances for {compute_dtype} computation (dtype policy `{policy}`)"
    verified = [e for e in trained.kip_report.entries if e.step == "verify"]
    assert verified and all(e.action == "outputs and gradients equal" and note in e.detail
                            for e in verified), [(e.action, e.detail) for e in verified]


# -- Recompute and weights whose true gradient is zero ------------------------
ZERO_GRADIENT_WEIGHTS = ["net/d0/bias", "net/attention/key/bias"]


def _recompute_auto_twins(mode, steps=3, learning_rate=1e-3):
    """Weights of plain Keras and of `Recompute(auto=True)` after `steps`
    Adam steps of GeluAttentionNet with attention biases, and the model
    trained through the plugin; `mode`: "eager", "graph" or "jit"."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16 * steps, 6, 12)).astype("float32")
    y = rng.normal(size=(16 * steps, 1)).astype("float32")
    results = []
    for passes in (None, [Recompute(auto=True)]):
        keras.utils.set_random_seed(5)
        model = GeluAttentionNet(attention_bias=True, name="net")
        model(x[:2])
        trained = model if passes is None else kip.PluginModel(model, passes=passes)
        trained.compile(optimizer=keras.optimizers.Adam(learning_rate), loss="mse",
                        jit_compile=mode == "jit", run_eagerly=mode == "eager")
        trained.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
        results.append({v.path: v.numpy() for v in model.weights})
    return results[0], results[1], trained


@pytest.mark.parametrize("mode", ["eager", "graph", "jit"])
def test_recompute_auto_trains_as_plain_keras_to_float_rounding(mode):
    """`Recompute(auto=True)` recomputes the forward pass's own ops, in the
    same order, but TensorFlow's graph optimiser (Grappler's arithmetic
    optimiser and remapper) and XLA's fusion rewrite an elementwise chain
    (gelu's) according to how many ops read each intermediate tensor, which
    differs between a forward pass whose tensors the backward pass reads
    and a recomputation: the results differ in the last bits. So weights
    equal plain Keras's to float rounding, and a weight whose true gradient
    is zero (a Dense bias feeding BatchNormalization, an attention key
    bias), whose gradient is rounding noise in both, may take another Adam
    step, of the order of the learning rate (bounded here by the learning
    rate per step; measured 1e-6 after three steps at 1e-3). Run eagerly,
    where nothing rewrites the ops, every weight is equal."""
    steps, learning_rate = 3, 1e-3
    expected, actual, trained = _recompute_auto_twins(mode, steps, learning_rate)
    notes = trained.converted.kip_annotations
    # Both weights are in recomputed work (else this test could not fail).
    assert notes["d0"].get("recompute") and notes["d1"].get("recompute"), notes
    for path, value in expected.items():
        if mode == "eager":
            np.testing.assert_array_equal(actual[path], value,
                                          err_msg=f"weight {path} differs from plain Keras")
            continue
        bound = steps * learning_rate if path in ZERO_GRADIENT_WEIGHTS else ATOL
        np.testing.assert_allclose(actual[path], value, rtol=0, atol=bound,
                                   err_msg=f"weight {path} differs from plain Keras")
