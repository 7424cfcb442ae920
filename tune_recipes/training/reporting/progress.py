"""Progress bar and per-step metrics, the same in every recipe."""

import atexit
import contextlib
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional

import torch
from tqdm import tqdm


def tokens_per_second(num_tokens: int, seconds: float) -> float:
    return num_tokens / seconds if seconds > 0 else 0.0


def memory_stats(device: torch.device) -> Dict[str, float]:
    """Peak memory in GiB on CUDA; empty on CPU (no CUDA-only calls there)."""
    if device.type != "cuda":
        return {}
    gib = 1024**3
    return {
        "peak_memory_active_gib": torch.cuda.max_memory_allocated(device) / gib,
        "peak_memory_reserved_gib": torch.cuda.max_memory_reserved(device) / gib,
    }


def device_synchronizer(device: torch.device) -> Callable[[], None]:
    """A function that waits until ``device`` has finished all queued work (a no-op on CPU)."""
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    accel = getattr(torch, device.type, None)
    sync = getattr(accel, "synchronize", None) if device.type != "cpu" else None
    return sync if sync is not None else (lambda: None)


# Pinned buffers all come in one size (so torch's pinned-memory cache can hand any freed one
# back), and a few are taken and returned up front. NOTE: keep both. Allocating pinned memory
# waits for the device (CUDA's implicit synchronization); without them each new size and the
# first rows of a run drained the queue once, which slowed the first logged steps' windows.
_PINNED_SLOTS = 64


def _pinned_slots() -> torch.Tensor:
    return torch.empty(_PINNED_SLOTS, dtype=torch.float64, pin_memory=True)


def warm_pinned_cache(count: int = 8) -> None:
    """Take ``count`` pinned buffers and return them to the cache (before training starts)."""
    held = [_pinned_slots() for _ in range(count)]
    del held


class DeviceValues:
    """Scalars of one step, read on the host later without waiting for later steps' work.

    ``tensor.item()`` waits for everything queued on the stream so far: once the host runs a
    step ahead, that includes the whole next step. On CUDA the scalars are instead copied
    (non-blocking) into pinned host memory right after they are computed, with a timing event
    behind the copy; ``values()`` waits for that event only, and ``seconds_since`` measures the
    device's own timeline between two such points. Elsewhere they are read at once, after
    ``synchronize`` and the host clock (the device's work is done by then).
    Plain numbers among ``values`` pass through unchanged."""

    def __init__(self, values: Dict[str, Any], device: torch.device, lagged: bool,
                 synchronize: Optional[Callable[[], None]] = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self._plain = {k: v for k, v in values.items() if not isinstance(v, torch.Tensor)}
        tensors = {k: v for k, v in values.items() if isinstance(v, torch.Tensor)}
        self._names = list(tensors)
        self._event = None
        self._time = None
        if lagged:
            self._host = None
            if tensors:
                stacked = torch.stack([t.detach().reshape(()).to(device, torch.float64)
                                       for t in tensors.values()])
                self._host = _pinned_slots()[:len(tensors)]
                self._host.copy_(stacked, non_blocking=True)
            self._event = torch.cuda.Event(enable_timing=True)
            self._event.record(torch.cuda.current_stream(device))
        else:
            (synchronize or device_synchronizer(device))()
            self._time = clock()
            self._host = torch.stack([t.detach().reshape(()).cpu().double() for t in tensors.values()]) \
                if tensors else None

    def values(self) -> Dict[str, Any]:
        if self._event is not None:
            self._event.synchronize()
        out = dict(zip(self._names, self._host.tolist())) if self._host is not None else {}
        out.update(self._plain)
        return out

    def seconds_since(self, earlier: "DeviceValues") -> float:
        if self._event is not None:
            self._event.synchronize()
            return earlier._event.elapsed_time(self._event) / 1000.0
        return self._time - earlier._time


@dataclass
class _Row:
    """A logged step whose values are still on the device."""

    step: int
    lr: float
    tokens: int
    window_steps: int
    paused_s: float
    start: Any  # the window's start mark (DeviceValues or a test's stand-in)
    end: Any    # this step's mark, holding its loss, grad norm and extras
    memory: Dict[str, float]  # peak memory when the step was queued (a host-side counter)
    epoch: Dict[str, Any]  # where in its epoch the step is (name, done, steps; epoch_end)


# Off a terminal: a plain progress line at most this often (and at each epoch's end).
PLAIN_LINE_EVERY_S = 30.0


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


# Reporters that may hold a row waiting for its step's values (the lagging reporter); each
# leaves the set in close(). A plain set, not a weak one: a run that exits through
# ``sys.exit`` (Ctrl-C, a ConfigError) has dropped its traceback, and with it the last
# reference to its reporter, before the exit handlers run.
_REPORTERS: "set[StepReporter]" = set()
_EXIT_HANDLER_REGISTERED = False


def _write_waiting_rows() -> None:
    """At interpreter exit, write the row a lagging reporter still holds.

    NOTE: keep this. A run that stops mid-epoch (an exception in a later step, Ctrl-C) never
    reaches ``close()``; without it the last logged step's row, whose step had finished, was
    lost from metrics.jsonl although the run got past that step. Registered when the first
    reporter is made, after the output_dir lock and the metric logger (wandb) register theirs:
    exit handlers run last-registered first, so the row is written while both still stand.
    """
    for reporter in list(_REPORTERS):
        reporter._write_last_row()


def _track_waiting_rows(reporter: "StepReporter") -> None:
    global _EXIT_HANDLER_REGISTERED
    _REPORTERS.add(reporter)
    if not _EXIT_HANDLER_REGISTERED:
        atexit.register(_write_waiting_rows)
        _EXIT_HANDLER_REGISTERED = True


class StepReporter:
    """Owns the progress bar and the metric logger calls of a training loop.

    ``add_tokens`` after each micro-batch; ``step_done`` at each optimizer step. Every
    ``log_every_n_steps``-th step is logged, and each epoch's last. With ``is_main=False``
    (non-zero ranks) nothing is shown or logged.

    Timing: tokens/s and ``step_time_s`` cover the window since the previous logged step (or
    the epoch start), so steps that are not logged fall into the next logged window and no step
    goes uncounted; time inside ``paused()`` (validation) is left out.

    On CUDA (``lag``, the default there) a logged step's row is written one step late, when the
    next step's work is queued: its values and its end are read through ``DeviceValues`` (a
    pinned copy and a timing event per logged step), so the host never waits for the device to
    drain. NOTE: keep it so. Waiting at every logged step (``synchronize``, ``.item()``) left the
    GPU idle while the host fetched and collated the next batch and queued its first kernels,
    every step at ``log_every_n_steps: 1``. Elsewhere (``lag=False``) a logged step waits for the
    device, then reads the clock. NOTE: never read the clock before the device is done: GPU
    work is queued asynchronously, so the window would measure how fast Python queues kernels,
    not training (it overstated tokens/s by ~40% on an H200).
    """

    def __init__(self, metric_logger, log_every_n_steps: int = 1, device: Optional[torch.device] = None,
                 log_peak_memory_stats: bool = False, is_main: bool = True,
                 synchronize: Optional[Callable[[], None]] = None,
                 clock: Callable[[], float] = time.perf_counter,
                 show_progress: Optional[bool] = None, plot_from: Optional[str] = None,
                 lag: Optional[bool] = None, mark: Optional[Callable[[Dict[str, Any]], Any]] = None) -> None:
        self.metric_logger = metric_logger
        # The bar (with loss, tokens/s and tqdm's ETA) only on an interactive terminal: piped
        # or logged output would fill with carriage-return redraws. Elsewhere (a job's log
        # file: nohup, SLURM) a plain line every PLAIN_LINE_EVERY_S at most, and at each
        # epoch's end, says the run is alive and how it goes; not where the metric logger
        # prints its own rows (a Stdout logger) nor when quiet (show_progress=False).
        tty = sys.stdout.isatty()
        self.show_progress = tty if show_progress is None else show_progress
        self.plain_lines = show_progress is None and not tty \
            and "Stdout" not in type(metric_logger).__name__
        self._clock = clock
        self._last_line_at: Optional[float] = None
        self._epoch: Dict[str, Any] = {}
        self._eta_from: Optional[tuple] = None
        # The run folder or metrics file close() draws metrics.png from, beside it (None: none).
        self.plot_from = plot_from
        self.log_every_n_steps = max(1, int(log_every_n_steps))
        self.device = device or torch.device("cpu")
        self.log_peak_memory_stats = log_peak_memory_stats
        self.is_main = is_main
        # Whether rows (and the driver's non-finite check) come one step late; see above.
        self.lags = self.device.type == "cuda" if lag is None else bool(lag)
        if self.lags and mark is None and torch.cuda.is_available():
            warm_pinned_cache()
        synchronize = synchronize or device_synchronizer(self.device)
        # mark(values): a point in the device's work holding ``values`` (tests pass a stand-in).
        self._mark = mark or (lambda values: DeviceValues(values, self.device, self.lags, synchronize, clock))
        self._pbar = None
        self._pending: Optional[_Row] = None
        self._tokens, self._window_steps, self._paused_s = 0, 0, 0.0
        self._window_start = None
        if self.lags and is_main:
            _track_waiting_rows(self)

    def start_epoch(self, epoch: int, total_epochs: int, steps: int, done: int = 0) -> None:
        """``done``: steps of this epoch already run (a run resumed mid-epoch)."""
        self.flush()
        self._epoch = {"name": f"epoch {epoch + 1}/{total_epochs}", "steps": steps, "done": done}
        self._eta_from = None  # (clock, steps done) at the epoch's first line
        if self.is_main and self.show_progress:
            self._pbar = tqdm(total=steps, initial=done, desc=f"epoch {epoch + 1}/{total_epochs}",
                              dynamic_ncols=True, file=sys.stdout)
        self._tokens, self._window_steps, self._paused_s = 0, 0, 0.0
        self._window_start = self._mark({})

    def add_tokens(self, num_tokens: int) -> None:
        self._tokens += num_tokens

    def step_done(self, global_step: int, loss: torch.Tensor, lr: float,
                  grad_norm: Optional[torch.Tensor] = None, *, epoch_end: bool = False,
                  **extra) -> None:
        """``epoch_end``: the epoch's last step, logged whatever ``log_every_n_steps`` says, so
        a run's last steps (or a run shorter than the interval) are never missing from
        ``metrics.jsonl``."""
        self._window_steps += 1
        if self._epoch:
            self._epoch["done"] += 1
        # The previous step's row: its work finished while this step's was being queued.
        self.flush()
        if self.is_main and (global_step % self.log_every_n_steps == 0 or epoch_end):
            if self._window_start is None:
                self._window_start = self._mark({})
            values = {"loss": loss, **({"grad_norm": grad_norm} if grad_norm is not None else {}), **extra}
            mark = self._mark(values)
            # Read now, not when the row is written: by then the next step is running.
            memory = memory_stats(self.device) if self.log_peak_memory_stats else {}
            row = _Row(global_step, lr, self._tokens, self._window_steps, self._paused_s,
                       self._window_start, mark, memory,
                       dict(self._epoch, epoch_end=epoch_end) if self._epoch else {})
            # The next window starts where this one ends: logging time is counted in the next
            # window, so the windows add up to the whole run's wall time.
            self._tokens, self._window_steps, self._paused_s = 0, 0, 0.0
            self._window_start = mark
            self._pending = row
            if not self.lags:
                self.flush()
        if self._pbar is not None:
            self._pbar.update(1)

    def flush(self) -> None:
        """Write the logged row still waiting for its step's values, if any."""
        row, self._pending = self._pending, None
        if row is None:
            return
        values = row.end.values()  # waits for that step's work only
        elapsed = row.end.seconds_since(row.start) - row.paused_s
        loss_value = float(values.pop("loss"))
        metrics = {
            "loss": loss_value,
            "lr": row.lr,
            "tokens_per_second_per_gpu": tokens_per_second(row.tokens, elapsed),
            "valid_tokens": row.tokens,
            # The window this row's tokens/s covers (steps since the last logged one).
            "step_time_s": elapsed / row.window_steps,
            "steps_in_window": row.window_steps,
        }
        if "grad_norm" in values:
            metrics["grad_norm"] = values.pop("grad_norm")
        metrics.update(row.memory)
        metrics.update(values)
        self.metric_logger.log_dict(metrics, step=row.step)
        if self._pbar is not None:
            self._pbar.set_postfix(loss=f"{loss_value:.4f}", lr=f"{row.lr:.2e}",
                                   tok_s=f"{metrics['tokens_per_second_per_gpu']:,.0f}",
                                   refresh=False)
        if self.plain_lines and self.is_main:
            self._plain_line(row, loss_value, metrics["tokens_per_second_per_gpu"])

    def _plain_line(self, row: "_Row", loss: float, tokens_per_s: float) -> None:
        """One line for a log file: where the run is, its loss, speed and the epoch's ETA (the
        first logged row, then at most every PLAIN_LINE_EVERY_S, and each epoch's last)."""
        now = self._clock()
        epoch = row.epoch
        if not (self._last_line_at is None or now - self._last_line_at >= PLAIN_LINE_EVERY_S
                or epoch.get("epoch_end")):
            return
        self._last_line_at = now
        where = f"step {row.step}"
        eta = ""
        if epoch:
            where = (f"{epoch['name']}, step {epoch['done']}/{epoch['steps']} "
                     f"(step {row.step} of the run)")
            # The rate since the epoch's first line: its first steps (a compile, the loader's
            # workers starting) would make an ETA of hours.
            if self._eta_from is None:
                self._eta_from = (now, epoch["done"])
            since, done_then = self._eta_from
            left = epoch["steps"] - epoch["done"]
            if epoch["done"] > done_then and left > 0:
                eta = f", epoch ETA {_duration((now - since) / (epoch['done'] - done_then) * left)}"
        self._print_line(f"{where}: loss {loss:.4f}, lr {row.lr:.2e}, {tokens_per_s:,.0f} "
                         f"tokens/s{eta}")

    def _print_line(self, line: str) -> None:
        """A plain line; a stdout that fails (a closed pipe, a full disk) ends the lines, never
        the run (the rows are in the metric logger already)."""
        try:
            print(line, flush=True)
        except OSError:
            self.plain_lines = False

    @contextlib.contextmanager
    def paused(self):
        """Time spent inside (validation) is left out of the training throughput window."""
        self.flush()
        before = self._mark({})
        try:
            yield
        finally:
            self._paused_s += self._mark({}).seconds_since(before)

    def log_validation(self, global_step: int, val_loss: float) -> None:
        if self.is_main and self.metric_logger is not None:
            self.metric_logger.log_dict({"val_loss": val_loss}, step=global_step)
        if self._pbar is not None:
            self._pbar.write(f"step {global_step}: val_loss {val_loss:.4f}")
        elif self.plain_lines and self.is_main:
            self._print_line(f"step {global_step} of the run: val_loss {val_loss:.4f}")

    def end_epoch(self) -> None:
        self.flush()
        if self._pbar is not None:
            self._pbar.close()
            self._pbar = None

    def _write_last_row(self) -> None:
        """Write the waiting row if its values can still be read; an error reading them (a
        failed device) is reported, not raised: the run's end or exit must go on."""
        try:
            self.flush()
        except Exception as e:  # noqa: BLE001
            self._pending = None
            print(f"note: the last logged step's row was not written ({type(e).__name__}: {e})",
                  file=sys.stderr)

    def stop_for_error(self) -> None:
        """Before an error's one line: the waiting row written if it can be (a failure to is
        a note, never an exception that would replace the error), the progress bar closed so
        the line gets a line of its own."""
        self._write_last_row()
        self.end_epoch()

    def close(self) -> None:
        # (A run that dies mid-epoch never gets here: _write_waiting_rows writes its waiting
        # row at exit.)
        self._write_last_row()
        self.end_epoch()
        _REPORTERS.discard(self)
        if self.metric_logger is not None:
            self.metric_logger.close()
        if self.is_main and self.plot_from is not None:
            self._plot()

    def _plot(self) -> None:
        # A picture is a convenience: a run that trained must not fail for want of one.
        try:
            from tune_recipes.plotting import plot_runs

            print(f"wrote {plot_runs([self.plot_from])}  (redraw or compare: tune plot DIR ...)")
        except Exception as e:  # matplotlib missing, a logger that writes no metrics.jsonl
            print(f"note: no metrics.png ({type(e).__name__}: {e})", file=sys.stderr)
