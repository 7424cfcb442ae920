"""The output_dir lock across torchrun restarts (lock.py): rank 0 of a restarted round takes
over its job's lock, wherever the earlier round's rank 0 ran, whatever restart count each node
keeps; nothing else does."""

import json
import os
import socket

import pytest

from tune_recipes.config import ConfigError
from tune_recipes.training.checkpointing.lock import LOCK_FILE, OutputDirLock

pytestmark = pytest.mark.unit


def _owner(tmp_path, **fields):
    (tmp_path / LOCK_FILE).write_text(json.dumps(fields))


@pytest.mark.parametrize("job, host, taken", [
    # This job's lock from another node: an earlier round's rank 0 (a round has one), whatever
    # restart count that node kept (torchrun counts per node: healthy nodes do not count).
    ("job7", "node-that-died", True),
    # This host, a live process of this job: not an earlier round (torchrun stopped those).
    ("job7", "this-host", False),
    ("other", "node-that-died", False),  # another job
    ("none", "node-that-died", False),   # torchrun's default id: every job without --rdzv_id
])
def test_a_restarted_round_takes_over_its_jobs_lock(tmp_path, monkeypatch, job, host, taken):
    host = socket.gethostname() if host == "this-host" else host
    pid = os.getppid()  # alive, so on this host only the job could make it stale
    _owner(tmp_path, host=host, pid=pid, **({"job": job} if job != "none" else {}))
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", job if job == "none" else "job7")
    lock = OutputDirLock(tmp_path)
    if taken:
        lock.acquire()
        mine = json.loads((tmp_path / LOCK_FILE).read_text())
        assert mine["pid"] == os.getpid() and mine["job"] == "job7"
        lock.release()
    else:
        with pytest.raises(ConfigError, match="in use by another run"):
            lock.acquire()


def test_outside_torchrun_a_lock_of_another_host_is_never_taken(tmp_path, monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    _owner(tmp_path, host="elsewhere", pid=1, job="job7")
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
