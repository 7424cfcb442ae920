"""Full fine-tuning on several GPUs (or CPU processes) with FSDP2.

    tune run --nproc_per_node 2 full_finetune_distributed --config tiny/full_distributed
    tune run --nproc_per_node 8 full_finetune_distributed --config llama3_1/8B_full_distributed

Parameters, gradients and optimizer states are sharded over the ranks (``fully_shard`` per
transformer layer, then the root). NCCL on CUDA, gloo on CPU. ``tensor_parallel_dim: N`` (with
``tensor_parallel_plan``) splits each layer over groups of N ranks first (DTensor tensor
parallelism) and shards with FSDP2 over the world_size / N data-parallel replicas.

The step's loss is the mean over the unmasked tokens of all micro-batches on all ranks (the NOTE
in ``__init__``), so 1-rank and N-rank runs log the same numbers.

Outputs (rank 0) in ``output_dir``: ``epoch_<n>/`` HF-format weights, ``recipe_state/`` for
resuming, ``metrics.jsonl``, ``config.yaml``.

``enable_fp8_training`` (+ ``fp8_recipe_name``): the transformer's linear layers compute in FP8
through torchao float8 (GPUs with compute capability >= 8.9; fast only with compile).
"""

import sys
from typing import Dict, Optional

import torch
from omegaconf import DictConfig
from torchtune import config as tt_config, training

from tune_recipes.config import check_known_keys, parse
from tune_recipes.training.checkpointing.state import RecipeState
from tune_recipes.training.checkpointing.writer import CheckpointWriter
from tune_recipes.training.losses.lm_loss import CausalLMLoss
from tune_recipes.training.setup.distributed import (
    check_fused_loss_sharding,
    fsdp_options,
    shard_and_load,
    tensor_parallel_options,
)
from tune_recipes.training.setup.fp8 import convert_to_fp8, fp8_recipe_wanted
from tune_recipes.training.setup.offloading import activation_offloading_wanted, offload_activations
from tune_recipes.training.setup.recipe import load_checkpoint, setup_step_driver, training_dtype
from tune_recipes.training.setup.runtime import init_distributed
from tune_recipes.training.step.driver import Position, Step
from tune_recipes.training.step.normalization import normalization_path
from tune_recipes.training.step.optim import build_optimizer, optimizer_in_bwd_flag

CONFIG_KEYS = {
    "output_dir", "model", "tokenizer", "checkpointer", "resume_from_checkpoint", "dataset",
    "seed", "shuffle", "batch_size", "epochs", "max_steps_per_epoch",
    "gradient_accumulation_steps", "optimizer", "optimizer_in_bwd", "lr_scheduler", "loss",
    "clip_grad_norm", "compile", "device", "dtype", "enable_activation_checkpointing",
    "ac_mode", "ac_option", "fsdp_reshard_after_forward",
    "custom_sharded_layers", "metric_logger", "log_every_n_steps", "log_peak_memory_stats",
    "collate_fn", "padding_free", "log_level", "dataset_val", "batch_size_val", "run_val_every_n_steps",
    "on_nonfinite", "profiler", "enable_activation_offloading", "fsdp_cpu_offload", "fsdp",
    "save_every_n_steps", "keep_last_n_checkpoints",
    "enable_fp8_training", "fp8_recipe_name", "fp8_fast_accum_backward",
    "tensor_parallel_dim", "tensor_parallel_plan",
    "cudnn_deterministic_mode",
}


class FullFinetuneRecipeDistributed:
    def __init__(self, cfg: DictConfig) -> None:
        check_known_keys(cfg, CONFIG_KEYS, "full_finetune_distributed")
        # tensor_parallel_dim > 1: a 2-D (dp, tp) mesh; data and token counts go by dp.
        self._runtime = init_distributed(cfg.get("device", "cuda"),
                                         tensor_parallel_dim=cfg.get("tensor_parallel_dim", 1))
        self._dtype = training_dtype(cfg, self._runtime.device)
        self._offload_activations = activation_offloading_wanted(
            cfg, self._runtime.device, self._runtime.is_main)
        # NOTE: never the single-device SKIP here, even at GA 1: token counts are per rank and
        # skipping the rescale weights each rank by its own count ([5, 3] tokens -> ~25% off).
        # Why, at length: tune_recipes/training/step/normalization.py. optimizer_in_bwd (GA 1,
        # no clipping) takes IN_BACKWARD_GLOBAL: the token count is all-reduced before the
        # forward so each gradient is exact when its in-backward optimizer step fires.
        self._optimizer_in_bwd = optimizer_in_bwd_flag(cfg)
        self._fp8 = fp8_recipe_wanted(cfg, self._runtime.device, self._runtime.is_main)
        self._path = normalization_path(
            distributed=True, gradient_accumulation_steps=cfg.get("gradient_accumulation_steps", 1),
            optimizer_in_bwd=self._optimizer_in_bwd)
        self._state = RecipeState.from_config(cfg)

    def setup(self, cfg: DictConfig) -> None:
        checkpointer, ckpt, resume = load_checkpoint(cfg, adapter=False)
        self._loss_fn = tt_config.instantiate(cfg.loss)
        check_fused_loss_sharding(self._loss_fn, cfg.get("custom_sharded_layers", None))
        self._model, _ = shard_and_load(
            cfg.model, dtype=self._dtype, device=self._runtime.device,
            world_size=self._runtime.world_size, full_state_dict=ckpt[training.MODEL_KEY],
            # FP8 linears are swapped in on the meta model, before fully_shard; FSDP2 then
            # all-gathers their weights in bf16 (torchao's float8 all-gather is not enabled).
            before_shard=lambda meta_model: convert_to_fp8(
                meta_model, self._fp8,
                fast_accum_backward=cfg.get("fp8_fast_accum_backward", False)),
            **fsdp_options(cfg), **tensor_parallel_options(cfg, self._runtime),
        )
        if cfg.get("compile", False):
            training.compile_model(self._model, verbose=self._runtime.is_main)
        offload_activations(self._model, self._offload_activations)
        self._lm_loss = CausalLMLoss(self._model, self._loss_fn, cfg.get("compile", False))
        self._tokenizer = tt_config.instantiate(cfg.tokenizer)
        self._optimizer = build_optimizer(
            cfg.optimizer, self._model, self._optimizer_in_bwd,
            state_dict=resume.optimizer if resume else None,
            distributed=True, device=self._runtime.device,
        )
        self._checkpoint_writer = CheckpointWriter.from_config(cfg, checkpointer, self._runtime)
        self._driver = setup_step_driver(
            cfg, path=self._path, runtime=self._runtime, state=self._state, resume=resume,
            model=self._model, tokenizer=self._tokenizer, optimizer=self._optimizer,
            save_checkpoint=self.save_checkpoint,
            ignore_index=self._loss_fn.ignore_index,
            eval_loss=self._lm_loss.validation_loss,
        )

    def save_checkpoint(self, epoch: int, position: Optional[Position] = None) -> None:
        # position: a mid-epoch checkpoint (step_<n>/) at that point of the epoch.
        self._checkpoint_writer.save(self._model, self._optimizer, self._state, epoch, position)

    def _loss_step(self, batch: Dict[str, torch.Tensor], step: Step) -> torch.Tensor:
        return self._lm_loss(batch, scaling=step.loss_scaling, num_tokens=step.num_tokens)

    def train(self) -> None:
        for epoch in self._driver.epochs():
            for step in epoch:
                for batch in step:
                    step.backward(self._loss_step(batch, step))
                step.finish()  # normalize, clip, optimizer step, zero_grad, LR; log
                if step.checkpoint_due:  # every save_every_n_steps, mid-epoch
                    self.save_checkpoint(epoch.index, self._driver.position())
            self.save_checkpoint(epoch.index)

    def cleanup(self) -> None:
        self._driver.close()
        self._runtime.close()


@parse
def recipe_main(cfg: DictConfig) -> None:
    recipe = FullFinetuneRecipeDistributed(cfg)
    recipe.setup(cfg)
    recipe.train()
    recipe.cleanup()


if __name__ == "__main__":
    sys.exit(recipe_main())
