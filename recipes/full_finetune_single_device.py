"""Full fine-tuning of a decoder LLM on one device.

    tune run full_finetune_single_device --config tiny/full_single_device
    tune run full_finetune_single_device --config llama3_2/1B_full_single_device batch_size=8

Every parameter trains. Features, each a config key:
- ``gradient_accumulation_steps``: micro-batches per optimizer step; the step's loss is the exact
  mean over all their unmasked tokens (tune_recipes.training.StepLossNormalizer).
- ``optimizer_in_bwd``: step each parameter's optimizer during backward and free its gradient
  at once (lowest memory; needs gradient_accumulation_steps=1 and clip_grad_norm=null).
- ``clip_grad_norm``: clip to this norm; ``inf`` only measures and logs it; null disables.
- ``enable_activation_checkpointing``, ``compile``, ``dtype`` (bf16 or fp32).
- ``resume_from_checkpoint``: continue from the last epoch checkpoint in ``output_dir`` with the
  same optimizer state, data order and schedule (the result equals an uninterrupted run).

Outputs in ``output_dir``: ``epoch_<n>/`` (HF-format weights), ``recipe_state/`` (for
resuming), ``metrics.jsonl`` (loss, lr, grad_norm, tokens/s, memory per step), ``config.yaml``.
"""

import sys
from typing import Any, Dict

import torch
from omegaconf import DictConfig
from torchtune import config as tt_config, training, utils
from torchtune.modules import TransformerSelfAttentionLayer

from tune_recipes.config import ConfigError, check_known_keys, parse
from tune_recipes.training import (
    complete_optimizer_step,
    count_valid_tokens,
)
from tune_recipes.training.data import to_device
from tune_recipes.training.lm_loss import CausalLMLoss
from tune_recipes.training.optim import build_optimizer
from tune_recipes.training.setup import (
    build_reporter,
    load_checkpoint,
    make_normalizer,
    setup_data_and_schedule,
    training_dtype,
)
from tune_recipes.training.state import RecipeState

CONFIG_KEYS = {
    "output_dir", "model", "tokenizer", "checkpointer", "resume_from_checkpoint", "dataset",
    "seed", "shuffle", "batch_size", "epochs", "max_steps_per_epoch",
    "gradient_accumulation_steps", "optimizer", "optimizer_in_bwd", "lr_scheduler", "loss",
    "clip_grad_norm", "compile", "device", "dtype", "enable_activation_checkpointing",
    "metric_logger", "log_every_n_steps", "log_peak_memory_stats", "collate_fn",
}


class FullFinetuneRecipeSingleDevice:
    def __init__(self, cfg: DictConfig) -> None:
        check_known_keys(cfg, CONFIG_KEYS, "full_finetune_single_device")
        self._device = utils.get_device(cfg.get("device", "cuda"))
        self._dtype = training_dtype(cfg, self._device)
        self._output_dir = cfg.output_dir
        self._clip_grad_norm = cfg.get("clip_grad_norm", None)
        self._optimizer_in_bwd = cfg.get("optimizer_in_bwd", False)
        self._gradient_accumulation_steps = cfg.get("gradient_accumulation_steps", 1)
        self._resume_from_checkpoint = cfg.get("resume_from_checkpoint", False)
        # Reject incompatible flags before any work is done.
        if self._optimizer_in_bwd and self._clip_grad_norm is not None:
            raise ConfigError(
                "clip_grad_norm needs every gradient at once, but optimizer_in_bwd=True frees "
                "each one inside backward: set clip_grad_norm=null or optimizer_in_bwd=False"
            )
        self._normalizer = make_normalizer(self._gradient_accumulation_steps, self._optimizer_in_bwd)
        self.seed = training.set_seed(seed=cfg.seed)
        self.epochs_run = 0
        self.total_epochs = cfg.epochs
        self.max_steps_per_epoch = cfg.get("max_steps_per_epoch", None)
        self.global_step = 0

    # ------------------------------------------------------------------ setup
    def setup(self, cfg: DictConfig) -> None:
        self._reporter = build_reporter(cfg, self._device)

        self._checkpointer, ckpt, state = load_checkpoint(
            cfg, self._resume_from_checkpoint, adapter=False
        )

        self._model = self._setup_model(
            cfg.model,
            enable_activation_checkpointing=cfg.get("enable_activation_checkpointing", False),
            compile_model=cfg.get("compile", False),
            model_state_dict=ckpt[training.MODEL_KEY],
        )
        self._tokenizer = tt_config.instantiate(cfg.tokenizer)
        self._optimizer = build_optimizer(
            cfg.optimizer, self._model, self._optimizer_in_bwd,
            state_dict=state.optimizer if state else None,
        )
        self._loss_fn = tt_config.instantiate(cfg.loss)
        self._lm_loss = CausalLMLoss(self._model, self._loss_fn, cfg.get("compile", False))

        if state is not None:
            # Before the dataloader: a resumed run keeps the checkpoint's seed (data order) and
            # counters; RNG is restored here too, after model init consumed it.
            state.apply_to(self)
        plan = setup_data_and_schedule(
            cfg, self._tokenizer, self._optimizer, seed=self.seed,
            ignore_index=self._loss_fn.ignore_index, epochs_run=self.epochs_run,
            total_epochs=self.total_epochs,
            gradient_accumulation_steps=self._gradient_accumulation_steps,
            max_steps_per_epoch=self.max_steps_per_epoch,
        )
        self._dataloader, self._steps_per_epoch = plan.dataloader, plan.steps_per_epoch
        self.global_step, self._lr_schedule = plan.global_step, plan.lr_schedule

    def _setup_model(self, cfg_model: DictConfig, enable_activation_checkpointing: bool,
                     compile_model: bool, model_state_dict: Dict[str, Any]) -> torch.nn.Module:
        with training.set_default_dtype(self._dtype), self._device:
            model = tt_config.instantiate(cfg_model)
        if compile_model:
            training.compile_model(model)
        if enable_activation_checkpointing:
            training.set_activation_checkpointing(
                model, auto_wrap_policy={TransformerSelfAttentionLayer}
            )
        model.load_state_dict(model_state_dict)
        training.validate_expected_param_dtype(model.named_parameters(), dtype=self._dtype)
        return model

    # ------------------------------------------------------------------ checkpoint
    def save_checkpoint(self, epoch: int) -> None:
        ckpt = {training.MODEL_KEY: self._model.state_dict()}
        intermediate = epoch + 1 < self.total_epochs
        if intermediate:
            ckpt.update(RecipeState.capture(self, optimizer_state=self._optimizer.state_dict()))
        self._checkpointer.save_checkpoint(ckpt, epoch=epoch, intermediate_checkpoint=intermediate)

    # ------------------------------------------------------------------ train
    def _loss_step(self, batch: Dict[str, torch.Tensor], num_tokens: int) -> torch.Tensor:
        # Mean over the batch's unmasked tokens; a fused loss also gets the factor the
        # normalizer will apply, so its pre-computed gradients need no rescale in backward.
        return self._lm_loss(batch, scaling=self._normalizer.backward_multiplier(num_tokens),
                             num_tokens=num_tokens)

    def train(self) -> None:
        ga = self._gradient_accumulation_steps
        self._optimizer.zero_grad(set_to_none=True)
        for epoch in range(self.epochs_run, self.total_epochs):
            self._dataloader.sampler.set_epoch(epoch)
            self._reporter.start_epoch(epoch, self.total_epochs, self._steps_per_epoch)
            step_in_epoch = 0
            for idx, batch in enumerate(self._dataloader):
                if step_in_epoch == self._steps_per_epoch:
                    break
                # Counted on the CPU labels: a Python int, no device sync.
                num_tokens = count_valid_tokens(batch["labels"], self._loss_fn.ignore_index)
                batch = to_device(batch, self._device)
                loss = self._loss_step(batch, num_tokens)
                self._normalizer.loss_to_backward(
                    loss, num_tokens, where=f"epoch {epoch}, step {self.global_step}, batch {idx}"
                ).backward()
                self._reporter.add_tokens(num_tokens)
                if (idx + 1) % ga != 0:
                    continue
                # Step boundary, same order on every path: normalize (a no-op on the skip and
                # in-backward paths), clip, step, zero_grad, schedule.
                loss_to_log, grad_norm, lr = complete_optimizer_step(
                    self._normalizer, self._model.parameters(), self._optimizer, self._lr_schedule,
                    self._clip_grad_norm,
                )
                self.global_step += 1
                step_in_epoch += 1
                self._reporter.step_done(self.global_step, loss_to_log, lr, grad_norm)
            self._reporter.end_epoch()
            self.epochs_run += 1
            self.save_checkpoint(epoch=epoch)

    def cleanup(self) -> None:
        self._reporter.close()


@parse
def recipe_main(cfg: DictConfig) -> None:
    recipe = FullFinetuneRecipeSingleDevice(cfg)
    recipe.setup(cfg)
    recipe.train()
    recipe.cleanup()


if __name__ == "__main__":
    sys.exit(recipe_main())
