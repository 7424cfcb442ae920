"""Llama-3.1-8B-shaped LoRA layers alone, compiled, forward + backward: time and memory of the
ways ``lora_finetune_single_device`` can run its frozen base and adapters (issue #15).

Each variant builds ``--layers`` transformer layers of the 8B shape (LoRA rank 8 on q/v/output
and the MLP, as configs/llama3_1/8B_lora_single_device.yaml), random weights in bf16, each layer
compiled as the recipe compiles it, and times ``--iters`` forward + backward passes of a
[batch, seq, 4096] input that requires grad (a middle layer's view) between CUDA events, after
``--warmup`` passes. Memory: the peak allocated during the timed passes, minus what was allocated
before them (weights, input): the activations a pass keeps for backward, plus its temporaries.

Variants:
  bf16          torchtune's LoRALinear, bf16 base (what stock runs)
  fp8           enable_fp8_training: frozen base products in FP8 (FP8LoRALinear)
  fp8_inputs    + fp8_adapter_inputs: the adapters' weight gradients from the base's e4m3 input
  fp8_inputs_t  + every layer's FP8 weights also stored transposed (fp8_transposed_weight_layers):
                backward's column-major operand without a transpose copy

(Commit 21eff57's version also timed the adapters' second products computed inside the adding
kernel, a multiply-sum over the rank: 8.71 ms a layer against 5.61 on an H200, 2026-12-01.)

    python3 scripts/bench_lora_layer.py --out /tmp/lora_layer.json
"""

import argparse
import json
import time

import torch


def build(args, variant: str):
    from torchtune import training
    from torchtune.models.llama3_1._component_builders import lora_llama3_1

    from tune_recipes.modules import fp8_lora

    torch.manual_seed(0)
    with training.set_default_dtype(torch.bfloat16), torch.device(args.device):
        model = lora_llama3_1(
            lora_attn_modules=["q_proj", "v_proj", "output_proj"], apply_lora_to_mlp=True,
            apply_lora_to_output=False, vocab_size=256, num_layers=args.layers,
            num_heads=args.dim // 128, num_kv_heads=args.dim // 512, embed_dim=args.dim,
            max_seq_len=args.seq, intermediate_dim=args.hidden, lora_rank=8, lora_alpha=16,
            lora_dropout=0.0)
    for name, p in model.named_parameters():
        p.requires_grad_("lora_" in name)
        if "lora_b" in name:
            torch.nn.init.normal_(p, std=0.02)
    if variant != "bf16":
        fp8_lora.convert_lora_to_fp8(model, emulate=args.device == "cpu",
                                     fp8_adapter_inputs=variant.startswith("fp8_inputs"),
                                     transposed_weight_layers=args.layers if variant.endswith("_t") else 0)
    layers = list(model.layers)
    for layer in layers:
        layer.compile()
    return model, layers


def run(args, variant: str) -> dict:
    model, layers = build(args, variant)
    x = torch.randn(args.batch, args.seq, args.dim, device=args.device, dtype=torch.bfloat16,
                    requires_grad=True)
    cuda = args.device == "cuda"
    grad = torch.randn_like(x)

    def step():
        h = x
        for layer in layers:
            h = layer(h)
        h.backward(grad)

    for _ in range(args.warmup):
        step()
    if cuda:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    t0 = time.perf_counter()
    for _ in range(args.iters):
        step()
    if cuda:
        end.record()
        torch.cuda.synchronize()  # NOTE: before reading either clock: the passes are queued
        ms = start.elapsed_time(end) / args.iters
        peak = (torch.cuda.max_memory_allocated() - base) / 2**30
    else:  # the CPU smoke run (--device cpu): wall clock, no memory figure
        ms, peak = (time.perf_counter() - t0) * 1e3 / args.iters, float("nan")
    tokens = args.batch * args.seq
    row = dict(variant=variant, layers=args.layers, tokens=tokens, ms_per_pass=round(ms, 3),
               ms_per_layer=round(ms / args.layers, 3), pass_gib=round(peak, 3),
               gib_per_layer=round(peak / args.layers, 4))
    del model, layers, x, grad
    torch._dynamo.reset()
    if cuda:
        torch.cuda.empty_cache()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default="bf16,fp8,fp8_inputs,fp8_inputs_t")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dim", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=14336)
    parser.add_argument("--device", default="cuda", help="cpu: a smoke run (FP8 emulated)")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rows = []
    for rep in range(args.reps):
        order = args.variants.split(",")
        for variant in (order if rep % 2 == 0 else order[::-1]):
            t0 = time.time()
            row = run(args, variant)
            row.update(rep=rep, wall_s=round(time.time() - t0, 1))
            print(json.dumps(row), flush=True)
            rows.append(row)
    meta = dict(date=time.strftime("%Y-%m-%d"), torch=torch.__version__, args=vars(args),
                gpu=torch.cuda.get_device_name() if args.device == "cuda" else "cpu")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)
    print("| variant | ms per layer (each rep) | GiB per layer (each rep) |")
    print("|---|---|---|")
    for variant in args.variants.split(","):
        mine = [r for r in rows if r["variant"] == variant]
        print(f"| {variant} | {' / '.join(str(r['ms_per_layer']) for r in mine)} | "
              f"{' / '.join(str(r['gib_per_layer']) for r in mine)} |")


if __name__ == "__main__":
    main()
