"""Knowledge distillation into a LoRA student on one device.

    tune run knowledge_distillation_single_device --config tiny/kd_single_device
    tune run knowledge_distillation_single_device --config llama3_2/8B_to_1B_kd_single_device

A frozen teacher (``teacher_model`` + ``teacher_checkpointer``) and a LoRA student (``model``)
see the same batch. The student minimizes
``(1 - kd_ratio) * loss(student, labels) + kd_ratio * kd_loss(teacher, student)``, where
``kd_loss`` is the forward KL divergence of the student's next-token distribution from the
teacher's, over the same unmasked tokens (so the mix is a per-token mean and is normalized
exactly like every other recipe's loss). ``class_loss`` and ``kd_loss`` are logged per step;
the shipped ``kd_loss`` (torchtune's) is the teacher's cross-entropy against the student, the KL
plus the teacher's entropy (no gradient), so its logged value stays above the KL.
Teacher and student must share the tokenizer (vocabulary).

Loss normalization is shared with every recipe (tune_recipes.training.step):
with ``gradient_accumulation_steps: 1`` the mean loss is backpropagated as is; with more, each
micro-batch's mean is weighted by its token count and the adapters' gradients are divided by the
step's total once.

Outputs in ``output_dir/epoch_<n>/``: the merged model (HF format, unless
``save_adapter_weights_only``), ``adapter_model.safetensors`` + ``adapter_config.json`` (PEFT
format, loadable with ``peft.PeftModel.from_pretrained``), ``adapter_model.pt`` (torchtune
format). Also ``recipe_state/``, ``metrics.jsonl`` and ``config.yaml``.
"""

import sys
from typing import Dict, Optional, Tuple

import torch
from omegaconf import DictConfig
from torchtune import config as tt_config, training

from tune_recipes.config import check_known_keys, parse
from tune_recipes.training.checkpointing.state import RecipeState
from tune_recipes.training.checkpointing.writer import CheckpointWriter
from tune_recipes.training.losses.kd import DistillationLoss
from tune_recipes.training.setup.activations import ac_interval, checkpoint_reentrant
from tune_recipes.training.setup.model import setup_full_model, setup_lora_model
from tune_recipes.training.setup.offloading import activation_offloading_wanted, offload_activations
from tune_recipes.training.setup.recipe import (
    load_checkpoint,
    read_teacher_weights,
    setup_step_driver,
    training_dtype,
)
from tune_recipes.training.setup.runtime import single_device
from tune_recipes.training.step.driver import Position
from tune_recipes.training.step.normalization import normalization_path
from tune_recipes.training.step.optim import build_optimizer

CONFIG_KEYS = {
    "output_dir", "model", "tokenizer", "checkpointer", "resume_from_checkpoint",
    "save_adapter_weights_only", "dataset", "seed", "shuffle", "batch_size", "epochs",
    "max_steps_per_epoch", "gradient_accumulation_steps", "optimizer", "lr_scheduler", "loss",
    "clip_grad_norm", "compile", "device", "dtype", "enable_activation_checkpointing",
    "ac_mode", "ac_option",
    "metric_logger", "log_every_n_steps", "log_peak_memory_stats", "collate_fn", "padding_free",
    "teacher_model", "teacher_checkpointer", "kd_loss", "kd_ratio", "log_level", "dataset_val",
    "batch_size_val", "run_val_every_n_steps", "on_nonfinite", "profiler",
    "enable_activation_offloading",
    "save_every_n_steps", "keep_last_n_checkpoints",
    "cudnn_deterministic_mode",
}


class KDRecipeSingleDevice:
    def __init__(self, cfg: DictConfig) -> None:
        check_known_keys(cfg, CONFIG_KEYS, "knowledge_distillation_single_device")
        self._runtime = single_device(cfg.get("device", "cuda"))
        self._dtype = training_dtype(cfg, self._runtime.device)
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
            compile_model=cfg.get("compile", False),
            ac_interval=ac_interval(cfg), ac_reentrant=checkpoint_reentrant(cfg),
        )
        self._tokenizer = tt_config.instantiate(cfg.tokenizer)
        self._optimizer = build_optimizer(
            cfg.optimizer, self._model, state_dict=resume.optimizer if resume else None
        )
        self._teacher = self._setup_teacher(cfg.teacher_model, cfg.teacher_checkpointer)
        self._loss_fn = tt_config.instantiate(cfg.loss)
        offload_activations(self._model, self._offload_activations)
        self._kd = DistillationLoss(
            self._model, self._teacher, self._loss_fn, tt_config.instantiate(cfg.kd_loss),
            cfg.get("kd_ratio", 0.5),
        )
        self._checkpoint_writer = CheckpointWriter.from_config(cfg, checkpointer, self._runtime, lora)
        self._driver = setup_step_driver(
            cfg, path=self._path, runtime=self._runtime, state=self._state, resume=resume,
            model=self._model, tokenizer=self._tokenizer, optimizer=self._optimizer,
            save_checkpoint=self.save_checkpoint,
            ignore_index=self._loss_fn.ignore_index,
            eval_loss=self._kd.validation_loss, also_fed=(self._teacher,),
        )

    def _setup_teacher(self, cfg_model: DictConfig, cfg_checkpointer: DictConfig) -> torch.nn.Module:
        teacher_sd = read_teacher_weights(cfg_checkpointer)
        # The library's full-model build: document attention routed for the student's
        # document-masked batches, and a checkpoint of the wrong shapes named in one line.
        return setup_full_model(cfg_model, dtype=self._dtype, device=self._runtime.device,
                                state_dict=teacher_sd, key="teacher_model")

    # ------------------------------------------------------------------ checkpoint
    def save_checkpoint(self, epoch: int, position: Optional[Position] = None) -> None:
        # position: a mid-epoch checkpoint (step_<n>/) at that point of the epoch.
        self._checkpoint_writer.save(self._model, self._optimizer, self._state, epoch, position)

    # ------------------------------------------------------------------ train
    def _loss_step(self, batch: Dict[str, torch.Tensor]) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
        # (mixed mean loss, {"class_loss": ..., "kd_loss": ...}) over the batch's tokens.
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


@parse
def recipe_main(cfg: DictConfig) -> None:
    recipe = KDRecipeSingleDevice(cfg)
    recipe.setup(cfg)
    recipe.train()
    recipe.cleanup()


if __name__ == "__main__":
    sys.exit(recipe_main())
