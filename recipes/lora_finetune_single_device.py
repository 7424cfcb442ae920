"""LoRA, QLoRA and DoRA fine-tuning of a decoder LLM on one device.

    tune run lora_finetune_single_device --config tiny/lora_single_device
    tune run lora_finetune_single_device --config llama3_1/8B_lora_single_device batch_size=4

Only the adapters train; the base weights stay frozen. Which variant runs is the model builder's
choice: ``lora_*`` builders give LoRA, ``qlora_*`` builders (or ``quantize_base: True``) keep the
frozen base in NF4, ``use_dora: True`` adds DoRA's magnitude vectors.

Loss normalization is shared with every recipe (tune_recipes.training.step):
with ``gradient_accumulation_steps: 1`` the mean loss is backpropagated as is; with more, each
micro-batch's mean is weighted by its token count and the adapters' gradients are divided by the
step's total once.

``enable_fp8_training: True`` (+ ``fp8_recipe_name: tensorwise``, the only one for LoRA): each
frozen base projection is quantized once to float8 e4m3 (one scale per tensor) and its product
runs on the FP8 tensor cores; backward computes only its input gradient (grad_out in e5m2). The
adapters train in ``dtype`` as before. The GPU holds the FP8 copies only, half the base
projections' bf16 memory; their bf16 weights stay in CPU memory, so checkpoints (adapter and
merged model) are exactly as without FP8. LoRA only: QLoRA and DoRA are config errors, and so
is a device without FP8 tensor cores (CUDA, compute capability >= 8.9); use it with
``compile: True`` (tune_recipes/modules/fp8_lora.py).

``compile_scope``: what ``compile: True`` compiles: ``layers`` (default, as torchtune) or
``model`` (the whole forward as one graph); ``activation_memory_budget`` (with ``compile``),
from 0 to 1: how much of their activations the compiled graphs save for backward (0: the least,
recomputing all they can; 1: torch's default); below 1 they recompute the cheapest ops instead.

Outputs in ``output_dir/epoch_<n>/``: the merged model (HF format, unless
``save_adapter_weights_only``), ``adapter_model.safetensors`` + ``adapter_config.json`` (PEFT
format, loadable with ``peft.PeftModel.from_pretrained``; no config with ``use_dora``, which
PEFT would load as a plain LoRA), ``adapter_model.pt`` (torchtune format). Also ``recipe_state/``, ``metrics.jsonl`` and ``config.yaml``. ``low_cpu_ram: True``
builds the merged model for saving tensor by tensor in a memory-mapped scratch file in
``output_dir`` instead of CPU memory (tune_recipes/training/checkpointing/low_ram.py).
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
from tune_recipes.training.setup.activations import ac_interval, checkpoint_reentrant
from tune_recipes.training.setup.fp8 import fp8_lora_wanted
from tune_recipes.training.setup.model import embedding_on_cpu_wanted, setup_lora_model
from tune_recipes.training.setup.offloading import activation_offloading_wanted, offload_activations
from tune_recipes.training.setup.recipe import load_checkpoint, setup_step_driver, training_dtype
from tune_recipes.training.setup.runtime import single_device
from tune_recipes.training.step.driver import Position, Step
from tune_recipes.training.step.normalization import normalization_path
from tune_recipes.training.step.optim import build_optimizer

CONFIG_KEYS = {
    "output_dir", "model", "tokenizer", "checkpointer", "resume_from_checkpoint",
    "save_adapter_weights_only", "dataset", "seed", "shuffle", "batch_size", "epochs",
    "max_steps_per_epoch", "gradient_accumulation_steps", "optimizer", "lr_scheduler", "loss",
    "clip_grad_norm", "compile", "compile_scope", "activation_memory_budget", "device", "dtype",
    "enable_activation_checkpointing",
    "ac_mode", "ac_option",
    "metric_logger", "log_every_n_steps", "log_peak_memory_stats", "collate_fn", "padding_free", "log_level",
    "dataset_val", "batch_size_val", "run_val_every_n_steps", "on_nonfinite", "profiler",
    "enable_activation_offloading", "low_cpu_ram",
    "save_every_n_steps", "keep_last_n_checkpoints", "enable_fp8_training", "fp8_recipe_name",
    "embedding_on_cpu", "fp8_mlp_activations", "fp8_mlp_layers", "fp8_adapter_inputs",
    "fp8_transposed_weight_layers",
    "cudnn_deterministic_mode",
}


class LoRAFinetuneRecipeSingleDevice:
    def __init__(self, cfg: DictConfig) -> None:
        check_known_keys(cfg, CONFIG_KEYS, "lora_finetune_single_device")
        self._runtime = single_device(cfg.get("device", "cuda"))
        self._dtype = training_dtype(cfg, self._runtime.device)
        # FP8 base projections: refused here (QLoRA, DoRA, no FP8 tensor cores) before any work.
        self._fp8 = fp8_lora_wanted(cfg, self._runtime.device, self._runtime.is_main)
        self._embedding_on_cpu = embedding_on_cpu_wanted(cfg, self._runtime.device)
        self._offload_activations = activation_offloading_wanted(
            cfg, self._runtime.device, self._runtime.is_main)
        # One device, GA 1: SKIP (no token multiply, no scale_grads: they cancel); else RESCALE.
        self._path = normalization_path(
            distributed=False, gradient_accumulation_steps=cfg.get("gradient_accumulation_steps", 1))
        self._state = RecipeState.from_config(cfg)

    # ------------------------------------------------------------------ setup
    def setup(self, cfg: DictConfig) -> None:
        # Base weights come from checkpoint_dir; when resuming, the adapter from the newest epoch.
        checkpointer, ckpt, resume = load_checkpoint(cfg, adapter=True)
        self._model, lora = setup_lora_model(
            cfg.model, dtype=self._dtype, device=self._runtime.device, seed=self._state.seed,
            base_state_dict=ckpt[training.MODEL_KEY], lora_state_dict=ckpt.get(training.ADAPTER_KEY),
            compile_model=cfg.get("compile", False), compile_scope=cfg.get("compile_scope", None),
            ac_interval=ac_interval(cfg), ac_reentrant=checkpoint_reentrant(cfg),
            fp8=self._fp8, embedding_on_cpu=self._embedding_on_cpu,
            fp8_mlp_activations=cfg.get("fp8_mlp_activations", False),
            fp8_mlp_layers=cfg.get("fp8_mlp_layers", None),
            fp8_adapter_inputs=cfg.get("fp8_adapter_inputs", False),
            fp8_transposed_weight_layers=cfg.get("fp8_transposed_weight_layers", 0),
            activation_memory_budget=cfg.get("activation_memory_budget", None),
        )
        self._tokenizer = tt_config.instantiate(cfg.tokenizer)
        self._optimizer = build_optimizer(
            cfg.optimizer, self._model, state_dict=resume.optimizer if resume else None
        )
        self._loss_fn = tt_config.instantiate(cfg.loss)
        offload_activations(self._model, self._offload_activations)
        self._lm_loss = CausalLMLoss(self._model, self._loss_fn, cfg.get("compile", False))
        self._checkpoint_writer = CheckpointWriter.from_config(cfg, checkpointer, self._runtime, lora)
        self._driver = setup_step_driver(
            cfg, path=self._path, runtime=self._runtime, state=self._state, resume=resume,
            model=self._model, tokenizer=self._tokenizer, optimizer=self._optimizer,
            save_checkpoint=self.save_checkpoint,
            ignore_index=self._loss_fn.ignore_index,
            eval_loss=self._lm_loss.validation_loss,
        )

    # ------------------------------------------------------------------ checkpoint
    def save_checkpoint(self, epoch: int, position: Optional[Position] = None) -> None:
        # position: a mid-epoch checkpoint (step_<n>/) at that point of the epoch.
        self._checkpoint_writer.save(self._model, self._optimizer, self._state, epoch, position)

    # ------------------------------------------------------------------ train
    def _loss_step(self, batch: Dict[str, torch.Tensor], step: Step) -> torch.Tensor:
        # Mean over the batch's unmasked tokens; a fused loss also gets the factor backward
        # will apply, so its pre-computed gradients need no rescale in backward.
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


@parse
def recipe_main(cfg: DictConfig) -> None:
    recipe = LoRAFinetuneRecipeSingleDevice(cfg)
    recipe.setup(cfg)
    recipe.train()
    recipe.cleanup()


if __name__ == "__main__":
    sys.exit(recipe_main())
