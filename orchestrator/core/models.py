"""The built-in tiny models' shapes (`tiny-llama`, `tiny-qwen2`) as plain numbers.

Pure data: the planner reads head counts from here for validation without importing torch or transformers;
`recipes.tiny` builds the actual models (random weights, local tokenizer) from the same numbers.
"""

from __future__ import annotations

VOCAB_SIZE = 512

_COMMON = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
    "vocab_size": VOCAB_SIZE,
    "tie_word_embeddings": False,
}

BUILTIN_MODELS: dict[str, dict] = {
    "tiny-llama": {"architecture": "llama", **_COMMON},
    "tiny-qwen2": {"architecture": "qwen2", **_COMMON},
}
