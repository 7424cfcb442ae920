"""``enable_fp8_training`` in lora_finetune_single_device (tune_recipes/modules/fp8_lora.py).

On CPU: refused in one line naming the keys. On a GPU with FP8 tensor cores (marked ``gpu``):
the tiny LoRA config trains with its frozen base projections in FP8 next to the same run in
bf16, and saves the same checkpoint files (adapter and merged model, same keys and dtypes).
The module's numerics and its compiled path are tested in tests/unit/modules/test_fp8_lora.py.
"""

import pytest
import torch

from helpers import losses, run_on_gpu, tune, weights

pytestmark = pytest.mark.integration


def test_fp8_lora_on_cpu_is_refused_naming_the_keys(tmp_path):
    proc = tune("run", "lora_finetune_single_device", "--config", "tiny/lora_single_device",
                f"output_dir={tmp_path}", "enable_fp8_training=True", check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "enable_fp8_training=True with device=cpu" in proc.stderr
    assert "Traceback" not in proc.stderr


def _run(out, *extra):
    return run_on_gpu("lora_finetune_single_device", "tiny/lora_single_device", out,
                      "lr_scheduler.num_warmup_steps=1", *extra)


@pytest.mark.gpu
def test_fp8_lora_trains_and_saves_like_bf16(tmp_path):
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("no FP8 tensor cores")
    _run(tmp_path / "bf16")
    # Eager: the tiny data is unpacked, and a new batch length recompiles (fp8.py's warning).
    proc = _run(tmp_path / "fp8", "enable_fp8_training=True")
    # 2 layers x 7 projections; the LoRA output head stays in bf16.
    assert "FP8 LoRA: 14 frozen base projections" in proc.stdout + proc.stderr
    bf16, fp8 = losses(tmp_path / "bf16"), losses(tmp_path / "fp8")
    assert len(fp8) == 4
    # test_fp8.py's tolerance (3% + 0.01 nats).
    for a, b in zip(bf16, fp8):
        assert abs(a - b) <= 0.03 * a + 0.01, (bf16, fp8)
    for name in ("adapter_model.safetensors", "model-00001-of-00001.safetensors"):
        ref, got = weights(tmp_path / "bf16", name=name), weights(tmp_path / "fp8", name=name)
        assert sorted(got) == sorted(ref), name
        assert all(got[k].dtype == ref[k].dtype and got[k].shape == ref[k].shape for k in ref)
