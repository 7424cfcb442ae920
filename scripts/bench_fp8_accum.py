"""Does FP8 "fast accumulation" pay in the backward products? (issue #15, the 1B gap).

torchao's float8 training (``enable_fp8_training``) runs each linear layer's three products
through ``torch._scaled_mm``. Its default config asks cuBLAS for fast accumulation only in the
forward product (``use_fast_accum=True``); the two backward products (input gradient, weight
gradient) accumulate with Hopper's periodic promotion to fp32 (``use_fast_accum=False``). This
times both settings at the real layer shapes, with the operands' layouts as torchao passes them,
and measures what fast accumulation does to the result against an fp64 product of the same
FP8 operands (so only the accumulation differs, not the e4m3/e5m2 rounding).

    python3 scripts/bench_fp8_accum.py --out results/fp8_accum.json     # H200: 1B and 8B shapes

Timing: CUDA events around ``--inner`` back-to-back calls, median of ``--reps``; one Llama
layer's projections times its layer count, per step of ``tokens`` tokens. Numerics: relative
RMS and max-abs errors of the bf16 output against fp64, operands N(0, 1) for activations and
N(0, 0.02) weights; gradients N(0, 1e-3) with 5% of rows 30x larger (outliers, like a real
output gradient)."""

import argparse
import json
import statistics

import torch

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2

# name: (dim, hidden, kv_dim, layers, tokens a step)
MODELS = {
    "llama3.2-1b": (2048, 8192, 512, 16, 8192),
    "llama3.1-8b": (4096, 14336, 1024, 32, 4096),
}


def to_fp8(t: torch.Tensor, dtype: torch.dtype):
    """(t scaled to ``dtype``'s range and cast, the fp32 inverse scale): one scale per tensor."""
    amax = t.abs().amax().float().clamp(min=1e-12)
    scale = torch.finfo(dtype).max / amax
    return (t.float() * scale).to(dtype), scale.reciprocal()


def layer_products(dim: int, hidden: int, kv: int, tokens: int):
    """Each projection of a layer as (name, M, K, N) of its forward product out[M, N] = x[M, K] w^T."""
    return [("q", tokens, dim, dim), ("k", tokens, dim, kv), ("v", tokens, dim, kv),
            ("o", tokens, dim, dim), ("w1", tokens, dim, hidden), ("w3", tokens, dim, hidden),
            ("w2", tokens, hidden, dim)]


def operands(kind: str, m: int, k: int, n: int, device, gen):
    """The two FP8 operands of one product as torchao lays them out (a row-major [M, K], b
    column-major [K, N]) with their inverse scales. kind: fwd (x e4m3 @ w^T e4m3), grad_input
    (dy e5m2 [T, N] @ w e4m3 [N, K]), grad_weight (dy^T e5m2 [N, T] @ x e4m3 [T, K])."""
    def act(r, c):
        return torch.randn(r, c, device=device, generator=gen, dtype=torch.float32)

    def grad(r, c):
        g = torch.randn(r, c, device=device, generator=gen) * 1e-3
        g[torch.rand(r, device=device, generator=gen) < 0.05] *= 30
        return g

    if kind == "fwd":          # out[T, N] = x[T, K] @ w[N, K]^T
        a, b = act(m, k), act(n, k).mul_(0.02)
        a8, ai = to_fp8(a, E4M3)
        b8, bi = to_fp8(b, E4M3)
        return a8, ai, b8.t(), bi
    if kind == "grad_input":   # dx[T, K] = dy[T, N] @ w[N, K]
        a, b = grad(m, n), act(n, k).mul_(0.02)
        a8, ai = to_fp8(a, E5M2)
        b8, bi = to_fp8(b.t().contiguous(), E4M3)        # w^T row-major, so w column-major
        return a8, ai, b8.t(), bi
    # dw[N, K] = dy^T[N, T] @ x[T, K]
    a, b = grad(m, n).t().contiguous(), act(m, k)
    a8, ai = to_fp8(a, E5M2)
    b8, bi = to_fp8(b.t().contiguous(), E4M3)            # x^T row-major, so x column-major
    return a8, ai, b8.t(), bi


def time_ms(fn, reps: int, inner: int) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / inner)
    return statistics.median(times)


def errors(out: torch.Tensor, ref: torch.Tensor) -> dict:
    d = out.double() - ref
    return {"rel_rms": (d.pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()).item(),
            "max_abs_rel": (d.abs().max() / ref.abs().max()).item()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--inner", type=int, default=10)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    rows, table = [], []
    for model in args.models.split(","):
        dim, hidden, kv, layers, tokens = MODELS[model]
        totals = {}
        for name, m, k, n in layer_products(dim, hidden, kv, tokens):
            for kind in ("fwd", "grad_input", "grad_weight"):
                mm, kk, nn_ = {"fwd": (m, k, n), "grad_input": (m, n, k), "grad_weight": (n, m, k)}[kind]
                a8, ai, b8, bi = operands(kind, m, k, n, device, gen)
                ref = (a8.double() @ b8.double()) * (ai.double() * bi.double())
                row = {"model": model, "proj": name, "kind": kind, "M": mm, "K": kk, "N": nn_}
                for fast in (False, True):
                    def call(fast=fast):
                        return torch._scaled_mm(a8, b8, scale_a=ai, scale_b=bi, out_dtype=torch.bfloat16,
                                                use_fast_accum=fast)
                    ms = time_ms(call, args.reps, args.inner)
                    tag = "fast" if fast else "precise"
                    row[f"{tag}_ms"] = ms
                    row[f"{tag}_tflops"] = 2 * mm * kk * nn_ / ms / 1e9
                    row[f"{tag}_err"] = errors(call(), ref)
                    totals[(kind, tag)] = totals.get((kind, tag), 0.0) + ms * layers
                del a8, b8, ref
                rows.append(row)
                print(f"{model:12s} {name:3s} {kind:11s} M{mm:6d} K{kk:6d} N{nn_:6d}  precise "
                      f"{row['precise_ms']:.3f} ms ({row['precise_tflops']:.0f} TF/s, err "
                      f"{row['precise_err']['rel_rms']:.1e})  fast {row['fast_ms']:.3f} ms "
                      f"({row['fast_tflops']:.0f} TF/s, err {row['fast_err']['rel_rms']:.1e})", flush=True)
        for kind in ("fwd", "grad_input", "grad_weight"):
            table.append((model, kind, totals[(kind, "precise")], totals[(kind, "fast")]))
    print("\n| model | product | precise accumulation ms/step | fast ms/step | saved ms/step |")
    print("|---|---|---|---|---|")
    for model, kind, p, f in table:
        print(f"| {model} | {kind} (all layers) | {p:.2f} | {f:.2f} | {p - f:.2f} |")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "rows": rows, "totals": [dict(zip(("model", "kind", "precise_ms", "fast_ms"), t))
                                                 for t in table]}, fh, indent=1)


if __name__ == "__main__":
    main()
