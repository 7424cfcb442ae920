"""Tiny models of each family we ship configs for, and deterministic HF-format checkpoints.

Nothing is downloaded: ``build_tiny_llama3_checkpoint`` writes ``config.json`` and
``model.safetensors`` from a fixed seed, so every machine builds byte-identical weights.

Families (the shipped-config tests swap a real builder for the tiny one of its family and keep
every other key): ``tiny_llama3`` / ``tiny_llama3_1`` (untied output, Llama-3.1 RoPE scaling
for the latter; both load the ``base`` checkpoint), ``tiny_llama3_2`` (tied embeddings,
``llama3_2`` checkpoint) and ``tiny_qwen2_5`` (q/k/v biases; tied: ``qwen2_5``, untied:
``qwen2_5_untied``). Each has a ``lora_`` twin taking the LoRA/DoRA/QLoRA options.
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
from torchtune.models.llama3_1._component_builders import llama3_1, lora_llama3_1
from torchtune.models.llama3_2._component_builders import llama3_2, lora_llama3_2
from torchtune.models.qwen2._component_builders import lora_qwen2, qwen2
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


def _lora_kwargs(lora_attn_modules, apply_lora_to_mlp, apply_lora_to_output, lora_rank,
                 lora_alpha, lora_dropout, use_dora, quantize_base) -> dict:
    return dict(lora_attn_modules=lora_attn_modules, apply_lora_to_mlp=apply_lora_to_mlp,
                apply_lora_to_output=apply_lora_to_output, lora_rank=lora_rank,
                lora_alpha=lora_alpha, lora_dropout=lora_dropout, use_dora=use_dora,
                quantize_base=quantize_base)


def tiny_llama3_1() -> TransformerDecoder:
    """``tiny_llama3`` with Llama-3.1's RoPE scaling (same weights: loads the base checkpoint)."""
    return llama3_1(**TINY_LLAMA3_ARGS)


def lora_tiny_llama3_1(lora_attn_modules: List[str], apply_lora_to_mlp: bool = False,
                       apply_lora_to_output: bool = False, lora_rank: int = 8,
                       lora_alpha: float = 16, lora_dropout: float = 0.0, use_dora: bool = False,
                       quantize_base: bool = False) -> TransformerDecoder:
    return lora_llama3_1(**_lora_kwargs(lora_attn_modules, apply_lora_to_mlp, apply_lora_to_output,
                                        lora_rank, lora_alpha, lora_dropout, use_dora,
                                        quantize_base), **TINY_LLAMA3_ARGS)


def tiny_llama3_2() -> TransformerDecoder:
    """Llama-3.2 architecture (tied input/output embeddings) at the tiny size."""
    return llama3_2(**TINY_LLAMA3_ARGS, tie_word_embeddings=True)


def lora_tiny_llama3_2(lora_attn_modules: List[str], apply_lora_to_mlp: bool = False,
                       apply_lora_to_output: bool = False, lora_rank: int = 8,
                       lora_alpha: float = 16, lora_dropout: float = 0.0, use_dora: bool = False,
                       quantize_base: bool = False) -> TransformerDecoder:
    # Options pass through unchanged: torchtune refuses apply_lora_to_output with tied
    # embeddings here exactly as it does for the real 1B/3B builders.
    return lora_llama3_2(**_lora_kwargs(lora_attn_modules, apply_lora_to_mlp, apply_lora_to_output, lora_rank,
                                        lora_alpha, lora_dropout, use_dora, quantize_base),
                         **TINY_LLAMA3_ARGS, tie_word_embeddings=True)


TINY_QWEN2_5_ARGS = dict(TINY_LLAMA3_ARGS, norm_eps=1e-6, rope_base=1_000_000.0)


def tiny_qwen2_5(tie_word_embeddings: bool = True) -> TransformerDecoder:
    """Qwen2.5 architecture (q/k/v biases) at the tiny size; tied like 0.5B-3B by default,
    ``tie_word_embeddings=False`` like 7B+."""
    return qwen2(**TINY_QWEN2_5_ARGS, tie_word_embeddings=tie_word_embeddings)


def lora_tiny_qwen2_5(lora_attn_modules: List[str], apply_lora_to_mlp: bool = False,
                      apply_lora_to_output: bool = False, lora_rank: int = 8,
                      lora_alpha: float = 16, lora_dropout: float = 0.0, use_dora: bool = False,
                      quantize_base: bool = False, tie_word_embeddings: bool = True
                      ) -> TransformerDecoder:
    return lora_qwen2(**_lora_kwargs(lora_attn_modules, apply_lora_to_mlp,
                                     apply_lora_to_output, lora_rank,
                                     lora_alpha, lora_dropout, use_dora, quantize_base),
                      **TINY_QWEN2_5_ARGS, tie_word_embeddings=tie_word_embeddings)


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


# variant -> (builder, seed). "base" and "teacher" are the untied Llama-3 family (tiny_llama3,
# tiny_llama3_1); the others hold the other families' weight layouts.
TINY_VARIANTS = {
    "base": (tiny_llama3, TINY_CHECKPOINT_SEED),
    "teacher": (tiny_llama3, 1),
    "llama3_2": (tiny_llama3_2, TINY_CHECKPOINT_SEED),
    "qwen2_5": (lambda: tiny_qwen2_5(tie_word_embeddings=True), TINY_CHECKPOINT_SEED),
    "qwen2_5_untied": (lambda: tiny_qwen2_5(tie_word_embeddings=False), TINY_CHECKPOINT_SEED),
}
TINY_VARIANT_SEEDS = {name: seed for name, (_, seed) in TINY_VARIANTS.items()}


def _hf_files(variant: str, model: TransformerDecoder):
    """(HF state dict, config.json dict) of a tiny model in ``variant``'s family layout."""
    a = TINY_LLAMA3_ARGS if not variant.startswith("qwen") else TINY_QWEN2_5_ARGS
    sd = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    tied = "output.weight" not in sd
    config = _hf_config()
    config["tie_word_embeddings"] = tied
    if variant.startswith("qwen"):
        from torchtune.models.qwen2._convert_weights import qwen2_tune_to_hf

        hf_sd = qwen2_tune_to_hf(sd, num_heads=a["num_heads"], num_kv_heads=a["num_kv_heads"],
                                 dim=a["embed_dim"], tie_word_embeddings=tied)
        config.update(architectures=["Qwen2ForCausalLM"], model_type="qwen2",
                      rms_norm_eps=a["norm_eps"], rope_theta=a["rope_base"])
    else:
        hf_sd = convert_weights.tune_to_hf(sd, num_heads=a["num_heads"],
                                           num_kv_heads=a["num_kv_heads"], dim=a["embed_dim"])
    return hf_sd, config


def build_tiny_llama3_checkpoint(out_dir: Optional[Union[str, Path]] = None,
                                 variant: str = "base") -> Path:
    """Write the deterministic tiny checkpoint (HF layout) to ``out_dir`` and return it.

    Idempotent and safe for concurrent callers: files are written to a temporary folder that is
    renamed into place, so a reader never sees a half-written checkpoint.
    """
    if variant not in TINY_VARIANTS:
        raise ValueError(f"unknown tiny checkpoint variant {variant!r}; use one of {list(TINY_VARIANTS)}")
    out = Path(out_dir) if out_dir is not None else default_tiny_checkpoint_dir(variant)
    if (out / "model.safetensors").exists() and (out / "config.json").exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    builder, seed = TINY_VARIANTS[variant]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = builder()
        # Small init keeps the initial loss near log(vocab) and training stable in fp32.
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                torch.nn.init.normal_(p, std=0.02)
    hf_sd, config = _hf_files(variant, model)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
    save_file({k: v.contiguous() for k, v in hf_sd.items()}, tmp / "model.safetensors",
              metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    try:
        tmp.rename(out)
    except OSError:
        # Another process won the race; its files are identical.
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return out
