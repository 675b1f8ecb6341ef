"""Follows the Keras example "Collaborative Filtering for Movie
Recommendations" (Siddhartha Banerjee,
keras.io/examples/structured_data/collaborative_filtering_movielens/): a
subclassed `RecommenderNet` with user and movie embeddings (L2-regularised)
and per-user / per-movie bias embeddings, reading the user and movie ids
as columns of one int input, scoring each pair by the dot product of the
embeddings plus the biases, through a sigmoid. (The example's
`ops.tensordot(u, m, 2)` contracts the batch too; this port takes the
per-row dot product the example intends.) Tiny sizes: 10 users, 12
movies, embeddings of 4.
"""

import keras
import numpy as np
from keras import layers
from keras import ops

USERS, MOVIES, EMBEDDING = 10, 12, 4
NO_NORM_LAYERS = True


class RecommenderNet(keras.Model):
    def __init__(self, num_users, num_movies, embedding_size, **kwargs):
        super().__init__(**kwargs)
        self.num_users = num_users
        self.num_movies = num_movies
        self.embedding_size = embedding_size
        self.user_embedding = layers.Embedding(
            num_users, embedding_size, embeddings_initializer="he_normal",
            embeddings_regularizer=keras.regularizers.l2(1e-6),
        )
        self.user_bias = layers.Embedding(num_users, 1)
        self.movie_embedding = layers.Embedding(
            num_movies, embedding_size, embeddings_initializer="he_normal",
            embeddings_regularizer=keras.regularizers.l2(1e-6),
        )
        self.movie_bias = layers.Embedding(num_movies, 1)

    def call(self, inputs):
        user_vector = self.user_embedding(inputs[:, 0])
        user_bias = self.user_bias(inputs[:, 0])
        movie_vector = self.movie_embedding(inputs[:, 1])
        movie_bias = self.movie_bias(inputs[:, 1])
        dot_user_movie = ops.sum(user_vector * movie_vector, axis=1, keepdims=True)
        x = dot_user_movie + user_bias + movie_bias
        return ops.nn.sigmoid(x)


def build():
    return RecommenderNet(USERS, MOVIES, EMBEDDING, name="recommender")


def data(batch):
    rng = np.random.RandomState(0)
    x = np.stack([rng.randint(0, USERS, size=batch), rng.randint(0, MOVIES, size=batch)], axis=1)
    return x.astype("int64"), rng.rand(batch, 1).astype("float32")


def compile_kwargs():
    return {
        "loss": keras.losses.BinaryCrossentropy(),
        "optimizer": keras.optimizers.Adam(learning_rate=0.001),
    }
