"""Knowledge distillation into a LoRA student on several GPUs (or CPU processes) with FSDP2.

    tune run --nproc_per_node 2 knowledge_distillation_distributed --config tiny/kd_distributed
    tune run --nproc_per_node 8 knowledge_distillation_distributed --config llama3_2/8B_to_1B_kd_distributed

Student (LoRA) and frozen teacher are both sharded with FSDP2. The student minimizes
``(1 - kd_ratio) * loss(student, labels) + kd_ratio * kd_loss(teacher, student)`` (forward KL
per token over the same unmasked tokens), normalized by the global token count like the other
distributed recipes. ``class_loss`` and ``kd_loss`` are logged as global token means (the
shipped ``kd_loss`` logs the KL plus the teacher's entropy, which takes no gradient).

The step's loss is the mean over the unmasked tokens of all micro-batches on all ranks (the NOTE
in ``__init__``), so 1-rank and N-rank runs log the same numbers.

Outputs (rank 0) in ``output_dir/epoch_<n>/``: the merged model (HF format, unless
``save_adapter_weights_only``), the adapter in PEFT and torchtune formats; plus
``recipe_state/``, ``metrics.jsonl``, ``config.yaml``.
"""

import sys
from typing import Dict, Optional, Tuple

import torch
from omegaconf import DictConfig
from torchtune import config as tt_config, training

from tune_recipes.config import check_known_keys, parse
from tune_recipes.training.checkpointing.io import LoRASpec
from tune_recipes.training.checkpointing.state import RecipeState
from tune_recipes.training.checkpointing.writer import CheckpointWriter
from tune_recipes.training.losses.kd import DistillationLoss
from tune_recipes.training.setup.distributed import (
    check_fused_loss_sharding,
    fsdp_cpu_offload_requested,
    fsdp_options,
    shard_and_load,
    shard_and_load_lora,
)
from tune_recipes.training.setup.offloading import activation_offloading_wanted, offload_activations
from tune_recipes.training.setup.recipe import (
    load_checkpoint,
    read_teacher_weights,
    setup_step_driver,
    training_dtype,
)
from tune_recipes.training.setup.runtime import init_distributed
from tune_recipes.training.step.driver import Position
from tune_recipes.training.step.normalization import normalization_path
from tune_recipes.training.step.optim import build_optimizer

CONFIG_KEYS = {
    "output_dir", "model", "tokenizer", "checkpointer", "resume_from_checkpoint", "dataset",
    "seed", "shuffle", "batch_size", "epochs", "max_steps_per_epoch",
    "gradient_accumulation_steps", "optimizer", "lr_scheduler", "loss", "clip_grad_norm",
    "compile", "device", "dtype", "enable_activation_checkpointing",
    "ac_mode", "ac_option", "fsdp_reshard_after_forward",
    "custom_sharded_layers", "metric_logger", "log_every_n_steps", "log_peak_memory_stats",
    "collate_fn", "padding_free", "save_adapter_weights_only",
    "teacher_model", "teacher_checkpointer", "kd_loss", "kd_ratio", "log_level", "dataset_val",
    "batch_size_val", "run_val_every_n_steps", "on_nonfinite", "profiler",
    "enable_activation_offloading", "fsdp_cpu_offload", "fsdp",
    "save_every_n_steps", "keep_last_n_checkpoints",
    "cudnn_deterministic_mode",
}


class KDRecipeDistributed:
    def __init__(self, cfg: DictConfig) -> None:
        check_known_keys(cfg, CONFIG_KEYS, "knowledge_distillation_distributed")
        self._runtime = init_distributed(cfg.get("device", "cuda"))
        self._dtype = training_dtype(cfg, self._runtime.device)
        self._offload_activations = activation_offloading_wanted(
            cfg, self._runtime.device, self._runtime.is_main)
        # NOTE: never the single-device SKIP here, even at GA 1: token counts are per rank and
        # skipping the rescale weights each rank by its own count ([5, 3] tokens -> ~25% off).
        # Why, at length: tune_recipes/training/step/normalization.py.
        self._path = normalization_path(
            distributed=True, gradient_accumulation_steps=cfg.get("gradient_accumulation_steps", 1))
        self._state = RecipeState.from_config(cfg)

    def setup(self, cfg: DictConfig) -> None:
        # Base weights come from checkpoint_dir; when resuming, the adapter from the newest epoch.
        checkpointer, ckpt, resume = load_checkpoint(cfg, adapter=True)
        self._loss_fn = tt_config.instantiate(cfg.loss)
        check_fused_loss_sharding(self._loss_fn, cfg.get("custom_sharded_layers", None))
        lora = LoRASpec.from_model_config(cfg.model)
        self._model = shard_and_load_lora(
            cfg.model, lora, dtype=self._dtype, device=self._runtime.device,
            world_size=self._runtime.world_size, base_state_dict=ckpt[training.MODEL_KEY],
            adapter_state_dict=ckpt.get(training.ADAPTER_KEY), seed=self._state.seed,
            **fsdp_options(cfg),
        )
        teacher_sd = read_teacher_weights(cfg.teacher_checkpointer)
        self._teacher, _ = shard_and_load(
            cfg.teacher_model, dtype=self._dtype, device=self._runtime.device,
            world_size=self._runtime.world_size, full_state_dict=teacher_sd,
            reshard_after_forward=cfg.get("fsdp_reshard_after_forward", True),
            cpu_offload=fsdp_cpu_offload_requested(cfg), key="teacher_model",
        )
        if cfg.get("compile", False):
            training.compile_model(self._model, verbose=self._runtime.is_main)
        offload_activations(self._model, self._offload_activations)
        self._kd = DistillationLoss(
            self._model, self._teacher, self._loss_fn, tt_config.instantiate(cfg.kd_loss),
            cfg.get("kd_ratio", 0.5),
        )
        self._tokenizer = tt_config.instantiate(cfg.tokenizer)
        self._optimizer = build_optimizer(
            cfg.optimizer, self._model, state_dict=resume.optimizer if resume else None,
            distributed=True, device=self._runtime.device,
        )
        self._checkpoint_writer = CheckpointWriter.from_config(cfg, checkpointer, self._runtime, lora)
        self._driver = setup_step_driver(
            cfg, path=self._path, runtime=self._runtime, state=self._state, resume=resume,
            model=self._model, tokenizer=self._tokenizer, optimizer=self._optimizer,
            save_checkpoint=self.save_checkpoint,
            ignore_index=self._loss_fn.ignore_index,
            eval_loss=self._kd.validation_loss, also_fed=(self._teacher,),
        )

    def save_checkpoint(self, epoch: int, position: Optional[Position] = None) -> None:
        # position: a mid-epoch checkpoint (step_<n>/) at that point of the epoch.
        self._checkpoint_writer.save(self._model, self._optimizer, self._state, epoch, position)

    def _loss_step(self, batch: Dict[str, torch.Tensor]) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
        # (mixed mean loss, {"class_loss": ..., "kd_loss": ...}) over this rank's tokens.
        return self._kd(batch)

    def train(self) -> None:
        for epoch in self._driver.epochs():
            for step in epoch:
                for batch in step:
                    loss, parts = self._loss_step(batch)
                    step.backward(loss, extras=parts)  # parts are logged as token means too
                step.finish()  # normalize, clip, optimizer step, zero_grad, LR; log
                if step.checkpoint_due:  # every save_every_n_steps, mid-epoch
                    self.save_checkpoint(epoch.index, self._driver.position())
            self.save_checkpoint(epoch.index)

    def cleanup(self) -> None:
        self._driver.close()
        self._runtime.close()


@parse
def recipe_main(cfg: DictConfig) -> None:
    recipe = KDRecipeDistributed(cfg)
    recipe.setup(cfg)
    recipe.train()
    recipe.cleanup()


if __name__ == "__main__":
    sys.exit(recipe_main())
