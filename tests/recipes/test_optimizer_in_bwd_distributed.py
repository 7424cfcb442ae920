"""``optimizer_in_bwd`` in the distributed recipes (IN_BACKWARD_GLOBAL): the step's token count
is all-reduced before the forward, so each gradient is the exact global token mean when its
in-backward optimizer step fires. On ragged data (every rank's count differs every step):
2 ranks x batch 4 == 1 rank x batch 8 == the single-device in-backward run, batch 8.
Tolerances as tests/recipes/test_distributed.py (fp32): losses rtol 1e-5, weights 1e-4 / 1e-5.
"""

import shutil

import pytest
import torch

from helpers import assert_runs_agree, assert_same_weights, losses, run_dist, run_recipe, tune, weights

pytestmark = pytest.mark.integration
IN_BWD = ["optimizer_in_bwd=True", "clip_grad_norm=null", "max_steps_per_epoch=4",
          "lr_scheduler.num_warmup_steps=1"]



def test_full_in_bwd_two_ranks_equal_one_rank_and_single_device(tmp_path):
    proc = run_dist(2, "full_finetune_distributed", "tiny/full_distributed", tmp_path / "r2",
                    [*IN_BWD, "batch_size=4"])
    assert "in_backward_global" in proc.stdout + proc.stderr  # the path, logged at startup
    run_dist(1, "full_finetune_distributed", "tiny/full_distributed", tmp_path / "r1",
             [*IN_BWD, "batch_size=8"])
    run_recipe("full_finetune_single_device", "tiny/full_single_device", tmp_path / "sd",
               [*IN_BWD, "batch_size=8"])
    assert_runs_agree(tmp_path / "r2", tmp_path / "r1", tmp_path / "sd", steps=4)


def test_qat_in_bwd_two_ranks_equal_single_device(tmp_path):
    # Before fake quantization starts, as in test_distributed.py: its rounding turns 1e-7
    # reduction-order differences into 1e-4 (measured: 8.6e-5 relative after 2 quantized steps).
    common = [*IN_BWD, "fake_quant_after_n_steps=1000"]
    run_dist(2, "qat_distributed", "tiny/qat_distributed", tmp_path / "r2", [*common, "batch_size=4"])
    run_recipe("qat_single_device", "tiny/qat_single_device", tmp_path / "sd",
               [*common, "batch_size=8"])
    torch.testing.assert_close(torch.tensor(losses(tmp_path / "r2")),
                               torch.tensor(losses(tmp_path / "sd")), rtol=1e-5, atol=0)
    assert_same_weights(weights(tmp_path / "r2"), weights(tmp_path / "sd"), rtol=1e-4, atol=1e-5)


def test_full_in_bwd_distributed_resume_equals_uninterrupted(tmp_path):
    # The per-parameter optimizers' sharded states are gathered into one checkpoint and
    # sharded back on resume.
    steps = ["optimizer_in_bwd=True", "clip_grad_norm=null", "max_steps_per_epoch=2", "epochs=2",
             "lr_scheduler.num_warmup_steps=1"]
    run_dist(2, "full_finetune_distributed", "tiny/full_distributed", tmp_path / "straight", steps)
    shutil.copytree(tmp_path / "straight", tmp_path / "resumed")  # a crash after epoch 0
    shutil.rmtree(tmp_path / "resumed" / "epoch_1")
    run_dist(2, "full_finetune_distributed", "tiny/full_distributed", tmp_path / "resumed",
             [*steps, "resume_from_checkpoint=True"])
    assert_same_weights(weights(tmp_path / "resumed", 1), weights(tmp_path / "straight", 1),
                        rtol=0, atol=0)
    # Without optimizer_in_bwd the gathered per-parameter state would load into one optimizer
    # without complaint and train on the wrong moments: refused, naming the key, before any
    # rank trains.
    shutil.rmtree(tmp_path / "resumed" / "epoch_1")
    proc = run_dist(2, "full_finetune_distributed", "tiny/full_distributed", tmp_path / "resumed",
                    [*steps[1:], "resume_from_checkpoint=True"], check=False)
    assert proc.returncode != 0 and not (tmp_path / "resumed" / "epoch_1").exists()
    assert "saved with optimizer_in_bwd=True, this run has optimizer_in_bwd=False" in proc.stderr


@pytest.mark.parametrize("override, message", [
    ("clip_grad_norm=1.0", "set clip_grad_norm=null"),
    ("gradient_accumulation_steps=2", "gradient_accumulation_steps=1"),
])
def test_in_bwd_refuses_clipping_and_accumulation(tmp_path, override, message):
    proc = run_dist(1, "full_finetune_distributed", "tiny/full_distributed", tmp_path,
                    ["optimizer_in_bwd=True", "clip_grad_norm=null", override], check=False)
    assert proc.returncode != 0
    assert message in proc.stdout + proc.stderr
