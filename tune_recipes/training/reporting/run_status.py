"""Where the running process stands, for the one line a Ctrl-C or SIGTERM prints
(``_cli/launch.py``).

The step driver records each finished step, the checkpoint writer each published checkpoint;
reading it costs nothing, so no signal handler has to touch the training state.
"""

import contextlib
import shlex
import signal
from pathlib import Path
from typing import List, Optional

_status = {"step": 0, "checkpoint": None}


def step_finished(global_step: int) -> None:
    _status["step"] = global_step


def checkpoint_saved(path) -> None:
    _status["checkpoint"] = str(path)


# Signals whose handlers print the one line (``_cli/launch.py``).
_STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM}


@contextlib.contextmanager
def stop_signals_held():
    """Hold Ctrl-C and SIGTERM until the block ends (then they act as usual): for a
    checkpoint's rename into place and its ``checkpoint_saved`` record, so a signal between
    the two cannot print "no checkpoint saved" beside a complete checkpoint. A no-op where
    the platform cannot mask signals (Windows)."""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    held = signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


def interrupted_message(script: Path, args: List[str], step: Optional[int] = None,
                        checkpoint: Optional[str] = None, how: str = "interrupted") -> str:
    """``interrupted at step N; last checkpoint ...; resume with ...`` in one line (``how``:
    what stopped it, e.g. ``terminated (SIGTERM)``)."""
    step = _status["step"] if step is None else step
    checkpoint = _status["checkpoint"] if checkpoint is None else checkpoint
    if checkpoint is None:
        return f"{how} at step {step}; no checkpoint saved by this run"
    return f"{how} at step {step}; last checkpoint {checkpoint}; {resume_hint(script, args)}"


def resume_hint(script: Path, args: List[str], checkpoint=None, launcher: List[str] = ()) -> str:
    """``resume with: tune run [LAUNCHER] RECIPE ARGS resume_from_checkpoint=True`` (``auto``
    where no checkpoint is known: it resumes if one was saved, else starts afresh)."""
    keep = [a for a in args if not a.startswith("resume_from_checkpoint=")]
    known = checkpoint is not None or _status["checkpoint"] is not None
    command = shlex.join(["tune", "run", *launcher, Path(script).stem, *keep,
                          f"resume_from_checkpoint={'True' if known else 'auto'}"])
    return f"resume with: {command}"
