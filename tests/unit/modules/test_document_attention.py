"""Document-masked batches' attention (tune_recipes.modules.document_attention): document spans
to the variable-length path, flex attention traced into the compiled graph."""

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask

from tune_recipes.modules.document_attention import _document_attention_call

pytestmark = pytest.mark.unit


class _Heads(torch.nn.Module):
    def __init__(self, num_kv_heads):
        super().__init__()
        self.num_kv_heads = num_kv_heads


def _document_mask(doc_ids: torch.Tensor):
    def mask_mod(b, h, q, kv):
        return (q >= kv) & (doc_ids[b, q] == doc_ids[b, kv])

    b, s = doc_ids.shape
    return create_block_mask(mask_mod, b, None, s, s, device=doc_ids.device, BLOCK_SIZE=16)


def _qkv(seed=0, b=2, h=2, s=64, d=16):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, h, s, d, generator=g) for _ in range(3)]


def _doc_ids(lengths, s=64):
    ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
    return torch.cat([ids, torch.full((s - len(ids),), len(lengths))])


def test_outside_compile_a_block_mask_takes_flex_compiled_for_any_length(monkeypatch):
    """Eagerly, a BlockMask goes to flex attention compiled with automatic dynamic shapes (one
    compile for every later length, where torchtune's call compiles once a length); any other
    mask goes to torchtune's call unchanged."""
    import tune_recipes.modules.document_attention as document_attention

    calls, flex_calls = [], []

    def fallback(q, k, v, mask=None, dropout_p=0.0, is_causal=True):
        calls.append((mask, dropout_p, is_causal))
        return q

    monkeypatch.setattr(document_attention, "_compiled_flex",
                        lambda q, k, v, block_mask: flex_calls.append(block_mask) or k)
    call = _document_attention_call(fallback, _Heads(2))
    q, k, v = _qkv()
    block_mask = _document_mask(torch.stack([_doc_ids([20, 44]), _doc_ids([64])]))
    assert call(q, k, v, mask=block_mask, dropout_p=0.0, is_causal=False) is k
    assert call(q, k, v, mask=None, dropout_p=0.1, is_causal=True) is q
    assert flex_calls == [block_mask]
    assert calls == [(None, 0.1, True)]


def test_the_eager_flex_compile_is_dynamic(monkeypatch):
    import tune_recipes.modules.document_attention as document_attention

    seen = {}
    monkeypatch.setattr(document_attention, "_compiled_flex", None)
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: seen.update(fn=fn, **kw) or fn)
    document_attention._flex_compiled_for_any_length()
    from torch.nn.attention.flex_attention import flex_attention
    # dynamic unset: torch's automatic dynamic shapes (dynamic=False recompiles every length)
    assert seen == {"fn": flex_attention}


def _check_against_dense_reference(device, backward):
    def fallback(*args, **kwargs):
        raise AssertionError("the compiled call must not take the fallback")

    call = _document_attention_call(fallback, _Heads(2))
    doc_ids = torch.stack([_doc_ids([20, 30, 10]), _doc_ids([64])]).to(device)
    block_mask = _document_mask(doc_ids)
    q, k, v = (t.to(device).requires_grad_(backward) for t in _qkv(1))
    out = torch.compile(call, backend="aot_eager", fullgraph=True)(q, k, v, mask=block_mask)
    qr, kr, vr = (t.detach().double().requires_grad_(backward) for t in (q, k, v))
    pos = torch.arange(doc_ids.shape[1], device=device)
    dense = (pos[:, None] >= pos[None, :]) & (doc_ids[:, :, None] == doc_ids[:, None, :])
    ref = torch.nn.functional.scaled_dot_product_attention(qr, kr, vr, attn_mask=dense[:, None])
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    if backward:
        out.sum().backward()
        ref.sum().backward()
        for t, r in zip((q, k, v), (qr, kr, vr)):
            torch.testing.assert_close(t.grad.double(), r.grad, rtol=1e-5, atol=1e-5)


def test_compiled_block_mask_attention_matches_the_document_masked_reference():
    """Under torch.compile the call is flex attention on the block mask: the output of plain
    attention with the dense document-causal mask (fp32 against float64, 1e-5). CPU flex
    attention has no backward; the gradients are checked on CUDA below."""
    _check_against_dense_reference("cpu", backward=False)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_block_mask_attention_gradients_match_on_cuda():
    _check_against_dense_reference("cuda", backward=True)


def test_compiled_call_refuses_dropout():
    call = _document_attention_call(lambda *a, **k: None, _Heads(2))
    q, k, v = _qkv()
    block_mask = _document_mask(torch.stack([_doc_ids([64]), _doc_ids([64])]))
    with pytest.raises(Exception, match="no dropout"):
        torch.compile(call, backend="aot_eager", fullgraph=True)(q, k, v, mask=block_mask, dropout_p=0.1)


def test_every_attention_layer_gets_the_call_and_eager_outputs_are_unchanged():
    """Each MultiHeadAttention gets the call, on every machine (document spans need it on the
    CPU too); without a document mask the model computes exactly what it did before (SDPA)."""
    from tune_recipes.models import tiny_llama3
    from tune_recipes.modules.document_attention import route_document_attention

    torch.manual_seed(0)
    model = tiny_llama3()
    tokens = torch.randint(0, 100, (2, 24))
    before = model(tokens)
    assert route_document_attention(model) == len(model.layers)
    torch.testing.assert_close(model(tokens), before, rtol=0, atol=0)


def test_document_spans_give_the_dense_document_masks_logits_and_gradients_in_one_graph():
    """The tiny Llama (grouped-query: 4 query heads a k/v head), routed, on packed rows: with the
    collate's document spans, the logits and gradients of torchtune's dense document mask (fp32,
    1e-5), eagerly and compiled whole (aot_eager: one graph, no break, no recompile for a batch
    of another document count, the spans moved as the step moves them)."""
    import torch._dynamo
    from torch._dynamo.utils import counters
    from torchtune.modules.attention_utils import create_block_causal_mask

    from tune_recipes.models import tiny_llama3
    from tune_recipes.modules.document_attention import route_document_attention
    from tune_recipes.modules.varlen_attention import document_spans
    from tune_recipes.training.step.batch import to_device

    torch.manual_seed(0)
    model = tiny_llama3()
    assert model.layers[0].attn.num_heads == 4 * model.layers[0].attn.num_kv_heads
    route_document_attention(model)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend="aot_eager")
    seq_len = 96
    for lens in ([[40, 30, 26], [96]], [[10, 20, 30, 6], [50, 40]]):  # the last row ends in padding
        tokens = torch.randint(0, 272, (2, seq_len))
        pos = torch.stack([torch.cat([torch.arange(n) for n in [*row, seq_len - sum(row)] if n])
                           for row in lens])
        dense = create_block_causal_mask([torch.tensor([n for n in [*row, seq_len - sum(row)] if n])
                                          for row in lens])
        spans = to_device({"mask": document_spans(lens, seq_len)}, torch.device("cpu"))["mask"]
        results = []
        for fn, mask in ((model, dense), (model, spans), (compiled, spans)):
            model.zero_grad()
            out = fn(tokens, mask=mask, input_pos=pos)
            out.square().mean().backward()
            results.append([out.detach()] + [p.grad.clone() for p in model.parameters()])
        for got in results[1:]:
            for a, b in zip(got, results[0]):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert counters["stats"]["unique_graphs"] == 1
    assert sum(counters["graph_break"].values()) == 0
    torch._dynamo.reset()


def test_document_spans_refuse_dropout():
    from tune_recipes.modules.varlen_attention import document_spans

    call = _document_attention_call(lambda *a, **k: None, _Heads(2))
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="no dropout"):
        call(q, k, v, mask=document_spans([[64], [64]], 64), dropout_p=0.1)


def test_a_compiled_model_is_one_graph_on_packed_batches_without_recompiles(monkeypatch):
    """The tiny Llama compiled whole on packed batches (torchtune's document-causal BlockMask,
    built as its packed collate builds it): one graph, no break (torchtune's own flex call sits
    behind torch.compiler.disable: a break in every layer), no recompile for a second batch of
    other document lengths, and the logits of SDPA with the dense document mask (fp32, 1e-6
    relative). CPU, forward only (CPU flex attention has no backward); aot_eager, since
    inductor's CPU flex template cannot lower RoPE's strided views (torch 2.13): the graph
    capture is dynamo's either way."""
    import torch._dynamo
    import torchtune.utils._import_guard as guard
    from torch._dynamo.utils import counters
    from torchtune.modules.attention_utils import create_block_causal_mask

    from tune_recipes.models import tiny_llama3
    from tune_recipes.modules.document_attention import route_document_attention

    def block_mask(lens, seq_len):
        doc = torch.cat([torch.full((n,), i) for i, n in enumerate(lens)])[None]

        def mask_mod(b, h, q_idx, kv_idx):
            return (doc[b, q_idx] == doc[b, kv_idx]) & (q_idx >= kv_idx)

        return create_block_mask(mask_mod, 1, None, seq_len, seq_len, device="cpu")

    torch.manual_seed(0)
    model = tiny_llama3().eval()
    monkeypatch.setattr(guard, "_SUPPORTS_FLEX_ATTENTION", True)
    route_document_attention(model)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend="aot_eager")
    seq_len = 384  # three 128-token blocks: full, partial and empty ones, in different counts
    for lens in ([40, 300, 44], [20, 30, 78, 256]):
        tokens = torch.randint(0, 272, (1, seq_len))
        pos = torch.cat([torch.arange(n) for n in lens])[None]
        with torch.no_grad():
            ref = model(tokens, mask=create_block_causal_mask([torch.tensor(lens)]), input_pos=pos)
            out = compiled(tokens, mask=block_mask(lens, seq_len), input_pos=pos)
        assert float((out - ref).abs().max() / ref.abs().max()) < 1e-6
    assert counters["stats"]["unique_graphs"] == 1
    assert sum(counters["graph_break"].values()) == 0
    torch._dynamo.reset()


def test_document_spans_take_the_head_counts_tensor_parallelism_leaves():
    """Tensor parallelism divides an attention module's head counts after the routing
    (torchtune's prepare_mha_for_tp): the call reads them when it runs. Qwen2.5-7B's 28 / 4
    heads over two ranks: 14 query heads, 2 k/v heads a rank (k/v copied out to 14 as torchtune
    does), against per-document attention of the unexpanded k/v (float64 reference, 1e-5)."""
    from tune_recipes.modules.varlen_attention import document_spans

    heads = _Heads(4)
    call = _document_attention_call(lambda *a, **k: None, heads)
    heads.num_kv_heads = 2  # what prepare_mha_for_tp leaves on each of two ranks
    lens, s, d = [[20, 30, 14], [64]], 64, 8
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 14, s, d, generator=g)
    k, v = (torch.randn(2, 2, s, d, generator=g) for _ in range(2))
    expanded = [t.unsqueeze(2).expand(2, 2, 7, s, d).flatten(1, 2) for t in (k, v)]
    out = call(q, *expanded, mask=document_spans(lens, s))
    doc = torch.stack([_doc_ids(row, s) for row in lens])
    pos = torch.arange(s)
    dense = ((pos[:, None] >= pos[None, :]) & (doc[:, :, None] == doc[:, None, :]))[:, None]
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.double(), *(t.double().repeat_interleave(7, 1) for t in (k, v)), attn_mask=dense)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


def test_flash_attention_takes_k_and_v_in_memory_of_their_own(monkeypatch):
    """torchtune copies k and v out to every query head before the attention call. Flash
    attention (whose inputs its backward saves) gets one head a group in memory of its own: a
    view would keep the whole expanded copy alive until the backward, 4x the bytes at 4 query
    heads a k/v head. One packed row (a batch of one row: the padding-free step's), as torchtune
    passes them; the values are the group's own head."""
    from tune_recipes.modules import varlen_attention

    given = {}

    def flash(q, k, v, cu_seqlens, max_len):
        given.update(k=k, v=v)
        return torch.zeros_like(q), None

    monkeypatch.setattr(varlen_attention, "_runs_flash", lambda q: True)
    monkeypatch.setattr(varlen_attention, "_flash_forward", flash)
    call = _document_attention_call(lambda *a, **k: None, _Heads(2))
    s, d = 64, 16
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 8, s, d, generator=g)
    k, v = (torch.randn(1, 2, s, d, generator=g) for _ in range(2))
    expanded = [t.unsqueeze(2).expand(1, 2, 4, s, d).flatten(1, 2) for t in (k, v)]
    call(q, *expanded, mask=varlen_attention.document_spans([[20, 44]], s))
    for name, own in (("k", k), ("v", v)):
        got = given[name]
        assert got.untyped_storage().nbytes() == got.numel() * got.element_size(), name
        torch.testing.assert_close(got, own[0].transpose(0, 1), rtol=0, atol=0)


def _routed_tiny_llama_and_its_graph():
    """The tiny Llama (eval, seed 0) with document attention routed, and it compiled as one
    graph (aot_eager) after dynamo's caches and counters are reset."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from tune_recipes.models import tiny_llama3
    from tune_recipes.modules.document_attention import route_document_attention

    torch.manual_seed(0)
    model = tiny_llama3().eval()
    route_document_attention(model)
    torch._dynamo.reset()
    counters.clear()
    return model, torch.compile(model, backend="aot_eager")


def test_padding_free_batches_of_three_lengths_compile_the_whole_model_once(padding_free_batches):
    """Padding-free batches (spans whose lengths vary) moved as the step moves them: the row
    length is dynamic from the first batch, so the whole tiny Llama, compiled as one graph
    (aot_eager), compiles once for batches of 128, 256 and 384 tokens, not first for one length
    and again for the rest; each example's logits are the eager model's (fp32, 1e-5)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    model, compiled = _routed_tiny_llama_and_its_graph()
    for batch in padding_free_batches("cpu"):
        assert batch["mask"].lengths_vary
        with torch.no_grad():
            args = dict(mask=batch["mask"], input_pos=batch["input_pos"])
            torch.testing.assert_close(compiled(batch["tokens"], **args), model(batch["tokens"], **args),
                                       rtol=1e-5, atol=1e-5)
    assert counters["stats"]["unique_graphs"] == 1
    torch._dynamo.reset()


def test_packs_without_padding_of_three_lengths_compile_the_whole_model_once():
    """Packs laid end to end without their padding (``padding_free`` on packed data) change
    length from batch to batch as padding-free rows do: the whole tiny Llama, compiled as one
    graph (aot_eager), compiles once over three such batches; each document's logits are the
    eager model's on the packs with their padding (fp32, 1e-5)."""
    import torch._dynamo
    from torch._dynamo.utils import counters
    from torchtune.datasets import PackedDataset

    from tune_recipes.data.collate import packed_collate, packed_padding_free_collate
    from tune_recipes.training.step.batch import to_device

    g = torch.Generator().manual_seed(0)
    rows = [{"tokens": torch.randint(1, 272, (n,), generator=g).tolist(),
             "labels": torch.randint(1, 272, (n,), generator=g).tolist()}
            for n in (50, 70, 100, 120, 30, 200, 40, 90, 160, 60, 110, 25)]
    packs = list(PackedDataset(rows, max_seq_len=256))
    model, compiled = _routed_tiny_llama_and_its_graph()
    lengths = set()
    for pair in (packs[0:2], packs[2:4], packs[4:6]):
        free = to_device(packed_padding_free_collate(pair, spans=True), torch.device("cpu"))
        padded = packed_collate(pair, spans=True)
        lengths.add(free["tokens"].shape[1])
        with torch.no_grad():
            out = compiled(free["tokens"], mask=free["mask"], input_pos=free["input_pos"])
            ref = model(padded["tokens"], mask=padded["mask"], input_pos=padded["input_pos"])
        start = 0
        for i, pack in enumerate(pair):
            n = 256 - int(pack["seq_lens"][-1])
            torch.testing.assert_close(out[0, start:start + n], ref[i, :n], rtol=1e-5, atol=1e-5)
            start += n
    assert len(lengths) == 3
    assert counters["stats"]["unique_graphs"] == 1
    torch._dynamo.reset()
