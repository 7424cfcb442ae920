"""Causal attention over document spans (tune_recipes.modules.varlen_attention): the spans, the
dense path (CPU, fp32) against per-document attention in float64, and on CUDA flash attention's
variable-length kernel against the same reference, eagerly and compiled."""

import pytest
import torch
import torch.nn.functional as F

from tune_recipes.modules.varlen_attention import DocumentSpans, document_spans, varlen_causal_attention

pytestmark = pytest.mark.unit

LENS = [[50, 7, 120, 31], [200], [33, 150, 17]]  # rows of 256: padding documents at their ends
SEQ_LEN = 256


def _qkv(rows, seq_len, heads, kv_heads, dim, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = [(rows, seq_len, heads, dim), (rows, seq_len, kv_heads, dim), (rows, seq_len, kv_heads, dim)]
    return [torch.randn(s, generator=g).to(device, dtype) for s in shapes]


def _per_document_reference(q, k, v, lens, seq_len):
    """float64: each document's causal attention on its own, k/v heads repeated per group."""
    group = q.shape[2] // k.shape[2]
    out = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    for row, row_lens in enumerate(lens):
        start = 0
        for n in [*row_lens, seq_len - sum(row_lens)]:
            span = slice(start, start + n)
            qq, kk, vv = (t[row, span].double().transpose(0, 1) for t in (q, k, v))
            attn = F.scaled_dot_product_attention(qq, kk.repeat_interleave(group, 0),
                                                  vv.repeat_interleave(group, 0), is_causal=True)
            out[row, span] = attn.transpose(0, 1)
            start += n
    return out


def test_spans_are_each_rows_documents_then_its_padding_in_flattened_offsets():
    spans = document_spans([[3, 0, 2], [6]], 6)
    # row 0: 3, 2, then 1 of padding; row 1: one document filling it; a zero length is dropped
    assert spans.cu_seqlens.tolist() == [0, 3, 5, 6, 12]
    assert spans.cu_seqlens.dtype == torch.int32
    with pytest.raises(ValueError, match="row 1: document lengths sum to 7 > sequence length 6"):
        document_spans([[6], [4, 3]], 6)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (6, 1)])
def test_the_dense_path_is_per_document_causal_attention(heads, kv_heads):
    """fp32 on the CPU (the dense block-causal mask and SDPA) against each document attended on
    its own in float64: outputs and gradients, 1e-5."""
    q, k, v = (t.requires_grad_() for t in _qkv(len(LENS), SEQ_LEN, heads, kv_heads, 16))
    out = varlen_causal_attention(q, k, v, document_spans(LENS, SEQ_LEN))
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = _per_document_reference(*leaves, LENS, SEQ_LEN)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    grad = torch.randn_like(ref)
    out.backward(grad.float())
    ref.backward(grad)
    for t, r in zip((q, k, v), leaves):
        torch.testing.assert_close(t.grad.double(), r.grad, rtol=1e-5, atol=1e-5)


def test_query_heads_must_be_a_multiple_of_key_value_heads():
    q, k, v = _qkv(1, 8, 3, 2, 8)
    with pytest.raises(ValueError, match="3 query heads are not a multiple of 2 key/value heads"):
        varlen_causal_attention(q, k, v, document_spans([[8]], 8))


def test_spans_move_with_their_offsets():
    spans = document_spans(LENS, SEQ_LEN)
    moved = spans.to("meta")
    assert isinstance(moved, DocumentSpans) and moved.cu_seqlens.device.type == "meta"
    assert spans.cu_seqlens.device.type == "cpu"


cuda = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 0),
                          reason="needs a CUDA GPU of compute capability 8.0+ (flash attention)")


def _errors_against_float64(fn, lens, seq_len, heads, kv_heads, dim):
    q, k, v = _qkv(len(lens), seq_len, heads, kv_heads, dim, dtype=torch.bfloat16, device="cuda", seed=1)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = _per_document_reference(*leaves, lens, seq_len)
    grad = torch.randn_like(ref)
    ref.backward(grad)
    ins = [t.clone().requires_grad_() for t in (q, k, v)]
    out = fn(*ins)
    out.backward(grad.to(out.dtype))
    return [(out.double() - ref).abs().max().item()] + [
        (t.grad.double() - r.grad).abs().max().item() for t, r in zip(ins, leaves)]


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("heads,kv_heads,dim", [(32, 8, 64), (28, 4, 128)])
def test_on_cuda_flash_varlen_is_as_exact_as_bf16_attention_with_the_dense_mask(heads, kv_heads, dim):
    """bf16 flash attention over the spans against float64 per-document attention: its output
    and gradients no further from it than bf16 SDPA with the dense document mask (the dense
    path's kernels; + 1e-3 of slack for the two kernels' different rounding)."""
    import tune_recipes.modules.varlen_attention as varlen

    spans = document_spans(LENS, SEQ_LEN).to("cuda")
    flash = _errors_against_float64(lambda q, k, v: varlen_causal_attention(q, k, v, spans),
                                    LENS, SEQ_LEN, heads, kv_heads, dim)
    original = varlen._runs_flash
    varlen._runs_flash = lambda q: False
    try:
        dense = _errors_against_float64(lambda q, k, v: varlen_causal_attention(q, k, v, spans),
                                        LENS, SEQ_LEN, heads, kv_heads, dim)
    finally:
        varlen._runs_flash = original
    for name, f, d in zip(("out", "dq", "dk", "dv"), flash, dense):
        assert f <= 2 * d + 1e-3, (name, f, d)


@pytest.mark.gpu
@cuda
def test_on_cuda_compiled_flash_varlen_is_the_eager_call_without_recompiling():
    """Compiled (inductor, one graph) with the spans moved as the step moves them, batches of
    another document count reuse the graph (the count is marked dynamic), and the compiled
    outputs and gradients are the eager call's (bf16, the same kernels: 1e-2 absolute)."""
    from torch._dynamo.utils import counters

    from tune_recipes.training.step.batch import to_device

    def attend(q, k, v, spans):
        return varlen_causal_attention(q * 1.0, k, v, spans)

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(attend, fullgraph=True)
    for lens in (LENS, [[256], [100, 100], [10, 20, 30, 40, 50]]):
        spans = to_device({"mask": document_spans(lens, SEQ_LEN)}, torch.device("cuda"))["mask"]
        q, k, v = _qkv(len(lens), SEQ_LEN, 8, 2, 64, dtype=torch.bfloat16, device="cuda")
        results = []
        for fn in (attend, compiled):
            ins = [t.clone().requires_grad_() for t in (q, k, v)]
            out = fn(*ins, spans)
            out.float().square().sum().backward()
            results.append([out, *(t.grad for t in ins)])
        for a, b in zip(*results):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-2)
    assert counters["stats"]["unique_graphs"] == 1


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("scope", ["model", "layers"])
def test_on_cuda_padding_free_batches_compile_the_bf16_model_once(scope, padding_free_batches):
    """The tiny Llama in bf16 on CUDA, routed, compiled whole or per layer (inductor;
    ``compile_layers``): padding-free batches of three lengths (flash attention's kernel with a
    symbolic row length) compile once, and each batch's logits are the eager model's within
    bf16's rounding (5e-2)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from tune_recipes.models import tiny_llama3
    from tune_recipes.modules.document_attention import route_document_attention

    from tune_recipes.training.setup.model import compile_layers

    torch.manual_seed(0)
    model = tiny_llama3().cuda().to(torch.bfloat16).eval()
    route_document_attention(model)
    torch._dynamo.reset()
    counters.clear()
    if scope == "model":
        compiled = torch.compile(model)
    else:
        compiled = tiny_llama3().cuda().to(torch.bfloat16).eval()
        compiled.load_state_dict(model.state_dict())
        route_document_attention(compiled)
        compile_layers(compiled, verbose=False)
    for batch in padding_free_batches("cuda"):
        with torch.no_grad():
            args = dict(mask=batch["mask"], input_pos=batch["input_pos"])
            torch.testing.assert_close(compiled(batch["tokens"], **args).float(),
                                       model(batch["tokens"], **args).float(), rtol=5e-2, atol=5e-2)
    assert counters["stats"]["unique_graphs"] == 1
    torch._dynamo.reset()
