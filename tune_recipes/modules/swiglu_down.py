"""A trained SwiGLU MLP whose down projection's input is recomputed in backward, not saved.

A Llama/Qwen MLP computes ``h = silu(g) * u`` from ``g = gate(x)`` and ``u = up(x)``, then
``down(h)``. Backward needs ``g`` and ``u`` for the SwiGLU's gradient and, when the down
projection trains, ``h`` for its weight gradient: three tensors of the MLP's width a token
(8192 at Llama-3.2-1B), the largest share of a full fine-tune's activations. torch.compile's
partitioner keeps all three (it does not recompute a value the backward must materialize anyway
for a product). ``h`` is one pointwise step from ``g`` and ``u``, which backward holds anyway:
``SwiGLUDownFeedForward`` saves only those and makes ``h`` again in backward, a third less of the
MLP's saved bytes (1.9 GiB at Llama-3.2-1B, 16 layers of 4 x 2048 tokens less padding).

The arithmetic is autograd's for torchtune's ``FeedForward``, op for op (``F.silu(g) * u``,
``F.linear``, and in backward ``silu_backward``, the products' and the linear's gradients): the
same bits eagerly; compiled, Inductor computes ``h`` in backward with the forward's kernel code.

Used for full fine-tunes under torch.compile (``recompute_down_inputs``, from the single-device
recipes' compile), where Inductor fuses the recompute into the backward's SwiGLU kernel. Eager
steps keep torchtune's module: there autograd
saves four such tensors (``silu(g)`` too) and this module would save two, but the recompute
would be two more unfused kernels a layer (not measured).
"""

import torch
import torch.nn.functional as F
from torch import nn
from torchtune.modules import FeedForward

__all__ = ["SwiGLUDownFeedForward", "recompute_down_inputs"]


class _SwiGLUDown(torch.autograd.Function):
    """``F.linear(F.silu(g) * u, weight)``, saving ``g``, ``u`` and ``weight``."""

    @staticmethod
    def forward(ctx, g: torch.Tensor, u: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(g, u, weight)
        return F.linear(F.silu(g) * u, weight)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        g, u, weight = ctx.saved_tensors
        silu = F.silu(g)
        grad_h = grad_out @ weight  # F.linear's input gradient
        grad_weight = None
        if ctx.needs_input_grad[2]:
            # NOTE: u * silu, not the forward's silu * u (the same product: IEEE multiplication
            # commutes). Compiled, the joint graph's common-subexpression pass would merge an
            # identical op into the forward's h, and the partitioner would save h after all.
            h = u * silu
            grad_weight = grad_out.reshape(-1, grad_out.shape[-1]).t() @ h.reshape(-1, h.shape[-1])
        # the product's gradients, then SiLU's, as autograd computes them for F.silu(g) * u
        grad_u = grad_h * silu
        grad_g = torch.ops.aten.silu_backward(grad_h * u, g)
        return grad_g, grad_u, grad_weight


class SwiGLUDownFeedForward(FeedForward):
    """torchtune's ``FeedForward`` (the same children, names and state dict) whose down
    projection's input is recomputed in backward (module docstring). Made from an existing
    module by ``recompute_down_inputs``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _SwiGLUDown.apply(self.w1(x), self.w3(x), self.w2.weight)


def _qualifies(module: nn.Module) -> bool:
    """A torchtune ``FeedForward`` with SiLU, an up projection and plain linear projections
    whose down projection trains and has no bias: the case ``_SwiGLUDown`` computes. LoRA,
    FP8 or fake-quantized projections (other classes) keep their own forward, and so does a
    down projection with forward hooks (tensor parallelism's output reduction, a user's): the
    product here never calls its module (its backward hooks and torch's global module hooks
    do not run for it either)."""
    if not (type(module) is FeedForward and isinstance(module.activation, nn.SiLU)
            and module.w3 is not None
            and all(type(p) is nn.Linear for p in (module.w1, module.w2, module.w3))):
        return False
    down = module.w2
    hooked = down._forward_hooks or down._forward_pre_hooks
    return down.bias is None and down.weight.requires_grad and not hooked


def recompute_down_inputs(model: nn.Module) -> int:
    """Re-class, in place, every MLP of ``model`` that ``_qualifies`` as a
    ``SwiGLUDownFeedForward``; returns how many. Call it after the parameters' ``requires_grad``
    are set and before compiling (forward hooks put on a down projection after it never run)."""
    swapped = 0
    for module in model.modules():
        if _qualifies(module):
            module.__class__ = SwiGLUDownFeedForward
            swapped += 1
    return swapped
