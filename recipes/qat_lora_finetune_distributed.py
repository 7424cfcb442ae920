"""QAT + LoRA fine-tuning on several GPUs (or CPU processes) with FSDP2.

    tune run --nproc_per_node 2 qat_lora_finetune_distributed --config tiny/qat_lora_distributed
    tune run --nproc_per_node 8 qat_lora_finetune_distributed --config llama3_1/8B_qat_lora_distributed

The LoRA distributed recipe whose adapted linears fake-quantize their frozen base weight and
input activations (``quantizer``, e.g. 8da4w with ``groupsize``), so the merged model tolerates
the quantization applied afterwards (``tune run quantize``). ``fake_quant_after_n_steps`` keeps
fake quantization off for the first N steps. Works with torchao 0.15 (our
``tune_recipes.modules.qat_lora``; torchtune 0.6.1's own swap asserts on an older config class).

The frozen base and the adapters are sharded over the ranks (``fully_shard`` per transformer
layer, then the root); only the adapters train. NCCL on CUDA, gloo on CPU. Adapters start from
the same seeded init as the single-device recipe (tune_recipes.modules.peft), so 1 rank,
N ranks and one device train identically.

The step's loss is the mean over the unmasked tokens of all micro-batches on all ranks (the NOTE
in ``__init__``), so 1-rank and N-rank runs log the same numbers.

Outputs (rank 0) in ``output_dir/epoch_<n>/``: the merged model (HF format, unless
``save_adapter_weights_only``), the adapter in PEFT and torchtune formats; plus
``recipe_state/``, ``metrics.jsonl``, ``config.yaml``.
"""

import sys
from typing import Dict, Optional

import torch
from omegaconf import DictConfig
from torchtune import config as tt_config, training

from tune_recipes.config import ConfigError, check_known_keys, parse
from tune_recipes.modules.qat_lora import qat_configs, swap_lora_linears_for_qat
from tune_recipes.training.checkpointing.io import LoRASpec
from tune_recipes.training.checkpointing.state import RecipeState
from tune_recipes.training.checkpointing.writer import CheckpointWriter
from tune_recipes.training.losses.lm_loss import CausalLMLoss
from tune_recipes.training.setup.distributed import (
    check_fused_loss_sharding,
    fsdp_options,
    shard_and_load_lora,
)
from tune_recipes.training.setup.qat import FakeQuantSchedule, build_quantizer
from tune_recipes.training.setup.offloading import activation_offloading_wanted, offload_activations
from tune_recipes.training.setup.recipe import load_checkpoint, setup_step_driver, training_dtype
from tune_recipes.training.setup.runtime import init_distributed
from tune_recipes.training.step.driver import Position, Step
from tune_recipes.training.step.normalization import normalization_path
from tune_recipes.training.step.optim import build_optimizer

CONFIG_KEYS = {
    "output_dir", "model", "tokenizer", "checkpointer", "resume_from_checkpoint", "dataset",
    "seed", "shuffle", "batch_size", "epochs", "max_steps_per_epoch",
    "gradient_accumulation_steps", "optimizer", "lr_scheduler", "loss", "clip_grad_norm",
    "compile", "device", "dtype", "enable_activation_checkpointing",
    "ac_mode", "ac_option", "fsdp_reshard_after_forward",
    "custom_sharded_layers", "metric_logger", "log_every_n_steps", "log_peak_memory_stats",
    "collate_fn", "padding_free", "save_adapter_weights_only", "quantizer", "fake_quant_after_n_steps",
    "log_level", "dataset_val", "batch_size_val", "run_val_every_n_steps", "on_nonfinite",
    "profiler", "enable_activation_offloading", "fsdp_cpu_offload", "fsdp",
    "save_every_n_steps", "keep_last_n_checkpoints",
    "cudnn_deterministic_mode",
}


class QATLoRAFinetuneRecipeDistributed:
    def __init__(self, cfg: DictConfig) -> None:
        check_known_keys(cfg, CONFIG_KEYS, "qat_lora_finetune_distributed")
        self._runtime = init_distributed(cfg.get("device", "cuda"))
        self._dtype = training_dtype(cfg, self._runtime.device)
        self._offload_activations = activation_offloading_wanted(
            cfg, self._runtime.device, self._runtime.is_main)
        self._quantizer, self._quantizer_mode = build_quantizer(cfg.get("quantizer"), self._dtype)
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
            # Fake-quantize the frozen base path of every LoRA linear (before sharding).
            extra_before_shard=self._swap_for_qat,
        )
        if cfg.get("compile", False):
            training.compile_model(self._model, verbose=self._runtime.is_main)
        offload_activations(self._model, self._offload_activations)
        self._lm_loss = CausalLMLoss(self._model, self._loss_fn, cfg.get("compile", False))
        self._tokenizer = tt_config.instantiate(cfg.tokenizer)
        self._optimizer = build_optimizer(
            cfg.optimizer, self._model, state_dict=resume.optimizer if resume else None,
            distributed=True, device=self._runtime.device,
        )
        self._checkpoint_writer = CheckpointWriter.from_config(cfg, checkpointer, self._runtime, lora)
        fake_quant = FakeQuantSchedule(self._model, self._quantizer_mode,
                                       cfg.get("fake_quant_after_n_steps", None))
        self._driver = setup_step_driver(
            cfg, path=self._path, runtime=self._runtime, state=self._state, resume=resume,
            model=self._model, tokenizer=self._tokenizer, optimizer=self._optimizer,
            save_checkpoint=self.save_checkpoint,
            ignore_index=self._loss_fn.ignore_index, hooks=[fake_quant],
            eval_loss=self._lm_loss.validation_loss,
        )

    def _swap_for_qat(self, meta_model) -> None:
        if swap_lora_linears_for_qat(meta_model, *qat_configs(self._quantizer)) == 0:
            raise ConfigError("model: no LoRA linears to apply QAT to")

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
    recipe = QATLoRAFinetuneRecipeDistributed(cfg)
    recipe.setup(cfg)
    recipe.train()
    recipe.cleanup()


if __name__ == "__main__":
    sys.exit(recipe_main())
