"""Attention on packed instruction data, forward + backward, one GPU, as the routed model calls
it (``modules.document_attention``; k and v copied out to every query head first, as torchtune's
attention passes them; compiled): flex attention with the collate's document ``BlockMask``
against flash attention over the documents' spans (``modules.varlen_attention``, one k/v head a
group taken back), at Llama-3.2-1B's attention shape by default. Beside them, uncompiled: flash's
kernel on the spans directly, with 2048 or the longest document as its length bound, and torch's
cuDNN path for variable lengths (``aten._cudnn_attention_forward`` with sequence offsets, the one
nested tensors take; its backward through autograd and by hand; k and v at their own head count
as flash takes them). Then each of those on eight packings in turn, as consecutive batches: the
host's time a call shows a plan or graph built per packing. Event times include the GPU's wait
for such host work (the cuDNN rows' graph builds).

    python3 scripts/bench_attention.py --rows 4 --seq-len 2048 --heads 32 --kv-heads 8 --head-dim 64

Documents: the lengths of scripts/make_instruction_data.py's rows (about one token a byte, as the
byte-level tokenizer the benchmarks use, plus alpaca's ~200-token prompt), packed greedily into
rows of ``--seq-len`` as torchtune's ``PackedDataset`` packs them (no example split; the rest of a
row is one padding document). Prints a table: milliseconds a call (CUDA events after warm-up,
median of ``--reps``), the output's and gradients' largest difference from a float64 reference.
"""

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from make_instruction_data import instruction_rows  # noqa: E402

from tune_recipes.data.collate import document_block_mask, move_block_mask  # noqa: E402
from tune_recipes.modules.document_attention import _one_copy_a_group  # noqa: E402
from tune_recipes.modules.varlen_attention import (  # noqa: E402
    _flash_forward, document_spans, varlen_causal_attention)

PROMPT_TOKENS = 200


def packed_lengths(rows: int, seq_len: int, seed: int = 0) -> list:
    lengths = [PROMPT_TOKENS + len(r["instruction"]) + len(r["input"]) + len(r["output"])
               for r in instruction_rows(rows * seq_len // 200 + 8, 40, seed)]
    packs, current = [], []
    for n in lengths:
        n = min(n, seq_len)
        if sum(current) + n > seq_len:
            packs.append(current)
            current = []
            if len(packs) == rows:
                break
        current.append(n)
    if current and len(packs) < rows:
        packs.append(current)
    if len(packs) < rows:
        raise ValueError(f"the instruction rows fill {len(packs)} of {rows} packs")
    return packs


def longest_document(packs: list, seq_len: int) -> int:
    """The longest document of ``packs`` (lengths a row), a row's padding counted as one."""
    return max(max(row + [seq_len - sum(row)] if sum(row) < seq_len else row) for row in packs)


def timed(fn, reps: int, device: torch.device, warmup: int = 3):
    for _ in range(warmup):
        fn()
    if device.type != "cuda":
        return None
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def new_layouts(b, s, h, kvh, d, reps, device, q, k, v, grad, flash_eager, cudnn_eager, cudnn_explicit,
                layouts=8):
    """Each call on the next of ``layouts`` packings (another document count and longest document,
    as consecutive training batches): the host's time a forward + backward call (a per-layout plan
    or graph build shows here) and the GPU's, the first pass over the layouts apart."""
    import time

    packs = [packed_lengths(b, s, seed=seed) for seed in range(1, layouts + 1)]
    spans = [document_spans(p, s).to(device) for p in packs]
    longest = [longest_document(p, s) for p in packs]
    ins = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    rows = []
    for name, fn, by_longest in (("flash varlen, eager", flash_eager, False),
                                 ("flash varlen, eager, max = longest document", flash_eager, True),
                                 ("cuDNN varlen, eager", cudnn_eager, False),
                                 ("cuDNN varlen, eager, max = longest document", cudnn_eager, True),
                                 ("cuDNN varlen, eager, aten backward by hand", cudnn_explicit, False),
                                 ("cuDNN varlen, eager, aten backward by hand, max = longest document", cudnn_explicit, True)):
        try:
            host, gpu = [], []
            for rep in range(max(reps, layouts) + layouts):
                i = rep % layouts
                max_len = longest[i] if by_longest else s
                torch.cuda.synchronize()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                t0 = time.perf_counter()
                start.record()
                fn(*ins, max_len=max_len, cu=spans[i].cu_seqlens).backward(grad)
                end.record()
                t1 = time.perf_counter()
                torch.cuda.synchronize()
                host.append((t1 - t0) * 1e3)
                gpu.append(start.elapsed_time(end))
            rows.append({"impl": name + f", {layouts} layouts in turn", "first_pass_host_ms": host[:layouts],
                         "host_ms": statistics.median(host[layouts:]),
                         "forward_backward_ms": statistics.median(gpu[layouts:])})
        except Exception as e:
            print(f"{name} on new layouts: {type(e).__name__}: {str(e)[:300]}")
            rows.append({"impl": name + f", {layouts} layouts in turn", "error": f"{type(e).__name__}: {str(e)[:300]}"})
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=None, help="also write the rows as JSON here")
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of the script (flash attention's "
                    "path takes its dense fallback there, flex attention has no CPU backward)")
    args = ap.parse_args(argv)
    from torch.nn.attention.flex_attention import flex_attention

    device = torch.device(args.device)
    lens = packed_lengths(args.rows, args.seq_len)
    b, s, h, kvh, d = args.rows, args.seq_len, args.heads, args.kv_heads, args.head_dim
    gen = torch.Generator(device).manual_seed(0)
    q = torch.randn(b, s, h, d, device=device, generator=gen, dtype=torch.bfloat16)
    k = torch.randn(b, s, kvh, d, device=device, generator=gen, dtype=torch.bfloat16)
    v = torch.randn(b, s, kvh, d, device=device, generator=gen, dtype=torch.bfloat16)
    grad = torch.randn(b, s, h, d, device=device, generator=gen, dtype=torch.bfloat16)
    block_mask = move_block_mask(document_block_mask(lens, s), device)
    spans = document_spans(lens, s).to(device)
    flex = torch.compile(flex_attention)

    def expanded(t):  # torchtune's GQA: k and v copied out to every query head
        return t.transpose(1, 2).unsqueeze(2).expand(b, kvh, h // kvh, s, d).flatten(1, 2)

    def run_flex(qq, kk, vv):
        return flex(qq.transpose(1, 2), expanded(kk), expanded(vv), block_mask=block_mask).transpose(1, 2)

    def flash_as_routed(qq, kk, vv):  # the model's path: torchtune's copies, one head a group back
        kk, vv = (_one_copy_a_group(expanded(t), kvh).transpose(1, 2) for t in (kk, vv))
        return varlen_causal_attention(qq, kk, vv, spans)

    run_flash = torch.compile(flash_as_routed)

    # float64 reference: each document's causal attention on its own
    ref_in = [t.double().requires_grad_() for t in (q, k, v)]
    ref_out = torch.empty(b, s, h, d, dtype=torch.float64, device=device)
    for row, row_lens in enumerate(lens):
        start = 0
        for n in row_lens + ([s - sum(row_lens)] if sum(row_lens) < s else []):
            sl = slice(start, start + n)
            qq = ref_in[0][row, sl].transpose(0, 1)
            kk = ref_in[1][row, sl].transpose(0, 1).repeat_interleave(h // kvh, 0)
            vv = ref_in[2][row, sl].transpose(0, 1).repeat_interleave(h // kvh, 0)
            ref_out[row, sl] = torch.nn.functional.scaled_dot_product_attention(
                qq, kk, vv, is_causal=True).transpose(0, 1)
            start += n
    ref_out.backward(grad.double())
    ref_grads = [t.grad for t in ref_in]

    tokens = b * s
    longest = longest_document(lens, s)

    def flat(qq, kk, vv):
        return qq.reshape(tokens, h, d), kk.reshape(tokens, kvh, d), vv.reshape(tokens, kvh, d)

    def flash_eager(qq, kk, vv, max_len=s, cu=None):
        out, _ = _flash_forward(*flat(qq, kk, vv), spans.cu_seqlens if cu is None else cu, max_len)
        return out.view(b, s, h, d)

    def cudnn_eager(qq, kk, vv, max_len=s, cu=None):
        cu = spans.cu_seqlens if cu is None else cu
        out = torch.ops.aten._cudnn_attention_forward(*flat(qq, kk, vv), None, cu, cu, max_len, max_len,
                                                      True, 0.0, True, False)[0]
        return out.view(b, s, h, d)

    class CudnnExplicit(torch.autograd.Function):  # aten's backward called by hand
        @staticmethod
        def forward(ctx, qq, kk, vv, cu, max_len):
            res = torch.ops.aten._cudnn_attention_forward(qq, kk, vv, None, cu, cu, max_len, max_len,
                                                          True, 0.0, True, False)
            ctx.save_for_backward(qq, kk, vv, res[0], res[1], cu, res[6], res[7])
            ctx.max_len = max_len
            return res[0]

        @staticmethod
        def backward(ctx, g):
            qq, kk, vv, out, lse, cu, seed, offset = ctx.saved_tensors
            dq, dk, dv = torch.ops.aten._cudnn_attention_backward(
                g.contiguous(), qq, kk, vv, out, lse, seed, offset, None, cu, cu, ctx.max_len, ctx.max_len,
                0.0, True)
            return dq, dk, dv, None, None

    def cudnn_explicit(qq, kk, vv, max_len=s, cu=None):
        cu = spans.cu_seqlens if cu is None else cu
        return CudnnExplicit.apply(*flat(qq, kk, vv), cu, max_len).view(b, s, h, d)

    results = []
    impls = (("flex, k/v expanded (torchtune)", run_flex), ("flash varlen", run_flash),
             ("flash varlen, eager", flash_eager),
             ("flash varlen, eager, max = longest document", lambda *t: flash_eager(*t, max_len=longest)),
             ("cuDNN varlen, eager", cudnn_eager),
             ("cuDNN varlen, eager, max = longest document", lambda *t: cudnn_eager(*t, max_len=longest)),
             ("cuDNN varlen, eager, aten backward by hand", cudnn_explicit))
    def measure(name, fn):
        ins = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out = fn(*ins)
        out.backward(grad)
        errors = {"out": (out.double() - ref_out).abs().max().item(),
                  **{f"d{n}": (t.grad.double() - r).abs().max().item()
                     for n, t, r in zip("qkv", ins, ref_grads)}}

        def fwd():
            with torch.no_grad():
                fn(*ins)

        def fwd_bwd():
            fn(*ins).backward(grad)

        return {"impl": name, "forward_ms": timed(fwd, args.reps, device),
                "forward_backward_ms": timed(fwd_bwd, args.reps, device), **errors}

    # a CPU dry run: the compiled flash row alone (its dense fallback; the others need CUDA)
    for name, fn in impls if device.type == "cuda" else impls[1:2]:
        try:
            results.append(measure(name, fn))
        except Exception as e:  # an implementation this torch or GPU lacks: say so, go on
            print(f"{name}: {type(e).__name__}: {str(e)[:300]}")
            results.append({"impl": name, "error": f"{type(e).__name__}: {str(e)[:300]}"})
    if device.type == "cuda":
        results += new_layouts(b, s, h, kvh, d, args.reps, device, q, k, v, grad, flash_eager, cudnn_eager,
                               cudnn_explicit)
    docs = sum(len(r) for r in lens)
    where = torch.cuda.get_device_name() if device.type == "cuda" else "CPU dry run"
    print(f"{b} rows x {s} tokens, {docs} documents (mean {sum(map(sum, lens)) / docs:.0f} tokens), "
          f"{h} heads ({kvh} k/v) of {d}; {where}, torch {torch.__version__}")
    print("| attention | forward ms | forward + backward ms | out err | dq err | dk err | dv err |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        if "error" in r:
            print(f"| {r['impl']} | {r['error'][:80]} |")
            continue
        ms = [f"{r[k]:.2f}" if r.get(k) is not None else "-" for k in ("forward_ms", "forward_backward_ms")]
        errs = [f"{r[k]:.1e}" if k in r else "-" for k in ("out", "dq", "dk", "dv")]
        host = f" (host {r['host_ms']:.2f} ms; first pass {max(r['first_pass_host_ms']):.1f} at most)" if "host_ms" in r else ""
        print(f"| {r['impl']}{host} | {ms[0]} | {ms[1]} | {' | '.join(errs)} |")
    if args.out:
        import datetime

        meta = {"date": datetime.date.today().isoformat(), "torch": torch.__version__, "device": where,
                "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None}
        Path(args.out).write_text(json.dumps({"meta": meta, "args": vars(args), "lengths": lens, "results": results},
                                             indent=1))


if __name__ == "__main__":
    main()
