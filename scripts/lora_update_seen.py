"""How much of a small LoRA update a forward pass sees, in each precision and path.

A LoRA layer's output is ``base(x) + scale * B(A(x))``. torchtune's ``LoRALinear`` computes the
base output, rounds it to the run's dtype, then adds the adapter's output: in bf16 an adapter
delta under half a bf16 step of that output rounds away, so the first updates of a run
(``lora_b`` starts at zero, Adam moves it by about ``lr`` an element) are partly invisible to the
eager forward. Under torch.compile the sum is not rounded before the next fused operation (it is
where a product or attention reads it, e.g. ``v_proj``'s).

This script takes one Adam-like first step on ``lora_b`` (``-lr * sign(dL/dB)``, from the
gradient of a reference model in fp64; torchtune's RMSNorm and RoPE compute in fp32 inside it)
on a Llama-3.2 LoRA model of the 1B's widths and reports, for each seed:

- at every LoRA linear's output, eagerly, the share of the adapter's output change
  (``scale * B(A x)`` in fp64, on the layer's own input) that the rounded output keeps
  (``<out(B) - out(0), delta> / <delta, delta>``, summed over layers): a direct, low-noise reading;
- the model's loss change each path's forward sees, as a fraction of the fp64 reference's (one
  step's change is small next to bf16's rounding of a loss: read it over seeds).

    python scripts/lora_update_seen.py --lr 3e-6 [--seeds 3] [--layers 2] [--small] [--no-compile]

The recipes' own eager and compiled setups are used (``compile_or_lighten``). ``--small``: the
widths of a tiny model, for a quick look on a CPU. Results: docs/benchmarks.md.
"""

import argparse
import statistics

import torch
import torch.nn.functional as F
from torchtune.models.llama3_2._component_builders import lora_llama3_2
from torchtune.modules.peft import LoRALinear

from tune_recipes.training.setup.model import compile_or_lighten


def model_kwargs(small: bool, layers: int, vocab: int) -> dict:
    return dict(lora_attn_modules=["q_proj", "v_proj", "output_proj"], apply_lora_to_mlp=True,
                vocab_size=vocab, num_layers=layers, num_heads=4 if small else 32,
                num_kv_heads=2 if small else 8, embed_dim=256 if small else 2048, max_seq_len=4096,
                intermediate_dim=512 if small else 8192, lora_rank=8 if small else 64,
                lora_alpha=16 if small else 128, lora_dropout=0.0)


def one_seed(args, seed: int, device: str) -> dict:
    kwargs = model_kwargs(args.small, args.layers, args.vocab)
    torch.manual_seed(seed)
    reference = lora_llama3_2(**kwargs).double().to(device)
    tokens = torch.randint(0, args.vocab, (args.rows, args.seq_len), device=device)
    labels = torch.randint(0, args.vocab, tokens.shape, device=device)

    def loss_of(model):
        return F.cross_entropy(model(tokens).double().flatten(0, 1), labels.flatten())

    for name, p in reference.named_parameters():
        p.requires_grad_("lora_b" in name)
    loss_of(reference).backward()
    step = {n: -args.lr * torch.sign(p.grad) for n, p in reference.named_parameters() if "lora_b" in n}
    start = {k: v.detach().clone() for k, v in reference.state_dict().items()}

    def build(dtype, compiled: bool):
        model = lora_llama3_2(**kwargs).to(dtype)
        model.load_state_dict({k: v.to(dtype) for k, v in start.items()})
        model.to(device)
        if dtype != torch.float64:
            compile_or_lighten(model, compiled, None)
        return model

    def take_step(model, dtype):
        for name, p in model.named_parameters():
            if name in step:
                p.add_(step[name].to(dtype))

    def loss_change(dtype, compiled: bool) -> float:
        model = build(dtype, compiled)
        with torch.no_grad():
            before = loss_of(model).item()
            take_step(model, dtype)
            return loss_of(model).item() - before

    def kept_share(dtype) -> float:
        """Eagerly, at each LoRA linear's output: the share of the adapter's change kept."""
        model = build(dtype, False)
        inputs = {}
        hooks = [m.register_forward_hook(lambda m, a, o, n=n: inputs.__setitem__(n, a[0].detach()))
                 for n, m in model.named_modules() if isinstance(m, LoRALinear)]
        with torch.no_grad():
            loss_of(model)
            for h in hooks:
                h.remove()
            kept = total = 0.0
            for name, module in model.named_modules():
                if name not in inputs:
                    continue
                x = inputs[name]
                before = module(x).double()
                b_step = step[f"{name}.lora_b.weight"]
                module.lora_b.weight.add_(b_step.to(dtype))
                after = module(x).double()
                delta = (module.alpha / module.rank) * F.linear(F.linear(x.double(), module.lora_a.weight.double()), b_step)
                kept += ((after - before) * delta).sum().item()
                total += (delta * delta).sum().item()
        return kept / total

    truth = loss_change(torch.float64, False)
    out = {"fp64 loss change": truth,
           "bf16 eager: kept at the LoRA outputs": kept_share(torch.bfloat16),
           "fp32 eager: kept at the LoRA outputs": kept_share(torch.float32),
           "fp32 eager: loss change / fp64's": loss_change(torch.float32, False) / truth,
           "bf16 eager: loss change / fp64's": loss_change(torch.bfloat16, False) / truth}
    if not args.no_compile:
        out["bf16 compiled: loss change / fp64's"] = loss_change(torch.bfloat16, True) / truth
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lr", type=float, default=3e-6, help="the step's size an element (Adam's first step)")
    ap.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1: model, tokens and labels")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--small", action="store_true", help="tiny widths")
    ap.add_argument("--no-compile", action="store_true", help="skip the compiled bf16 path")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    runs = [one_seed(args, seed, device) for seed in range(args.seeds)]
    print("| reading (lr %g, %d seeds) | mean | sd | each |\n|---|---|---|---|" % (args.lr, args.seeds))
    for key in runs[0]:
        values = [r[key] for r in runs]
        sd = statistics.stdev(values) if len(values) > 1 else 0.0
        print(f"| {key} | {statistics.mean(values):.4g} | {sd:.2g} | {' '.join(f'{v:.4g}' for v in values)} |",
              flush=True)


if __name__ == "__main__":
    main()
