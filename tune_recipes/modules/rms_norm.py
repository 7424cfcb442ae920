"""torchtune's RMSNorm through torch's fused kernel, for eager steps.

torchtune's ``RMSNorm`` normalizes in fp32 and scales by its weight in the model's dtype:
``F.rms_norm(x.float(), weight=scale)``. With a bf16 weight and an fp32 input, torch cannot
dispatch to its fused implementation (it warns "Mismatch dtype between input and weight") and
runs the composite: a square, a mean, an add, a reciprocal square root and two products forward,
each its own kernel and each saving its input for backward, and their backward one by one.
``FusedWeightRMSNorm`` passes the weight cast to fp32, the dtype the composite promotes it to
before its last product anyway, so torch's fused kernel runs: the same fp32 arithmetic
(the same bits on the CPU, tested; on a GPU the fused kernel sums each row's squares in its own
order), and one saved fp32 input and a row's scale for backward instead of the composite's
intermediates. The weight's gradient comes back through the cast in the weight's dtype, as the
composite's does.

Eagerly only: under ``torch.compile`` Inductor builds one kernel from either form.

``use_fused_rms_norm(model)`` re-classes every torchtune ``RMSNorm`` in place (the same
parameter, names and checkpoints).
"""

import torch
import torch.nn.functional as F
from torch import nn
from torchtune.modules import RMSNorm

__all__ = ["FusedWeightRMSNorm", "use_fused_rms_norm"]


class FusedWeightRMSNorm(RMSNorm):
    """torchtune's ``RMSNorm`` (its ``normalized_shape``, ``eps`` and ``scale``) with the weight
    in fp32 for the product, so torch's fused kernel computes it. ``use_fused_rms_norm`` makes
    one from an existing module."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # NOTE: keep ``self.scale.float()``: with the weight in bf16 torch falls back to the
        # composite (many kernels and saved tensors); fp32 is what the composite computes in.
        return F.rms_norm(x.float(), normalized_shape=self.normalized_shape,
                          weight=self.scale.float(), eps=self.eps).to(x.dtype)


def use_fused_rms_norm(model: nn.Module) -> int:
    """Re-class every torchtune ``RMSNorm`` in ``model`` as ``FusedWeightRMSNorm``, in place:
    the same parameter and state dict names. Returns how many were re-classed."""
    swapped = 0
    for module in model.modules():
        if type(module) is RMSNorm:
            module.__class__ = FusedWeightRMSNorm
            swapped += 1
    return swapped
