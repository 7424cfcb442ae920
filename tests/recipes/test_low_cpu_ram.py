"""``low_cpu_ram`` in lora_finetune_single_device (stock uses it with QLoRA): the merged model is
built for saving tensor by tensor in a memory-mapped scratch file instead of CPU memory
(tune_recipes/training/checkpointing/low_ram.py). It must change where the bytes live, never
what is written: a tiny QLoRA run saves bit-identical files with it on and off, and leaves no
scratch file behind."""

import pytest

from helpers import run_recipe

pytestmark = pytest.mark.integration
QLORA = ["max_steps_per_epoch=1", "model.quantize_base=True"]
FILES = ["model-00001-of-00001.safetensors", "model.safetensors.index.json",
         "adapter_model.safetensors", "adapter_model.pt", "adapter_config.json"]


def test_qlora_low_cpu_ram_saves_the_same_bytes(tmp_path):
    run_recipe("lora_finetune_single_device", "tiny/lora_single_device", tmp_path / "off",
               [*QLORA, "low_cpu_ram=False"])
    run_recipe("lora_finetune_single_device", "tiny/lora_single_device", tmp_path / "on",
               [*QLORA, "low_cpu_ram=True"])
    for name in FILES:
        on, off = (tmp_path / run / "epoch_0" / name for run in ("on", "off"))
        assert on.read_bytes() == off.read_bytes(), name
    assert not list((tmp_path / "on").rglob(".low_cpu_ram_*"))
