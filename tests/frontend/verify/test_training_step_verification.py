"""Verification covers what a training step writes, not only outputs and
gradients: a converted or passed graph that computes the same outputs and
gradients but loses a BatchNormalization layer's moving statistics (or a
counter, or a seed generator's draw) in training is refused, naming the
variable and its layer. And an image backbone whose custom layers pass
`training=training` down to BatchNormalization, inside a functional model
nested in a subclassed classifier, trains through `Expand("all")` with every
statistic equal to plain Keras.
"""

import keras
import numpy as np
import pytest
from keras import layers

import keras_ipu_plugin as kip
from keras_ipu_plugin.passes import Expand


class ConvNorm(layers.Layer):
    def __init__(self, filters, **kwargs):
        super().__init__(**kwargs)
        self.conv = layers.Conv2D(filters, 3, padding="same", use_bias=False)
        self.norm = layers.BatchNormalization(momentum=0.5)

    def call(self, x, training=None):
        return keras.ops.relu(self.norm(self.conv(x), training=training))


class Residual(layers.Layer):
    def __init__(self, filters, **kwargs):
        super().__init__(**kwargs)
        self.first = ConvNorm(filters)
        self.second = ConvNorm(filters)

    def call(self, x, training=None):
        return x + self.second(self.first(x, training=training), training=training)


def backbone():
    """A feature pyramid, as keras_hub's image backbones return: a dict of
    the stem's and each stage's feature map."""
    inputs = keras.Input((8, 8, 3))
    stem = ConvNorm(4)(inputs)
    stage1 = Residual(4)(stem)
    stage2 = layers.BatchNormalization()(Residual(4)(stage1))
    return keras.Model(inputs, {"stem": stem, "stage1": stage1, "stage2": stage2},
                       name="backbone")


class Classifier(keras.Model):
    """Classifies one feature map of the backbone (`feature`); the later
    stages' outputs are not read, and plain Keras still runs them in
    training, moving their statistics."""

    def __init__(self, make_backbone=backbone, feature="stage1", **kwargs):
        super().__init__(**kwargs)
        self.backbone = make_backbone()
        self.feature = feature
        self.pool = layers.GlobalAveragePooling2D()
        self.head = layers.Dense(3)

    def call(self, x, training=None):
        features = self.backbone(x, training=training)[self.feature]
        return self.head(self.pool(features))


class _StatisticsDropped(layers.Layer):
    """BatchNormalization computed as in training, its moving statistics
    never written: what a faulty pass could leave."""

    def __init__(self, norm, **kwargs):
        super().__init__(name=norm.name + "_no_update", **kwargs)
        self.norm = norm

    def call(self, x, training=None, mask=None):
        with keras.StatelessScope():  # the statistics' assigns go nowhere
            return self.norm(x, training=training, mask=mask)


class DropStatistics(kip.passes.Pass):
    """Swaps every BatchNormalization node for `_StatisticsDropped`."""

    def run(self, graph, report):
        graph = graph.copy()
        for node in graph.nodes:
            if isinstance(node.operation, layers.BatchNormalization):
                node.operation = _StatisticsDropped(node.operation)
        return graph


def _data(rows=16, size=8):
    rng = np.random.RandomState(0)
    return rng.rand(rows, size, size, 3).astype("float32"), rng.randint(0, 3, rows)


def test_a_pass_that_drops_statistics_updates_is_refused():
    """Outputs and gradients of the passed graph equal the original's in
    inference; its training step leaves the moving statistics alone, and
    `apply_passes` refuses it, naming the variable and its layer."""
    keras.utils.set_random_seed(3)
    model = Classifier(name="classifier")
    x, _ = _data()
    converted = kip.convert_to_functional(model, x)
    with pytest.raises((kip.PassError, kip.ConversionError),
                       match=r"training step.*moving_(mean|variance)` \(layer `[^`]*batch_normalization`\)"):
        kip.apply_passes(converted, [Expand("all"), DropStatistics()])


def test_verification_reports_the_training_step():
    """The report says the training step was compared and how many
    variables it writes (two statistics per BatchNormalization layer)."""
    keras.utils.set_random_seed(3)
    model = Classifier(name="classifier")
    x, _ = _data()
    converted = kip.convert_to_functional(model, x)
    verification = converted.kip_report.verifications[-1] if hasattr(
        converted.kip_report, "verifications") else None
    text = str(converted.kip_report) if verification is None else verification.describe()
    assert "training step (training=True): outputs and 12 variable(s) it writes equal" in text


def _hgnet_backbone():
    keras_hub = pytest.importorskip("keras_hub")
    return keras_hub.models.HGNetV2Backbone(
        depths=[1, 1], embedding_size=8, hidden_sizes=[8, 8], stem_channels=[3, 4, 8],
        hidden_act="relu", use_learnable_affine_block=False,
        stackwise_stage_filters=[(8, 4, 8, 1, 1, 3), (8, 4, 8, 1, 1, 3)],
        apply_downsample=[False, True], use_lightweight_conv_block=[False, True],
        image_shape=(16, 16, 3))


def _fit(make_backbone, size, passes):
    keras.utils.set_random_seed(5)
    model = Classifier(make_backbone, name="classifier")
    fitter = model if passes is None else kip.PluginModel(model, passes=passes)
    fitter.compile(optimizer="sgd",
                   loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = _data(size=size)
    fitter.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    return model.variables


@pytest.mark.parametrize("make_backbone,size", [(backbone, 8), (_hgnet_backbone, 16)],
                         ids=["hand_written", "keras_hub_hgnetv2"])
def test_expanded_backbone_moves_every_statistic_as_plain_keras(make_backbone, size):
    """Every variable, moving statistics included, equals plain Keras after
    training through `PluginModel(passes=[Expand("all")])`."""
    plain = _fit(make_backbone, size, None)
    expanded = _fit(make_backbone, size, [Expand("all")])
    assert len(plain) == len(expanded)
    moved = 0
    for expected, actual in zip(plain, expanded):
        np.testing.assert_allclose(np.asarray(actual), np.asarray(expected), rtol=1e-4,
                                   atol=1e-5, err_msg=expected.path)
        moved += "moving_mean" in expected.path
    assert moved >= 5
