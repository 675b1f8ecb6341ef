"""What the keras.applications models in the corpus share: the fine-tuning
wrapper users write (a subclassed model over the application built with
`include_top=False, pooling="avg", weights=None`, and a Dense head) and
image data. Not a corpus model itself."""

import keras
import numpy as np

IMAGE, CLASSES, BATCH = 32, 10, 2


class FineTuned(keras.Model):
    """An application as the feature extractor, a Dense classifier on top."""

    def __init__(self, base, num_classes=CLASSES, **kwargs):
        super().__init__(**kwargs)
        self.base = base
        self.dropout = keras.layers.Dropout(0.2)
        self.classifier = keras.layers.Dense(num_classes)

    def call(self, images, training=None):
        features = self.base(images, training=training)
        return self.classifier(self.dropout(features, training=training))


def make(application, name, **kwargs):
    base = application(
        include_top=False, weights=None, input_shape=(IMAGE, IMAGE, 3), pooling="avg", **kwargs
    )
    return FineTuned(base, name=name)


def image_data(batch):
    rng = np.random.RandomState(0)
    x = (rng.rand(batch, IMAGE, IMAGE, 3) * 255).astype("float32")
    return x, rng.randint(0, CLASSES, size=(batch,))


def compile_kwargs():
    return {
        "optimizer": keras.optimizers.SGD(1e-3, momentum=0.9),
        "loss": keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        "metrics": [keras.metrics.SparseCategoricalAccuracy()],
    }
