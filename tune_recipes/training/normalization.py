"""Exact token normalization of the loss of one optimizer step.

The loss of a step is the mean cross-entropy over every unmasked token of all its micro-batches
(and, distributed, of all ranks). Loss functions return the mean over one micro-batch, so a step
made of several micro-batches cannot simply average those means: micro-batches hold different
numbers of unmasked tokens. The exact recipe is

    backward(mean_i * n_i) for every micro-batch i, then scale every gradient by 1 / sum(n_i)

and this module is the one place that implements it. Three paths:

- ``rescale``: gradient accumulation > 1, or any distributed run. Multiply each micro-batch's
  mean by its token count before backward; at the step boundary scale the gradients by
  ``world_size / total_tokens`` (``world_size`` undoes the data-parallel gradient averaging),
  with the total all-reduced across ranks.
- ``skip``: a single device with one micro-batch per step. The multiply and the gradient pass
  cancel exactly (n / n), so both are skipped and the mean loss is backpropagated directly. This
  saves a full read-write pass over every gradient per step.
- ``in_backward``: the optimizer steps inside backward (one micro-batch, single device), so the
  loss must already be normalized when backward runs: the mean loss is backpropagated, like
  ``skip``.

Gradient clipping, ``optimizer.step()`` and ``zero_grad()`` are never part of this gate: the
recipe runs them on every path after ``finish_step``.
"""

from typing import Iterable, Optional

import torch
import torch.distributed as dist

CROSS_ENTROPY_IGNORE_INDEX = -100


def count_valid_tokens(labels: torch.Tensor, ignore_index: int = CROSS_ENTROPY_IGNORE_INDEX) -> int:
    """Number of tokens the loss is taken over, for unshifted ``labels`` of shape [b, s].

    Recipes shift labels left by one (token t predicts token t+1), so the first position never
    counts. Call this on the labels while they are still on the CPU, as the dataloader made
    them: the count is then a Python int and no device synchronisation is needed.
    """
    return int((labels[..., 1:] != ignore_index).sum())


def scale_grads_(parameters: Iterable[torch.nn.Parameter], factor: float) -> None:
    """Multiply every existing gradient in place by the Python float ``factor``.

    A Python float, not a 0-dim device tensor: ``_foreach_mul_`` with a scalar runs about three
    times faster than with a tensor operand on an H200 (docs/benchmarks.md).
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    if grads:
        torch._foreach_mul_(grads, float(factor))


def grad_norm_and_clip_(
    parameters: Iterable[torch.nn.Parameter], max_norm: Optional[float]
) -> Optional[torch.Tensor]:
    """Total gradient 2-norm, clipping to ``max_norm`` when it is finite.

    ``max_norm=None`` does nothing and returns None; ``max_norm=inf`` only measures (no extra
    multiply pass over the gradients), so the norm can be logged without clipping.
    """
    if max_norm is None:
        return None
    params = [p for p in parameters if p.grad is not None]
    if not params:
        return None
    max_norm = float(max_norm)
    if max_norm == float("inf"):
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    else:
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    # FSDP2 gradients are DTensors; their norm is one too. Materialize the replicated value.
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


class StepLossNormalizer:
    """Turns per-micro-batch mean losses into an exactly token-normalized step.

    Use per optimizer step::

        loss = loss_fn(...)                                   # mean over this micro-batch
        normalizer.loss_to_backward(loss, n_tokens, where=...).backward()
        ...                                                   # more micro-batches
        loss_to_log = normalizer.finish_step(model.parameters())
        grad_norm = grad_norm_and_clip_(model.parameters(), clip_grad_norm)
        optimizer.step(); optimizer.zero_grad(set_to_none=True)

    Args:
        gradient_accumulation_steps: micro-batches per optimizer step.
        optimizer_in_bwd: the optimizer steps inside backward (requires GA == 1).
        distributed: gradients are averaged over ``world_size`` data-parallel ranks.
        world_size: number of data-parallel ranks (1 when not distributed).
        process_group: group for the token-count all-reduce (default group if None).
    """

    def __init__(
        self,
        gradient_accumulation_steps: int,
        optimizer_in_bwd: bool = False,
        distributed: bool = False,
        world_size: int = 1,
        process_group=None,
    ) -> None:
        if gradient_accumulation_steps < 1:
            raise ValueError(
                f"gradient_accumulation_steps must be >= 1, got {gradient_accumulation_steps}"
            )
        if optimizer_in_bwd and gradient_accumulation_steps != 1:
            raise ValueError(
                "optimizer_in_bwd=True steps the optimizer inside backward, so it cannot "
                f"accumulate gradients: set gradient_accumulation_steps=1 "
                f"(got {gradient_accumulation_steps}) or optimizer_in_bwd=False"
            )
        if optimizer_in_bwd and distributed:
            raise ValueError(
                "optimizer_in_bwd=True cannot normalize by the global token count, which is "
                "only known after every rank's backward; set optimizer_in_bwd=False"
            )
        if not distributed and world_size != 1:
            raise ValueError(f"world_size={world_size} needs distributed=True")
        self.gradient_accumulation_steps = gradient_accumulation_steps
        self.optimizer_in_bwd = optimizer_in_bwd
        self.distributed = distributed
        self.world_size = world_size
        self.process_group = process_group
        # NOTE: the skip is valid only on one device. Distributed, each rank's token count is
        # local while the normalizer must be the all-reduced global count; skipping would divide
        # each rank by its own count and up-weight ranks that saw fewer tokens. Keep the rescale.
        if optimizer_in_bwd:
            self.path = "in_backward"
        elif gradient_accumulation_steps == 1 and not distributed:
            self.path = "skip"
        else:
            self.path = "rescale"
        self._reset()

    @property
    def rescales_gradients(self) -> bool:
        return self.path == "rescale"

    def _reset(self) -> None:
        self._running_loss: Optional[torch.Tensor] = None
        self._num_tokens = 0
        self._micro_batches = 0
        self._extra_sums = {}
        self.extras = {}

    def backward_multiplier(self, num_tokens: int) -> float:
        """The factor ``loss_to_backward`` will multiply this micro-batch's mean loss by (a loss
        that pre-scales its gradients in forward takes it as ``scaling``)."""
        return float(num_tokens) if self.path == "rescale" and num_tokens > 0 else 1.0

    def loss_to_backward(
        self, mean_loss: torch.Tensor, num_tokens: int, where: str = "", extras=None
    ) -> torch.Tensor:
        """Record one micro-batch and return the tensor to call ``backward()`` on.

        ``mean_loss`` is the loss function's mean over this micro-batch's ``num_tokens``
        unmasked tokens (a Python int, see ``count_valid_tokens``). ``where`` names the
        position (e.g. "epoch 0, step 12") for the error message. ``extras`` maps names to
        other per-token means to log (e.g. the two parts of a distillation loss); after
        ``finish_step`` they are in ``self.extras``, token-weighted like the loss.
        """
        num_tokens = int(num_tokens)
        if num_tokens <= 0 and not self.distributed:
            raise RuntimeError(
                f"Batch at {where or 'this step'} has no unmasked label token, so its mean loss "
                "is 0/0. Every example was truncated before its response or fully masked: raise "
                "tokenizer.max_seq_len, set train_on_input=True, or filter such examples from "
                "the dataset."
            )
        self._micro_batches += 1
        self._num_tokens += num_tokens
        if self.path == "rescale":
            # A rank with no unmasked token still runs backward (collectives must match), but
            # its mean is NaN: contribute an exact zero with zero gradients instead.
            loss = mean_loss * num_tokens if num_tokens > 0 else mean_loss.nan_to_num(0.0) * 0.0
        else:
            loss = mean_loss
        detached = loss.detach()
        self._running_loss = detached if self._running_loss is None else self._running_loss + detached
        weight = float(num_tokens) if self.path == "rescale" else 1.0
        for name, value in (extras or {}).items():
            v = value.detach().float() * weight if num_tokens > 0 else torch.zeros((), device=value.device)
            self._extra_sums[name] = v if name not in self._extra_sums else self._extra_sums[name] + v
        return loss

    def finish_step(self, parameters: Iterable[torch.nn.Parameter]) -> torch.Tensor:
        """Close the step: on the rescale path scale gradients by world_size / global tokens.

        Returns the step's loss (a 0-dim tensor; call ``.item()`` only when logging): the mean
        over all unmasked tokens of the step, identical on every path and, distributed, on
        every rank.
        """
        if self._micro_batches != self.gradient_accumulation_steps:
            raise RuntimeError(
                f"finish_step after {self._micro_batches} micro-batches, expected "
                f"gradient_accumulation_steps={self.gradient_accumulation_steps}"
            )
        running_loss = self._running_loss
        names = sorted(self._extra_sums)
        extras = [self._extra_sums[n] for n in names]
        if self.path == "rescale":
            total_tokens = self._num_tokens
            if self.distributed:
                # One all-reduce for all: [loss sum, token count, extras...], in fp64 so counts
                # stay exact.
                dev = running_loss.device
                packed = torch.stack(
                    [running_loss.double(), torch.tensor(float(total_tokens), dtype=torch.float64,
                                                         device=dev)]
                    + [e.double().to(dev) for e in extras]
                )
                dist.all_reduce(packed, group=self.process_group)
                running_loss = packed[0]
                extras = list(packed[2:])
                # The only host sync of the step: the count becomes a Python float so the
                # gradient pass multiplies by a scalar, not a device tensor.
                total_tokens = int(packed[1].item())
            if total_tokens <= 0:
                raise RuntimeError(
                    "No rank had an unmasked label token in this step; raise "
                    "tokenizer.max_seq_len, set train_on_input=True, or filter the data."
                )
            scale_grads_(parameters, self.world_size / total_tokens)
            denominator = float(total_tokens)
        else:
            # Skip/in-backward: running_loss already holds a mean; denominator 1.0.
            denominator = 1.0
        loss_to_log = running_loss / denominator
        extras_to_log = {n: e / denominator for n, e in zip(names, extras)}
        self._reset()
        self.extras = extras_to_log
        return loss_to_log


def complete_optimizer_step(
    normalizer: StepLossNormalizer,
    parameters: Iterable[torch.nn.Parameter],
    optimizer,
    lr_schedule,
    clip_grad_norm: Optional[float],
):
    """The step boundary, in the one order every recipe uses:
    normalize -> clip (or measure) -> optimizer.step -> zero_grad -> LR schedule.

    Only the normalization depends on the path (skip / rescale / in-backward); clipping, the
    optimizer step and zero_grad run on every path. Returns ``(loss_to_log, grad_norm, lr)``
    where ``lr`` is the rate this step used.
    """
    params = list(parameters)
    loss_to_log = normalizer.finish_step(params)
    grad_norm = grad_norm_and_clip_(params, clip_grad_norm)
    lr = lr_schedule.lr
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    lr_schedule.step()
    return loss_to_log, grad_norm, lr
