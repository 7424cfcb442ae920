"""Flex attention for batches with document masks: inside the compiled graph, and compiled
once for every length outside it.

On packed data the collate hands the model a ``BlockMask`` (document masks), and torchtune's
attention then calls its own separately compiled ``flex_attention`` from behind
``torch.compiler.disable``. Under ``compile: True`` that cuts every transformer layer's graph in
two (forward and backward), with a Python round trip between the halves. Calling
``flex_attention`` directly while torch.compile traces puts the same fused kernels inside the
layer's (or the whole model's) graph instead: ``compile_scope: model`` then traces the whole
forward as one graph. On the H200, Llama-3.2-1B full on packed instruction data ran 2% faster
with it (docs/benchmarks.md, "On instruction data (packed, padded) and as shipped").

Outside torch.compile (``compile: False``), torchtune's call compiles flex attention for one
sequence length (``dynamic=False``): padding-free batches (``data.collate``), whose length
changes from batch to batch, would compile it again for each new length until torch's recompile
limit, then fall back to the unfused reference. Here it is compiled with torch's automatic
dynamic shapes instead: a graph for the first length, then a dynamic-shape one for the others
(inductor may split a size range once more).
"""

from typing import Callable

import torch
from torch import nn


_compiled_flex = None


def _flex_compiled_for_any_length() -> Callable:
    global _compiled_flex
    if _compiled_flex is None:
        from torch.nn.attention.flex_attention import flex_attention

        _compiled_flex = torch.compile(flex_attention)  # automatic dynamic shapes
    return _compiled_flex


def _flex_call_traced_while_compiling(fallback: Callable) -> Callable:
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    def attention_call(q, k, v, mask=None, dropout_p: float = 0.0, is_causal: bool = True):
        # NOTE: the plain flex_attention only while torch.compile traces. Run eagerly (compile
        # off, or a frame dynamo gave up on), flex_attention is its unfused reference, which
        # materializes the whole score matrix (~2 GiB a layer at 4 x 32 heads x 2048^2).
        if isinstance(mask, BlockMask):
            if dropout_p > 0.0:
                raise ValueError("flex attention has no dropout: set the model's attn_dropout to 0.0")
            if torch.compiler.is_compiling():
                return flex_attention(q, k, v, block_mask=mask)
            return _flex_compiled_for_any_length()(q, k, v, block_mask=mask)
        return fallback(q, k, v, mask=mask, dropout_p=dropout_p, is_causal=is_causal)

    return attention_call


def route_flex_attention(model: nn.Module) -> int:
    """Give each torchtune ``MultiHeadAttention`` in ``model`` the attention call of the module
    docstring; returns how many. Call before compiling. Batches without a ``BlockMask`` (a
    tensor mask or none) take torchtune's SDPA path as before."""
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
