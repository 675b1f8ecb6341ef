"""The `Tracer`'s hooks: one rule for where tracing stops, one probe for
`training`, overridable by subclassing (as torch.fx's `Tracer.is_leaf_module`)."""

import ast
from pathlib import Path

import keras
import numpy as np
from keras import layers
from keras import ops

import keras_ipu_plugin as kip
from keras_ipu_plugin.frontend.trace.call_trace import Traces
from keras_ipu_plugin.frontend.trace.tracer import DEFAULT_TRACER
from keras_ipu_plugin.frontend.trace.tracer import Tracer
from keras_ipu_plugin.frontend.trace.tracer import current_tracer
from keras_ipu_plugin.frontend.trace.tracer import trace_model
from keras_ipu_plugin.frontend.trace.training_modes import trace_modes
from keras_ipu_plugin.frontend.inputs import input_specs
from keras_ipu_plugin.passes import Expand
from keras_ipu_plugin.layers import user_code
from keras_ipu_plugin.layers.layer_kinds import is_expandable


class Inner(layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = layers.Dense(4, name="dense")

    def call(self, x):
        return self.dense(x) + x


class Outer(layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.inner = Inner(name="inner")
        self.norm = layers.LayerNormalization(name="norm")

    def call(self, x):
        return self.norm(self.inner(x))


class Net(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.blocks = [Outer(name=f"outer_{i}") for i in range(2)]

    def call(self, x):
        for block in self.blocks:
            x = block(x)
        return x


class KeepInner(Tracer):
    """Keeps every `Inner` whole: a leaf, as torch.fx's `is_leaf_module`."""

    def is_user_code(self, layer):
        return not isinstance(layer, Inner) and super().is_user_code(layer)


class TunedDense(layers.Dense):
    """A user's subclass of Dense that keeps Dense's own `call`."""


def _model():
    model = Net(name="net")
    x = np.random.RandomState(0).normal(size=(3, 4)).astype("float32")
    model(x)
    return model, x


def _operations(model):
    return [node.operation for node in model.kip_graph.nodes]


def test_by_default_expand_all_goes_through_every_user_layer():
    model, x = _model()
    expanded = kip.apply_passes(kip.convert_to_functional(model, x), [Expand("all")])
    assert not any(isinstance(op, (Inner, Outer)) for op in _operations(expanded))
    np.testing.assert_allclose(expanded(x), model(x), rtol=1e-6, atol=1e-6)


def test_a_tracer_subclass_keeps_the_layers_it_calls_leaves_whole():
    model, x = _model()
    with KeepInner().tracing():
        assert isinstance(current_tracer(), KeepInner)
        expanded = kip.apply_passes(kip.convert_to_functional(model, x), [Expand("all")])
    assert current_tracer() is DEFAULT_TRACER
    operations = _operations(expanded)
    kept = [op for op in operations if isinstance(op, Inner)]
    assert kept == [block.inner for block in model.blocks]  # each Inner: one node
    assert not any(isinstance(op, Outer) for op in operations)  # the rest expanded
    assert sum(isinstance(op, layers.LayerNormalization) for op in operations) == 2
    np.testing.assert_allclose(expanded(x), model(x), rtol=1e-6, atol=1e-6)


def test_a_tracer_passed_to_a_trace_is_the_one_it_asks():
    model, x = _model()
    asked = []

    class Recording(Tracer):
        def takes_training(self, layer):
            asked.append(layer)
            return super().takes_training(layer)

        def is_user_code(self, layer):
            asked.append(layer)
            return super().is_user_code(layer)

    graph = trace_model(model, input_specs(x), tracer=Recording())
    assert model in asked and model.blocks[0] in asked
    assert [node.operation for node in graph.nodes] == model.blocks


class Flag(layers.Layer):
    def call(self, x, training=None):
        return x * 2.0 if training else x


class NoTraining(Tracer):
    def takes_training(self, layer):
        return not isinstance(layer, Flag) and super().takes_training(layer)


def test_a_tracer_saying_a_call_takes_no_training_is_not_handed_it():
    flag, x = Flag(name="flag"), np.ones((2, 3), "float32")
    flag(x)
    specs = input_specs(x)
    # Handed `training`, `call` branches on it: one node holds both modes.
    assert [type(node.operation).__name__ for node in trace_model(flag, specs).nodes] == [
        "ModeSwitch"]
    # Never handed it, `call` takes its `else` branch alone: `x` itself.
    assert trace_model(flag, specs, tracer=NoTraining()).nodes == []


def test_the_one_rule_for_user_code():
    assert not user_code.is_user_module("keras.src.layers.core.dense")
    assert not user_code.is_user_module("tensorflow.python.ops.math_ops")
    assert not user_code.is_user_module("keras_ipu_plugin.layers.opaque")
    assert user_code.is_user_module("keras.src.applications.convnext")  # model code
    assert user_code.is_user_module("my_project.blocks")
    assert user_code.user_call(Inner()) is Inner.call
    assert user_code.user_call(layers.Dense(2)) is None
    # A user's subclass of a Keras layer is user code (Expand may inline it),
    # but the `call` it keeps is Keras's: tracing calls it as Keras calls a Dense.
    tuned = TunedDense(2)
    assert user_code.is_user_layer(tuned) and not user_code.is_user_layer(layers.Dense(2))
    assert user_code.user_call(tuned) is None
    assert is_expandable(tuned) and is_expandable(Inner())
    assert not is_expandable(layers.Dense(2))
    assert DEFAULT_TRACER.is_user_code(tuned) and DEFAULT_TRACER.traced_call(tuned) is None
    assert DEFAULT_TRACER.traced_call(Inner()) is Inner.call
    assert KeepInner().traced_call(Inner()) is None


def test_the_one_probe_for_training():
    class Forwards(layers.Layer):
        def call(self, x, **kwargs):
            return x

    assert user_code.takes_training(layers.Dropout(0.1))
    assert not user_code.takes_training(layers.LayerNormalization())
    # As Keras decides: `**kwargs` alone is not handed `training`.
    assert not user_code.takes_training(Forwards())
    assert user_code.takes_keyword(Forwards().call, "training")
    assert DEFAULT_TRACER.takes_training(layers.Dropout(0.1))


def _signature_training_probes(source):
    """Lines of `source` asking `"training" in <...>.parameters`: a probe of
    a signature for `training` written again instead of `takes_training`."""
    return [node.lineno for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Compare) and isinstance(node.left, ast.Constant)
            and node.left.value == "training" and isinstance(node.ops[0], ast.In)
            and isinstance(node.comparators[0], ast.Attribute)
            and node.comparators[0].attr == "parameters"]


def test_no_module_probes_a_signature_for_training_but_the_one_probe():
    package = Path(kip.__file__).parent
    found = {str(path.relative_to(package)): _signature_training_probes(path.read_text())
             for path in package.rglob("*.py") if path.name != "user_code.py"}
    assert {path: lines for path, lines in found.items() if lines} == {}
    # The check sees the probe it is there to catch.
    planted = 'self.training = "training" in inspect.signature(call).parameters'
    assert _signature_training_probes(planted) == [1]


class GrowingNet(keras.Model):
    """Calls a second block once `grow` is set: its variables, made then,
    make the plugin convert the model again."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.grow = False
        self.first = Outer(name="first")
        self.second = Outer(name="second")
        self.head = layers.Dense(1, name="head")

    def call(self, x):
        x = self.first(x)
        if self.grow:
            x = self.second(x)
        return self.head(x)


def test_a_plugin_model_made_in_a_tracer_block_keeps_that_tracer_for_every_conversion():
    """A PluginModel made inside `with tracer.tracing():` converts with that
    tracer at its first fit and at every rebuild for new variables, even
    when fit runs outside the block (the block only picks the default of
    `PluginModel(..., tracer=)`)."""
    rng = np.random.RandomState(0)
    x = rng.normal(size=(16, 4)).astype("float32")
    y = rng.normal(size=(16, 1)).astype("float32")
    model = GrowingNet(name="growing")
    model(x[:2])
    with KeepInner().tracing():
        plugin = kip.PluginModel(model, passes=[Expand("all")])
    plugin.compile(optimizer="sgd", loss="mse")
    plugin.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert [op for op in _operations(plugin.converted) if isinstance(op, Inner)] == [
        model.first.inner]
    model.grow = True
    plugin.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert plugin._kip_session.rebuilds == 1
    assert [op for op in _operations(plugin.converted) if isinstance(op, Inner)] == [
        model.first.inner, model.second.inner]


def test_a_tracer_given_by_keyword_decides_conversion_passes_and_plugin_model():
    """`tracer=` of `convert_to_functional`, `apply_passes` and `PluginModel`
    says where tracing stops, with no block around the call."""
    model, x = _model()
    converted = kip.convert_to_functional(model, x, tracer=KeepInner())
    expanded = kip.apply_passes(converted, [Expand("all")], tracer=KeepInner())
    assert [op for op in _operations(expanded) if isinstance(op, Inner)] == [
        block.inner for block in model.blocks]
    # The default tracer goes through every Inner.
    plain = kip.apply_passes(converted, [Expand("all")])
    assert not any(isinstance(op, Inner) for op in _operations(plain))
    plugin = kip.PluginModel(model, passes=[Expand("all")], tracer=KeepInner())
    plugin.compile(optimizer="sgd", loss="mse")
    plugin.fit(x, np.zeros((3, 4), "float32"), batch_size=3, epochs=1, verbose=0)
    assert [op for op in _operations(plugin.converted) if isinstance(op, Inner)] == [
        block.inner for block in model.blocks]


def test_the_passes_get_the_tracer_of_apply_passes_with_the_graph_not_from_the_thread():
    """The tracer `apply_passes` is given reaches each pass with the graph it
    edits (`graph.tracer`), not through the tracer in use on the thread: a
    pass of one's own that runs Expand under another tracer's block still
    expands with the tracer `apply_passes` was given."""

    class ExpandUnderTheDefaultTracer(kip.passes.Pass):
        def run(self, graph, report):
            with DEFAULT_TRACER.tracing():
                return Expand("all").run(graph, report)

    model, x = _model()
    converted = kip.convert_to_functional(model, x, tracer=KeepInner())
    expanded = kip.apply_passes(converted, [ExpandUnderTheDefaultTracer()], tracer=KeepInner())
    assert [op for op in _operations(expanded) if isinstance(op, Inner)] == [
        block.inner for block in model.blocks]


class PositionsOfHeads(layers.Layer):
    """keras_hub's T5 attention: a position table as long as heads reshaped
    to `(batch_size, -1, ...)`, which the unknown batch size leaves unknown:
    the call is traced again, at two batch sizes."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.proj = layers.Dense(8, name="proj")

    def call(self, x):
        heads = ops.reshape(self.proj(x), (ops.shape(x)[0], -1, 2, 4))
        positions = ops.cast(ops.arange(ops.shape(heads)[1]), heads.dtype)
        return ops.reshape(heads + positions[None, :, None, None], (ops.shape(x)[0], -1, 8))


class HoldsBlock(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.block = PositionsOfHeads(name="block")

    def call(self, x):
        return self.block(x)


class SymbolicOnly(Tracer):
    """Traces each call once, symbolically, in both modes: never again at
    trial batch sizes."""

    def traces(self, call):
        return Traces(((call, trace_modes(call)),))


def test_the_retry_policy_is_one_method_a_tracer_subclass_overrides():
    """`Tracer.traces` decides how a call is traced again when its symbolic
    trace fails: the default traces a call needing its batch size at two
    batch sizes (the block expands), a subclass that never retries leaves
    that block whole, with the reason."""
    x = np.random.RandomState(0).normal(size=(4, 5, 3)).astype("float32")
    model = HoldsBlock(name="holds")
    model(x)
    converted = kip.convert_to_functional(model, x)
    retried = []

    class Recording(Tracer):
        def traces(self, call):
            traces = super().traces(call)
            retried.append((call.layer, traces.trial is not None))
            return traces

    expanded = kip.apply_passes(converted, [Expand("all")], tracer=Recording())
    assert "block" not in expanded.kip_report.opaque
    assert (model.block, True) in retried  # traced again, at trial batch sizes
    kept = kip.apply_passes(converted, [Expand("all")], tracer=SymbolicOnly())
    assert "block" in kept.kip_report.opaque
    for passed in (expanded, kept):
        np.testing.assert_allclose(passed(x), model(x), atol=1e-5)
