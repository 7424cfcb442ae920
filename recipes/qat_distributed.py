"""Quantization-aware full fine-tuning (QAT) on several GPUs (or CPU processes) with FSDP2.

    tune run --nproc_per_node 2 qat_distributed --config tiny/qat_distributed
    tune run --nproc_per_node 8 qat_distributed --config llama3_1/8B_qat_distributed

The full distributed recipe plus fake quantization: ``quantizer`` (e.g. 8da4w with
``groupsize``) swaps the linears before sharding, and ``fake_quant_after_n_steps`` keeps it off
for the first N steps. Convert the result with ``tune run quantize``.

Parameters, gradients and optimizer states are sharded over the ranks (``fully_shard`` per
transformer layer, then the root). NCCL on CUDA, gloo on CPU.

Loss normalization: the step's loss is the mean over the unmasked tokens of every micro-batch
on every rank, whatever each rank's share of them (see the NOTE in ``train``). The logged loss
is that global mean, so 1-rank and N-rank runs log the same numbers.

Outputs (rank 0) in ``output_dir``: ``epoch_<n>/`` HF-format weights, ``recipe_state/`` for
resuming, ``metrics.jsonl``, ``config.yaml``.
"""

import sys
from typing import Dict

import torch
from omegaconf import DictConfig
from torchtune import config as tt_config, training

from tune_recipes.config import check_known_keys, parse
from tune_recipes.training import complete_optimizer_step, count_valid_tokens
from tune_recipes.training import distributed as tr_dist
from tune_recipes.training.data import to_device
from tune_recipes.training.lm_loss import CausalLMLoss
from tune_recipes.training.qat import FakeQuantSchedule, build_quantizer, check_group_size
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
    "gradient_accumulation_steps", "optimizer", "lr_scheduler", "loss", "clip_grad_norm",
    "compile", "device", "dtype", "enable_activation_checkpointing", "fsdp_reshard_after_forward",
    "custom_sharded_layers", "metric_logger", "log_every_n_steps", "log_peak_memory_stats",
    "collate_fn", "quantizer", "fake_quant_after_n_steps",
}


class QATRecipeDistributed:
    def __init__(self, cfg: DictConfig) -> None:
        check_known_keys(cfg, CONFIG_KEYS, "qat_distributed")
        self._device, self.world_size, self.rank = tr_dist.init_distributed(cfg.get("device", "cuda"))
        self._is_rank_zero = self.rank == 0
        self._dtype = training_dtype(cfg, self._device)
        self._output_dir = cfg.output_dir
        self._clip_grad_norm = cfg.get("clip_grad_norm", None)
        self._gradient_accumulation_steps = cfg.get("gradient_accumulation_steps", 1)
        self._resume_from_checkpoint = cfg.get("resume_from_checkpoint", False)
        self._quantizer, self._quantizer_mode = build_quantizer(cfg.get("quantizer"), self._dtype)
        self._fake_quant_after_n_steps = cfg.get("fake_quant_after_n_steps", None)
        # NOTE: world_size given = distributed: the multiply-by-tokens + rescale path even at GA 1.
        # See the NOTE in train(); do not "simplify" it to the single-device skip.
        self._normalizer = make_normalizer(
            self._gradient_accumulation_steps, world_size=self.world_size
        )
        self.seed = training.set_seed(seed=cfg.seed)
        self.epochs_run = 0
        self.total_epochs = cfg.epochs
        self.max_steps_per_epoch = cfg.get("max_steps_per_epoch", None)
        self.global_step = 0

    def setup(self, cfg: DictConfig) -> None:
        self._reporter = build_reporter(cfg, self._device, is_main=self._is_rank_zero)
        self._checkpointer, ckpt, state = load_checkpoint(
            cfg, self._resume_from_checkpoint, adapter=False
        )

        self._loss_fn = tt_config.instantiate(cfg.loss)
        custom = cfg.get("custom_sharded_layers", None)
        tr_dist.check_fused_loss_sharding(self._loss_fn, custom)
        self._model, _ = tr_dist.shard_and_load(
            cfg.model, dtype=self._dtype, device=self._device, world_size=self.world_size,
            full_state_dict=ckpt[training.MODEL_KEY],
            enable_activation_checkpointing=cfg.get("enable_activation_checkpointing", False),
            reshard_after_forward=cfg.get("fsdp_reshard_after_forward", True),
            custom_sharded_layers=list(custom) if custom else None,
            before_shard=self._prepare_qat,
        )
        if cfg.get("compile", False):
            training.compile_model(self._model, verbose=self._is_rank_zero)
        self._lm_loss = CausalLMLoss(self._model, self._loss_fn, cfg.get("compile", False))
        self._tokenizer = tt_config.instantiate(cfg.tokenizer)
        self._optimizer = tt_config.instantiate(cfg.optimizer, self._model.parameters())
        if state is not None and state.optimizer is not None:
            tr_dist.load_optimizer_state(self._model, self._optimizer, state.optimizer, self._device)

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
            world_size=self.world_size, rank=self.rank,
        )
        self._dataloader, self._steps_per_epoch = plan.dataloader, plan.steps_per_epoch
        self.global_step, self._lr_schedule = plan.global_step, plan.lr_schedule
        self._fake_quant = FakeQuantSchedule(
            self._model, self._quantizer_mode, self._fake_quant_after_n_steps
        )

    def _prepare_qat(self, meta_model) -> None:
        # Swap linears for fake-quantized ones on the meta model, before sharding.
        check_group_size(meta_model, self._quantizer)
        self._quantizer.prepare(meta_model)

    def save_checkpoint(self, epoch: int) -> None:
        intermediate = epoch + 1 < self.total_epochs
        # Collectives: every rank gathers, rank 0 writes.
        model_sd = tr_dist.gather_full_state_dict(self._model, self._is_rank_zero)
        opt_sd = (tr_dist.full_optimizer_state(self._model, self._optimizer, self._is_rank_zero)
                  if intermediate else None)
        if self._is_rank_zero:
            ckpt = {training.MODEL_KEY: model_sd}
            if intermediate:
                ckpt.update(RecipeState.capture(self, optimizer_state=opt_sd))
            self._checkpointer.save_checkpoint(ckpt, epoch=epoch, intermediate_checkpoint=intermediate)
        torch.distributed.barrier()

    def _loss_step(self, batch: Dict[str, torch.Tensor], num_tokens: int) -> torch.Tensor:
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
                if (idx % ga) == 0:
                    self._fake_quant.update(self.global_step)
                # NOTE: num_tokens is this rank's count only. Ranks see different numbers of
                # unmasked tokens (variable-length data), so the loss is multiplied by the local
                # count here and the gradients are divided by the all-reduced global count in
                # finish_step (times world_size, undoing FSDP's averaging). The single-device
                # skip (backward the mean, no rescale) would instead divide each rank by its
                # own count and up-weight ranks with fewer tokens: [5, 3] tokens already move
                # the gradient ~25% (tests/unit/test_distributed_normalization.py).
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
                    self._normalizer, self._model.parameters(), self._optimizer,
                    self._lr_schedule, self._clip_grad_norm,
                )
                self.global_step += 1
                step_in_epoch += 1
                self._reporter.step_done(self.global_step, loss_to_log, lr, grad_norm,
                                         fake_quant=int(self._fake_quant.enabled))
            self._reporter.end_epoch()
            self.epochs_run += 1
            self.save_checkpoint(epoch=epoch)

    def cleanup(self) -> None:
        self._reporter.close()
        tr_dist.destroy()


@parse
def recipe_main(cfg: DictConfig) -> None:
    recipe = QATRecipeDistributed(cfg)
    recipe.setup(cfg)
    recipe.train()
    recipe.cleanup()


if __name__ == "__main__":
    sys.exit(recipe_main())
