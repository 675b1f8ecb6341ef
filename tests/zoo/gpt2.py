"""Follows keras_hub's GPT-2 (`keras_hub.models.GPT2Backbone` and the logits
of `keras_hub.models.GPT2CausalLM`): a tiny backbone built from its
constructor (no preset, no download) — token and position embeddings,
`TransformerDecoder` blocks with a causal mask built from the batch size,
a final LayerNormalization — wrapped in a subclassed language model whose
logits come from the backbone's tied `token_embedding(..., reverse=True)`.
Trained on next-token labels. Tiny config: vocabulary 50, 2 layers, 2
heads, width 8, sequences of 8.
"""

import keras_hub

from ._causal_lm import CausalLM
from ._causal_lm import VOCAB
from ._causal_lm import compile_kwargs  # noqa: F401 - the corpus interface
from ._causal_lm import next_token_data as data  # noqa: F401 - the corpus interface

SLOW = True


def build():
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=VOCAB, num_layers=2, num_heads=2, hidden_dim=8,
        intermediate_dim=16, max_sequence_length=16,
    )
    return CausalLM(backbone, name="gpt2")
