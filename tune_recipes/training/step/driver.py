"""The training loop of every recipe, once: epochs -> optimizer steps -> micro-batches.

A recipe's ``train`` reads::

    for epoch in driver.epochs():
        for step in epoch:
            for batch in step:                                  # on the device
                step.backward(self._loss_step(batch, step))     # a mean over batch's tokens
            step.finish()                                       # normalize, clip, step, LR, log
            if step.checkpoint_due:                             # save_every_n_steps
                self.save_checkpoint(epoch.index, driver.position())
        self.save_checkpoint(epoch.index)

The driver owns everything with one correct answer: grouping ``gradient_accumulation_steps``
micro-batches into a step, stopping an epoch after ``steps_per_epoch`` steps (which already
honours ``max_steps_per_epoch``), counting each micro-batch's unmasked tokens on the CPU, the
factor backward needs (``StepLossNormalizer``), the step boundary in one order
(``complete_optimizer_step``), the global step, and the progress bar and metrics.

Methods extend a step through hooks (``StepHook``: QAT switches fake quantization on before a
step and logs whether it is on) and through ``step.backward(loss, extras=...)`` (distillation's
two loss terms, logged as token means like the loss).

Mid-epoch checkpoints (``save_every_n_steps``): ``step.checkpoint_due`` says when, and
``driver.position()`` gathers where the run stands (the global step; each rank's RNG and
dataloader state). A driver built with ``first_step_in_epoch`` (a run resumed from such a
checkpoint, its dataloader already loaded) starts its first epoch at that step.

A data error that stops a single-device run mid-epoch (an example the template refuses, a step
without a label token: a ``ConfigError`` while a step runs) first saves the steps trained since
the last checkpoint, through ``save_on_data_error`` (the recipe's ``save_checkpoint``), as the
mid-epoch checkpoint of the last finished step; its line then says so. A distributed run only
stops: its other ranks are elsewhere in the step, and a save is a collective.
"""

import contextlib
import hashlib
import sys
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Protocol, Sequence, Tuple

import torch
import torch.distributed as dist
from torchtune.utils import get_logger

from tune_recipes.config import ConfigError, positive_int_or_none
from tune_recipes.training.reporting import run_status
from tune_recipes.training.step.batch import count_valid_tokens, to_device
from tune_recipes.training.step.nonfinite import (
    NonFiniteError,
    NonFiniteGuard,
    check_clip_grad_norm,
    check_mode,
)
from tune_recipes.training.step.normalization import (
    StepLossNormalizer,
    grad_norm_and_clip_,
)

log = get_logger("INFO")

# Keys of each rank's entry in ``Position.ranks``.
RNG_STATE = "rng_state"
CUDA_RNG_STATE = "cuda_rng_state"
DATALOADER_STATE = "dataloader"
# What the data order of a mid-epoch checkpoint depends on besides the seed: a resume with
# other values would continue on other data (the sampler resumes by sample count).
DATA_SHAPE = "data_shape"


@dataclass
class Position:
    """Where a run stands after an optimizer step: what a mid-epoch checkpoint needs besides
    the weights, optimizer and recipe state. ``ranks``: one dict per rank, in rank order."""

    global_step: int
    ranks: List[Dict[str, Any]]


DATASET_EXAMPLES = "dataset_examples"  # data_shape's fingerprint of the examples
# The fingerprint's examples left out (they could not be made into tokens): a resume leaves
# out the same ones, so a row fixed in place still matches.
DATASET_EXAMPLES_SKIPPED = "dataset_examples_skipped"


def dataset_examples_fingerprint(dataset, skip: Sequence[int] = ()) -> Tuple[Optional[str], List[int]]:
    """A hash of the token ids of a few examples (the first two, the middle and the last), to
    tell the dataset a mid-epoch checkpoint was written on from another of the same size (a
    data position means nothing on other examples), and the examples left out of it: those in
    ``skip`` and any that cannot be made into tokens (a ``ConfigError``: the bad row a data
    error stops at). (None, []) where an example holds no ``tokens``."""
    n = len(dataset)
    digest, skipped = hashlib.sha1(), []
    for i in sorted({0, 1, n // 2, n - 1} & set(range(n))):
        if i in skip:
            skipped.append(i)
            continue
        try:
            example = dataset[i]
        except ConfigError:
            skipped.append(i)
            continue
        tokens = example.get("tokens") if isinstance(example, dict) else None
        if tokens is None:
            return None, []
        digest.update(torch.as_tensor(tokens, dtype=torch.int64).numpy().tobytes())
    return digest.hexdigest()[:16], skipped


def mid_epoch_save_due(global_step: int, index_in_epoch: int, steps_per_epoch: int,
                       save_every_n_steps: Optional[int]) -> bool:
    """Whether ``save_every_n_steps`` asks for a mid-epoch checkpoint after the optimizer step
    that made ``global_step`` steps (``index_in_epoch``: its 0-based place in its epoch). Never
    at an epoch's last step: the epoch checkpoint is written right after it."""
    return (save_every_n_steps is not None and global_step % save_every_n_steps == 0
            and index_in_epoch + 1 < steps_per_epoch)


def data_shape(dataloader, gradient_accumulation_steps: int, skip: Sequence[int] = ()) -> Dict[str, Any]:
    """What a mid-epoch checkpoint's data position depends on, recorded with it and compared on
    resume (a key an older checkpoint lacks, or a None, is not compared). ``skip``: examples
    to leave out of the fingerprint (a checkpoint's ``DATASET_EXAMPLES_SKIPPED``)."""
    fingerprint, skipped = dataset_examples_fingerprint(dataloader.dataset, skip)
    shape = {"batch_size": dataloader.batch_size, "dataset_size": len(dataloader.dataset),
             "gradient_accumulation_steps": gradient_accumulation_steps,
             "shuffle": bool(getattr(dataloader.sampler, "shuffle", False)),
             DATASET_EXAMPLES: fingerprint}
    if skipped:
        shape[DATASET_EXAMPLES_SKIPPED] = skipped
    return shape


class StepHook(Protocol):
    def before_step(self, global_step: int) -> None:
        """Runs before the first micro-batch of the step numbered ``global_step`` (0-based)."""

    def metrics(self) -> Dict[str, Any]:
        """Extra values to log with the step."""

    # Optional: ``end_epoch()``, run when an epoch's last step is done, before the epoch-end
    # checks, validation and the recipe's checkpoint (the profiler closes that step's window
    # there, so that work is not counted in the step); ``close()``, run once by
    # ``StepDriver.close`` (e.g. the profiler writes its trace).


def complete_optimizer_step(normalizer: StepLossNormalizer, parameters: Iterable[torch.nn.Parameter],
                            optimizer, lr_schedule, clip_grad_norm: Optional[float],
                            guard: Optional[NonFiniteGuard] = None, step: int = 0, where: str = ""):
    """The step boundary, in the one order every path uses:
    normalize -> clip (or measure) -> [non-finite check] -> optimizer.step -> zero_grad -> LR.

    Only the normalization depends on the path (skip / rescale / in-backward); clipping, the
    optimizer step and zero_grad run on every path. ``guard`` (``on_nonfinite``) records
    whether the step (number ``step``, at ``where``) is finite and, in skip mode, drops its
    update. Returns ``(loss_to_log, grad_norm, lr)`` where ``lr`` is the rate this step used.
    """
    params = list(parameters)
    loss_to_log = normalizer.finish_step(params)
    grad_norm = grad_norm_and_clip_(params, clip_grad_norm)
    lr = lr_schedule.lr
    why = "no unmasked label token" if normalizer.last_step_empty else None
    if guard is None or guard.allow_update(loss_to_log, grad_norm, params, step, where, why=why):
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    lr_schedule.step()
    return loss_to_log, grad_norm, lr


def _several_ranks() -> bool:
    """Whether this process is one rank of several (a process group of more than one)."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


class StepDriver:
    """Runs the epochs of a training run; see the module docstring.

    ``state`` is the run's ``RecipeState`` (``epochs_run``, ``total_epochs``): the driver
    advances ``epochs_run`` at the end of each epoch, before the recipe saves its checkpoint.
    ``parameters`` are the trainable ones (normalized and clipped at the step boundary).
    """

    def __init__(self, *, normalizer: StepLossNormalizer, parameters: Sequence[torch.nn.Parameter],
                 optimizer, lr_schedule, dataloader, steps_per_epoch: int, global_step: int,
                 state, reporter, device: torch.device, ignore_index: int,
                 clip_grad_norm: Optional[float] = None, hooks: Sequence[StepHook] = (),
                 validator=None, on_nonfinite: str = "raise",
                 save_every_n_steps: Optional[int] = None, first_step_in_epoch: int = 0,
                 save_on_data_error: Optional[Callable[[int, "Position"], None]] = None) -> None:
        self.normalizer = normalizer
        self.parameters = list(parameters)
        self.optimizer = optimizer
        self.lr_schedule = lr_schedule
        self.dataloader = dataloader
        self.steps_per_epoch = steps_per_epoch
        self.global_step = global_step
        self.state = state
        self.reporter = reporter
        self.device = device
        self.ignore_index = ignore_index
        self.clip_grad_norm = check_clip_grad_norm(clip_grad_norm)
        self.guard = NonFiniteGuard(check_mode(
            on_nonfinite, optimizer_in_bwd=normalizer.path.steps_in_backward))
        self.guard.skipped_steps = state.skipped_steps  # a resumed run continues the count
        normalizer.skip_empty_steps = self.guard.mode == "skip"
        self._staged_flag = None  # a logged step's flag, checked one step later (lagging reporter)
        self.hooks: List[StepHook] = list(hooks)
        # Validation loss (training/step/validation.py): every run_val_every_n_steps and at
        # each epoch end; None without dataset_val.
        self.validator = validator
        self._validated_at: Optional[int] = None
        self.save_every_n_steps = positive_int_or_none("save_every_n_steps", save_every_n_steps)
        self._data_shape: Optional[Dict[str, Any]] = None  # position()'s, built at its first call
        # save_checkpoint(epoch, position) of a single-device recipe, for a data error mid-epoch;
        # the last step boundary (global step, this rank's entry) and the newest step saved.
        # NOTE: one device only, decided here: a distributed rank meeting a bad example is alone
        # in that (the others are inside the step's collectives) and a save is a collective, so
        # a distributed run neither saves nor snapshots its host state at every step.
        self._save_on_data_error = None if _several_ranks() else save_on_data_error
        self._boundary: Optional[Tuple[int, Dict[str, Any]]] = None
        self._saved_step = global_step
        if not 0 <= first_step_in_epoch < steps_per_epoch:
            raise ValueError(f"first_step_in_epoch={first_step_in_epoch} is outside an epoch of "
                             f"{steps_per_epoch} steps")
        # The first epoch's steps already run (a mid-epoch resume); later epochs start at 0.
        self._resume_at = first_step_in_epoch
        if reporter.is_main:
            log.info("loss normalization: %s", normalizer.path.describe())

    @property
    def gradient_accumulation_steps(self) -> int:
        return self.normalizer.gradient_accumulation_steps

    def epochs(self) -> Iterator["Epoch"]:
        self.optimizer.zero_grad(set_to_none=True)
        for epoch in range(self.state.epochs_run, self.state.total_epochs):
            yield Epoch(self, epoch)

    def validate(self) -> None:
        """Run the validation set now (once per global step) and log ``val_loss``."""
        if self.validator is None or self._validated_at == self.global_step:
            return
        # Never validate weights a non-finite step produced (with the lagging reporter the
        # logged step's flag is read one step late; validation waits for the device anyway).
        self.check_finite()
        with self.reporter.paused():
            val_loss = self.validator()
        self._validated_at = self.global_step
        self.reporter.log_validation(self.global_step, val_loss)

    def check_finite(self) -> None:
        """Stop (``NonFiniteError``) if any step so far had a non-finite loss or gradient norm;
        one host sync. The driver calls it at logged steps and epoch ends; call it before
        saving anything else."""
        self._staged_flag = None  # the full check covers it
        try:
            self.guard.check()
        except Exception:
            self.reporter.end_epoch()  # close the progress bar: the error gets its own line
            raise

    def check_finite_at_logged_step(self) -> None:
        """The non-finite check of logged steps, at the pace of the reporter's rows: at the
        logged step itself when the reporter waits for the device there (its row read the loss
        back already, so this adds no sync on the main rank; the others wait at the same step,
        so all ranks stop together), else one step late, from the flag staged at that step.
        NOTE: reading the flag at the logged step itself would wait for the device to drain,
        which is what the lagging reporter avoids."""
        logged = self.global_step % self.reporter.log_every_n_steps == 0
        if not self.reporter.lags:
            if logged:
                self.check_finite()
            return
        staged, self._staged_flag = self._staged_flag, None
        if staged is not None:
            try:
                self.guard.check(staged)
            except Exception:
                self.reporter.end_epoch()
                raise
        # Its pinned buffer back to the cache before the next one is taken: a new pinned
        # allocation would wait for the device.
        del staged
        if logged:
            self._staged_flag = self.guard.stage(self.global_step, self.device)

    def position(self) -> Position:
        """Where the run stands now, for a mid-epoch checkpoint; call it right after
        ``step.finish()``. A collective in a distributed run (every rank calls it; the ranks'
        entries are all-gathered). A non-finite step so far stops the run first: such weights
        are never checkpointed."""
        self.check_finite()
        # The row still waiting for its values (the lagging reporter) is written before the
        # checkpoint: a run killed after the save would otherwise never log the saved step.
        self.reporter.flush()
        mine = {**self._rank_entry(), DATA_SHAPE: self._shape()}
        ranks = [mine]
        if _several_ranks():
            ranks = [None] * dist.get_world_size()
            dist.all_gather_object(ranks, mine)
        return Position(self.global_step, ranks)

    def _shape(self) -> Dict[str, Any]:
        """``data_shape`` of this run, built at the first checkpoint that needs it (it reads a
        few examples for their fingerprint, leaving out one that cannot be made into tokens)."""
        if self._data_shape is None:
            self._data_shape = data_shape(self.dataloader, self.normalizer.gradient_accumulation_steps)
        return self._data_shape

    def _rank_entry(self) -> Dict[str, Any]:
        """This rank's RNG and dataloader state, now."""
        entry = {RNG_STATE: torch.get_rng_state(), DATALOADER_STATE: self.dataloader.state_dict()}
        if self.device.type == "cuda":
            entry[CUDA_RNG_STATE] = torch.cuda.get_rng_state(self.device)
        return entry

    def _mark_boundary(self) -> None:
        """After a step (before the next fetches a batch): where a save at a data error would
        resume from. Host state only, no device sync (~50 us a step on a CPU)."""
        if self._save_on_data_error is not None:
            self._boundary = (self.global_step, self._rank_entry())

    def save_before_data_error(self, epoch: int, error: ConfigError) -> None:
        """A data error stops the run: first save the steps finished since the last checkpoint
        as a mid-epoch checkpoint at the last step boundary (the weights and optimizer are
        still those of that step: only ``finish`` changes them), then raise ``error`` saying
        so. Nothing is saved for a distributed run or with no new step; a non-finite step
        found here is raised instead (its weights are never checkpointed)."""
        if self._save_on_data_error is None or isinstance(error, NonFiniteError):
            return  # (None: a distributed run, see __init__)
        # (no boundary yet: no step finished in this epoch)
        step, entry = self._boundary if self._boundary is not None else (self._saved_step, None)
        said = str(error).rstrip(".")
        resume = ("a run on the same examples (a row fixed in place: as many examples, in the same "
                  "order) continues from there with resume_from_checkpoint=True")
        if step <= self._saved_step:
            if self._saved_step > 0:  # nothing new since the newest checkpoint: say it is there
                raise ConfigError(f"{said}. The training up to step {self._saved_step} is in "
                                  f"output_dir's newest checkpoint: {resume}") from None
            return
        try:
            self.guard.check()
        except NonFiniteError as bad:
            raise bad from None
        if self.reporter.is_main:
            # (a full model's save takes a while: say why the run pauses before its error line)
            print(f"stopping at a data error; first saving the training up to step {step} "
                  f"(step_{step}/)", file=sys.stderr, flush=True)
        try:
            self._save_on_data_error(epoch, Position(step, [{**entry, DATA_SHAPE: self._shape()}]))
        except Exception as failed:  # noqa: BLE001 - the data error stays the run's one line
            why = str(failed).splitlines()[0] if str(failed) else type(failed).__name__
            raise ConfigError(f"{said} (saving the training up to step {step} first failed: {why})") from None
        self._saved_step = step
        raise ConfigError(
            f"{said}. The training up to step {step} is saved as step_{step}/ in output_dir: "
            f"{resume}") from None

    def close(self) -> None:
        for hook in self.hooks:
            if hasattr(hook, "close"):
                hook.close()
        self.reporter.close()


class Epoch:
    """Iterating it yields the epoch's ``Step``s; when they are done, ``epochs_run`` counts it."""

    def __init__(self, driver: StepDriver, index: int) -> None:
        self.driver = driver
        self.index = index

    def __iter__(self) -> Iterator["Step"]:
        d = self.driver
        first, d._resume_at = d._resume_at, 0
        d.dataloader.sampler.set_epoch(self.index)
        d.reporter.start_epoch(self.index, d.state.total_epochs, d.steps_per_epoch, first)
        if first:
            # NOTE: keep this save/restore. Starting an iterator draws a seed from the global
            # RNG (torch's DataLoader base seed). The uninterrupted run drew it at the epoch's
            # start, before the RNG state the mid-epoch checkpoint restored; drawing it again
            # here would shift every later random number (dropout) against that run.
            rng = torch.get_rng_state()
            iterator = iter(d.dataloader)  # continues after the loaded position
            torch.set_rng_state(rng)
        else:
            iterator = iter(d.dataloader)
        batches = enumerate(iterator, start=first * d.gradient_accumulation_steps)
        # Saved by now: the run's start, the checkpoint resumed, or the previous epoch's.
        d._saved_step, d._boundary = d.global_step, None
        for index in range(first, d.steps_per_epoch):
            step = Step(d, self.index, batches, index)
            yield step
            if not step.finished:
                raise RuntimeError("a training step ended without step.finish()")
            if step.checkpoint_due:  # the recipe saved it
                d._saved_step = d.global_step
            d._mark_boundary()
        for hook in d.hooks:
            if hasattr(hook, "end_epoch"):
                hook.end_epoch()
        # Before the recipe saves this epoch: a non-finite step must stop the run first.
        d.check_finite()
        d.validate()
        d.reporter.end_epoch()
        d.state.epochs_run = self.index + 1


class Step:
    """One optimizer step. Iterating it yields its micro-batches, on the device; call
    ``backward`` once per micro-batch, then ``finish`` once."""

    def __init__(self, driver: StepDriver, epoch: int, batches, index: int = 0) -> None:
        self.driver = driver
        self.epoch = epoch
        self.index = index  # in the epoch, 0-based
        self._batches = batches
        self.num_tokens = 0  # the current micro-batch's unmasked tokens (a CPU count)
        self._where = ""
        self._first_batch: Optional[int] = None
        self._pending_backward = False
        self.finished = False

    def __iter__(self) -> Iterator[Dict[str, Any]]:
        d = self.driver
        for hook in d.hooks:
            hook.before_step(d.global_step)
        for _ in range(d.gradient_accumulation_steps):
            with self._bar_closed_on_config_error():  # an example that cannot be made into tokens
                idx, batch = next(self._batches)
            if self._first_batch is None:
                self._first_batch = idx
            # Counted on the CPU labels: a Python int, no device sync.
            self.num_tokens = count_valid_tokens(batch["labels"], d.ignore_index)
            # As logged: the step's number in metrics.jsonl, the batch's in its epoch.
            self._where = f"epoch {self.epoch}, step {d.global_step + 1} (batch {idx} of the epoch)"
            self._pending_backward = True
            yield to_device(batch, d.device)
            if self._pending_backward:
                raise RuntimeError("a micro-batch ended without step.backward(loss)")

    @property
    def checkpoint_due(self) -> bool:
        """After ``finish``: whether ``save_every_n_steps`` asks for a mid-epoch checkpoint
        now. Never at an epoch's last step: the epoch checkpoint is written right after it."""
        d = self.driver
        return self.finished and mid_epoch_save_due(d.global_step, self.index, d.steps_per_epoch,
                                                    d.save_every_n_steps)

    @contextlib.contextmanager
    def _bar_closed_on_config_error(self):
        """A data problem found mid-step (an example that cannot be made into tokens, no label
        token) prints one line: the waiting row written and the progress bar closed first, so
        the line stands on its own; the steps since the last checkpoint saved before it
        (``StepDriver.save_before_data_error``)."""
        try:
            yield
        except ConfigError as e:
            self.driver.reporter.stop_for_error()
            self.driver.save_before_data_error(self.epoch, e)
            raise

    @property
    def loss_scaling(self) -> float:
        """The factor ``backward`` will multiply this micro-batch's mean loss by; a loss that
        pre-computes its gradients in forward (the fused loss) takes it as ``scaling``."""
        with self._bar_closed_on_config_error():  # no rank had a label token (pre-forward)
            return self.driver.normalizer.backward_factor(self.num_tokens, where=self._where)

    def backward(self, mean_loss: torch.Tensor, extras: Optional[Dict[str, torch.Tensor]] = None) -> None:
        """Backward this micro-batch's mean loss with the factor its path needs. ``extras``:
        other per-token means to log with the step (e.g. distillation's loss terms)."""
        d = self.driver
        with self._bar_closed_on_config_error():
            to_backward = d.normalizer.loss_to_backward(mean_loss, self.num_tokens,
                                                        where=self._where, extras=extras)
        to_backward.backward()
        d.reporter.add_tokens(self.num_tokens)
        self._pending_backward = False

    def finish(self) -> None:
        """The step boundary: normalize, clip, optimizer step, zero_grad, LR; then log."""
        d = self.driver
        number = d.global_step + 1  # as logged in metrics.jsonl
        last = self._first_batch + d.gradient_accumulation_steps - 1
        batches = f"batch {last}" if last == self._first_batch else f"batches {self._first_batch}-{last}"
        where = f"epoch {self.epoch}, step {number} ({batches} of the epoch)"
        with self._bar_closed_on_config_error():  # a step with nothing to train on
            loss, grad_norm, lr = complete_optimizer_step(
                d.normalizer, d.parameters, d.optimizer, d.lr_schedule, d.clip_grad_norm,
                guard=d.guard, step=number, where=where)
        d.global_step += 1
        d.state.skipped_steps = d.guard.skipped_steps  # a running total, checkpointed
        run_status.step_finished(d.global_step)
        metrics = dict(d.normalizer.extras)
        for hook in d.hooks:
            metrics.update(hook.metrics())
        if d.guard.mode == "skip":
            metrics["skipped_steps"] = d.guard.skipped_steps
        d.reporter.step_done(d.global_step, loss, lr, grad_norm,
                             epoch_end=self.index + 1 >= d.steps_per_epoch, **metrics)
        d.check_finite_at_logged_step()
        self.finished = True
        if d.validator is not None and d.validator.due(d.global_step):
            d.validate()
