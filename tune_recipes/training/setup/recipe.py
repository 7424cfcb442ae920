"""Setup steps every recipe performs the same way (one correct answer each)."""

import contextlib
import json
import os
import signal
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf
from torch import nn
from torchtune import config as tt_config, training
from torchtune.utils import get_logger

from tune_recipes.config import ConfigError
from tune_recipes.constants import DEFAULT_COLLATE
from tune_recipes.training.checkpointing.io import (
    ADAPTER_FILE,
    FINISHED_RUN_FILE,
    RECIPE_STATE_FILE,
    CheckpointError,
    ResumePoint,
    checkpointer_config_for_output_dir,
    instantiate_checkpointer_for_resume,
    keep_earlier_checkpoints_aside,
    load_recipe_state,
    paths_the_run_reads,
    refuse_reading_an_earlier_step,
    resume_point,
)
from tune_recipes.training.checkpointing.lock import OutputDirLock
from tune_recipes.training.checkpointing.state import RecipeState, SavedState
from tune_recipes.training.reporting import run_status
from tune_recipes.training.reporting.progress import StepReporter
from tune_recipes.training.setup.data import (
    build_dataloader,
    build_dataset,
    build_validation_dataloader,
    document_spans_wanted,
    is_packed,
    padded_batch_multiple,
    training_padding_free,
    whole_model_dynamic_compile_warning,
)
from tune_recipes.training.setup.model import check_resumed_adapter_scale
from tune_recipes.training.setup.profiling import setup_profiler
from tune_recipes.training.setup.runtime import Runtime
from tune_recipes.training.step.driver import (
    DATA_SHAPE,
    DATALOADER_STATE,
    DATASET_EXAMPLES,
    DATASET_EXAMPLES_SKIPPED,
    Position,
    StepDriver,
    StepHook,
    data_shape,
    mid_epoch_save_due,
)
from tune_recipes.training.step.normalization import NormalizationPath, StepLossNormalizer
from tune_recipes.training.step.optim import LRSchedule, OptimizerInBackward
from tune_recipes.training.step.validation import Validator
from tune_recipes.validation import brief, warmup_problem

log = get_logger("INFO")


def training_dtype(cfg: DictConfig, device) -> torch.dtype:
    """``dtype`` from the config (bf16 or fp32); fp16 would need loss scaling we do not do."""
    dtype = training.get_dtype(cfg.get("dtype", "bf16"), device=device)
    if dtype == torch.float16:
        raise ConfigError("dtype=fp16 is not supported: use bf16 or fp32")
    return dtype


def load_checkpoint(cfg: DictConfig, adapter: bool) -> Tuple[Any, Dict[str, Any], Optional[SavedState]]:
    """Instantiate the checkpointer (pointed at the newest checkpoint, ``epoch_<e>/`` or a
    mid-epoch ``step_<n>/``, when the run resumes), load, and return ``(checkpointer,
    checkpoint dict, saved recipe state or None)``. The saved state is not None exactly when
    the run continues an earlier one: the recipe hands it on to ``setup_step_driver``, whose
    metric logger then continues ``metrics.jsonl`` instead of starting it afresh.

    ``resume_from_checkpoint``: True resumes (a ConfigError when there is nothing to resume);
    ``auto`` resumes when ``output_dir`` holds a checkpoint and starts afresh when it holds none
    (a torchrun restart after a rank died, before or after the first checkpoint); False starts
    afresh. A finished run (its final ``epoch_<e>/``) continues with more ``epochs``
    (``_continue_finished_run``).

    ``adapter=True`` (LoRA-type recipes): base weights come from ``checkpoint_dir`` and the
    adapter from the newest epoch; a resume without an adapter is an error.
    """
    if int(os.environ.get("RANK", "0")) == 0:
        # First, before anything is written: one run per output_dir (released at exit).
        OutputDirLock(cfg.output_dir).acquire()
    setting = cfg.get("resume_from_checkpoint", False)
    point = resume_point(cfg.output_dir, setting)
    cfg_checkpointer = checkpointer_config_for_output_dir(
        cfg.checkpointer, cfg.output_dir, setting, full_weights=not adapter
    )
    if point is None:
        # Every rank, before anything moves: a key reading from an earlier run's step folder.
        refuse_reading_an_earlier_step(cfg.output_dir, paths_the_run_reads(cfg))
        if dist.is_available() and dist.is_initialized():
            # NOTE: every rank has read output_dir's step folders (checkpointer_config_for_
            # output_dir) before rank 0 moves them aside below.
            dist.barrier()
        if int(os.environ.get("RANK", "0")) == 0:
            keep_earlier_checkpoints_aside(cfg.output_dir, read_by_the_run=paths_the_run_reads(cfg))
        checkpointer = tt_config.instantiate(cfg_checkpointer, should_load_recipe_state=False)
        return checkpointer, read_checkpoint(checkpointer, cfg_checkpointer), None
    run_status.resuming_from(point.checkpoint)  # the checkpoint a Ctrl-C from here names
    if point.finished:
        return _continue_finished_run(cfg, cfg_checkpointer, point, adapter)
    state_file = Path(cfg.output_dir) / cfg_checkpointer.recipe_checkpoint
    # Before the weights are read (a minute for an 8B) and before anything is written to
    # output_dir (config.yaml, metrics): the recipe state alone decides whether this run can
    # continue it (the saved optimizer state must fit this run's optimizer; epochs must be left).
    saved = SavedState.from_checkpoint(load_recipe_state(state_file))
    saved.check_training_kind(cfg, point.checkpoint)
    saved.check_optimizer(cfg)
    saved.check_epochs(cfg, point.checkpoint)
    saved.keep_optimizer_settings(cfg, is_main=int(os.environ.get("RANK", "0")) == 0)
    if adapter:
        check_resumed_adapter_scale(cfg.model, point.checkpoint)
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"resuming from {state_file.parent}", file=sys.stderr)
    checkpointer = instantiate_checkpointer_for_resume(cfg_checkpointer, cfg.output_dir)
    ckpt = read_checkpoint(checkpointer, cfg_checkpointer,
                           resuming_from=(Path(cfg.output_dir) / cfg_checkpointer.recipe_checkpoint).parent,
                           base_too=adapter)
    if adapter and training.ADAPTER_KEY not in ckpt:
        raise ConfigError(
            f"resume_from_checkpoint={setting} but no adapter checkpoint was found under "
            f"{cfg.output_dir}; set checkpointer.adapter_checkpoint or start afresh"
        )
    return checkpointer, ckpt, SavedState.from_checkpoint(ckpt)


def read_checkpoint(checkpointer: Any, cfg_checkpointer: DictConfig,
                    key: str = "checkpointer", resuming_from: Optional[Path] = None,
                    base_too: bool = False) -> Dict[str, Any]:
    """``checkpointer.load_checkpoint()``, with a failure of the files to load (torchtune's
    converters raise bare Exceptions, KeyErrors and ValueErrors: a Meta checkpointer on HF files,
    a model_type that does not fit the weights; a file cut short) as one line naming the
    checkpointer (config ``key``) and where it read: ``resuming_from``, the checkpoint folder a
    resume reads (and, ``base_too``, the base weights a LoRA resume reads beside it), else
    ``checkpoint_dir``."""
    try:
        with _sigint_noticed() as sigint:
            return checkpointer.load_checkpoint()
    except ConfigError:
        raise
    except Exception as e:  # every converter failure, whatever its class
        if sigint.arrived or _interrupted(e):
            # NOTE: a Ctrl-C that landed inside the read (torchtune turns whatever the file
            # reader raised into a ValueError) is the user's stop, not a broken checkpoint.
            raise KeyboardInterrupt from e
        base = f"{cfg_checkpointer.get('checkpoint_dir')} (model_type={cfg_checkpointer.get('model_type')})"
        where, way_on = base, ""
        if resuming_from is not None:
            where = f"{base} and the checkpoint being resumed, {resuming_from}" if base_too \
                else f"the checkpoint being resumed, {resuming_from}"
            way_on = (f"; if a file there was cut short, restore it, or remove {resuming_from} "
                      "to resume from the checkpoint before it")
        raise ConfigError(
            f"{key}: {cfg_checkpointer.get('_component_')} could not load {where}: "
            f"{type(e).__name__}: {brief(e)}{way_on}") from None


class _Arrival:
    arrived = False


@contextlib.contextmanager
def _sigint_noticed():
    """Notes whether a SIGINT arrives inside the block (Python's handler still runs: a
    KeyboardInterrupt). NOTE: the safetensors reader can turn the interrupt into an error of its
    own that keeps no trace of it (its Rust code checks for signals), which torchtune then wraps
    in a ValueError: only the arrival tells a Ctrl-C from an unreadable file."""
    arrival = _Arrival()
    previous = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() or not callable(previous):
        yield arrival  # ignored (SIG_IGN) or the default action: nothing to note
        return

    def note(signum, frame):
        arrival.arrived = True
        previous(signum, frame)

    signal.signal(signal.SIGINT, note)
    try:
        yield arrival
    finally:
        signal.signal(signal.SIGINT, previous)


def _interrupted(error: BaseException) -> bool:
    """Whether a KeyboardInterrupt is among ``error``'s causes and contexts."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, KeyboardInterrupt) or "KeyboardInterrupt" in str(error):
            return True
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return False


def finished_run_record(final_checkpoint: Path, output_dir: Path) -> Dict[str, Any]:
    """What the finished run recorded of its seed and steps per epoch (torchtune's
    ``SEED_KEY`` and ``MAX_STEPS_KEY``): its final folder's ``finished_run.json``; for a run
    saved before that file was written, the recipe state of its last intermediate epoch (none
    for a one-epoch run: then {} and the config's values stand)."""
    record = final_checkpoint / FINISHED_RUN_FILE
    if record.is_file():
        try:
            return dict(json.loads(record.read_text()))
        except (OSError, ValueError, TypeError) as e:
            raise CheckpointError(f"{record} is unreadable ({e}); restore it, or start afresh "
                                  "in another output_dir") from None
    earlier = output_dir / RECIPE_STATE_FILE
    return load_recipe_state(earlier) if earlier.is_file() else {}


def read_teacher_weights(cfg_teacher_checkpointer: DictConfig) -> Dict[str, Any]:
    """A distillation teacher's state dict, read through ``teacher_checkpointer`` (its
    failures in one line naming that key, as the student's name ``checkpointer``)."""
    checkpointer = tt_config.instantiate(cfg_teacher_checkpointer)
    return read_checkpoint(checkpointer, cfg_teacher_checkpointer,
                           key="teacher_checkpointer")[training.MODEL_KEY]


def _continue_finished_run(cfg: DictConfig, cfg_checkpointer: DictConfig, point: ResumePoint,
                           adapter: bool) -> Tuple[Any, Dict[str, Any], SavedState]:
    """A finished run resumed: with ``epochs`` above the epochs it ran, training continues
    from its final weights (or adapter) at epoch ``epochs_done``; with no more epochs there is
    nothing to train and the process ends at once, status 0, leaving ``output_dir`` as it was (a
    torchrun restart after the final save).

    NOTE: the final checkpoint holds no optimizer state (the writer keeps it only while
    epochs remain: it is twice the model for AdamW), so the optimizer starts from fresh state
    here, and the LR schedule is laid over all ``epochs`` and entered at epoch
    ``epochs_done``: not the numbers of one run that trained ``epochs`` from the start. The
    line printed says so. The seed and steps per epoch are the run's own
    (``finished_run_record``; the config's where it recorded none), as for any resume."""
    out = Path(cfg.output_dir)
    done, total = point.epochs_done, cfg.epochs
    recorded = finished_run_record(point.checkpoint, out)
    saved = SavedState(
        optimizer=None, seed=recorded.get(training.SEED_KEY, cfg.get("seed", None)),
        epochs_run=done, total_epochs=total,
        max_steps_per_epoch=recorded.get(training.MAX_STEPS_KEY,
                                         cfg.get("max_steps_per_epoch", None)),
    )
    if int(os.environ.get("RANK", "0")) == 0:
        if total > done:
            print(f"continuing the finished run in {out} from {point.checkpoint.name}/ "
                  f"({done} epoch(s) done) to epochs={total}: that checkpoint holds the weights "
                  "but no optimizer state, so the optimizer starts from fresh state and the "
                  f"learning-rate schedule, laid over all {total} epochs, resumes at epoch "
                  f"{done}", file=sys.stderr)
        else:
            print(f"{out} holds a finished run ({done} epoch(s), final checkpoint "
                  f"{point.checkpoint.name}/): nothing to train with epochs={total}; set "
                  f"epochs above {done} to train further", file=sys.stderr)
    if total <= done:
        # NOTE: the process ends here, before the weights are read (a minute for an 8B) and
        # before anything in output_dir (config.yaml, metrics) is rewritten for a run that
        # trains nothing.
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        sys.exit(0)
    if adapter:
        check_resumed_adapter_scale(cfg.model, point.checkpoint)
    checkpointer = tt_config.instantiate(cfg_checkpointer, should_load_recipe_state=False)
    ckpt = read_checkpoint(checkpointer, cfg_checkpointer)
    if adapter:
        ckpt[training.ADAPTER_KEY] = torch.load(point.checkpoint / ADAPTER_FILE,
                                                map_location="cpu", weights_only=True)
    return checkpointer, ckpt, saved


SYNC_LOGGING_ENV = "TUNE_RECIPES_SYNC_LOGGING"


def build_reporter(cfg: DictConfig, device, is_main: bool = True,
                   resume_step: Optional[int] = None) -> StepReporter:
    """Metric logger (main process only; it also writes config.yaml) + progress bar.
    ``resume_step``: a resumed run's first step; rows a killed run logged after it are
    dropped (our JSONL logger), so no step is logged twice."""
    metric_logger = None
    if is_main:
        metric_logger = tt_config.instantiate(cfg.metric_logger)
        metric_logger.log_config(cfg)
        # Loggers that write beyond metrics.jsonl (TensorBoard, MLflow, W&B) say where, once.
        where = metric_logger.where() if hasattr(metric_logger, "where") else None
        if where:
            log.info("%s", where)
        if resume_step is not None and hasattr(metric_logger, "drop_rows_after"):
            metric_logger.drop_rows_after(resume_step)
        elif resume_step is None and hasattr(metric_logger, "begin_run"):
            # Setup is done (this is its last step): a fresh run's config.yaml is written and an
            # earlier run's metrics kept aside now, even if no row is ever logged (a short run
            # with a large log_every_n_steps, a stop during the first step).
            metric_logger.begin_run(None)
    # log_level (torchtune's key): WARNING or quieter turns the progress bar off too.
    quiet = str(cfg.get("log_level", "INFO")).upper() in ("WARNING", "WARN", "ERROR", "CRITICAL")
    # SYNC_LOGGING_ENV=1: every logged step waits for the device (no one-step lag on CUDA); for
    # measuring what the lag buys (bench_recipes.py --env TUNE_RECIPES_SYNC_LOGGING=1), not a setting.
    lag = False if os.environ.get(SYNC_LOGGING_ENV) == "1" else None
    # The picture is drawn from the file the logger writes (its log_dir and filename), beside it;
    # a logger that writes no metrics.jsonl (torchtune's DiskLogger, TensorBoard, W&B) gets none,
    # and no note saying so at the end of a run that logged as asked.
    metrics_file = getattr(metric_logger, "path", None)
    plot_from = str(metrics_file) if metrics_file is not None else None
    return StepReporter(metric_logger, cfg.get("log_every_n_steps", 1), device,
                        cfg.get("log_peak_memory_stats", False), is_main=is_main,
                        show_progress=False if quiet else None, plot_from=plot_from, lag=lag)


def steps_per_epoch(num_batches: int, gradient_accumulation_steps: int,
                    max_steps_per_epoch: Optional[int], batch_size: int,
                    num_examples: Optional[int] = None, world_size: int = 1,
                    unit: str = "examples") -> int:
    """Optimizer steps in one epoch of ``num_batches`` micro-batches (per rank);
    ``num_examples``: the dataset's length (``unit``: examples, or packs), for the error."""
    steps = num_batches // gradient_accumulation_steps
    if max_steps_per_epoch is not None:
        steps = min(steps, max_steps_per_epoch)
    if steps < 1:
        held = ""
        if num_examples is not None:
            # The sampler gives each process ceil(N / world_size) (padded by repeats); batches
            # are full ones only (drop_last).
            per_process = -(-num_examples // world_size)
            fits = per_process // gradient_accumulation_steps
            held = (f" (the dataset holds {num_examples} {unit}"
                    + (f", {per_process} a process" if world_size > 1 else "")
                    + (f": batch_size={fits} at most fits one step" if fits >= 1 else "") + ")")
        raise ConfigError(
            f"the dataset yields {num_batches} batches of batch_size={batch_size} per process, "
            f"fewer than gradient_accumulation_steps={gradient_accumulation_steps}{held}"
        )
    return steps


@dataclass
class DataAndSchedule:
    dataloader: Any
    steps_per_epoch: int
    global_step: int
    lr_schedule: Any
    first_step_in_epoch: int = 0  # > 0: resumed mid-epoch, the dataloader positioned there


def setup_data_and_schedule(
    cfg: DictConfig, tokenizer, optimizer, state: RecipeState, *, ignore_index: int,
    resume: Optional[SavedState] = None, world_size: int = 1, rank: int = 0,
    max_seq_len: Optional[int] = None, is_main: Optional[bool] = None, device=None,
    spans: bool = False,
) -> DataAndSchedule:
    """Dataset and dataloader (order from the seed, epoch and rank only), optimizer steps per
    epoch, the global step a run starts at, and the LR schedule positioned at that step.

    A resumed run's ``resume`` is applied to ``state`` first, here and nowhere else: its seed
    (data order), ``max_steps_per_epoch`` and ``epochs_run`` must be in place before the
    dataloader and schedule are built, and its RNG restored after model init consumed it. A
    mid-epoch checkpoint also positions this rank's dataloader after the batches it consumed.
    ``max_seq_len``: the most tokens the model takes in a row (``padding_free`` batches' rows).
    ``is_main``: the process that prints (default: data-parallel rank 0; under tensor
    parallelism every rank of the first group has that rank). ``device``: where the batches go
    (padded batches on a GPU go on to 128-token multiples: ``padded_batch_multiple``).
    ``spans``: document masks as ``DocumentSpans`` (``document_spans_wanted``).
    """
    if resume is not None:
        if resume.mid_epoch and len(resume.rank_states) != world_size:
            raise ConfigError(
                f"the mid-epoch checkpoint in {cfg.output_dir} was written by "
                f"{len(resume.rank_states)} process(es) and this run has {world_size}: resume "
                f"with --nproc_per_node {len(resume.rank_states)} (each rank continues its own "
                "data shard)"
            )
        state.resume(resume, rank=rank)
    gradient_accumulation_steps = cfg.get("gradient_accumulation_steps", 1)
    main = rank == 0 if is_main is None else is_main
    dataset = build_dataset(cfg.dataset, tokenizer, main=main)
    padding_free = training_padding_free(cfg, dataset, device, spans)
    if padding_free and is_packed(dataset) and main:
        log.info("padding_free: packs without their padding, laid end to end")
    dataloader = build_dataloader(
        dataset, batch_size=cfg.batch_size, shuffle=cfg.shuffle,
        seed=state.seed, pad_id=tokenizer.pad_id,
        collate_fn=cfg.get("collate_fn", DEFAULT_COLLATE),
        ignore_index=ignore_index, world_size=world_size, rank=rank,
        padding_free=padding_free, max_seq_len=max_seq_len,
        pad_to_multiple_of=padded_batch_multiple(device), longest_row=getattr(tokenizer, "max_seq_len", None),
        spans=spans,
    )
    steps = steps_per_epoch(len(dataloader), gradient_accumulation_steps,
                            state.max_steps_per_epoch, cfg.batch_size,
                            num_examples=len(dataset), world_size=world_size,
                            unit="packs" if is_packed(dataset) else "examples")
    global_step = state.epochs_run * steps
    first_step = 0
    if resume is not None and resume.mid_epoch:
        first_step = resume.global_step - global_step
        loader_state = resume.rank_states[rank][DATALOADER_STATE]
        saved_shape = resume.rank_states[rank].get(DATA_SHAPE, {})
        # the fingerprint over the examples the checkpoint's covered (a row it could not read,
        # fixed in place since, is left out again)
        here = data_shape(dataloader, gradient_accumulation_steps,
                          skip=saved_shape.get(DATASET_EXAMPLES_SKIPPED, ()))
        differ = [k for k in here if k in saved_shape and saved_shape[k] != here[k]
                  and k not in (DATASET_EXAMPLES, DATASET_EXAMPLES_SKIPPED)]
        changed = [f"{k}={here[k]} (the checkpoint's: {saved_shape[k]})" for k in differ]
        if "dataset_size" in differ:  # not a key to set back: the data itself changed
            raise ConfigError(
                f"the mid-epoch checkpoint at step {resume.global_step} in {cfg.output_dir} was "
                f"written on a dataset of {saved_shape['dataset_size']} examples, this run's holds "
                f"{here['dataset_size']} (a row removed or added): resume on the data it was "
                "written on (a row fixed in place, not removed), or start a new run from its weights")
        examples = (here[DATASET_EXAMPLES], saved_shape.get(DATASET_EXAMPLES))
        if not changed and None not in examples and examples[0] != examples[1]:
            raise ConfigError(
                f"the mid-epoch checkpoint at step {resume.global_step} in {cfg.output_dir} was "
                f"written on other examples than this run's dataset holds (as many, "
                f"{here['dataset_size']}, but not the same tokens: another data file, or the "
                "dataset or tokenizer settings changed): resume on the data it was written on, "
                "or start a new run from its weights")
        if changed:
            raise ConfigError(
                f"the mid-epoch checkpoint at step {resume.global_step} in {cfg.output_dir} was "
                f"written with other data settings: {', '.join(changed)}; resume with the "
                "values it was written with (the data order depends on them)"
            )
        consumed = loader_state.get("_num_yielded")
        if not 0 < first_step < steps or consumed != first_step * gradient_accumulation_steps:
            raise ConfigError(
                f"the mid-epoch checkpoint at step {resume.global_step} does not fit this run: "
                f"it is step {first_step} of epoch {state.epochs_run} after {consumed} batches, "
                f"but an epoch here has {steps} steps of {gradient_accumulation_steps} batches; "
                "resume with the dataset, batch_size and gradient_accumulation_steps it was "
                "written with"
            )
        # Applies to the next iterator (the first epoch's), after sampler.set_epoch.
        dataloader.load_state_dict(loader_state)
        global_step = resume.global_step
    if resume is not None and resume.optimizer is None:
        # A finished run continued (no optimizer state saved): torch's schedulers entered at
        # last_epoch >= 0 read each group's initial_lr, which a loaded optimizer state holds.
        base = optimizer.first if isinstance(optimizer, OptimizerInBackward) else optimizer
        for group in base.param_groups:
            group.setdefault("initial_lr", group["lr"])
    total_steps = state.total_epochs * steps
    # NOTE: validation warns from epochs x max_steps_per_epoch alone; only here, with the dataset
    # built, is a run's length known where the dataset sets it (no max_steps_per_epoch, or fewer
    # batches than it allows). Warn then, in one process, unless validation already did.
    warmup = OmegaConf.select(cfg, "lr_scheduler.num_warmup_steps", default=None)
    bound = None if state.max_steps_per_epoch is None else state.total_epochs * state.max_steps_per_epoch
    if (rank == 0 if is_main is None else is_main) and \
            (bound is None or (steps < state.max_steps_per_epoch and not warmup_problem(warmup, bound))):
        problem = warmup_problem(
            warmup, total_steps, f": {state.total_epochs} epoch(s) of {steps} steps, {len(dataloader)} "
            f"batches of batch_size={cfg.batch_size} an epoch in each of {world_size} process(es)")
        if problem:
            print(f"warning: {problem}", file=sys.stderr)
    after = cfg.get("fake_quant_after_n_steps", None)
    if (rank == 0 if is_main is None else is_main) and isinstance(after, int) \
            and not isinstance(after, bool) and after >= total_steps:
        print(f"warning: fake_quant_after_n_steps={after} is not before the run's last step "
              f"({total_steps} optimizer steps): the run never trains with fake quantization, "
              "so it is a plain fine-tune; lower fake_quant_after_n_steps", file=sys.stderr)
    every = cfg.get("save_every_n_steps", None)
    if (rank == 0 if is_main is None else is_main) and isinstance(every, int) \
            and not isinstance(every, bool) and every > 0 and steps > 0 \
            and not any(mid_epoch_save_due(done, (done - 1) % steps, steps, every)
                        for done in range(global_step + 1, total_steps + 1)):
        print(f"warning: save_every_n_steps={every} writes no mid-epoch checkpoint in this "
              f"run ({state.total_epochs} epoch(s) of {steps} steps, each saved at its end); "
              f"lower it below {steps} for checkpoints inside an epoch", file=sys.stderr)
    lr_schedule = LRSchedule(
        cfg.get("lr_scheduler", None), optimizer, num_training_steps=total_steps,
        last_epoch=global_step - 1,
    )
    return DataAndSchedule(dataloader, steps, global_step, lr_schedule, first_step)


def longest_row_all_take(*models: nn.Module) -> Optional[int]:
    """The most tokens a row may hold for every one of ``models`` (their ``max_seq_len``, the
    length of torchtune's RoPE caches); None when none of them says."""
    lengths = [m.max_seq_len for m in models if getattr(m, "max_seq_len", None) is not None]
    return min(lengths) if lengths else None


def setup_step_driver(
    cfg: DictConfig, *, path: NormalizationPath, runtime: Runtime, state: RecipeState,
    resume: Optional[SavedState], model: nn.Module, tokenizer, optimizer, ignore_index: int,
    save_checkpoint: Optional[Callable[[int, Position], None]],
    hooks: Sequence[StepHook] = (), eval_loss=None, also_fed: Sequence[nn.Module] = (),
) -> StepDriver:
    """The last setup step of every recipe: apply a resumed state, build the data and the LR
    schedule (``setup_data_and_schedule``), the progress reporter, and the step driver that runs
    ``path`` over the model's trainable parameters, with the ``profiler`` key's hook (if on)
    after the recipe's ``hooks``. ``also_fed``: other models given the same batches (a
    distillation teacher): padded and padding-free rows stay within what each of them takes.
    ``save_checkpoint``: the recipe's ``save_checkpoint(epoch, position)``, which a
    single-device run calls to keep its steps when a data error stops it mid-epoch (every
    recipe passes it: the driver never calls it in a distributed run).

    NOTE: data, token counts and the gradient average go by the *data-parallel* size and rank
    (``runtime.dp_*``), not the world's: under tensor parallelism the ranks of one group see
    the same batch, and counting it once per rank would weight it tensor_parallel_dim times."""
    max_seq_len = longest_row_all_take(model, *also_fed)
    spans = document_spans_wanted(runtime.device, cfg.get("dtype", "bf16"), model, *also_fed)
    compile_warning = whole_model_dynamic_compile_warning(cfg, runtime.device, spans)
    if compile_warning and runtime.is_main:
        print(f"warning: {compile_warning}", file=sys.stderr)
    plan = setup_data_and_schedule(cfg, tokenizer, optimizer, state, ignore_index=ignore_index,
                                   resume=resume, world_size=runtime.dp_size, rank=runtime.dp_rank,
                                   max_seq_len=max_seq_len, is_main=runtime.is_main,
                                   device=runtime.device, spans=spans)
    normalizer = StepLossNormalizer(
        cfg.get("gradient_accumulation_steps", 1),
        optimizer_in_bwd=path.steps_in_backward,
        distributed=runtime.distributed, world_size=runtime.dp_size, device=runtime.device,
        group=runtime.dp_group,
    )
    if normalizer.path != path:
        raise ValueError(f"path {path.value} does not match the run's flags ({normalizer.path.value})")
    validator = None
    val_loader = build_validation_dataloader(cfg, tokenizer, ignore_index=ignore_index,
                                             world_size=runtime.dp_size, rank=runtime.dp_rank,
                                             max_seq_len=max_seq_len, device=runtime.device,
                                             spans=spans)
    if val_loader is not None:
        if eval_loss is None:
            raise ConfigError("dataset_val: this recipe has no validation loss")
        validator = Validator(model, eval_loss, val_loader, ignore_index=ignore_index,
                              device=runtime.device, distributed=runtime.distributed,
                              group=runtime.dp_group, every_n_steps=cfg.get("run_val_every_n_steps", None))
    profiler = setup_profiler(cfg.get("profiler", None), output_dir=cfg.output_dir,
                              device=runtime.device, rank=runtime.rank,
                              distributed=runtime.distributed)
    hooks = list(hooks) + ([profiler] if profiler is not None else [])
    return StepDriver(
        normalizer=normalizer, parameters=[p for p in model.parameters() if p.requires_grad],
        optimizer=optimizer, lr_schedule=plan.lr_schedule, dataloader=plan.dataloader,
        steps_per_epoch=plan.steps_per_epoch, global_step=plan.global_step, state=state,
        reporter=build_reporter(cfg, runtime.device, is_main=runtime.is_main,
                                resume_step=plan.global_step if resume is not None else None),
        device=runtime.device, ignore_index=ignore_index,
        clip_grad_norm=cfg.get("clip_grad_norm", None), hooks=hooks, validator=validator,
        on_nonfinite=cfg.get("on_nonfinite", "raise"),
        save_every_n_steps=cfg.get("save_every_n_steps", None),
        first_step_in_epoch=plan.first_step_in_epoch,
        save_on_data_error=save_checkpoint,  # used by a run on one device only (the driver)
    )
