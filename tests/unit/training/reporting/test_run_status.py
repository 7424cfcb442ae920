"""tune_recipes.training.reporting.run_status: the Ctrl-C line."""

import pytest

from tune_recipes.training.reporting import run_status

pytestmark = pytest.mark.unit


def test_the_interrupt_line_names_step_checkpoint_and_resume_command(monkeypatch):
    monkeypatch.setattr(run_status, "_status", {"step": 0, "checkpoint": None})
    args = ["--config", "tiny/full_single_device", "output_dir=/tmp/o", "resume_from_checkpoint=False"]
    assert run_status.interrupted_message("r/full.py", args) == (
        "interrupted at step 0; no checkpoint saved by this run")
    run_status.step_finished(7)
    run_status.checkpoint_saved("/tmp/o/epoch_0")
    line = run_status.interrupted_message("r/full.py", args)
    assert line == ("interrupted at step 7; last checkpoint /tmp/o/epoch_0; resume with: tune run "
                    "full --config tiny/full_single_device output_dir=/tmp/o resume_from_checkpoint=True")
    assert "\n" not in line


def test_a_checkpoint_counts_once_its_folder_is_renamed_into_place(monkeypatch, tmp_path):
    monkeypatch.setattr(run_status, "_status", {"step": 3, "checkpoint": None, "publishing": None})
    staged, final = tmp_path / ".saving" / "epoch_0", tmp_path / "epoch_0"
    staged.mkdir(parents=True)
    run_status.checkpoint_publishing(staged, final)
    # Interrupted before the rename: nothing saved yet.
    assert run_status.interrupted_message("r/full.py", []).endswith("no checkpoint saved by this run")
    staged.rename(final)
    # After the rename, before checkpoint_saved: the folder on disk counts.
    assert f"last checkpoint {final};" in run_status.interrupted_message("r/full.py", [])
    run_status.checkpoint_saved(final)
    assert run_status.last_checkpoint() == str(final)
