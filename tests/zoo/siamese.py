"""Follows the Keras example "Image similarity estimation using a Siamese
Network with a triplet loss" (Hazem Essam and Santiago L. Valdarrama,
keras.io/examples/vision/siamese_network/): a functional embedding network
named "Embedding" (a small CNN here instead of the example's ResNet50)
shared by three inputs, a `DistanceLayer` taking three tensors as
positional arguments and returning two distances, a functional
`siamese_network` over (anchor, positive, negative), and a `SiameseModel`
whose own `train_step` / `test_step` call its helper `_compute_loss`
(the example's name) for the triplet loss and track it with a `Mean`
metric. The training data yields (anchor, positive, negative) triples with
no labels, as the example's dataset does. Tiny sizes: 16x16 images,
embeddings of 8.
"""

import keras
import numpy as np
import tensorflow as tf
from keras import layers
from keras import ops

IMAGE, EMBEDDING = 16, 8
NO_NORM_LAYERS = True  # BatchNormalization only: not of the LayerNormalization family


def make_embedding():
    inputs = keras.Input(shape=(IMAGE, IMAGE, 3))
    x = layers.Conv2D(8, 3, activation="relu")(inputs)
    x = layers.BatchNormalization()(x)
    x = layers.GlobalAveragePooling2D()(x)
    x = layers.Dense(16, activation="relu")(x)
    x = layers.BatchNormalization()(x)
    outputs = layers.Dense(EMBEDDING)(x)
    return keras.Model(inputs, outputs, name="Embedding")


class DistanceLayer(layers.Layer):
    """Computes the distance between the anchor embedding and the positive
    embedding, and between the anchor embedding and the negative embedding."""

    def call(self, anchor, positive, negative):
        ap_distance = ops.sum(tf.square(anchor - positive), -1)
        an_distance = ops.sum(tf.square(anchor - negative), -1)
        return (ap_distance, an_distance)


def make_siamese_network(embedding):
    anchor_input = layers.Input(name="anchor", shape=(IMAGE, IMAGE, 3))
    positive_input = layers.Input(name="positive", shape=(IMAGE, IMAGE, 3))
    negative_input = layers.Input(name="negative", shape=(IMAGE, IMAGE, 3))
    distances = DistanceLayer()(
        embedding(anchor_input), embedding(positive_input), embedding(negative_input)
    )
    return keras.Model(inputs=[anchor_input, positive_input, negative_input], outputs=distances)


class SiameseModel(keras.Model):
    def __init__(self, siamese_network, margin=0.5, **kwargs):
        super().__init__(**kwargs)
        self.siamese_network = siamese_network
        self.margin = margin
        self.loss_tracker = keras.metrics.Mean(name="loss")

    def call(self, inputs):
        return self.siamese_network(inputs)

    def train_step(self, data):
        with tf.GradientTape() as tape:
            loss = self._compute_loss(data)
        gradients = tape.gradient(loss, self.siamese_network.trainable_weights)
        self.optimizer.apply_gradients(zip(gradients, self.siamese_network.trainable_weights))
        self.loss_tracker.update_state(loss)
        return {"loss": self.loss_tracker.result()}

    def test_step(self, data):
        loss = self._compute_loss(data)
        self.loss_tracker.update_state(loss)
        return {"loss": self.loss_tracker.result()}

    def _compute_loss(self, data):
        ap_distance, an_distance = self.siamese_network(data)
        loss = ap_distance - an_distance
        return tf.maximum(loss + self.margin, 0.0)

    @property
    def metrics(self):
        return [self.loss_tracker]


def build():
    return SiameseModel(make_siamese_network(make_embedding()), name="siamese")


def data(batch):
    rng = np.random.RandomState(0)
    anchor, positive, negative = (
        rng.rand(batch, IMAGE, IMAGE, 3).astype("float32") for _ in range(3)
    )
    return (anchor, positive, negative), None


def model_input(x, y):
    return list(x)  # the functional siamese network takes a list of three


def compile_kwargs():
    return {"optimizer": keras.optimizers.Adam(0.0001)}
