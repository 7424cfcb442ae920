"""Batches (tune_recipes.data.collate): the BlockMask built from lengths on the CPU, its move to
the device, padding-free micro-batches and packs, and padded batches on to a multiple of 128
tokens."""

import pytest
import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask
from torchtune.data import padded_collate_sft

from tune_recipes.data.collate import (
    document_block_mask, document_ids, move_block_mask, pack_padding, packed_collate,
    packed_padding_free_collate, padded_length, padded_to_a_multiple, padding_free_collate)
from tune_recipes.training.step.batch import count_valid_tokens, shift_labels

pytestmark = pytest.mark.unit

# Rows of document lengths that put boundaries inside blocks, on block edges, one-token
# documents, one document filling the row, and lengths summing short of the row (the rest is
# padding: a document of its own).
ROWS = [[300, 100, 500, 124], [1024], [1, 127, 128, 129, 639], [200, 56], [128] * 8]
SEQ_LEN = 1024


def _reference_mask(seq_lens, seq_len):
    ids = document_ids(seq_lens, seq_len)

    def mask_mod(b, h, q, kv):
        return (q >= kv) & (ids[b, q] == ids[b, kv])

    return create_block_mask(mask_mod, len(seq_lens), None, seq_len, seq_len, device="cpu")


def test_document_ids_number_each_rows_documents_and_the_padding_after_them():
    ids = document_ids([[2, 3], [5]], 6)
    assert ids.tolist() == [[0, 0, 1, 1, 1, 2], [0, 0, 0, 0, 0, 1]]
    with pytest.raises(ValueError, match="sum to 7 > sequence length 6"):
        document_ids([[3, 4]], 6)


def test_the_block_mask_from_lengths_is_torchs_block_mask_of_the_document_causal_mask():
    """Block for block what flex attention's create_block_mask finds by evaluating the mask on
    every token pair: which blocks are skipped, full or partial, in both directions."""
    ours, ref = document_block_mask(ROWS, SEQ_LEN), _reference_mask(ROWS, SEQ_LEN)
    for name in ("kv_num_blocks", "full_kv_num_blocks", "q_num_blocks", "full_q_num_blocks"):
        assert torch.equal(getattr(ours, name), getattr(ref, name)), name
    assert torch.equal(ours.to_dense(), ref.to_dense())
    assert ours.seq_lengths == (SEQ_LEN, SEQ_LEN) and ours.BLOCK_SIZE == (128, 128)


@pytest.mark.parametrize("seq_len", [1000, 130, 100])
def test_a_length_off_the_block_grid_gets_torchs_block_mask_too(seq_len):
    """Packs of a tokenizer.max_seq_len that is not a multiple of 128 (and padding-free rows cut
    at such a model length) keep flex attention: the mask torch builds for that length."""
    rows = [[seq_len // 3, seq_len - seq_len // 3], [seq_len], [7, 1, seq_len - 20]]
    ours, ref = document_block_mask(rows, seq_len), _reference_mask(rows, seq_len)
    assert ours.seq_lengths == ref.seq_lengths == (seq_len, seq_len)
    for name in ("kv_num_blocks", "full_kv_num_blocks", "q_num_blocks", "full_q_num_blocks"):
        assert torch.equal(getattr(ours, name), getattr(ref, name)), name
    assert torch.equal(ours.to_dense(), ref.to_dense())
    from torch.nn.attention.flex_attention import flex_attention

    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(3, 2, seq_len, 8, generator=g, dtype=torch.float64) for _ in range(3))
    ids, pos = document_ids(rows, seq_len), torch.arange(seq_len)
    dense = (pos[:, None] >= pos[None, :]) & (ids[:, :, None] == ids[:, None, :])
    torch.testing.assert_close(flex_attention(q, k, v, block_mask=ours),
                               torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=dense[:, None]),
                               rtol=1e-12, atol=1e-12)


def test_attention_under_the_block_mask_is_attention_under_the_dense_document_mask():
    """Flex attention (its eager reference) with the mask built from lengths, against SDPA with
    the dense document-causal mask, float64 (1e-12)."""
    from torch.nn.attention.flex_attention import flex_attention

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(len(ROWS), 2, SEQ_LEN, 8, generator=g, dtype=torch.float64) for _ in range(3))
    out = flex_attention(q, k, v, block_mask=document_block_mask(ROWS, SEQ_LEN))
    ids = document_ids(ROWS, SEQ_LEN)
    pos = torch.arange(SEQ_LEN)
    dense = (pos[:, None] >= pos[None, :]) & (ids[:, :, None] == ids[:, None, :])
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=dense[:, None])
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)


def test_moving_the_mask_moves_every_tensor_and_the_mask_mods_ids():
    mask = document_block_mask(ROWS[:2], SEQ_LEN)
    moved = move_block_mask(mask, torch.device("meta"))
    assert isinstance(moved, BlockMask) and moved is not mask
    tensors = [v for v in vars(moved).values() if isinstance(v, torch.Tensor)]
    assert len(tensors) >= 8 and all(t.device.type == "meta" for t in tensors)
    assert moved.mask_mod.document_ids.device.type == "meta"
    assert mask.kv_num_blocks.device.type == "cpu"  # the original is untouched


def _rows(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i, n in enumerate(lengths):
        tokens = torch.randint(1, 250, (n,), generator=g)
        labels = tokens.clone()
        if i % 2:
            labels[: n // 3] = -100  # a masked prompt; the others train on their first token too
        rows.append({"tokens": tokens.tolist(), "labels": labels.tolist()})
    return rows


def test_padding_free_lays_rows_end_to_end_and_pads_to_the_block():
    rows = _rows([50, 7, 120])
    batch = padding_free_collate(rows, padding_idx=0, ignore_idx=-100)
    assert batch["tokens"].shape == (1, 256)  # 177 tokens, up to a multiple of 128
    assert batch["tokens"][0, :177].tolist() == sum((r["tokens"] for r in rows), [])
    assert batch["tokens"][0, 177:].eq(0).all() and batch["labels"][0, 177:].eq(-100).all()
    assert batch["input_pos"][0].tolist() == [*range(50), *range(7), *range(120), *range(79)]
    # each example's first label is ignored: no example is scored on the next one's first token
    for start in (0, 50, 57):
        assert batch["labels"][0, start] == -100
    assert padding_free_collate(rows, pad_to_multiple_of=64)["tokens"].shape == (1, 192)


def test_padding_free_scores_exactly_the_padded_batchs_targets():
    """The same (context, target) pairs as the padded batch after the recipes' shift: the same
    token count, and the same multiset of targets."""
    rows = _rows([50, 7, 120, 3, 64])
    padded = padded_collate_sft(rows, padding_idx=0, ignore_idx=-100)
    free = padding_free_collate(rows, padding_idx=0, ignore_idx=-100)
    assert count_valid_tokens(free["labels"]) == count_valid_tokens(padded["labels"])
    targets = lambda labels: sorted(shift_labels(labels)[shift_labels(labels) != -100].tolist())  # noqa: E731
    assert targets(free["labels"]) == targets(padded["labels"])


def test_the_padded_length_is_the_next_multiple_within_the_cap_and_never_shorter():
    assert [padded_length(n, 128) for n in (0, 1, 128, 129)] == [128, 128, 128, 256]
    assert padded_length(150, 128, max_seq_len=200) == 200  # the cap
    assert padded_length(150, 128, max_seq_len=100) == 150  # never cut below the longest row
    assert padded_length(7, 1) == 7


def test_padded_batches_go_on_to_a_multiple_of_128_and_keep_torchtunes_values():
    """Every length in a run is one of max_seq_len / 128 (a bounded set of shapes): torchtune's
    padded batch in its columns, the padding after it never scored."""
    for lengths in ([50, 7, 120], [129, 3], [256], [1, 1]):
        rows = _rows(lengths)
        plain = padded_collate_sft(rows, padding_idx=0, ignore_idx=-100)
        batch = padded_to_a_multiple(rows, collate=padded_collate_sft, padding_idx=0, ignore_idx=-100)
        n = max(lengths)
        assert batch["tokens"].shape == (len(lengths), -(-n // 128) * 128)
        assert torch.equal(batch["tokens"][:, :n], plain["tokens"])
        assert torch.equal(batch["labels"][:, :n], plain["labels"])
        assert batch["tokens"][:, n:].eq(0).all() and batch["labels"][:, n:].eq(-100).all()
        assert count_valid_tokens(batch["labels"]) == count_valid_tokens(plain["labels"])
    # never past what the model takes, never shorter than the longest row
    rows = _rows([150, 20])
    assert padded_to_a_multiple(rows, collate=padded_collate_sft, max_seq_len=200)["tokens"].shape == (2, 200)
    assert padded_to_a_multiple(rows, collate=padded_collate_sft, max_seq_len=100)["tokens"].shape == (2, 150)


def test_a_collate_returning_more_than_tokens_and_labels_is_left_as_it_returns_them():
    rows = _rows([50, 7])

    def with_a_mask(batch, padding_idx, ignore_idx):
        out = padded_collate_sft(batch, padding_idx=padding_idx, ignore_idx=ignore_idx)
        return {**out, "mask": torch.ones(2, 50, 50, dtype=torch.bool)}

    batch = padded_to_a_multiple(rows, collate=with_a_mask)
    assert batch["tokens"].shape == (2, 50) and batch["mask"].shape == (2, 50, 50)
    as_a_list = padded_to_a_multiple(rows, collate=lambda b, padding_idx, ignore_idx: [dict(x) for x in b])
    assert as_a_list == [dict(x) for x in rows]


def test_the_padding_to_a_multiple_leaves_each_rows_logits_and_the_loss_and_gradients():
    """The tiny Llama on a padded batch and on the same batch padded on to 128 tokens: each real
    position's logits (the padding comes after it, causal attention never looks ahead), the
    loss and its gradients equal in fp32 (1e-6)."""
    from tune_recipes.models import tiny_llama3

    torch.manual_seed(0)
    model = tiny_llama3()
    rows = _rows([50, 7, 93], seed=2)
    plain = padded_collate_sft(rows, padding_idx=0, ignore_idx=-100)
    longer = padded_to_a_multiple(rows, collate=padded_collate_sft, padding_idx=0, ignore_idx=-100)
    assert longer["tokens"].shape[1] == 128 > plain["tokens"].shape[1]

    logits_p, loss_p, grads_p = _logits_loss_and_grads(model, plain)
    logits_l, loss_l, grads_l = _logits_loss_and_grads(model, longer)
    torch.testing.assert_close(logits_l[:, :93], logits_p, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(loss_l, loss_p, rtol=1e-6, atol=0)
    for gl, gp in zip(grads_l, grads_p):
        torch.testing.assert_close(gl, gp, rtol=1e-5, atol=1e-6)


def _logits_loss_and_grads(model, batch):
    """The model's logits on ``batch`` (its mask and positions, if any), the mean cross-entropy
    over the shifted labels, and every parameter's gradient of it."""
    model.zero_grad()
    logits = model(batch["tokens"], mask=batch.get("mask"), input_pos=batch.get("input_pos"))
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(),
                                             shift_labels(batch["labels"]).flatten(), ignore_index=-100)
    loss.backward()
    return logits.detach(), loss.detach(), [p.grad.clone() for p in model.parameters()]


def _assert_each_example(free_logits, padded_logits, lengths, tol):
    """Each example's logits in the padding-free row equal its padded row's."""
    start = 0
    for i, n in enumerate(lengths):
        torch.testing.assert_close(free_logits[0, start:start + n], padded_logits[i, :n], rtol=tol, atol=tol)
        start += n


def test_padding_free_logits_and_gradients_are_the_padded_batchs():
    """The tiny Llama on a padded batch and on the same rows padding-free (the dense document
    mask: no flex attention on the CPU): each example's logits, and the loss's gradients, equal
    in fp32 (1e-5)."""
    from tune_recipes.models import tiny_llama3

    torch.manual_seed(0)
    model = tiny_llama3()
    lengths = [50, 7, 120, 31]
    rows = _rows(lengths, seed=1)
    padded = padded_collate_sft(rows, padding_idx=0, ignore_idx=-100)
    free = padding_free_collate(rows, padding_idx=0, ignore_idx=-100)

    def loss_and_grads(logits, labels):
        model.zero_grad()
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(),
                                                 shift_labels(labels).flatten(), ignore_index=-100)
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    logits_p = model(padded["tokens"])
    _assert_each_example(model(free["tokens"], mask=free["mask"], input_pos=free["input_pos"]),
                         logits_p, lengths, tol=1e-5)
    loss_p, grads_p = loss_and_grads(logits_p, padded["labels"])
    loss_f, grads_f = loss_and_grads(model(free["tokens"], mask=free["mask"], input_pos=free["input_pos"]),
                                     free["labels"])
    torch.testing.assert_close(loss_f, loss_p, rtol=1e-6, atol=0)
    for gf, gp in zip(grads_f, grads_p):
        torch.testing.assert_close(gf, gp, rtol=1e-5, atol=1e-6)


def test_collates_give_spans_or_a_block_mask_where_the_gpu_runs_them(monkeypatch):
    """Asked for spans (a run whose device and dtype run flash attention), packs and padding-free
    batches carry the documents' offsets; else, where flex attention runs, the BlockMask built
    from lengths; elsewhere the dense boolean mask SDPA takes."""
    import tune_recipes.data.collate as collate

    rows = _rows([100, 200])
    pack = {"tokens": torch.zeros(256, dtype=torch.long), "labels": torch.zeros(256, dtype=torch.long),
            "input_pos": torch.zeros(256, dtype=torch.long), "seq_lens": torch.tensor([100, 156])}
    dense = packed_collate([pack])["mask"]
    assert dense.dtype == torch.bool and dense.shape == (1, 256, 256)
    assert torch.equal(dense[0], torch.block_diag(torch.ones(100, 100), torch.ones(156, 156)).tril().bool())
    monkeypatch.setattr(collate, "flex_available", lambda: True)
    assert isinstance(packed_collate([pack])["mask"], BlockMask)
    mask = padding_free_collate(rows)["mask"]
    assert isinstance(mask, BlockMask)
    assert torch.equal(mask.to_dense(), _reference_mask([[100, 200, 84]], 384).to_dense())
    # where the run's device and dtype run flash attention: the documents' offsets, padding last
    assert packed_collate([pack], spans=True)["mask"].cu_seqlens.tolist() == [0, 100, 256]
    # over spans the row pads on to 16 tokens (SPANS_MULTIPLE), not flex attention's 128
    assert padding_free_collate(rows, spans=True)["mask"].cu_seqlens.tolist() == [0, 100, 300, 304]


def test_padding_free_fills_more_rows_where_the_model_takes_fewer_tokens():
    rows = _rows([200, 150, 300, 10])
    batch = padding_free_collate(rows, max_seq_len=384)
    # 200+150 in the first row, 300+10 in the second: two rows of the model's 384 tokens
    assert batch["tokens"].shape == (2, 384)
    assert batch["input_pos"][1, :310].tolist() == [*range(300), *range(10)]
    assert count_valid_tokens(batch["labels"]) == count_valid_tokens(
        padded_collate_sft(rows, padding_idx=0, ignore_idx=-100)["labels"])
    assert padding_free_collate(rows, max_seq_len=4096)["tokens"].shape == (1, 768)


# Examples of spread lengths packed into 256 tokens by torchtune's PackedDataset: every pack ends
# in padding (a document of its own), some examples train on their first token.
PACK_LEN = 256
PACKED_LENGTHS = [50, 7, 120, 31, 90, 60, 100, 200, 18, 140]


def _packs(lengths=PACKED_LENGTHS, seed=0):
    from torchtune.datasets import PackedDataset

    return list(PackedDataset(_rows(lengths, seed=seed), max_seq_len=PACK_LEN))


def _scored(batch):
    """(row position's token, its position id, its target) for every scored position, in order."""
    targets = shift_labels(batch["labels"])
    keep = targets != -100
    return list(zip(batch["tokens"][keep].tolist(), batch["input_pos"][keep].tolist(),
                    targets[keep].tolist()))


def test_packs_padding_free_drop_each_packs_padding_and_score_the_same_targets():
    packs = _packs()
    padding = [int(p["seq_lens"][-1]) for p in packs]
    assert len(packs) >= 3 and all(n > 0 and (p["labels"][-n:] == -100).all() for p, n in zip(packs, padding))
    packed = packed_collate(packs)
    free = packed_padding_free_collate(packs, padding_idx=0, ignore_idx=-100, spans=True)
    real = len(packs) * PACK_LEN - sum(padding)
    assert free["tokens"].shape == (1, padded_length(real, 16))  # over spans: on to 16 tokens
    assert free["tokens"].numel() < packed["tokens"].numel()
    assert _scored(free) == _scored(packed)
    # each pack's documents, in order, then the row's padding (if any) as one more document
    docs = [n for p in packs for n in p["seq_lens"][:-1].tolist()]
    ends = torch.tensor([0, *docs]).cumsum(0).tolist()
    length = free["tokens"].shape[1]
    assert free["mask"].cu_seqlens.tolist() == ends + ([length] if length > real else [])
    assert free["mask"].lengths_vary
    # without spans: the same rows, on to flex attention's 128-token block
    assert padded_length(real, 128) == packed_padding_free_collate(packs)["tokens"].shape[1]


def test_a_pack_without_padding_and_a_trailing_document_with_nothing_to_score():
    """A full pack keeps all its tokens; a last document none of whose labels is scored is
    dropped like padding (it attends only to itself and adds nothing to the loss)."""
    full = {"tokens": torch.arange(1, 9), "labels": torch.arange(1, 9),
            "input_pos": torch.tensor([0, 1, 2, 0, 1, 2, 3, 4]), "seq_lens": torch.tensor([3, 5])}
    masked_last = {"tokens": torch.arange(1, 9), "labels": torch.tensor([1, 2, 3, 4, -100, -100, -100, -100]),
                   "input_pos": torch.tensor([0, 1, 2, 3, 0, 1, 2, 3]), "seq_lens": torch.tensor([4, 4])}
    assert pack_padding(full) == 0 and pack_padding(masked_last) == 4
    batch = packed_padding_free_collate([full, masked_last], pad_to_multiple_of=1, spans=True)
    assert batch["tokens"].tolist() == [[*range(1, 9), 1, 2, 3, 4]]
    assert batch["mask"].cu_seqlens.tolist() == [0, 3, 8, 12]
    assert batch["labels"].tolist() == [[-100, *range(2, 9), -100, 2, 3, 4]]
    assert _scored(batch) == _scored(packed_collate([full, masked_last]))


def test_packs_padding_free_fill_rows_of_the_models_length_without_splitting_a_pack():
    packs = _packs()
    real = [PACK_LEN - int(p["seq_lens"][-1]) for p in packs]
    batch = packed_padding_free_collate(packs, max_seq_len=PACK_LEN + 64)
    rows, filled = [[]], 0
    for n in real:  # greedy, in order, a pack whole
        if rows[-1] and filled + n > PACK_LEN + 64:
            rows.append([])
            filled = 0
        rows[-1].append(n)
        filled += n
    assert batch["tokens"].shape[0] == len(rows) > 1
    for row, lengths in zip(batch["input_pos"], rows):
        starts = [0, *torch.tensor(lengths).cumsum(0).tolist()[:-1]]
        # each pack's first document starts from position 0 where its pack starts
        assert all(row[s].item() == 0 for s in starts)
    assert _scored(batch) == _scored(packed_collate(packs))


def test_packs_padding_free_logits_and_gradients_are_the_packed_batchs():
    """The tiny Llama on packed rows and on the same packs without their padding (the dense
    document mask: no flex attention on the CPU): each pack's logits, and the loss's gradients,
    equal in fp32 (1e-5)."""
    from tune_recipes.models import tiny_llama3

    torch.manual_seed(0)
    model = tiny_llama3()
    packs = [_packs()[0], _packs()[3]]  # 208 + 140 tokens and 48 + 116 of padding
    packed = packed_collate(packs)
    free = packed_padding_free_collate(packs, padding_idx=0, ignore_idx=-100, max_seq_len=model.max_seq_len)
    assert free["tokens"].shape == (1, 384)

    logits_p, loss_p, grads_p = _logits_loss_and_grads(model, packed)
    logits_f, loss_f, grads_f = _logits_loss_and_grads(model, free)
    start = 0
    for i, pack in enumerate(packs):
        n = PACK_LEN - int(pack["seq_lens"][-1])
        torch.testing.assert_close(logits_f[0, start:start + n], logits_p[i, :n], rtol=1e-5, atol=1e-5)
        start += n
    torch.testing.assert_close(loss_f, loss_p, rtol=1e-6, atol=0)
    for gf, gp in zip(grads_f, grads_p):
        torch.testing.assert_close(gf, gp, rtol=1e-5, atol=1e-6)


def test_the_packed_collate_drops_padding_only_when_padding_free():
    from tune_recipes.training.setup.data import make_collate
    from torchtune.datasets import PackedDataset

    dataset = PackedDataset(_rows(PACKED_LENGTHS), max_seq_len=PACK_LEN)
    kept = make_collate(dataset, pad_id=0, collate_fn="torchtune.data.padded_collate_sft", ignore_index=-100)
    dropped = make_collate(dataset, pad_id=0, collate_fn="torchtune.data.padded_collate_sft", ignore_index=-100,
                           padding_free=True, max_seq_len=4096, spans=True)
    batch = [dataset[i] for i in range(3)]
    assert kept(batch)["tokens"].shape == (3, PACK_LEN)
    assert dropped(batch)["tokens"].numel() < 3 * PACK_LEN
    assert _scored(dropped(batch)) == _scored(kept(batch))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_moved_mask_gives_torchtunes_packed_attention_and_gradients():
    """Compiled flex attention on CUDA with the mask built from lengths and moved, against the
    same with torchtune's packed_block_causal_mask (built on the GPU): outputs and gradients,
    fp32 (1e-5)."""
    from torch.nn.attention.flex_attention import flex_attention
    from torchtune.modules.attention_utils import packed_block_causal_mask

    flex = torch.compile(flex_attention)
    ours = move_block_mask(document_block_mask(ROWS, SEQ_LEN), torch.device("cuda"))
    lens = [torch.bincount(r.long()) for r in document_ids(ROWS, SEQ_LEN)]
    ref = packed_block_causal_mask(lens)
    g = torch.Generator().manual_seed(0)
    qkv = [torch.randn(len(ROWS), 4, SEQ_LEN, 64, generator=g).cuda() for _ in range(3)]
    outs, grads = [], []
    for mask in (ours, ref):
        leaves = [t.clone().requires_grad_() for t in qkv]
        out = flex(*leaves, block_mask=mask)
        out.square().sum().backward()
        outs.append(out.detach())
        grads.append([t.grad for t in leaves])
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 5e-2)])
def test_on_cuda_padding_free_batches_of_changing_length_give_the_padded_logits(dtype, tol):
    """The tiny Llama on CUDA, not compiled, its attention routed: padding-free batches of four
    lengths, in the form the run's dtype gets (``document_spans_wanted``), give each example's
    logits of the padded batch (SDPA): fp32 1e-4 (flex attention on the BlockMask, compiled at
    most twice: automatic dynamic shapes), bf16 5e-2 (document spans: flash attention's
    variable-length kernel, where it runs)."""
    from torch._dynamo.utils import counters

    import tune_recipes.modules.document_attention as document_attention
    from tune_recipes.models import tiny_llama3
    from tune_recipes.modules.document_attention import route_document_attention
    from tune_recipes.training.setup.data import document_spans_wanted
    from tune_recipes.training.step.batch import to_device

    spans = document_spans_wanted("cuda", dtype)
    torch.manual_seed(0)
    model = tiny_llama3().cuda().to(dtype)
    assert route_document_attention(model) == len(model.layers)
    document_attention._compiled_flex = None
    counters.clear()
    for seed, lengths in enumerate(([50, 7, 120, 31], [200, 90], [33, 250, 17], [100] * 5)):
        rows = _rows(lengths, seed=seed)
        padded = to_device(padded_collate_sft(rows, padding_idx=0, ignore_idx=-100), torch.device("cuda"))
        free = to_device(padding_free_collate(rows, max_seq_len=model.max_seq_len, spans=spans),
                         torch.device("cuda"))
        with torch.no_grad():
            _assert_each_example(model(free["tokens"], mask=free["mask"], input_pos=free["input_pos"]).float(),
                                 model(padded["tokens"]).float(), lengths, tol=tol)
    assert counters["stats"]["unique_graphs"] <= 2
