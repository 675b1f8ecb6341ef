"""The gallery in `examples/`: every model converts and passes equal to the
original, trains through the plugin, and every script runs.

Each example module exposes `build_model()`, `make_data(samples)`,
`passes()`, `compile_model(model)` and `main()`; the modules are loaded from
their files (examples/ is not a package) once per test session.
"""

import importlib.util
import subprocess
import sys
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_ipu_plugin as kip

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
GALLERY = [
    "text_transformer",
    "resnet_blocks",
    "vae",
    "wide_and_deep",
    "seq2seq",
    "dynamic_model",
    "keras_applications",
]
#: Examples whose `main()` takes more than ~20 s on 2 CPU cores.
SLOW_MAIN = {"keras_applications"}
#: Examples trained eagerly in the three-step test: building the train
#: graph of MobileNetV3Small takes ~30 s on 2 cores (plain Keras too);
#: `main()` trains it in graph mode, and the test of `main()` runs that.
EAGER_STEPS = {"keras_applications"}

_modules = {}


def example(name):
    """The example module `examples/NAME.py`, imported once."""
    if name not in _modules:
        spec = importlib.util.spec_from_file_location(
            f"kip_example_{name}", EXAMPLES / f"{name}.py"
        )
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        _modules[name] = module
    return _modules[name]


def batch(module, samples):
    """`(x, y)` from the example's own data (y is None for the VAE)."""
    data = module.make_data(samples=samples)
    return data if isinstance(data, tuple) else (data, None)


def as_tensors(x):
    return tf.nest.map_structure(tf.convert_to_tensor, x)


def has_replace(passes):
    return any(isinstance(p, kip.passes.Replace) for p in passes)


# -- conversion and passes are exact ---------------------------------------------
@pytest.mark.parametrize("name", GALLERY)
def test_outputs_and_gradients_equal_after_conversion_and_passes(name):
    module = example(name)
    model = module.build_model()
    x, _ = batch(module, 16)
    x = as_tensors(x)
    first = tf.nest.map_structure(lambda t: t[:8], x)
    converted = kip.convert_to_functional(model, first)
    assert isinstance(converted, kip.KipFunctional)
    assert {id(v) for v in converted.trainable_variables} <= {
        id(v) for v in model.trainable_variables
    }
    passes = module.passes()
    passed = kip.apply_passes(converted, passes) if passes else converted
    assert passed.kip_report is not None
    # Both halves: the dynamic model's second half takes the other branch.
    # (`convert_to_functional` verified `converted` on the first half: its
    # `verify=True` is this `check_equivalent`, raising on a mismatch.)
    second = tf.nest.map_structure(lambda t: t[8:], x)
    kip.frontend.verify.equivalence.check_equivalent(model, converted, second)
    for half in (first, second):
        # Replace gives the replaced layers new variables: the original's
        # gradients are compared with the new layers' below instead.
        kip.frontend.verify.equivalence.check_equivalent(
            model, passed, half, what="passed", gradients=not has_replace(passes)
        )
    if has_replace(passes):
        assert_replaced_gradients_equal(model, passed, first)


def assert_replaced_gradients_equal(model, passed, x):
    """Gradients w.r.t. each replaced layer's weights equal the gradients
    w.r.t. the weights of the layer it replaced (copied weights: the
    replacement computes the same function)."""
    pairs = passed.kip_replaced
    assert pairs, "Replace replaced nothing"
    old_vars = [v for old, _ in pairs for v in old.trainable_variables]
    new_vars = [v for _, new in pairs for v in new.trainable_variables]
    assert len(old_vars) == len(new_vars)
    expected = _projection_gradients(model, x, old_vars)
    actual = _projection_gradients(passed, x, new_vars)
    for old, e, a in zip(old_vars, expected, actual):
        np.testing.assert_allclose(a, e, rtol=1e-4, atol=1e-5, err_msg=old.path)


def _projection_gradients(model, x, variables):
    with tf.GradientTape() as tape:
        outputs = model(x, training=False)
        total = 0.0
        for i, out in enumerate(tf.nest.flatten(outputs)):
            weights = np.random.RandomState(i).uniform(0.5, 1.5, out.shape[1:])
            total += tf.reduce_sum(out * weights.astype("float32"))
    return [g.numpy() for g in tape.gradient(total, [v.value for v in variables])]


# -- training through the plugin --------------------------------------------------
@pytest.mark.parametrize("name", GALLERY)
def test_three_training_steps_through_the_plugin_lower_the_loss(name):
    module = example(name)
    x, y = batch(module, 32)
    x = as_tensors(x)
    plugin = kip.PluginModel(module.build_model(), passes=module.passes())
    module.compile_model(plugin)
    plugin.run_eagerly = name in EAGER_STEPS
    plugin.convert(x)
    before = eval_loss(module, plugin, x, y)
    element = x if y is None else (x, y)
    # one fixed batch, three steps
    plugin.fit(tf.data.Dataset.from_tensors(element).repeat(3), epochs=1, verbose=0)
    after = eval_loss(module, plugin, x, y)
    print(f"{name}: loss {before:.4f} -> {after:.4f}")
    assert after < before, (before, after)


def eval_loss(module, plugin, x, y):
    """The loss on one batch, in inference mode, through the plugin."""
    if hasattr(module, "eval_loss"):
        return float(module.eval_loss(plugin, x, y))
    return float(keras.ops.mean(plugin.loss(y, plugin(x, training=False))))


# -- the scripts ----------------------------------------------------------------------
@pytest.mark.parametrize("name", [
    pytest.param(n, marks=pytest.mark.slow) if n in SLOW_MAIN else n for n in GALLERY
])
def test_example_main_prints_the_report_and_the_final_loss(name, capsys):
    example(name).main()
    out = capsys.readouterr().out
    assert "keras_ipu_plugin report" in out
    assert "final loss:" in out
    final = float(out.rsplit("final loss:", 1)[1].split()[0])
    assert np.isfinite(final)


@pytest.mark.slow
def test_an_example_runs_as_a_script():
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / "vae.py")],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "keras_ipu_plugin report" in result.stdout
    assert "final loss:" in result.stdout
