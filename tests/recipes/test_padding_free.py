"""``padding_free: True``: an unpacked micro-batch's rows end to end with document masks trains
exactly as the padded batch does (fp32, tiny, CPU), on one device, on two gloo ranks, and under
distillation (the teacher reads the same batches); packs without their padding train exactly as
the packs."""

import math

import pytest
import torch

from helpers import assert_same_weights, losses, run_dist, run_recipe, tune, weights
from tune_recipes.training.metrics import read_metrics

pytestmark = pytest.mark.integration
STEPS = ["max_steps_per_epoch=4", "lr_scheduler.num_warmup_steps=1"]


@pytest.mark.parametrize("recipe,config,extra", [
    ("full_finetune_single_device", "tiny/full_single_device", ["gradient_accumulation_steps=2", "batch_size=4"]),
    ("lora_finetune_single_device", "tiny/lora_single_device", ["optimizer.lr=3e-3"]),
])
@pytest.mark.parametrize("data", [[], ["dataset.packed=True"]], ids=["rows", "packs"])
def test_padding_free_trains_as_padded(tmp_path, recipe, config, extra, data):
    """Rows end to end train as padded rows; packs without their padding (the run says so) as
    the packs: the same losses and weights."""
    kept = run_recipe(recipe, config, tmp_path / "padded", [*STEPS, *extra, *data])
    proc = run_recipe(recipe, config, tmp_path / "free", [*STEPS, *extra, *data, "padding_free=True"])
    said = "packs without their padding"
    assert (said in proc.stdout + proc.stderr) == bool(data) and said not in kept.stdout + kept.stderr
    free, padded = losses(tmp_path / "free"), losses(tmp_path / "padded")
    assert len(free) == 4
    torch.testing.assert_close(torch.tensor(free), torch.tensor(padded), rtol=1e-5, atol=0)
    if recipe.startswith("full"):
        assert_same_weights(weights(tmp_path / "free"), weights(tmp_path / "padded"), rtol=1e-4, atol=1e-6)
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("recipe,config,extra", [
    ("full_finetune_distributed", "tiny/full_distributed", ["gradient_accumulation_steps=2", "batch_size=4"]),
    ("lora_finetune_distributed", "tiny/lora_distributed", ["optimizer.lr=3e-3", "batch_size=4"]),
])
@pytest.mark.parametrize("data", [[], ["dataset.packed=True"]], ids=["rows", "packs"])
def test_padding_free_trains_as_padded_on_two_ranks(tmp_path, recipe, config, extra, data):
    """Each rank's micro-batches padding-free (rows end to end, or packs without their padding,
    so the ranks' batches differ in length): the same losses and weights as padded batches (the
    global token count, all-reduced, is the same)."""
    run_dist(2, recipe, config, tmp_path / "padded", [*STEPS, *extra, *data])
    run_dist(2, recipe, config, tmp_path / "free", [*STEPS, *extra, *data, "padding_free=True"])
    free, padded = losses(tmp_path / "free"), losses(tmp_path / "padded")
    assert len(free) == 4
    torch.testing.assert_close(torch.tensor(free), torch.tensor(padded), rtol=1e-5, atol=0)
    if recipe.startswith("full"):
        assert_same_weights(weights(tmp_path / "free"), weights(tmp_path / "padded"), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("data", [[], ["dataset.packed=True"]], ids=["rows", "packs"])
def test_padding_free_distills_as_padded(tmp_path, data):
    common = [*STEPS, "gradient_accumulation_steps=2", "batch_size=4", *data]
    run_recipe("knowledge_distillation_single_device", "tiny/kd_single_device", tmp_path / "padded", common)
    run_recipe("knowledge_distillation_single_device", "tiny/kd_single_device", tmp_path / "free",
               [*common, "padding_free=True"])
    for key in ("loss", "class_loss", "kd_loss"):
        free = read_metrics(tmp_path / "free" / "metrics.jsonl", key)
        assert len(free) == 4, key
        torch.testing.assert_close(torch.tensor(free),
                                   torch.tensor(read_metrics(tmp_path / "padded" / "metrics.jsonl", key)),
                                   rtol=1e-5, atol=0)


@pytest.mark.parametrize("config", ["tiny/qat_distributed", "tiny/qat_lora_distributed", "tiny/kd_distributed"])
def test_the_other_distributed_recipes_take_padding_free(config):
    proc = tune("validate", config, "padding_free=True", check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]


def _on_cuda(launch, recipe, config, out, *overrides, said=None):
    """A tiny config on the GPU in fp32 (unless overridden), 4 steps (``said``: a list the run's
    stderr is appended to)."""
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "tune_recipes", "run", *launch, recipe, "--config", config,
           f"output_dir={out}", "device=cuda", "dtype=fp32", *STEPS, *overrides]  # later keys win
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    if said is not None:
        said.append(proc.stderr)
    return losses(out)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("launch,recipe,config,extra", [
    (["--nproc_per_node", "1"], "full_finetune_distributed", "tiny/full_distributed", ["compile=True"]),
    ([], "knowledge_distillation_single_device", "tiny/kd_single_device", []),
])
def test_on_cuda_padding_free_trains_as_padded_in_the_sharded_model_and_the_teacher(
        tmp_path, launch, recipe, config, extra):
    """Document attention routed where the sharded (FSDP2) model and the distillation teacher
    are built: padding-free batches (fp32: flex attention on a BlockMask) train as padded ones
    (SDPA), fp32, 2e-4."""
    padded = _on_cuda(launch, recipe, config, tmp_path / "padded", *extra)
    free = _on_cuda(launch, recipe, config, tmp_path / "free", *extra, "padding_free=True")
    assert len(free) == len(padded) == 4
    torch.testing.assert_close(torch.tensor(free), torch.tensor(padded), rtol=2e-4, atol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("extra", [["compile=True"], ["compile=True", "compile_scope=model"],
                                   ["compile=True", "compile_scope=model", "dataset.packed=True"]])
def test_on_cuda_bf16_document_spans_train_as_padded(tmp_path, extra):
    """bf16 on a GPU that runs flash attention: padding-free batches (compiled per layer, or the
    whole model as the README's unpacked command: no warning) and packs without their padding
    (the whole model compiled) carry document spans, and attention runs flash attention's
    variable-length kernel: the same losses within bf16's rounding (1e-2 relative) as padded
    batches (SDPA), and as the same packs with their padding."""
    packed = "dataset.packed=True" in extra
    reference = ["compile=True", "compile_scope=model", "dataset.packed=True"] if packed else ["compile=True"]
    padded = _on_cuda([], "full_finetune_single_device", "tiny/full_single_device", tmp_path / "padded",
                      "dtype=bf16", *reference)
    said = []
    spans = _on_cuda([], "full_finetune_single_device", "tiny/full_single_device", tmp_path / "spans",
                     "dtype=bf16", "padding_free=True", *extra, said=said)
    assert "compile_scope=layers" not in said[0]
    assert len(spans) == len(padded) == 4
    assert all(map(math.isfinite, spans)) and spans[-1] < spans[0]
    torch.testing.assert_close(torch.tensor(spans), torch.tensor(padded), rtol=1e-2, atol=0)


@pytest.mark.parametrize("override,named", [
    ("collate_fn=torchtune.data.padded_collate_dpo", "padding_free=True with collate_fn="),
    ("padding_free=3", "padding_free=3"),
])
def test_padding_free_conflicts_are_named(tmp_path, override, named):
    proc = tune("run", "full_finetune_single_device", "--config", "tiny/full_single_device",
                f"output_dir={tmp_path}", "padding_free=True", override, check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert named in proc.stderr and "Traceback" not in proc.stderr


def test_padding_free_with_the_whole_model_compiled_validates_without_a_warning(tmp_path):
    """The README's unpacked command compiles the whole model over padding-free batches: with
    flash attention's document spans it compiles dynamic from the first batch, so the config
    itself earns no warning
    (the run warns where it would take flex attention: ``whole_model_dynamic_compile_warning``)."""
    proc = tune("validate", "tiny/full_single_device", "padding_free=True", "compile=True",
                "compile_scope=model", check=False)
    said = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "warning" not in said, said[-2000:]


def test_packing_a_shipped_config_that_sets_padding_free_packs_without_a_warning(tmp_path):
    """The shipped configs set padding_free: True and their headers say to add
    dataset.packed=True: the pair packs (every batch a packed one), with no warning."""
    proc = run_recipe("full_finetune_single_device", "tiny/full_single_device", tmp_path,
                      ["padding_free=True", "dataset.packed=True", "max_steps_per_epoch=2"])
    said = proc.stdout + proc.stderr
    warnings = [line for line in said.splitlines() if line.startswith("warning:")]
    assert not [w for w in warnings if "padding_free" in w or "packed" in w], warnings
    assert len(losses(tmp_path)) == 2
