"""What the step does with one micro-batch before the model sees it."""

from typing import Any, Dict

import torch
from torch.nn.attention.flex_attention import BlockMask

from tune_recipes.constants import CROSS_ENTROPY_IGNORE_INDEX
from tune_recipes.data.collate import move_block_mask
from tune_recipes.modules.varlen_attention import DocumentSpans


def count_valid_tokens(labels: torch.Tensor, ignore_index: int = CROSS_ENTROPY_IGNORE_INDEX) -> int:
    """Number of tokens the loss is taken over, for unshifted ``labels`` of shape [b, s].

    Recipes shift labels left by one (token t predicts token t+1), so the first position never
    counts. Call this on the labels while they are still on the CPU, as the dataloader made
    them: the count is then a Python int and no device synchronisation is needed.
    """
    return int((labels[..., 1:] != ignore_index).sum())


def shift_labels(labels: torch.Tensor, ignore_index: int = CROSS_ENTROPY_IGNORE_INDEX) -> torch.Tensor:
    """labels[:, 1:] padded with ignore_index: position t is scored on token t+1, without
    slicing the (large) logits."""
    pad = torch.full_like(labels[..., :1], ignore_index)
    return torch.cat([labels[..., 1:], pad], dim=-1)


def _document_spans_to(spans: DocumentSpans, device: torch.device) -> DocumentSpans:
    moved = spans.to(device, non_blocking=True)
    # NOTE: the number of documents changes from batch to batch; marked dynamic from the first
    # batch, a compiled graph (the whole model's, under compile_scope: model) is not compiled
    # a second time for the second batch's count.
    torch._dynamo.maybe_mark_dynamic(moved.cu_seqlens, 0)
    return moved


def to_device(batch: Dict[str, Any], device: torch.device) -> Dict[str, Any]:
    """The batch's tensors and its document mask (flex attention's ``BlockMask`` or the
    documents' spans), if any, on ``device``, copied without waiting for the GPU. Spans of
    batches whose length varies (padding-free) mark the row length of the batch's [rows, length]
    tensors dynamic from the first batch: the whole model's compiled graph (``compile_scope:
    model``) is compiled once, for every length, not first for one length and again for the
    rest. (Compiled per layer, a layer's input is the eager embedding's output:
    ``training.setup.model.compile_layers`` marks it too.)"""
    moved = {k: (v.to(device, non_blocking=True) if isinstance(v, torch.Tensor)
                 else move_block_mask(v, device) if isinstance(v, BlockMask)
                 else _document_spans_to(v, device) if isinstance(v, DocumentSpans) else v)
             for k, v in batch.items()}
    spans, tokens = moved.get("mask"), moved.get("tokens")
    if isinstance(spans, DocumentSpans) and spans.lengths_vary and isinstance(tokens, torch.Tensor):
        for value in moved.values():
            if isinstance(value, torch.Tensor) and value.dim() == 2 and value.shape == tokens.shape:
                torch._dynamo.maybe_mark_dynamic(value, 1)
    return moved
