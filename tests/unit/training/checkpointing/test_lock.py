"""tune_recipes.training.checkpointing.lock: one run per output_dir."""

import json
import os
import socket
import subprocess
import sys

import pytest

from tune_recipes.config import ConfigError
from tune_recipes.training.checkpointing.lock import LOCK_FILE, OutputDirLock

pytestmark = pytest.mark.unit


def test_a_second_run_is_refused_naming_the_owner(tmp_path):
    first = OutputDirLock(tmp_path).acquire()
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    first.release()
    assert not (tmp_path / LOCK_FILE).exists()
    # Another live process (our parent) holds it.
    owner = os.getppid()
    (tmp_path / LOCK_FILE).write_text(json.dumps({"host": socket.gethostname(), "pid": owner}))
    with pytest.raises(ConfigError, match=f"in use by another run \\(pid {owner} on"):
        OutputDirLock(tmp_path).acquire()
    # A lock this process left (an earlier run in a notebook) is its own to take.
    (tmp_path / LOCK_FILE).write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid()}))
    OutputDirLock(tmp_path).acquire().release()


def test_a_stale_lock_is_taken_over(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()
    (tmp_path / LOCK_FILE).write_text(json.dumps({"host": socket.gethostname(), "pid": int(dead)}))
    lock = OutputDirLock(tmp_path).acquire()
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    lock.release()
    (tmp_path / LOCK_FILE).write_text("")  # half-written by a killed process
    OutputDirLock(tmp_path).acquire().release()


def test_an_output_dir_that_cannot_be_created_is_one_error(tmp_path):
    (tmp_path / "f").write_text("")
    with pytest.raises(ConfigError, match="cannot create output_dir"):
        OutputDirLock(tmp_path / "f" / "out").acquire()
