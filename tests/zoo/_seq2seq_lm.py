"""What the encoder-decoder keras_hub backbones in the corpus share: the
wrapper of keras_hub's `Seq2SeqLM` tasks (logits from the decoder's
sequence output through the backbone's `token_embedding` with
`reverse=True`) and shifted-target data. Not a corpus model itself."""

import keras
import numpy as np

VOCAB, LENGTH = 50, 8


class Seq2SeqLM(keras.Model):
    """Backbone + tied embedding head over `decoder_sequence_output`, as
    keras_hub's `BartSeq2SeqLM` / `T5Gemma`-style tasks compute logits."""

    def __init__(self, backbone, **kwargs):
        super().__init__(**kwargs)
        self.backbone = backbone

    def call(self, inputs, training=None):
        outputs = self.backbone(inputs, training=training)
        return self.backbone.token_embedding(outputs["decoder_sequence_output"], reverse=True)


def seq2seq_data(batch):
    """Encoder tokens and masks, decoder tokens shifted by one as labels."""
    rng = np.random.RandomState(0)
    encoder = rng.randint(1, VOCAB, size=(batch, LENGTH)).astype("int32")
    encoder_mask = np.ones_like(encoder)
    decoder = rng.randint(1, VOCAB, size=(batch, LENGTH + 1)).astype("int32")
    decoder_mask = np.ones_like(decoder)
    for row in range(batch):
        encoder_mask[row, LENGTH - row % 3:] = 0
        decoder_mask[row, LENGTH + 1 - row % 2:] = 0
    encoder *= encoder_mask
    decoder *= decoder_mask
    x = {
        "encoder_token_ids": encoder,
        "encoder_padding_mask": encoder_mask,
        "decoder_token_ids": decoder[:, :-1],
        "decoder_padding_mask": decoder_mask[:, :-1],
    }
    return x, decoder[:, 1:]


def compile_kwargs():
    return {
        "optimizer": keras.optimizers.Adam(1e-3),
        "loss": keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        "weighted_metrics": [keras.metrics.SparseCategoricalAccuracy()],
    }
