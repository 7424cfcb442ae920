"""What a LoRA transformer layer keeps for backward, per token and layer, by shape and dtype
(CPU; issue #15's memory work).

A small Llama (dims multiples of 16: the FP8 base runs emulated on the CPU) with LoRA on
q/v/output and the MLP, bf16, each layer compiled as the recipe compiles it (``--compile``;
Inductor's CPU backend makes the same save-or-recompute choices as on a GPU); one forward
under ``torch.autograd.graph.saved_tensors_hooks`` counts every saved storage once, leaving out
parameters and buffers. Divide by the layer's widths to read which activations they are
(e.g. at --dim 256 --hidden 896: 1792 bytes a token are one [tokens, hidden] bf16 tensor).

    python3 scripts/saved_bytes_per_layer.py --fp8 --compile
    python3 scripts/saved_bytes_per_layer.py --fp8 --fp8-adapter-inputs --compile
"""

import argparse
import collections

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=896)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=320, help="one sequence of this length")
    parser.add_argument("--fp8", action="store_true", help="enable_fp8_training (emulated)")
    parser.add_argument("--fp8-adapter-inputs", action="store_true")
    parser.add_argument("--compile", action="store_true", help="each layer, as the recipe")
    args = parser.parse_args()

    from torchtune import training
    from torchtune.models.llama3 import lora_llama3

    from tune_recipes.modules.fp8_lora import convert_lora_to_fp8

    torch.manual_seed(0)
    with training.set_default_dtype(torch.bfloat16):
        model = lora_llama3(lora_attn_modules=["q_proj", "v_proj", "output_proj"],
                            apply_lora_to_mlp=True, vocab_size=512, num_layers=args.layers,
                            num_heads=args.dim // 64, num_kv_heads=1, embed_dim=args.dim,
                            max_seq_len=args.tokens, intermediate_dim=args.hidden, lora_rank=8,
                            lora_alpha=16)
    for name, p in model.named_parameters():
        p.requires_grad_("lora" in name)
    if args.fp8:
        convert_lora_to_fp8(model, emulate=True, fp8_adapter_inputs=args.fp8_adapter_inputs)
    if args.compile:
        training.compile_model(model, verbose=False)
    tokens = torch.randint(0, 512, (1, args.tokens))
    seen = {}

    def pack(t):
        seen.setdefault(t.untyped_storage().data_ptr(),
                        (tuple(t.shape), t.dtype, t.untyped_storage().nbytes()))
        return t

    for _ in range(2):  # the second pass: compiled, nothing left to trace
        seen.clear()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = model(tokens)
        out.float().sum().backward()
    params = {t.untyped_storage().data_ptr() for t in list(model.parameters()) + list(model.buffers())}
    per = collections.Counter()
    for ptr, (shape, dtype, nbytes) in seen.items():
        if ptr not in params:
            per[(shape, str(dtype).replace("torch.", ""))] += nbytes / args.tokens / args.layers
    print(f"dim {args.dim}, hidden {args.hidden}, fp8 {args.fp8}, fp8_adapter_inputs "
          f"{args.fp8_adapter_inputs}, compile {args.compile}: {sum(per.values()):.0f} bytes saved "
          "per token and layer")
    for (shape, dtype), nbytes in sorted(per.items(), key=lambda kv: -kv[1]):
        print(f"  {nbytes:8.1f}  {dtype:14s} {shape}")


if __name__ == "__main__":
    main()
