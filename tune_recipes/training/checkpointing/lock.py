"""One run per ``output_dir`` at a time: ``output_dir/.lock`` holds the owner's host and pid.

Two runs writing one ``output_dir`` interleave ``metrics.jsonl`` and overwrite each other's
checkpoints. The second run stops with one line naming the first one's pid. A lock whose
process is gone (killed, crashed) on this host is stale and taken over.

Under torchrun the lock also records the job (``TORCHELASTIC_RUN_ID``, torchrun's
``--rdzv_id``): after a rank dies, torchrun restarts every process (``--max_restarts``), and rank
0 of the new round takes over the lock of the same job, even where the earlier round's rank 0 ran
on another node (whose pid cannot be checked from here). A job's rounds are told apart by the
holder, not by a restart count: torchrun counts restarts per node, so nodes disagree on it.
torchrun's default id ``none`` (static rendezvous without ``--rdzv_id``) names no job.
"""

import atexit
import json
import os
import socket
from pathlib import Path
from typing import Optional

from tune_recipes.config import ConfigError

LOCK_FILE = ".lock"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return True


def _elastic_job() -> dict:
    """This torchrun job's id (``{}`` outside torchrun, or under torchrun's default id ``none``,
    which every job without ``--rdzv_id`` shares)."""
    job = os.environ.get("TORCHELASTIC_RUN_ID")
    return {"job": job} if job and job != "none" else {}


class OutputDirLock:
    def __init__(self, output_dir) -> None:
        self.path = Path(output_dir) / LOCK_FILE
        self.held = False

    def acquire(self) -> "OutputDirLock":
        me = {"host": socket.gethostname(), "pid": os.getpid(), **_elastic_job()}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"cannot create output_dir {self.path.parent}: {e.strerror or e}") from None
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                self.refuse_if_in_use()
                self.path.unlink(missing_ok=True)  # stale: its process is gone
                continue
            except OSError as e:
                raise self._unwritable(e) from None
            try:
                with os.fdopen(fd, "w") as f:
                    json.dump(me, f)
            except OSError as e:  # a full disk: the file exists, its bytes did not fit
                self.path.unlink(missing_ok=True)
                raise self._unwritable(e) from None
            self.held = True
            atexit.register(self.release)
            return self
        raise ConfigError(f"cannot take the lock {self.path}; delete it if no run uses it")

    def _unwritable(self, e: OSError) -> ConfigError:
        return ConfigError(f"cannot write to output_dir {self.path.parent}: {e.strerror or e} "
                           f"({self.path})")

    def refuse_if_in_use(self) -> None:
        """ConfigError naming the live run that holds the lock, if one does (a stale lock, or
        none, passes)."""
        owner = self._owner() if self.path.exists() else None
        if owner is not None and not self._stale(owner):
            raise ConfigError(
                f"output_dir {self.path.parent} is in use by another run (pid "
                f"{owner.get('pid')} on {owner.get('host')}); wait for it to finish or "
                f"choose another output_dir (if no such run exists, delete {self.path})"
            )

    def _owner(self) -> Optional[dict]:
        try:
            return json.loads(self.path.read_text())
        except (OSError, ValueError):
            return None  # unreadable or half-written by a killed process: stale

    def remove_if_stale(self) -> None:
        """Delete a lock whose process on this host is gone (a rank killed by a signal runs no
        exit handler); a live run's, or another host's, stays."""
        owner = self._owner() if self.path.exists() else None
        if owner is not None and owner.get("host") == socket.gethostname() \
                and isinstance(owner.get("pid"), int) and not _alive(owner["pid"]):
            self.path.unlink(missing_ok=True)

    @staticmethod
    def _stale(owner: dict) -> bool:
        job = _elastic_job()
        if job and owner.get("job") == job["job"] and owner.get("host") != socket.gethostname():
            # This job's lock from another node: a round has one rank 0, so the holder belongs
            # to an earlier round, which torchrun stopped before starting this one. (On this
            # host the pid check below tells.)
            return True
        if owner.get("host") != socket.gethostname():
            return False  # another machine's process: cannot tell, assume alive
        pid = owner.get("pid")
        # Our own pid: an earlier run in this process (a notebook, a test) that ended.
        return not isinstance(pid, int) or pid == os.getpid() or not _alive(pid)

    def release(self) -> None:
        if not self.held:
            return
        self.held = False
        owner = self._owner()
        if owner is not None and owner.get("pid") == os.getpid():
            self.path.unlink(missing_ok=True)
