"""Batches with document masks: packed sequences, and padding-free micro-batches.

A packed sequence holds several examples one after another; each example attends only to its
own earlier tokens (a block-causal "document" mask). ``document_mask`` gives it in the form the
run's attention takes: in bf16 on a GPU that runs flash attention, the examples' offsets
(``modules.varlen_attention.DocumentSpans``, for its variable-length kernel); else on a GPU
with flex attention a ``BlockMask``, which ``document_block_mask`` builds on the CPU from the
examples' lengths, in O((seq_len / 128)^2) work a row, where torchtune's collate evaluates the
mask on every token pair on the GPU (a seq_len^2 tensor a row, and a host sync) each batch; on a
CPU a dense boolean mask. Either is moved to the device with the rest of the batch without a
sync (``training.step.batch.to_device``).

``padded_to_a_multiple`` pads a padded batch's rows on to a multiple of 128 tokens on a GPU, so
that a run sees a bounded set of batch shapes.

``padding_free_collate`` lays the rows of an unpacked micro-batch end to end in one sequence
with a document mask instead of padding each row to the longest: the same examples, the same
(position, target) pairs scored, the same attention, without the padding's compute.
``packed_padding_free_collate`` does the same for packs: each pack without the padding that
fills it to its length, the packs end to end.
"""

import copy
from typing import Any, Dict, List, Mapping, Optional, Sequence

import torch
from torch.nn.attention.flex_attention import BlockMask

from tune_recipes.constants import CROSS_ENTROPY_IGNORE_INDEX
from tune_recipes.modules.varlen_attention import DocumentSpans, document_spans

# flex attention's tile: a BlockMask describes the mask in blocks of this many queries x keys.
FLEX_BLOCK = 128
# What a padding-free row over documents' spans is padded on to: flash attention takes any
# length, but FP8's scaled matmuls take token counts in multiples of 16 only. NOTE: not
# FLEX_BLOCK: at ~2,150 real tokens a step (4 instruction rows) 128-token multiples add 2.9%
# padding the GPU computes, 16-token multiples 0.35%.
SPANS_MULTIPLE = 16


def flex_available() -> bool:
    """Whether batches not given as spans carry a ``BlockMask`` (flex attention) or a dense
    boolean mask: the test torchtune's attention uses to pick flex over SDPA (a CUDA device of
    compute capability 7.5+)."""
    from torchtune.utils._import_guard import _SUPPORTS_FLEX_ATTENTION

    return bool(_SUPPORTS_FLEX_ATTENTION)


def document_ids(seq_lens: Sequence[Sequence[int]], seq_len: int) -> torch.Tensor:
    """[rows, seq_len] int32: each position's document index within its row. Positions past a
    row's last document (if its lengths sum to less than ``seq_len``) form one more document."""
    ids = torch.empty(len(seq_lens), seq_len, dtype=torch.int32)
    for row, lens in enumerate(seq_lens):
        lens = [int(n) for n in lens if int(n) > 0]
        total = sum(lens)
        if total > seq_len:
            raise ValueError(f"row {row}: document lengths sum to {total} > sequence length {seq_len}")
        if total < seq_len:
            lens.append(seq_len - total)
        ids[row] = torch.repeat_interleave(torch.arange(len(lens), dtype=torch.int32),
                                           torch.tensor(lens))
    return ids


def _document_causal(doc_ids: torch.Tensor):
    """The mask_mod: a query sees the keys at or before it in its own document."""
    def document_causal(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (doc_ids[b, q_idx] == doc_ids[b, kv_idx])

    # NOTE: read by move_block_mask, which rebuilds this function around the ids on the device
    # the batch goes to: flex attention evaluates the mask_mod where q, k and v are.
    document_causal.document_ids = doc_ids
    return document_causal


def _first_true_indices(flags: torch.Tensor):
    """(count, indices) of each last-dim row's True entries, the True ones first in order."""
    count = flags.sum(-1, dtype=torch.int32)
    order = torch.argsort((~flags).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    return count, order


def document_block_mask(seq_lens: Sequence[Sequence[int]], seq_len: int):
    """The block-causal document mask of rows whose documents have lengths ``seq_lens`` (a list
    per row), as a flex attention ``BlockMask`` on the CPU, built from the lengths alone.

    A (query block, key block) pair is skipped when no query in it may see any key in it: keys
    after the queries, or only other documents. It is "full" (no mask_mod evaluated) when both
    blocks lie inside one document and the keys come before the queries; else "partial"."""
    # A length that is not a multiple of the block: the ids run on to the next multiple (the
    # extra positions join the last document; flex attention never reads past seq_len).
    padded = -(-seq_len // FLEX_BLOCK) * FLEX_BLOCK
    ids = document_ids(seq_lens, seq_len)
    if padded > seq_len:
        ids = torch.cat([ids, ids[:, -1:].expand(-1, padded - seq_len)], dim=1)
    blocks = ids.view(ids.shape[0], -1, FLEX_BLOCK)
    first, last = blocks[..., 0], blocks[..., -1]  # documents are contiguous: a block spans first..last
    n = blocks.shape[1]
    q = torch.arange(n).view(1, n, 1)
    kv = torch.arange(n).view(1, 1, n)
    # Key block j (j <= i) holds a key some query of block i may see iff j's last document is
    # not before i's first; on the diagonal every query sees itself.
    visible = (kv <= q) & (last[:, None, :] >= first[:, :, None])
    # A block running past seq_len is never full (flex attention masks its outside positions).
    one_doc = (first == last) & (torch.arange(1, n + 1) * FLEX_BLOCK <= seq_len)
    full = (kv < q) & one_doc[:, :, None] & one_doc[:, None, :] & (first[:, :, None] == first[:, None, :])
    partial = visible & ~full
    kv_num, kv_idx = _first_true_indices(partial)
    full_num, full_idx = _first_true_indices(full)
    return BlockMask.from_kv_blocks(
        kv_num[:, None], kv_idx[:, None], full_num[:, None], full_idx[:, None],
        BLOCK_SIZE=FLEX_BLOCK, mask_mod=_document_causal(ids), seq_lengths=(seq_len, seq_len))


def move_block_mask(mask, device: torch.device):
    """``mask`` with its tensors copied to ``device`` without a host sync (``non_blocking``; a
    BlockMask's own ``.to`` blocks on every tensor), and a document mask's mask_mod rebuilt
    around its ids there. Works across torch versions: every tensor attribute moves."""
    moved = copy.copy(mask)
    for name, value in vars(mask).items():
        if isinstance(value, torch.Tensor):
            setattr(moved, name, value.to(device, non_blocking=True))
    ids = getattr(mask.mask_mod, "document_ids", None)
    if ids is not None:
        moved.mask_mod = _document_causal(ids.to(device, non_blocking=True))
    return moved


def document_mask(seq_lens: Sequence[Sequence[int]], seq_len: int, spans: bool = False):
    """The document mask in the form the model's attention takes: the documents' offsets
    (``DocumentSpans``, for flash attention's variable-length kernel) if ``spans`` (the run's
    device and dtype run it: ``training.setup.data.document_spans_wanted``), else a
    ``BlockMask`` where flex attention runs, else a dense [rows, seq_len, seq_len] boolean mask
    (torchtune's, for SDPA). The first two need the model's attention routed
    (``modules.document_attention``), as the recipes route it."""
    if spans:
        return document_spans(seq_lens, seq_len)
    if flex_available():
        return document_block_mask(seq_lens, seq_len)
    from torchtune.modules.attention_utils import create_block_causal_mask

    ids = document_ids(seq_lens, seq_len)
    lens = [torch.bincount(row.long()) for row in ids]
    return create_block_causal_mask(lens)


def packed_collate(batch: List[Dict[str, Any]], spans: bool = False) -> Dict[str, Any]:
    """Packs (torchtune's ``PackedDataset`` items: tokens, labels, input_pos, seq_lens, all one
    length) stacked into a batch with their document mask (``spans``: see ``document_mask``)."""
    tokens = torch.stack([torch.as_tensor(x["tokens"]) for x in batch])
    return {"tokens": tokens,
            "labels": torch.stack([torch.as_tensor(x["labels"]) for x in batch]),
            "input_pos": torch.stack([torch.as_tensor(x["input_pos"]) for x in batch]),
            "mask": document_mask([torch.as_tensor(x["seq_lens"]).tolist() for x in batch],
                                  tokens.shape[1], spans)}


def padded_length(longest: int, multiple: int, max_seq_len: Optional[int] = None) -> int:
    """The length rows of ``longest`` tokens are padded to: on to a multiple of ``multiple``, but
    never past ``max_seq_len`` (the most a row may hold) nor shorter than ``longest``."""
    length = -(-max(longest, 1) // multiple) * multiple
    return length if max_seq_len is None else max(min(length, max_seq_len), longest)


def padded_to_a_multiple(batch: List[Dict[str, Any]], *, collate, padding_idx: int = 0,
                         ignore_idx: int = CROSS_ENTROPY_IGNORE_INDEX,
                         pad_to_multiple_of: int = FLEX_BLOCK,
                         max_seq_len: Optional[int] = None) -> Dict[str, Any]:
    """``collate``'s padded batch (torchtune's ``padded_collate_sft`` by default), its rows then
    padded on to a multiple of ``pad_to_multiple_of`` tokens (at most ``max_seq_len``, never
    shorter than they were): padding that is never attended to (it comes after every real token
    of its row) nor scored (its labels are ``ignore_idx``).

    NOTE: a speed fix, not cosmetics: do not pad to the longest row only on a GPU. Then almost
    every batch has a new length, and on an H200 each new shape cost ~120 ms of host work on
    compiled steps of ~50 ms (in the profile the idle gaps end at cuDNN attention, which plans
    per shape; the cause is not isolated): 3.3x slower (label tokens/s) than the same batches
    padded on to 128-token multiples, a bounded set of shapes whose plans and compiled graphs
    are reused (docs/benchmarks.md). A collate that returns anything but a mapping of exactly tokens and
    labels (a mask, positions, a list) is left as it returns it."""
    out = collate(batch, padding_idx=padding_idx, ignore_idx=ignore_idx)
    if not isinstance(out, Mapping) or set(out) != {"tokens", "labels"} or out["tokens"].dim() != 2 \
            or out["labels"].shape != out["tokens"].shape:
        return out
    length = out["tokens"].shape[1]
    target = padded_length(length, pad_to_multiple_of, max_seq_len)
    if target > length:
        out = {"tokens": torch.nn.functional.pad(out["tokens"], (0, target - length), value=padding_idx),
               "labels": torch.nn.functional.pad(out["labels"], (0, target - length), value=ignore_idx)}
    return out


def _end_to_end(pieces: List[Dict[str, Any]], *, padding_idx: int, ignore_idx: int,
                pad_to_multiple_of: Optional[int], max_seq_len: Optional[int],
                spans: bool) -> Dict[str, Any]:
    """``pieces`` (each: 1-D ``tokens``, ``labels``, ``input_pos`` and the ``lens`` of its
    documents) laid end to end in rows of at most ``max_seq_len`` tokens (a piece never splits;
    None: one row), every row padded to one length, a multiple of ``pad_to_multiple_of``
    (None: 16 over spans, else 128); the padding is a document of its own, never scored."""
    rows: List[List[Dict[str, Any]]] = [[]]
    filled = 0
    for piece in pieces:
        n = len(piece["tokens"])
        if max_seq_len is not None and rows[-1] and filled + n > max_seq_len:
            rows.append([])
            filled = 0
        rows[-1].append(piece)
        filled += n
    longest = max(sum(len(p["tokens"]) for p in row) for row in rows)
    multiple = pad_to_multiple_of or (SPANS_MULTIPLE if spans else FLEX_BLOCK)
    length = padded_length(longest, multiple, max_seq_len)
    tokens, labels, input_pos, seq_lens = [], [], [], []
    for row in rows:
        pad = length - sum(len(p["tokens"]) for p in row)
        tokens.append(torch.cat([*(p["tokens"] for p in row),
                                 torch.full((pad,), padding_idx, dtype=torch.long)]))
        labels.append(torch.cat([*(p["labels"] for p in row),
                                 torch.full((pad,), ignore_idx, dtype=torch.long)]))
        input_pos.append(torch.cat([*(p["input_pos"] for p in row), torch.arange(pad)]))
        seq_lens.append([n for p in row for n in p["lens"]] + ([pad] if pad else []))
    mask = document_mask(seq_lens, length, spans)
    if isinstance(mask, DocumentSpans):
        mask.lengths_vary = True  # the step marks the row length dynamic (training.step.batch)
    return {"tokens": torch.stack(tokens), "labels": torch.stack(labels),
            "input_pos": torch.stack(input_pos), "mask": mask}


def padding_free_collate(batch: List[Dict[str, Any]], padding_idx: int = 0,
                         ignore_idx: int = CROSS_ENTROPY_IGNORE_INDEX,
                         pad_to_multiple_of: Optional[int] = None,
                         max_seq_len: Optional[int] = None, spans: bool = False) -> Dict[str, Any]:
    """An unpacked micro-batch as one row: its examples end to end, each attending only to
    itself, then padding up to a multiple of ``pad_to_multiple_of`` tokens (None: 16 with
    ``spans``, ``SPANS_MULTIPLE``; else 128, flex attention's block). Where the examples together are
    longer than the model takes (``max_seq_len``), they fill as many rows of at most that many
    tokens as they need, in order.

    Scores exactly what ``padded_collate_sft`` does: each example's first label is set to
    ``ignore_idx``, so after the recipe's shift by one the last token of an example is not
    scored on the next example's first token (in a padded batch it is scored on nothing)."""
    pieces = []
    for x in batch:
        t = torch.as_tensor(x["tokens"], dtype=torch.long)
        y = torch.as_tensor(x["labels"], dtype=torch.long).clone()
        y[:1] = ignore_idx
        pieces.append({"tokens": t, "labels": y, "input_pos": torch.arange(len(t)), "lens": [len(t)]})
    return _end_to_end(pieces, padding_idx=padding_idx, ignore_idx=ignore_idx,
                       pad_to_multiple_of=pad_to_multiple_of, max_seq_len=max_seq_len, spans=spans)


def pack_padding(pack: Dict[str, Any], ignore_idx: int = CROSS_ENTROPY_IGNORE_INDEX) -> int:
    """How many of ``pack``'s tokens are its padding: its last document when none of that
    document's labels is scored (``PackedDataset`` adds the padding as a document of its own; a
    trailing document with nothing to score counts too: it attends only to itself and adds
    nothing to the loss or the gradients), else 0."""
    lens = _document_lengths(pack)
    return lens[-1] if _ends_in_padding(pack, lens, ignore_idx) else 0


def _document_lengths(pack: Dict[str, Any]) -> List[int]:
    """The lengths of ``pack``'s documents, its padding (a document of its own) included."""
    return [int(n) for n in torch.as_tensor(pack["seq_lens"]).tolist() if int(n) > 0]


def _ends_in_padding(pack: Dict[str, Any], lens: List[int], ignore_idx: int) -> bool:
    labels = torch.as_tensor(pack["labels"])
    return bool(lens) and bool((labels[len(labels) - lens[-1]:] == ignore_idx).all())


def packed_padding_free_collate(batch: List[Dict[str, Any]], padding_idx: int = 0,
                                ignore_idx: int = CROSS_ENTROPY_IGNORE_INDEX,
                                pad_to_multiple_of: Optional[int] = None,
                                max_seq_len: Optional[int] = None,
                                spans: bool = False) -> Dict[str, Any]:
    """Packs (torchtune's ``PackedDataset`` items) without their padding, end to end in one row
    (more where they exceed ``max_seq_len``; a pack never splits), padded as
    ``padding_free_collate`` pads: the same packs a step, each document attending to itself as
    in its pack, the same (position, target) pairs scored, without the compute of the padding
    that fills each pack to its length (on alpaca-like rows of ~430 tokens packed into 2048,
    about 15% of a pack's tokens).

    A pack's padding is what ``pack_padding`` counts. Each pack's first label is set to ``ignore_idx``: in the pack it is nobody's
    target (nothing comes before it), and end to end it would be the target of the previous
    pack's last token, which in its pack was scored on nothing (the padding, or the end of the
    row)."""
    pieces = []
    for x in batch:
        t = torch.as_tensor(x["tokens"], dtype=torch.long)
        y = torch.as_tensor(x["labels"], dtype=torch.long).clone()
        pos = torch.as_tensor(x["input_pos"], dtype=torch.long)
        lens = _document_lengths(x)
        if _ends_in_padding(x, lens, ignore_idx):
            lens.pop()
        n = sum(lens)
        if n == 0:
            continue
        y = y[:n]
        y[:1] = ignore_idx
        pieces.append({"tokens": t[:n], "labels": y, "input_pos": pos[:n], "lens": lens})
    if not pieces:  # nothing to score anywhere: one row of padding (the step then says so)
        pieces = [{"tokens": torch.full((1,), padding_idx, dtype=torch.long),
                   "labels": torch.full((1,), ignore_idx, dtype=torch.long),
                   "input_pos": torch.zeros(1, dtype=torch.long), "lens": [1]}]
    return _end_to_end(pieces, padding_idx=padding_idx, ignore_idx=ignore_idx,
                       pad_to_multiple_of=pad_to_multiple_of, max_seq_len=max_seq_len, spans=spans)
