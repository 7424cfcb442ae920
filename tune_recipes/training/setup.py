"""Setup steps every recipe performs the same way (one correct answer each)."""

from typing import Any, Dict, Optional, Tuple

from omegaconf import DictConfig
from torchtune import config as tt_config, training

from tune_recipes.config import ConfigError
from tune_recipes.training.checkpoint import checkpointer_config_for_resume
from tune_recipes.training.progress import StepReporter
from tune_recipes.training.state import RecipeState


def build_reporter(cfg: DictConfig, device, is_main: bool = True) -> StepReporter:
    """Metric logger (main process only; it also writes config.yaml) + progress bar."""
    metric_logger = None
    if is_main:
        metric_logger = tt_config.instantiate(cfg.metric_logger)
        metric_logger.log_config(cfg)
    return StepReporter(metric_logger, cfg.get("log_every_n_steps", 1), device,
                        cfg.get("log_peak_memory_stats", False), is_main=is_main)


def load_checkpoint(cfg: DictConfig, resume: bool, adapter: bool
                    ) -> Tuple[Any, Dict[str, Any], Optional[RecipeState]]:
    """Instantiate the checkpointer (pointed at the newest epoch when resuming), load, and
    return ``(checkpointer, checkpoint dict, recipe state or None)``.

    ``adapter=True`` (LoRA-type recipes): base weights come from ``checkpoint_dir`` and the
    adapter from the newest epoch; a resume without an adapter is an error.
    """
    cfg_checkpointer = cfg.checkpointer
    if resume:
        cfg_checkpointer = checkpointer_config_for_resume(
            cfg.checkpointer, cfg.output_dir, full_weights=not adapter
        )
    checkpointer = tt_config.instantiate(cfg_checkpointer, should_load_recipe_state=resume)
    ckpt = checkpointer.load_checkpoint()
    if not resume:
        return checkpointer, ckpt, None
    if adapter and training.ADAPTER_KEY not in ckpt:
        raise ConfigError(
            f"resume_from_checkpoint=True but no adapter checkpoint was found under "
            f"{cfg.output_dir}; set checkpointer.adapter_checkpoint or start afresh"
        )
    return checkpointer, ckpt, RecipeState.from_checkpoint(ckpt)


def steps_per_epoch(num_batches: int, gradient_accumulation_steps: int,
                    max_steps_per_epoch: Optional[int], batch_size: int) -> int:
    """Optimizer steps in one epoch of ``num_batches`` micro-batches (per rank)."""
    steps = num_batches // gradient_accumulation_steps
    if max_steps_per_epoch is not None:
        steps = min(steps, max_steps_per_epoch)
    if steps < 1:
        raise ConfigError(
            f"the dataset yields {num_batches} batches of batch_size={batch_size} per process, "
            f"fewer than gradient_accumulation_steps={gradient_accumulation_steps}"
        )
    return steps


def training_dtype(cfg: DictConfig, device):
    """``dtype`` from the config (bf16 or fp32); fp16 would need loss scaling we do not do."""
    import torch

    dtype = training.get_dtype(cfg.get("dtype", "bf16"), device=device)
    if dtype == torch.float16:
        raise ConfigError("dtype=fp16 is not supported: use bf16 or fp32")
    return dtype


def make_normalizer(gradient_accumulation_steps: int, optimizer_in_bwd: bool = False,
                    world_size: Optional[int] = None):
    """The step's loss normalizer; ``world_size`` given = distributed (never the skip path).
    Incompatible flags become a ConfigError naming them."""
    from tune_recipes.training.normalization import StepLossNormalizer

    try:
        return StepLossNormalizer(
            gradient_accumulation_steps, optimizer_in_bwd=optimizer_in_bwd,
            distributed=world_size is not None, world_size=world_size or 1,
        )
    except ValueError as e:
        raise ConfigError(str(e)) from None
