"""Reliability end to end (issue 13): unsafe checkpoints refused, non-finite steps caught.

Tiny full fine-tunes on the CPU; each test states the fault it injects and what must hold.
"""

import shutil

import pytest
import torch

from helpers import run_recipe, weights

pytestmark = pytest.mark.integration
FULL = ("full_finetune_single_device", "tiny/full_single_device")
TWO_EPOCHS = ["max_steps_per_epoch=2", "epochs=2"]


class _RunsCode:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        import os

        return os.system, (f"touch {self.marker}",)


def test_resume_refuses_a_malicious_recipe_state_and_runs_nothing(tmp_path):
    out = tmp_path / "run"
    run_recipe(*FULL, out, TWO_EPOCHS)
    shutil.rmtree(out / "epoch_1")
    state_path = out / "recipe_state" / "recipe_state.pt"
    state = torch.load(state_path, weights_only=True)
    marker = tmp_path / "pwned"
    state["evil"] = _RunsCode(marker)
    torch.save(state, state_path)
    proc = run_recipe(*FULL, out, [*TWO_EPOCHS, "resume_from_checkpoint=True"], check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert str(state_path) in last and "refusing to unpickle" in last, last
    assert "Traceback" not in proc.stderr
    assert not marker.exists()
