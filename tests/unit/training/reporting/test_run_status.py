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


def test_a_resume_stopped_before_it_began_says_how_to_resume(monkeypatch):
    """Ctrl-C while the process starts (imports, the config), before the resume names its
    checkpoint: the line still says how to resume, not only that nothing was saved."""
    monkeypatch.setattr(run_status, "_status", {"step": 0, "checkpoint": None})
    args = ["--config", "tiny/full_single_device", "output_dir=/tmp/o", "resume_from_checkpoint=True"]
    assert run_status.interrupted_message("r/full.py", args) == (
        "interrupted at step 0; no checkpoint saved by this run, nor any checkpoint resumed yet; "
        "resume with: tune run full --config tiny/full_single_device output_dir=/tmp/o "
        "resume_from_checkpoint=auto")


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


def _fresh(monkeypatch):
    monkeypatch.setattr(run_status, "_status", {"step": 0, "checkpoint": None, "publishing": None,
                                                "final": False, "resumed_from": None})


def test_a_run_stopped_while_resuming_names_the_checkpoint_it_resumes_from(monkeypatch):
    """Stopped before its first step, a resumed run has saved nothing, but the checkpoint it
    resumes from is intact: the line names it and the command that resumes it again."""
    _fresh(monkeypatch)
    run_status.resuming_from("/tmp/o/step_50")
    line = run_status.interrupted_message("r/lora.py", ["output_dir=/tmp/o", "resume_from_checkpoint=True"])
    assert line == ("interrupted while resuming from /tmp/o/step_50, before its first step; resume "
                    "with: tune run lora output_dir=/tmp/o resume_from_checkpoint=True")
    run_status.step_finished(53)  # steps after the resume: the step, and still that checkpoint
    assert run_status.interrupted_message("r/lora.py", []).startswith(
        "interrupted at step 53; last checkpoint /tmp/o/step_50; resume with:")
    run_status.checkpoint_saved("/tmp/o/step_60")
    assert "last checkpoint /tmp/o/step_60;" in run_status.interrupted_message("r/lora.py", [])


def test_a_run_stopped_after_its_final_checkpoint_has_nothing_to_resume(monkeypatch, tmp_path):
    _fresh(monkeypatch)
    run_status.step_finished(3)
    run_status.checkpoint_saved(tmp_path / "step_2")
    assert "resume with:" in run_status.interrupted_message("r/lora.py", [])
    staged, final = tmp_path / ".saving" / "epoch_0", tmp_path / "epoch_0"
    staged.mkdir(parents=True)
    run_status.checkpoint_publishing(staged, final, final=True)
    # not yet renamed into place: the earlier checkpoint is the one to resume from
    assert f"last checkpoint {tmp_path / 'step_2'};" in run_status.interrupted_message("r/lora.py", [])
    staged.rename(final)  # renamed, before checkpoint_saved: the final folder counts
    line = run_status.interrupted_message("r/lora.py", [])
    assert line == (f"interrupted after the run finished (step 3); its final checkpoint {final} "
                    "is complete, nothing to resume")
    run_status.checkpoint_saved(final, final=True)
    assert run_status.interrupted_message("r/lora.py", []) == line


def test_the_resume_command_names_output_dir_whole_wherever_it_came_from(monkeypatch, tmp_path):
    """An output_dir from the environment (the tiny configs' ${oc.env:TUNE_RECIPES_OUTPUT,...})
    or relative to where the run started would resume another folder from another shell: the
    command names the checkpoint's folder, absolute, in place of any output_dir argument."""
    _fresh(monkeypatch)
    monkeypatch.chdir(tmp_path)
    run_status.step_finished(5)
    run_status.checkpoint_saved("outputs/tiny_kd/step_5")  # as the recipe's relative output_dir has it
    whole = tmp_path / "outputs" / "tiny_kd"
    for args in (["--config", "tiny/kd_single_device"],
                 ["--config", "tiny/kd_single_device", "output_dir=outputs/tiny_kd"]):
        line = run_status.interrupted_message("r/kd.py", args)
        assert line.endswith(f"resume with: tune run kd --config tiny/kd_single_device "
                             f"output_dir={whole} resume_from_checkpoint=True"), line
    # A config file of the user's, named relative to where the run started: made absolute
    # (a shipped config's name stays as it is).
    (tmp_path / "my_run.yaml").write_text("{}")
    line = run_status.interrupted_message("r/kd.py", ["--config", "my_run.yaml"])
    assert line.endswith(f"tune run kd --config {tmp_path / 'my_run.yaml'} output_dir={whole} "
                         "resume_from_checkpoint=True"), line
    # Nothing saved yet: the run starts afresh wherever it is run, so no folder is named.
    _fresh(monkeypatch)
    assert run_status.resume_hint("r/kd.py", ["epochs=2"]) == (
        "resume with: tune run kd epochs=2 resume_from_checkpoint=auto")
