"""Recipe state for exact resume, plus small measurement helpers."""

import warnings
from dataclasses import dataclass
from typing import Any, Dict, Optional

import torch
from torchtune import training

from tune_recipes.config import ConfigError

RNG_KEY = "rng_state"
CUDA_RNG_KEY = "cuda_rng_state"


@dataclass
class RecipeState:
    """What a recipe needs, beyond the weights, to continue exactly where it stopped."""

    optimizer: Optional[Dict[str, Any]]
    seed: int
    epochs_run: int
    total_epochs: int
    max_steps_per_epoch: Optional[int]
    rng_state: Optional[torch.Tensor] = None
    cuda_rng_state: Optional[torch.Tensor] = None

    @staticmethod
    def capture(recipe, optimizer_state: Optional[Dict[str, Any]]) -> Dict[str, Any]:
        """Checkpoint dict entries for ``recipe`` (torchtune's key names, so stock tooling
        can read them)."""
        out = {
            training.SEED_KEY: recipe.seed,
            training.EPOCHS_KEY: recipe.epochs_run,
            training.TOTAL_EPOCHS_KEY: recipe.total_epochs,
            training.MAX_STEPS_KEY: recipe.max_steps_per_epoch,
            RNG_KEY: torch.get_rng_state(),
        }
        if optimizer_state is not None:
            out[training.OPT_KEY] = optimizer_state
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            out[CUDA_RNG_KEY] = torch.cuda.get_rng_state()
        return out

    @classmethod
    def from_checkpoint(cls, ckpt: Dict[str, Any]) -> "RecipeState":
        missing = [k for k in (training.SEED_KEY, training.EPOCHS_KEY, training.TOTAL_EPOCHS_KEY)
                   if k not in ckpt]
        if missing:
            raise ConfigError(
                f"resume_from_checkpoint=True but the recipe state in output_dir lacks {missing}: "
                "was it written by this recipe? Point checkpointer.recipe_checkpoint at the "
                "right recipe_state.pt or set resume_from_checkpoint=False"
            )
        return cls(
            optimizer=ckpt.get(training.OPT_KEY),
            seed=ckpt[training.SEED_KEY],
            epochs_run=ckpt[training.EPOCHS_KEY],
            total_epochs=ckpt[training.TOTAL_EPOCHS_KEY],
            max_steps_per_epoch=ckpt.get(training.MAX_STEPS_KEY),
            rng_state=ckpt.get(RNG_KEY),
            cuda_rng_state=ckpt.get(CUDA_RNG_KEY),
        )

    def apply_to(self, recipe) -> None:
        """Restore counters and RNG; the seed and steps-per-epoch of the checkpoint win over
        the config (changing them mid-run would change the data order)."""
        if recipe.seed != self.seed:
            warnings.warn(f"config seed {recipe.seed} differs from the checkpoint's {self.seed}; "
                          "using the checkpoint's")
            recipe.seed = self.seed
        if recipe.max_steps_per_epoch != self.max_steps_per_epoch:
            warnings.warn(f"config max_steps_per_epoch {recipe.max_steps_per_epoch} differs from "
                          f"the checkpoint's {self.max_steps_per_epoch}; using the checkpoint's")
            recipe.max_steps_per_epoch = self.max_steps_per_epoch
        recipe.epochs_run = self.epochs_run
        if self.rng_state is not None:
            torch.set_rng_state(self.rng_state)
        if self.cuda_rng_state is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state(self.cuda_rng_state)


def tokens_per_second(num_tokens: int, seconds: float) -> float:
    return num_tokens / seconds if seconds > 0 else 0.0


def memory_stats(device: torch.device) -> Dict[str, float]:
    """Peak memory in GiB on CUDA; empty on CPU (no CUDA-only calls there)."""
    if device.type != "cuda":
        return {}
    gib = 1024**3
    return {
        "peak_memory_active_gib": torch.cuda.max_memory_allocated(device) / gib,
        "peak_memory_reserved_gib": torch.cuda.max_memory_reserved(device) / gib,
    }
