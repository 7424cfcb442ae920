"""Time one optimizer step over a real model's parameter shapes (issue #15: the 1B step's
fused AdamW took 8.5 ms of 115 in the session-10 profile, ~2 TB/s of the H200's ~4.8).

    python3 scripts/bench_optimizer_step.py --builder torchtune.models.llama3_2.llama3_2_1b
    python3 scripts/bench_optimizer_step.py --device cpu --builder tune_recipes.models.tiny.tiny_llama3_2  # smoke

Variants (``--variants``, comma-separated):
  fused      torch.optim.AdamW(fused=True): what the recipes run (the baseline)
  foreach    torch.optim.AdamW(foreach=True)
  compiled   torch.compile of a foreach AdamW's step (Inductor fuses it into a few kernels)
  ao8bit     torchao.optim.AdamW8bit (8-bit states: less memory and traffic, other numerics)

Parameters and gradients are random, in the model's dtype (bf16 by default), states as the
optimizer makes them. Each variant's step is timed with CUDA events over ``--steps`` steps after
``--warmup`` (the compile happens there); on the CPU with a wall clock (a smoke, not a number).
Also printed: the states' bytes, the bytes a step must at least read and write (parameters,
gradients and states read, parameters and states written) and the bandwidth that implies.
Results as JSON with ``--out``.
"""

import argparse
import json
import time

import torch
from torchtune import config as tt_config
from omegaconf import OmegaConf


def model_shapes(builder: str):
    with torch.device("meta"):
        model = tt_config.instantiate(OmegaConf.create({"_component_": builder}))
    return [p.shape for p in model.parameters()]


def make_optimizer(variant: str, params, lr: float):
    if variant == "fused":
        return torch.optim.AdamW(params, lr=lr, fused=True), None
    if variant == "foreach":
        return torch.optim.AdamW(params, lr=lr, foreach=True), None
    if variant == "compiled":
        # lr as a tensor: a float lr that a scheduler changes would recompile every step.
        opt = torch.optim.AdamW(params, lr=torch.tensor(lr, device=params[0].device), foreach=True,
                                capturable=True)
        return opt, torch.compile(opt.step)
    if variant == "ao8bit":
        from torchao.optim import AdamW8bit

        return AdamW8bit(params, lr=lr), None
    raise SystemExit(f"--variants: unknown variant {variant!r}")


def state_bytes(opt) -> int:
    total = 0
    for state in opt.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor):
                # torchao's 8-bit states are tensor subclasses: count what they hold.
                inner = getattr(v, "__tensor_flatten__", None)
                if inner is not None and type(v) is not torch.Tensor:
                    names, _ = v.__tensor_flatten__()
                    total += sum(getattr(v, n).numel() * getattr(v, n).element_size() for n in names)
                else:
                    total += v.numel() * v.element_size()
    return total


def time_variant(variant, shapes, device, dtype, steps, warmup, lr):
    gen = torch.Generator(device=device).manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen, device=device, dtype=dtype) * 0.02)
              for s in shapes]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen, device=device, dtype=dtype) * 1e-3
    opt, step = make_optimizer(variant, params, lr)
    step = step or opt.step
    t_compile = time.perf_counter()
    for _ in range(warmup):
        step()
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
    warm_s = time.perf_counter() - t_compile
    if cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(steps):
            step()
        end.record()
        end.synchronize()
        ms = start.elapsed_time(end) / steps
    else:
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        ms = (time.perf_counter() - t0) * 1e3 / steps
    n = sum(p.numel() for p in params)
    states = state_bytes(opt)
    elem = params[0].element_size()
    # Read p, g and the states; write p and the states.
    moved = n * elem * 3 + 2 * states
    row = {"variant": variant, "ms_per_step": round(ms, 3), "warmup_s": round(warm_s, 1),
           "params": n, "tensors": len(params), "state_gib": round(states / 2**30, 3),
           "min_bytes_gib": round(moved / 2**30, 2), "implied_tb_per_s": round(moved / ms / 1e9, 2)}
    del opt, params
    if cuda:
        torch.cuda.empty_cache()
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--builder", default="torchtune.models.llama3_2.llama3_2_1b")
    ap.add_argument("--variants", default="fused,foreach,compiled,ao8bit")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    device = torch.device(args.device)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    shapes = model_shapes(args.builder)
    rows = []
    for variant in args.variants.split(","):
        try:
            rows.append(time_variant(variant, shapes, device, dtype, args.steps, args.warmup, args.lr))
        except Exception as e:  # one variant failing (e.g. torchao's on this torch) keeps the rest
            rows.append({"variant": variant, "error": f"{type(e).__name__}: {e}"[:300]})
        print(json.dumps(rows[-1]), flush=True)
    print("| variant | ms per step | state GiB | min traffic GiB | implied TB/s |")
    print("|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['variant']} | error: {r['error'][:80]} | | | |")
        else:
            print(f"| {r['variant']} | {r['ms_per_step']} | {r['state_gib']} | {r['min_bytes_gib']} | "
                  f"{r['implied_tb_per_s']} |")
    if args.out:
        meta = {"torch": torch.__version__, "builder": args.builder, "dtype": args.dtype,
                "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
