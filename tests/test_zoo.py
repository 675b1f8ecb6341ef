"""The public-architecture corpus through the plugin: one test
per corpus model (tests/zoo/) per check.

- converts fully traced (no opaque node unless the model file says why);
- `Expand("all")` keeps outputs and gradients equal;
- `Expand("all")` leaves no custom layer that the report gives no reason for,
  and custom layers at all only in the models `STAYS_WHOLE` names;
- `Replace` reaches every layer of the LayerNormalization family (custom
  norms too, by a subclass of their own class with the weights copied)
  with outputs equal;
- `PluginModel` and `PluginCallback` train 3 steps with the logs and final
  variables of plain Keras on an identical twin; so do `PluginModel` with
  `Recompute(auto=True)`, and with `Expand("all")` and every optimizer
  replaced by Adam (a model that compiles with Adam already keeps its own).

The checks live in `tests/zoo/harness.py` (they return results, so that
`benchmarks/zoo.py` can print the same checks as a scoreboard); these tests
assert on them. Models whose checks take more than ~10 s on 2 cores are
marked `slow` (keras_hub backbones, keras.applications).
"""

import functools

import keras
import numpy as np
import pytest

from zoo import MODELS
from zoo import harness

REQUIRED = (
    "vae", "dcgan", "perceiver", "vit", "mlp_mixer", "swin", "translation_transformer",
    "siamese", "recommender", "pointnet", "cct", "distillation", "gat", "speech_transformer",
    "bert", "gpt2", "llama", "gemma", "resnet50", "efficientnet_b0", "convnext_tiny",
    "mobilenet_v3_small",
)


#: The models whose `Expand("all")` leaves custom layers, by the classes it
#: leaves (each with its reason in the report; docs/zoo.md
#: says why and what to write instead). Every other model expands to
#: built-in layers and kip's own graph layers only: 38 of 39.
STAYS_WHOLE = {
    # `tf.reshape(inputs, [NUM_TOKENS_PER_BATCH, embed_dim])`: a batch
    # written as a constant (written with -1 it expands:
    # tests/layers/test_added_losses.py)
    "switch_transformer": {"Switch"},
}


#: Checks that fail on a model for a known plugin bug, not fixed yet:
#: `(check, model) -> reason`. Each is a strict xfail, so the test fails
#: (XPASS) the day the bug is fixed, and the entry must then go.
KNOWN_FAILURES = {}


def _corpus(check=None):
    return [
        pytest.param(name, id=name, marks=[
            # one pytest-xdist worker runs every check of a model, in order
            pytest.mark.xdist_group(f"zoo_{name}"),
            *([pytest.mark.slow] if harness.Subject(name).slow else []),
            *([pytest.mark.xfail(reason=KNOWN_FAILURES[check, name], strict=True)]
              if (check, name) in KNOWN_FAILURES else []),
        ])
        for name in MODELS
    ]


#: The checks below take the corpus as a module-scoped parameter: pytest then
#: runs every check of one model before the next model's (and, under
#: pytest-xdist's `--dist loadgroup`, on one worker), so the checks of a
#: model share its conversion and its plain-Keras fit (see
#: `harness.shared_conversion`, `harness.plain_fit`); each keeps its own test.
CORPUS = _corpus()


def _assert_ok(result):
    assert result.ok, f"{result.model} / {result.check}: {result.status}: {result.detail}"


@functools.cache
def _expansion(name):
    """One `Expand("all")` run gives the results of two tests."""
    return harness.check_expand(name)


# -- the corpus itself -------------------------------------------------------------
def test_corpus_has_the_required_architectures():
    assert len(MODELS) >= 22
    assert set(REQUIRED) <= set(MODELS)
    assert {"t5", "bart"} & set(MODELS)
    assert {"gmlp", "fnet"} & set(MODELS)
    assert {"dcgan", "wgan_gp"} & set(MODELS)


def test_known_failures_name_a_check_and_a_model_of_the_corpus():
    for check, name in KNOWN_FAILURES:
        assert check in harness.CHECKS and name in MODELS, (check, name)


@pytest.mark.parametrize("name", MODELS)
def test_corpus_model_cites_its_source_and_has_the_interface(name):
    subject = harness.Subject(name)
    assert subject.doc.startswith("Follows "), f"{name}: the docstring must cite its source"
    for function in ("build", "data", "compile_kwargs"):
        assert callable(getattr(subject.module, function, None)), f"{name} has no {function}()"
    x, _ = subject.data(2)
    assert len(keras.tree.flatten(x)[0]) == 2


# -- the checks ----------------------------------------------------------------------
@pytest.mark.parametrize("name", CORPUS, scope="module")
def test_converts_fully_traced(name):
    _assert_ok(harness.check_traced(name))


@pytest.mark.parametrize("name", CORPUS, scope="module")
def test_expand_all_keeps_outputs_and_gradients_equal(name):
    _assert_ok(_expansion(name)[0])


@pytest.mark.parametrize("name", CORPUS, scope="module")
def test_expand_all_leaves_no_custom_layer_without_a_reason(name):
    _assert_ok(_expansion(name)[1])


@pytest.mark.parametrize("name", CORPUS, scope="module")
def test_expand_all_leaves_custom_layers_only_in_the_models_stated(name):
    """The corpus expands to built-in and kip layers, but for
    `STAYS_WHOLE` (VQ-VAE's `add_loss`, the `tf.random` VAE's sampling
    left it before)."""
    result = _expansion(name)[1]
    _assert_ok(result)
    assert result.classes_left == STAYS_WHOLE.get(name, set()), result.detail


#: The models whose expanded graph `kip.to_keras` cannot write with Keras's
#: classes only, by what its error names (first among the nodes it lists).
#: Every other model is served: 25 of 39.
NEEDS_KIP = {
    "vae": "RandomDraw",  # `keras.random.normal` in the sampling layer: a draw
    "pixelcnn": "VariableWrite",  # the masked kernel assigned in `call`
    "vae_tf_random": "TFRandomDraw",  # `tf.random.normal`
    "vq_vae": "no exact keras.ops form",  # `tf.math.reduce_sum` ..., and its `add_loss`
    "ddpm": "`tf.shape`",  # shapes computed in the graph
    "cct": "ModeSwitch",  # stochastic depth branching on `training`
    "pointnet": "OrthogonalRegularizer in its config",  # the model's own regularizer
    "shiftvit": "ModeSwitch",
    "translation_transformer": "AttachMask",  # masks computed in `call`
    "gat": "TensorSizedOperation",  # sizes from the data (`ops.bincount`)
    "ner_transformer": "`tf.shape`",  # `tf.range(tf.shape(x)[-1])`
    "switch_transformer": "`tf.shape`",
    # keras_hub's activation, a function keras_hub registers with Keras
    "bert": "keras_hub>gelu_approximate",
    "gpt2": "keras_hub>gelu_approximate",
}


@pytest.mark.parametrize("name", CORPUS, scope="module")
def test_to_keras_serves_the_expanded_model_or_names_what_needs_kip(name):
    """A plain Keras model of the expanded graph computes its outputs (weight
    reads, fixed tensors, batch-sized reshapes and broadcasts, and `tf.*`
    calls of the table written with Keras's classes); the models of
    `NEEDS_KIP` are n/a, with the nodes that need kip named."""
    _expansion(name)
    result = harness.check_to_keras(name)
    if name in NEEDS_KIP:
        assert result.status == harness.NA, result.detail
        assert "not Keras's own classes" in result.detail
        assert NEEDS_KIP[name] in result.detail
    else:
        assert result.status == harness.PASS, result.detail


@pytest.mark.parametrize("name", CORPUS, scope="module")
def test_a_feature_inside_a_block_kept_whole_is_extracted_as_after_expand(name):
    _expansion(name)
    result = harness.check_inner_feature(name)
    assert result.status in (harness.PASS, harness.NA), result.detail


@pytest.mark.parametrize("name", CORPUS, scope="module")
def test_node_paths_are_equal_across_two_builds(name):
    _expansion(name)  # the first build's paths
    _assert_ok(harness.check_stable_paths(name))


def test_the_models_stated_to_stay_whole_are_of_the_corpus():
    assert set(STAYS_WHOLE) <= set(MODELS)


@pytest.mark.parametrize("name", CORPUS, scope="module")
def test_replace_reaches_every_norm_layer_with_outputs_equal(name):
    _assert_ok(harness.check_replace(name))


@pytest.mark.parametrize("name", CORPUS, scope="module")
def test_plugin_model_fit_equals_plain_keras(name):
    _assert_ok(harness.check_fit(name, "plugin_model"))


@pytest.mark.parametrize("name", CORPUS, scope="module")
def test_plugin_callback_fit_equals_plain_keras(name):
    _assert_ok(harness.check_fit(name, "plugin_callback"))


@pytest.mark.parametrize("name", CORPUS, scope="module")
def test_plugin_model_with_expand_all_and_adam_fit_equals_plain_keras_with_adam(name):
    _assert_ok(harness.check_fit(name, "fit_expand"))


@pytest.mark.parametrize("name", _corpus("fit_recompute"), scope="module")
def test_plugin_model_with_recompute_auto_fit_equals_plain_keras(name):
    _assert_ok(harness.check_fit(name, "fit_recompute"))



# -- the harness sees what it must see -------------------------------------------------
def _dense_model(seed):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((3,))
    return keras.Model(inputs, keras.layers.Dense(2)(inputs))


def test_harness_compare_models_finds_a_different_output_and_gradient():
    x = np.ones((2, 3), "float32")
    model = _dense_model(0)
    assert harness.compare_models(model, model, x, gradients=True) == ""
    assert "output 0 differs" in harness.compare_models(model, _dense_model(1), x, gradients=False)

    class Stopped(keras.Model):  # equal outputs, no gradient to the kernel
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def call(self, inputs):
            return keras.ops.stop_gradient(self.inner(inputs))

    assert "gradient" in harness.compare_models(model, Stopped(model), x, gradients=True)


def test_harness_compare_fits_finds_a_different_loss_and_a_weight_that_did_not_train():
    initial = [np.zeros(3, "float32")]
    reference = harness.FitRun([{"loss": 1.0}, {"loss": 0.5}], [("w", np.ones(3, "float32"))])
    same = harness.FitRun([{"loss": 1.0}, {"loss": 0.5}], [("w", np.ones(3, "float32"))])
    assert harness.compare_fits(reference, same, initial) == ""
    other_loss = harness.FitRun([{"loss": 1.0}, {"loss": 0.6}], [("w", np.ones(3, "float32"))])
    assert "step 2" in harness.compare_fits(reference, other_loss, initial)
    untrained = harness.FitRun([{"loss": 1.0}, {"loss": 0.5}], [("w", np.zeros(3, "float32"))])
    assert "variable `w`" in harness.compare_fits(reference, untrained, initial)
    never_converted = harness.FitRun(reference.logs, reference.variables, converted=False)
    assert "never converted" in harness.compare_fits(reference, never_converted, initial)


def test_harness_counts_layers_not_exported_by_keras_layers_as_custom():
    class MyDense(keras.layers.Dense):
        pass

    assert not harness.is_custom(keras.layers.Dense(2))
    assert not harness.is_custom(keras.layers.LayerNormalization())
    assert harness.is_custom(MyDense(2))
    assert harness.is_custom(keras.Sequential([keras.layers.Dense(2)]))
    assert harness.is_norm(keras.layers.RMSNormalization())
    assert not harness.is_norm(keras.layers.BatchNormalization())


def test_harness_shared_conversion_gives_each_check_the_converted_state():
    """The checks of a model share one conversion: a check must neither see
    what an earlier one changed nor change it unnoticed."""
    subject = harness.Subject("recommender")
    shared = harness.shared_conversion(subject)
    (converted,) = shared.converted()
    variable = converted.trainable_variables[0]
    as_converted = np.array(variable.numpy())
    assert shared.check_unchanged("nothing") is None

    variable.assign(as_converted + 1.0)  # what a pass must not do
    with pytest.raises(harness.CheckFailed, match=f"changed the variable `{variable.path}`"):
        shared.check_unchanged("a pass")

    again = harness.shared_conversion(subject)
    assert again is shared, "the next check of the model converts it again"
    np.testing.assert_array_equal(variable.numpy(), as_converted)
    assert shared.check_unchanged("nothing") is None


def test_the_zoo_report_counts_the_models_to_keras_serves():
    """The scoreboard's totals say how many models `kip.to_keras` turns into
    a file plain Keras loads (a model that needs kip is n/a: not counted)."""
    from benchmark_modules import load_benchmark

    board = load_benchmark("zoo")
    rows = [(name, [harness.CheckResult(name, "to_keras", status)])
            for name, status in (("a", harness.PASS), ("b", harness.NA), ("c", harness.PASS))]
    assert "served by to_keras (a file plain Keras loads): 2/3 models" in board.totals(rows)
    assert "to_keras" in [title for _, title in board.COLUMNS]
