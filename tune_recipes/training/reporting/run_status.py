"""Where the running process stands, for the one line a Ctrl-C or SIGTERM prints
(``_cli/launch.py``).

The step driver records each finished step, the checkpoint writer each published checkpoint
(and whether it is the run's final one), the resume the checkpoint it continues from; reading
it costs nothing, so no signal handler has to touch the training state.
"""

import os
import shlex
from pathlib import Path
from typing import List, Optional

_status = {}


def reset() -> None:
    """A new run: no step, no checkpoint."""
    _status.clear()
    _status.update(step=0, checkpoint=None, publishing=None, final=False, resumed_from=None)


reset()


def step_finished(global_step: int) -> None:
    _status["step"] = global_step


def resuming_from(checkpoint) -> None:
    """The run continues from ``checkpoint`` (an earlier run's): until this run saves one, it is
    the checkpoint to resume from again."""
    _status["resumed_from"] = str(checkpoint)


def checkpoint_saved(path, final: bool = False) -> None:
    """``final``: the run's last checkpoint, with its finished-run record: nothing to resume."""
    _status["checkpoint"] = str(path)
    _status["publishing"] = None
    _status["final"] = final


def checkpoint_publishing(staged, final_dir, final: bool = False) -> None:
    """Called before ``staged`` is renamed to ``final_dir``: a signal can land between the
    rename and ``checkpoint_saved``, so the line asks the disk (``last_checkpoint``)."""
    _status["publishing"] = (str(staged), str(final_dir), final)


def _published() -> Optional[tuple]:
    """(folder, final) of the newest checkpoint this run saved, or None: the one being published
    counts once its staged folder has been renamed into place."""
    pending = _status.get("publishing")
    if pending is not None:
        staged, final_dir = (Path(p) for p in pending[:2])
        if not staged.exists() and final_dir.exists():
            return str(final_dir), pending[2]
    if _status["checkpoint"] is None:
        return None
    return _status["checkpoint"], _status.get("final", False)


def last_checkpoint() -> Optional[str]:
    """The newest checkpoint this run saved, else the one it resumed from (None: neither)."""
    published = _published()
    return published[0] if published is not None else _status.get("resumed_from")


def interrupted_message(script: Path, args: List[str], step: Optional[int] = None,
                        checkpoint: Optional[str] = None, how: str = "interrupted") -> str:
    """``interrupted at step N; last checkpoint ...; resume with ...`` in one line (``how``:
    what stopped it, e.g. ``terminated (SIGTERM)``). A run stopped after its final checkpoint
    has nothing to resume; one stopped while resuming names the checkpoint it resumes from."""
    step = _status["step"] if step is None else step
    published = _published()
    if checkpoint is None and published is not None and published[1]:
        return (f"{how} after the run finished (step {step}); its final checkpoint "
                f"{published[0]} is complete, nothing to resume")
    checkpoint = last_checkpoint() if checkpoint is None else checkpoint
    if checkpoint is None:
        line = f"{how} at step {step}; no checkpoint saved by this run"
        asked = [a.split("=", 1)[1] for a in args if a.startswith("resume_from_checkpoint=")]
        if step == 0 and asked and asked[-1].lower() not in ("false", "0", "no", "off"):
            # Stopped before the resume began (while the process started): the checkpoint it
            # was asked to resume is where it was.
            line += f", nor any checkpoint resumed yet; {resume_hint(script, args)}"
        return line
    if published is None and step == 0:  # no step run since the resume
        return (f"{how} while resuming from {checkpoint}, before its first step; "
                f"{resume_hint(script, args)}")
    return f"{how} at step {step}; last checkpoint {checkpoint}; {resume_hint(script, args)}"


def resume_hint(script: Path, args: List[str], checkpoint=None, launcher: List[str] = ()) -> str:
    """``resume with: tune run [LAUNCHER] RECIPE ARGS output_dir=DIR resume_from_checkpoint=True``
    (``auto`` where no checkpoint is known: it resumes if one was saved, else starts afresh).
    ``DIR``: the folder holding the checkpoint, absolute. NOTE: written out whenever a checkpoint
    is known, whatever the arguments said, and a config file given by a relative path made
    absolute: the config's output_dir may come from the environment
    (``${oc.env:TUNE_RECIPES_OUTPUT,outputs}``) or be relative to the folder the run started
    in, and the command pasted into another shell would then resume another run's folder."""
    checkpoint = last_checkpoint() if checkpoint is None else checkpoint
    keep = [a for a in args if not a.startswith("resume_from_checkpoint=")]
    for i in range(len(keep) - 1):
        if keep[i] == "--config" and not os.path.isabs(keep[i + 1]) and os.path.isfile(keep[i + 1]):
            keep[i + 1] = os.path.abspath(keep[i + 1])
    if checkpoint is not None:
        keep = [a for a in keep if not a.startswith("output_dir=")]
        keep.append(f"output_dir={Path(os.path.abspath(checkpoint)).parent}")
    command = shlex.join(["tune", "run", *launcher, Path(script).stem, *keep,
                          f"resume_from_checkpoint={'True' if checkpoint is not None else 'auto'}"])
    return f"resume with: {command}"
