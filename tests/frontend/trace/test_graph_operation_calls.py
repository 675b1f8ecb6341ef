"""Layers of a functional model called as Keras calls them when a trace runs
the model's graph (keras_hub's DINOv2 backbone stayed whole).

`Functional.call` hands `training` to every layer whose `call` takes it,
and Keras's symbolic call hands it on to the layer's `compute_output_spec`;
keras_hub's `DINOV2Embedding.compute_output_spec(self, inputs)` takes none
(Keras builds the model without `training`, so never calls it with one),
and tracing the backbone failed ("unexpected keyword argument 'training'").
The trace calls such a layer's `compute_output_spec` without it, while its
node keeps `training` for its `call`. Here a functional model, a
keras_hub-style functional subclass and a Sequential hold such a layer
(its `call` branching on `training` in Python and calling a `Dropout`, so
both modes differ and verification checks each): the model converts fully
traced, `Expand("all")` leaves no custom layer in any mode, its outputs
equal the original's in every mode, and `PluginModel(passes=[Expand("all")])`
trains 3 steps to the weights of plain Keras.
"""

import keras
import numpy as np
import pytest

import keras_ipu_plugin as kip
from keras_ipu_plugin.frontend.trace.trace_views import graph_operation
from keras_ipu_plugin.layers.user_code import viewed_layer
from keras_ipu_plugin.passes import Expand
from keras_ipu_plugin.runtime.mode_switch import ModeSwitch

from graph_checks import all_nodes, outputs_in_every_mode

layers = keras.layers
WIDTH = 6


class SpecTakesNoTraining(layers.Layer):
    """keras_hub's `DINOV2Embedding` pattern: `call(inputs, training=None)`,
    `compute_output_spec(self, inputs)`."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.project = layers.Dense(WIDTH, name="project")
        self.dropout = layers.Dropout(0.25, name="dropout")

    def call(self, inputs, training=None):
        x = self.project(inputs)
        if training:  # both modes in the graph: verification checks each
            x = x * 2.0
        return self.dropout(x, training=training)

    def compute_output_shape(self, input_shape):
        return (*input_shape[:-1], WIDTH)

    def compute_output_spec(self, inputs):
        return keras.KerasTensor(self.compute_output_shape(inputs.shape), dtype=self.compute_dtype)


class Backbone(keras.Model):
    """A functional subclass, as keras_hub writes its backbones."""

    def __init__(self, **kwargs):
        inputs = keras.Input((4,), name="features")
        embedding = SpecTakesNoTraining(name="embedding")
        outputs = layers.Dense(WIDTH, activation="relu", name="mix")(embedding(inputs))
        super().__init__(inputs=inputs, outputs=outputs, **kwargs)
        self.embedding = embedding


def _functional():
    inputs = keras.Input((4,), name="features")
    outputs = layers.Dense(WIDTH, activation="relu", name="mix")(
        SpecTakesNoTraining(name="embedding")(inputs))
    return keras.Model(inputs, outputs, name="backbone")


def _sequential():
    return keras.Sequential([keras.Input((4,)), SpecTakesNoTraining(name="embedding"),
                             layers.Dense(WIDTH, activation="relu", name="mix")],
                            name="backbone")


BACKBONES = {"functional": _functional, "functional_subclass": lambda: Backbone(name="backbone"),
             "sequential": _sequential}


class FineTuned(keras.Model):
    """A subclassed model over the backbone, as users fine-tune one."""

    def __init__(self, backbone, **kwargs):
        super().__init__(**kwargs)
        self.backbone = backbone
        self.head = layers.Dense(1, name="head")

    def call(self, inputs, training=None):
        return self.head(self.backbone(inputs, training=training))


def _data(rows=24, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(rows, 4)).astype("float32"),
            rng.normal(size=(rows, 1)).astype("float32"))


def _built(kind, seed=3):
    keras.utils.set_random_seed(seed)
    model = FineTuned(BACKBONES[kind](), name="fine_tuned")
    model(_data()[0][:2])
    return model


@pytest.mark.parametrize("kind", sorted(BACKBONES))
def test_a_graph_layer_whose_output_spec_takes_no_training_expands_in_both_modes(kind):
    model = _built(kind)
    x, _ = _data()
    converted = kip.convert_to_functional(model, x)
    assert not converted.kip_report.opaque
    expanded = kip.apply_passes(converted, [Expand("all")])
    nodes = all_nodes(expanded.kip_graph)
    assert not [n.name for n in nodes if n.opaque_reason]
    left = [n.name for n in nodes if n.is_layer and not isinstance(n.operation, ModeSwitch)
            and not type(n.operation).__module__.startswith(("keras.", "keras_ipu_plugin."))]
    assert left == []
    # Expand reached inside the embedding, in each mode of its switch.
    assert any(isinstance(n.operation, ModeSwitch) for n in nodes)
    assert any(n.operation is model.backbone.get_layer("embedding").project for n in nodes)
    assert "training=True" in str(expanded.kip_report)
    outputs_in_every_mode(model, expanded, x)
    # Another batch size than the conversion's.
    other = _data(5, seed=1)[0]
    np.testing.assert_allclose(expanded(other, training=False), model(other, training=False),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", sorted(BACKBONES))
def test_plugin_model_with_expand_trains_as_plain_keras(kind):
    x, y = _data(24)
    weights = {}
    for how in ("plain", "plugin"):
        model = _built(kind, seed=11)
        trained = model
        if how == "plugin":
            trained = kip.PluginModel(model, passes=[Expand("all")])
            trained.convert(x[:8])
            assert not trained.converted.kip_report.opaque
        trained.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
        keras.utils.set_random_seed(7)
        trained.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)  # 3 steps
        weights[how] = [v.numpy() for v in model.weights]
    assert len(weights["plain"]) == len(weights["plugin"])
    for expected, actual in zip(weights["plain"], weights["plugin"]):
        np.testing.assert_allclose(actual, expected, rtol=0, atol=1e-5)
    first = _built(kind, seed=11)
    assert any(not np.allclose(v.numpy(), value) for v, value in
               zip(first.trainable_weights, weights["plain"])), "training moved no weight"


def test_only_a_layer_whose_output_spec_refuses_training_is_called_through_a_view():
    model = _built("functional")
    embedding = model.backbone.get_layer("embedding")
    mix = model.backbone.get_layer("mix")
    assert graph_operation(mix) is mix  # Keras's own: its spec takes what call takes

    class TakesNoTraining(SpecTakesNoTraining):
        def call(self, inputs):  # Keras itself hands it no `training`
            return self.project(inputs)

    plain = TakesNoTraining()
    assert graph_operation(plain) is plain
    before = (type(embedding), set(vars(embedding)))
    view = graph_operation(embedding)
    assert view is not embedding and viewed_layer(view) is embedding
    assert isinstance(view, SpecTakesNoTraining)
    spec = view.compute_output_spec(keras.KerasTensor((None, 4)), training=True)
    assert tuple(spec.shape) == (None, WIDTH)
    with pytest.raises(TypeError, match="training"):  # the layer itself refuses it
        embedding.compute_output_spec(keras.KerasTensor((None, 4)), training=True)
    assert (type(embedding), set(vars(embedding))) == before  # the user's layer is unchanged
