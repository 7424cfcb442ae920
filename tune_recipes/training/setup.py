"""Setup steps every recipe performs the same way (one correct answer each)."""

from dataclasses import dataclass
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


@dataclass
class DataAndSchedule:
    dataloader: Any
    steps_per_epoch: int
    global_step: int
    lr_schedule: Any


def setup_data_and_schedule(
    cfg: DictConfig, tokenizer, optimizer, *, seed: int, ignore_index: int, epochs_run: int,
    total_epochs: int, gradient_accumulation_steps: int, max_steps_per_epoch: Optional[int],
    world_size: int = 1, rank: int = 0,
) -> DataAndSchedule:
    """Dataset and dataloader (order from ``seed``, epoch and rank only), optimizer steps per
    epoch, the global step a run starts at, and the LR schedule positioned at that step.

    Call it after a resumed run's state is applied (its seed and ``epochs_run`` win), so the
    resumed data order, step count and learning rate are those of the interrupted run.
    """
    from tune_recipes.training.data import build_dataloader, build_dataset
    from tune_recipes.training.optim import LRSchedule

    dataloader = build_dataloader(
        build_dataset(cfg.dataset, tokenizer), batch_size=cfg.batch_size, shuffle=cfg.shuffle,
        seed=seed, pad_id=tokenizer.pad_id,
        collate_fn=cfg.get("collate_fn", "torchtune.data.padded_collate_sft"),
        ignore_index=ignore_index, world_size=world_size, rank=rank,
    )
    steps = steps_per_epoch(len(dataloader), gradient_accumulation_steps, max_steps_per_epoch,
                            cfg.batch_size)
    global_step = epochs_run * steps
    lr_schedule = LRSchedule(
        cfg.get("lr_scheduler", None), optimizer, num_training_steps=total_epochs * steps,
        last_epoch=global_step - 1,
    )
    return DataAndSchedule(dataloader, steps, global_step, lr_schedule)


def setup_lora_model(cfg_model: DictConfig, *, dtype, device, seed: int,
                     base_state_dict: Dict[str, Any],
                     lora_state_dict: Optional[Dict[str, Any]],
                     compile_model: bool = False,
                     enable_activation_checkpointing: bool = False):
    """A single-device LoRA/QLoRA/DoRA model, ready to train: built in ``dtype`` on
    ``device``, only the adapters trainable, the base weights loaded, the adapters from
    ``lora_state_dict`` (a resume) or a seeded init, DoRA magnitudes from the base weights, and
    both loads checked against the LoRA layout. Returns ``(model, LoRASpec)``."""
    from torchtune.modules import TransformerSelfAttentionLayer
    from torchtune.modules.peft import (
        get_adapter_params,
        set_trainable_params,
        validate_missing_and_unexpected_for_lora,
    )

    from tune_recipes.training.adapters import adapter_init_state_dict, initialize_dora_magnitudes
    from tune_recipes.training.checkpoint import LoRASpec

    resuming = bool(lora_state_dict)
    with training.set_default_dtype(dtype), device:
        model = tt_config.instantiate(cfg_model)
    adapter_params = get_adapter_params(model)
    if not adapter_params:
        raise ConfigError(
            f"model: {cfg_model._component_} has no LoRA adapters; use a lora_*/qlora_* "
            "builder or the full_finetune_single_device recipe"
        )
    lora = LoRASpec.from_model_config(cfg_model)  # after the check: it reads the lora_* keys
    set_trainable_params(model, adapter_params)
    if compile_model:
        training.compile_model(model)
    if enable_activation_checkpointing:
        training.set_activation_checkpointing(model, auto_wrap_policy={TransformerSelfAttentionLayer})
    base_missing, base_unexpected = model.load_state_dict(base_state_dict, strict=False)
    if not lora_state_dict:
        # Seeded, build-independent adapter init: the same as the distributed recipes'.
        lora_state_dict = adapter_init_state_dict(model, seed)
    lora_missing, lora_unexpected = model.load_state_dict(lora_state_dict, strict=False)
    if not resuming:
        # DoRA magnitudes start from the loaded base weights (a resumed run loads them);
        # the init dict holds only lora_a/lora_b, so its "missing" keys are expected.
        initialize_dora_magnitudes(model)
        lora_missing = None
    validate_missing_and_unexpected_for_lora(
        lora_attn_modules=lora.attn_modules,
        apply_lora_to_mlp=lora.apply_to_mlp,
        apply_lora_to_output=lora.apply_to_output,
        base_missing=base_missing,
        base_unexpected=base_unexpected,
        lora_missing=lora_missing,
        lora_unexpected=lora_unexpected,
    )
    training.validate_expected_param_dtype(adapter_params.items(), dtype=dtype)
    return model, lora
