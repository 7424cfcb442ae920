"""How much of a small LoRA update a forward pass sees, in each precision and path.

A LoRA layer's output is ``base(x) + scale * B(A(x))``. In bf16 the base output is rounded to
bf16 before the add, so an adapter delta below half a bf16 step of that output rounds away: the
first updates of a run (``lora_b`` starts at zero, Adam moves it by about ``lr`` an element) are
partly invisible to the eager forward. torch.compile adds the delta inside a fused kernel in
fp32, before anything rounds it. This script takes one Adam-like first step on ``lora_b``
(``-lr * sign(dL/dB)``, computed in fp64) on a Llama-3.2 LoRA model of the 1B's widths and
reports the loss change each path's forward sees, as a fraction of fp64's.

    python scripts/lora_update_seen.py --lr 3e-6 [--layers 2] [--small] [--no-compile]

The recipes' own eager and compiled setups are used (``compile_or_lighten``). ``--small``: the
widths of a tiny model, for a quick look on a CPU. Results: docs/benchmarks.md.
"""

import argparse

import torch
import torch.nn.functional as F
from torchtune.models.llama3_2._component_builders import lora_llama3_2

from tune_recipes.training.setup.model import compile_or_lighten


def model_kwargs(small: bool, layers: int, vocab: int) -> dict:
    return dict(lora_attn_modules=["q_proj", "v_proj", "output_proj"], apply_lora_to_mlp=True,
                vocab_size=vocab, num_layers=layers, num_heads=4 if small else 32,
                num_kv_heads=2 if small else 8, embed_dim=256 if small else 2048, max_seq_len=4096,
                intermediate_dim=512 if small else 8192, lora_rank=8 if small else 64,
                lora_alpha=16 if small else 128, lora_dropout=0.0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lr", type=float, default=3e-6, help="the step's size an element (Adam's first step)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--small", action="store_true", help="tiny widths")
    ap.add_argument("--no-compile", action="store_true", help="skip the compiled bf16 path")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    kwargs = model_kwargs(args.small, args.layers, args.vocab)
    torch.manual_seed(args.seed)
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

    def loss_change(dtype, compiled: bool) -> float:
        model = lora_llama3_2(**kwargs).to(dtype)
        model.load_state_dict({k: v.to(dtype) for k, v in start.items()})
        model.to(device)
        if dtype != torch.float64:
            compile_or_lighten(model, compiled, None)
        with torch.no_grad():
            before = loss_of(model).item()
            for name, p in model.named_parameters():
                key = name.replace("_orig_mod.", "")
                if key in step:
                    p.add_(step[key].to(dtype))
            return loss_of(model).item() - before

    truth = loss_change(torch.float64, False)
    print(f"| path | loss change | of fp64's |\n|---|---|---|\n| fp64 | {truth:.4e} | 1 |")
    paths = [("fp32 eager", torch.float32, False), ("bf16 eager", torch.bfloat16, False)]
    if not args.no_compile:
        paths.append(("bf16 compiled", torch.bfloat16, True))
    for label, dtype, compiled in paths:
        change = loss_change(dtype, compiled)
        print(f"| {label} | {change:.4e} | {change / truth:.3f} |", flush=True)


if __name__ == "__main__":
    main()
