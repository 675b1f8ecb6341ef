"""Follows keras_hub's Gemma (`keras_hub.models.GemmaBackbone` and the
logits of `keras_hub.models.GemmaCausalLM`): a tiny backbone built from its
constructor (no preset, no download) — embeddings scaled by the square
root of the width, `GemmaDecoderBlock`s with `CachedGemmaAttention`, rotary
embeddings and keras_hub's own `RMSNormalization` (a custom norm class) —
wrapped in a subclassed language model whose logits come from the tied
`token_embedding(..., reverse=True)`. Trained on next-token labels. Tiny
config: vocabulary 50, 2 layers, 2 query heads and 1 key/value head of
width 4, width 8, sequences of 8.
"""

import keras_hub

from ._causal_lm import CausalLM
from ._causal_lm import VOCAB
from ._causal_lm import compile_kwargs  # noqa: F401 - the corpus interface
from ._causal_lm import next_token_data as data  # noqa: F401 - the corpus interface

SLOW = True


def build():
    backbone = keras_hub.models.GemmaBackbone(
        vocabulary_size=VOCAB, num_layers=2, num_query_heads=2, num_key_value_heads=1,
        hidden_dim=8, intermediate_dim=16, head_dim=4,
    )
    return CausalLM(backbone, name="gemma")
