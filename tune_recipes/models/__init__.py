from tune_recipes.models.tiny import (
    TINY_LLAMA3_ARGS,
    build_tiny_llama3_checkpoint,
    lora_tiny_llama3,
    tiny_llama3,
)

__all__ = ["TINY_LLAMA3_ARGS", "build_tiny_llama3_checkpoint", "lora_tiny_llama3", "tiny_llama3"]
