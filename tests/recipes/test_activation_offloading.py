"""``enable_activation_offloading`` in a recipe run on CPU: accepted, a one-line warning that
there is nothing to offload (activations already live in CPU memory; torchtune's context needs
CUDA), and the same losses as with it off. The offloading itself is tested on a GPU in
tests/unit/training/setup/test_offloading.py (skipped without CUDA); its memory saving and time
cost are not measured yet."""

import pytest

from helpers import losses, tune

pytestmark = pytest.mark.integration


def test_offloading_on_cpu_runs_and_trains_as_off(tmp_path):
    runs = {}
    for offload in (False, True):
        out = tmp_path / f"offload_{offload}"
        proc = tune("run", "full_finetune_single_device", "--config", "tiny/full_single_device",
                    f"output_dir={out}", "max_steps_per_epoch=3",
                    "enable_activation_checkpointing=True",
                    f"enable_activation_offloading={offload}")
        warned = "nothing to offload" in proc.stdout + proc.stderr
        assert warned == offload
        runs[offload] = losses(out)
    assert len(runs[True]) == 3
    assert runs[True] == runs[False]


def test_offloading_without_checkpointing_is_refused(tmp_path):
    proc = tune("run", "full_finetune_single_device", "--config", "tiny/full_single_device",
                f"output_dir={tmp_path}", "enable_activation_offloading=True", check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "enable_activation_checkpointing=True" in proc.stderr
