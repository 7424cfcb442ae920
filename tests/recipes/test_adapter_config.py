"""adapter_config.json names the base model portably: the hub id when the base checkpoint
folder records one (`tune download` writes original_repo_id.json there), else the local path."""

import json
import shutil

import pytest

from helpers import run_recipe
from tune_recipes.models.tiny import build_tiny_llama3_checkpoint

pytestmark = pytest.mark.integration
STEPS = ["max_steps_per_epoch=1", "save_adapter_weights_only=True"]


def _base_name(out):
    return json.loads((out / "epoch_0" / "adapter_config.json").read_text())["base_model_name_or_path"]


def test_hub_id_when_the_checkpoint_folder_records_one_else_the_local_path(tmp_path):
    base = tmp_path / "base"
    shutil.copytree(build_tiny_llama3_checkpoint(), base)
    run_recipe("lora_finetune_single_device", "tiny/lora_single_device", tmp_path / "local",
               [*STEPS, f"checkpointer.checkpoint_dir={base}"])
    assert _base_name(tmp_path / "local") == str(base.resolve())

    (base / "original_repo_id.json").write_text(json.dumps({"repo_id": "meta-llama/Llama-3.2-1B"}))
    run_recipe("lora_finetune_single_device", "tiny/lora_single_device", tmp_path / "hub",
               [*STEPS, f"checkpointer.checkpoint_dir={base}"])
    assert _base_name(tmp_path / "hub") == "meta-llama/Llama-3.2-1B"


def test_every_lora_checkpoint_holds_its_adapter_config(tmp_path):
    """The intermediate epoch folder too (torchtune's save pops the adapter entries from the
    state dict it writes the recipe state from: a check made after it would take the folder
    for one without an adapter and drop its config)."""
    out = tmp_path / "run"
    run_recipe("lora_finetune_single_device", "tiny/lora_single_device", out,
               ["max_steps_per_epoch=1", "epochs=2"])
    for epoch in ("epoch_0", "epoch_1"):
        assert json.loads((out / epoch / "adapter_config.json").read_text())["peft_type"] == "LORA"
    assert (out / "epoch_0" / "recipe_state.pt").is_file()  # the intermediate one


def test_a_dora_run_writes_no_peft_adapter_config(tmp_path):
    """PEFT loads torchtune's DoRA adapter with its config as a plain LoRA (magnitudes ignored:
    wrong outputs, one warning); without the config PEFT refuses the folder. The merged model
    and torchtune's adapter file are written."""
    out = tmp_path / "run"
    run_recipe("lora_finetune_single_device", "tiny/lora_single_device", out,
               ["max_steps_per_epoch=1", "model.use_dora=True"])
    written = {p.name for p in (out / "epoch_0").iterdir()}
    assert "adapter_config.json" not in written, written
    assert {"adapter_model.pt", "model.safetensors.index.json"} <= written, written
