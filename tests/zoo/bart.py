"""Follows keras_hub's BART (`keras_hub.models.BartBackbone` and the logits
of `keras_hub.models.BartSeq2SeqLM`): a tiny encoder-decoder backbone built
from its constructor (no preset, no download) — token and position
embeddings, keras_hub `TransformerEncoder` / `TransformerDecoder` blocks
(the decoder with causal and cross-attention masks), LayerNormalization —
wrapped in a subclassed sequence-to-sequence model whose logits come from
the tied `token_embedding(..., reverse=True)` over the decoder output.
Trained on shifted targets. Tiny config: vocabulary 50, 2 layers, 2 heads,
width 8, sequences of 8.
"""

import keras_hub

from ._seq2seq_lm import VOCAB
from ._seq2seq_lm import Seq2SeqLM
from ._seq2seq_lm import compile_kwargs  # noqa: F401 - the corpus interface
from ._seq2seq_lm import seq2seq_data as data  # noqa: F401 - the corpus interface

SLOW = True


def build():
    backbone = keras_hub.models.BartBackbone(
        vocabulary_size=VOCAB, num_layers=2, num_heads=2, hidden_dim=8,
        intermediate_dim=16, max_sequence_length=16,
    )
    return Seq2SeqLM(backbone, name="bart")
