"""Full fine-tuning of a decoder LLM on one device.

    tune run full_finetune_single_device --config tiny/full_single_device
    tune run full_finetune_single_device --config llama3_2/1B_full_single_device batch_size=8

Every parameter trains. Features, each a config key:
- ``gradient_accumulation_steps``: micro-batches per optimizer step; the step's loss is the exact
  mean over all their unmasked tokens (tune_recipes.training.step).
- ``optimizer_in_bwd``: step each parameter's optimizer during backward and free its gradient
  at once (lowest memory; needs gradient_accumulation_steps=1 and clip_grad_norm=null).
- ``clip_grad_norm``: clip to this norm; ``inf`` only measures and logs it; null disables.
- ``enable_activation_checkpointing``, ``compile``, ``dtype`` (bf16 or fp32).
- ``ac_mode``/``ac_option`` (with ``enable_activation_checkpointing: False``): torchtune's
  selective checkpointing, e.g. ``selective``/``2`` recomputes every 2nd transformer layer.
- ``compile_scope``: what ``compile: True`` compiles: ``layers`` (default, as torchtune: one
  graph per transformer layer, quick to compile) or ``model`` (the whole forward, one graph).
- ``activation_memory_budget`` (with ``compile``): from 0 to 1, how much of their activations
  the compiled graphs save for backward (0: the least, recomputing all they can; 1: torch's
  default); below 1 they recompute the cheapest ops in backward instead.
- ``compile_optimizer_step``: the optimizer step runs through torch.compile (torch's Adam/AdamW:
  tune_recipes.training.step.optim.CompiledOptimizerStep; tune_recipes.optim.AdamW8bit: its own
  step in batches of alike parameters).
- ``enable_fp8_training`` (+ ``fp8_recipe_name``): the transformer's linear layers compute in
  FP8 through torchao float8 (GPUs with compute capability >= 8.9; fast only with compile);
  ``fp8_fast_accum_backward: True`` also gives the backward products cuBLAS's fast
  accumulation (opt-in; speed and loss curve in docs/benchmarks.md).
- ``fp8_mlp_activations``: each MLP keeps its gate and up products in float8 e4m3 for backward
  (half its saved bytes; tune_recipes/modules/fp8_mlp.py), FP8 training or not;
  ``fp8_mlp_layers`` N: only the first N layers' MLPs.
- ``save_every_n_steps`` (+ ``keep_last_n_checkpoints``): also a mid-epoch checkpoint
  ``step_<n>/`` every N optimizer steps.
- ``resume_from_checkpoint`` (True, False or ``auto``): continue from the newest checkpoint in
  ``output_dir``, ``epoch_<n>/`` or mid-epoch ``step_<n>/``, with the same optimizer state,
  data position and schedule (the result equals an uninterrupted run).

Outputs in ``output_dir``: ``epoch_<n>/`` (HF-format weights, and the recipe state for resuming
after every epoch but the last), ``step_<n>/`` (with ``save_every_n_steps``),
``recipe_state/`` (a copy of the newest epoch's recipe state), ``metrics.jsonl`` (loss, lr,
grad_norm, tokens/s, memory per step), ``metrics.png`` (drawn when the run ends),
``config.yaml``.
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
from tune_recipes.training.setup.fp8 import fp8_recipe_wanted
from tune_recipes.training.setup.model import setup_full_model
from tune_recipes.training.setup.offloading import activation_offloading_wanted, offload_activations
from tune_recipes.training.setup.recipe import load_checkpoint, setup_step_driver, training_dtype
from tune_recipes.training.setup.runtime import single_device
from tune_recipes.training.step.driver import Position, Step
from tune_recipes.training.step.normalization import normalization_path
from tune_recipes.training.step.optim import build_optimizer, optimizer_in_bwd_flag

CONFIG_KEYS = {
    "output_dir", "model", "tokenizer", "checkpointer", "resume_from_checkpoint", "dataset",
    "seed", "shuffle", "batch_size", "epochs", "max_steps_per_epoch",
    "gradient_accumulation_steps", "optimizer", "optimizer_in_bwd", "lr_scheduler", "loss",
    "clip_grad_norm", "compile", "compile_scope", "activation_memory_budget",
    "compile_optimizer_step", "device", "dtype",
    "enable_activation_checkpointing",
    "ac_mode", "ac_option",
    "metric_logger", "log_every_n_steps", "log_peak_memory_stats", "collate_fn", "padding_free", "log_level",
    "dataset_val", "batch_size_val", "run_val_every_n_steps", "on_nonfinite", "profiler",
    "enable_activation_offloading", "enable_fp8_training", "fp8_recipe_name",
    "fp8_fast_accum_backward", "fp8_mlp_activations", "fp8_mlp_layers", "save_every_n_steps",
    "keep_last_n_checkpoints",
    "cudnn_deterministic_mode",
}


class FullFinetuneRecipeSingleDevice:
    def __init__(self, cfg: DictConfig) -> None:
        check_known_keys(cfg, CONFIG_KEYS, "full_finetune_single_device")
        self._runtime = single_device(cfg.get("device", "cuda"))
        self._dtype = training_dtype(cfg, self._runtime.device)
        self._offload_activations = activation_offloading_wanted(
            cfg, self._runtime.device, self._runtime.is_main)
        self._fp8 = fp8_recipe_wanted(cfg, self._runtime.device, self._runtime.is_main,
                                      has_compile_scope=True)
        # Rejects optimizer_in_bwd with clipping before any work is done.
        self._optimizer_in_bwd = optimizer_in_bwd_flag(cfg)
        # One device, GA 1: SKIP (no token multiply, no scale_grads: they cancel); else RESCALE.
        self._path = normalization_path(
            distributed=False, gradient_accumulation_steps=cfg.get("gradient_accumulation_steps", 1),
            optimizer_in_bwd=self._optimizer_in_bwd)
        self._state = RecipeState.from_config(cfg)

    # ------------------------------------------------------------------ setup
    def setup(self, cfg: DictConfig) -> None:
        checkpointer, ckpt, resume = load_checkpoint(cfg, adapter=False)
        self._model = setup_full_model(
            cfg.model, dtype=self._dtype, device=self._runtime.device,
            state_dict=ckpt[training.MODEL_KEY], compile_model=cfg.get("compile", False),
            compile_scope=cfg.get("compile_scope", None),
            activation_memory_budget=cfg.get("activation_memory_budget", None),
            ac_interval=ac_interval(cfg), ac_reentrant=checkpoint_reentrant(cfg),
            fp8_recipe=self._fp8,
            fp8_fast_accum_backward=cfg.get("fp8_fast_accum_backward", False),
            fp8_mlp_activations=cfg.get("fp8_mlp_activations", False),
            fp8_mlp_layers=cfg.get("fp8_mlp_layers", None),
        )
        self._tokenizer = tt_config.instantiate(cfg.tokenizer)
        self._optimizer = build_optimizer(
            cfg.optimizer, self._model, self._optimizer_in_bwd,
            state_dict=resume.optimizer if resume else None,
            compile_step=cfg.get("compile_optimizer_step", False),
        )
        self._loss_fn = tt_config.instantiate(cfg.loss)
        offload_activations(self._model, self._offload_activations)
        self._lm_loss = CausalLMLoss(self._model, self._loss_fn, cfg.get("compile", False))
        self._checkpoint_writer = CheckpointWriter.from_config(cfg, checkpointer, self._runtime)
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
    recipe = FullFinetuneRecipeSingleDevice(cfg)
    recipe.setup(cfg)
    recipe.train()
    recipe.cleanup()


if __name__ == "__main__":
    sys.exit(recipe_main())
