"""Follows the Keras example "Point cloud classification with PointNet"
(David Griffiths, keras.io/examples/vision/pointnet/): an
`OrthogonalRegularizer` (a custom `keras.regularizers.Regularizer` that
pushes the predicted feature transform towards an orthogonal matrix, set as
the activity regularizer of the T-Net's last Dense), T-Nets (Conv1D +
BatchNormalization + ReLU blocks, global max pooling, Dense blocks, a Dense
initialised to the identity, Reshape, and a Dot that applies the transform
to the points), written as a custom `TNet` layer inside a subclassed
`PointNet` classifier. The regularization loss reaches training through
`model.losses`. Tiny sizes: 16 points, widths 8-16.
"""

import keras
import numpy as np
from keras import layers

POINTS, CLASSES = 16, 4
NO_NORM_LAYERS = True  # BatchNormalization only: not of the LayerNormalization family


class OrthogonalRegularizer(keras.regularizers.Regularizer):
    def __init__(self, num_features, l2reg=0.001):
        self.num_features = num_features
        self.l2reg = l2reg
        self.eye = keras.ops.eye(num_features)

    def __call__(self, x):
        x = keras.ops.reshape(x, (-1, self.num_features, self.num_features))
        xxt = keras.ops.tensordot(x, x, axes=(2, 2))
        xxt = keras.ops.reshape(xxt, (-1, self.num_features, self.num_features))
        return keras.ops.sum(self.l2reg * keras.ops.square(xxt - self.eye))

    def get_config(self):
        return {"num_features": self.num_features, "l2reg": self.l2reg}


class ConvBN(layers.Layer):
    def __init__(self, filters, **kwargs):
        super().__init__(**kwargs)
        self.conv = layers.Conv1D(filters, kernel_size=1, padding="valid")
        self.bn = layers.BatchNormalization(momentum=0.0)
        self.relu = layers.Activation("relu")

    def call(self, x, training=None):
        return self.relu(self.bn(self.conv(x), training=training))


class DenseBN(layers.Layer):
    def __init__(self, units, **kwargs):
        super().__init__(**kwargs)
        self.dense = layers.Dense(units)
        self.bn = layers.BatchNormalization(momentum=0.0)
        self.relu = layers.Activation("relu")

    def call(self, x, training=None):
        return self.relu(self.bn(self.dense(x), training=training))


class TNet(layers.Layer):
    def __init__(self, num_features, **kwargs):
        super().__init__(**kwargs)
        self.num_features = num_features
        bias = keras.initializers.Constant(np.eye(num_features).flatten())
        self.convs = [ConvBN(8), ConvBN(16)]
        self.pool = layers.GlobalMaxPooling1D()
        self.denses = [DenseBN(16), DenseBN(8)]
        self.transform = layers.Dense(
            num_features * num_features, kernel_initializer="zeros", bias_initializer=bias,
            activity_regularizer=OrthogonalRegularizer(num_features),
        )
        self.reshape = layers.Reshape((num_features, num_features))
        self.dot = layers.Dot(axes=(2, 1))

    def call(self, inputs, training=None):
        x = inputs
        for block in self.convs:
            x = block(x, training=training)
        x = self.pool(x)
        for block in self.denses:
            x = block(x, training=training)
        feat_t = self.reshape(self.transform(x))
        return self.dot([inputs, feat_t])


class PointNet(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.input_transform = TNet(3, name="input_tnet")
        self.conv_1 = ConvBN(8)
        self.conv_2 = ConvBN(8)
        self.feature_transform = TNet(8, name="feature_tnet")
        self.conv_3 = ConvBN(8)
        self.conv_4 = ConvBN(16)
        self.pool = layers.GlobalMaxPooling1D()
        self.dense_1 = DenseBN(16)
        self.dropout = layers.Dropout(0.3)
        self.logits = layers.Dense(CLASSES, activation="softmax")

    def call(self, points, training=None):
        x = self.input_transform(points, training=training)
        x = self.conv_2(self.conv_1(x, training=training), training=training)
        x = self.feature_transform(x, training=training)
        x = self.conv_4(self.conv_3(x, training=training), training=training)
        x = self.dense_1(self.pool(x), training=training)
        return self.logits(self.dropout(x, training=training))


def build():
    return PointNet(name="pointnet")


def data(batch):
    rng = np.random.RandomState(0)
    x = rng.normal(size=(batch, POINTS, 3)).astype("float32")
    return x, rng.randint(0, CLASSES, size=(batch,))


def compile_kwargs():
    return {
        "optimizer": keras.optimizers.Adam(learning_rate=1e-3),
        "loss": "sparse_categorical_crossentropy",
        "metrics": ["sparse_categorical_accuracy"],
    }
