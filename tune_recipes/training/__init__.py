from tune_recipes.training.normalization import (
    CROSS_ENTROPY_IGNORE_INDEX,
    StepLossNormalizer,
    complete_optimizer_step,
    count_valid_tokens,
    grad_norm_and_clip_,
    scale_grads_,
)

__all__ = [
    "CROSS_ENTROPY_IGNORE_INDEX",
    "StepLossNormalizer",
    "complete_optimizer_step",
    "count_valid_tokens",
    "grad_norm_and_clip_",
    "scale_grads_",
]
