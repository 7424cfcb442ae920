"""Where the running process stands, for the one line a Ctrl-C prints (``_cli/launch.py``).

The step driver records each finished step, the checkpoint writer each published checkpoint;
reading it costs nothing, so no signal handler has to touch the training state.
"""

import shlex
from pathlib import Path
from typing import List, Optional

_status = {"step": 0, "checkpoint": None}


def step_finished(global_step: int) -> None:
    _status["step"] = global_step


def checkpoint_saved(path) -> None:
    _status["checkpoint"] = str(path)


def interrupted_message(script: Path, args: List[str], step: Optional[int] = None,
                        checkpoint: Optional[str] = None) -> str:
    """``interrupted at step N; last checkpoint ...; resume with ...`` in one line."""
    step = _status["step"] if step is None else step
    checkpoint = _status["checkpoint"] if checkpoint is None else checkpoint
    if checkpoint is None:
        return f"interrupted at step {step}; no checkpoint saved by this run"
    rerun = [a for a in args if not a.startswith("resume_from_checkpoint=")]
    command = shlex.join(["tune", "run", Path(script).stem, *rerun, "resume_from_checkpoint=True"])
    return f"interrupted at step {step}; last checkpoint {checkpoint}; resume with: {command}"
