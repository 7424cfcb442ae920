"""Checkpoint I/O glue around torchtune's checkpointers."""

import json
import os
import pickle
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple, Union

import torch
from omegaconf import DictConfig, OmegaConf
from torchtune import training
from torchtune.utils import get_logger

from tune_recipes.constants import EPOCH_DIR_PATTERN, STEP_DIR_PATTERN
from tune_recipes.config import ConfigError
from tune_recipes.validation import brief

log = get_logger("INFO")

_EPOCH_DIR = re.compile(EPOCH_DIR_PATTERN)
# Mid-epoch checkpoints (save_every_n_steps), named by the global optimizer step.
STEP_DIR = re.compile(STEP_DIR_PATTERN)
RECIPE_STATE_FILE = Path("recipe_state") / "recipe_state.pt"
# Each intermediate epoch folder holds its own copy: a folder and its state appear together.
EPOCH_STATE_FILE = "recipe_state.pt"
# The final epoch folder's record of what a continuation must keep (seed, steps per epoch,
# epochs run): it holds no recipe_state.pt (no optimizer state to resume).
FINISHED_RUN_FILE = "finished_run.json"
ADAPTER_FILE = "adapter_model.pt"  # torchtune's name for the adapter it loads on resume
ADAPTER_CONFIG_FILE = "adapter_config.json"  # the PEFT adapter's config
PEFT_ADAPTER_FILE = "adapter_model.safetensors"  # the PEFT adapter's weights
# Keys of a mid-epoch checkpoint's recipe state (tune_recipes.training.checkpointing.state).
GLOBAL_STEP_KEY = "global_step"
RANK_STATES_KEY = "rank_states"
# resume_from_checkpoint: auto resumes from the newest checkpoint if there is one, else starts
# afresh: what a torchrun restart (--max_restarts) needs, whether or not a rank died before
# the first checkpoint.
AUTO = "auto"


class CheckpointError(ConfigError):
    """A checkpoint in ``output_dir`` cannot be used (unsafe, truncated, unreadable, or not
    the one it should be). A ConfigError, so recipes report it in one line (exit 2)."""


def load_recipe_state(path: Path) -> Dict[str, object]:
    """The recipe state at ``path``, unpickled with ``weights_only=True``: tensors, numbers,
    strings, lists and dicts only.

    NOTE: never ``weights_only=False`` here. ``output_dir`` may hold a file someone else wrote
    (a shared disk, a downloaded run); a full unpickle runs whatever code the file names before
    anything can check it.
    """
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(
            f"{path} holds objects other than tensors and plain values; refusing to unpickle it "
            f"(it could run code). Delete it or resume from a checkpoint you wrote ({first})"
        ) from None
    except Exception as e:  # truncated (a kill mid-write), not a torch file, unreadable
        folder = Path(path).parent
        way_on = (f"; restore it, or remove {folder} to resume from the checkpoint before it"
                  if STEP_DIR.match(folder.name) or _EPOCH_DIR.match(folder.name) else "")
        raise CheckpointError(
            f"cannot read the recipe state {path}: {type(e).__name__}: {brief(e)}{way_on}"
        ) from None



def _numbered_dirs(output_dir: Path, pattern: "re.Pattern") -> List[Tuple[int, Path]]:
    return sorted((int(m.group(1)), p) for p in Path(output_dir).iterdir()
                  if p.is_dir() and (m := pattern.match(p.name))) if Path(output_dir).is_dir() else []


def latest_epoch_dir(output_dir: Path) -> Optional[Path]:
    dirs = _numbered_dirs(output_dir, _EPOCH_DIR)
    return dirs[-1][1] if dirs else None


def step_dirs(output_dir: Path) -> List[Path]:
    """The mid-epoch checkpoints ``step_<n>/`` in ``output_dir``, oldest first. Each one is
    complete: the writer renames a folder into place only after everything in it is written."""
    return [p for _, p in _numbered_dirs(output_dir, STEP_DIR)]


def refuse_stale_step_checkpoints(output_dir: Path) -> None:
    """A fresh run (no ``resume_from_checkpoint``) must not start beside an earlier run whose
    newest checkpoint is a ``step_<n>/`` folder: that run was interrupted mid-epoch, most
    likely meant to be resumed, so this is a ConfigError naming both ways out. Step folders
    older than the newest ``epoch_<n>/`` (the run went on past them, or finished) move aside
    with the epochs (``keep_earlier_checkpoints_aside``)."""
    stale = step_dirs(output_dir)
    if stale and newest_checkpoint_dir(output_dir) != latest_epoch_dir(output_dir):
        names = ", ".join(p.name for p in stale[:3]) + (" ..." if len(stale) > 3 else "")
        raise ConfigError(
            f"output_dir {output_dir} holds mid-epoch checkpoints of an earlier run ({names}): "
            "resume it with resume_from_checkpoint=True, or remove them or choose another "
            "output_dir to start afresh"
        )


def newest_checkpoint_dir(output_dir: Path) -> Optional[Path]:
    """The newest checkpoint in ``output_dir``: the last ``epoch_<e>/`` or the last
    ``step_<n>/``, whichever the run wrote later.

    A step checkpoint's recipe state records the epoch it was written in (``epochs_run``
    epochs done before it); it is newer than ``epoch_<e>/`` exactly when that is past ``e``.
    Comparing this way needs no steps-per-epoch, which is only known once the data is built.
    """
    epoch_dir = latest_epoch_dir(output_dir)
    steps = step_dirs(output_dir)
    if not steps:
        return epoch_dir
    if epoch_dir is None:
        return steps[-1]
    state_path = steps[-1] / EPOCH_STATE_FILE
    if not state_path.is_file():
        raise CheckpointError(f"{steps[-1]} has no {EPOCH_STATE_FILE}: it was not written by "
                              "this recipe's checkpoint writer; remove it to resume")
    in_epoch = load_recipe_state(state_path).get(training.EPOCHS_KEY)
    epoch = int(_EPOCH_DIR.match(epoch_dir.name).group(1))
    return steps[-1] if isinstance(in_epoch, int) and in_epoch > epoch else epoch_dir


def _model_files(epoch_dir: Path):
    index = epoch_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            return sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            # Emptied or cut short by a kill or a full disk (our writer never publishes one so).
            raise CheckpointError(
                f"cannot read {index}: {type(e).__name__}: {brief(e)}; restore it, or "
                f"remove {epoch_dir} to resume from the checkpoint before it") from None
    files = sorted(p.name for p in epoch_dir.glob("*.safetensors") if not p.name.startswith("adapter"))
    return files or sorted(p.name for p in epoch_dir.glob("*.bin"))


def checkpointer_config_for_resume(cfg_checkpointer: DictConfig, output_dir: str,
                                   full_weights: Optional[bool]) -> DictConfig:
    """Point the checkpointer at the newest checkpoint in ``output_dir``: an epoch's
    ``epoch_<e>/`` or a mid-epoch ``step_<n>/`` (``newest_checkpoint_dir``).

    torchtune 0.6.1's HF checkpointer, when resuming a full fine-tune, looks for the *original*
    file names directly in ``output_dir``, while it saved them under ``output_dir/epoch_<n>/``;
    a resume then fails with "No file with name ...". Here the files of the chosen folder are
    named explicitly (the adapter too: torchtune would only look in the newest ``epoch_*``),
    and the recipe state is checked to belong to that folder.
    """
    out = Path(output_dir)
    ckpt_dir = newest_checkpoint_dir(out)
    if ckpt_dir is not None and STEP_DIR.match(ckpt_dir.name):
        state_path = ckpt_dir / EPOCH_STATE_FILE  # checked by newest_checkpoint_dir
        state = load_recipe_state(state_path)
        step = int(STEP_DIR.match(ckpt_dir.name).group(1))
        if state.get(GLOBAL_STEP_KEY) != step or state.get(RANK_STATES_KEY) is None:
            raise CheckpointError(
                f"{state_path} is not the state of a mid-epoch checkpoint at step {step} "
                f"(its global_step is {state.get(GLOBAL_STEP_KEY)!r}); remove {ckpt_dir} to "
                "resume from the checkpoint before it"
            )
    else:
        ckpt_dir = _checked_epoch_dir(out)
        state_path = ckpt_dir / EPOCH_STATE_FILE
        if not state_path.is_file():
            state_path = out / RECIPE_STATE_FILE  # an older layout: one shared state file
    cfg = OmegaConf.create(OmegaConf.to_container(cfg_checkpointer, resolve=True))
    # The state checked here is the one torchtune loads (relative to output_dir).
    _take_from_the_resume_checkpoint(cfg, "recipe_checkpoint", state_path, out, ckpt_dir)
    refuse_another_recipes_checkpoint(ckpt_dir, full_weights)
    if full_weights:
        files = _model_files(ckpt_dir)
        missing = [f for f in files if not (ckpt_dir / f).is_file()]
        if not files or missing:
            what = f"{', '.join(missing)} (named by its index) is missing" if missing else \
                "it holds no model weights"
            raise CheckpointError(f"cannot resume from {ckpt_dir}: {what}; restore it, or remove "
                                  "that folder to resume from the checkpoint before it")
        # Relative to output_dir, where torchtune looks when it loads recipe state.
        cfg.checkpoint_files = [f"{ckpt_dir.name}/{f}" for f in files]
    elif (ckpt_dir / ADAPTER_FILE).is_file():
        _take_from_the_resume_checkpoint(cfg, "adapter_checkpoint", ckpt_dir / ADAPTER_FILE, out,
                                         ckpt_dir)
    elif full_weights is False:  # a LoRA-type recipe resumes its adapter (None: not known)
        raise CheckpointError(f"cannot resume from {ckpt_dir}: {ADAPTER_FILE} is missing; restore "
                              "it, or remove that folder to resume from the checkpoint before it")
    return cfg


def refuse_another_recipes_checkpoint(ckpt_dir: Path, full_weights: Optional[bool]) -> None:
    """A CheckpointError where ``ckpt_dir`` was written by the other kind of recipe: a LoRA
    adapter where this recipe trains every weight (``full_weights``), or model weights and no
    adapter where it trains an adapter (None: the recipe is not known, nothing to check).

    NOTE: the message must not say "remove that folder": it is a complete checkpoint of another
    recipe's run, and every older one in ``output_dir`` would fail the same way."""
    # The adapter's weights (adapter_model.pt or .safetensors), which only a LoRA-type recipe
    # writes: a LoRA folder that lost one of the two is still a LoRA folder, whose own errors
    # say so. NOTE: not adapter_config.json: torchtune's checkpointer copies that file from
    # checkpoint_dir into a full fine-tune's folders too (a run started from a LoRA run's
    # merged weights, or a Hub repo that ships one); the writer drops that copy
    # (``drop_another_runs_records``), but folders written by torchtune's recipes keep it.
    has_adapter = any((ckpt_dir / name).is_file() for name in (ADAPTER_FILE, PEFT_ADAPTER_FILE))
    if full_weights and has_adapter:
        holds, writer = "a LoRA adapter", "a LoRA-type recipe"
    elif full_weights is False and not has_adapter and _model_files(ckpt_dir):
        holds, writer = ("model weights and no LoRA adapter",
                         "a recipe that trains every weight (or it lost its adapter files)")
    else:
        return
    raise CheckpointError(f"cannot resume from {ckpt_dir} with this recipe: it holds {holds}, "
                          f"written by {writer}; resume it with the recipe that wrote it, or "
                          "start this recipe's run in another output_dir")


def _take_from_the_resume_checkpoint(cfg: DictConfig, key: str, path: Path, out: Path,
                                     ckpt_dir: Path) -> None:
    """``cfg[key]`` = ``path`` (relative to ``out``, as torchtune reads it). NOTE: a value the
    user set is overridden, not honoured: an exact resume needs the weights, the adapter and the
    recipe state (optimizer, data position) of one checkpoint, and torchtune's way of resuming
    (``recipe_checkpoint: recipe_state/recipe_state.pt``) names the newest epoch's state even
    beside a newer ``step_<n>/``, whose weights the resume takes."""
    wanted = str(path.relative_to(out))
    given = cfg.get(key)
    if given and (out / str(given)).resolve() != path.resolve() \
            and not _the_chosen_epochs_copy(out / str(given), path):
        line = (f"checkpointer.{key}={given} is not used: the resume takes the weights and the "
                f"state of one checkpoint, {ckpt_dir.name}/ ({key}: {wanted})")
        if line not in _SAID:  # once: tune run's check before the recipe, then the recipe
            _SAID.add(line)
            log.warning(line)
    cfg[key] = wanted


_SAID = set()


def _the_chosen_epochs_copy(given: Path, chosen: Path) -> bool:
    """Whether ``given`` is ``recipe_state/recipe_state.pt``, the copy of the newest epoch's
    state, and ``chosen`` that epoch's own (torchtune's documented way names the copy)."""
    out = chosen.parent.parent
    if given.resolve() != (out / RECIPE_STATE_FILE).resolve() \
            or not _EPOCH_DIR.match(chosen.parent.name) or not given.is_file():
        return False
    mine, theirs = load_recipe_state(chosen), load_recipe_state(given)
    return mine.get(training.EPOCHS_KEY) == theirs.get(training.EPOCHS_KEY)


@dataclass
class ResumePoint:
    """The checkpoint a run continues from. ``finished``: the final ``epoch_<e>/`` of a run
    that completed its epochs, which holds the weights but no recipe or optimizer state (the
    writer saves those only while epochs remain); ``epochs_done``: e + 1 then."""

    checkpoint: Path
    finished: bool = False
    epochs_done: int = 0


def resume_point(output_dir: str, resume: Union[bool, str]) -> Optional[ResumePoint]:
    """Where a run with ``resume_from_checkpoint=resume`` continues from; None: it starts
    afresh (False, or ``auto`` with no checkpoint in ``output_dir``). True with no checkpoint
    is a ConfigError."""
    if resume is not True and resume != AUTO:
        return None
    out = Path(output_dir)
    newest = newest_checkpoint_dir(out)
    if newest is None:
        if resume == AUTO:
            return None
        kept = sorted(p.name for p in out.glob("checkpoints.*") if p.is_dir())
        moved = (f" (an earlier run's, moved aside by a fresh run: {', '.join(kept)}/; move its "
                 "folders back to resume it)") if kept else ""
        raise ConfigError(
            f"resume_from_checkpoint=True but {out} holds no checkpoint to resume (an "
            f"epoch_<n>/ or step_<n>/ folder with its recipe_state.pt){moved}; run without "
            "resume_from_checkpoint first (or with resume_from_checkpoint=auto)"
        )
    if STEP_DIR.match(newest.name) or (newest / EPOCH_STATE_FILE).is_file():
        return ResumePoint(newest)
    epoch = int(_EPOCH_DIR.match(newest.name).group(1))
    shared = out / RECIPE_STATE_FILE
    if shared.is_file() and load_recipe_state(shared).get(training.EPOCHS_KEY) == epoch + 1:
        return ResumePoint(newest)  # an older layout: one shared state file for the newest epoch
    return ResumePoint(newest, finished=True, epochs_done=epoch + 1)


def checkpointer_config_for_finished_run(cfg_checkpointer: DictConfig, point: ResumePoint,
                                         full_weights: Optional[bool]) -> DictConfig:
    """The checkpointer for continuing a finished run from its final ``epoch_<e>/``: the
    model files of that folder by absolute path (``full_weights``), or the config's base
    weights (the adapter is loaded from the folder by ``load_checkpoint``); no recipe state.
    ``full_weights=None`` (``tune validate``, which does not know the recipe): the folder
    must hold model weights or an adapter."""
    ckpt_dir = point.checkpoint
    refuse_another_recipes_checkpoint(ckpt_dir, full_weights)
    files = _model_files(ckpt_dir)
    has_weights = bool(files) and all((ckpt_dir / f).is_file() for f in files)
    has_adapter = (ckpt_dir / ADAPTER_FILE).is_file()
    ok = {True: has_weights, False: has_adapter, None: has_weights or has_adapter}[full_weights]
    if not ok:
        # Neither: one message whoever asks (tune validate, not knowing the recipe, says the same).
        what = f"model weights or adapter ({ADAPTER_FILE})" if not has_weights | has_adapter \
            else {True: "model weights", False: f"adapter ({ADAPTER_FILE})"}[full_weights]
        raise CheckpointError(
            f"{ckpt_dir} is the final checkpoint of a finished run and holds no {what} to "
            "continue from; restore it, or start afresh in another output_dir")
    cfg = OmegaConf.create(OmegaConf.to_container(cfg_checkpointer, resolve=True))
    if full_weights:
        cfg.checkpoint_files = [str((ckpt_dir / f).resolve()) for f in files]
    cfg.pop("recipe_checkpoint", None)
    cfg.pop("adapter_checkpoint", None)
    return cfg


def refuse_checkpoints_elsewhere(cfg_checkpointer: DictConfig, output_dir: str) -> None:
    """``checkpointer.output_dir`` must be ``output_dir`` (torchtune's configs set it to
    ``${output_dir}``). NOTE: torchtune's checkpointer writes the epoch folders into its own
    ``output_dir``, while resuming, the step folders, the guard against a fresh run over an
    earlier one and the lock all read ``output_dir``: apart, a resume found nothing and a fresh
    run wrote over the earlier run's checkpoints."""
    where = cfg_checkpointer.get("output_dir") if cfg_checkpointer is not None else None
    if where is None or Path(str(where)).expanduser().resolve() == Path(output_dir).expanduser().resolve():
        return
    raise ConfigError(
        f"checkpointer.output_dir={where} is not output_dir={output_dir}: the recipes keep a "
        "run's checkpoints, recipe state and metrics in one folder (resume and the checks that "
        "keep an earlier run's checkpoints look there); set 'checkpointer.output_dir=${output_dir}', "
        f"or output_dir={where} to keep everything there")


def checkpointer_config_for_output_dir(cfg_checkpointer: DictConfig, output_dir: str,
                                      resume: Union[bool, str],
                                      full_weights: Optional[bool]) -> DictConfig:
    """What ``output_dir`` allows, checked before anything is loaded: a resume gets the
    checkpointer pointed at its newest checkpoint (``checkpointer_config_for_resume``; a
    finished run's final epoch: ``checkpointer_config_for_finished_run``); a fresh run
    (``auto`` with nothing to resume included) is refused beside an earlier run's
    ``step_<n>/`` (``refuse_stale_step_checkpoints``). Raises ConfigError. The recipes and
    ``tune validate`` both call it, so they agree."""
    refuse_checkpoints_elsewhere(cfg_checkpointer, output_dir)
    point = resume_point(output_dir, resume)
    if point is None:
        refuse_stale_step_checkpoints(Path(output_dir))
        return cfg_checkpointer
    if point.finished:
        return checkpointer_config_for_finished_run(cfg_checkpointer, point, full_weights)
    return checkpointer_config_for_resume(cfg_checkpointer, output_dir, full_weights)


def paths_the_run_reads(cfg: DictConfig) -> Dict[str, str]:
    """The config's paths a run reads its weights and tokenizer from, by key."""
    keys = ("checkpointer.checkpoint_dir", "teacher_checkpointer.checkpoint_dir",
            "tokenizer.path", "tokenizer.merges_file")
    found = {key: OmegaConf.select(cfg, key, default=None) for key in keys}
    return {key: str(value) for key, value in found.items() if isinstance(value, str) and value}


def refuse_reading_an_earlier_step(output_dir: str, read_by_the_run: Dict[str, str]) -> None:
    """A fresh run that reads from a ``step_<n>/`` folder of an earlier run in its own
    ``output_dir`` is a ConfigError: that folder would move aside (or be resumed over this run's
    checkpoints). Read-only, so every rank, ``tune run`` and ``tune validate`` make it."""
    out = Path(output_dir)
    for key, path in read_by_the_run.items():
        inside = next((d for d in step_dirs(out) if _is_within(Path(path), d)), None)
        if inside is not None:
            raise ConfigError(
                f"{key}={path} reads from {inside.name}/, a mid-epoch checkpoint of an earlier "
                f"run in {out}: copy it out of output_dir first, or choose another output_dir")


QUANTIZED_RECORD_FILE = "quantize.json"  # the quantize recipe's record beside its model


def quantized_record(folder: Path) -> Optional[dict]:
    """The quantize recipe's ``quantize.json`` in ``folder``, or None (none, or unreadable)."""
    try:
        record = json.loads((Path(folder) / QUANTIZED_RECORD_FILE).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def _outputs_made_from(out: Path, moving: List[Path]) -> List[Path]:
    """Folders of ``out`` holding what was made from the checkpoints ``moving`` away: a
    quantized model (``quantize.json`` whose ``source`` lies inside one of them, as the shipped
    quantize configs write ``<output_dir>/quantized/`` from ``<output_dir>/epoch_<n>/``). Left
    behind, its record would name the new run's folder as the source of the earlier run's
    model."""
    made = []
    for folder in sorted(d for d in out.iterdir() if d.is_dir() and d not in moving):
        source = (quantized_record(folder) or {}).get("source")
        if isinstance(source, str) and any(_is_within(Path(source), d) for d in moving):
            made.append(folder)
    return made


def keep_earlier_checkpoints_aside(output_dir: str,
                                   read_by_the_run: Optional[Dict[str, str]] = None) -> Optional[Path]:
    """A fresh run into an ``output_dir`` that holds an earlier run's ``epoch_<n>/`` folders
    (and ``recipe_state/``, ``step_<n>/`` folders older than them, and a quantized model made
    from them: ``_outputs_made_from``): they move into ``checkpoints.<suffix>/`` (returned),
    named as the earlier run's kept metrics and config are (``earlier_run_suffix``), and one
    line says so.

    NOTE: moved, not left for the new run to overwrite: the new run's ``epoch_0/`` would
    replace the earlier one's while the earlier ``epoch_1/`` ... stayed, and a later resume would
    continue the earlier run's newest epoch on the new run's metrics. Moved at the start, not at
    the first save, so that ``resume_from_checkpoint=auto`` after a crash before that save
    starts afresh again instead of resuming the earlier run. ``step_<n>/`` folders older than
    the newest epoch move with them; a newer one never gets here: a fresh run beside it is
    refused (``refuse_stale_step_checkpoints``).
    ``read_by_the_run`` (config key -> path): where one lies inside an ``epoch_<n>/`` or
    ``recipe_state/`` (a new run trained on from an earlier epoch,
    ``checkpointer.checkpoint_dir=<output_dir>/epoch_0``), those stay: the run reads from
    there, and its checkpoints replace them, as torchtune's do; the step folders still move (a
    resume would take the newest of them over the new run's epochs). One inside a
    ``step_<n>/`` is a ConfigError: copy it out first. A line says what stayed and what moved."""
    from tune_recipes.training.reporting.metrics import earlier_run_suffix, time_stamp

    out = Path(output_dir)
    if not out.is_dir():
        return None
    found = sorted((d for d in out.iterdir() if d.is_dir() and _EPOCH_DIR.match(d.name)),
                   key=lambda d: int(_EPOCH_DIR.match(d.name).group(1)))
    if not found:
        return None
    steps = step_dirs(out)  # older than the newest epoch (refuse_stale_step_checkpoints)
    found += steps
    if (out / RECIPE_STATE_FILE.parent).is_dir():
        found.append(out / RECIPE_STATE_FILE.parent)
    refuse_reading_an_earlier_step(output_dir, read_by_the_run or {})
    read = {}  # the keys reading from an epoch_<n>/ or recipe_state/ here
    for key, path in (read_by_the_run or {}).items():
        inside = next((d for d in found if _is_within(Path(path), d)), None)
        if inside is not None:
            read[key] = (path, inside)
    if read:
        key, (path, inside) = next(iter(read.items()))
        print(f"{out} holds an earlier run's checkpoints; {key}={path} reads from "
              f"{inside.name}/, so its epochs stay where they are and this run's checkpoints "
              "replace them", file=sys.stderr)
        found = steps
        if not found:
            return None
    made = _outputs_made_from(out, found)
    found += made
    metrics = out / "metrics.jsonl"
    if metrics.is_file() and metrics.stat().st_size:
        suffix = earlier_run_suffix(metrics)
    else:
        suffix = time_stamp(max(d.stat().st_mtime for d in found))
    kept = move_into_new_folder(out, f"checkpoints.{suffix}", found)
    for folder in made:  # its record names where its source now is, beside it
        record_file = kept / folder.name / QUANTIZED_RECORD_FILE
        record = quantized_record(kept / folder.name)
        source = Path(record["source"]).resolve().relative_to(out.resolve())
        record["source"] = str(kept.resolve() / source)
        record_file.write_text(json.dumps(record, indent=2) + "\n")
    moved = ", ".join(d.name + "/" for d in found)
    if read:
        print(f"{out} held an earlier run's mid-epoch checkpoints: {moved} moved to "
              f"{kept.name}/", file=sys.stderr)
    else:
        print(f"{out} held an earlier run's checkpoints: {moved} moved to {kept.name}/ (this "
              "run starts afresh; to continue the earlier run instead, move them back and run "
              "with resume_from_checkpoint=True)", file=sys.stderr)
    return kept


def move_into_new_folder(parent: Path, name: str, paths: List[Path]) -> Path:
    """Move ``paths`` (files or folders in ``parent``) into a new ``parent/name/`` (``name-2``,
    ``name-3`` ... when taken), returned: how an earlier run's outputs are kept aside."""
    kept, n = parent / name, 1
    while kept.exists():
        n += 1
        kept = parent / f"{name}-{n}"
    kept.mkdir()
    for p in paths:
        os.replace(p, kept / p.name)
    return kept


def _is_within(path: Path, folder: Path) -> bool:
    try:
        path.resolve().relative_to(folder.resolve())
        return True
    except ValueError:
        return False


def check_output_dir_allows_the_run(output_dir: str, cfg_checkpointer: DictConfig,
                                    resume: Union[bool, str], check_lock: bool = True,
                                    read_by_the_run: Optional[Dict[str, str]] = None) -> None:
    """``load_checkpoint``'s checks of ``output_dir``, for ``tune run`` and ``tune validate``
    to make before anything starts (raises its ConfigError): no live run holds it (first, so
    that a second run is told of the live one, not told to resume or remove its step_<n>/;
    ``check_lock=False`` skips this); a resume finds a checkpoint to resume; a fresh run finds
    no earlier run's step_<n>/ newer than its epochs, nor reads from one
    (``read_by_the_run``: ``paths_the_run_reads``)."""
    from tune_recipes.training.checkpointing.lock import OutputDirLock

    if check_lock:
        OutputDirLock(output_dir).refuse_if_in_use()
    # full_weights=None: only the recipe knows whether it resumes model weights or an adapter
    # alone; its load_checkpoint checks the files with the right answer.
    checkpointer_config_for_output_dir(cfg_checkpointer, output_dir, resume, full_weights=None)
    if resume_point(output_dir, resume) is None:
        refuse_reading_an_earlier_step(output_dir, read_by_the_run or {})


def instantiate_checkpointer_for_resume(cfg_checkpointer: DictConfig, output_dir: str):
    """The checkpointer for a resume, configured by ``checkpointer_config_for_resume``.

    NOTE: keep the first-epoch branch. torchtune 0.6.1's HF checkpointer, built with
    ``should_load_recipe_state=True`` and no ``adapter_checkpoint``, looks for an adapter in
    the newest ``epoch_*`` folder even for a full fine-tune, and fails with a TypeError
    (``os.path.join(output_dir, None)``) when there is none yet: a full fine-tune killed in
    its first epoch, resumable from a ``step_<n>/``. Then it is built as for a fresh run, with
    the model files named by absolute path, and pointed at the recipe state afterwards (the
    attributes its constructor would have set; no adapter for a full fine-tune).
    """
    from torchtune import config as tt_config

    out = Path(output_dir)
    if latest_epoch_dir(out) is not None or cfg_checkpointer.get("adapter_checkpoint"):
        return tt_config.instantiate(cfg_checkpointer, should_load_recipe_state=True)
    cfg = OmegaConf.create(OmegaConf.to_container(cfg_checkpointer, resolve=True))
    cfg.checkpoint_files = [str(out / f) for f in cfg.checkpoint_files]
    recipe_checkpoint = out / cfg.pop("recipe_checkpoint")
    checkpointer = tt_config.instantiate(cfg, should_load_recipe_state=False)
    checkpointer._should_load_recipe_state = True
    checkpointer._recipe_checkpoint = recipe_checkpoint
    return checkpointer


def _checked_epoch_dir(out: Path) -> Path:
    """The newest ``epoch_<e>/``, checked to have the recipe state written after epoch e
    (``resume_point`` sends a finished run's final epoch elsewhere first)."""
    epoch_dir = latest_epoch_dir(out)
    state_path = out / RECIPE_STATE_FILE
    if epoch_dir is not None and (epoch_dir / EPOCH_STATE_FILE).is_file():
        state_path = epoch_dir / EPOCH_STATE_FILE  # written with the folder (crash-safe)
    if epoch_dir is not None and not state_path.is_file():
        raise ConfigError(
            f"resume_from_checkpoint=True but {epoch_dir} is the final checkpoint of a finished "
            "run (the last epoch saves no recipe state): there is nothing to resume; to train "
            f"further, start a new run from its weights (checkpointer.checkpoint_dir={epoch_dir})"
            " into another output_dir"
        )
    if epoch_dir is None or not state_path.is_file():
        raise ConfigError(
            f"resume_from_checkpoint=True but {out} holds no checkpoint to resume (an "
            f"epoch_<n>/ or step_<n>/ folder with its recipe_state.pt); run without "
            "resume_from_checkpoint first"
        )
    state = load_recipe_state(state_path)
    epochs_run = state.get("epochs_run")
    epoch = int(_EPOCH_DIR.match(epoch_dir.name).group(1))
    if epochs_run != epoch + 1:
        raise ConfigError(
            f"{state_path} was written after epoch {epochs_run - 1 if epochs_run else '?'} but the "
            f"newest checkpoint is {epoch_dir}; remove the newer epoch folder or the stale state"
        )
    return epoch_dir


def complete_peft_adapter_config(epoch_dir: Path, base_model_name_or_path: str) -> None:
    """Make ``adapter_config.json`` loadable as is: where the base model lives, and the task.

    torchtune leaves ``base_model_name_or_path`` out unless the checkpoint folder names a hub
    repo (transformers' ``from_pretrained(epoch_dir)`` then fails with a KeyError): the base
    checkpoint folder goes there. It also writes no ``task_type``, without which PEFT's
    ``AutoPeftModelForCausalLM`` cannot tell which model class to build; every recipe here
    trains a causal LM.
    """
    path = Path(epoch_dir) / ADAPTER_CONFIG_FILE
    if not path.is_file():
        return
    cfg = json.loads(path.read_text())
    base = Path(str(base_model_name_or_path))
    # NOTE: a base that is a training run's epoch_<n>/ or step_<n>/ folder is named as such even
    # where torchtune named a hub repo: folders saved by torchtune, or by this project before it
    # stopped copying `tune download`'s original_repo_id.json, still carry the repo they were
    # trained from, which is not the weights this adapter was trained on.
    trained = _EPOCH_DIR.match(base.name) or STEP_DIR.match(base.name)
    if not cfg.get("base_model_name_or_path") or trained:
        cfg["base_model_name_or_path"] = str(base_model_name_or_path)
    if not cfg.get("task_type"):
        cfg["task_type"] = "CAUSAL_LM"
    path.write_text(json.dumps(cfg, indent=2) + "\n")


def undo_rope_permutation_of_peft_adapter(epoch_dir: Path, num_heads: int, num_kv_heads: int,
                                          head_dim: int) -> None:
    """Rewrite the PEFT adapter's q/k ``lora_B`` rows in the model's own order.

    torchtune 0.6.1 writes every PEFT adapter's q_proj/k_proj ``lora_B`` with the rows of each
    head interleaved the way Llama's Hugging Face weights are (its ``tune_to_peft_adapter_weights``
    permutes whatever the model type), while its Qwen2 weights are saved unpermuted (Qwen2's
    Hugging Face and torchtune layouts are the same). Loaded onto the base through PEFT, such
    an adapter shifts the wrong rows: a Qwen2.5 LoRA's logits came out about as far from the
    trained model's as the untrained base's. This inverts that permutation for a model whose
    weights are not permuted; the merged weights and ``adapter_model.pt`` are not affected.
    """
    from safetensors.torch import load_file, save_file

    path = Path(epoch_dir) / PEFT_ADAPTER_FILE
    safetensors = path.is_file()
    if not safetensors:  # checkpointer.safe_serialization=False: torch.save's adapter_model.bin
        path = path.with_suffix(".bin")
        if not path.is_file():
            return
    tensors = load_file(path) if safetensors else torch.load(path, map_location="cpu",
                                                             weights_only=True)

    def unpermuted(t: torch.Tensor, heads: int) -> torch.Tensor:
        rank = t.shape[-1]
        # torchtune's permutation: view(heads, head_dim // 2, 2, rank).transpose(1, 2).
        return (t.view(heads, 2, head_dim // 2, rank).transpose(1, 2)
                .reshape(heads * head_dim, rank).contiguous())

    changed = False
    for key, value in tensors.items():
        if ".lora_B." not in key:
            continue
        if ".q_proj." in key:
            tensors[key], changed = unpermuted(value, num_heads), True
        elif ".k_proj." in key:
            tensors[key], changed = unpermuted(value, num_kv_heads), True
    if changed and safetensors:
        save_file(tensors, path, metadata={"format": "pt"})
    elif changed:
        torch.save(tensors, path)


@dataclass
class LoRASpec:
    """The LoRA hyper-parameters a checkpoint needs (merging and the PEFT adapter config)."""

    rank: int
    alpha: float
    attn_modules: List[str]
    apply_to_mlp: bool
    apply_to_output: bool
    use_dora: bool = False

    @classmethod
    def from_model_config(cls, cfg_model) -> "LoRASpec":
        missing = [k for k in ("lora_rank", "lora_alpha", "lora_attn_modules") if k not in cfg_model]
        if missing:
            raise ConfigError(
                f"model: {cfg_model.get('_component_')} is not a LoRA builder (no "
                f"{', '.join('model.' + k for k in missing)}); use a lora_*/qlora_* builder"
            )
        return cls(rank=cfg_model.lora_rank, alpha=cfg_model.lora_alpha,
                   attn_modules=list(cfg_model.lora_attn_modules),
                   apply_to_mlp=cfg_model.get("apply_lora_to_mlp", False),
                   apply_to_output=cfg_model.get("apply_lora_to_output", False),
                   use_dora=bool(cfg_model.get("use_dora", False)))


def lora_checkpoint_entries(full_cpu_state_dict: Dict[str, torch.Tensor], spec: LoRASpec,
                            adapter_only: bool, merge=None) -> Dict[str, object]:
    """Checkpoint entries of a LoRA-type run: the adapter, its PEFT config and (unless
    ``adapter_only``) the merged model. ``merge(state_dict, rank=, alpha=)`` defaults to
    torchtune's ``get_merged_lora_ckpt`` (``low_cpu_ram`` passes its in-place one).

    NOTE: ``full_cpu_state_dict`` must hold tensors this call may modify: torchtune's merge
    adds the LoRA delta to the base weights in place. Pass CPU copies, never the live model's
    tensors (on a CPU run ``.cpu()`` returns the live parameter itself).
    """
    from torchtune import training
    from torchtune.modules.peft import get_adapter_state_dict, get_lora_module_names, get_merged_lora_ckpt

    out: Dict[str, object] = {training.ADAPTER_KEY: get_adapter_state_dict(full_cpu_state_dict)}
    if not adapter_only:
        out[training.MODEL_KEY] = (merge or get_merged_lora_ckpt)(
            full_cpu_state_dict, rank=spec.rank, alpha=spec.alpha)
    if spec.use_dora:
        # NOTE: no PEFT adapter config for DoRA. torchtune's config (r, alpha, modules) makes
        # PEFT load a DoRA adapter as a plain LoRA, ignoring its magnitudes (logits off by
        # ~15 on the tiny model), and with use_dora set PEFT's DoRA still gave other outputs
        # than the trained model's (0.31 off). The merged model and torchtune's adapter_model.pt
        # are right; without the config, PEFT refuses the folder instead of loading it wrong.
        return out
    out[training.ADAPTER_CONFIG] = {
        "r": spec.rank,
        "lora_alpha": spec.alpha,
        "target_modules": get_lora_module_names(spec.attn_modules, spec.apply_to_mlp,
                                                spec.apply_to_output),
        "peft_type": "LORA",
    }
    return out
