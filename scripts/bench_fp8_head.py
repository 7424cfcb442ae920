"""Would an FP8 LM head pay? The three products of the fused linear-CE (logits = X W^T, the
hidden gradient G W, the weight gradient G^T X) in bf16 against FP8 (e4m3 operands, one scale
per tensor, torch._scaled_mm), with the casts FP8 needs counted, and what FP8 does to the
logits and the loss (issue #15: the tied head is 17.3 ms of the 1B step's bf16 products).

    python3 scripts/bench_fp8_head.py                      # H200: 1B and 8B head shapes
    python3 scripts/bench_fp8_head.py --device cpu --rows 256 --vocab 4096 --dims 512  # smoke

Timing (CUDA events, median of ``--reps``): ``bf16``: the three torch.mm products;
``fp8``: the same products through torch._scaled_mm, plus every cast they need: X and W to
e4m3 (amax, scale, cast), W also transposed for the hidden gradient's layout, the logits'
gradient G to e5m2 (and transposed for the weight gradient), X transposed. The weight gradient
comes out in bf16 (no accumulation across chunks is modelled).

Numerics (fp64 reference on the same operands): X ~ N(0, 1) (a normed hidden state), W rows of
norm ``--logit-scale`` (logits with a spread like a trained LM's), targets drawn from the
reference softmax (so the loss is near the entropy, as on real text). Printed: the logits'
RMS error, the mean loss's error and the hidden and weight gradients' relative RMS errors, for
bf16 products (fp32 accumulation, rounded to bf16 once) and FP8.
"""

import argparse
import json
import statistics

import torch

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def to_fp8(t: torch.Tensor, dtype) -> tuple:
    """(t in ``dtype`` scaled to its range, the fp32 inverse scale): one scale per tensor."""
    amax = t.abs().amax().float().clamp(min=1e-12)
    scale = torch.finfo(dtype).max / amax
    return (t.float() * scale).clamp(-torch.finfo(dtype).max, torch.finfo(dtype).max).to(dtype), scale.reciprocal()


def scaled_mm(a8, a_inv, b8, b_inv, out_dtype):
    """a8 @ b8 (row-major a, column-major b) times both inverse scales."""
    if a8.is_cuda:
        return torch._scaled_mm(a8, b8, scale_a=a_inv, scale_b=b_inv, out_dtype=out_dtype)
    return ((a8.float() @ b8.float()) * (a_inv * b_inv)).to(out_dtype)  # CPU: emulated


def fp8_products(x, w, g):
    """The three head products in FP8 with their casts; returns (logits, grad_x, grad_w)."""
    x8, x_inv = to_fp8(x, E4M3)
    w8, w_inv = to_fp8(w, E4M3)
    logits = scaled_mm(x8, x_inv, w8.t(), w_inv, torch.bfloat16)             # [N, V]
    g8, g_inv = to_fp8(g, E5M2)
    w8_t = w8.t().contiguous()                                              # [D, V] row-major
    grad_x = scaled_mm(g8, g_inv, w8_t.t(), w_inv, torch.bfloat16)          # [N, D]
    g8_t = g8.t().contiguous()                                              # [V, N]
    x8_t = x8.t().contiguous()                                              # [D, N]
    grad_w = scaled_mm(g8_t, g_inv, x8_t.t(), x_inv, torch.bfloat16)        # [V, D]
    return logits, grad_x, grad_w


def bf16_products(x, w, g):
    return x @ w.t(), g @ w, g.t() @ x


def time_ms(fn, reps, cuda):
    times = []
    for i in range(reps + 1):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            ms = start.elapsed_time(end)
        else:
            import time
            t0 = time.perf_counter()
            fn()
            ms = (time.perf_counter() - t0) * 1e3
        if i:  # the first call warms up (cuBLAS heuristics, allocations)
            times.append(ms)
    return statistics.median(times)


def numerics(rows, dim, vocab, logit_scale, device, seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(rows, dim, generator=gen, device=device).to(torch.bfloat16)
    w = torch.randn(vocab, dim, generator=gen, device=device)
    w = (w / w.norm(dim=1, keepdim=True) * logit_scale).to(torch.bfloat16)
    x64, w64 = x.double(), w.double()
    ref_logits = x64 @ w64.t()
    target = torch.multinomial(torch.softmax(ref_logits.float(), -1), 1, generator=gen).squeeze(1)
    ref_loss = torch.nn.functional.cross_entropy(ref_logits, target)
    g64 = torch.softmax(ref_logits, -1)
    g64[torch.arange(rows, device=device), target] -= 1
    g64 /= rows
    ref_gx, ref_gw = g64 @ w64, g64.t() @ x64
    out = {}
    for name, fn in (("bf16", bf16_products), ("fp8", fp8_products)):
        if name == "bf16" and not x.is_cuda:  # CPU: fp32 products rounded once, as cuBLAS
            logits, gx, gw = [t.to(torch.bfloat16) for t in bf16_products(x.float(), w.float(), g64.float())]
        else:
            logits, gx, gw = fn(x, w, g64.to(torch.bfloat16))
        loss = torch.nn.functional.cross_entropy(logits.double(), target)

        def rel(a, b):
            return float((a.double() - b).norm() / b.norm())

        out[name] = {"logits_rms_err": float((logits.double() - ref_logits).pow(2).mean().sqrt()),
                     "loss_err": float(loss - ref_loss), "grad_x_rel": rel(gx, ref_gx),
                     "grad_w_rel": rel(gw, ref_gw)}
    out["ref_loss"] = float(ref_loss)
    out["ref_logits_std"] = float(ref_logits.std())
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--rows", type=int, default=8192)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--dims", default="2048,4096", help="hidden sizes (1B: 2048, 8B: 4096)")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--numerics-rows", type=int, default=1024)
    ap.add_argument("--logit-scale", type=float, default=3.0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    rows = []
    for dim in map(int, args.dims.split(",")):
        x = torch.randn(args.rows, dim, device=device, dtype=torch.bfloat16)
        w = torch.randn(args.vocab, dim, device=device, dtype=torch.bfloat16) * dim ** -0.5
        g = torch.randn(args.rows, args.vocab, device=device, dtype=torch.bfloat16) * 1e-5
        t_bf16 = time_ms(lambda: bf16_products(x, w, g), args.reps, cuda)
        t_fp8 = time_ms(lambda: fp8_products(x, w, g), args.reps, cuda)
        flops = 3 * 2 * args.rows * dim * args.vocab
        del x, w, g
        if cuda:
            torch.cuda.empty_cache()
        num = numerics(args.numerics_rows, dim, args.vocab, args.logit_scale, device)
        row = {"rows": args.rows, "dim": dim, "vocab": args.vocab, "bf16_ms": round(t_bf16, 3),
               "fp8_ms_with_casts": round(t_fp8, 3), "bf16_tflops": round(flops / t_bf16 / 1e9, 1),
               "numerics": num}
        rows.append(row)
        print(json.dumps(row), flush=True)
    print("| D | bf16 ms | FP8 ms (with casts) | logits RMS err bf16 / FP8 | loss err bf16 / FP8 | "
          "grad_x rel bf16 / FP8 | grad_w rel bf16 / FP8 |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        n = r["numerics"]
        b, f = n["bf16"], n["fp8"]
        print(f"| {r['dim']} | {r['bf16_ms']} | {r['fp8_ms_with_casts']} | {b['logits_rms_err']:.2e} / "
              f"{f['logits_rms_err']:.2e} | {b['loss_err']:+.2e} / {f['loss_err']:+.2e} | "
              f"{b['grad_x_rel']:.2e} / {f['grad_x_rel']:.2e} | {b['grad_w_rel']:.2e} / {f['grad_w_rel']:.2e} |")
    if args.out:
        meta = {"torch": torch.__version__,
                "device": torch.cuda.get_device_name(device) if cuda else "cpu"}
        with open(args.out, "w") as fh:
            json.dump({"meta": meta, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
