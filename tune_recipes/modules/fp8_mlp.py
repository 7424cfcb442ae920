"""The MLP's intermediate products kept in FP8 for backward: ``fp8_mlp_activations`` (LoRA and
the single-device full fine-tune).

A Llama/Qwen MLP computes ``h = silu(g) * u`` with ``g = gate(x)``, ``u = up(x)``, then
``down(h)``. Backward needs ``g`` and ``u`` (for the SwiGLU's gradient) and, when the down
projection has a LoRA adapter, ``h`` (its ``lora_a`` gradient is ``grad_a^T @ h``). In bf16
that is 2-3 x 2 bytes x the MLP width per token and layer, the largest share of a LoRA run's
activations: Llama-3.1-8B (width 14336) at batch 2 x 2048 keeps 7.3 GiB of ``g`` and ``u``
over its 32 layers (compile recomputes ``h`` from them).

``FP8SavedFeedForward`` computes the same forward, exactly, but saves ``g`` and ``u`` in
float8 e4m3, 1 byte an element, and recomputes ``h`` from them in backward for the down
adapter's gradient: half the memory (3.7 GiB at that 8B shape). With LoRA each row (token) has
its own scale; in a full fine-tune each tensor has one (below).
The frozen base products never need their inputs (no weight gradient). The price is precision
in backward only: the SwiGLU's gradient and the down adapter's weight gradient see ``g`` and
``u`` rounded to e4m3 (3 mantissa bits; relative error at most 2^-4, ~3.6% rms, for elements
above 2^-6 of the scale's range: below that, about amax / 2^15, e4m3's subnormals keep an
absolute error instead, which matters more with one scale per tensor than per token), less than
the e5m2 rounding (2^-3) of the output gradients that ``enable_fp8_training``'s frozen FP8 base
products already apply. The forward, the loss and the weights' dtypes are unchanged.

In a full fine-tune the down projection trains, and its weight gradient needs ``h`` too: in
bf16 the compiled graph keeps ``g`` and ``u`` (recomputing ``h``), 4.0 GiB at Llama-3.2-1B
batch 4 x 2048 (the largest share of its peak). There the
module runs the down product itself (``_SwiGLUTrainedDown``): the forward is unchanged (``h``
from the exact ``g`` and ``u``), backward recomputes ``h`` from the e4m3 ``g`` and ``u`` for
the down weight's gradient. With ``enable_fp8_training`` (the down projection a torchao
``Float8Linear``, ``tensorwise``) its three products are FP8 as torchao computes them (``h``
and the weight in e4m3 with one scale each, the output gradient in e5m2, fast accumulation
forward, and in backward as the layer's ``fp8_fast_accum_backward`` says); the one
difference is the weight gradient's ``h``, e4m3(h recomputed from e4m3 g and u) instead of
e4m3(h). Half the MLP's saved bytes: 1.75 GiB less at that 1B shape (13.37 GiB peak).

NOTE: one scale per tensor for ``g`` and ``u`` in a full fine-tune, not per token, for speed
(measured on an H200). Per token, inductor
compiles the forward's casts into one kernel that walks each 8192-wide row four times (amax and
cast of ``g``, then of ``u``) and the backward's amax of the recomputed ``h`` into a pass of its
own: +0.9 ms an MLP (4.04 against torchao's 3.13 ms), 10-12% of the 1B step. Per tensor,
all the amaxes share one split reduction and all the casts one pointwise kernel, as torchao's
own casts do: 3.15 ms, and 2.3% of the step. The precision is torchao's
for the down projection's input ``h`` (one e4m3 scale a tensor). LoRA keeps per-token scales
(measured there at 8B; per tensor is not measured with LoRA).

Supported: ``FeedForward`` with ``nn.SiLU`` and an up projection (Llama, Qwen2.5), whose down
projection is a plain frozen linear or a ``LoRALinear`` (bf16, NF4 or FP8 base) with no dropout,
or, in a full fine-tune, a trainable ``nn.Linear`` or tensorwise ``Float8Linear`` without bias.
DoRA (its magnitude needs the adapted weight's norm), LoRA dropout and a LoRA model whose base
weights train are ``ConfigError``s.
"""

from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from torchtune.modules import FeedForward
from torchtune.modules.peft import DoRALinear, LoRALinear

from tune_recipes.config import ConfigError
from tune_recipes.modules.fp8_lora import E4M3, E5M2, FP8LoRALinear, _mm, _rows, frozen_fp8_linear, to_float8
from tune_recipes.modules.peft import state_dict_key

KEY = "fp8_mlp_activations"
LAYERS_KEY = "fp8_mlp_layers"


def _swiglu_grads(grad_h: torch.Tensor, g: torch.Tensor, u: torch.Tensor):
    """(d/dg, d/du) of silu(g) * u for an upstream gradient, all fp32."""
    sig = torch.sigmoid(g)
    silu = g * sig
    return grad_h * u * sig * (1 + g * (1 - sig)), grad_h * silu


class _SwiGLUSavedInFP8(torch.autograd.Function):
    """h = silu(g) * u, and with ``a_weight`` also a = h @ a_weight^T (the down adapter's
    first product); saves g and u in e4m3 (one scale per row, or ``per_row=False`` per tensor)
    and recomputes h in backward."""

    @staticmethod
    def forward(ctx, g: torch.Tensor, u: torch.Tensor, a_weight: Optional[torch.Tensor],
                per_row: bool = True):
        h = F.silu(g) * u
        a = F.linear(h, a_weight) if a_weight is not None else None
        g8, g_inv = to_float8(g, E4M3, per_row=per_row)
        u8, u_inv = to_float8(u, E4M3, per_row=per_row)
        ctx.save_for_backward(g8, g_inv, u8, u_inv, a_weight)
        ctx.dtype = g.dtype
        return (h, a) if a_weight is not None else (h, h.new_zeros(()))

    @staticmethod
    def backward(ctx, grad_h: Optional[torch.Tensor], grad_a: Optional[torch.Tensor]):
        g8, g_inv, u8, u_inv, a_weight = ctx.saved_tensors
        g = g8.to(torch.float32) * g_inv
        u = u8.to(torch.float32) * u_inv
        total = grad_h.to(torch.float32) if grad_h is not None else torch.zeros_like(g)
        grad_a_weight = None
        if a_weight is not None and grad_a is not None:
            total = total + F.linear(grad_a, a_weight.t()).to(torch.float32)
            if ctx.needs_input_grad[2]:
                # The down adapter's weight gradient, from h recomputed out of the FP8 g and u
                # (in the training dtype, as nn.Linear's would be).
                h = (F.silu(g) * u).to(ctx.dtype)
                grad_a_weight = grad_a.reshape(-1, grad_a.shape[-1]).t() @ h.reshape(-1, h.shape[-1])
        grad_g, grad_u = _swiglu_grads(total, g, u)
        return grad_g.to(ctx.dtype), grad_u.to(ctx.dtype), grad_a_weight, None


class _SwiGLUTrainedDown(torch.autograd.Function):
    """out = (silu(g) * u) @ W^T for a trained down projection W [dim, hidden]: saves g and u in
    e4m3 (one scale per tensor, or ``per_row`` per row) and W, recomputes h from them in
    backward for W's gradient (module
    docstring). ``fp8``: the three products in FP8 (tensorwise, torchao's arithmetic: e4m3 h
    and W, e5m2 output gradient; fast accumulation forward, ``fast_grad_input`` and
    ``fast_grad_weight`` for the other two, as the layer's torchao config says); else in the
    training dtype, as ``F.linear``. ``emulate``: the FP8 products dequantized and multiplied
    in fp32 (CPU tests)."""

    @staticmethod
    def forward(ctx, g: torch.Tensor, u: torch.Tensor, weight: torch.Tensor, fp8: bool,
                fast_grad_input: bool, fast_grad_weight: bool, emulate: bool,
                per_row: bool = False) -> torch.Tensor:
        h2 = _rows(F.silu(g) * u)
        if fp8:
            h8, h_inv = to_float8(h2, E4M3)
            w8, w_inv = to_float8(weight, E4M3)
            out = _mm(h8, h_inv, w8.t(), w_inv, g.dtype, True, emulate)
        else:
            out = F.linear(h2, weight)
        g8, g_inv = to_float8(g, E4M3, per_row=per_row)
        u8, u_inv = to_float8(u, E4M3, per_row=per_row)
        ctx.save_for_backward(g8, g_inv, u8, u_inv, weight)
        ctx.dtype, ctx.fp8, ctx.emulate = g.dtype, fp8, emulate
        ctx.fast = (fast_grad_input, fast_grad_weight)
        return out.reshape(*g.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        g8, g_inv, u8, u_inv, weight = ctx.saved_tensors
        g = g8.to(torch.float32) * g_inv
        u = u8.to(torch.float32) * u_inv
        go2 = _rows(grad_out)
        need_w = ctx.needs_input_grad[2]
        h2 = _rows((F.silu(g) * u).to(ctx.dtype)) if need_w else None
        grad_w = None
        if ctx.fp8:
            go8, go_inv = to_float8(go2, E5M2)
            w8, w_inv = to_float8(weight, E4M3)
            # Second operands column-major, first row-major (torch._scaled_mm's layouts).
            grad_h = _mm(go8, go_inv, w8.t().contiguous().t(), w_inv, ctx.dtype, ctx.fast[0], ctx.emulate)
            if need_w:
                # NOTE: the inner dimension here is the token count, which torch._scaled_mm needs
                # to be a multiple of 16 (padded batches rarely are): zero rows, which change
                # neither the scales (amax) nor the product, as torchao's pad_inner_dim does.
                pad = -go2.shape[0] % 16
                if pad:
                    go8, _ = to_float8(F.pad(go2, (0, 0, 0, pad)), E5M2)
                    h2 = F.pad(h2, (0, 0, 0, pad))
                h8, h_inv = to_float8(h2, E4M3)
                grad_w = _mm(go8.t().contiguous(), go_inv, h8.t().contiguous().t(), h_inv, weight.dtype,
                             ctx.fast[1], ctx.emulate)
        else:
            grad_h = go2 @ weight
            if need_w:
                grad_w = (go2.t() @ h2).to(weight.dtype)
        grad_g, grad_u = _swiglu_grads(grad_h.to(torch.float32).reshape(g.shape), g, u)
        return grad_g.to(ctx.dtype), grad_u.to(ctx.dtype), grad_w, None, None, None, None, None


def _trained_down(down: nn.Module) -> Optional[Tuple[bool, bool, bool, bool]]:
    """For a down projection whose own weight trains (a full fine-tune): (its product in FP8,
    fast accumulation for the input gradient, for the weight gradient, emulated); None for a
    frozen or LoRA one."""
    if isinstance(down, LoRALinear) or not down.weight.requires_grad:
        return None
    mm = getattr(down, "linear_mm_config", None)  # a torchao Float8Linear's products
    if mm is None:
        return False, False, False, False
    return True, mm.grad_input.use_fast_accum, mm.grad_weight.use_fast_accum, bool(down.config.emulate)


def _adapter(down: nn.Module) -> Optional[LoRALinear]:
    """The down projection as a LoRALinear whose adapter is active, else None."""
    return down if isinstance(down, LoRALinear) and not down.disabled else None


def _frozen_base(down: LoRALinear, h: torch.Tensor) -> torch.Tensor:
    """The down projection's frozen base product (and bias), as ``down`` computes it."""
    # NOTE: an FP8LoRALinear's fp8_adapter_inputs does not apply here: this module saves g and u
    # in e4m3 and recomputes the adapter's input h from them (its own rounding).
    if isinstance(down, FP8LoRALinear):
        out = frozen_fp8_linear(h, down.weight_fp8, down.weight_inv_scale, down.emulate, down.weight_fp8_t)
        return out + down.bias if down.bias is not None else out
    if getattr(down, "_quantize_base", False):
        from torchao.dtypes.nf4tensor import linear_nf4

        out = linear_nf4(input=h, weight=down.weight)
        return out + down.bias if down.bias is not None else out
    return F.linear(h, down.weight, down.bias)


class FP8SavedFeedForward(nn.Module):
    """A ``FeedForward`` (same children: ``w1`` gate, ``w2`` down, ``w3`` up) that saves its
    intermediate products in FP8 for backward (module docstring). Same state dict.
    ``per_row``: one e4m3 scale per token (True) or per tensor (False) for g and u; None: the
    measured choice, per tensor with a trained down projection, per token with LoRA."""

    def __init__(self, ff: FeedForward, per_row: Optional[bool] = None) -> None:
        super().__init__()
        self.w1, self.w2, self.w3, self.activation = ff.w1, ff.w2, ff.w3, ff.activation
        self.per_row = per_row

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g, u = self.w1(x), self.w3(x)
        trained = _trained_down(self.w2)
        if trained is not None:
            per_row = bool(self.per_row)  # None: per tensor (module docstring's NOTE)
            return _SwiGLUTrainedDown.apply(g, u, self.w2.weight, *trained, per_row)
        per_row = self.per_row is not False  # None: per token
        down = _adapter(self.w2)
        if down is None:
            h, _ = _SwiGLUSavedInFP8.apply(g, u, None, per_row)
            return self.w2(h)
        h, a = _SwiGLUSavedInFP8.apply(g, u, down.lora_a.weight, per_row)
        return _frozen_base(down, h) + (down.alpha / down.rank) * down.lora_b(a)


def _check(ff: FeedForward, name: str) -> None:
    if not isinstance(ff.activation, nn.SiLU) or ff.w3 is None:
        raise ConfigError(f"{KEY}=True: {name} is not a SiLU-gated MLP (gate, up and down "
                          "projections with SiLU); set it to False for this model")
    for child_name in ("w1", "w2", "w3"):
        child = getattr(ff, child_name)
        if isinstance(child, DoRALinear):
            raise ConfigError(f"{KEY}=True with DoRA ({name}.{child_name}; model.use_dora=True): "
                              f"not implemented; set model.use_dora=False or {KEY}=False")
        if isinstance(child, LoRALinear) and not isinstance(child.dropout, nn.Identity):
            raise ConfigError(f"{KEY}=True with LoRA dropout ({name}.{child_name}; "
                              f"model.lora_dropout > 0): not implemented; set model.lora_dropout=0.0 "
                              f"or {KEY}=False")
    has_lora = any(isinstance(getattr(ff, c), LoRALinear) for c in ("w1", "w2", "w3"))
    base_trains = any(p.requires_grad for n, p in ff.named_parameters()
                      if "lora" not in n and "magnitude" not in n)
    if has_lora and base_trains:
        raise ConfigError(f"{KEY}=True: {name} has trainable base weights beside LoRA adapters; "
                          "it is for LoRA (frozen base projections) or a full fine-tune")
    if not has_lora and ff.w2.weight.requires_grad:  # a full fine-tune: this module's own product
        from torchao.float8.float8_linear import Float8Linear

        if type(ff.w2) not in (nn.Linear, Float8Linear):
            # Its own forward (fake quantization, say) would be bypassed: the module computes
            # the product from the weight.
            raise ConfigError(f"{KEY}=True: {name}.w2 is a {type(ff.w2).__name__}; a trained down "
                              f"projection must be an nn.Linear or torchao Float8Linear; set {KEY}=False")
        if ff.w2.bias is not None:
            raise ConfigError(f"{KEY}=True: {name}.w2 has a bias: not implemented for a trained "
                              f"down projection; set {KEY}=False")
        config = getattr(ff.w2, "config", None)  # torchao Float8Linear
        if config is not None and config.cast_config_input.scaling_granularity.value != "tensorwise":
            raise ConfigError(f"{KEY}=True with fp8_recipe_name other than tensorwise ({name}.w2): "
                              f"not implemented; set fp8_recipe_name=tensorwise or {KEY}=False")


def convert_mlps_to_fp8_saved(model: nn.Module, per_row: Optional[bool] = None,
                              max_mlps: Optional[int] = None) -> List[str]:
    """Swap every ``FeedForward`` of ``model`` (``max_mlps`` N: the first N, in module order:
    the first N layers', the key ``fp8_mlp_layers``) for an ``FP8SavedFeedForward``, in place;
    returns their names. Call it after the weights are loaded and any FP8 base conversion,
    before the first forward (compile traces lazily). ``per_row``: FP8SavedFeedForward's."""
    converted: List[str] = []
    total = sum(type(m) is FeedForward for m in model.modules())
    if max_mlps is not None and total and not 1 <= max_mlps <= total:
        raise ConfigError(f"{LAYERS_KEY}={max_mlps}: expected 1 to {total} (the model's MLPs), "
                          f"or null for all of them")

    def swap(parent: nn.Module, prefix: str) -> None:
        for child_name, child in parent.named_children():
            name = state_dict_key(f"{prefix}{child_name}")
            if type(child) is FeedForward and (max_mlps is None or len(converted) < max_mlps):
                _check(child, name)
                setattr(parent, child_name, FP8SavedFeedForward(child, per_row))
                converted.append(name)
                continue
            swap(child, f"{prefix}{child_name}.")

    swap(model, "")
    if not converted:
        raise ConfigError(f"{KEY}=True, but the model has no torchtune FeedForward MLP")
    return converted
