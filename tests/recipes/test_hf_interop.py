"""Epoch folders are Hugging Face model folders: ``AutoModelForCausalLM.from_pretrained`` loads
what the full, QAT and KD recipes save, and gives the logits our (torchtune) model gives with the
same weights, in fp32 to 1e-5."""

import shutil
from pathlib import Path

import pytest
import torch

from helpers import run_recipe

pytestmark = pytest.mark.integration
transformers = pytest.importorskip("transformers")

WEIGHTS = "model-00001-of-00001.safetensors"
IDS = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))


def _our_logits(model_dir: Path, tmp_path: Path) -> torch.Tensor:
    """The tiny model built by our builder, weights read from ``model_dir`` through torchtune's
    HF checkpointer (the conversion our recipes load with)."""
    from torchtune.training import FullModelHFCheckpointer

    from tune_recipes.models import tiny_llama3

    ckpt = FullModelHFCheckpointer(checkpoint_dir=str(model_dir), checkpoint_files=[WEIGHTS],
                                   model_type="LLAMA3", output_dir=str(tmp_path / "unused"))
    model = tiny_llama3()
    model.load_state_dict(ckpt.load_checkpoint()["model"])
    with torch.no_grad():
        return model.eval()(IDS).float()


def _hf_logits(model_dir: Path) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        return model.eval()(IDS).logits


def _base_logits(tmp_path) -> torch.Tensor:
    from tune_recipes.models.tiny import build_tiny_llama3_checkpoint

    return _hf_logits(build_tiny_llama3_checkpoint())


def _check_epoch_folder(model_dir: Path, tmp_path: Path) -> None:
    for name in ("config.json", WEIGHTS, "model.safetensors.index.json"):
        assert (model_dir / name).is_file(), f"{model_dir} lacks {name}"
    hf = _hf_logits(model_dir)
    # Training moved the weights, so agreement below means something.
    assert (hf - _base_logits(tmp_path)).abs().max() > 1e-3
    torch.testing.assert_close(hf, _our_logits(model_dir, tmp_path), rtol=0, atol=1e-5)


def test_full_finetune_epoch_loads_in_transformers(tmp_path):
    out = tmp_path / "full"
    run_recipe("full_finetune_single_device", "tiny/full_single_device", out,
               ["max_steps_per_epoch=2", "lr_scheduler.num_warmup_steps=1"])
    _check_epoch_folder(out / "epoch_0", tmp_path)


def test_qat_epoch_loads_in_transformers(tmp_path):
    out = tmp_path / "qat"
    # Fake quantization on from step 1, so the QAT path (its swap and removal) is what saves.
    run_recipe("qat_single_device", "tiny/qat_single_device", out,
               ["max_steps_per_epoch=2", "fake_quant_after_n_steps=1",
                "lr_scheduler.num_warmup_steps=1"])
    _check_epoch_folder(out / "epoch_0", tmp_path)


def test_kd_merged_student_loads_in_transformers(tmp_path):
    out = tmp_path / "kd"
    run_recipe("knowledge_distillation_single_device", "tiny/kd_single_device", out,
               ["max_steps_per_epoch=2", "lr_scheduler.num_warmup_steps=1"])
    epoch = out / "epoch_0"
    # The folder also holds the PEFT adapter, and transformers then loads base + adapter
    # (adapter_config.json names the base). The merged student alone: its files without those.
    merged = tmp_path / "merged_student"
    merged.mkdir()
    for f in epoch.iterdir():
        if not f.name.startswith("adapter"):
            shutil.copy(f, merged / f.name)
    _check_epoch_folder(merged, tmp_path)
    pytest.importorskip("peft")
    # Base + adapter through PEFT equals the merged weights to fp32 rounding of the merge.
    torch.testing.assert_close(_hf_logits(epoch), _our_logits(merged, tmp_path),
                               rtol=1e-4, atol=1e-4)


def test_a_full_run_started_from_a_lora_runs_folder_saves_plain_model_folders(tmp_path):
    """torchtune's checkpointer copies checkpoint_dir's small files into every save: started
    from a LoRA run's final folder, a full run's folders would hold that run's
    adapter_config.json (transformers then loads them as an adapter, and fails) and its
    finished_run.json (a false record in a folder that is not final). Neither is kept."""
    lora = tmp_path / "lora"
    run_recipe("lora_finetune_single_device", "tiny/lora_single_device", lora,
               ["max_steps_per_epoch=2", "lr_scheduler.num_warmup_steps=1"])
    source = lora / "epoch_0"
    assert (source / "adapter_config.json").is_file() and (source / "finished_run.json").is_file()
    out = tmp_path / "full"
    run_recipe("full_finetune_single_device", "tiny/full_single_device", out,
               ["max_steps_per_epoch=2", "epochs=2", "lr_scheduler.num_warmup_steps=1",
                f"checkpointer.checkpoint_dir={source}", f"checkpointer.checkpoint_files=[{WEIGHTS}]"])
    for epoch in ("epoch_0", "epoch_1"):
        assert not (out / epoch / "adapter_config.json").exists()
        assert (out / epoch / "config.json").is_file()  # the model's own files are still copied
    assert not (out / "epoch_0" / "finished_run.json").exists()
    assert '"epochs_run": 2' in (out / "epoch_1" / "finished_run.json").read_text()
    _check_epoch_folder(out / "epoch_1", tmp_path)
    # The weights are as readable as the folder's other files (safetensors alone writes 0600).
    import os
    import stat

    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE((out / "epoch_1" / WEIGHTS).stat().st_mode) == 0o666 & ~umask


def test_an_adapter_trained_on_a_trained_folder_names_that_folder_as_its_base(tmp_path):
    """`tune download` records the hub repo in original_repo_id.json; torchtune's checkpointer
    copied it into every save and named that repo as the base of any adapter later trained on
    the saved folder: PEFT then loaded the adapter onto the download, dropping the full
    fine-tune. A trained folder is not that repo: the record is not copied."""
    import json

    from tune_recipes.resolvers import tiny_checkpoint

    download = tmp_path / "download"
    shutil.copytree(tiny_checkpoint(), download)
    (download / "original_repo_id.json").write_text(json.dumps({"repo_id": "org/tiny-base"}))
    full = tmp_path / "full"
    run_recipe("full_finetune_single_device", "tiny/full_single_device", full,
               ["max_steps_per_epoch=2", "lr_scheduler.num_warmup_steps=1",
                f"checkpointer.checkpoint_dir={download}"])
    assert not (full / "epoch_0" / "original_repo_id.json").exists()
    # A folder saved before (or by torchtune) still carries the record: its own path wins.
    (full / "epoch_0" / "original_repo_id.json").write_text(json.dumps({"repo_id": "org/tiny-base"}))
    lora = tmp_path / "lora"
    run_recipe("lora_finetune_single_device", "tiny/lora_single_device", lora,
               ["max_steps_per_epoch=2", "lr_scheduler.num_warmup_steps=1",
                "save_adapter_weights_only=True",
                f"checkpointer.checkpoint_dir={full / 'epoch_0'}",
                f"checkpointer.checkpoint_files=[{WEIGHTS}]"])
    adapter_config = json.loads((lora / "epoch_0" / "adapter_config.json").read_text())
    assert adapter_config["base_model_name_or_path"] == str(full / "epoch_0")
