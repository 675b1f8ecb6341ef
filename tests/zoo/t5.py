"""Follows keras_hub's T5 (`keras_hub.models.T5Backbone`): a tiny
encoder-decoder backbone built from its constructor (no preset, no
download) — `T5TransformerLayer`s with `T5MultiHeadAttention` and relative
position biases, RMS-style `T5LayerNorm` (a custom norm class), a dict of
`encoder_token_ids`, `encoder_padding_mask`, `decoder_token_ids`,
`decoder_padding_mask` — wrapped in a subclassed sequence-to-sequence model
whose logits come from the tied `token_embedding(..., reverse=True)` over
the decoder output. Trained on shifted targets. Tiny config: vocabulary
50, 2 layers, 2 heads, width 8, key/value width 4, sequences of 8.
"""

import keras_hub

from ._seq2seq_lm import VOCAB
from ._seq2seq_lm import Seq2SeqLM
from ._seq2seq_lm import compile_kwargs  # noqa: F401 - the corpus interface
from ._seq2seq_lm import seq2seq_data as data  # noqa: F401 - the corpus interface

SLOW = True


def build():
    backbone = keras_hub.models.T5Backbone(
        vocabulary_size=VOCAB, num_layers=2, num_heads=2, hidden_dim=8,
        intermediate_dim=16, key_value_dim=4,
    )
    return Seq2SeqLM(backbone, name="t5")
