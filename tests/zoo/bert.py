"""Follows keras_hub's BERT (`keras_hub.models.BertBackbone`, the backbone of
`keras_hub.models.BertTextClassifier`): a tiny backbone built from its
constructor (no preset, no download), wrapped as a user would in a
subclassed classifier that reads the backbone's `pooled_output` from its
dict of outputs, with Dropout and a Dense head. Inputs are the backbone's
dict of `token_ids`, `segment_ids` and `padding_mask`. Tiny config:
vocabulary 50, 2 layers, 2 heads, width 8, sequences of 8.
"""

import keras
import keras_hub
import numpy as np

VOCAB, LENGTH, CLASSES = 50, 8, 2
SLOW = True


class BertClassifier(keras.Model):
    def __init__(self, backbone, num_classes, dropout=0.1, **kwargs):
        super().__init__(**kwargs)
        self.backbone = backbone
        self.output_dropout = keras.layers.Dropout(dropout, name="output_dropout")
        self.output_dense = keras.layers.Dense(num_classes, name="logits")

    def call(self, inputs, training=None):
        pooled = self.backbone(inputs, training=training)["pooled_output"]
        return self.output_dense(self.output_dropout(pooled, training=training))


def build():
    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=VOCAB, num_layers=2, num_heads=2, hidden_dim=8,
        intermediate_dim=16, max_sequence_length=16,
    )
    return BertClassifier(backbone, CLASSES, name="bert")


def data(batch):
    rng = np.random.RandomState(0)
    token_ids = rng.randint(1, VOCAB, size=(batch, LENGTH)).astype("int32")
    padding_mask = np.ones((batch, LENGTH), "int32")
    for row in range(batch):
        padding_mask[row, LENGTH - row % 3:] = 0
    token_ids *= padding_mask
    segment_ids = np.zeros((batch, LENGTH), "int32")
    segment_ids[:, LENGTH // 2:] = 1
    x = {"token_ids": token_ids, "segment_ids": segment_ids, "padding_mask": padding_mask}
    return x, rng.randint(0, CLASSES, size=(batch,))


def compile_kwargs():
    return {
        "optimizer": keras.optimizers.Adam(5e-5),
        "loss": keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        "metrics": [keras.metrics.SparseCategoricalAccuracy()],
    }
