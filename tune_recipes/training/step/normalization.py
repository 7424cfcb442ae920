"""Exact token normalization of the loss of one optimizer step.

The loss of a step is the mean cross-entropy over every unmasked token of all its micro-batches
(and, distributed, of all ranks). Loss functions return the mean over one micro-batch, so a step
made of several micro-batches cannot simply average those means: micro-batches hold different
numbers of unmasked tokens. The exact recipe is

    backward(mean_i * n_i) for every micro-batch i, then scale every gradient by 1 / sum(n_i)

and this module is the one place that implements it, on one of four paths
(``NormalizationPath``), chosen once per run by ``normalization_path``.

Optimizer in backward, distributed
----------------------------------
An in-backward optimizer steps each parameter the moment its gradient is reduced, so there is no
step boundary at which to divide by the global token count: the gradient must already be exact
when the hook fires. GA is 1, and the step's batch is on the host before the forward, so its
valid-token count is all-reduced *before* the forward (one 8-byte all-reduce per step) and the
rank's mean loss is backpropagated times ``local_tokens x world_size / global_tokens``; the
data-parallel average (/ world_size) then leaves sum-over-ranks-of-token-losses / global_tokens,
the same gradient RESCALE produces at its step boundary (``IN_BACKWARD_GLOBAL``).

Why the SKIP path is single-device only
---------------------------------------
On one device with one micro-batch per step, the multiply by n and the gradient pass by 1/n
cancel exactly, so both are skipped (a full read-write pass over every gradient saved per step).
Distributed, they do not cancel. ``n`` in the multiply is this rank's *local* token count; the
gradient pass divides by the *global*, all-reduced count (times ``world_size``, which undoes the
data-parallel gradient average). The two agree only when every rank saw the same number of
unmasked tokens, which variable-length instruction data almost never gives. Skipping both would
normalize each rank by its own count and up-weight the ranks that saw fewer tokens: a silent
convergence shift, not a crash. Measured with two real gloo ranks
(tests/unit/test_distributed_normalization.py): [5, 3] tokens move the gradient ~25%, [1, 64]
by more than 100%; only balanced [4, 4] is exact. A single-device test cannot see this
(world_size is 1 and every variant agrees), so the distributed recipes always take RESCALE.

Gradient clipping, ``optimizer.step()`` and ``zero_grad()`` are never part of this gate: they
run after ``finish_step`` on every path (``tune_recipes.training.step.driver``).
"""

from enum import Enum
from typing import Dict, Iterable, List, Optional

import torch
import torch.distributed as dist

from tune_recipes.config import ConfigError
from tune_recipes.modules.loss import declare_grad_output


class NormalizationPath(str, Enum):
    """How one step's per-micro-batch mean losses become an exactly token-normalized step."""

    #: One device, one micro-batch per step: no multiply, no rescale, clip and step anyway,
    #: logged loss = the mean (denominator 1.0). The x n and / n would cancel exactly.
    SKIP = "skip"
    #: Gradient accumulation > 1, or any distributed run: backward(mean x local tokens), then
    #: gradients x world_size / global tokens (one Python float) at the step boundary.
    RESCALE = "rescale"
    #: The optimizer steps inside backward (one device, GA 1): the loss must already be
    #: normalized when backward runs, so the mean is backpropagated, as on SKIP.
    IN_BACKWARD = "in_backward"
    #: The optimizer steps inside backward on several ranks (GA 1): the step's token count is
    #: all-reduced before the forward and the mean loss is backpropagated times
    #: local tokens x world_size / global tokens, so each reduced gradient is already exact.
    IN_BACKWARD_GLOBAL = "in_backward_global"

    @property
    def steps_in_backward(self) -> bool:
        """Whether the optimizer steps inside backward (one device or several)."""
        return self in (NormalizationPath.IN_BACKWARD, NormalizationPath.IN_BACKWARD_GLOBAL)

    def describe(self) -> str:
        return {
            NormalizationPath.SKIP: "skip (one device, gradient_accumulation_steps=1: no token "
                                    "multiply, no scale_grads; clip and step as always)",
            NormalizationPath.RESCALE: "rescale (loss x micro-batch tokens, gradients x "
                                       "world_size / step tokens at the step boundary)",
            NormalizationPath.IN_BACKWARD: "in_backward (the optimizer steps inside backward on "
                                           "the mean loss)",
            NormalizationPath.IN_BACKWARD_GLOBAL: "in_backward_global (token count all-reduced "
                                                  "before the forward; loss x local tokens x "
                                                  "world_size / global tokens; the optimizer "
                                                  "steps inside backward)",
        }[self]


def normalization_path(*, distributed: bool, gradient_accumulation_steps: int,
                       optimizer_in_bwd: bool = False) -> NormalizationPath:
    """The one decision: which path a run takes. Incompatible flags are a ConfigError."""
    if gradient_accumulation_steps < 1:
        raise ConfigError(
            f"gradient_accumulation_steps must be >= 1, got {gradient_accumulation_steps}")
    if optimizer_in_bwd:
        if gradient_accumulation_steps != 1:
            raise ConfigError(
                "optimizer_in_bwd=True steps the optimizer inside backward, so it cannot "
                f"accumulate gradients: set gradient_accumulation_steps=1 "
                f"(got {gradient_accumulation_steps}) or optimizer_in_bwd=False")
        if distributed:
            return NormalizationPath.IN_BACKWARD_GLOBAL
        return NormalizationPath.IN_BACKWARD
    if gradient_accumulation_steps == 1 and not distributed:
        return NormalizationPath.SKIP
    # Distributed: RESCALE even at GA 1 (see the module docstring).
    return NormalizationPath.RESCALE


def scale_grads_(parameters: Iterable[torch.nn.Parameter], factor: float) -> None:
    """Multiply every existing gradient in place by ``factor``, passed on as a Python float.

    A Python float, not a 0-dim device tensor: ``_foreach_mul_`` with a scalar runs about twice
    as fast as with a tensor operand on an H200 (docs/benchmarks.md).
    """
    for grads in grads_by_mesh([p.grad for p in parameters if p.grad is not None]):
        torch._foreach_mul_(grads, float(factor))


def grads_by_mesh(grads: List[torch.Tensor]) -> List[List[torch.Tensor]]:
    """``grads`` grouped so each group is all plain tensors or all DTensors of one device mesh.

    NOTE: one group in every run but tensor parallelism. There, the planned layers' gradients
    are DTensors on the tp mesh (or the 2-D mesh under FSDP) while the norms' are plain tensors
    (or dp-mesh DTensors), and a foreach op over a list mixing them fails ("mixed torch.Tensor
    and DTensor"): keep the grouping even though it looks redundant.
    """
    groups: Dict[object, List[torch.Tensor]] = {}
    for g in grads:
        groups.setdefault(getattr(g, "device_mesh", None), []).append(g)
    return list(groups.values())


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
    groups = grads_by_mesh([p.grad for p in params])
    if len(groups) > 1:
        # Tensor parallelism: one norm per mesh, each materialized, then combined; the clip
        # coefficient multiplies each group separately (see grads_by_mesh).
        norms = [torch.nn.utils.get_total_norm(g) for g in groups]
        norm = torch.linalg.vector_norm(torch.stack(
            [n.full_tensor() if hasattr(n, "full_tensor") else n for n in norms]))
        if max_norm != float("inf"):
            # As torch.nn.utils.clip_grads_with_norm_ computes it (same eps, clamped at 1).
            coef = float(torch.clamp(max_norm / (norm + 1e-6), max=1.0))
            for g in groups:
                torch._foreach_mul_(g, coef)
        return norm
    if max_norm == float("inf"):
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    else:
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    # FSDP2 gradients are DTensors; their norm is one too. Materialize the replicated value.
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


def _no_label_tokens(what: str, can_skip: bool = True) -> str:
    """The one line for a step with nothing to train on: a data problem, not a bug (raised as
    a ConfigError, so it prints as one line naming where and what to change). ``can_skip``:
    whether on_nonfinite=skip is open to the run (not with the optimizer in backward)."""
    skip = ("set on_nonfinite=skip to skip such steps (the data stays as it is, so a checkpoint "
            "of this run still resumes), " if can_skip else "")
    return (f"{what[0].upper()}{what[1:]} has no unmasked label token, so its mean loss is "
            "0/0. Every example was truncated before its response or fully masked: raise "
            f"tokenizer.max_seq_len, set train_on_input=True, {skip}or filter such examples from "
            "the dataset (a fresh run: a mid-epoch checkpoint resumes only on its own data).")


class StepLossNormalizer:
    """Turns per-micro-batch mean losses into an exactly token-normalized step.

    The step driver (``tune_recipes.training.step.driver``) is its one user in the recipes::

        loss = loss_fn(...)                                   # mean over this micro-batch
        normalizer.loss_to_backward(loss, n_tokens, where=...).backward()
        ...                                                   # more micro-batches
        loss_to_log = normalizer.finish_step(params)          # then clip, step, zero_grad, LR

    Args:
        gradient_accumulation_steps: micro-batches per optimizer step.
        optimizer_in_bwd: the optimizer steps inside backward (requires GA == 1).
        distributed: gradients are averaged over ``world_size`` data-parallel ranks.
        world_size: number of data-parallel ranks (1 when not distributed); under tensor
            parallelism the data-parallel size, not the number of processes.
        group: the data-parallel process group the token counts are all-reduced over (None:
            every process). Under tensor parallelism the ranks of one tensor-parallel group see
            the same batch and must count it once.
        device: where the pre-forward token all-reduce runs (``IN_BACKWARD_GLOBAL`` only; the
            CPU for gloo, the rank's GPU for NCCL).
    """

    def __init__(self, gradient_accumulation_steps: int, optimizer_in_bwd: bool = False,
                 distributed: bool = False, world_size: int = 1,
                 device: Optional[torch.device] = None, group=None) -> None:
        if not distributed and world_size != 1:
            raise ConfigError(f"world_size={world_size} needs distributed=True")
        self.path = normalization_path(distributed=distributed,
                                       gradient_accumulation_steps=gradient_accumulation_steps,
                                       optimizer_in_bwd=optimizer_in_bwd)
        self.gradient_accumulation_steps = gradient_accumulation_steps
        self.distributed = distributed
        self.world_size = world_size
        self.group = group
        self.device = device if device is not None else torch.device("cpu")
        self.extras: Dict[str, torch.Tensor] = {}
        # on_nonfinite=skip (set by the step driver): a step without a label token is not an
        # error but a 0/0 loss, which the non-finite guard then skips like any other.
        self.skip_empty_steps = False
        self.last_step_empty = False
        self._reset()

    def _reset(self) -> None:
        self._running_loss: Optional[torch.Tensor] = None
        self._num_tokens = 0
        self._micro_batches = 0
        self._extra_sums: Dict[str, torch.Tensor] = {}
        self._global_tokens: Optional[int] = None
        self._where = ""

    @property
    def _weights_by_tokens(self) -> bool:
        """Each micro-batch's mean is weighted by its token count (loss sums, extras)."""
        return self.path in (NormalizationPath.RESCALE, NormalizationPath.IN_BACKWARD_GLOBAL)

    def global_tokens(self, num_tokens: int) -> int:
        """``IN_BACKWARD_GLOBAL``: the step's token count over all ranks, all-reduced once per
        step (every rank asks at the same point, before its forward) and cached."""
        if self._global_tokens is None:
            count = torch.tensor([float(num_tokens)], dtype=torch.float64, device=self.device)
            dist.all_reduce(count, group=self.group)
            self._global_tokens = int(count.item())
            if self._global_tokens <= 0:
                raise ConfigError(_no_label_tokens(
                    f"every rank's batch at {self._where or 'this step'}", can_skip=False))
        return self._global_tokens

    def backward_factor(self, num_tokens: int, where: str = "") -> float:
        """The factor ``loss_to_backward`` multiplies this micro-batch's mean loss by (a loss
        that pre-scales its gradients in forward takes it as ``scaling``); ``where``: as for
        ``loss_to_backward`` (asked before the forward, it may be the first to know)."""
        if where:
            self._where = where
        if self.path == NormalizationPath.IN_BACKWARD_GLOBAL:
            # Every rank joins the count's all-reduce, even one with no token of its own.
            global_tokens = self.global_tokens(num_tokens)
            return num_tokens * self.world_size / global_tokens if num_tokens > 0 else 1.0
        if self.path == NormalizationPath.RESCALE and num_tokens > 0:
            return float(num_tokens)
        return 1.0

    def loss_to_backward(
        self, mean_loss: torch.Tensor, num_tokens: int, where: str = "", extras=None
    ) -> torch.Tensor:
        """Record one micro-batch and return the tensor to call ``backward()`` on.

        ``mean_loss`` is the loss function's mean over this micro-batch's ``num_tokens``
        unmasked tokens (a Python int, see ``count_valid_tokens``). ``where`` names the
        position (e.g. "epoch 0, step 12 (batch 47 of the epoch)") for the error message. ``extras`` maps names to
        other per-token means to log (e.g. the two parts of a distillation loss); after
        ``finish_step`` they are in ``self.extras``, token-weighted like the loss.

        Call ``backward()`` on the returned tensor with its default gradient: the fused loss is
        told the gradient that reaches it (``declare_grad_output``), which spares its host sync.
        """
        num_tokens = int(num_tokens)
        rescale = self._weights_by_tokens
        if num_tokens <= 0 and not rescale and not self.skip_empty_steps:
            # The micro-batch is the whole step: nothing to train on.
            raise ConfigError(_no_label_tokens(f"batch at {where or 'this step'}",
                                               can_skip=not self.path.steps_in_backward))
        self._where = where
        self._micro_batches += 1
        self._num_tokens += num_tokens
        if rescale:
            # A micro-batch (or a rank) with no unmasked token still runs backward (collectives
            # must match), but its mean is NaN: contribute an exact zero with zero gradients;
            # the step's other micro-batches (and ranks) carry it (the step's count is checked
            # in _step_sums).
            factor = self.backward_factor(num_tokens)
            loss = mean_loss * factor if num_tokens > 0 else mean_loss.nan_to_num(0.0) * 0.0
            if num_tokens > 0:
                declare_grad_output(mean_loss, factor)
            # logged as a token sum, like RESCALE's
            detached = (mean_loss.detach() * num_tokens if num_tokens > 0
                        else torch.zeros((), dtype=mean_loss.dtype, device=mean_loss.device))
        elif num_tokens <= 0:
            # SKIP with skip_empty_steps: the step is this micro-batch and holds nothing to
            # train on. Zero gradients, a NaN (0/0) loss to log; the guard skips the update.
            loss = mean_loss.nan_to_num(0.0) * 0.0
            detached = torch.full((), float("nan"), dtype=mean_loss.dtype, device=mean_loss.device)
        else:
            loss = mean_loss  # SKIP / IN_BACKWARD: no multiply
            declare_grad_output(mean_loss, 1.0)
            detached = loss.detach()
        self._running_loss = detached if self._running_loss is None else self._running_loss + detached
        weight = float(num_tokens) if rescale else 1.0
        for name, value in (extras or {}).items():
            # A micro-batch without tokens adds nothing to a step's sums (rescale); alone in
            # its step (skip), its mean is 0/0, as its loss.
            empty = torch.zeros((), device=value.device) if rescale else \
                torch.full((), float("nan"), device=value.device)
            v = value.detach().float() * weight if num_tokens > 0 else empty
            self._extra_sums[name] = v if name not in self._extra_sums else self._extra_sums[name] + v
        return loss

    def finish_step(self, parameters: Iterable[torch.nn.Parameter]) -> torch.Tensor:
        """Close the step's normalization. Returns the step's loss (a 0-dim tensor; call
        ``.item()`` only when logging): the mean over all unmasked tokens of the step, identical
        on every path and, distributed, on every rank."""
        if self._micro_batches != self.gradient_accumulation_steps:
            raise RuntimeError(
                f"finish_step after {self._micro_batches} micro-batches, expected "
                f"gradient_accumulation_steps={self.gradient_accumulation_steps}"
            )
        names = sorted(self._extra_sums)
        self.last_step_empty = False
        if self.path == NormalizationPath.RESCALE:
            loss_sum, extra_sums, total_tokens = self._step_sums(names)
            scale_grads_(parameters, self.world_size / total_tokens)
            denominator = float(total_tokens)
        elif self.path == NormalizationPath.IN_BACKWARD_GLOBAL:
            # The gradients were exact (and are already spent) when backward ran; only the
            # logged values need the all-reduced sums.
            loss_sum, extra_sums, total_tokens = self._step_sums(names)
            denominator = float(total_tokens)
        else:
            # SKIP / IN_BACKWARD: no multiply happened, so there is nothing to rescale; the
            # running loss is already the step's mean (denominator 1.0). Clip and step still
            # run after this, as on every path.
            loss_sum, extra_sums = self._running_loss, [self._extra_sums[n] for n in names]
            denominator = 1.0
            self.last_step_empty = self._num_tokens <= 0
        self.extras = {n: e / denominator for n, e in zip(names, extra_sums)}
        loss_to_log = loss_sum / denominator
        self._reset()
        return loss_to_log

    def _step_sums(self, names: List[str]):
        """(loss sum, extra sums, token count) of the step; distributed, over all ranks."""
        running_loss = self._running_loss
        extras = [self._extra_sums[n] for n in names]
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
            dist.all_reduce(packed, group=self.group)
            running_loss = packed[0]
            extras = list(packed[2:])
            # The only host sync of the step: the count becomes a Python number so the
            # gradient pass multiplies by a scalar, not a device tensor.
            total_tokens = int(packed[1].item())
        if total_tokens <= 0:
            if self.skip_empty_steps:
                # Every rank sees the same count: all skip this step (gradients are zeros).
                self.last_step_empty = True
                nan = torch.full((), float("nan"), dtype=running_loss.dtype, device=running_loss.device)
                return nan, [nan for _ in extras], 1
            ranks = " on every rank" if self.distributed else ""
            raise ConfigError(_no_label_tokens(
                f"every micro-batch of the step ending at {self._where or 'this step'}{ranks}"))
        return running_loss, extras, total_tokens
