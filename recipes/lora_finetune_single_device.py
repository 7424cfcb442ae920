"""LoRA, QLoRA and DoRA fine-tuning of a decoder LLM on one device.

    tune run lora_finetune_single_device --config tiny/lora_single_device
    tune run lora_finetune_single_device --config llama3_1/8B_lora_single_device batch_size=4

Only the adapters train; the base weights stay frozen. Which variant runs is the model builder's
choice: ``lora_*`` builders give LoRA, ``qlora_*`` builders (or ``quantize_base: True``) keep the
frozen base in NF4, ``use_dora: True`` adds DoRA's magnitude vectors.

Loss normalization is shared with every recipe (tune_recipes.training.StepLossNormalizer):
with ``gradient_accumulation_steps: 1`` the mean loss is backpropagated as is; with more, each
micro-batch's mean is weighted by its token count and the adapters' gradients are divided by the
step's total once.

Outputs in ``output_dir/epoch_<n>/``: the merged model (HF format, unless
``save_adapter_weights_only``), ``adapter_model.safetensors`` + ``adapter_config.json`` (PEFT
format, loadable with ``peft.PeftModel.from_pretrained``), ``adapter_model.pt`` (torchtune
format). Also ``recipe_state/``, ``metrics.jsonl`` and ``config.yaml``.
"""

import sys
from pathlib import Path
from typing import Any, Dict, Optional

import torch
from omegaconf import DictConfig
from torchtune import config as tt_config, training, utils

from tune_recipes.config import check_known_keys, parse
from tune_recipes.training import (
    complete_optimizer_step,
    count_valid_tokens,
)
from tune_recipes.training.checkpoint import (
    complete_peft_adapter_config,
    lora_checkpoint_entries,
)
from tune_recipes.training.data import to_device
from tune_recipes.training.lm_loss import CausalLMLoss
from tune_recipes.training.optim import build_optimizer
from tune_recipes.training.setup import (
    build_reporter,
    load_checkpoint,
    make_normalizer,
    setup_data_and_schedule,
    setup_lora_model,
    training_dtype,
)
from tune_recipes.training.state import RecipeState

CONFIG_KEYS = {
    "output_dir", "model", "tokenizer", "checkpointer", "resume_from_checkpoint",
    "save_adapter_weights_only", "dataset", "seed", "shuffle", "batch_size", "epochs",
    "max_steps_per_epoch", "gradient_accumulation_steps", "optimizer", "lr_scheduler", "loss",
    "clip_grad_norm", "compile", "device", "dtype", "enable_activation_checkpointing",
    "metric_logger", "log_every_n_steps", "log_peak_memory_stats", "collate_fn",
}


class LoRAFinetuneRecipeSingleDevice:
    def __init__(self, cfg: DictConfig) -> None:
        check_known_keys(cfg, CONFIG_KEYS, "lora_finetune_single_device")
        self._device = utils.get_device(cfg.get("device", "cuda"))
        self._dtype = training_dtype(cfg, self._device)
        self._output_dir = cfg.output_dir
        self._clip_grad_norm = cfg.get("clip_grad_norm", None)
        self._gradient_accumulation_steps = cfg.get("gradient_accumulation_steps", 1)
        self._resume_from_checkpoint = cfg.get("resume_from_checkpoint", False)
        self._save_adapter_weights_only = cfg.get("save_adapter_weights_only", False)
        self._normalizer = make_normalizer(self._gradient_accumulation_steps)
        self.seed = training.set_seed(seed=cfg.seed)
        self.epochs_run = 0
        self.total_epochs = cfg.epochs
        self.max_steps_per_epoch = cfg.get("max_steps_per_epoch", None)
        self.global_step = 0

    # ------------------------------------------------------------------ setup
    def setup(self, cfg: DictConfig) -> None:
        self._reporter = build_reporter(cfg, self._device)
        # Base weights come from checkpoint_dir; when resuming, the adapter from the newest epoch.
        self._base_checkpoint_dir = str(Path(cfg.checkpointer.checkpoint_dir).resolve())
        self._checkpointer, ckpt, state = load_checkpoint(
            cfg, self._resume_from_checkpoint, adapter=True
        )

        self._model = self._setup_model(
            cfg.model,
            enable_activation_checkpointing=cfg.get("enable_activation_checkpointing", False),
            compile_model=cfg.get("compile", False),
            base_model_state_dict=ckpt[training.MODEL_KEY],
            lora_weights_state_dict=ckpt.get(training.ADAPTER_KEY),
        )
        self._tokenizer = tt_config.instantiate(cfg.tokenizer)
        self._optimizer = build_optimizer(
            cfg.optimizer, self._model, state_dict=state.optimizer if state else None
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
                     compile_model: bool, base_model_state_dict: Dict[str, Any],
                     lora_weights_state_dict: Optional[Dict[str, Any]]) -> torch.nn.Module:
        model, self._lora = setup_lora_model(
            cfg_model, dtype=self._dtype, device=self._device, seed=self.seed,
            base_state_dict=base_model_state_dict, lora_state_dict=lora_weights_state_dict,
            compile_model=compile_model,
            enable_activation_checkpointing=enable_activation_checkpointing,
        )
        return model

    # ------------------------------------------------------------------ checkpoint
    def save_checkpoint(self, epoch: int) -> None:
        intermediate = epoch + 1 < self.total_epochs
        ckpt: Dict[str, Any] = {}
        if intermediate:
            ckpt.update(RecipeState.capture(self, optimizer_state=self._optimizer.state_dict()))
        # CPU copies (copy=True even on a CPU run): the merge writes into them.
        cpu_sd = {k: v.detach().to("cpu", copy=True) for k, v in self._model.state_dict().items()}
        ckpt.update(lora_checkpoint_entries(cpu_sd, self._lora, self._save_adapter_weights_only))
        self._checkpointer.save_checkpoint(
            ckpt, epoch=epoch, intermediate_checkpoint=intermediate,
            adapter_only=self._save_adapter_weights_only,
        )
        complete_peft_adapter_config(
            Path(self._output_dir) / f"epoch_{epoch}", self._base_checkpoint_dir
        )

    # ------------------------------------------------------------------ train
    def _loss_step(self, batch: Dict[str, torch.Tensor], num_tokens: int) -> torch.Tensor:
        # Mean over the batch's unmasked tokens; a fused loss also gets the factor the
        # normalizer will apply, so its pre-computed gradients need no rescale in backward.
        return self._lm_loss(batch, scaling=self._normalizer.backward_multiplier(num_tokens),
                             num_tokens=num_tokens)

    def train(self) -> None:
        ga = self._gradient_accumulation_steps
        trainable = [p for p in self._model.parameters() if p.requires_grad]
        self._optimizer.zero_grad(set_to_none=True)
        for epoch in range(self.epochs_run, self.total_epochs):
            self._dataloader.sampler.set_epoch(epoch)
            self._reporter.start_epoch(epoch, self.total_epochs, self._steps_per_epoch)
            step_in_epoch = 0
            for idx, batch in enumerate(self._dataloader):
                if step_in_epoch == self._steps_per_epoch:
                    break
                num_tokens = count_valid_tokens(batch["labels"], self._loss_fn.ignore_index)
                batch = to_device(batch, self._device)
                loss = self._loss_step(batch, num_tokens)
                self._normalizer.loss_to_backward(
                    loss, num_tokens, where=f"epoch {epoch}, step {self.global_step}, batch {idx}"
                ).backward()
                self._reporter.add_tokens(num_tokens)
                if (idx + 1) % ga != 0:
                    continue
                loss_to_log, grad_norm, lr = complete_optimizer_step(
                    self._normalizer, trainable, self._optimizer, self._lr_schedule,
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
    recipe = LoRAFinetuneRecipeSingleDevice(cfg)
    recipe.setup(cfg)
    recipe.train()
    recipe.cleanup()


if __name__ == "__main__":
    sys.exit(recipe_main())
