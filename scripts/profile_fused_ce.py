"""Where the fused loss's time goes on one CUDA GPU, per chunk size (a tuning aid, not a test).

    python3 scripts/profile_fused_ce.py --out results/profile_fused_ce.json

    python3 scripts/profile_fused_ce.py --trace --trace-rows 359   # kernel timeline

Parts (--parts, comma-separated; default floors,stages,softmax,whole):
- sustain: call times and SM clock over 40 back-to-back calls;
- layouts: the three per-chunk products with the logits stored [rows, V] or [V, rows];
- floors: the three matrix products over all valid rows at once, and a device copy;
- stages: per chunk size, each stage's cost (logits product, softmax-gradient kernel,
  hidden-gradient product, weight-gradient product written vs accumulated) times the chunks;
- softmax: launch configurations of the softmax-gradient kernel;
- whole: the whole loss (default settings) per chunk size: time, peak extra memory and
  weight-gradient error against an fp32 reference.
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_fused_ce import V, bench_one, event_ms, make_inputs, reference, rel_l2  # noqa: E402
from tune_recipes.modules import _triton_ce  # noqa: E402
from tune_recipes.modules.loss import fused_linear_cross_entropy  # noqa: E402


def timed(fn, iters=10, warmup=2):
    for _ in range(warmup):
        fn()
    return statistics.median(event_ms(fn) for _ in range(iters))


def trace(args):
    """Kernel-level view of whole forward+backward calls: which kernels, how long, and how
    much of the elapsed time the GPU sat idle."""
    from torch.profiler import ProfilerActivity, profile

    import bench_fused_ce

    n, d = map(int, args.shape.split("x"))
    h0, w0, y = make_inputs(n, d, kind=args.kind)
    h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
    impls = [("ours", fused_linear_cross_entropy)]
    if args.previous:
        bench_fused_ce.load_baseline(args.previous, "previous")
        impls.append(("previous", bench_fused_ce._baseline["previous"]))
    for (impl, loss_fn), rows in [(i, r) for i in impls for r in map(int, args.trace_rows.split(","))]:
        print(f"=== {impl}")
        fn = lambda: loss_fn(h, w, y, chunk_size=rows, weight_grad_fp32=False).backward()
        for _ in range(3):
            fn()
            h.grad = w.grad = None
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
        h.grad = w.grad = None
        elapsed = a.elapsed_time(b)
        # Host time of the forward alone: far below the GPU time when the host runs ahead.
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = loss_fn(h, w, y, chunk_size=rows)
        host_fwd = (time.perf_counter() - t0) * 1000
        torch.cuda.synchronize()
        gpu_fwd = (time.perf_counter() - t0) * 1000
        del loss
        print(f"rows {rows}: forward host {host_fwd:.2f} ms, until GPU done {gpu_fwd:.2f} ms")
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        busy = sum(e.device_time for e in kernels) / 1000
        print(f"rows {rows}: elapsed {elapsed:.2f} ms, kernel time {busy:.2f} ms, kernels {len(kernels)}")
        agg = {}
        for e in kernels:
            k = e.name[:90]
            c, t = agg.get(k, (0, 0.0))
            agg[k] = (c + 1, t + e.device_time / 1000)
        for k, (c, t) in sorted(agg.items(), key=lambda kv: -kv[1][1])[:24]:
            print(f"  {t:7.3f} ms  x{c:3d}  {k}")
        # Timeline gaps over 20 us between consecutive kernels.
        ks = sorted(kernels, key=lambda e: e.time_range.start)
        gaps = [(ks[i + 1].time_range.start - ks[i].time_range.end, ks[i].name[:40], ks[i + 1].name[:40])
                for i in range(len(ks) - 1)]
        big = [g for g in gaps if g[0] > 20]
        print(f"  gaps > 20 us: {len(big)}, total {sum(g[0] for g in big) / 1000:.2f} ms; "
              f"all gaps {sum(g[0] for g in gaps) / 1000:.2f} ms")
        by_pair = {}
        for g, a_name, b_name in gaps:
            key = (a_name[:28], b_name[:28])
            c, t = by_pair.get(key, (0, 0.0))
            by_pair[key] = (c + 1, t + g)
        for (a_name, b_name), (c, t) in sorted(by_pair.items(), key=lambda kv: -kv[1][1])[:10]:
            print(f"    {t / 1000:6.3f} ms x{c:3d}  {a_name} -> {b_name}")
        first = ks[0].time_range.start
        print("  first GEMM starts at", [round((e.time_range.start - first) / 1000, 3) for e in ks
                                         if "nvjet" in e.name][:1], "ms after the first kernel")


def softmax_sweep(hv, yv, w, rows, res):
    """Launch configurations of the softmax-gradient kernel on one chunk of bf16 logits (the
    target's logit recomputed, the gradient written over them, as the loss does)."""
    from tune_recipes.modules.loss import _softmax_grad_torch, target_logits

    hc, yc = hv[:rows].contiguous(), yv[:rows].contiguous()
    logits = torch.mm(hc, w.t())
    gl = logits.clone()
    ref_loss, ref_grad = _softmax_grad_torch(logits.clone(), yc, 1e-4, target_logit=target_logits(hc, w, yc))
    base = timed(lambda: gl.copy_(logits), iters=20)
    res["softmax_launch"] = []
    for launch in [(0, 4096, 16), (0, 2048, 8), (0, 8192, 32), (1, 8192, 32), (2, 4096, 16)]:
        t = timed(lambda: _triton_ce.softmax_grad_inplace(gl.copy_(logits), yc, 1e-4, launch=launch,
                                                          weight=w, hidden=hc), iters=20) - base
        loss_k = torch.empty(rows, device="cuda")
        _, grad_k = _triton_ce.softmax_grad_inplace(gl.copy_(logits), yc, 1e-4, loss_out=loss_k, launch=launch,
                                                    weight=w, hidden=hc)
        # Bytes: bf16 read twice, bf16 written once.
        r = {"launch": launch, "ms": t, "TBps": logits.numel() * 6 / (t * 1e9),
             "err_loss": rel_l2(loss_k, ref_loss), "err_grad": rel_l2(grad_k, ref_grad.float())}
        res["softmax_launch"].append(r)
        print(json.dumps(r), flush=True)


def layouts(hv, w, res, rows=640):
    """The three products per chunk with the logits stored [rows, V] (as now) or transposed
    [V, rows]: which layout cuBLAS runs fastest."""
    hc = hv[:rows].contiguous()
    g = (hc @ w.t()).mul_(1e-3)
    gt = g.t().contiguous()
    gw = torch.empty_like(w)
    t = {
        "logits_rowsV": timed(lambda: torch.mm(hc, w.t(), out=g), iters=20),
        "logits_Vrows": timed(lambda: torch.mm(w, hc.t(), out=gt), iters=20),
        "grad_hidden_rowsV": timed(lambda: torch.mm(g, w), iters=20),
        "grad_hidden_Vrows": timed(lambda: torch.mm(gt.t(), w), iters=20),
        "grad_weight_rowsV": timed(lambda: torch.mm(g.t(), hc, out=gw), iters=20),
        "grad_weight_Vrows": timed(lambda: torch.mm(gt, hc, out=gw), iters=20),
        "grad_weight_acc_rowsV": timed(lambda: gw.addmm_(g.t(), hc), iters=20),
        "grad_weight_acc_Vrows": timed(lambda: gw.addmm_(gt, hc), iters=20),
    }
    res["layouts"] = t
    for k, v in t.items():
        print(f"  {k:24s} {v:.3f} ms  {2 * rows * w.shape[0] * w.shape[1] / (v * 1e9):.0f} TFLOP/s", flush=True)


def sustain(h0, w0, y, res, iters=40, rows=640):
    """Back-to-back calls with the SM clock and power logged beside them (does sustained
    matrix work lower the clock?)."""
    import subprocess

    log = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,power.draw,clocks_throttle_reasons.active",
                            "--format=csv,noheader", "-lms", "50"], stdout=subprocess.PIPE, text=True)
    time.sleep(0.5)
    h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
    ts = []
    for _ in range(iters):
        ts.append(round(event_ms(lambda: fused_linear_cross_entropy(h, w, y, chunk_size=rows).backward()), 2))
        h.grad = w.grad = None
    time.sleep(0.3)
    log.terminate()
    smi = log.communicate()[0].strip().splitlines()
    res["sustain"] = {"ms": ts, "smi": smi}
    print("sustain ms:", ts, flush=True)
    print("smi:", smi[:3], "...", smi[-25:], flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="profile_fused_ce.json")
    ap.add_argument("--shape", default="8192x4096")
    ap.add_argument("--rows", default="320,359,410,478,574,638")
    ap.add_argument("--parts", default="floors,stages,softmax,whole")
    ap.add_argument("--whole-rows", default="359,410,478,574,638")
    ap.add_argument("--trace", action="store_true", help="only profile the whole loss's kernels")
    ap.add_argument("--trace-rows", default="359")
    ap.add_argument("--kind", default="random", help="input kind for --trace (random, peaked)")
    ap.add_argument("--previous", default=None,
                    help="with --trace: also trace the loss in this directory (bench_fused_ce.py --previous)")
    args = ap.parse_args()
    if args.trace:
        return trace(args)
    n, d = map(int, args.shape.split("x"))
    h, w, y = make_inputs(n, d)
    valid = (y != -100).nonzero().squeeze(1)
    m = valid.numel()
    hv = h.index_select(0, valid)
    yv = y.index_select(0, valid)
    res = {"N": n, "D": d, "V": V, "valid_rows": m}

    parts = args.parts.split(",")
    res["stages"], res["whole"] = [], []
    best = _triton_ce.LAUNCH
    if "sustain" in parts:
        sustain(h, w, y, res)
    if "layouts" in parts:
        layouts(hv, w, res)
    # (1) floors
    gw = torch.empty(V, d, device="cuda", dtype=torch.bfloat16)
    if "floors" in parts:
        g_full = torch.empty(m, V, device="cuda", dtype=torch.bfloat16).normal_().mul_(1e-6)
        big = torch.empty(2 * 1024**3, device="cuda", dtype=torch.uint8)
        big2 = torch.empty_like(big)
        res["floor_ms"] = {
            "logits_mm": timed(lambda: hv @ w.t()),
            "grad_hidden_mm": timed(lambda: g_full @ w),
            "grad_weight_mm": timed(lambda: torch.mm(g_full.t(), hv, out=gw)),
            "copy_2GiB": timed(lambda: big2.copy_(big)),
        }
        flops = 2 * m * d * V
        res["floor_ms"]["tflops_each"] = {k: flops / (res["floor_ms"][k] * 1e9)
                                          for k in ("logits_mm", "grad_hidden_mm", "grad_weight_mm")}
        res["floor_ms"]["copy_TBps"] = 2 * 2 * 1024**3 / (res["floor_ms"]["copy_2GiB"] * 1e9)
        del g_full, big, big2
        print(json.dumps(res["floor_ms"]), flush=True)

    # (2) stages per chunk size
    for rows in (map(int, args.rows.split(",")) if "stages" in parts else []):
        hc, yc = hv[:rows].contiguous(), yv[:rows].contiguous()
        logits = torch.mm(hc, w.t())  # as the loss: bf16 logits
        gl = logits.clone()
        gv = _triton_ce.softmax_grad_inplace(gl, yc, 1e-4, weight=w, hidden=hc)[1]
        n_chunks = -(-m // rows)
        st = {
            "rows": rows, "chunks": n_chunks,
            "logits_mm": timed(lambda: torch.mm(hc, w.t(), out=logits)),
            "softmax_grad": timed(lambda: _triton_ce.softmax_grad_inplace(gl.copy_(logits), yc, 1e-4,
                                                                          weight=w, hidden=hc))
            - timed(lambda: gl.copy_(logits)),
            # The bf16 gradient as the loss leaves it, over the logits.
            "grad_hidden_mm": timed(lambda: gv @ w),
            "grad_weight_write": timed(lambda: torch.mm(gv.t(), hc, out=gw)),
            "grad_weight_accumulate": timed(lambda: gw.addmm_(gv.t(), hc)),
        }
        st["total_est_ms"] = n_chunks * (st["logits_mm"] + st["softmax_grad"] + st["grad_hidden_mm"]
                                         + st["grad_weight_accumulate"])
        res["stages"].append(st)
        print(json.dumps(st), flush=True)
        del logits, gl, gv

    # (2b) softmax-gradient kernel launch configurations at one chunk size
    rows = 359
    if "softmax" in parts:
        softmax_sweep(hv, yv, w, rows, res)
        best = min(res["softmax_launch"], key=lambda r: r["ms"])["launch"]
        _triton_ce.LAUNCH = best

    # (3) the whole loss (default bf16 weight-gradient accumulation) per chunk size
    _, _, ref_gw = reference(h, w, y) if "whole" in parts else (None, None, None)
    for rows in (map(int, args.whole_rows.split(",")) if "whole" in parts else []):
        fn = lambda a, b, c: fused_linear_cross_entropy(a, b, c, chunk_size=rows)
        ms, peak, (gh, gwt, loss), ok, _ = bench_one(fn, h, w, y, 20, 3)
        row = {"rows": rows, "ms": round(ms, 2), "peak_gib": round(peak / 1024**3, 4),
               "err_gw": rel_l2(gwt, ref_gw), "retain_ok": ok}
        res["whole"].append(row)
        print(json.dumps(row), flush=True)
    res["meta"] = {"date": time.strftime("%Y-%m-%d"), "gpu": torch.cuda.get_device_name(),
                   "torch": torch.__version__}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1))
    print("\nrows chunks | logits softmax grad_h gw_write gw_acc | est_total")
    for st in res["stages"]:
        print(f"{st['rows']:5d} {st['chunks']:3d} | {st['logits_mm']:.3f} {st['softmax_grad']:.3f} "
              f"{st['grad_hidden_mm']:.3f} {st['grad_weight_write']:.3f} {st['grad_weight_accumulate']:.3f} | "
              f"{st['total_est_ms']:.2f}")
    print("softmax launch", best)
    print("rows | ms peak_gib err_gw")
    for wh in res["whole"]:
        print(f"{wh['rows']} | {wh['ms']} {wh['peak_gib']} {wh['err_gw']:.2e}")

if __name__ == "__main__":
    main()
