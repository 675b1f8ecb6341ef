"""Follows keras_hub's Llama (`keras_hub.models.LlamaBackbone` and the logits
of `keras_hub.models.LlamaCausalLM`): a tiny backbone built from its
constructor (no preset, no download) — `LlamaTransformerDecoder` blocks
with grouped-query `LlamaAttention`, rotary embeddings, RMS-style
`LlamaLayerNorm` (a custom norm class) — wrapped in a subclassed language
model whose logits come from the backbone's `token_embedding(...,
reverse=True)` (untied reverse embeddings, as Llama's default). Trained on
next-token labels. Tiny config: vocabulary 50, 2 layers, 2 query heads and
1 key/value head, width 8, sequences of 8.
"""

import keras_hub

from ._causal_lm import CausalLM
from ._causal_lm import VOCAB
from ._causal_lm import compile_kwargs  # noqa: F401 - the corpus interface
from ._causal_lm import next_token_data as data  # noqa: F401 - the corpus interface

SLOW = True


def build():
    backbone = keras_hub.models.LlamaBackbone(
        vocabulary_size=VOCAB, num_layers=2, num_query_heads=2, hidden_dim=8,
        intermediate_dim=16, num_key_value_heads=1,
    )
    return CausalLM(backbone, name="llama")
