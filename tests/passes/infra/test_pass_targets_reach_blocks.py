"""Class and name targets reach nested blocks and survive Expand.

A ViT-style model whose transformer blocks sit inside an `Encoder` layer:
`Recompute(TransformerEncoder)` used to match nothing (the blocks are not
nodes of the converted graph), and after `Expand` no node had the block's
class any more. A target now reaches a block wherever it sits (the layers
holding it are expanded, as `Replace` does), and names an expanded block by
its path, its layer's name or its class: Recompute checkpoints after the
block's last node, Outline outlines its layers, PipelineStages stages them.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_ipu_plugin as kip
from keras_ipu_plugin.passes import Expand
from keras_ipu_plugin.passes import Outline
from keras_ipu_plugin.passes import PipelineStages
from keras_ipu_plugin.passes import Recompute

layers = keras.layers

DEPTH = 3


class TransformerEncoder(layers.Layer):
    """Pre-norm block: attention and an MLP, each with a residual."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.norm_1 = layers.LayerNormalization(name="norm_1")
        self.attention = layers.MultiHeadAttention(num_heads=2, key_dim=4, name="attention")
        self.norm_2 = layers.LayerNormalization(name="norm_2")
        self.mlp_1 = layers.Dense(32, activation="gelu", name="mlp_1")
        self.mlp_2 = layers.Dense(8, name="mlp_2")

    def call(self, x):
        h = self.norm_1(x)
        x = x + self.attention(h, h)
        return x + self.mlp_2(self.mlp_1(self.norm_2(x)))


class Encoder(layers.Layer):
    """Holds the blocks: they are not nodes of the converted graph."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.blocks = [TransformerEncoder(name=f"block_{i}") for i in range(DEPTH)]
        self.norm = layers.LayerNormalization(name="norm")

    def call(self, x):
        for block in self.blocks:
            x = block(x)
        return self.norm(x)


class ViT(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.patches = layers.Conv2D(8, 4, strides=4, name="patches")
        self.tokens = layers.Reshape((4, 8), name="tokens")
        self.encoder = Encoder(name="encoder")
        self.pool = layers.GlobalAveragePooling1D(name="pool")
        self.head = layers.Dense(3, name="head")

    def call(self, images):
        return self.head(self.pool(self.encoder(self.tokens(self.patches(images)))))


@pytest.fixture(scope="module")
def vit():
    images = np.random.default_rng(0).normal(size=(8, 8, 8, 3)).astype("float32")
    model = ViT(name="vit")
    model(images)
    return model, kip.convert_to_functional(model, images), images


def _checkpoints(passed):
    """The paths of the nodes checkpointed, from the model's annotations
    (keyed by Keras layer name)."""
    return sorted(node.name for node in passed.kip_graph.nodes if passed.kip_annotations.get(
        passed.kip_layer_paths.get(node.name, node.name), {}).get("recompute"))


def _gradients_equal(model, passed, images):
    @tf.function
    def gradients(net):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(net(images, training=True) ** 2)
        return tape.gradient(loss, model.trainable_variables)

    for variable, e, a in zip(model.trainable_variables, gradients(model), gradients(passed)):
        np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-5, err_msg=variable.path)


def test_class_target_reaches_blocks_inside_another_layer(vit):
    model, converted, images = vit
    assert [n.name for n in converted.kip_graph.nodes if n.name.startswith("encoder")] == [
        "encoder"
    ]
    passed = kip.apply_passes(converted, [Recompute(TransformerEncoder)])
    assert _checkpoints(passed) == [f"encoder.blocks.{i}" for i in range(DEPTH)]
    # The encoder was expanded to reach them, and the report says so.
    assert "encoder" in passed.kip_report.touched("recompute")
    kip.frontend.verify.equivalence.check_equivalent(model, passed, images)
    _gradients_equal(model, passed, images)
    passed(images)
    assert sum(s.recompute for s in passed.kip_interpreter().steps) >= DEPTH - 1


def test_class_target_after_expand_checkpoints_at_the_end_of_each_expanded_block(vit):
    model, converted, images = vit
    passed = kip.apply_passes(converted, [Expand(), Recompute(TransformerEncoder)])
    graph = passed.kip_graph
    assert not any(isinstance(n.operation, TransformerEncoder) for n in graph.nodes)
    ends = []
    for i in range(DEPTH):
        block_nodes = [n.name for n in graph.nodes if n.name.startswith(f"encoder.blocks.{i}.")]
        ends.append(block_nodes[-1])  # the block's output (its last residual add)
    assert _checkpoints(passed) == sorted(ends)
    assert all(
        [b.path for b in graph.node(end).from_blocks] == ["encoder", f"encoder.blocks.{i}"]
        for i, end in enumerate(ends)
    )
    kip.frontend.verify.equivalence.check_equivalent(model, passed, images)
    _gradients_equal(model, passed, images)
    passed(images)
    segments = passed.kip_interpreter().steps
    checkpointed = [s.nodes[-1].name for s in segments if s.recompute]
    assert set(checkpointed) <= set(ends) and checkpointed


@pytest.mark.parametrize("target", ["block_1", "encoder.blocks.1"])
def test_name_target_after_expand_means_the_expanded_block(vit, target):
    model, converted, images = vit
    passed = kip.apply_passes(converted, [Expand(), Recompute(target)])
    block_nodes = [n.name for n in passed.kip_graph.nodes if n.name.startswith("encoder.blocks.1.")]
    assert _checkpoints(passed) == [block_nodes[-1]]
    kip.frontend.verify.equivalence.check_equivalent(model, passed, images)


def test_outline_of_an_expanded_block_class_outlines_its_layers(vit):
    model, converted, images = vit
    passed = kip.apply_passes(converted, [Expand(), Outline(TransformerEncoder)])
    outlined = sorted(path for path, name in passed.kip_layer_paths.items()
                      if "outline" in passed.kip_annotations.get(name, {}))
    expected = sorted(
        f"encoder.blocks.{i}.{layer}" for i in range(DEPTH)
        for layer in ("norm_1", "attention", "norm_2", "mlp_1", "mlp_2")
    )
    assert outlined == expected
    kip.frontend.verify.equivalence.check_equivalent(model, passed, images)
    # One body per kind of layer, shared by the three blocks (per mode for
    # the attention, whose dropout reads the training mode).
    bodies = passed.kip_interpreter().effects["outline"].bodies
    assert len({key[:3] for key in bodies}) == 4  # norm, attention, mlp_1, mlp_2


def test_pipeline_stages_of_expanded_blocks_cover_all_their_nodes(vit):
    model, converted, images = vit
    passed = kip.apply_passes(
        converted, [Expand(), PipelineStages([["block_0"], ["encoder.blocks.1", "block_2"]])]
    )
    stages = passed.kip_stages  # by node path
    for node in passed.kip_graph.nodes:
        if node.name.startswith("encoder.blocks.0."):
            assert stages[node.name] == 0, node.name
        elif node.name.startswith(("encoder.blocks.1.", "encoder.blocks.2.")):
            assert stages[node.name] == 1, node.name
    np.testing.assert_allclose(passed(images), model(images), atol=1e-5)


def test_expand_by_class_reaches_blocks_inside_another_layer(vit):
    model, converted, images = vit
    passed = kip.apply_passes(converted, [Expand(TransformerEncoder)])
    names = [n.name for n in passed.kip_graph.nodes]
    assert "encoder.blocks.0.mlp_1" in names and "encoder.norm" in names
    assert not any(isinstance(n.operation, (TransformerEncoder, Encoder))
                   for n in passed.kip_graph.nodes)
    kip.frontend.verify.equivalence.check_equivalent(model, passed, images)


def test_a_block_inside_a_layer_that_cannot_be_expanded_is_a_clear_error():
    class Opaque(layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.block = TransformerEncoder(name="inner")

        def call(self, x):
            if tf.reduce_sum(x) > 0:  # Python control flow on a tensor: opaque
                return self.block(x)
            return x

    class Net(keras.Model):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.opaque = Opaque(name="opaque")

        def call(self, x):
            return self.opaque(x)

    x = np.ones((2, 4, 8), "float32")
    model = Net(name="net")
    model(x)
    converted = kip.convert_to_functional(model, x)
    with pytest.raises(kip.PassError, match="inside layer `opaque`"):
        kip.apply_passes(converted, [Recompute(TransformerEncoder)])
