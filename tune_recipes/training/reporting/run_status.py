"""Where the running process stands, for the one line a Ctrl-C or SIGTERM prints
(``_cli/launch.py``).

The step driver records each finished step, the checkpoint writer each published checkpoint;
reading it costs nothing, so no signal handler has to touch the training state.
"""

import shlex
from pathlib import Path
from typing import List, Optional

_status = {"step": 0, "checkpoint": None, "publishing": None}


def step_finished(global_step: int) -> None:
    _status["step"] = global_step


def checkpoint_saved(path) -> None:
    _status["checkpoint"] = str(path)
    _status["publishing"] = None


def checkpoint_publishing(staged, final) -> None:
    """Called before ``staged`` is renamed to ``final``: a signal can land between the rename
    and ``checkpoint_saved``, so the line asks the disk (``last_checkpoint``)."""
    _status["publishing"] = (str(staged), str(final))


def last_checkpoint() -> Optional[str]:
    """The newest checkpoint this run saved: the one being published counts once its staged
    folder has been renamed into place."""
    pending = _status.get("publishing")
    if pending is not None:
        staged, final = (Path(p) for p in pending)
        if not staged.exists() and final.exists():
            return str(final)
    return _status["checkpoint"]


def interrupted_message(script: Path, args: List[str], step: Optional[int] = None,
                        checkpoint: Optional[str] = None, how: str = "interrupted") -> str:
    """``interrupted at step N; last checkpoint ...; resume with ...`` in one line (``how``:
    what stopped it, e.g. ``terminated (SIGTERM)``)."""
    step = _status["step"] if step is None else step
    checkpoint = last_checkpoint() if checkpoint is None else checkpoint
    if checkpoint is None:
        return f"{how} at step {step}; no checkpoint saved by this run"
    return f"{how} at step {step}; last checkpoint {checkpoint}; {resume_hint(script, args)}"


def resume_hint(script: Path, args: List[str], checkpoint=None, launcher: List[str] = ()) -> str:
    """``resume with: tune run [LAUNCHER] RECIPE ARGS resume_from_checkpoint=True`` (``auto``
    where no checkpoint is known: it resumes if one was saved, else starts afresh)."""
    keep = [a for a in args if not a.startswith("resume_from_checkpoint=")]
    known = checkpoint is not None or last_checkpoint() is not None
    command = shlex.join(["tune", "run", *launcher, Path(script).stem, *keep,
                          f"resume_from_checkpoint={'True' if known else 'auto'}"])
    return f"resume with: {command}"
