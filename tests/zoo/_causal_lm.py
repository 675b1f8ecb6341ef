"""What the decoder-only keras_hub backbones in the corpus share: the
language-model wrapper of keras_hub's `CausalLM` tasks (logits from the
backbone's `token_embedding` called with `reverse=True`) and next-token
data. Not a corpus model itself."""

import keras
import numpy as np

VOCAB, LENGTH = 50, 8


class CausalLM(keras.Model):
    """Backbone + tied (or untied reverse) embedding head, as keras_hub's
    `GPT2CausalLM` / `LlamaCausalLM` / `GemmaCausalLM` compute logits."""

    def __init__(self, backbone, **kwargs):
        super().__init__(**kwargs)
        self.backbone = backbone

    def call(self, inputs, training=None):
        hidden = self.backbone(inputs, training=training)
        return self.backbone.token_embedding(hidden, reverse=True)


def next_token_data(batch):
    """`{"token_ids", "padding_mask"}` and the next tokens as labels."""
    rng = np.random.RandomState(0)
    ids = rng.randint(1, VOCAB, size=(batch, LENGTH + 1)).astype("int32")
    mask = np.ones_like(ids)
    for row in range(batch):
        mask[row, LENGTH + 1 - row % 3:] = 0
    ids *= mask
    x = {"token_ids": ids[:, :-1], "padding_mask": mask[:, :-1]}
    return x, ids[:, 1:]


def compile_kwargs():
    return {
        "optimizer": keras.optimizers.Adam(1e-3),
        "loss": keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        "weighted_metrics": [keras.metrics.SparseCategoricalAccuracy()],
    }
