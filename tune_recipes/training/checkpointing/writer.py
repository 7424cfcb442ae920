"""Every recipe's ``save_checkpoint``: full or LoRA-type, one device or FSDP, in one place."""

import contextlib
import errno
import json
import logging
import os
import shutil
import sys
from pathlib import Path
from typing import Dict, Optional

import torch
import torch.distributed as dist
from safetensors import SafetensorError
from torch import nn
from torchtune import training
from torchtune.training import ModelType

from tune_recipes.config import positive_int_or_none
from tune_recipes.validation import brief
from tune_recipes.constants import CHECKPOINT_SAVE_EVENT, DOWNLOADED_REPO_FILE
from tune_recipes.training.checkpointing.io import (
    ADAPTER_CONFIG_FILE,
    EPOCH_STATE_FILE,
    FINISHED_RUN_FILE,
    RECIPE_STATE_FILE,
    STEP_DIR,
    CheckpointError,
    LoRASpec,
    complete_peft_adapter_config,
    lora_checkpoint_entries,
    step_dirs,
    undo_rope_permutation_of_peft_adapter,
)

STAGING_DIR = ".saving"  # under output_dir; NOTE: not "epoch_*": torchtune globs ^epoch_(\d+)


def replace_file_atomically(src: Path, dst: Path) -> None:
    """Make ``dst`` hold ``src``'s bytes so that ``dst`` is always either the old or the new
    file: a hard link to ``src`` where the filesystem allows one (an 8B full run's recipe state
    is its whole optimizer state, written once instead of twice), else a copy. NOTE: both
    names stay valid apart: every later write here replaces a name (``os.replace``), never a
    file's bytes in place."""
    tmp = dst.with_name(dst.name + ".tmp")
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp.unlink(missing_ok=True)  # left by a killed save
    try:
        os.link(src, tmp)
    except OSError:
        shutil.copyfile(src, tmp)
    os.replace(tmp, dst)


def publish_dir(staged: Path, final: Path, trash: Path) -> None:
    """Rename the complete ``staged`` folder to ``final`` (an existing one is moved to
    ``trash`` first and deleted after): ``final`` never holds a partial checkpoint."""
    if final.exists():
        os.rename(final, trash)
    os.rename(staged, final)
    shutil.rmtree(trash, ignore_errors=True)
from tune_recipes.training.checkpointing.low_ram import file_backed_state_dict, merge_lora_in_place
from tune_recipes.training.checkpointing.state import RecipeState
from tune_recipes.training.reporting import run_status
from tune_recipes.training.step.driver import Position
from tune_recipes.training.step.nonfinite import NonFiniteError


def with_own_storage(state):
    """``state`` (nested dicts and lists of tensors) with each tensor that views a larger
    storage copied into one of its own size. On a CPU (gloo) run, gathered FSDP shards of a
    dimension the ranks do not divide evenly are views of the padded all-gather buffer (on a
    GPU, the move to the CPU already copies them), and ``torch.save`` (the adapter's .pt file,
    the optimizer state) writes a view's whole storage, padding included."""
    if isinstance(state, dict):
        return {k: with_own_storage(v) for k, v in state.items()}
    if type(state) in (list, tuple):
        return type(state)(with_own_storage(v) for v in state)
    if isinstance(state, torch.Tensor) and \
            state.untyped_storage().nbytes() > state.numel() * state.element_size():
        return state.clone()
    return state


# torch.save's zip writer (PytorchStreamWriter) raises RuntimeError, not OSError, when a write
# fails: on a full disk "[enforce fail at inline_container.cc:...] . unexpected pos ..." (a
# large file) or "basic_ios::clear: iostream error" (a small one), or "PytorchStreamWriter
# failed writing file ...".
_TORCH_SAVE_WRITE_FAILURES = ("inline_container", "PytorchStreamWriter", "file write failed",
                              "iostream error")


def torch_save_write_failure(e: RuntimeError) -> bool:
    return any(marker in str(e) for marker in _TORCH_SAVE_WRITE_FAILURES)


def free_space_note(path: Path, error: Exception) -> str:
    """``; 12.0 MiB free on that disk`` where the failure may be a full disk (ENOSPC, or an
    error that carries no errno) and the disk can be asked; else nothing."""
    if isinstance(error, OSError) and error.errno not in (None, errno.ENOSPC, errno.EDQUOT):
        return ""
    try:
        free = shutil.disk_usage(path).free
    except OSError:
        return ""
    return f"; {free / 2**20:.1f} MiB free on that disk"

class _DropInfo(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno > logging.INFO


@contextlib.contextmanager
def _without_torchtune_save_lines():
    """Drop torchtune's INFO lines while its checkpointer writes: they name the staging
    folder (``.saving/epoch_<n>/...``), gone once the folder is renamed into place, and call
    adapter_config.json an "Adapter checkpoint". ``saved_line`` says what was saved where.
    Its warnings still print."""
    logger = logging.getLogger("torchtune.utils._logging")
    f = _DropInfo()
    logger.addFilter(f)
    try:
        yield
    finally:
        logger.removeFilter(f)


def drop_another_runs_records(folder: Path, peft_config_saved: bool) -> None:
    """Remove from a checkpoint ``folder`` the records torchtune's HF checkpointer copied from
    ``checkpoint_dir`` (it copies every small non-weight file, so a run started from another
    run's checkpoint folder inherits that run's): its ``finished_run.json`` (this run writes
    its own, in its final folder only) and, where this save writes no PEFT config (no adapter,
    or a DoRA one), its ``adapter_config.json``, which makes transformers and PEFT load the
    folder as an adapter whose weights are not there (or as another kind of adapter). The
    model's own files (config.json, tokenizer, generation config) stay, but not
    ``original_repo_id.json``: ``tune download`` records there the hub repo the folder holds,
    which a trained folder no longer is, and torchtune's checkpointer names that repo as the
    base of every PEFT adapter trained from the folder."""
    (folder / FINISHED_RUN_FILE).unlink(missing_ok=True)
    (folder / DOWNLOADED_REPO_FILE).unlink(missing_ok=True)
    if not peft_config_saved:
        (folder / ADAPTER_CONFIG_FILE).unlink(missing_ok=True)


def _umask() -> int:
    """The process's umask, read without setting it where Linux reports it (setting and
    restoring it would race with another thread creating a file meanwhile)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)  # elsewhere the only way to read it
    os.umask(mask)
    return mask


def readable_as_umask_allows(folder: Path) -> None:
    """Give the files in ``folder`` the permissions a plain write gets under the process's
    umask (0644 under the usual 022). NOTE: safetensors writes through a private temporary
    file (mode 0600) renamed into place, so its weight files would be readable by their owner
    alone while every other file of the checkpoint is not: on a shared machine, teammates
    could read the config but not the weights."""
    mask = _umask()
    for path in folder.rglob("*"):
        if path.is_file() and not path.is_symlink():
            path.chmod(0o666 & ~mask)


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def saved_line(what: str, folder: Path) -> str:
    """``<what> saved to <folder>: <file> (<size>), ...``: the published folder's files as
    they are on disk, largest first."""
    files = sorted((p for p in Path(folder).iterdir() if p.is_file()),
                   key=lambda p: (-p.stat().st_size, p.name))
    listing = ", ".join(f"{p.name} ({_size(p.stat().st_size)})" for p in files)
    what = what[len("the "):] if what.startswith("the ") else what
    return f"{what} saved to {folder}: {listing}"


def refuse_nonfinite_weights(state_dict: Dict[str, torch.Tensor], epoch: int,
                             what: Optional[str] = None) -> None:
    """Never write NaN/inf weights. The step driver's ``on_nonfinite`` check normally stops a
    run first; this is the last line, one pass over the weights at save time."""
    bad = [k for k, v in state_dict.items()
           # Plain tensors only: quantized/NF4 subclasses may not implement isfinite.
           if type(v) in (torch.Tensor, nn.Parameter) and v.is_floating_point()
           and not bool(torch.isfinite(v).all())]
    if bad:
        raise NonFiniteError(
            f"the weights to save for {what or f'epoch {epoch}'} hold NaN/inf ({len(bad)} tensors, e.g. "
            f"{bad[0]}); not writing them"
        )


class CheckpointWriter:
    """Writes ``output_dir/epoch_<n>/`` through a torchtune checkpointer, plus the recipe state
    (and optimizer state) when more epochs follow; and, given the step driver's ``Position``,
    a mid-epoch ``output_dir/step_<global step>/`` (``save_every_n_steps``) with everything a
    resume needs, keeping the newest ``keep_last_n_checkpoints`` of those (None: all).

    ``lora`` set (the five LoRA-type recipes): the adapter in torchtune and PEFT formats, and the
    merged model unless ``adapter_only``; ``base_checkpoint_dir`` goes into the PEFT
    adapter_config.json. ``distributed``: the model and optimizer are FSDP2 shards; saving is a
    collective every rank calls, and the main rank writes.
    """

    def __init__(self, checkpointer, *, output_dir: str, distributed: bool = False,
                 is_main: bool = True, lora: Optional[LoRASpec] = None,
                 adapter_only: bool = False, base_checkpoint_dir: Optional[str] = None,
                 keep_last_n_checkpoints: Optional[int] = None,
                 low_cpu_ram: bool = False) -> None:
        self.keep_last_n_checkpoints = positive_int_or_none("keep_last_n_checkpoints",
                                                            keep_last_n_checkpoints)
        self.checkpointer = checkpointer
        self.output_dir = Path(output_dir)
        self.distributed = distributed
        self.is_main = is_main
        self.lora = lora
        self.adapter_only = adapter_only
        self.base_checkpoint_dir = base_checkpoint_dir
        if low_cpu_ram and (distributed or lora is None):
            raise ValueError("low_cpu_ram applies to a single-device LoRA-type save")
        self.low_cpu_ram = low_cpu_ram

    @classmethod
    def from_config(cls, cfg, checkpointer, runtime, lora: Optional[LoRASpec] = None
                    ) -> "CheckpointWriter":
        """``output_dir``, ``keep_last_n_checkpoints``, and for LoRA ``save_adapter_weights_only``
        and the base ``checkpointer.checkpoint_dir``, from the recipe's config; ``runtime``:
        where it runs."""
        return cls(checkpointer, output_dir=cfg.output_dir, distributed=runtime.distributed,
                   keep_last_n_checkpoints=cfg.get("keep_last_n_checkpoints", None),
                   is_main=runtime.is_main, lora=lora,
                   adapter_only=cfg.get("save_adapter_weights_only", False) if lora else False,
                   base_checkpoint_dir=(str(Path(cfg.checkpointer.checkpoint_dir).resolve())
                                        if lora else None),
                   low_cpu_ram=bool(cfg.get("low_cpu_ram", False)))

    def save(self, model: nn.Module, optimizer, state: RecipeState, epoch: int,
             position: Optional[Position] = None) -> None:
        """The checkpoint at the end of ``epoch``; or, with ``position`` (``driver.position()``,
        right after a step), the mid-epoch one at that step. A collective when distributed.
        Marked ``CHECKPOINT_SAVE_EVENT`` in a profiler trace (scripts/trace_summary.py flags a
        trace that holds one: its kernels are not training)."""
        with torch.profiler.record_function(CHECKPOINT_SAVE_EVENT):
            self._save(model, optimizer, state, epoch, position)

    def _save(self, model: nn.Module, optimizer, state: RecipeState, epoch: int,
              position: Optional[Position]) -> None:
        mid_epoch = position is not None
        intermediate = mid_epoch or epoch + 1 < state.total_epochs
        # NOTE: a mid-epoch LoRA checkpoint holds the adapter only: a resume needs nothing else,
        # and a merged full model every save_every_n_steps would be a full-model write each time.
        adapter_only = self.adapter_only or (mid_epoch and self.lora is not None)
        name = f"step_{position.global_step}" if mid_epoch else f"epoch_{epoch}"
        model_sd = self._model_state_dict(model, adapter_only=adapter_only and self.lora is not None)
        opt_sd = self._optimizer_state_dict(model, optimizer) if intermediate else None
        if self.is_main:
            refuse_nonfinite_weights(model_sd, epoch, what=f"step {position.global_step}"
                                     if mid_epoch else None)
            if self.lora is not None:
                ckpt = lora_checkpoint_entries(
                    model_sd, self.lora, adapter_only,
                    merge=merge_lora_in_place if self.low_cpu_ram else None)
            else:
                ckpt = {training.MODEL_KEY: model_sd}
            if intermediate:
                ckpt.update(state.checkpoint_entries(opt_sd, position))
            finished = None if intermediate else {
                training.SEED_KEY: state.seed, training.MAX_STEPS_KEY: state.max_steps_per_epoch,
                training.EPOCHS_KEY: epoch + 1}
            self._write(ckpt, epoch, intermediate, name=name, adapter_only=adapter_only,
                        shared_state=not mid_epoch, finished=finished)
            if mid_epoch:
                self._delete_old_step_checkpoints()
        if self.distributed:
            dist.barrier()

    def _write(self, ckpt: Dict[str, object], epoch: int, intermediate: bool,
               name: Optional[str] = None, adapter_only: Optional[bool] = None,
               shared_state: bool = True, finished: Optional[Dict[str, object]] = None) -> None:
        """Crash-safe: the checkpointer writes into ``output_dir/.saving/``; only a complete
        ``name`` folder (``epoch_<n>/`` or ``step_<n>/``: weights, adapter, and unless it is
        the last epoch its own ``recipe_state.pt``; the last epoch's: ``finished``, the
        ``finished_run.json`` a continuation reads) is renamed into ``output_dir``, then (if
        ``shared_state``) ``recipe_state/`` is replaced atomically. A kill at any point leaves
        the previous checkpoints as they were."""
        name = name or f"epoch_{epoch}"
        adapter_only = self.adapter_only if adapter_only is None else adapter_only
        what = (f"the step {name[len('step_'):]} checkpoint" if STEP_DIR.match(name)
                else f"the epoch {epoch} checkpoint")
        # NOTE: read before the save: torchtune's save pops the adapter entries from ``ckpt``
        # when it writes the recipe state.
        peft_config_saved = training.ADAPTER_CONFIG in ckpt  # not for DoRA: io.lora_checkpoint_entries
        # NOTE: torchtune's checkpointers write everything under ``_output_dir``; pointing it
        # at the staging folder for one call is what makes their writes atomic here.
        real_output_dir = self.checkpointer._output_dir
        out = Path(real_output_dir)
        staging = out / STAGING_DIR
        try:
            shutil.rmtree(staging, ignore_errors=True)  # left by a killed save
            staging.mkdir(parents=True)
            self.checkpointer._output_dir = staging
            try:
                with _without_torchtune_save_lines():
                    self.checkpointer.save_checkpoint(ckpt, epoch=epoch,
                                                      intermediate_checkpoint=intermediate,
                                                      adapter_only=adapter_only)
            finally:
                self.checkpointer._output_dir = real_output_dir
            # torchtune names its folder by the epoch; a step checkpoint is renamed below.
            written = staging / f"epoch_{epoch}"
            drop_another_runs_records(written, peft_config_saved=peft_config_saved)
            readable_as_umask_allows(written)
            if self.lora is not None:
                complete_peft_adapter_config(written, self.base_checkpoint_dir)
                if getattr(self.checkpointer, "_model_type", None) == ModelType.QWEN2:
                    hf = self.checkpointer._config
                    undo_rope_permutation_of_peft_adapter(
                        written, num_heads=hf["num_attention_heads"],
                        num_kv_heads=hf["num_key_value_heads"],
                        head_dim=hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"])
            if intermediate:
                # The folder's own copy travels with it: resume reads it from there.
                os.replace(staging / RECIPE_STATE_FILE, written / EPOCH_STATE_FILE)
            if finished is not None:
                (written / FINISHED_RUN_FILE).write_text(json.dumps(finished) + "\n")
            # NOTE: announced first: a Ctrl-C between the rename and the record must not
            # report "no checkpoint saved" beside a complete folder.
            run_status.checkpoint_publishing(written, out / name, final=finished is not None)
            publish_dir(written, out / name, staging / "replaced")
            run_status.checkpoint_saved(out / name, final=finished is not None)
            # One line naming where each file ended up (torchtune's lines are dropped above).
            print(saved_line(what, out / name), file=sys.stderr)
            if intermediate and shared_state:
                # Where torchtune's tools look for it. NOTE: epoch checkpoints only: the
                # older-layout resume check reads it as the state after an epoch.
                replace_file_atomically(out / name / EPOCH_STATE_FILE, out / RECIPE_STATE_FILE)
            shutil.rmtree(staging, ignore_errors=True)
        except (OSError, SafetensorError, RuntimeError) as e:
            # NOTE: safetensors reports a full disk as its own error, and torch.save as a
            # RuntimeError of its zip writer; any other RuntimeError is not a write failure.
            if isinstance(e, RuntimeError) and not torch_save_write_failure(e):
                raise
            where = getattr(e, "filename", None) or staging
            # The partial files would hold the space a retry (or the disk's owner) needs.
            shutil.rmtree(staging, ignore_errors=True)
            reason = getattr(e, "strerror", None) or brief(e)
            raise CheckpointError(
                f"cannot write {what}: {reason} ({where}{free_space_note(out, e)}); "
                f"earlier checkpoints in {out} are intact"
            ) from None

    def _delete_old_step_checkpoints(self) -> None:
        """Keep the newest ``keep_last_n_checkpoints`` step folders. Runs only after a new one
        is published, so a kill never leaves fewer complete checkpoints than asked for; epoch
        folders are never deleted."""
        if self.keep_last_n_checkpoints is None:
            return
        out = Path(self.checkpointer._output_dir)
        old = step_dirs(out)[:-self.keep_last_n_checkpoints]
        if not old:
            return
        # NOTE: moved into the staging folder first, then deleted: a kill mid-delete leaves
        # no half-deleted step_<n>/ under a name a resume would consider.
        staging = out / STAGING_DIR
        staging.mkdir(exist_ok=True)
        for path in old:
            os.rename(path, staging / path.name)
        shutil.rmtree(staging, ignore_errors=True)

    def _model_state_dict(self, model: nn.Module, adapter_only: bool = False) -> Dict[str, torch.Tensor]:
        # adapter_only (a LoRA-type save that writes no merged model): the adapter's tensors
        # only, not a gather or copy of the whole base model (8B+ at every save_every_n_steps).
        if self.distributed:
            # Collective: every rank gathers its shards; fresh full CPU tensors on the main rank.
            return with_own_storage(training.gather_cpu_state_dict(
                model, self.is_main, device=None, adapter_weights_only=adapter_only))
        if adapter_only:
            from torchtune.modules.peft import get_adapter_state_dict

            return get_adapter_state_dict(model.state_dict(), device="cpu")
        if self.low_cpu_ram:
            # The merged model tensor by tensor in a memory-mapped scratch file (low_ram.py).
            return file_backed_state_dict(model, self.output_dir)
        if self.lora is not None:
            # NOTE: copy=True even on a CPU run, where .to("cpu") would return the live parameter
            # itself: the LoRA merge adds the adapter delta into these tensors in place.
            return {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
        return model.state_dict()

    def _optimizer_state_dict(self, model: nn.Module, optimizer):
        if self.distributed:
            return with_own_storage(training.get_full_optimizer_state_dict(
                model, optimizer, self.is_main, device=None))
        return optimizer.state_dict()
