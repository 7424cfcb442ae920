"""LoRA's frozen base projections in FP8: ``enable_fp8_training`` for ``lora_finetune_single_device``.

LoRA trains only the adapters, so the base weight W [out, in] of every ``LoRALinear`` is a
constant. ``convert_lora_to_fp8`` swaps each (plain, bf16-base) ``LoRALinear`` for an
``FP8LoRALinear`` that quantizes W once, at conversion, to float8 e4m3 with one fp32 scale for
the whole tensor (amax-based, as torchao's ``tensorwise`` recipe scales), and computes

    out = fp8_base(x) + bias + (alpha / rank) * lora_b(lora_a(dropout(x)))

``fp8_base`` is ``_FrozenFP8Matmul``: forward casts x to e4m3 with a dynamic per-tensor scale
and multiplies on the FP8 tensor cores (``torch._scaled_mm``, output in x's dtype); backward
computes only grad_x = grad_out @ W (there is no weight gradient), with grad_out cast to e5m2
with its own dynamic scale. The adapters, dropout, scaling and the bias stay in the training
dtype and train exactly as before. No ``.item()`` and no branch on tensor values: it traces
under ``torch.compile`` (the recipe compiles each transformer layer).

Memory (the point of the design, besides speed). The GPU keeps only the e4m3 copy of each
converted weight, 1 byte per element, instead of bf16's 2: the frozen projections' GPU memory
halves (Llama-3.1-8B with LoRA on q/v/output and the MLP: 6.85e9 converted elements, about
6.4 GiB less than bf16). The bf16 ``weight`` Parameter itself moves to CPU memory, under its
name, frozen: ``state_dict()`` keys and values are exactly those of the bf16 model, so the
adapter save, the merged-model save (which merges into this original bf16 base, never a
dequantized one) and a resume work unchanged. The price is CPU RAM: one bf16 copy of the
converted weights (8B: ~12.8 GiB) for the run's lifetime.

Layout choice. ``_scaled_mm`` takes its first operand row-major and its second column-major.
Forward needs W^T column-major, which is W [out, in] row-major as stored (a free ``.t()``);
backward needs W column-major, i.e. W^T row-major. Storing both layouts would cost as much GPU
memory as the bf16 weight (no saving); storing one costs a transpose copy of each weight per
backward call (``.t().contiguous().t()``, as torchao does for its weight): for the 8B case
6.85 GB read + 6.85 GB written per micro-batch, ~3.5 ms at H200 bandwidth against a ~260 ms
bf16 step (about 1-2% of an FP8 step), plus one transient weight (at most 59 MB). We store one
layout: half the base memory for ~2% of the step (an estimate: not yet measured on a GPU).
``fp8_transposed_weight_layers`` N (``keep_transposed_weight``) stores the second layout for the
first N transformer layers: memory for speed, where memory is left over (e.g. what
``fp8_adapter_inputs`` frees).

``fp8_adapter_inputs`` (opt-in, a precision trade of its own). The adapter's first product
needs its input x again in backward (lora_a's gradient is grad_a^T @ x), so plain LoRA keeps x
in bf16 for every adapted projection. The base product has already cast x to e4m3 (one scale
per tensor) for its own forward; with the key set, ``_FrozenFP8LoRAMatmul`` computes base and
adapter in one function and lora_a's gradient from that e4m3 copy instead, so what backward
needs of x is 1 byte an element. The saving is made by compile: in eager mode each projection
keeps its own e4m3 copy where plain LoRA shares one bf16 x between siblings (q and v, gate and
up), so little is saved; under per-layer compile the partitioner recomputes the copies in
backward from tensors the layer keeps anyway (measured on the compiled layer's saved tensors:
the MLP's SwiGLU output and most of the normed inputs are no longer kept). Llama-3.1-8B, batch 2 x
2048, compiled, on an H200: 26.73 -> 21.43 GiB at the same speed. Only lora_a's gradient
changes: it sees x rounded to e4m3 (at most 2^-4 relative per element), as torchao's float8
training does for every weight gradient (there with an FP8 output gradient too); the forward,
the loss, lora_b's gradient and the input gradient are the default path's up to rounding. LoRA dropout is a ``ConfigError`` with it (the adapter's input would not be the base
product's). ``fp8_mlp_activations`` replaces the MLP's forward and computes the down
projection's adapter itself, so with both keys the down adapter follows that key's rules.

Not converted, on purpose: the output projection (as for the full fine-tune: its rounding error
goes straight into the logits), layers whose in or out
features are not multiples of 16 (``_scaled_mm`` needs both dims of each operand divisible by
16; the token count is never an inner dimension here, since there is no weight gradient), and
plain frozen ``nn.Linear`` layers without an adapter (e.g. k_proj when LoRA is not applied to
it: a small share of the FLOPs). Refused with a ``ConfigError``: an NF4 base (QLoRA) and DoRA
(its magnitude needs the bf16 base's column norms every step).

``emulate=True`` computes the same quantized operands' product by dequantizing to fp32 and a
plain matmul, on any device: what the CPU unit tests check the numerics with. Training uses
the real FP8 matmul, which needs a CUDA GPU with compute capability >= 8.9 (checked by
``training.setup.fp8.fp8_recipe_wanted`` before any model is built).
"""

import re
from typing import List, Optional, Tuple

import torch
from torch import nn
from torchtune.modules.peft import DoRALinear, LoRALinear

from tune_recipes.config import ConfigError
from tune_recipes.modules.peft import state_dict_key

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
E4M3_MAX = torch.finfo(E4M3).max  # 448
E5M2_MAX = torch.finfo(E5M2).max  # 57344
# torchao's floor on amax (torchao.float8.float8_utils.EPS): an all-zero tensor gets a finite scale.
AMAX_EPS = 1e-12
# Modules never converted, by the last part of their name (the LM head; see the docstring).
SKIPPED_NAMES = ("output",)
# The config key that makes the adapters' weight gradients read the e4m3 input (see
# _FrozenFP8LoRAMatmul): opt-in, a precision trade of its own.
ADAPTER_INPUTS_KEY = "fp8_adapter_inputs"


def to_float8(t: torch.Tensor, dtype: torch.dtype, per_row: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """``t`` in float8 ``dtype`` with one scale for the whole tensor (or, ``per_row``, one per
    row of the last dim, as [..., 1]), and the fp32 factor that dequantizes it
    (``t ~= q.float() * inv_scale``): scale = max(dtype) / amax(t), saturated cast, the
    arithmetic of torchao's tensorwise float8 (the division in float64, as torchao does, so
    eager and compiled agree). The amax stays a device tensor: no host sync."""
    fmax = torch.finfo(dtype).max
    amax = (t.detach().abs().amax(dim=-1, keepdim=True) if per_row
            else t.detach().abs().amax()).to(torch.float64)
    scale = (fmax / torch.clamp(amax, min=AMAX_EPS)).to(torch.float32)
    q = (t.to(torch.float32) * scale).clamp(-fmax, fmax).to(dtype)
    return q, scale.reciprocal()


def _mm(a: torch.Tensor, a_inv: torch.Tensor, b: torch.Tensor, b_inv: torch.Tensor,
        out_dtype: torch.dtype, fast_accum: bool, emulate: bool) -> torch.Tensor:
    """(a * a_inv) @ (b * b_inv) in ``out_dtype``; ``a`` row-major, ``b`` column-major."""
    if emulate:
        # The same quantized operands, dequantized to fp32 and multiplied in fp32 (tests only).
        return ((a.to(torch.float32) * a_inv) @ (b.to(torch.float32) * b_inv)).to(out_dtype)
    # use_fast_accum: torchao's tensorwise choice, on for the output GEMM, off for grad_input.
    return torch._scaled_mm(a, b, scale_a=a_inv, scale_b=b_inv, out_dtype=out_dtype,
                            use_fast_accum=fast_accum)


def _base_forward(x2: torch.Tensor, weight_fp8: torch.Tensor, weight_inv_scale: torch.Tensor,
                  emulate: bool):
    """x2 [tokens, in] @ W^T on the FP8 tensor cores; also returns x2's e4m3 copy and scale."""
    # Row-major first operand (the caller makes x2 contiguous; the cast keeps its strides).
    x_fp8, x_inv = to_float8(x2, E4M3)
    # W [out, in] row-major: its .t() is the column-major [in, out] operand, no copy.
    out = _mm(x_fp8, x_inv, weight_fp8.t(), weight_inv_scale, x2.dtype, True, emulate)
    return out, x_fp8, x_inv


def _base_grad_input(g2: torch.Tensor, weight_fp8: torch.Tensor, weight_inv_scale: torch.Tensor,
                     emulate: bool, weight_fp8_t: Optional[torch.Tensor] = None) -> torch.Tensor:
    """g2 [tokens, out] @ W, the base product's input gradient, g2 cast to e5m2; ``weight_fp8_t``
    is W's e4m3 copy stored transposed ([in, out], row-major), where the module keeps one."""
    g_fp8, g_inv = to_float8(g2, E5M2)
    # NOTE: the second operand must be column-major: W [out, in] laid out as W^T. One copy
    # per call unless the module stores it (the module docstring says why).
    w_col = weight_fp8_t.t() if weight_fp8_t is not None else weight_fp8.t().contiguous().t()
    return _mm(g_fp8, g_inv, w_col, weight_inv_scale, g2.dtype, False, emulate)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """[..., features] as a contiguous [tokens, features] (the FP8 products' row-major operand)."""
    return t.reshape(-1, t.shape[-1]).contiguous()


class _FrozenFP8Matmul(torch.autograd.Function):
    """x @ W^T with W a constant e4m3 tensor [out, in] and its dequantizing scale; gradient
    for x only."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight_fp8: torch.Tensor, weight_inv_scale: torch.Tensor,
                emulate: bool, weight_fp8_t: Optional[torch.Tensor]) -> torch.Tensor:
        out, _, _ = _base_forward(_rows(x), weight_fp8, weight_inv_scale, emulate)
        # Nothing of x is kept: the base product has no weight gradient.
        ctx.save_for_backward(weight_fp8, weight_inv_scale, weight_fp8_t)
        ctx.emulate = emulate
        return out.reshape(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        if not ctx.needs_input_grad[0]:
            return None, None, None, None, None
        weight_fp8, weight_inv_scale, weight_fp8_t = ctx.saved_tensors
        grad_x = _base_grad_input(_rows(grad_out), weight_fp8, weight_inv_scale, ctx.emulate,
                                  weight_fp8_t)
        return grad_x.reshape(*grad_out.shape[:-1], grad_x.shape[-1]), None, None, None, None


def frozen_fp8_linear(x: torch.Tensor, weight_fp8: torch.Tensor, weight_inv_scale: torch.Tensor,
                      emulate: bool = False, weight_fp8_t: Optional[torch.Tensor] = None
                      ) -> torch.Tensor:
    """``F.linear(x, W)`` for a frozen W given as ``to_float8(W, E4M3)``; differentiable in x.
    ``weight_fp8_t``: the same e4m3 values stored transposed, if kept (no transpose in backward)."""
    return _FrozenFP8Matmul.apply(x, weight_fp8, weight_inv_scale, emulate, weight_fp8_t)


class _FrozenFP8LoRAMatmul(torch.autograd.Function):
    """x @ W^T + bias + scale * (x @ A^T) @ B^T: the frozen FP8 base product and a LoRA adapter
    (A [rank, in], B [out, rank]) in one function, so that backward can take the adapter's
    input from the e4m3 copy of x the base product made anyway (``fp8_adapter_inputs``).

    Forward runs ``FP8LoRALinear``'s default path's operations in its order; backward computes
    the same gradients up to rounding (the scale is applied to the small products), but for one:
    A's gradient is grad_a^T @ x8, x8 being x rounded to e4m3 with one scale per tensor (the
    base product's operand), instead of grad_a^T @ x. What this function keeps of x is 1 byte an
    element instead of 2. NOTE: per projection; in eager mode sibling projections of
    one input (q and v, gate and up) each keep their own e4m3 copy where plain LoRA shares one
    bf16 x, so the saving is small there; under compile (what the recipe runs with FP8) the
    partitioner recomputes the copies in backward from what the layer keeps anyway.

    NOTE: the adapter's second product stays a cuBLAS rank-r matmul. Computing it inside the
    kernel that adds it to the base output (a multiply-sum over the rank, no [tokens, out]
    product in memory) is slower under compile: 8.71 ms per 8B layer against 5.61 on an H200
    (docs/benchmarks.md, "Tried, and did not pay")."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight_fp8: torch.Tensor, weight_inv_scale: torch.Tensor,
                bias: Optional[torch.Tensor], a_weight: torch.Tensor, b_weight: torch.Tensor,
                scale: float, emulate: bool, weight_fp8_t: Optional[torch.Tensor]) -> torch.Tensor:
        x2 = _rows(x)
        out, x_fp8, x_inv = _base_forward(x2, weight_fp8, weight_inv_scale, emulate)
        if bias is not None:
            out = out + bias
        a = x2 @ a_weight.t()  # [tokens, rank]
        out = out + scale * (a @ b_weight.t())
        # NOTE: x8, not x: the point of the function. Saving x here would undo the saving.
        ctx.save_for_backward(weight_fp8, weight_inv_scale, x_fp8, x_inv, a_weight, b_weight, a,
                              weight_fp8_t)
        ctx.scale, ctx.emulate = scale, emulate
        return out.reshape(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        weight_fp8, weight_inv_scale, x_fp8, x_inv, a_weight, b_weight, a, weight_fp8_t = ctx.saved_tensors
        need_x, _, _, need_bias, need_a, need_b, _, _, _ = ctx.needs_input_grad
        g2 = _rows(grad_out)
        # NOTE: the scale multiplies the [.., rank] products, not grad_out: autograd's order
        # (scale * grad_out first) would write and read a second [tokens, out] tensor per
        # adapter, ~20 GB a step at 8B. Only rounding differs.
        grad_x = grad_bias = grad_a_weight = grad_b_weight = None
        if need_b:
            grad_b_weight = ctx.scale * (g2.t() @ a)
        if need_x or need_a:
            grad_a = ctx.scale * (g2 @ b_weight)  # [tokens, rank]
            if need_a:
                # e4m3 values are exact in bf16: multiply the e4m3 copy as is, scale the product.
                grad_a_weight = (grad_a.t() @ x_fp8.to(grad_a.dtype)) * x_inv
            if need_x:
                grad_x = _base_grad_input(g2, weight_fp8, weight_inv_scale, ctx.emulate, weight_fp8_t)
                grad_x = (grad_x + grad_a @ a_weight).reshape(*grad_out.shape[:-1], grad_x.shape[-1])
        if need_bias:
            grad_bias = g2.sum(0)
        return grad_x, None, None, grad_bias, grad_a_weight, grad_b_weight, None, None, None


class FP8LoRALinear(LoRALinear):
    """A ``LoRALinear`` whose frozen base product runs in FP8 (module docstring).

    Same class family, parameter names and adapter protocol as ``LoRALinear`` (PEFT export,
    merging and ``get_adapter_params`` work unchanged). Buffers ``weight_fp8`` (e4m3, on the
    GPU) and ``weight_inv_scale`` (fp32 scalar) are not persistent: not in ``state_dict()``.
    ``weight`` is the original bf16 Parameter, frozen, in CPU memory; forward never reads it.
    """

    # With True, backward takes the adapter's input from the base product's e4m3 copy of x
    # (``_FrozenFP8LoRAMatmul``); set by ``convert_lora_to_fp8(..., fp8_adapter_inputs=True)``.
    fp8_adapter_inputs = False

    @classmethod
    def from_lora_linear(cls, lora: LoRALinear, name: str = "", emulate: bool = False,
                         fp8_adapter_inputs: bool = False) -> "FP8LoRALinear":
        where = f" ({name})" if name else ""
        if getattr(lora, "_quantize_base", False):
            raise ConfigError(
                f"enable_fp8_training=True with a quantized base{where}: the frozen base is NF4 "
                "(QLoRA: model.quantize_base=True or a qlora_* builder), and FP8 quantizes a "
                "bf16 base; set enable_fp8_training=False or model.quantize_base=False")
        if lora.weight.requires_grad:
            raise ConfigError(f"enable_fp8_training: the base weight{where} trains; FP8 LoRA "
                              "needs it frozen (only the adapters train)")
        device = lora.weight.device
        if not emulate and device.type != "cuda":
            raise ConfigError(f"enable_fp8_training=True needs the model on a CUDA GPU; "
                              f"the base weight{where} is on {device.type}")
        # Built on the meta device (nothing allocated), then given the original's modules.
        with torch.device("meta"):
            new = cls(lora.in_dim, lora.out_dim, lora.rank, lora.alpha, use_bias=lora.use_bias)
        new.lora_a, new.lora_b, new.dropout = lora.lora_a, lora.lora_b, lora.dropout
        new.disabled, new.merged = lora.disabled, lora.merged
        new.bias = lora.bias
        weight = lora.weight.detach()
        q, inv = to_float8(weight, E4M3)
        # NOTE: nn.Buffer, not a plain tensor: activation offloading (torchtune's hooks) copies
        # every large tensor saved for backward to CPU unless it is a Parameter or a Buffer,
        # and backward saves this weight.
        new.register_buffer("weight_fp8", nn.Buffer(q, persistent=False), persistent=False)
        new.register_buffer("weight_inv_scale", nn.Buffer(inv, persistent=False), persistent=False)
        new.register_buffer("weight_fp8_t", None, persistent=False)  # keep_transposed_weight()
        # NOTE: the bf16 original, kept exactly (on CPU) for state_dict() and the merged save;
        # do not "simplify" it to a dequantized copy: the merged model would change.
        new.weight = nn.Parameter(weight.to("cpu", copy=True), requires_grad=False)
        new.emulate = emulate
        if fp8_adapter_inputs:
            _check_adapter_inputs(new, name)
            new.fp8_adapter_inputs = True
        return new

    def keep_transposed_weight(self) -> None:
        """Store the e4m3 weight a second time, transposed, for backward's column-major operand:
        no transpose copy per backward, for as much GPU memory again as ``weight_fp8``."""
        if self.weight_fp8_t is None:
            # NOTE: an nn.Buffer for the reason weight_fp8 is one (activation offloading).
            self.register_buffer("weight_fp8_t", nn.Buffer(self.weight_fp8.t().contiguous(),
                                                           persistent=False), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fp8_adapter_inputs and not self.disabled:
            # NOTE: reads lora_a's and lora_b's weights directly (forward hooks on those two
            # modules do not run) and never calls self.dropout: conversion refuses dropout with
            # this key. A disabled adapter takes the plain path below (the base product only).
            return _FrozenFP8LoRAMatmul.apply(x, self.weight_fp8, self.weight_inv_scale, self.bias,
                                              self.lora_a.weight, self.lora_b.weight,
                                              self.alpha / self.rank, self.emulate, self.weight_fp8_t)
        out = frozen_fp8_linear(x, self.weight_fp8, self.weight_inv_scale, self.emulate,
                                self.weight_fp8_t)
        if self.bias is not None:
            out = out + self.bias
        if self.disabled:
            return out
        lora_out = self.lora_a(self.dropout(x))
        return out + (self.alpha / self.rank) * self.lora_b(lora_out)


def _check_adapter_inputs(module: LoRALinear, name: str) -> None:
    """``ConfigError`` where ``fp8_adapter_inputs`` cannot apply to ``module`` (named ``name``)."""
    if not isinstance(module.dropout, nn.Identity):
        where = f" ({name})" if name else ""
        raise ConfigError(f"{ADAPTER_INPUTS_KEY}=True with LoRA dropout{where} "
                          "(model.lora_dropout > 0): the adapter's input is then not the base "
                          f"product's; set model.lora_dropout=0.0 or {ADAPTER_INPUTS_KEY}=False")


def _eligible(module: LoRALinear, name: str) -> bool:
    if name.split(".")[-1] in SKIPPED_NAMES:
        return False
    return module.in_dim % 16 == 0 and module.out_dim % 16 == 0


def layer_index(name: str) -> Optional[int]:
    """The transformer layer a module belongs to, from its state-dict name (``layers.<i>.``)."""
    match = re.search(r"(?:^|\.)layers\.(\d+)\.", name)
    return int(match.group(1)) if match else None


def convert_lora_to_fp8(model: nn.Module, emulate: bool = False,
                        fp8_adapter_inputs: bool = False,
                        transposed_weight_layers: int = 0) -> List[str]:
    """Swap every eligible ``LoRALinear`` of ``model`` for an ``FP8LoRALinear``, in place;
    returns the names of the modules that compute in FP8. Call it after the base weights are loaded (they are
    quantized here, once) and before the first forward (compile traces lazily, so a model
    already marked for compile is fine). With ``transposed_weight_layers`` N, the modules of
    transformer layers 0..N-1 also keep their e4m3 weight transposed for backward
    (``FP8LoRALinear.keep_transposed_weight``: memory for speed). A ``ConfigError`` for DoRA,
    an NF4 base, another ``LoRALinear`` subclass, or a model with nothing to convert."""
    converted: List[str] = []

    def swap(parent: nn.Module, prefix: str) -> None:
        for child_name, child in parent.named_children():
            # The state-dict name (without activation checkpointing's or compile's prefixes).
            name = state_dict_key(f"{prefix}{child_name}")
            if isinstance(child, DoRALinear):
                raise ConfigError(
                    f"enable_fp8_training=True with DoRA ({name}; model.use_dora=True): not "
                    "implemented, DoRA's magnitude needs the bf16 base weight's column norms "
                    "at every step; set model.use_dora=False or enable_fp8_training=False")
            if isinstance(child, LoRALinear):
                if isinstance(child, FP8LoRALinear):  # converted before: only the key can change
                    if fp8_adapter_inputs and not child.fp8_adapter_inputs:
                        _check_adapter_inputs(child, name)
                        child.fp8_adapter_inputs = True
                    converted.append(name)
                    continue
                if type(child) is not LoRALinear:
                    raise ConfigError(
                        f"enable_fp8_training=True: {name} is a {type(child).__name__}; FP8 "
                        "converts plain LoRALinear layers only")
                if _eligible(child, name):
                    setattr(parent, child_name, FP8LoRALinear.from_lora_linear(
                        child, name, emulate, fp8_adapter_inputs))
                    converted.append(name)
                continue
            swap(child, f"{prefix}{child_name}.")

    swap(model, "")
    if not converted:
        raise ConfigError("enable_fp8_training=True, but the model has no LoRALinear whose dims "
                          "are multiples of 16 (the output projection is never converted)")
    if transposed_weight_layers:
        kept = 0
        for name, module in model.named_modules():
            index = layer_index(state_dict_key(name))
            if isinstance(module, FP8LoRALinear) and index is not None and index < transposed_weight_layers:
                module.keep_transposed_weight()
                kept += 1
        if not kept:
            raise ConfigError(f"fp8_transposed_weight_layers={transposed_weight_layers}: no FP8 "
                              "projection sits under layers.<i> (i below it) in this model; set it to 0")
    return converted
