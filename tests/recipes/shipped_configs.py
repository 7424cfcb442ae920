"""Shrink a shipped config so it runs on a CPU in seconds, changing only what cannot run here.

Kept as shipped: every key (activation checkpointing, compile, packing, dtype, optimizer, loss,
clipping, gradient accumulation, LoRA modules/rank/alpha/DoRA/QLoRA, apply_lora_to_mlp/output,
save_adapter_weights_only, QAT quantizer and its timing, KD teacher and loss, FSDP options).
Replaced: the model and teacher builders by the tiny builder of the same family (same adapter
options), the checkpoints by that family's tiny checkpoint (the checkpointer and its
``model_type`` stay, so the family's weight conversion runs), the tokenizer and data by the tiny
ones (``packed`` etc. kept), the device by the CPU (with it FP8 training and ``embedding_on_cpu``
off: FP8 needs a CUDA GPU, and on a CPU the table is in CPU memory already), and the length by
``steps`` optimizer steps in one epoch.
"""

from pathlib import Path
from typing import Dict, Optional, Tuple

import torch
from omegaconf import DictConfig, OmegaConf

from tune_recipes._cli import registry
from tune_recipes.config import resolve_component

DISTRIBUTED_RECIPES = {
    "full_finetune_distributed", "lora_finetune_distributed", "qat_distributed",
    "qat_lora_finetune_distributed", "knowledge_distillation_distributed",
}

# module of the real builder -> (tiny builder module path prefix, family)
_FAMILIES = {
    "torchtune.models.llama3": "llama3",
    "torchtune.models.llama3_1": "llama3_1",
    "torchtune.models.llama3_2": "llama3_2",
    "torchtune.models.qwen2_5": "qwen2_5",
}


def shipped_config_names():
    """Every config we ship outside configs/tiny/ (the tiny ones already run as shipped)."""
    return [c for c in registry.list_configs() if not c.startswith("tiny/")]


def _real_is_tied(module: str, base_fn: str) -> bool:
    builder = resolve_component(f"{module}.{base_fn}")
    with torch.device("meta"):
        model = builder()
    return "output.weight" not in model.state_dict()


def tiny_model_node(node: DictConfig, teacher_seed: bool = False) -> Tuple[DictConfig, str]:
    """(the tiny model config replacing ``node``, the tiny checkpoint variant it loads)."""
    module, fn = str(node._component_).rsplit(".", 1)
    family = _FAMILIES.get(module)
    if family is None:
        raise ValueError(f"no tiny model for the family of {node._component_}")
    lora = fn.startswith(("lora_", "qlora_"))
    base_fn = fn.removeprefix("qlora_").removeprefix("lora_")
    out = OmegaConf.create(OmegaConf.to_container(node, resolve=False))
    out._component_ = f"tune_recipes.models.{'lora_' if lora else ''}tiny_{family}"
    if fn.startswith("qlora_"):
        out.quantize_base = True  # torchtune's qlora_* builders are lora_* with NF4 bases
    variant = {"llama3": "base", "llama3_1": "base", "llama3_2": "llama3_2"}.get(family)
    if family == "qwen2_5":
        tied = _real_is_tied(module, base_fn)
        out.tie_word_embeddings = tied
        variant = "qwen2_5" if tied else "qwen2_5_untied"
    if teacher_seed:
        if variant != "base":
            raise ValueError("tiny KD teachers exist for the untied Llama-3 family only")
        variant = "teacher"
    return out, variant


def _tiny_checkpointer(node: DictConfig, variant: str) -> DictConfig:
    node = OmegaConf.create(OmegaConf.to_container(node, resolve=False))
    node.checkpoint_dir = "${tiny_checkpoint:%s}" % ("" if variant == "base" else variant)
    node.checkpoint_files = ["model.safetensors"]
    return node


def shrink(config_name: str, output_dir: Path, steps: int = 2,
           recipe: Optional[str] = None) -> Tuple[str, Path, Dict]:
    """Write the shrunk config next to ``output_dir``; return (recipe, yaml path, facts) where
    facts describe what the run must produce (for the assertions).

    ``config_name`` is one of our config names, or a path to any YAML (torchtune's stock
    configs: tests/recipes/test_stock_configs.py), whose ``recipe`` is then given."""
    if str(config_name).endswith((".yaml", ".yml")):
        path = Path(config_name)
        if recipe is None:
            raise ValueError(f"shrink({config_name}): a path needs its recipe")
    else:
        recipe = recipe or registry.recipe_for_config(config_name)
        path = registry.resolve_config(config_name).path
    cfg = OmegaConf.load(path)
    facts = {"recipe": recipe, "lora": False, "adapter_only": False}

    cfg.model, variant = tiny_model_node(cfg.model)
    facts["variant"] = variant
    facts["lora"] = str(cfg.model._component_).split(".")[-1].startswith("lora_")
    facts["model"] = OmegaConf.to_container(cfg.model)
    cfg.checkpointer = _tiny_checkpointer(cfg.checkpointer, variant)
    if "teacher_model" in cfg:
        cfg.teacher_model, teacher_variant = tiny_model_node(cfg.teacher_model, teacher_seed=True)
        cfg.teacher_checkpointer = _tiny_checkpointer(cfg.teacher_checkpointer, teacher_variant)
    if "tokenizer" in cfg:
        cfg.tokenizer = {"_component_": "tune_recipes.data.tiny_tokenizer", "max_seq_len": 256}
    if "dataset" in cfg:
        kept = {k: cfg.dataset[k] for k in ("packed", "train_on_input") if k in cfg.dataset}
        cfg.dataset = {"_component_": "tune_recipes.data.tiny_alpaca_dataset", **kept}
    if "epochs" in cfg:
        cfg.epochs = 1
        cfg.max_steps_per_epoch = steps
    cfg.device = "cpu"
    if cfg.get("enable_fp8_training", False):  # FP8 matmuls need a CUDA GPU (>= sm_89)
        for key in [k for k in cfg if str(k).startswith("fp8_")]:
            del cfg[key]
        cfg.enable_fp8_training = False
    if cfg.get("embedding_on_cpu", False):  # the table is in CPU memory already
        cfg.embedding_on_cpu = False
    cfg.output_dir = str(output_dir)
    facts["adapter_only"] = bool(cfg.get("save_adapter_weights_only", False))
    facts["steps"] = steps
    yaml_path = Path(str(output_dir) + ".yaml")
    yaml_path.write_text(OmegaConf.to_yaml(cfg))
    return recipe, yaml_path, facts
