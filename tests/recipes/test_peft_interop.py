"""The LoRA recipe's adapter loads in PEFT + transformers and reproduces our merged model."""

import shutil

import pytest
import torch

from helpers import run_recipe

pytestmark = pytest.mark.integration
peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("family", ["llama3", "qwen2_5"])
def test_peft_adapter_matches_merged_checkpoint(family, tmp_path):
    """For Qwen2 (q/k weights saved unpermuted) as for Llama: torchtune's PEFT export permutes
    the q/k lora_B rows for every model type, which loaded Qwen2 adapters onto the wrong rows."""
    from peft import AutoPeftModelForCausalLM

    from tune_recipes.resolvers import tiny_checkpoint

    overrides = ["max_steps_per_epoch=4", "lr_scheduler.num_warmup_steps=1"]
    if family == "qwen2_5":
        overrides += ["model._component_=tune_recipes.models.lora_tiny_qwen2_5",
                      "checkpointer.checkpoint_dir=${tiny_checkpoint:qwen2_5}",
                      "checkpointer.model_type=QWEN2", "model.apply_lora_to_output=False"]
    run_recipe("lora_finetune_single_device", "tiny/lora_single_device", tmp_path, overrides)
    epoch = tmp_path / "epoch_0"
    base_dir = tiny_checkpoint(None if family == "llama3" else family)
    vocab = transformers.AutoConfig.from_pretrained(base_dir).vocab_size
    ids = torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
        base_logits = base(ids).logits
        with_adapter = peft.PeftModel.from_pretrained(base, str(epoch))
        peft_logits = with_adapter(ids).logits
        # The epoch folder itself loads as base + adapter (adapter_config names the base) ...
        auto = transformers.AutoModelForCausalLM.from_pretrained(epoch, dtype=torch.float32)
        auto_logits = auto(ids).logits
        # ... and through PEFT's auto class (adapter_config names the task) ...
        auto_peft = AutoPeftModelForCausalLM.from_pretrained(str(epoch), dtype=torch.float32)
        auto_peft_logits = auto_peft(ids).logits
        # ... and the merged weights alone, copied without the adapter files.
        merged_dir = tmp_path / "merged"
        merged_dir.mkdir()
        for f in epoch.iterdir():
            if not f.name.startswith("adapter"):
                shutil.copy(f, merged_dir / f.name)
        merged = transformers.AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32)
        merged_logits = merged(ids).logits
    # The adapter changed the model (so this comparison means something) ...
    assert (merged_logits - base_logits).abs().max() > 1e-2
    # ... and PEFT's base+adapter equals our merged weights (fp32).
    torch.testing.assert_close(peft_logits, merged_logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(auto_logits, peft_logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(auto_peft_logits, peft_logits, rtol=1e-5, atol=1e-5)
