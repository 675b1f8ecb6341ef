"""Follows the keras-rs example "List-wise ranking" (keras-rs,
github.com/keras-team/keras-rs/blob/main/examples/listwise_ranking.py): a
subclassed `RankingModel` with its own `build` (building its sub-layers
from the input dict's shapes), a user embedding repeated along the list of
candidate movies (`ops.repeat(..., repeats=ops.shape(movie_id)[-1])`),
concatenated with the candidates' embeddings and scored by a `ratings`
MLP (a `keras.Sequential`), trained with a pairwise hinge loss over the
list. (keras-rs is not a dependency here: the loss is written here after
keras-rs's `PairwiseHingeLoss`, without its masks.) Tiny sizes: 6 users,
10 movies, lists of 4, embeddings of 4, an MLP of 8 and 4.
"""

import keras
import numpy as np
from keras import layers
from keras import ops

USERS, MOVIES, LIST, EMBEDDING = 6, 10, 4, 4
NO_NORM_LAYERS = True


class RankingModel(keras.Model):
    def __init__(self, num_users, num_candidates, embedding_dimension=32, **kwargs):
        super().__init__(**kwargs)
        self.user_embedding = layers.Embedding(num_users, embedding_dimension)
        self.candidate_embedding = layers.Embedding(num_candidates, embedding_dimension)
        self.ratings = keras.Sequential([
            layers.Dense(8, activation="relu"),
            layers.Dense(4, activation="relu"),
            layers.Dense(1),
        ])

    def build(self, input_shape):
        self.user_embedding.build(input_shape["user_id"])
        self.candidate_embedding.build(input_shape["movie_id"])
        output_shape = self.candidate_embedding.compute_output_shape(input_shape["movie_id"])
        self.ratings.build(list(output_shape[:-1]) + [2 * output_shape[-1]])

    def call(self, inputs):
        user_id, movie_id = inputs["user_id"], inputs["movie_id"]
        user_embeddings = self.user_embedding(user_id)
        candidate_embeddings = self.candidate_embedding(movie_id)
        list_length = ops.shape(movie_id)[-1]
        user_embeddings_repeated = ops.repeat(
            ops.expand_dims(user_embeddings, axis=1), repeats=list_length, axis=1)
        concatenated = ops.concatenate([user_embeddings_repeated, candidate_embeddings], axis=-1)
        return ops.squeeze(self.ratings(concatenated), axis=-1)

    def compute_output_shape(self, input_shape):
        return (input_shape["user_id"][0], input_shape["movie_id"][1])


class PairwiseHingeLoss(keras.losses.Loss):
    """`max(0, 1 - (s_i - s_j))` over the pairs of a list where item i is
    rated above item j, averaged over those pairs."""

    def call(self, y_true, y_pred):
        true_diff = ops.expand_dims(y_true, -1) - ops.expand_dims(y_true, -2)
        pred_diff = ops.expand_dims(y_pred, -1) - ops.expand_dims(y_pred, -2)
        pairs = ops.cast(true_diff > 0, y_pred.dtype)
        losses = ops.relu(1.0 - pred_diff) * pairs
        return ops.sum(losses, axis=(-2, -1)) / ops.maximum(ops.sum(pairs, axis=(-2, -1)), 1.0)


def build():
    return RankingModel(USERS, MOVIES, EMBEDDING, name="listwise_ranking")


def data(batch):
    rng = np.random.RandomState(0)
    x = {"user_id": rng.randint(0, USERS, size=(batch,)).astype("int32"),
         "movie_id": rng.randint(0, MOVIES, size=(batch, LIST)).astype("int32")}
    return x, rng.randint(1, 6, size=(batch, LIST)).astype("float32")


def compile_kwargs():
    return {
        "loss": PairwiseHingeLoss(),
        "optimizer": keras.optimizers.Adagrad(learning_rate=0.1),
    }
