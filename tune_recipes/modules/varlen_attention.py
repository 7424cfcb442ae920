"""Causal attention over the documents of packed (or padding-free) rows, by their lengths.

A batch whose rows hold several documents end to end (``dataset.packed``, ``padding_free``) needs
each token to attend only to the earlier tokens of its own document. With the documents' start
offsets (``DocumentSpans``: a cumulative-lengths vector over the batch's tokens flattened) flash
attention's variable-length kernel computes exactly that, document by document, without a mask:
no mask evaluated per token pair or per tile, and k and v taken at their own head count
(grouped-query attention: each k/v head serves its group of query heads in the kernel).

On a CUDA GPU of compute capability 8.0+ with bf16 or fp16 inputs it runs flash attention
(``torch.ops.aten._flash_attention_forward`` / ``_backward``, behind a custom op that
torch.compile keeps whole); anywhere else (CPU, fp32) the same attention as a dense block-causal
mask built from the spans and PyTorch's ``scaled_dot_product_attention``.
"""

from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor


@dataclass
class DocumentSpans:
    """Where the documents of a batch of ``rows`` rows of ``seq_len`` tokens begin and end:
    ``cu_seqlens`` (int32, documents + 1) holds 0, then each document's end offset into the
    batch's tokens flattened row after row. Every row's tokens are covered: a row's padding is
    a document of its own, and no document crosses a row's end. ``lengths_vary``: the batches
    these spans come with change length from batch to batch (padding-free ones)."""

    cu_seqlens: Tensor
    lengths_vary: bool = False

    def to(self, device, non_blocking: bool = False) -> "DocumentSpans":
        return DocumentSpans(self.cu_seqlens.to(device, non_blocking=non_blocking), self.lengths_vary)


def document_spans(seq_lens, seq_len: int) -> DocumentSpans:
    """The ``DocumentSpans`` of rows whose documents have lengths ``seq_lens`` (a list per row);
    the rest of a row shorter than ``seq_len`` is one more document."""
    ends, offset = [0], 0
    for row, lens in enumerate(seq_lens):
        lens = [int(n) for n in lens if int(n) > 0]
        if sum(lens) > seq_len:
            raise ValueError(f"row {row}: document lengths sum to {sum(lens)} > sequence length {seq_len}")
        if sum(lens) < seq_len:
            lens.append(seq_len - sum(lens))
        for n in lens:
            offset += n
            ends.append(offset)
    return DocumentSpans(torch.tensor(ends, dtype=torch.int32))


def flash_varlen_available() -> bool:
    """Whether this machine runs flash attention's variable-length kernel: a CUDA GPU of compute
    capability 8.0 or newer in a PyTorch built with flash attention."""
    if not torch.cuda.is_available():
        return False
    try:
        available = torch.backends.cuda.is_flash_attention_available()
    except AttributeError:  # older torch: assume built with it
        available = True
    return available and torch.cuda.get_device_capability() >= (8, 0)


def _flash_head_size(head_dim: int) -> bool:
    return head_dim % 8 == 0 and head_dim <= 256


def flash_takes_heads(*models) -> bool:
    """Whether flash attention's kernel takes the head size of every torchtune attention in
    ``models`` (a multiple of 8, at most 256)."""
    from torchtune.modules import MultiHeadAttention

    return all(_flash_head_size(m.head_dim) for model in models for m in model.modules()
               if isinstance(m, MultiHeadAttention))


def _runs_flash(q: Tensor) -> bool:
    return q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and _flash_head_size(q.shape[-1])


# NOTE: a custom op, not an autograd.Function around the aten calls: torch.compile keeps it as
# one opaque call in the graph (and in the whole-model graph of ``compile_scope: model``) with
# the fake implementations below, whatever the torch version's flash signature grew since.
@torch.library.custom_op("tune_recipes::flash_varlen_causal", mutates_args=())
def _flash_forward(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_len: int) -> Tuple[Tensor, Tensor]:
    out, lse, _, _, _ = torch.ops.aten._flash_attention_forward(
        q, k, v, cu_seqlens, cu_seqlens, max_len, max_len, 0.0, True, False)
    return out, lse


@_flash_forward.register_fake
def _(q, k, v, cu_seqlens, max_len):
    # the aten op's own meta function: the log-sum-exp's layout changed across torch versions
    out, lse, _, _, _ = torch.ops.aten._flash_attention_forward(
        q, k, v, cu_seqlens, cu_seqlens, max_len, max_len, 0.0, True, False)
    return torch.empty_like(out), torch.empty_like(lse)


@torch.library.custom_op("tune_recipes::flash_varlen_causal_backward", mutates_args=())
def _flash_backward(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                    cu_seqlens: Tensor, max_len: int) -> Tuple[Tensor, Tensor, Tensor]:
    # no dropout: the random state is never read, but the op takes one
    rng_state = torch.zeros(2, dtype=torch.uint64, device=q.device)
    unused = torch.empty(0, device=q.device)
    dq, dk, dv = torch.ops.aten._flash_attention_backward(
        grad_out.contiguous(), q, k, v, out, lse, cu_seqlens, cu_seqlens, max_len, max_len, 0.0, True,
        rng_state, unused)
    return dq, dk, dv


@_flash_backward.register_fake
def _(grad_out, q, k, v, out, lse, cu_seqlens, max_len):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, cu_seqlens, max_len = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens)
    ctx.max_len = max_len


def _backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse, cu_seqlens = ctx.saved_tensors
    dq, dk, dv = _flash_backward(grad_out, q, k, v, out, lse, cu_seqlens, ctx.max_len)
    return dq, dk, dv, None, None


_flash_forward.register_autograd(_backward, setup_context=_setup_context)


def _dense_document_mask(spans: DocumentSpans, rows: int, seq_len: int) -> Tensor:
    """[rows, 1, seq_len, seq_len] boolean: True where a query may see a key (the key at or
    before it, in its document)."""
    positions = torch.arange(rows * seq_len, device=spans.cu_seqlens.device, dtype=torch.int32)
    doc = torch.searchsorted(spans.cu_seqlens, positions, right=True).view(rows, seq_len)
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=doc.device).tril()
    return ((doc[:, :, None] == doc[:, None, :]) & causal)[:, None]


def varlen_causal_attention(q: Tensor, k: Tensor, v: Tensor, spans: DocumentSpans,
                            scale: Optional[float] = None) -> Tensor:
    """Causal attention inside each document of ``spans``: ``q`` [rows, seq_len, heads, dim],
    ``k`` and ``v`` [rows, seq_len, kv_heads, dim] (kv_heads divides heads: grouped-query
    attention, each k/v head shared by heads / kv_heads consecutive query heads). Returns
    [rows, seq_len, heads, dim]. ``scale``: None for 1 / sqrt(dim)."""
    rows, seq_len, heads, dim = q.shape
    kv_heads = k.shape[2]
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads are not a multiple of {kv_heads} key/value heads")
    if _runs_flash(q) and scale is None:
        tokens = rows * seq_len
        out, _ = _flash_forward(q.reshape(tokens, heads, dim), k.reshape(tokens, kv_heads, dim),
                                v.reshape(tokens, kv_heads, dim), spans.cu_seqlens, seq_len)
        return out.view(rows, seq_len, heads, dim)
    group = heads // kv_heads
    mask = _dense_document_mask(spans, rows, seq_len)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2).repeat_interleave(group, 1),
        v.transpose(1, 2).repeat_interleave(group, 1), attn_mask=mask, scale=scale)
    return out.transpose(1, 2)
