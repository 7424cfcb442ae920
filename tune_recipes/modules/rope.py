"""Llama's rotary position embeddings in fewer kernels, to the same bits, for eager steps.

torchtune's ``RotaryPositionalEmbeddings`` and ``Llama3ScaledRoPE`` rotate each pair of a head's
features (2i, 2i+1) by its position's angle in fp32: the pairs are selected out, four products,
a difference, a sum, a stack; 40 operators a call forward and backward (its backward writes
each selected half into a zero-filled full-size tensor), twice a layer (queries and keys).
``InterleavedRoPE`` computes the same sums on the pairs as they lie:

    out = pairs * cos + swap(pairs) * (-sin, sin)

out[2i] = x[2i] c + x[2i+1] (-s) is torchtune's x[2i] c - x[2i+1] s (a product's sign is
exact), out[2i+1] = x[2i+1] c + x[2i] s its sum in its order: the same fp32 roundings, so the
same bits (tested on the CPU, and on an H100 for Llama3ScaledRoPE at Llama-3.1-8B's head shape), in 4
kernels (a flip, two products, a sum) and two casts; 21 operators a call forward and backward.
Eagerly only: under ``torch.compile`` Inductor fuses either form into one kernel, and may
contract products into FMAs differently.

``use_interleaved_rope(model)`` swaps every attention's torchtune Llama RoPE for one built from
its cache (a buffer outside the state dict: checkpoints are unchanged).
"""

from typing import Optional

import torch
from torch import nn

__all__ = ["InterleavedRoPE", "use_interleaved_rope"]


def _llama_rope_classes() -> tuple:
    from torchtune.models.llama3_1._position_embeddings import Llama3ScaledRoPE
    from torchtune.modules import RotaryPositionalEmbeddings

    return (RotaryPositionalEmbeddings, Llama3ScaledRoPE)


class InterleavedRoPE(nn.Module):
    """torchtune's Llama RoPE (interleaved pairs) from its ``cache`` ([max_seq_len, head_dim
    / 2, 2]: cosine, sine), as its ``forward(x, *, input_pos=None)`` computes it. One buffer,
    ``rotation`` [max_seq_len, head_dim / 2, 3]: (cos, -sin, sin), 1.5x torchtune's cache, so
    a packed batch's positions are one gather."""

    def __init__(self, cache: torch.Tensor) -> None:
        super().__init__()
        cos, sin = cache[..., 0], cache[..., 1]
        self.register_buffer("rotation", torch.stack([cos, -sin, sin], dim=-1), persistent=False)

    def forward(self, x: torch.Tensor, *, input_pos: Optional[torch.Tensor] = None) -> torch.Tensor:
        # x: [b, s, n_h, h_d]; input_pos: [b, s] for packed rows (each document from 0)
        seq_len = x.size(1)
        rotation = self.rotation[:seq_len] if input_pos is None else self.rotation[input_pos]
        rotation = rotation.view(-1, seq_len, 1, x.size(-1) // 2, 3)
        pairs = x.float().unflatten(-1, (-1, 2))  # [b, s, n_h, h_d / 2, 2]
        # (x[2i+1] (-s), x[2i] s), then + (x[2i] c, x[2i+1] c): torchtune's sums, in place
        # where autograd allows (neither product saves its input), so the forward's fp32 peak
        # is three copies of x, as torchtune's.
        rotated = pairs.flip(-1).mul_(rotation[..., 1:])
        out = pairs * rotation[..., :1]
        del pairs
        return out.add_(rotated).flatten(-2).type_as(x)


def use_interleaved_rope(model: nn.Module) -> int:
    """Give every module whose ``pos_embeddings`` is torchtune's Llama RoPE (built, not on the
    meta device) an ``InterleavedRoPE`` of the same cache; modules that shared one RoPE share
    its replacement. Returns how many modules now use one."""
    classes = _llama_rope_classes()
    replacements = {}
    swapped = 0
    for module in model.modules():
        rope = getattr(module, "pos_embeddings", None)
        if type(rope) not in classes or not getattr(rope, "is_cache_built", True):
            continue
        if rope.cache.is_meta:
            continue
        if id(rope) not in replacements:
            replacements[id(rope)] = InterleavedRoPE(rope.cache)
        module.pos_embeddings = replacements[id(rope)]
        swapped += 1
    return swapped
