"""tune_recipes.training.reporting.run_status: the Ctrl-C line."""

import os
import signal

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


class _Stopped(Exception):
    pass


def _raise_stopped(signum, frame):
    raise _Stopped


def test_a_signal_sent_inside_the_held_block_acts_when_it_ends(monkeypatch):
    # SIGTERM with a raising handler stands for Ctrl-C (pytest-xdist workers ignore SIGINT).
    previous = signal.signal(signal.SIGTERM, _raise_stopped)
    reached = []
    try:
        with pytest.raises(_Stopped):
            with run_status.stop_signals_held():
                os.kill(os.getpid(), signal.SIGTERM)
                reached.append("after the signal")
            reached.append("after the block")
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert reached == ["after the signal"]
    # The mask is restored: the next signal acts at once.
    assert signal.SIGTERM not in signal.pthread_sigmask(signal.SIG_BLOCK, [])
