"""A traced layer's body receives its inputs as Keras's `Layer.__call__`
hands them to `call`: cast to the layer's compute dtype where its policy
autocasts. Without the cast, `Expand` computed a `mixed_float16` layer's
body in its float32 input's dtype: the same ops with other rounding,
within verification's mixed-precision tolerance, so nothing said so."""

import keras
import numpy as np
import pytest

import keras_ipu_plugin as kip


class Scaled(keras.layers.Layer):
    def build(self, shape):
        self.scale = self.add_weight(shape=(shape[-1],), initializer="ones")

    def call(self, x):
        return x * self.scale + 1.0


class Block(keras.layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.scaled = Scaled(dtype="mixed_float16")

    def call(self, x):
        return self.scaled(x) * 3.0


class Net(keras.Model):
    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(4)
        self.block = Block()
        self.head = keras.layers.Dense(1)

    def call(self, x):
        return self.head(self.block(self.dense(x) * 1.1))


@pytest.fixture
def policy():
    yield keras.config.set_dtype_policy
    keras.config.set_dtype_policy("float32")


@pytest.mark.parametrize("global_policy", ["float32", "mixed_float16", "mixed_bfloat16"])
def test_an_expanded_layer_computes_in_its_own_policy_as_keras_calls_it(policy, global_policy):
    policy(global_policy)
    x = np.random.default_rng(0).random((8, 3)).astype("float32") * 100
    model = Net()
    expected = np.asarray(model(x))
    converted = kip.convert_to_functional(model, x)
    expanded = kip.apply_passes(converted, [kip.passes.Expand("all")])
    np.testing.assert_array_equal(np.asarray(expanded(x)), expected)
    nodes = {node.name: node for node in expanded.kip_graph.nodes}
    assert "block.scaled.multiply" in nodes  # the layer's body is in the graph
    casts = [node for node in nodes.values() if type(node.operation).__name__ == "Cast"]
    assert casts, "no node casts an input to the dtype its layer computes in"
