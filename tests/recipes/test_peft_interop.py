"""The LoRA recipe's adapter loads in PEFT + transformers and reproduces our merged model."""

import shutil

import pytest
import torch

from helpers import run_recipe

pytestmark = pytest.mark.integration
peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")


def test_peft_adapter_matches_merged_checkpoint(tmp_path):
    from tune_recipes.models.tiny import build_tiny_llama3_checkpoint

    run_recipe("lora_finetune_single_device", "tiny/lora_single_device", tmp_path,
               ["max_steps_per_epoch=4", "lr_scheduler.num_warmup_steps=1"])
    epoch = tmp_path / "epoch_0"
    base_dir = build_tiny_llama3_checkpoint()
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
        base_logits = base(ids).logits
        with_adapter = peft.PeftModel.from_pretrained(base, str(epoch))
        peft_logits = with_adapter(ids).logits
        # The epoch folder itself loads as base + adapter (adapter_config names the base) ...
        auto = transformers.AutoModelForCausalLM.from_pretrained(epoch, dtype=torch.float32)
        auto_logits = auto(ids).logits
        # ... and the merged weights alone, copied without the adapter files.
        merged_dir = tmp_path / "merged"
        merged_dir.mkdir()
        for f in epoch.iterdir():
            if not f.name.startswith("adapter"):
                shutil.copy(f, merged_dir / f.name)
        merged = transformers.AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32)
        merged_logits = merged(ids).logits
    # The adapter changed the model (so this comparison means something) ...
    assert (peft_logits - base_logits).abs().max() > 1e-2
    # ... and PEFT's base+adapter equals our merged weights (fp32).
    torch.testing.assert_close(peft_logits, merged_logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(auto_logits, peft_logits, rtol=1e-5, atol=1e-5)
