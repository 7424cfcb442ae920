"""Packed batches' flex attention traced into the compiled graph.

On packed data the collate hands the model a ``BlockMask`` (document masks), and torchtune's
attention then calls its own separately compiled ``flex_attention`` from behind
``torch.compiler.disable``. Under ``compile: True`` that cuts every transformer layer's graph in
two (forward and backward), with a Python round trip between the halves. Calling
``flex_attention`` directly while torch.compile traces puts the same fused kernels inside the
layer's (or the whole model's) graph instead: ``compile_scope: model`` then traces the whole
forward as one graph. On the H200, Llama-3.2-1B full on packed instruction data ran 2% faster
with it (docs/benchmarks.md, "On instruction data (packed) and as shipped").
"""

from typing import Callable

import torch
from torch import nn


def _flex_call_traced_while_compiling(fallback: Callable) -> Callable:
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    def attention_call(q, k, v, mask=None, dropout_p: float = 0.0, is_causal: bool = True):
        # NOTE: only while torch.compile traces. Run eagerly (compile off, or a frame dynamo
        # gave up on), flex_attention is its unfused reference, which materializes the whole
        # score matrix (~2 GiB a layer at 4 x 32 heads x 2048^2); torchtune's own call, compiled
        # on its own, stays the eager path.
        if isinstance(mask, BlockMask) and torch.compiler.is_compiling():
            if dropout_p > 0.0:
                raise ValueError("flex attention has no dropout: set the model's attn_dropout to 0.0")
            return flex_attention(q, k, v, block_mask=mask)
        return fallback(q, k, v, mask=mask, dropout_p=dropout_p, is_causal=is_causal)

    return attention_call


def trace_flex_attention_when_compiled(model: nn.Module) -> int:
    """Give each torchtune ``MultiHeadAttention`` in ``model`` an attention call that traces
    flex attention into the compiled graph (see the module docstring); returns how many. Call
    before compiling. Unpacked batches (a tensor mask or none) take torchtune's SDPA path as
    before, and so does everything outside torch.compile."""
    from torchtune.modules import MultiHeadAttention
    from torchtune.utils._import_guard import _SUPPORTS_FLEX_ATTENTION

    if not _SUPPORTS_FLEX_ATTENTION:  # no BlockMask on this machine: nothing to trace
        return 0
    count = 0
    for module in model.modules():
        if isinstance(module, MultiHeadAttention):
            module._attention_call = _flex_call_traced_while_compiling(module._attention_call)
            count += 1
    return count
