"""``enable_fp8_training`` (+ ``fp8_fast_accum_backward``) through full_finetune_single_device.

On CPU: refused in one line naming the key. On a GPU with FP8 tensor cores (marked ``gpu``):
the tiny full config trains in FP8, with and without fast accumulation in the backward
products, next to the same run in bf16, and the log names what ran. The float8 swap and its
configuration are unit-tested in tests/unit/training/setup/test_fp8.py."""

import subprocess
import sys

import pytest
import torch

from helpers import losses, tune

pytestmark = pytest.mark.integration


def test_fp8_full_on_cpu_is_refused_naming_the_key(tmp_path):
    proc = tune("run", "full_finetune_single_device", "--config", "tiny/full_single_device",
                f"output_dir={tmp_path}", "enable_fp8_training=True", "fp8_fast_accum_backward=True",
                check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "enable_fp8_training=True with device=cpu" in proc.stderr
    assert "Traceback" not in proc.stderr


def _run(out, *extra):
    # NOTE: python -m tune_recipes (on the GPU machine a `tune` script may be torchtune's).
    cmd = [sys.executable, "-m", "tune_recipes", "run", "full_finetune_single_device", "--config",
           "tiny/full_single_device", f"output_dir={out}", "device=cuda", "dtype=bf16",
           "max_steps_per_epoch=4", *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout + proc.stderr


@pytest.mark.gpu
def test_fp8_full_trains_like_bf16_with_and_without_fast_accumulation(tmp_path):
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("no FP8 tensor cores")
    _run(tmp_path / "bf16")
    plain = _run(tmp_path / "fp8", "enable_fp8_training=True")
    fast = _run(tmp_path / "fast", "enable_fp8_training=True", "fp8_fast_accum_backward=True")
    assert "FP8 training (torchao float8, tensorwise): 14 linear layers converted" in plain
    assert ("FP8 training (torchao float8, tensorwise, fast accumulation in backward too): "
            "14 linear layers converted") in fast
    bf16 = losses(tmp_path / "bf16")
    for run in ("fp8", "fast"):
        got = losses(tmp_path / run)
        assert len(got) == len(bf16) == 4
        # test_fp8.py's tolerance (3% + 0.01 nats).
        for a, b in zip(bf16, got):
            assert abs(a - b) <= 0.03 * a + 0.01, (run, bf16, got)
