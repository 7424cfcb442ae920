from tune_recipes.models.tiny import (
    TINY_LLAMA3_ARGS,
    build_tiny_llama3_checkpoint,
    lora_tiny_llama3,
    lora_tiny_llama3_1,
    lora_tiny_llama3_2,
    lora_tiny_qwen2_5,
    tiny_llama3,
    tiny_llama3_1,
    tiny_llama3_2,
    tiny_qwen2_5,
)

__all__ = [
    "TINY_LLAMA3_ARGS", "build_tiny_llama3_checkpoint", "lora_tiny_llama3", "lora_tiny_llama3_1",
    "lora_tiny_llama3_2", "lora_tiny_qwen2_5", "tiny_llama3", "tiny_llama3_1", "tiny_llama3_2",
    "tiny_qwen2_5",
]
