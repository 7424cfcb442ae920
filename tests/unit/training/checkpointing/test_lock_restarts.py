"""The output_dir lock across torchrun restarts (lock.py): rank 0 of a restarted round takes
over the lock of an earlier round of the same job, wherever that one ran; nothing else does."""

import json
import os
import socket

import pytest

from tune_recipes.config import ConfigError
from tune_recipes.training.checkpointing.lock import LOCK_FILE, OutputDirLock

pytestmark = pytest.mark.unit


def _owner(tmp_path, **fields):
    (tmp_path / LOCK_FILE).write_text(json.dumps(fields))


@pytest.mark.parametrize("job, round_, taken", [
    ("job7", 0, True),    # the round before this one: torchrun stopped it
    ("job7", 1, False),   # this round (another rank 0 of it would be a second run)
    ("other", 0, False),  # another job
])
def test_a_restarted_round_takes_over_its_jobs_lock(tmp_path, monkeypatch, job, round_, taken):
    # Another host's live-looking process: only the job and round can tell it is gone.
    _owner(tmp_path, host="node-that-died", pid=1, job=job, round=round_)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job7")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    lock = OutputDirLock(tmp_path)
    if taken:
        lock.acquire()
        mine = json.loads((tmp_path / LOCK_FILE).read_text())
        assert mine["pid"] == os.getpid() and mine["job"] == "job7" and mine["round"] == 1
        lock.release()
    else:
        with pytest.raises(ConfigError, match="in use by another run"):
            lock.acquire()


def test_outside_torchrun_a_lock_of_another_host_is_never_taken(tmp_path, monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    _owner(tmp_path, host="elsewhere", pid=1, job="job7", round=0)
    with pytest.raises(ConfigError, match="in use by another run"):
        OutputDirLock(tmp_path).acquire()


def test_remove_if_stale_removes_only_a_dead_process_lock_of_this_host(tmp_path):
    import subprocess
    import sys

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()
    _owner(tmp_path, host=socket.gethostname(), pid=int(dead))
    OutputDirLock(tmp_path).remove_if_stale()
    assert not (tmp_path / LOCK_FILE).exists()
    for owner in ({"host": socket.gethostname(), "pid": os.getppid()},  # alive
                  {"host": "elsewhere", "pid": int(dead)}):             # cannot tell
        _owner(tmp_path, **owner)
        OutputDirLock(tmp_path).remove_if_stale()
        assert (tmp_path / LOCK_FILE).exists()
