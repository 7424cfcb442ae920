"""What a compiled Llama layer stack keeps for its backward, by tensor: torch.compile's
partitioner decides which forward values are saved and which the backward recomputes, and
``activation_memory_budget`` moves that choice. This runs Llama-3.2's layers (the 1B's widths by
default, a few layers, random weights, bf16) compiled on the CPU, each MLP recomputing its down
projection's input in backward as the recipes' compiled full fine-tunes do
(``tune_recipes.modules.swiglu_down``), records every tensor the compiled forward saves
(``torch.autograd.graph.saved_tensors_hooks``) and prints the activation bytes a token a layer
and the saved tensors by shape.

    python3 scripts/saved_activations.py                    # torch's default partition
    python3 scripts/saved_activations.py --budget 0.7       # activation_memory_budget=0.7
    python3 scripts/saved_activations.py --torchtune-mlp    # torchtune's MLP (its product saved)

The partition is made on the joint forward-backward graph before code generation, so a GPU's
follows the same rules, with two differences: the torch version installed here may not be the
GPU machine's, and attention here is SDPA on one causal row, which saves k and v copied to every
query head (torchtune's expansion), where over flash attention's document spans on a GPU k and v
are saved at their own head count.
"""

import argparse
import collections


def saved_activations(budget: float = 1.0, layers: int = 2, tokens: int = 512,
                      embed_dim: int = 2048, intermediate_dim: int = 8192,
                      num_heads: int = 32, num_kv_heads: int = 8, torchtune_mlp: bool = False) -> dict:
    """The forward's saved activations (parameters and buffers excluded) of ``layers`` compiled
    Llama-3.2 layers on one row of ``tokens`` tokens: total bytes, bytes a token a layer and a
    count by (shape, dtype). ``torchtune_mlp``: torchtune's MLP instead of the recipes'."""
    import torch
    import torch._functorch.config as functorch_config
    from torchtune.models.llama3_2._component_builders import llama3_2

    torch.manual_seed(0)
    model = llama3_2(vocab_size=1024, num_layers=layers, num_heads=num_heads, num_kv_heads=num_kv_heads,
                     embed_dim=embed_dim, max_seq_len=max(tokens, 2048), intermediate_dim=intermediate_dim,
                     attn_dropout=0.0, norm_eps=1e-5, rope_base=500000, scale_factor=32,
                     tie_word_embeddings=True).to(torch.bfloat16)
    if not torchtune_mlp:
        from tune_recipes.modules.swiglu_down import recompute_down_inputs

        recompute_down_inputs(model)

    def body(x):  # the layers and the final norm: the fused loss owns the output projection
        h = model.tok_embeddings(x)
        for layer in model.layers:
            h = layer(h)
        return model.norm(h)

    saved = {}

    def pack(t):
        saved[t.data_ptr()] = (tuple(t.shape), str(t.dtype).removeprefix("torch."), t.numel() * t.element_size())
        return t

    torch._dynamo.reset()
    with functorch_config.patch(activation_memory_budget=budget), \
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = torch.compile(body)(torch.randint(0, 1024, (1, tokens)))
    out.float().pow(2).mean().backward()  # the saved tensors are used, as in training
    state = {t.data_ptr() for t in (*model.parameters(), *model.buffers())}  # weights, RoPE cache
    activations = [v for ptr, v in saved.items() if ptr not in state]
    total = sum(v[2] for v in activations)
    by_shape = collections.Counter((v[0], v[1]) for v in activations)
    return {"budget": budget, "torchtune_mlp": torchtune_mlp, "bytes": total, "bytes_per_token_per_layer": total / tokens / layers,
            "by_shape": sorted(by_shape.items(), key=lambda kv: -kv[1])}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--budget", type=float, default=1.0, help="activation_memory_budget (1.0: torch's default)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--torchtune-mlp", action="store_true",
                    help="torchtune's MLP, whose compiled graph saves the down projection's input")
    args = ap.parse_args(argv)
    if not 0.0 < args.budget <= 1.0:
        ap.error(f"--budget {args.budget}: activation_memory_budget is a fraction in (0, 1]")
    if args.layers < 1 or args.tokens < 1:
        ap.error("--layers and --tokens take positive counts")
    result = saved_activations(args.budget, args.layers, args.tokens, torchtune_mlp=args.torchtune_mlp)
    mlp = "torchtune's MLP" if args.torchtune_mlp else "the recipes' MLP"
    print(f"activation_memory_budget {result['budget']}, {mlp}: {result['bytes'] / 1e6:.1f} MB saved, "
          f"{result['bytes_per_token_per_layer'] / 1e3:.1f} KB a token a layer")
    for (shape, dtype), count in result["by_shape"]:
        print(f"  {count} x {list(shape)} {dtype}")


if __name__ == "__main__":
    main()
