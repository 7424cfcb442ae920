from tune_recipes.data.tiny import (
    TINY_DATA_PATH,
    TINY_SPECIAL_TOKENS,
    TINY_TOKENIZER_PATH,
    TINY_VOCAB_SIZE,
    tiny_alpaca_dataset,
    tiny_tokenizer,
)

__all__ = [
    "TINY_DATA_PATH",
    "TINY_SPECIAL_TOKENS",
    "TINY_TOKENIZER_PATH",
    "TINY_VOCAB_SIZE",
    "tiny_alpaca_dataset",
    "tiny_tokenizer",
]
