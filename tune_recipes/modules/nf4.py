"""QLoRA's NF4 base weights dequantized in fewer, lighter kernels, to the same bits.

A QLoRA step dequantizes every frozen NF4 weight to bf16 each time a projection runs: in the
forward, again in backward for the input gradient, and once more for the recompute when layers
are checkpointed. torchao 0.15.0's ``NF4Tensor.get_original_weight`` does it in 13 kernels:
both 4-bit halves of every byte widened to int64 index tensors (8 bytes an element), two
lookups, two copies of the expanded scalers, two scalings, a stack. ``dequantize_nf4`` does it
in 5, three of them over the whole weight: the bytes widened once to int32, one lookup of both
halves at once in a 256-entry table of value pairs, one scaling by the block scalers (those
from torchao's own ``dequantize_scalers``, two small kernels). The products are the same (each
value times its block's scaler, in the same dtypes), so the weights are equal bit for bit
(tested); a dequantization reads and writes about 10 bytes an element instead of about 33
(counted from the kernels).

``use_lean_nf4_dequantization()`` installs it as ``NF4Tensor.get_original_weight``, which every
dequantization of an NF4Tensor goes through (``weight.to(dtype)`` in torchao's ``linear_nf4``,
the state-dict hooks that save a merged model), so torchtune's QLoRA modules use it unchanged.
The LoRA setup installs it for eager models (under ``torch.compile`` Inductor fuses torchao's
dequantization into one kernel anyway); a compiled model traces it correctly if it is installed.

NOTE: it reads torchao's NF4Tensor fields (``quantized_data``, ``quantized_scalers``,
``quantization_factor``, ``nf4``, ``block_size``); with a torchao other than the pinned one it
installs nothing and torchao's own method stays.
"""

from typing import Callable, Dict, Tuple

import torch

_TORCHAO_VERSION = "0.15.0"  # the NF4Tensor layout read here
_PAIR_TABLES: Dict[Tuple[torch.device, torch.dtype], torch.Tensor] = {}
# torchao's own method, once replaced (what the tests compare against).
TORCHAO_DEQUANTIZE: Dict[str, Callable] = {}


def _pair_table(nf4: torch.Tensor) -> torch.Tensor:
    """(256, 2): for each byte, the values of its high and its low 4 bits (torchao packs the
    even element of a pair in the high bits), cached per device and dtype. torchao builds every
    NF4Tensor's 16-value ``nf4`` from the same constants."""
    if type(nf4) is not torch.Tensor or torch.compiler.is_compiling():
        # NOTE: never cached while torch.compile traces (its tensors are fakes, and a cached
        # real one cannot enter its graph); the table is then three more ops in the graph.
        return torch.stack([nf4.repeat_interleave(16), nf4.repeat(16)], dim=-1)
    key = (nf4.device, nf4.dtype)
    table = _PAIR_TABLES.get(key)
    if table is None:
        table = torch.stack([nf4.repeat_interleave(16), nf4.repeat(16)], dim=-1).contiguous()
        _PAIR_TABLES[key] = table
    return table


def dequantize_nf4(weight) -> torch.Tensor:
    """``weight`` (a torchao NF4Tensor) as a plain tensor of its shape and dtype, equal bit for
    bit to ``weight.get_original_weight()`` as torchao 0.15.0 computes it."""
    scalers = weight.dequantize_scalers(weight.quantized_scalers, weight.quantization_factor,
                                        weight.scaler_block_size)
    values = _pair_table(weight.nf4)[weight.quantized_data.int()]  # (numel / 2, 2), in order
    return (values.view(-1, weight.block_size) * scalers.unsqueeze(-1)).view(weight.shape)


def use_lean_nf4_dequantization() -> bool:
    """Make ``dequantize_nf4`` torchao's NF4 dequantization for this process (idempotent).
    Returns whether it is installed: False with a torchao other than 0.15.0."""
    import torchao
    from torchao.dtypes.nf4tensor import NF4Tensor

    if torchao.__version__.split("+")[0] != _TORCHAO_VERSION:
        return False
    if NF4Tensor.get_original_weight is not dequantize_nf4:
        TORCHAO_DEQUANTIZE.setdefault("get_original_weight", NF4Tensor.get_original_weight)
        NF4Tensor.get_original_weight = dequantize_nf4
    return True
