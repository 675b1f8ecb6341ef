"""What several test files check of a conversion: every node of a graph,
the bodies of its training switches included; a model's outputs in each
`training` mode against the original's; outputs and gradients against the
original's, independently of `kip.verify` (`assert_equivalent`); that the
user's model is unchanged (`Snapshot`); that a graph holds no opaque or
custom layer; and that a block expands exactly at any batch size.

The shared test helpers live here and in `models.py` (the shared models),
both imported by name (`tests/` is on `sys.path` under pytest)."""

import keras
import numpy as np
import tensorflow as tf

import keras_ipu_plugin as kip
from keras_ipu_plugin.passes import Expand

import models as zoo  # tests/models.py


def all_nodes(graph):
    """The graph's nodes and, depth first, those of every branch graph a
    node holds (a `ModeSwitch`'s training and inference bodies)."""
    nodes = []
    for node in graph.nodes:
        nodes.append(node)
        for branch in getattr(node.operation, "branch_graphs", {}).values():
            nodes.extend(all_nodes(branch))
    return nodes


def outputs_in_every_mode(original, other, x):
    """Assert both models' outputs are equal with training True, False and
    None, each run from the same non-trainable variable state; return the
    last mode's pair."""
    state = [(v, v.numpy()) for v in original.non_trainable_variables]
    for training in (True, False, None):
        results = []
        for model in (original, other):
            for variable, value in state:
                variable.assign(value)
            results.append(np.asarray(model(x, training=training)))
        for variable, value in state:
            variable.assign(value)
        np.testing.assert_allclose(results[1], results[0], rtol=1e-5, atol=1e-6,
                                   err_msg=f"training={training}")
    return results


def float_leaves(structure):
    return [
        t for t in tf.nest.flatten(structure) if tf.as_dtype(t.dtype).is_floating
    ]


def projection(outputs):
    """A fixed, non-uniform scalar of all float outputs (a plain sum would
    hide errors that cancel, e.g. a softmax or a normalisation)."""
    total = tf.constant(0.0)
    for index, tensor in enumerate(keras.tree.flatten(outputs)):
        tensor = tf.convert_to_tensor(tensor)
        if not tensor.dtype.is_floating:
            continue
        weights = np.random.RandomState(100 + index).normal(size=tensor.shape[1:])
        total += tf.reduce_sum(tensor * weights.astype(tensor.dtype.as_numpy_dtype))
    return total


def assert_close(actual, expected, what, rtol=1e-5, atol=1e-5):
    np.testing.assert_allclose(
        np.asarray(actual), np.asarray(expected), rtol=rtol, atol=atol, err_msg=what
    )


def outputs_and_grads(model, x, variables, training=False):
    """Outputs, gradients w.r.t. `variables` and w.r.t. the float inputs."""
    x = zoo.as_tensor(x)
    inputs = float_leaves(x)
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(inputs)
        outputs = model(x, training=training)
        scalar = projection(outputs)
    variable_grads = tape.gradient(scalar, [v.value for v in variables])
    input_grads = tape.gradient(scalar, inputs)
    dense = lambda g: None if g is None else tf.convert_to_tensor(g)  # IndexedSlices
    return outputs, [dense(g) for g in variable_grads], [dense(g) for g in input_grads]


def assert_equivalent(original, converted, x, training=False):
    """Independent of `kip.verify`: same outputs (structure included), same
    gradients w.r.t. every trainable variable and every float input."""
    variables = original.trainable_variables
    assert variables, "the model has no trainable variable to compare"
    out_o, grads_o, in_o = outputs_and_grads(original, x, variables, training)
    out_c, grads_c, in_c = outputs_and_grads(converted, x, variables, training)
    keras.tree.assert_same_structure(out_o, out_c)
    for (path, a), b in zip(
        keras.tree.flatten_with_path(out_o), keras.tree.flatten(out_c)
    ):
        assert a.dtype == b.dtype, path
        assert_close(b, a, f"output {path}")
    assert sum(g is not None for g in grads_o) > 0
    for variable, a, b in zip(variables, grads_o, grads_c):
        assert (a is None) == (b is None), variable.path
        if a is not None:
            assert float(tf.reduce_max(tf.abs(a))) > 0 or variable.path.endswith(
                "bias"
            ), f"zero gradient for {variable.path}: the check would be vacuous"
            assert_close(b, a, f"gradient of {variable.path}")
    for a, b in zip(in_o, in_c):
        assert_close(b, a, "input gradient")


def all_layers(model):
    return model._flatten_layers(include_self=True, recursive=True)


class Snapshot:
    """What "the model is unchanged" means: for the model and every layer in
    it, the same instance attributes (names and identities), the same
    variables with the same values, and `call` still the class's."""

    def __init__(self, model):
        self.model = model
        self.layers = list(all_layers(model))
        self.attributes = [dict(vars(layer)) for layer in self.layers]
        # Lists are changed in place (variables, nodes recorded by symbolic
        # calls): keep their contents too.
        self.lists = [
            {k: list(v) for k, v in vars(layer).items() if isinstance(v, list)}
            for layer in self.layers
        ]
        self.weights = [(w, np.array(w.numpy(), copy=True)) for w in model.weights]
        self.built = [layer.built for layer in self.layers]

    def assert_unchanged(self):
        model = self.model
        assert list(all_layers(model)) == self.layers
        for layer, before in zip(self.layers, self.attributes):
            after = vars(layer)
            assert set(after) == set(before), (
                f"{layer.name}: attributes added {set(after) - set(before)}, "
                f"removed {set(before) - set(after)}"
            )
            changed = [k for k in before if after[k] is not before[k]]
            assert not changed, f"{layer.name}: attributes replaced: {changed}"
            assert "call" not in after, f"{layer.name}.call was rebound"
        for layer, lists in zip(self.layers, self.lists):
            for name, contents in lists.items():
                now = vars(layer)[name]
                assert len(now) == len(contents) and all(
                    a is b for a, b in zip(now, contents)
                ), f"{layer.name}.{name} changed"
            assert layer.call.__func__ is type(layer).call
        assert [layer.built for layer in self.layers] == self.built
        assert len(model.weights) == len(self.weights)
        for (variable, value), now in zip(self.weights, model.weights):
            assert now is variable
            np.testing.assert_array_equal(variable.numpy(), value)


def fully_traced(converted):
    """No node of the graph is opaque."""
    assert converted.kip_report.opaque == {}, converted.kip_report.opaque
    assert not any(isinstance(l, kip.OpaqueLayer) for l in converted.layers)


def custom_layers_left(passed):
    """Nodes whose layer is neither Keras's nor the plugin's own."""
    return [
        node.name for node in passed.kip_graph.nodes
        if node.is_layer and not type(node.operation).__module__.startswith(
            ("keras.", "keras_ipu_plugin.")
        )
    ]


def _rand(*shape, seed=0):
    return np.random.RandomState(seed).normal(size=shape).astype("float32")


class Wrapper(keras.Model):
    def __init__(self, block, **kwargs):
        super().__init__(**kwargs)
        self.embed = keras.layers.Dense(8, name="embed")
        self.block = block
        self.head = keras.layers.Dense(2, name="head")

    def call(self, x):
        return self.head(self.block(self.embed(x)))


def expands_exactly_at_any_batch_size(block, tmp_path):
    """Convert and `Expand` a model around `block`; the expanded graph has
    no custom layer left and equals the original at other batch sizes and
    after saving and loading. Returns the expanded model."""
    x = _rand(4, 5, 3)
    model = Wrapper(block, name="wrapper")
    model(x)
    converted = kip.convert_to_functional(model, x)
    fully_traced(converted)
    passed = kip.apply_passes(converted, [Expand()])
    assert custom_layers_left(passed) == []
    assert passed.kip_report.opaque == {}, passed.kip_report.opaque
    assert_equivalent(model, passed, x)
    for batch in (1, 7):
        other = _rand(batch, 5, 3, seed=batch)
        np.testing.assert_allclose(passed(other), model(other), atol=1e-5)
    path = str(tmp_path / "passed.keras")
    passed.save(path)
    loaded = keras.models.load_model(path)
    other = _rand(6, 5, 3, seed=6)
    np.testing.assert_allclose(loaded(other), model(other), atol=1e-5)
    return passed
