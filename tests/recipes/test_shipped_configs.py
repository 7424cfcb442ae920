"""Every config we ship runs, shrunk (tests/recipes/shipped_configs.py says what changes and
what is kept), and writes a checkpoint that loads back into the model it trained.

Parametrized from the configs directory, so a new config is covered without editing this file.
In CI every config runs 1 optimizer step (its own gradient accumulation, so one step is all its
micro-batches); ``-m slow`` runs 2 steps. Distributed configs run on 2 gloo ranks.

The dtype is the one thing changed beyond the model, data and length: bf16 matmuls run about 10x
slower than fp32 on our CI CPUs (24 s vs 2 s for one LoRA step of 16 micro-batches), so the CPU
runs use fp32; ``scripts/gpu_acceptance.py`` runs every config as shipped, bf16 included.
"""

import math
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file

from helpers import tune
from shipped_configs import DISTRIBUTED_RECIPES, shipped_config_names, shrink
from tune_recipes._cli import registry
from tune_recipes.config import resolve_component
from tune_recipes.training.metrics import read_metrics

pytestmark = pytest.mark.integration
CONFIGS = shipped_config_names()


def test_every_shipped_config_is_covered():
    on_disk = sorted(str(p.relative_to(registry.configs_dir()).with_suffix(""))
                     for p in registry.configs_dir().rglob("*.yaml")
                     if p.relative_to(registry.configs_dir()).parts[0] != "tiny")
    assert CONFIGS == on_disk
    # Three families x full/LoRA/QAT/KD/quantize, single device and distributed.
    assert len(CONFIGS) >= 37, CONFIGS
    assert all(registry.recipe_for_config(c) for c in CONFIGS)


def _base_model(facts):
    node = dict(facts["model"])
    builder = node.pop("_component_").replace("lora_tiny_", "tiny_")
    kwargs = {k: v for k, v in node.items() if k == "tie_word_embeddings"}
    return resolve_component(builder)(**kwargs)


def _lora_model(facts):
    node = dict(facts["model"])
    return resolve_component(node.pop("_component_"))(**node)


def _assert_full_model_loads(epoch_dir: Path, facts):
    files = sorted(epoch_dir.glob("model-*.safetensors"))
    assert files, f"no model weights in {epoch_dir}"
    cfg = OmegaConf.load(epoch_dir.parent / "config.yaml")
    from torchtune import training

    checkpointer = training.FullModelHFCheckpointer(
        checkpoint_dir=str(epoch_dir), checkpoint_files=[f.name for f in files],
        model_type=cfg.checkpointer.model_type, output_dir=str(epoch_dir.parent / "reload"),
    )
    state = checkpointer.load_checkpoint()[training.MODEL_KEY]
    model = _base_model(facts)
    model.load_state_dict(state, strict=True)
    assert all(torch.isfinite(v).all() for v in state.values())


def _assert_adapter_loads(epoch_dir: Path, facts):
    adapter = torch.load(epoch_dir / "adapter_model.pt", weights_only=True, map_location="cpu")
    model = _lora_model(facts)
    lora_keys = {k for k in model.state_dict() if "lora_" in k or "magnitude" in k}
    assert set(adapter) == lora_keys
    missing, unexpected = model.load_state_dict(adapter, strict=False)
    assert unexpected == []
    assert (epoch_dir / "adapter_model.safetensors").is_file()
    assert set(load_file(str(epoch_dir / "adapter_model.safetensors")))  # PEFT format, non-empty


def _run(config_name, out: Path, steps: int):
    recipe, yaml_path, facts = shrink(config_name, out, steps=steps)
    launch = ["--nproc_per_node", "2"] if recipe in DISTRIBUTED_RECIPES else []
    tune("run", *launch, recipe, "--config", str(yaml_path), "dtype=fp32", timeout=900)
    if recipe == "quantize":
        saved = list(out.glob("model-*.pt"))
        assert len(saved) == 1 and (out / "quantize.json").is_file()
        assert torch.load(saved[0], weights_only=False, map_location="cpu")
        return
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert all(math.isfinite(float(r["loss"])) for r in rows)
    epoch_dir = out / "epoch_0"
    if facts["lora"]:
        _assert_adapter_loads(epoch_dir, facts)
        if not facts["adapter_only"]:
            _assert_full_model_loads(epoch_dir, facts)
    else:
        _assert_full_model_loads(epoch_dir, facts)


@pytest.mark.parametrize("config_name", CONFIGS)
def test_shipped_config_runs_one_step(tmp_path, config_name):
    _run(config_name, tmp_path / "run", steps=1)


@pytest.mark.slow
@pytest.mark.parametrize("config_name", CONFIGS)
def test_shipped_config_runs_two_steps(tmp_path, config_name):
    _run(config_name, tmp_path / "run", steps=2)
