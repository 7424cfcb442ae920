"""Recipes with the fused linear cross-entropy give the plain loss's training (fp32, tiny)."""

import pytest
import torch

from helpers import assert_same_weights, losses, run_recipe, tune, weights

pytestmark = pytest.mark.integration
FUSED = "loss._component_=tune_recipes.modules.loss.FusedLinearCrossEntropyLoss"
STEPS = ["max_steps_per_epoch=5", "lr_scheduler.num_warmup_steps=1"]


@pytest.mark.parametrize("batch_size, ga", [(8, 1), (2, 4)])
def test_full_fused_equals_plain(tmp_path, batch_size, ga):
    common = [*STEPS, f"batch_size={batch_size}", f"gradient_accumulation_steps={ga}"]
    run_recipe("full_finetune_single_device", "tiny/full_single_device", tmp_path / "plain", common)
    run_recipe("full_finetune_single_device", "tiny/full_single_device", tmp_path / "fused",
               [*common, FUSED])
    plain, fused = losses(tmp_path / "plain"), losses(tmp_path / "fused")
    assert len(fused) == 5
    torch.testing.assert_close(torch.tensor(fused), torch.tensor(plain), rtol=1e-5, atol=0)
    assert_same_weights(weights(tmp_path / "fused"), weights(tmp_path / "plain"), rtol=1e-4, atol=1e-6)


def test_lora_fused_equals_plain_with_frozen_head(tmp_path):
    common = [*STEPS, "model.apply_lora_to_output=False", "optimizer.lr=3e-3",
              "batch_size=2", "gradient_accumulation_steps=4"]
    run_recipe("lora_finetune_single_device", "tiny/lora_single_device", tmp_path / "plain", common)
    run_recipe("lora_finetune_single_device", "tiny/lora_single_device", tmp_path / "fused",
               [*common, FUSED])
    torch.testing.assert_close(torch.tensor(losses(tmp_path / "fused")),
                               torch.tensor(losses(tmp_path / "plain")), rtol=1e-5, atol=0)


def test_lora_adapted_head_is_named_in_the_error(tmp_path):
    proc = tune("run", "lora_finetune_single_device", "--config", "tiny/lora_single_device",
                f"output_dir={tmp_path}", FUSED, "model.apply_lora_to_output=True", check=False)
    assert proc.returncode == 2
    assert "model.output is LoRALinear" in proc.stderr and "apply_lora_to_output=False" in proc.stderr


# The whole-model case also runs under activation_memory_budget (recomputing in backward must
# not change the losses; that it saves less: tests/unit/training/setup/test_model.py).
@pytest.mark.parametrize("scope,budget", [(None, None), ("model", 0.5)])
def test_fused_loss_under_torch_compile_matches_eager_plain(tmp_path, scope, budget):
    common = ["max_steps_per_epoch=3", "lr_scheduler.num_warmup_steps=1"]
    run_recipe("full_finetune_single_device", "tiny/full_single_device", tmp_path / "plain", common)
    proc = run_recipe("full_finetune_single_device", "tiny/full_single_device", tmp_path / "compiled",
                      [*common, FUSED, "compile=True", *([f"compile_scope={scope}"] if scope else []),
                       *([f"activation_memory_budget={budget}"] if budget else [])])
    said = proc.stdout + proc.stderr
    assert (f"activation memory budget {budget}:" in said) if budget else ("activation memory budget" not in said)
    torch.testing.assert_close(torch.tensor(losses(tmp_path / "compiled")),
                               torch.tensor(losses(tmp_path / "plain")), rtol=1e-5, atol=0)


def test_compile_scope_is_checked_and_named(tmp_path):
    proc = tune("run", "full_finetune_single_device", "--config", "tiny/full_single_device",
                f"output_dir={tmp_path}", "compile=True", "compile_scope=everything", check=False)
    assert proc.returncode == 2 and "compile_scope" in proc.stderr and "model" in proc.stderr
    assert not any(tmp_path.glob("epoch_*"))


def test_lora_whole_model_compile_matches_eager(tmp_path):
    # Under an activation memory budget too: the LoRA recipe hands the key to its model setup.
    common = [*STEPS, "model.apply_lora_to_output=False", "optimizer.lr=3e-3", FUSED]
    run_recipe("lora_finetune_single_device", "tiny/lora_single_device", tmp_path / "eager", common)
    proc = run_recipe("lora_finetune_single_device", "tiny/lora_single_device", tmp_path / "compiled",
                      [*common, "compile=True", "compile_scope=model", "activation_memory_budget=0.5"])
    assert "activation memory budget 0.5:" in proc.stdout + proc.stderr
    torch.testing.assert_close(torch.tensor(losses(tmp_path / "compiled")),
                               torch.tensor(losses(tmp_path / "eager")), rtol=1e-5, atol=0)
