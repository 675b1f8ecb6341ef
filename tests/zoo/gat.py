"""Follows the Keras example "Graph attention network (GAT) for node
classification" (Alexander Kensert,
keras.io/examples/graph/gat_node_classification/), with keras.ops in place
of the example's tf calls: `GraphAttention` layers with their kernels made
in `build` and read directly in `call`, gathering node states along the
edge list, normalising attention scores per target node with
`segment_sum` / `bincount` / `repeat`, and aggregating neighbours with
`segment_sum`; `MultiHeadGraphAttention` concatenating heads; and a
`GraphAttentionNetwork` that holds the whole graph (node features and edge
list) as tensor attributes and whose `train_step` calls
`self([self.node_states, self.edges])` and gathers the outputs of the
batch's node indices. `fit` sees only (node indices, labels). Tiny graph:
12 nodes with 6 features, a ring plus self loops, 3 classes.
"""

import keras
import numpy as np
import tensorflow as tf
from keras import layers
from keras import ops

NODES, FEATURES, CLASSES, HIDDEN, HEADS, LAYERS = 12, 6, 3, 4, 2, 2
NO_NORM_LAYERS = True


class GraphAttention(layers.Layer):
    def __init__(self, units, kernel_initializer="glorot_uniform", kernel_regularizer=None, **kwargs):
        super().__init__(**kwargs)
        self.units = units
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self.kernel_regularizer = keras.regularizers.get(kernel_regularizer)

    def build(self, input_shape):
        self.kernel = self.add_weight(
            shape=(input_shape[0][-1], self.units), trainable=True,
            initializer=self.kernel_initializer, regularizer=self.kernel_regularizer, name="kernel",
        )
        self.kernel_attention = self.add_weight(
            shape=(self.units * 2, 1), trainable=True, initializer=self.kernel_initializer,
            regularizer=self.kernel_regularizer, name="kernel_attention",
        )
        self.built = True

    def call(self, inputs):
        node_states, edges = inputs
        node_states_transformed = ops.matmul(node_states, self.kernel)
        # (1) pair-wise attention scores
        node_states_expanded = ops.take(node_states_transformed, edges, axis=0)
        node_states_expanded = ops.reshape(node_states_expanded, (ops.shape(edges)[0], -1))
        attention_scores = ops.leaky_relu(ops.matmul(node_states_expanded, self.kernel_attention))
        attention_scores = ops.squeeze(attention_scores, -1)
        # (2) normalised per target node
        attention_scores = ops.exp(ops.clip(attention_scores, -2, 2))
        attention_scores_sum = ops.segment_sum(
            attention_scores, edges[:, 0], num_segments=ops.max(edges[:, 0]) + 1
        )
        attention_scores_sum = ops.repeat(
            attention_scores_sum, ops.bincount(ops.cast(edges[:, 0], "int32"))
        )
        attention_scores_norm = attention_scores / attention_scores_sum
        # (3) neighbours' states, weighted and aggregated
        node_states_neighbors = ops.take(node_states_transformed, edges[:, 1], axis=0)
        return ops.segment_sum(
            node_states_neighbors * attention_scores_norm[:, None], edges[:, 0],
            num_segments=ops.shape(node_states)[0],
        )


class MultiHeadGraphAttention(layers.Layer):
    def __init__(self, units, num_heads=8, merge_type="concat", **kwargs):
        super().__init__(**kwargs)
        self.num_heads = num_heads
        self.merge_type = merge_type
        self.attention_layers = [GraphAttention(units) for _ in range(num_heads)]

    def call(self, inputs):
        atom_features, pair_indices = inputs
        outputs = [layer([atom_features, pair_indices]) for layer in self.attention_layers]
        if self.merge_type == "concat":
            outputs = ops.concatenate(outputs, axis=-1)
        else:
            outputs = ops.mean(ops.stack(outputs, axis=-1), axis=-1)
        return ops.relu(outputs)


class GraphAttentionNetwork(keras.Model):
    def __init__(self, node_states, edges, hidden_units, num_heads, num_layers, output_dim, **kwargs):
        super().__init__(**kwargs)
        self.node_states = node_states
        self.edges = edges
        self.preprocess = layers.Dense(hidden_units * num_heads, activation="relu")
        self.attention_layers = [
            MultiHeadGraphAttention(hidden_units, num_heads) for _ in range(num_layers)
        ]
        self.output_layer = layers.Dense(output_dim)

    def call(self, inputs):
        node_states, edges = inputs
        x = self.preprocess(node_states)
        for attention_layer in self.attention_layers:
            x = attention_layer([x, edges]) + x
        return self.output_layer(x)

    def train_step(self, data):
        indices, labels = data
        with tf.GradientTape() as tape:
            outputs = self([self.node_states, self.edges])
            y_pred = ops.take(outputs, indices, axis=0)
            loss = self.compute_loss(y=labels, y_pred=y_pred)
        grads = tape.gradient(loss, self.trainable_weights)
        self.optimizer.apply_gradients(zip(grads, self.trainable_weights))
        return self.compute_metrics(indices, labels, y_pred)


def graph():
    """Node features and an edge list (target, source) sorted by target,
    every node with a self loop and its two ring neighbours."""
    rng = np.random.RandomState(0)
    features = rng.normal(size=(NODES, FEATURES)).astype("float32")
    edges = sorted(
        (target, source) for target in range(NODES)
        for source in (target, (target - 1) % NODES, (target + 1) % NODES)
    )
    return tf.constant(features), tf.constant(np.array(edges, dtype="int64"))


def build():
    node_states, edges = graph()
    return GraphAttentionNetwork(
        node_states, edges, HIDDEN, HEADS, LAYERS, CLASSES, name="gat"
    )


def data(batch):
    rng = np.random.RandomState(1)
    labels = rng.randint(0, CLASSES, size=NODES)
    indices = np.arange(batch) % NODES
    return indices, labels[indices]


def parts(model, x, y):
    """What the step calls the model on: the graph it holds."""
    return [("gat", model, [model.node_states, model.edges])]


def compile_kwargs():
    return {
        "loss": keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        "optimizer": keras.optimizers.SGD(0.1, momentum=0.9),
        "metrics": [keras.metrics.SparseCategoricalAccuracy(name="acc")],
    }
