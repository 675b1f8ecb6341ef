"""Follows the keras-rs example "Rank with Deep and Cross Network (DCN)"
(keras-rs, github.com/keras-team/keras-rs/blob/main/examples/dcn.py): a
MovieLens ranking model taking a dict of integer features (movie, user,
gender, age bucket), one `Embedding` per feature, the embeddings
concatenated, then feature crosses (a `FeatureCross` layer computing
`x0 * dense(x) + x`, with a low-rank projection where `projection_dim` is
set, as keras-rs's `FeatureCross`) and a deep network of `Dense` layers,
regressing the rating. The example builds it with a function of the
functional API; this port holds the same parts in a subclassed model, the
cross and deep networks as `keras.Sequential`s (as the example's toy
models are), stacked. (keras-rs is not a dependency here: the
`FeatureCross` layer is written here after keras-rs's formula.) Tiny
sizes: vocabularies of 6 to 10, embeddings of 4, one cross layer of
projection 2 and a deep network of 8 and 8.
"""

import keras
import numpy as np
from keras import layers
from keras import ops

VOCABULARIES = {"movie_id": 10, "user_id": 8, "user_gender": 2, "bucketized_user_age": 6}
EMBEDDING, PROJECTION, DEEP = 4, 2, (8, 8)
NO_NORM_LAYERS = True


class FeatureCross(layers.Layer):
    """One cross layer: `x0 * (W x + b) + x` (W of low rank when
    `projection_dim` is set)."""

    def __init__(self, projection_dim=None, diag_scale=0.0, use_bias=True, **kwargs):
        super().__init__(**kwargs)
        self.projection_dim = projection_dim
        self.diag_scale = diag_scale
        self.use_bias = use_bias

    def build(self, input_shape):
        last_dim = input_shape[-1]
        if self.projection_dim is not None:
            self.down_proj_dense = layers.Dense(self.projection_dim, use_bias=False)
        self.dense = layers.Dense(last_dim, use_bias=self.use_bias)
        self.built = True

    def call(self, x0, x=None):
        if x is None:
            x = x0
        output = x if self.projection_dim is None else self.down_proj_dense(x)
        output = ops.cast(self.dense(output), self.compute_dtype)
        if self.diag_scale:
            output = ops.add(output, ops.multiply(self.diag_scale, x))
        return ops.add(ops.multiply(x0, output), x)


class DeepCrossNetwork(keras.Model):
    def __init__(self, vocabularies, embedding_dim, projection_dim, deep_units, **kwargs):
        super().__init__(**kwargs)
        self.embeddings = {
            name: layers.Embedding(input_dim=size + 1, output_dim=embedding_dim, name=f"{name}_emb")
            for name, size in vocabularies.items()
        }
        self.cross_network = keras.Sequential([FeatureCross(projection_dim=projection_dim)])
        self.deep_network = keras.Sequential(
            [layers.Dense(units, activation="relu") for units in deep_units] + [layers.Dense(1)])

    def call(self, inputs):
        x = ops.concatenate([self.embeddings[name](inputs[name]) for name in self.embeddings],
                            axis=1)
        return self.deep_network(self.cross_network(x))


def build():
    return DeepCrossNetwork(VOCABULARIES, EMBEDDING, PROJECTION, DEEP, name="dcn")


def data(batch):
    rng = np.random.RandomState(0)
    x = {name: rng.randint(0, size + 1, size=(batch,)).astype("int32")
         for name, size in VOCABULARIES.items()}
    return x, rng.uniform(1, 5, size=(batch, 1)).astype("float32")


def compile_kwargs():
    return {
        "loss": keras.losses.MeanSquaredError(),
        "optimizer": keras.optimizers.AdamW(learning_rate=0.01),
        "metrics": [keras.metrics.RootMeanSquaredError()],
    }
