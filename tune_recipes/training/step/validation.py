"""Validation loss: the token-mean loss over a whole validation set, by the training rules.

Every batch's mean loss is weighted by its unmasked tokens, the weighted sum and the token count
are summed over batches (and, distributed, all-reduced over ranks), and divided once. A mean of
per-batch means would over-weight short batches, exactly as in training (see normalization.py).

Distributed: each rank takes every ``world_size``-th example (no sampler padding: a repeated
example would be counted twice). Ranks may then hold different numbers of batches, but a
sharded (FSDP) forward is collective, so every rank runs as many forwards as the rank with the
most batches; a rank out of batches repeats its last one with weight zero.
"""

from typing import Callable, Dict, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Subset

from tune_recipes.training.step.batch import count_valid_tokens, to_device

# eval_loss(batch on device, num_tokens) -> mean loss over the batch's unmasked tokens
EvalLoss = Callable[[Dict[str, torch.Tensor], int], torch.Tensor]


def shard_for_rank(dataset, world_size: int, rank: int):
    """Examples rank, rank + world_size, ...: every example on exactly one rank."""
    return dataset if world_size == 1 else Subset(dataset, range(rank, len(dataset), world_size))


class Validator:
    def __init__(self, model: nn.Module, eval_loss: EvalLoss, dataloader: DataLoader, *,
                 ignore_index: int, device: torch.device, distributed: bool,
                 every_n_steps: Optional[int] = None, group=None) -> None:
        self.model = model
        self.eval_loss = eval_loss
        self.dataloader = dataloader
        self.ignore_index = ignore_index
        self.device = device
        self.distributed = distributed
        self.group = group  # data-parallel peers (tensor parallelism); None: all processes
        self.every_n_steps = every_n_steps

    def due(self, global_step: int) -> bool:
        return bool(self.every_n_steps) and global_step % self.every_n_steps == 0

    def _max_batches(self, local: int) -> int:
        if not self.distributed:
            return local
        n = torch.tensor([local], device=self.device)
        # NOTE: over every process, not the dp group: FSDP and tensor-parallel forwards are
        # collectives on both mesh dimensions, so all ranks run the same number of them.
        dist.all_reduce(n, op=dist.ReduceOp.MAX)
        return int(n.item())

    @torch.no_grad()
    def __call__(self) -> float:
        """The validation loss (the same value on every rank)."""
        was_training = self.model.training
        self.model.eval()
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        tokens = 0
        batches = list(self.dataloader) if self.distributed else None
        total = self._max_batches(len(batches)) if self.distributed else None
        source = (batches[i] if i < len(batches) else (batches[-1] if batches else None)
                  for i in range(total)) if self.distributed else iter(self.dataloader)
        for i, batch in enumerate(source):
            if batch is None:
                raise RuntimeError("a rank has no validation example: use a larger dataset_val")
            counted = not self.distributed or i < len(batches)
            n = count_valid_tokens(batch["labels"], self.ignore_index)
            mean = self.eval_loss(to_device(dict(batch), self.device), n)
            if counted and n > 0:
                loss_sum += mean.double() * n
                tokens += n
        if self.distributed:
            packed = torch.stack([loss_sum, torch.tensor(float(tokens), dtype=torch.float64,
                                                          device=self.device)])
            dist.all_reduce(packed, group=self.group)
            loss_sum, tokens = packed[0], int(packed[1].item())
        if was_training:
            self.model.train()
        if tokens == 0:
            raise RuntimeError("the validation set has no unmasked label token")
        return float(loss_sum.item() / tokens)
