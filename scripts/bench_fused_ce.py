"""Benchmark fused linear + cross-entropy implementations side by side (one CUDA GPU).

    python3 scripts/bench_fused_ce.py --out results/fused_ce.json

For each shape (bf16, V=128256, 30% ignored labels, grads for hidden and weight) and each input
kind: median forward+backward time after warm-up, peak memory above the inputs, relative-L2
error of the hidden/weight gradients and of the loss against an fp32 reference, and whether a
second ``backward(retain_graph=True)`` doubles the gradients as it should. Methods that are not
installed are reported as skipped. Not a test: numbers go to docs/benchmarks.md.

Input kinds (``make_inputs``):
- ``random``: hidden ~ N(0, 0.5^2), W ~ N(0, 1/D): nearly uniform logits (std ~0.5, mean loss
  ~11.8), 30% of labels ignored at random positions. Rounding such logits costs little.
- ``peaked_zipf``: ``peaked`` with labels drawn like text's tokens (rank r with probability
  ~ 1/(r+10)^1.1: the most frequent label ~1.6% of rows, 3,749 distinct labels in 8192 rows),
  so labels recur within and across chunks, which the per-label target sums must handle.
- ``peaked``: logits shaped like a trained LM's. W ~ N(0, 1/D); the hidden state of a row with
  label y is 2.5 z + m * w_y / |w_y|^2 (z ~ N(0, I)), so its logits are N(0, 2.5^2) except the
  target's, raised by a margin m ~ N(log V + 2.5^2/2 - 0.4, 3^2): the target usually stands
  well above the rest, the largest logits are ~15-20 and the mean loss is ~1.9 (printed as
  ``ref_loss``). The labels of the first 30% of every 2048-token sequence (the prompt) are
  ignored. Here rounding the logits to bf16 before the softmax doubles the gradient error.
"""

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tune_recipes.modules.loss import fused_linear_cross_entropy  # noqa: E402

V = 128256
IGNORE = -100


def ours(h, w, y):
    return fused_linear_cross_entropy(h, w, y)


def ours_fp32(h, w, y):
    return fused_linear_cross_entropy(h, w, y, weight_grad_fp32=True)


def plain_eager(h, w, y):
    return F.cross_entropy((h @ w.t()).float(), y, ignore_index=IGNORE)


_compiled = {}


def plain_compiled(h, w, y):
    if "fn" not in _compiled:
        _compiled["fn"] = torch.compile(plain_eager)
    return _compiled["fn"](h, w, y)


def torchtune_chunked(h, w, y):
    from torchtune.modules.loss import CEWithChunkedOutputLoss

    loss_fn = CEWithChunkedOutputLoss(num_output_chunks=8)
    # As torchtune's decoder does: the projection is applied per chunk of the sequence.
    chunks = [c @ w.t() for c in h[None].chunk(8, dim=1)]
    return loss_fn(chunks, y[None])


def liger(h, w, y):
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    out = liger_fused_linear_cross_entropy(h, w, y, ignore_index=IGNORE)
    return out[0] if isinstance(out, tuple) else out


def cce(h, w, y):
    from cut_cross_entropy import linear_cross_entropy

    return linear_cross_entropy(h, w, y, ignore_index=IGNORE, shift=False)


METHODS = {
    "ours": ("tune-recipes fused (default)", ours),
    "ours_fp32": ("tune-recipes fused, weight_grad_fp32=True", ours_fp32),
    "eager": ("plain PyTorch eager", plain_eager),
    "compiled": ("plain PyTorch torch.compile", plain_compiled),
    "torchtune": ("torchtune 0.6.1 CEWithChunkedOutputLoss", torchtune_chunked),
    "liger": ("Liger Kernel fused linear CE", liger),
    "cce": ("Apple Cut Cross-Entropy", cce),
}


def make_inputs(n, d, seed=0, kind="random"):
    """bf16 hidden [n, d], weight [V, d] and labels [n]; the kinds are described at the top."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    if kind == "random":
        h = (torch.randn(n, d, device="cuda", generator=g) * 0.5).bfloat16()
        w = (torch.randn(V, d, device="cuda", generator=g) / d**0.5).bfloat16()
        y = torch.randint(0, V, (n,), device="cuda", generator=g)
        y[torch.rand(n, device="cuda", generator=g) < 0.3] = IGNORE
        return h, w, y
    assert kind in ("peaked", "peaked_zipf"), kind
    w = torch.randn(V, d, device="cuda", generator=g) / d**0.5
    if kind == "peaked_zipf":
        # Frequent tokens, as in text: label of rank r with probability ~ 1 / (r + 10)^1.1 (the
        # most frequent ~1.6% of rows), in a random order over the vocabulary.
        ranks = torch.arange(V, device="cuda", dtype=torch.float64)
        probs = (ranks + 10.0) ** -1.1
        perm = torch.randperm(V, device="cuda", generator=g)
        y = perm[torch.multinomial(probs / probs.sum(), n, replacement=True, generator=g)]
    else:
        y = torch.randint(0, V, (n,), device="cuda", generator=g)
    margin = math.log(V) + 2.5**2 / 2 - 0.4 + 3.0 * torch.randn(n, device="cuda", generator=g)
    wy = w[y]
    h = 2.5 * torch.randn(n, d, device="cuda", generator=g)
    h += (margin / (wy * wy).sum(1))[:, None] * wy
    seq = 2048
    for s in range(0, n, seq):
        y[s:s + round(0.3 * min(seq, n - s))] = IGNORE
    return h.bfloat16(), w.bfloat16(), y


def reference(h, w, y, chunk=4096):
    """fp32 loss and gradients, computed in row chunks (exact; nothing fused)."""
    hf, wf = h.float(), w.float()
    n_valid = int((y != IGNORE).sum())
    gh, gw = torch.zeros_like(hf), torch.zeros_like(wf)
    loss = 0.0
    for s in range(0, h.shape[0], chunk):
        hc = hf[s:s + chunk].clone().requires_grad_()
        wc = wf.detach().requires_grad_()
        lc = F.cross_entropy(hc @ wc.t(), y[s:s + chunk], ignore_index=IGNORE, reduction="sum")
        lc.backward()
        gh[s:s + chunk] = hc.grad
        gw += wc.grad
        loss += lc.item()
    return loss / n_valid, gh / n_valid, gw / n_valid


def rel_l2(a, b):
    return float((a.float() - b).norm() / b.norm())


def event_ms(run, idle_s=0.0):
    """One timed call of ``run`` (CUDA events), after an optional idle pause."""
    torch.cuda.synchronize()
    if idle_s:
        time.sleep(idle_s)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    run()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


def bench_one(fn, h0, w0, y, iters, warmup):
    """(median ms, or None with iters=0; peak bytes; gradients and loss; retain_graph check)"""
    h = h0.clone().requires_grad_()
    w = w0.clone().requires_grad_()
    for _ in range(warmup):
        fn(h, w, y).backward()
        h.grad = w.grad = None
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        h.grad = w.grad = None
        times.append(event_ms(lambda: fn(h, w, y).backward()))
    # Peak memory above the inputs, for one fwd+bwd, gradients included.
    h.grad = w.grad = None
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    loss = fn(h, w, y)
    loss.backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    grads = (h.grad.clone(), w.grad.clone(), float(loss.float().item()))
    # Second backward through a retained graph must give exactly twice the gradients.
    h.grad = w.grad = None
    try:
        loss = fn(h, w, y)
        loss.backward(retain_graph=True)
        g1h, g1w = h.grad.clone(), w.grad.clone()
        loss.backward()
        retain_err = max(rel_l2(h.grad, 2 * g1h.float()), rel_l2(w.grad, 2 * g1w.float()))
        retain_ok = retain_err < 1e-2
    except RuntimeError as e:
        retain_ok, retain_err = f"raises ({str(e).splitlines()[0][:60]})", None
    loss = None
    return (statistics.median(times) if times else None), peak, grads, retain_ok, retain_err


def cool_ms(fn, h0, w0, y, reps=3, idle_s=0.5):
    """Median of single forward+backward calls, each after an idle pause: the GPU then runs at
    its boost clock. Back-to-back calls (the main column) run into the board's power limit and
    clock down (seen on the H200: 1980 MHz falling to ~1500-1650 MHz, throttle reason SW power
    cap), so both are reported."""
    h = h0.clone().requires_grad_()
    w = w0.clone().requires_grad_()
    times = []
    for _ in range(reps):
        h.grad = w.grad = None
        times.append(event_ms(lambda: fn(h, w, y).backward(), idle_s))
    return statistics.median(times)


def matmul_floor(h, w, y, iters, warmup, after_idle=True):
    """The three matrix products alone over the valid rows (logits, grad_hidden, grad_weight),
    each in one call: what any exact method must at least spend. Back-to-back and after idle."""
    valid = (y != IGNORE).nonzero().squeeze(1)
    hv = h.index_select(0, valid)
    g = torch.randn(valid.numel(), V, device="cuda", dtype=torch.bfloat16) * 1e-5
    gw = torch.empty_like(w)

    def run():
        hv @ w.t()
        g @ w
        torch.mm(g.t(), hv, out=gw)

    for _ in range(warmup):
        run()
    back_to_back = statistics.median(event_ms(run) for _ in range(iters))
    return back_to_back, (statistics.median(event_ms(run, 0.5) for _ in range(3)) if after_idle else None)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="fused_ce.json")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--shapes", default="8192x4096,32768x4096,16384x2048")
    ap.add_argument("--kinds", default="random,peaked")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--variant-methods", default="",
                    help="methods run only at the --cool-shapes (trade-off rows, prototypes)")
    ap.add_argument("--cool-shapes", default="8192x4096",
                    help="shapes timed on every kind and also after idle pauses")
    ap.add_argument("--time-kinds", default="peaked",
                    help="kinds timed at the other shapes (the rest: one run for the errors)")
    args = ap.parse_args()
    variants = set(args.variant_methods.split(","))
    rows = []
    for shape in args.shapes.split(","):
        n, d = map(int, shape.split("x"))
        cool = shape in args.cool_shapes.split(",")
        for kind in args.kinds.split(","):
            h, w, y = make_inputs(n, d, kind=kind)
            ref_loss, ref_gh, ref_gw = reference(h, w, y)
            common = {"N": n, "D": d, "V": V, "kind": kind, "ref_loss": round(ref_loss, 4),
                      "valid_rows": int((y != IGNORE).sum())}
            if cool or kind in args.time_kinds.split(","):
                fl, fl_cool = matmul_floor(h, w, y, args.iters, args.warmup, cool)
                rows.append({**common, "method": "floor: the 3 matrix products alone",
                             "ms": round(fl, 2), "ms_after_idle": round(fl_cool, 2) if cool else None})
                print(json.dumps(rows[-1]), flush=True)
            # What any method returning bf16 gradients loses: the reference rounded to bf16.
            rows.append({**common, "method": "bound: the fp32 reference's gradients rounded to bf16",
                         "err_grad_hidden": rel_l2(ref_gh.bfloat16(), ref_gh),
                         "err_grad_weight": rel_l2(ref_gw.bfloat16(), ref_gw)})
            print(json.dumps(rows[-1]), flush=True)
            torch.cuda.empty_cache()
            for name in args.methods.split(","):
                if name in variants and not cool:
                    continue
                label, fn = METHODS[name]
                row = {**common, "method": label}
                try:
                    timed = cool or kind in args.time_kinds.split(",")
                    ms, peak, (gh, gw, loss), retain_ok, retain_err = bench_one(
                        fn, h, w, y, args.iters if timed else 0, args.warmup if timed else 1)
                    row.update(ms=None if ms is None else round(ms, 2), peak_extra_gib=round(peak / 1024**3, 3),
                               err_grad_hidden=rel_l2(gh, ref_gh), err_grad_weight=rel_l2(gw, ref_gw),
                               err_loss=abs(loss - ref_loss) / abs(ref_loss),
                               retain_graph_second_backward_ok=retain_ok, retain_err=retain_err)
                    if cool:
                        row["ms_after_idle"] = round(cool_ms(fn, h, w, y), 2)
                except ImportError as e:
                    row.update(skipped=f"not installed: {e.name}")
                except torch.OutOfMemoryError:
                    row.update(skipped="out of memory")
                except Exception as e:  # a broken method must not cost the others' numbers
                    row.update(skipped=f"error: {type(e).__name__}: {str(e).splitlines()[0][:80]}")
                rows.append(row)
                print(json.dumps(row), flush=True)
                gh = gw = None
                torch.cuda.empty_cache()
            del h, w, y, ref_gh, ref_gw
            torch.cuda.empty_cache()
    meta = {
        "date": time.strftime("%Y-%m-%d"),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "command": " ".join(sys.argv),
    }
    for mod in ("triton", "torchtune", "liger_kernel", "cut_cross_entropy"):
        try:
            m = __import__(mod)
            meta[mod] = getattr(m, "__version__", "installed")
        except ImportError:
            meta[mod] = "not installed"
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print("\n| N x D | kind | method | ms | ms after idle | extra GiB | err gh | err gw | retain x2 |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        idle = r.get("ms_after_idle") or ""
        head = f"| {r['N']}x{r['D']} | {r['kind']} | {r['method'][:44]} |"
        if "skipped" in r:
            print(f"{head} {r['skipped'][:60]} | | | | | |")
        elif "ms" not in r:
            print(f"{head} | | | {r['err_grad_hidden']:.2e} | {r['err_grad_weight']:.2e} | |")
        elif "peak_extra_gib" not in r:
            print(f"{head} {r['ms']} | {idle} | loss {r['ref_loss']} | | | |")
        else:
            print(f"{head} {r['ms'] or '-'} | {idle} | {r['peak_extra_gib']} | "
                  f"{r['err_grad_hidden']:.2e} | {r['err_grad_weight']:.2e} | {r['retain_graph_second_backward_ok']} |")


if __name__ == "__main__":
    main()
