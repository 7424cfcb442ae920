"""Optimizers the shipped configs name: torchao's, with the memory of their step bounded."""

import functools
import math
from typing import Iterator, Optional

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor
from torchao.optim import AdamW8bit as TorchaoAdamW8bit
from torchao.optim.adam import single_param_adam
from torchao.optim.quant_utils import (
    _fp32_to_bf16_sr,
    dequant_with_qmap,
    quantize_8bit_with_qmap,
    scale_tensor,
)
from torchao.optim.subclass_8bit import OptimState8bit


def adamw_8bit_update(p: Tensor, grad: Tensor, step: Tensor, m_codes: Tensor, m_scale: Tensor,
                      m_qmap: Tensor, v_codes: Tensor, v_scale: Tensor, v_qmap: Tensor,
                      lr: Tensor, beta1: float, beta2: float, weight_decay: float, eps: float,
                      bf16_stochastic_round: bool) -> None:
    """One AdamW step of ``p`` in place, its moments 8-bit codes + block scales updated in place:
    torchao's ``single_param_adam`` for AdamW, op for op, on the states' plain tensors.

    NOTE: keep the plain tensors. Called through ``torch.compile``, torchao's own function takes
    the states as tensor subclasses, and unwrapping and rewrapping them costs ~0.25 ms of host
    time a call (0.40 against 0.15 ms at a 64 x 64 parameter, CPU); stepped inside backward that
    is paid once per parameter per step, with the GPU waiting on it."""
    p_f32 = p.float()
    grad_f32 = grad.float()
    p_f32 = p_f32 - lr * weight_decay * p_f32
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    m = dequant_with_qmap(m_codes, m_qmap, m_scale).lerp(grad_f32, 1 - beta1)
    v = dequant_with_qmap(v_codes, v_qmap, v_scale).lerp(grad_f32.square(), 1 - beta2)
    block_size = m_codes.numel() // m_scale.numel()
    for codes, scale, qmap, moment in ((m_codes, m_scale, m_qmap, m), (v_codes, v_scale, v_qmap, v)):
        scaled, new_scale = scale_tensor(moment, block_size)
        codes.copy_(quantize_8bit_with_qmap(scaled, qmap))
        scale.copy_(new_scale)
    denom = (v.sqrt() / bias_correction2.sqrt()) + eps
    p_f32 = p_f32 - lr * (m / bias_correction1) / denom
    p.copy_(_fp32_to_bf16_sr(p_f32) if bf16_stochastic_round else p_f32)


@functools.lru_cache(maxsize=1)
def compiled_updates():
    """torchao's update and ours, each compiled once per process (building the wrapper on every
    step is host time too)."""
    return (torch.compile(single_param_adam, fullgraph=True, dynamic=False),
            torch.compile(adamw_8bit_update, fullgraph=True, dynamic=False))


class AdamW8bit(TorchaoAdamW8bit):
    """torchao's ``AdamW8bit`` (states in 8 bits, block-wise scales), stepping a parameter of
    more than ``chunk_numel`` elements a slice of rows at a time.

    torchao compiles one update per parameter, and inductor materializes the new first and
    second moments in fp32 before quantizing them (each block's scale is a reduction over them):
    two fp32 copies of the parameter alive at once. For Llama-3.1-8B's 525M-element embedding
    and output projection that is 3.9 GiB, measured as the top of the 8B full config's peak on
    an H200 (``BENCH_MEMORY_AT_PEAK``, docs/benchmarks.md). Here such a parameter steps through
    the same compiled torchao update on views of whole rows of the parameter, its gradient and
    its states, cut on quantization-block boundaries: every block's scale and every element come
    out as in one update, and the temporaries stay under ~8 bytes x ``chunk_numel``.

    The compiled update takes the states' plain tensors (codes, scales, quantization map), not
    torchao's tensor subclass: the same arithmetic with less host time a call
    (``adamw_8bit_update``). Parameters whose states torchao keeps unquantized (under 4,096
    elements), ``amsgrad`` and DTensor parameters go through torchao's own update.

    States, ``state_dict`` and checkpoints are torchao's: either class resumes the other's.
    DTensor (FSDP2) parameters are shards already and step whole, as in torchao.
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 amsgrad=False, *, block_size=256, bf16_stochastic_round=False,
                 chunk_numel: int = 2**26) -> None:
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, block_size=block_size,
                         bf16_stochastic_round=bf16_stochastic_round)
        if chunk_numel < 1:
            raise ValueError(f"chunk_numel must be positive, got {chunk_numel}")
        self.chunk_numel = chunk_numel

    def row_slices(self, p: Tensor) -> Iterator[Optional[slice]]:
        """``None`` (step ``p`` whole), or slices of ``p``'s first dimension, each at most ``chunk_numel`` elements where whole
        rows allow it, each starting on a multiple of four quantization blocks (so every slice
        of a state starts a block, and its codes and scales stay 16-byte aligned: inductor
        copies a misaligned input, which would defeat the point)."""
        rows = p.shape[0] if p.dim() else 1
        if isinstance(p, DTensor) or p.numel() <= self.chunk_numel or rows < 2:
            yield None
            return
        row_numel = p.numel() // rows
        align = 4 * self.block_size
        rows_multiple = align // math.gcd(row_numel, align)
        step = max(rows_multiple, (self.chunk_numel // row_numel) // rows_multiple * rows_multiple)
        for start in range(0, rows, step):
            yield slice(start, min(start + step, rows))

    @torch.no_grad()
    def step(self, closure=None) -> Optional[Tensor]:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        torchao_update, plain_update = compiled_updates()
        # One compiled update per distinct (shape, flags): a fixed set for a model, as in torchao.
        with torch._dynamo.utils.disable_cache_limit():
            for group in self.param_groups:
                if not isinstance(group["lr"], Tensor):
                    raise RuntimeError("AdamW8bit keeps lr as a tensor: change it with "
                                       "optimizer.param_groups[i]['lr'].fill_(new_lr)")
                beta1, beta2 = group["betas"]
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    if p.grad.is_sparse:
                        raise RuntimeError("AdamW8bit does not take sparse gradients")
                    state = self.state[p]
                    if not state:  # the keys and buffers torchao's own step creates
                        state["step"] = torch.tensor(0.0)
                        state["exp_avg"] = self._new_buffer(p, True)
                        state["exp_avg_sq"] = self._new_buffer(p, False)
                        if group["amsgrad"]:
                            state["max_exp_avg_sq"] = self._new_buffer(p, False)
                    state["step"] += 1
                    m, v, max_sq = state["exp_avg"], state["exp_avg_sq"], state.get("max_exp_avg_sq")
                    stochastic = self.bf16_stochastic_round and p.dtype is torch.bfloat16
                    # NOTE: p.detach(): compiled with FSDP2's DTensors, p itself misbehaves
                    # (torchao does the same); the gradient is passed on its own.
                    param = p.detach()
                    plain = isinstance(m, OptimState8bit) and isinstance(v, OptimState8bit) and max_sq is None
                    for rows in self.row_slices(p):
                        def cut(t):
                            return t if rows is None or t is None else t[rows]
                        if plain:
                            m_rows, v_rows = cut(m), cut(v)  # views: codes and scales of the rows
                            plain_update(cut(param), cut(p.grad), state["step"], m_rows.codes,
                                         m_rows.scale, m.qmap, v_rows.codes, v_rows.scale, v.qmap,
                                         group["lr"], beta1, beta2, group["weight_decay"],
                                         group["eps"], stochastic)
                        else:
                            torchao_update(cut(param), cut(p.grad), state["step"], cut(m), cut(v),
                                           cut(max_sq), group["lr"], beta1, beta2,
                                           group["weight_decay"], group["eps"], self.is_adamw,
                                           stochastic)
        return loss
