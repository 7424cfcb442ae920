"""What ``fp8_mlp_activations`` costs per MLP in a full fine-tune (issue #15, the 1B case).

One Llama MLP (gate, up, down; torchao float8 tensorwise with fast accumulation in backward, as
the 1B bench's best runs it), compiled, forward + backward at the real shape. Variants:

- ``torchao``: torchtune's FeedForward with Float8Linear children (what the recipe runs without
  the key; compile keeps g and u in bf16 for backward),
- ``rows``: FP8SavedFeedForward, g and u kept in e4m3 with one scale per token (the key's
  session-12 form),
- ``tensor``: the same with one scale per tensor.

Each variant runs in its own process (``--code-dir``: inductor's generated code is written
there, to see which kernels a cost comes from). Timing: CUDA events around each forward and
backward, median of ``--iters`` after warm-up. Memory: the bytes the forward leaves allocated
for backward (output excluded).

    python3 scripts/bench_fp8_mlp.py --out results/fp8_mlp.json --code-dir results/fp8_mlp_code
"""

import argparse
import json
import os
import statistics
import subprocess
import sys

import torch

SHAPES = {"llama3.2-1b": (2048, 8192, 4, 2048), "llama3.1-8b": (4096, 14336, 2, 2048)}
VARIANTS = ("torchao", "rows", "tensor")


def build(variant: str, dim: int, hidden: int) -> torch.nn.Module:
    from torchtune.models.llama3._component_builders import llama3_mlp

    from tune_recipes.modules.fp8_mlp import FP8SavedFeedForward
    from tune_recipes.training.setup.fp8 import convert_to_fp8

    torch.manual_seed(0)
    mlp = llama3_mlp(dim, hidden).to(device="cuda", dtype=torch.bfloat16)
    for p in mlp.parameters():
        torch.nn.init.normal_(p, std=0.02)
    convert_to_fp8(mlp, "tensorwise", module_filter=lambda m, fqn: isinstance(m, torch.nn.Linear),
                   fast_accum_backward=True)
    if variant != "torchao":
        mlp = FP8SavedFeedForward(mlp, per_row=variant == "rows")
    return mlp


def run_one(variant: str, shape: str, iters: int) -> dict:
    dim, hidden, batch, seq = SHAPES[shape]
    mlp = torch.compile(build(variant, dim, hidden))
    x = torch.randn(batch, seq, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    go = torch.randn(batch, seq, dim, device="cuda", dtype=torch.bfloat16)
    fwd, bwd = [], []
    for i in range(iters + 5):
        x.grad = None  # every backward writes fresh gradients (no accumulation pass timed)
        for p in mlp.parameters():
            p.grad = None
        e = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
        e[0].record()
        out = mlp(x)
        e[1].record()
        out.backward(go)
        e[2].record()
        torch.cuda.synchronize()
        if i >= 5:
            fwd.append(e[0].elapsed_time(e[1]))
            bwd.append(e[1].elapsed_time(e[2]))
    x.grad = None
    for p in mlp.parameters():
        p.grad = None
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    out = mlp(x)
    torch.cuda.synchronize()
    saved = torch.cuda.memory_allocated() - before - out.numel() * out.element_size()
    return {"variant": variant, "shape": shape, "fwd_ms": statistics.median(fwd),
            "bwd_ms": statistics.median(bwd), "saved_gib": saved / 2**30,
            "device": torch.cuda.get_device_name(), "torch": torch.__version__}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="fp8_mlp.json")
    ap.add_argument("--shapes", default="llama3.2-1b")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--code-dir", default=None, help="write each variant's inductor code here")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # variant:shape, in a child
    args = ap.parse_args()
    if args.one:
        variant, shape = args.one.split(":")
        print(json.dumps(run_one(variant, shape, args.iters)))
        return
    rows = []
    for shape in args.shapes.split(","):
        for variant in args.variants.split(","):
            env = dict(os.environ)
            code = None
            if args.code_dir:
                os.makedirs(args.code_dir, exist_ok=True)
                env["TORCH_LOGS"] = "output_code"
                code = open(os.path.join(args.code_dir, f"{shape}_{variant}.txt"), "w")
            proc = subprocess.run([sys.executable, __file__, "--one", f"{variant}:{shape}",
                                   "--iters", str(args.iters)], env=env, stdout=subprocess.PIPE,
                                  stderr=code or subprocess.PIPE, text=True)
            if code:
                code.close()
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
            if proc.returncode or not lines:
                err = proc.stderr if not code else open(code.name).read()  # stderr went there
                print(f"{shape} {variant}: failed (rc {proc.returncode}) {(err or '')[-1500:]}")
                continue
            rows.append(json.loads(lines[-1]))
            with open(args.out, "w") as fh:  # after every variant: a timeout keeps the rows
                json.dump(rows, fh, indent=1)
            print(json.dumps(rows[-1]), flush=True)
    print("| shape | variant | forward ms | backward ms | fwd+bwd ms | saved for backward GiB |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['shape']} | {r['variant']} | {r['fwd_ms']:.3f} | {r['bwd_ms']:.3f} | "
              f"{r['fwd_ms'] + r['bwd_ms']:.3f} | {r['saved_gib']:.3f} |")


if __name__ == "__main__":
    main()
