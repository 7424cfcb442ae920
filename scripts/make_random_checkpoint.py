"""Write a random-init HF-format checkpoint with a real model's shapes (for GPU benchmarks on
machines that cannot download weights).

    python3 scripts/make_random_checkpoint.py --builder torchtune.models.llama3_2.llama3_2_1b --out /tmp/rand_1b
"""

import argparse
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from torchtune import training  # noqa: E402
from torchtune.models import convert_weights  # noqa: E402

from tune_recipes.config import resolve_component  # noqa: E402


def write_random_checkpoint(builder: str, out, dtype_name: str = "bf16") -> Path:
    """Random-init weights of ``builder``'s real shapes, in HF layout (Llama or Qwen2 names by
    the builder's family), with a config.json that torchtune's HF checkpointer reads."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype_name]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    with training.set_default_dtype(dtype), torch.device(device):
        model = resolve_component(builder)()
        # Small normal init (as the tiny model): a sane initial loss (~log V) instead of the
        # huge logits of the default init at these widths.
        for p in model.parameters():
            if p.dim() >= 2:
                torch.nn.init.normal_(p, std=0.02)
    layer = model.layers[0]
    attn = layer.attn
    num_heads, num_kv_heads, head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
    dim = attn.embed_dim
    num_layers = len(model.layers)
    tied = "output.weight" not in model.state_dict()
    sd = {k: v.detach().to("cpu").contiguous() for k, v in model.state_dict().items()}
    del model
    qwen = "qwen" in builder
    if qwen:
        from torchtune.models.qwen2._convert_weights import qwen2_tune_to_hf

        hf = qwen2_tune_to_hf(sd, num_heads=num_heads, num_kv_heads=num_kv_heads, dim=dim,
                              head_dim=head_dim, tie_word_embeddings=tied)
    else:
        hf = convert_weights.tune_to_hf(sd, num_heads=num_heads, num_kv_heads=num_kv_heads,
                                        dim=dim, head_dim=head_dim)
    save_file({k: v.contiguous() for k, v in hf.items()}, out / "model.safetensors",
              metadata={"format": "pt"})
    vocab = sd["tok_embeddings.weight"].shape[0]
    config = {
        "architectures": ["Qwen2ForCausalLM" if qwen else "LlamaForCausalLM"],
        "model_type": "qwen2" if qwen else "llama",
        "hidden_size": dim, "num_attention_heads": num_heads, "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim, "num_hidden_layers": num_layers, "vocab_size": vocab,
        "tie_word_embeddings": tied, "torch_dtype": "bfloat16" if dtype == torch.bfloat16 else "float32",
    }
    (out / "config.json").write_text(json.dumps(config, indent=2))
    n = sum(v.numel() for v in sd.values())
    print(f"wrote {n / 1e9:.2f}B random parameters ({builder}) to {out}", flush=True)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--builder", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--dtype", default="bf16")
    args = ap.parse_args()
    write_random_checkpoint(args.builder, args.out, args.dtype)


if __name__ == "__main__":
    main()
