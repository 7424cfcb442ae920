"""The training layer, bottom to top (a module imports only from packages listed before it):

- ``reporting/``      progress bar, per-step metrics, ``metrics.jsonl``
- ``step/``           one optimizer step: token counts, the normalization path, optimizers,
                      and the ``StepDriver`` that runs every recipe's loop
- ``losses/``         (model, batch) -> mean loss: causal LM, knowledge distillation
- ``checkpointing/``  checkpoint I/O, recipe state, the one ``CheckpointWriter``
- ``setup/``          building a run: runtime, models, sharding, data, QAT, the driver
"""

from tune_recipes.constants import CROSS_ENTROPY_IGNORE_INDEX
from tune_recipes.training.step.batch import count_valid_tokens
from tune_recipes.training.step.driver import StepDriver, complete_optimizer_step
from tune_recipes.training.step.normalization import (
    NormalizationPath,
    StepLossNormalizer,
    grad_norm_and_clip_,
    normalization_path,
    scale_grads_,
)

__all__ = [
    "CROSS_ENTROPY_IGNORE_INDEX",
    "NormalizationPath",
    "StepDriver",
    "StepLossNormalizer",
    "complete_optimizer_step",
    "count_valid_tokens",
    "grad_norm_and_clip_",
    "normalization_path",
    "scale_grads_",
]
