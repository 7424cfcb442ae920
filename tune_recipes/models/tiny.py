"""A tiny Llama-3-architecture model and a deterministic HF-format checkpoint for it.

Nothing is downloaded: ``build_tiny_llama3_checkpoint`` writes ``config.json`` and
``model.safetensors`` from a fixed seed, so every machine builds byte-identical weights.
"""

import json
import os
import tempfile
from pathlib import Path
from typing import List, Optional, Union

import torch
from safetensors.torch import save_file
from torchtune.models import convert_weights
from torchtune.models.llama3 import llama3, lora_llama3
from torchtune.modules import TransformerDecoder

from tune_recipes.data.tiny import TINY_VOCAB_SIZE

TINY_LLAMA3_ARGS = dict(
    vocab_size=TINY_VOCAB_SIZE,
    num_layers=2,
    # dim 256 with 8 query / 2 KV heads: small, GQA, and every projection's size is a multiple
    # of 64 x 256, which NF4 (QLoRA) quantization requires.
    num_heads=8,
    num_kv_heads=2,
    embed_dim=256,
    intermediate_dim=512,
    max_seq_len=512,
    norm_eps=1e-5,
    rope_base=500_000,
)
TINY_CHECKPOINT_SEED = 0
# Bump when the builder's output would change, so stale caches are rebuilt.
TINY_CHECKPOINT_VERSION = 2


def tiny_llama3() -> TransformerDecoder:
    """2 layers, dim 256, GQA 8/2 heads, untied output layer, vocabulary 272."""
    return llama3(**TINY_LLAMA3_ARGS)


def lora_tiny_llama3(
    lora_attn_modules: List[str],
    apply_lora_to_mlp: bool = False,
    apply_lora_to_output: bool = False,
    lora_rank: int = 8,
    lora_alpha: float = 16,
    lora_dropout: float = 0.0,
    use_dora: bool = False,
    quantize_base: bool = False,
) -> TransformerDecoder:
    """``tiny_llama3`` with LoRA (or DoRA, or QLoRA with ``quantize_base``) adapters."""
    return lora_llama3(
        lora_attn_modules=lora_attn_modules,
        apply_lora_to_mlp=apply_lora_to_mlp,
        apply_lora_to_output=apply_lora_to_output,
        lora_rank=lora_rank,
        lora_alpha=lora_alpha,
        lora_dropout=lora_dropout,
        use_dora=use_dora,
        quantize_base=quantize_base,
        **TINY_LLAMA3_ARGS,
    )


def _hf_config() -> dict:
    a = TINY_LLAMA3_ARGS
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": a["vocab_size"],
        "hidden_size": a["embed_dim"],
        "intermediate_size": a["intermediate_dim"],
        "num_hidden_layers": a["num_layers"],
        "num_attention_heads": a["num_heads"],
        "num_key_value_heads": a["num_kv_heads"],
        "head_dim": a["embed_dim"] // a["num_heads"],
        "max_position_embeddings": a["max_seq_len"],
        "rms_norm_eps": a["norm_eps"],
        "rope_theta": a["rope_base"],
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "tune_recipes_tiny_version": TINY_CHECKPOINT_VERSION,
    }


def default_tiny_checkpoint_dir(variant: str = "base") -> Path:
    root = os.environ.get("TUNE_RECIPES_CACHE") or Path.home() / ".cache" / "tune_recipes"
    suffix = "" if variant == "base" else f"_{variant}"
    return Path(root) / f"tiny_llama3_v{TINY_CHECKPOINT_VERSION}{suffix}"


TINY_VARIANT_SEEDS = {"base": TINY_CHECKPOINT_SEED, "teacher": 1}


def build_tiny_llama3_checkpoint(out_dir: Optional[Union[str, Path]] = None,
                                 variant: str = "base") -> Path:
    """Write the deterministic tiny checkpoint (HF layout) to ``out_dir`` and return it.

    Idempotent and safe for concurrent callers: files are written to a temporary folder that is
    renamed into place, so a reader never sees a half-written checkpoint.
    """
    if variant not in TINY_VARIANT_SEEDS:
        raise ValueError(f"unknown tiny checkpoint variant {variant!r}; use one of {list(TINY_VARIANT_SEEDS)}")
    out = Path(out_dir) if out_dir is not None else default_tiny_checkpoint_dir(variant)
    if (out / "model.safetensors").exists() and (out / "config.json").exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(TINY_VARIANT_SEEDS[variant])
        model = tiny_llama3()
        # Small init keeps the initial loss near log(vocab) and training stable in fp32.
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                torch.nn.init.normal_(p, std=0.02)
    a = TINY_LLAMA3_ARGS
    hf_sd = convert_weights.tune_to_hf(
        {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()},
        num_heads=a["num_heads"],
        num_kv_heads=a["num_kv_heads"],
        dim=a["embed_dim"],
    )
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
    save_file({k: v.contiguous() for k, v in hf_sd.items()}, tmp / "model.safetensors",
              metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(_hf_config(), indent=2) + "\n")
    try:
        tmp.rename(out)
    except OSError:
        # Another process won the race; its files are identical.
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return out
