"""``enable_fp8_training`` (+ ``fp8_fast_accum_backward``) and ``fp8_mlp_activations`` through
full_finetune_single_device.

On CPU: FP8 training is refused in one line naming the key; ``fp8_mlp_activations`` (the MLP's
gate and up products kept in e4m3 for backward) trains like the plain recipe and saves the
same checkpoint (its compiled form: tests/unit/modules/test_fp8_mlp.py). On a GPU with FP8 tensor cores
(marked ``gpu``): the tiny full config trains in FP8, with and without fast accumulation in the
backward products and with ``fp8_mlp_activations``, next to the same run in bf16, and the log
names what ran. The modules are unit-tested in tests/unit/training/setup/test_fp8.py and
tests/unit/modules/test_fp8_mlp.py."""

import pytest
import torch

from helpers import losses, run_on_gpu, run_recipe, tune, weights

pytestmark = pytest.mark.integration


def test_fp8_full_on_cpu_is_refused_naming_the_key(tmp_path):
    proc = tune("run", "full_finetune_single_device", "--config", "tiny/full_single_device",
                f"output_dir={tmp_path}", "enable_fp8_training=True", "fp8_fast_accum_backward=True",
                check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "enable_fp8_training=True with device=cpu" in proc.stderr
    assert "Traceback" not in proc.stderr


def _run(out, *extra):
    proc = run_on_gpu("full_finetune_single_device", "tiny/full_single_device", out, *extra)
    return proc.stdout + proc.stderr


@pytest.mark.gpu
def test_fp8_full_trains_like_bf16_with_and_without_fast_accumulation_and_fp8_mlp(tmp_path):
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("no FP8 tensor cores")
    _run(tmp_path / "bf16")
    plain = _run(tmp_path / "fp8", "enable_fp8_training=True")
    fast = _run(tmp_path / "fast", "enable_fp8_training=True", "fp8_fast_accum_backward=True")
    mlp = _run(tmp_path / "mlp", "enable_fp8_training=True", "fp8_fast_accum_backward=True",
               "fp8_mlp_activations=True")
    assert "FP8 training (torchao float8, tensorwise): 14 linear layers converted" in plain
    assert ("FP8 training (torchao float8, tensorwise, fast accumulation in backward too): "
            "14 linear layers converted") in fast
    assert "fp8_mlp_activations: 2 MLPs keep their gate and up products in float8 e4m3" in mlp
    bf16 = losses(tmp_path / "bf16")
    for run in ("fp8", "fast", "mlp"):
        got = losses(tmp_path / run)
        assert len(got) == len(bf16) == 4
        # test_fp8.py's tolerance (3% + 0.01 nats).
        for a, b in zip(bf16, got):
            assert abs(a - b) <= 0.03 * a + 0.01, (run, bf16, got)


def test_fp8_mlp_activations_trains_like_the_plain_recipe(tmp_path):
    common = ["max_steps_per_epoch=4", "lr_scheduler.num_warmup_steps=1"]
    run_recipe("full_finetune_single_device", "tiny/full_single_device", tmp_path / "plain", common)
    said = run_recipe("full_finetune_single_device", "tiny/full_single_device", tmp_path / "e4m3",
                      [*common, "fp8_mlp_activations=True"])
    assert "fp8_mlp_activations: 2 MLPs keep their gate and up products in float8 e4m3" in said.stdout + said.stderr
    plain, e4m3 = losses(tmp_path / "plain"), losses(tmp_path / "e4m3")
    assert e4m3[0] == plain[0]  # the forward is exact; the first update is the first difference
    # The backward's g and u rounded to e4m3 (test_fp8.py's tolerance, 3% + 0.01 nats) ...
    for a, b in zip(plain, e4m3):
        assert abs(a - b) <= 0.03 * a + 0.01, (plain, e4m3)
    assert e4m3 != plain
    ref, got = weights(tmp_path / "plain"), weights(tmp_path / "e4m3")
    assert sorted(got) == sorted(ref) and all(got[k].dtype == ref[k].dtype for k in ref)


@pytest.mark.parametrize("recipe, config, products", [
    ("full_finetune_single_device", "tiny/full_single_device", "gate and up products"),
    ("lora_finetune_single_device", "tiny/lora_single_device", "intermediate products"),
])
def test_fp8_mlp_layers_converts_only_the_first_layers_mlps(tmp_path, recipe, config, products):
    common = ["max_steps_per_epoch=3", "lr_scheduler.num_warmup_steps=1", "fp8_mlp_activations=True"]
    said = run_recipe(recipe, config, tmp_path / "one", [*common, "fp8_mlp_layers=1"])
    assert (f"fp8_mlp_activations: 1 MLPs keep their {products} in float8 e4m3 for backward "
            "(fp8_mlp_layers=1: layer 0)") in said.stdout + said.stderr
    # More than the model has (2 layers): refused naming the key, before any step.
    proc = tune("run", recipe, "--config", config, f"output_dir={tmp_path / 'three'}", *common,
                "fp8_mlp_layers=3", check=False)
    assert proc.returncode != 0 and "fp8_mlp_layers=3: expected 1 to 2" in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
