"""Which SDPA kernel for causal attention at the issue #15 shapes (the 1B step spends 12.8 ms in
cuDNN's, s13prof): cuDNN (what torch picks on the H200), torch's built-in flash kernel, and
FlashAttention-4 through torch's flash-impl registry (``activate_flash_attention_impl("FA4")``,
package flash-attn-4; its wheels: scripts/fa4_wheels.sh).

Inputs as torchtune's attention passes them: [batch, heads, seq, head_dim] bf16, the key/value
heads already expanded to the query heads (GQA), ``is_causal=True``. Each backend runs in its
own process (activating FA4 replaces the flash kernels for the whole process). Timing: CUDA
events around forward and backward, median of ``--iters`` after warm-up. Check: output and
gradients against fp32 math SDPA of the same inputs, relative L2 error (bf16 kernels land at
~3e-3; a wrong kernel at ~1).

    python3 scripts/bench_attention.py --out results/attention.json
    python3 scripts/bench_attention.py --backends math --shapes tiny --device cpu   # smoke test
"""

import argparse
import json
import statistics
import subprocess
import sys

import torch
import torch.nn.functional as F

# name: (batch, heads, seq, head_dim, layers a step)
SHAPES = {"llama3.2-1b": (4, 32, 2048, 64, 16), "llama3.1-8b": (2, 32, 2048, 128, 32),
          "tiny": (1, 2, 64, 16, 1)}
BACKENDS = ("cudnn", "flash", "fa4")


def _select(backend: str):
    """The context that makes SDPA use ``backend`` (FA4: activated first, then the flash path)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if backend == "fa4":
        from torch.nn.attention import activate_flash_attention_impl

        activate_flash_attention_impl("FA4")
    chosen = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
              "fa4": SDPBackend.FLASH_ATTENTION, "math": SDPBackend.MATH}[backend]
    return sdpa_kernel([chosen])


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().double() - b.detach().double()).norm() / b.detach().double().norm())


def run_one(backend: str, shape: str, iters: int, device: str) -> dict:
    b, h, s, d, layers = SHAPES[shape]
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(b, h, s, d, device=device, dtype=dtype, generator=gen).requires_grad_()
               for _ in range(3))
    go = torch.randn(b, h, s, d, device=device, dtype=dtype, generator=gen)
    with _select(backend):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        grads = torch.autograd.grad(out, (q, k, v), go)
    # The reference: fp32 math SDPA of the same (rounded) inputs.
    ref_in = [t.detach().float().requires_grad_() for t in (q, k, v)]
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.MATH]):
        ref = F.scaled_dot_product_attention(*ref_in, is_causal=True)
        ref_grads = torch.autograd.grad(ref, ref_in, go.float())
    row = {"backend": backend, "shape": shape, "out_rel_err": _rel(out, ref),
           "grad_rel_err": max(_rel(g, r) for g, r in zip(grads, ref_grads))}
    try:  # which flash implementation is active (FA4 falls back to torch's where it cannot run)
        from torch.nn.attention import current_flash_attention_impl

        row["flash_impl"] = current_flash_attention_impl()
    except ImportError:
        row["flash_impl"] = "n/a (this torch has no flash-impl registry)"
    if device == "cuda":
        fwd, bwd = [], []
        with _select(backend):
            for i in range(iters + 5):
                e = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
                e[0].record()
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
                e[1].record()
                torch.autograd.grad(out, (q, k, v), go)
                e[2].record()
                torch.cuda.synchronize()
                if i >= 5:
                    fwd.append(e[0].elapsed_time(e[1]))
                    bwd.append(e[1].elapsed_time(e[2]))
        row.update(fwd_ms=statistics.median(fwd), bwd_ms=statistics.median(bwd))
        row["step_ms"] = (row["fwd_ms"] + row["bwd_ms"]) * layers  # one step's layers
        # Causal attention FLOPs: forward 2 products of b*h*s*s*d, halved by the mask; backward 2.5x.
        flops = 4 * b * h * s * s * d / 2
        row["fwd_tflops"] = flops / row["fwd_ms"] / 1e9
        row["bwd_tflops"] = 2.5 * flops / row["bwd_ms"] / 1e9
        row.update(device_name=torch.cuda.get_device_name(), torch=torch.__version__)
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="attention.json")
    ap.add_argument("--shapes", default="llama3.2-1b,llama3.1-8b")
    ap.add_argument("--backends", default=",".join(BACKENDS))
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # backend:shape, in a child
    args = ap.parse_args()
    if args.one:
        backend, shape = args.one.split(":")
        print(json.dumps(run_one(backend, shape, args.iters, args.device)))
        return
    rows = []
    for shape in args.shapes.split(","):
        for backend in args.backends.split(","):
            proc = subprocess.run([sys.executable, __file__, "--one", f"{backend}:{shape}", "--iters",
                                   str(args.iters), "--device", args.device],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
            if proc.returncode or not lines:
                print(f"{shape} {backend}: failed (rc {proc.returncode}) {proc.stderr[-1500:]}", flush=True)
                continue
            rows.append(json.loads(lines[-1]))
            print(lines[-1], flush=True)
            with open(args.out, "w") as fh:  # after every run: a timeout keeps the rows
                json.dump(rows, fh, indent=1)
    print("| shape | backend | forward ms | backward ms | a step's layers ms | fwd / bwd TFLOP/s | "
          "rel. error out / grads |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        timing = (f"{r['fwd_ms']:.3f} | {r['bwd_ms']:.3f} | {r['step_ms']:.1f} | "
                  f"{r['fwd_tflops']:.0f} / {r['bwd_tflops']:.0f}") if "fwd_ms" in r else "| | |"
        print(f"| {r['shape']} | {r['backend']} | {timing} | {r['out_rel_err']:.1e} / {r['grad_rel_err']:.1e} |")


if __name__ == "__main__":
    main()
