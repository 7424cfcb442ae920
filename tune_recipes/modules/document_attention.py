"""Attention for batches with document masks (packed rows, padding-free micro-batches).

Each torchtune ``MultiHeadAttention`` gets an attention call (``route_document_attention``) that
takes the collate's document mask in either of its forms:

- ``DocumentSpans`` (the documents' offsets; the collates' form on a CUDA GPU that runs flash
  attention): ``modules.varlen_attention``, flash attention's variable-length kernel over the
  documents, k and v at their own head count. torchtune's attention has already copied k and v
  out to every query head by then: the call takes one copy of each group back (the gradient
  flows to the original through the copy's backward).
- a flex attention ``BlockMask`` (where flex attention runs but flash attention does not):
  torchtune calls its own separately compiled ``flex_attention`` from behind
  ``torch.compiler.disable``, which under ``compile: True`` cuts every layer's graph in two with a
  Python round trip between the halves. Calling ``flex_attention`` directly while torch.compile
  traces puts its fused kernels inside the layer's (or the whole model's) graph instead. Outside
  torch.compile, torchtune's call compiles flex attention for one sequence length
  (``dynamic=False``): padding-free batches, whose length changes from batch to batch, would
  compile it again for each new length until torch's recompile limit, then fall back to the
  unfused reference. Here it is compiled with automatic dynamic shapes instead: a graph for the
  first length, then a dynamic-shape one for the others.

Any other mask (a dense boolean one, or none) takes torchtune's call unchanged.
"""

from typing import Callable

import torch
from torch import nn

from tune_recipes.modules.varlen_attention import DocumentSpans, varlen_causal_attention


_compiled_flex = None


def _flex_compiled_for_any_length() -> Callable:
    global _compiled_flex
    if _compiled_flex is None:
        from torch.nn.attention.flex_attention import flex_attention

        _compiled_flex = torch.compile(flex_attention)  # automatic dynamic shapes
    return _compiled_flex


def _one_copy_a_group(t: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[b, heads, s, d] k or v as torchtune passes it (each of ``kv_heads`` heads repeated for
    its group of query heads, consecutively) -> [b, kv_heads, s, d], in memory of its own."""
    if t.shape[1] == kv_heads:
        return t
    # NOTE: keep the copy. A view of one head a group would be what the attention saves for
    # backward, and a view keeps the whole expanded tensor alive: k and v at every query head
    # (4x their size at Llama's 32 / 8 heads; 0.7 GiB at Llama-3.2-1B's 16 layers and 7,600
    # tokens). Compiled, the copy reads the projections' values and the expanded tensor is
    # never made.
    return t.unflatten(1, (kv_heads, -1))[:, :, 0].contiguous()


def _document_attention_call(fallback: Callable, attention: nn.Module) -> Callable:
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    def attention_call(q, k, v, mask=None, dropout_p: float = 0.0, is_causal: bool = True):
        if isinstance(mask, DocumentSpans):
            if dropout_p > 0.0:
                raise ValueError("attention over document spans has no dropout: set the model's "
                                 "attn_dropout to 0.0")
            # NOTE: read when called, not when routed: tensor parallelism divides the module's
            # head counts by its degree after the routing (training.prepare_mha_for_tp).
            kv_heads = attention.num_kv_heads
            k, v = _one_copy_a_group(k, kv_heads), _one_copy_a_group(v, kv_heads)
            out = varlen_causal_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask)
            return out.transpose(1, 2)
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


def route_document_attention(model: nn.Module) -> int:
    """Give each torchtune ``MultiHeadAttention`` in ``model`` the attention call of the module
    docstring; returns how many. Call before compiling. Batches without document spans or a
    ``BlockMask`` (a tensor mask or none) take torchtune's SDPA path as before."""
    from torchtune.modules import MultiHeadAttention

    count = 0
    for module in model.modules():
        if isinstance(module, MultiHeadAttention):
            module._attention_call = _document_attention_call(module._attention_call, module)
            count += 1
    return count


def _mark_length_dynamic(module, args, output) -> None:
    torch._dynamo.maybe_mark_dynamic(output, 1)


def mark_varying_lengths_dynamic(model: nn.Module) -> bool:
    """For a model compiled per layer: a batch whose lengths vary (padding-free spans,
    ``DocumentSpans.lengths_vary``) has its token embedding's output marked dynamic in its
    length, so that the layers' graphs compile once, for every length, from the first batch
    (the step marks the batch's own tensors; a layer's input is the embedding's output, made
    eagerly). The embedding is looked up at each call (``embedding_on_cpu`` replaces it after
    compiling). Returns False, doing nothing, for a model without ``tok_embeddings``."""
    if not hasattr(model, "tok_embeddings"):
        return False

    def before_forward(module, args, kwargs):
        mask = kwargs.get("mask")
        if (isinstance(mask, DocumentSpans) and mask.lengths_vary
                and not torch.compiler.is_compiling()):
            handle = module.tok_embeddings.register_forward_hook(_mark_length_dynamic)
            # NOTE: one call only; removed after the forward below (or a failed one)
            module._length_mark_handles = getattr(module, "_length_mark_handles", []) + [handle]

    def after_forward(module, args, kwargs, output):
        for handle in getattr(module, "_length_mark_handles", []):
            handle.remove()
        module._length_mark_handles = []

    model.register_forward_pre_hook(before_forward, with_kwargs=True)
    model.register_forward_hook(after_forward, with_kwargs=True, always_call=True)
    return True
