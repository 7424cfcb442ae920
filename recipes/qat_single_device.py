"""Quantization-aware full fine-tuning (QAT) of a decoder LLM on one device.

    tune run qat_single_device --config tiny/qat_single_device
    tune run qat_single_device --config llama3_2/1B_qat_single_device

Every parameter trains while the linear layers fake-quantize their weights (and, for 8da4w, their
input activations) as the target scheme will, so the model learns to tolerate it. Afterwards
``tune run quantize --config ...`` converts the checkpoint into a real quantized model.

QAT keys:
- ``quantizer``: a torchtune/torchao QAT quantizer, e.g.
  ``torchtune.training.quantization.Int8DynActInt4WeightQATQuantizer`` with ``groupsize``
  (int8 dynamic activations + int4 grouped weights); its group size must divide every linear's
  input dim (checked at start, naming the layer).
- ``fake_quant_after_n_steps``: train the first N steps without fake quantization, then turn it
  on (often converges better); null = on from the start.

Everything else is the full single-device recipe's:
- ``gradient_accumulation_steps``: micro-batches per optimizer step; the step's loss is the exact
  mean over all their unmasked tokens (tune_recipes.training.step).
- ``optimizer_in_bwd``: step each parameter's optimizer during backward and free its gradient
  at once (lowest memory; needs gradient_accumulation_steps=1 and clip_grad_norm=null).
- ``clip_grad_norm``: clip to this norm; ``inf`` only measures and logs it; null disables.
- ``enable_activation_checkpointing``, ``compile``, ``dtype`` (bf16 or fp32).
- ``ac_mode``/``ac_option`` (with ``enable_activation_checkpointing: False``): torchtune's
  selective checkpointing, e.g. ``selective``/``2`` recomputes every 2nd transformer layer.
- ``resume_from_checkpoint``: continue from the last epoch checkpoint in ``output_dir``.

Outputs in ``output_dir``: ``epoch_<n>/`` (HF-format weights), ``recipe_state/`` (for
resuming), ``metrics.jsonl`` (loss, lr, grad_norm, tokens/s, memory per step), ``config.yaml``.
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
from tune_recipes.training.setup.model import setup_full_model
from tune_recipes.training.setup.qat import FakeQuantSchedule, build_quantizer, check_group_size
from tune_recipes.training.setup.recipe import load_checkpoint, setup_step_driver, training_dtype
from tune_recipes.training.setup.runtime import single_device
from tune_recipes.training.step.driver import Position, Step
from tune_recipes.training.step.normalization import normalization_path
from tune_recipes.training.step.optim import build_optimizer, optimizer_in_bwd_flag

CONFIG_KEYS = {
    "output_dir", "model", "tokenizer", "checkpointer", "resume_from_checkpoint", "dataset",
    "seed", "shuffle", "batch_size", "epochs", "max_steps_per_epoch",
    "gradient_accumulation_steps", "optimizer", "optimizer_in_bwd", "lr_scheduler", "loss",
    "clip_grad_norm", "compile", "device", "dtype", "enable_activation_checkpointing",
    "ac_mode", "ac_option",
    "metric_logger", "log_every_n_steps", "log_peak_memory_stats", "collate_fn", "padding_free",
    "quantizer", "fake_quant_after_n_steps", "log_level", "dataset_val", "batch_size_val",
    "run_val_every_n_steps", "on_nonfinite", "profiler",
    "save_every_n_steps", "keep_last_n_checkpoints",
    "cudnn_deterministic_mode",
}


class QATRecipeSingleDevice:
    def __init__(self, cfg: DictConfig) -> None:
        check_known_keys(cfg, CONFIG_KEYS, "qat_single_device")
        self._runtime = single_device(cfg.get("device", "cuda"))
        self._dtype = training_dtype(cfg, self._runtime.device)
        # Rejects optimizer_in_bwd with clipping before any work is done.
        self._optimizer_in_bwd = optimizer_in_bwd_flag(cfg)
        self._quantizer, self._quantizer_mode = build_quantizer(cfg.get("quantizer"), self._dtype)
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
            ac_interval=ac_interval(cfg), ac_reentrant=checkpoint_reentrant(cfg),
            before_load=self._prepare_qat,
        )
        self._tokenizer = tt_config.instantiate(cfg.tokenizer)
        self._optimizer = build_optimizer(
            cfg.optimizer, self._model, self._optimizer_in_bwd,
            state_dict=resume.optimizer if resume else None,
        )
        self._loss_fn = tt_config.instantiate(cfg.loss)
        self._lm_loss = CausalLMLoss(self._model, self._loss_fn, cfg.get("compile", False))
        self._checkpoint_writer = CheckpointWriter.from_config(cfg, checkpointer, self._runtime)
        fake_quant = FakeQuantSchedule(self._model, self._quantizer_mode,
                                       cfg.get("fake_quant_after_n_steps", None))
        self._driver = setup_step_driver(
            cfg, path=self._path, runtime=self._runtime, state=self._state, resume=resume,
            model=self._model, tokenizer=self._tokenizer, optimizer=self._optimizer,
            save_checkpoint=self.save_checkpoint,
            ignore_index=self._loss_fn.ignore_index, hooks=[fake_quant],
            eval_loss=self._lm_loss.validation_loss,
        )

    def _prepare_qat(self, model: torch.nn.Module) -> torch.nn.Module:
        # Swap linears for fake-quantized ones before loading: same parameter names.
        check_group_size(model, self._quantizer)
        return self._quantizer.prepare(model)

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
        # The fake-quant hook switches quantization on before the step that reaches
        # fake_quant_after_n_steps, and logs fake_quant with every step.
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
    recipe = QATRecipeSingleDevice(cfg)
    recipe.setup(cfg)
    recipe.train()
    recipe.cleanup()


if __name__ == "__main__":
    sys.exit(recipe_main())
