"""Follows the Keras example "Classification with Gated Residual and
Variable Selection Networks" (Khalid Salama,
keras.io/examples/structured_data/classification_with_grn_and_vsn/): a
functional model over one input per feature, named after the feature; an
encoding layer holding, per categorical feature, an `Embedding` named after
its feature ("education", as the model input is: Expand and
Replace failed with "The name "education" is used 2 times") and, per
numeric feature, a `Dense` projection; a `VariableSelection` of
`GatedResidualNetwork`s (a `GatedLinearUnit`, dropout, LayerNormalization,
a projection where the widths differ) weighting the features by a softmax;
and a sigmoid output. The example's string lookups belong to its input
pipeline; here the categorical features arrive as integer indices. Tiny
sizes: one categorical feature (4 values) and one numeric, encodings of 4.
"""

import keras
import numpy as np
from keras import layers
from keras import ops

CATEGORICAL = {"education": 4}
NUMERIC = ("age",)
FEATURES = tuple(CATEGORICAL) + NUMERIC
ENCODING, DROPOUT = 4, 0.1


class GatedLinearUnit(layers.Layer):
    def __init__(self, num_units, **kwargs):
        super().__init__(**kwargs)
        self.linear = layers.Dense(num_units)
        self.sigmoid = layers.Dense(num_units, activation="sigmoid")

    def call(self, inputs):
        return self.linear(inputs) * self.sigmoid(inputs)


class GatedResidualNetwork(layers.Layer):
    def __init__(self, num_units, dropout_rate, **kwargs):
        super().__init__(**kwargs)
        self.num_units = num_units
        self.elu_dense = layers.Dense(num_units, activation="elu")
        self.linear_dense = layers.Dense(num_units)
        self.dropout = layers.Dropout(dropout_rate)
        self.gated_linear_unit = GatedLinearUnit(num_units)
        self.layer_norm = layers.LayerNormalization()
        self.project = layers.Dense(num_units)

    def call(self, inputs):
        x = self.elu_dense(inputs)
        x = self.linear_dense(x)
        x = self.dropout(x)
        if inputs.shape[-1] != self.num_units:
            inputs = self.project(inputs)
        x = inputs + self.gated_linear_unit(x)
        x = self.layer_norm(x)
        return x


class VariableSelection(layers.Layer):
    def __init__(self, num_features, units, dropout_rate, **kwargs):
        super().__init__(**kwargs)
        self.grns = [GatedResidualNetwork(units, dropout_rate) for _ in range(num_features)]
        self.grn_concat = GatedResidualNetwork(units, dropout_rate)
        self.softmax = layers.Dense(units=num_features, activation="softmax")

    def call(self, inputs):
        v = layers.concatenate(inputs)
        v = self.grn_concat(v)
        v = ops.expand_dims(self.softmax(v), axis=-1)
        x = []
        for idx, input_ in enumerate(inputs):
            x.append(self.grns[idx](input_))
        x = ops.stack(x, axis=1)
        outputs = ops.squeeze(ops.matmul(ops.transpose(v, axes=[0, 2, 1]), x), axis=1)
        return outputs


class FeatureEncoder(layers.Layer):
    """The example's `encode_inputs`: one `Embedding` per categorical
    feature, named after it, and one `Dense` per numeric feature."""

    def __init__(self, encoding_size, **kwargs):
        super().__init__(**kwargs)
        self.embeddings = {
            name: layers.Embedding(input_dim=size, output_dim=encoding_size, name=name)
            for name, size in CATEGORICAL.items()
        }
        self.projections = {name: layers.Dense(encoding_size, name=f"{name}_dense")
                            for name in NUMERIC}

    def call(self, inputs):
        encoded = []
        for name in FEATURES:
            if name in self.embeddings:
                encoded.append(self.embeddings[name](inputs[name]))
            else:
                encoded.append(self.projections[name](ops.expand_dims(inputs[name], -1)))
        return encoded


def build():
    inputs = {
        name: layers.Input(name=name, shape=(), dtype="int32" if name in CATEGORICAL else "float32")
        for name in FEATURES
    }
    features = FeatureEncoder(ENCODING)(inputs)
    features = VariableSelection(len(FEATURES), ENCODING, DROPOUT)(features)
    outputs = layers.Dense(units=1, activation="sigmoid")(features)
    return keras.Model(inputs=inputs, outputs=outputs, name="grn_vsn")


def data(batch):
    rng = np.random.RandomState(0)
    x = {name: rng.randint(0, size, size=batch).astype("int32")
         for name, size in CATEGORICAL.items()}
    x.update({name: rng.rand(batch).astype("float32") for name in NUMERIC})
    return x, rng.randint(0, 2, size=(batch, 1)).astype("float32")


def compile_kwargs():
    return {"optimizer": keras.optimizers.Adam(learning_rate=0.001),
            "loss": keras.losses.BinaryCrossentropy()}
