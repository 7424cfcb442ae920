"""Every recipe's ``save_checkpoint``: full or LoRA-type, one device or FSDP, in one place."""

from pathlib import Path
from typing import Dict, Optional

import torch
import torch.distributed as dist
from torch import nn
from torchtune import training

from tune_recipes.training.checkpointing.io import (
    LoRASpec,
    complete_peft_adapter_config,
    lora_checkpoint_entries,
)
from tune_recipes.training.checkpointing.state import RecipeState


class CheckpointWriter:
    """Writes ``output_dir/epoch_<n>/`` through a torchtune checkpointer, plus the recipe state
    (and optimizer state) when more epochs follow.

    ``lora`` set (the five LoRA-type recipes): the adapter in torchtune and PEFT formats, and the
    merged model unless ``adapter_only``; ``base_checkpoint_dir`` goes into the PEFT
    adapter_config.json. ``distributed``: the model and optimizer are FSDP2 shards; saving is a
    collective every rank calls, and the main rank writes.
    """

    def __init__(self, checkpointer, *, output_dir: str, distributed: bool = False,
                 is_main: bool = True, lora: Optional[LoRASpec] = None,
                 adapter_only: bool = False, base_checkpoint_dir: Optional[str] = None) -> None:
        self.checkpointer = checkpointer
        self.output_dir = Path(output_dir)
        self.distributed = distributed
        self.is_main = is_main
        self.lora = lora
        self.adapter_only = adapter_only
        self.base_checkpoint_dir = base_checkpoint_dir

    @classmethod
    def from_config(cls, cfg, checkpointer, runtime, lora: Optional[LoRASpec] = None
                    ) -> "CheckpointWriter":
        """``output_dir``, and for LoRA ``save_adapter_weights_only`` and the base
        ``checkpointer.checkpoint_dir``, from the recipe's config; ``runtime``: where it runs."""
        return cls(checkpointer, output_dir=cfg.output_dir, distributed=runtime.distributed,
                   is_main=runtime.is_main, lora=lora,
                   adapter_only=cfg.get("save_adapter_weights_only", False) if lora else False,
                   base_checkpoint_dir=(str(Path(cfg.checkpointer.checkpoint_dir).resolve())
                                        if lora else None))

    def save(self, model: nn.Module, optimizer, state: RecipeState, epoch: int) -> None:
        intermediate = epoch + 1 < state.total_epochs
        model_sd = self._model_state_dict(model)
        opt_sd = self._optimizer_state_dict(model, optimizer) if intermediate else None
        if self.is_main:
            if self.lora is not None:
                ckpt = lora_checkpoint_entries(model_sd, self.lora, self.adapter_only)
            else:
                ckpt = {training.MODEL_KEY: model_sd}
            if intermediate:
                ckpt.update(state.checkpoint_entries(opt_sd))
            self.checkpointer.save_checkpoint(ckpt, epoch=epoch, intermediate_checkpoint=intermediate,
                                              adapter_only=self.adapter_only)
            if self.lora is not None:
                complete_peft_adapter_config(self.output_dir / f"epoch_{epoch}",
                                             self.base_checkpoint_dir)
        if self.distributed:
            dist.barrier()

    def _model_state_dict(self, model: nn.Module) -> Dict[str, torch.Tensor]:
        if self.distributed:
            # Collective: every rank gathers its shards; fresh full CPU tensors on the main rank.
            return training.gather_cpu_state_dict(model, self.is_main, device=None)
        if self.lora is not None:
            # NOTE: copy=True even on a CPU run, where .to("cpu") would return the live parameter
            # itself: the LoRA merge adds the adapter delta into these tensors in place.
            return {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
        return model.state_dict()

    def _optimizer_state_dict(self, model: nn.Module, optimizer):
        if self.distributed:
            return training.get_full_optimizer_state_dict(model, optimizer, self.is_main, device=None)
        return optimizer.state_dict()
