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
the same seeded init as the single-device recipe (tune_recipes.training.adapters), so 1 rank,
N ranks and one device train identically.

Loss normalization: the step's loss is the mean over the unmasked tokens of every micro-batch
on every rank, whatever each rank's share of them (see the NOTE in ``train``). The logged loss
is that global mean, so 1-rank and N-rank runs log the same numbers.

Outputs (rank 0) in ``output_dir/epoch_<n>/``: the merged model (HF format, unless
``save_adapter_weights_only``), the adapter in PEFT and torchtune formats; plus
``recipe_state/``, ``metrics.jsonl``, ``config.yaml``.
"""

import sys
from pathlib import Path
from typing import Dict

import torch
from omegaconf import DictConfig
from torchtune import config as tt_config, training

from tune_recipes.config import ConfigError, check_known_keys, parse
from tune_recipes.training import complete_optimizer_step, count_valid_tokens
from tune_recipes.training import distributed as tr_dist
from tune_recipes.training.checkpoint import (
    LoRASpec,
    complete_peft_adapter_config,
    lora_checkpoint_entries,
)
from tune_recipes.training.data import to_device
from tune_recipes.training.lm_loss import CausalLMLoss
from tune_recipes.modules.qat_lora import qat_configs, swap_lora_linears_for_qat
from tune_recipes.training.qat import FakeQuantSchedule, build_quantizer
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
    "collate_fn", "save_adapter_weights_only", "quantizer", "fake_quant_after_n_steps",
}


class QATLoRAFinetuneRecipeDistributed:
    def __init__(self, cfg: DictConfig) -> None:
        check_known_keys(cfg, CONFIG_KEYS, "qat_lora_finetune_distributed")
        self._device, self.world_size, self.rank = tr_dist.init_distributed(cfg.get("device", "cuda"))
        self._is_rank_zero = self.rank == 0
        self._dtype = training_dtype(cfg, self._device)
        self._output_dir = cfg.output_dir
        self._clip_grad_norm = cfg.get("clip_grad_norm", None)
        self._gradient_accumulation_steps = cfg.get("gradient_accumulation_steps", 1)
        self._resume_from_checkpoint = cfg.get("resume_from_checkpoint", False)
        self._save_adapter_weights_only = cfg.get("save_adapter_weights_only", False)
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
        # Base weights come from checkpoint_dir; when resuming, the adapter from the newest epoch.
        self._base_checkpoint_dir = str(Path(cfg.checkpointer.checkpoint_dir).resolve())
        self._checkpointer, ckpt, state = load_checkpoint(
            cfg, self._resume_from_checkpoint, adapter=True
        )

        self._loss_fn = tt_config.instantiate(cfg.loss)
        custom = cfg.get("custom_sharded_layers", None)
        tr_dist.check_fused_loss_sharding(self._loss_fn, custom)
        cfg_model = cfg.model
        self._lora = LoRASpec.from_model_config(cfg_model)
        self._model = tr_dist.shard_and_load_lora(
            cfg_model, self._lora, dtype=self._dtype, device=self._device,
            world_size=self.world_size, base_state_dict=ckpt[training.MODEL_KEY],
            adapter_state_dict=ckpt.get(training.ADAPTER_KEY), seed=self.seed,
            enable_activation_checkpointing=cfg.get("enable_activation_checkpointing", False),
            reshard_after_forward=cfg.get("fsdp_reshard_after_forward", True),
            custom_sharded_layers=list(custom) if custom else None,
            # Fake-quantize the frozen base path of every LoRA linear (before sharding).
            extra_before_shard=self._swap_for_qat,
        )
        if cfg.get("compile", False):
            training.compile_model(self._model, verbose=self._is_rank_zero)
        self._lm_loss = CausalLMLoss(self._model, self._loss_fn, cfg.get("compile", False))
        self._tokenizer = tt_config.instantiate(cfg.tokenizer)
        self._trainable = [p for p in self._model.parameters() if p.requires_grad]
        self._optimizer = tt_config.instantiate(cfg.optimizer, self._trainable)
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

    def _swap_for_qat(self, meta_model) -> None:
        if swap_lora_linears_for_qat(meta_model, *qat_configs(self._quantizer)) == 0:
            raise ConfigError("model: no LoRA linears to apply QAT to")

    def save_checkpoint(self, epoch: int) -> None:
        intermediate = epoch + 1 < self.total_epochs
        # Collectives: every rank gathers, rank 0 writes.
        full_sd = tr_dist.gather_full_state_dict(self._model, self._is_rank_zero)
        opt_sd = (tr_dist.full_optimizer_state(self._model, self._optimizer, self._is_rank_zero)
                  if intermediate else None)
        if self._is_rank_zero:
            # full_sd holds fresh CPU copies gathered from the shards: safe to merge into.
            ckpt = lora_checkpoint_entries(full_sd, self._lora, self._save_adapter_weights_only)
            if intermediate:
                ckpt.update(RecipeState.capture(self, optimizer_state=opt_sd))
            self._checkpointer.save_checkpoint(
                ckpt, epoch=epoch, intermediate_checkpoint=intermediate,
                adapter_only=self._save_adapter_weights_only,
            )
            complete_peft_adapter_config(
                Path(self._output_dir) / f"epoch_{epoch}", self._base_checkpoint_dir
            )
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
                    self._normalizer, self._trainable, self._optimizer,
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
    recipe = QATLoRAFinetuneRecipeDistributed(cfg)
    recipe.setup(cfg)
    recipe.train()
    recipe.cleanup()


if __name__ == "__main__":
    sys.exit(recipe_main())
