"""Progress bar and per-step metrics, the same in every recipe."""

import contextlib
import sys
import time
from typing import Callable, Dict, Optional

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


class StepReporter:
    """Owns the progress bar and the metric logger calls of a training loop.

    ``add_tokens`` after each micro-batch; ``step_done`` at each optimizer step. Only every
    ``log_every_n_steps``-th step reads the loss back from the device (one sync per logged step).
    With ``is_main=False`` (non-zero ranks) nothing is shown or logged.

    Timing: tokens/s and ``step_time_s`` cover the window since the previous logged step (or
    the epoch start), so steps that are not logged fall into the next logged window and no step
    goes uncounted. NOTE: the clock is read only after ``synchronize()``. GPU work is queued
    asynchronously; without the wait, on a path where nothing in the step blocks (the
    single-device skip path), the window would measure how fast Python queues kernels, not
    training (it overstated tokens/s by ~40% on an H200).
    """

    def __init__(self, metric_logger, log_every_n_steps: int = 1, device: Optional[torch.device] = None,
                 log_peak_memory_stats: bool = False, is_main: bool = True,
                 synchronize: Optional[Callable[[], None]] = None,
                 clock: Callable[[], float] = time.perf_counter,
                 show_progress: Optional[bool] = None, plot_dir: Optional[str] = None) -> None:
        self.metric_logger = metric_logger
        # The bar (with loss, tokens/s and tqdm's ETA) only on an interactive terminal: piped
        # or logged output would fill with carriage-return redraws.
        self.show_progress = sys.stdout.isatty() if show_progress is None else show_progress
        # Where close() draws metrics.png from metrics.jsonl (None: no picture).
        self.plot_dir = plot_dir
        self.log_every_n_steps = max(1, int(log_every_n_steps))
        self.device = device or torch.device("cpu")
        self.log_peak_memory_stats = log_peak_memory_stats
        self.is_main = is_main
        self._synchronize = synchronize or device_synchronizer(self.device)
        self._clock = clock
        self._pbar = None
        self._tokens = 0
        self._window_steps = 0
        self._t0 = self._read_clock()

    def _read_clock(self) -> float:
        self._synchronize()
        return self._clock()

    def start_epoch(self, epoch: int, total_epochs: int, steps: int, done: int = 0) -> None:
        """``done``: steps of this epoch already run (a run resumed mid-epoch)."""
        if self.is_main and self.show_progress:
            self._pbar = tqdm(total=steps, initial=done, desc=f"epoch {epoch + 1}/{total_epochs}",
                              dynamic_ncols=True, file=sys.stdout)
        self._tokens, self._window_steps = 0, 0
        self._t0 = self._read_clock()

    def add_tokens(self, num_tokens: int) -> None:
        self._tokens += num_tokens

    def step_done(self, global_step: int, loss: torch.Tensor, lr: float,
                  grad_norm: Optional[torch.Tensor] = None, **extra) -> None:
        self._window_steps += 1
        if self.is_main and global_step % self.log_every_n_steps == 0:
            now = self._read_clock()
            elapsed = now - self._t0
            loss_value = float(loss.item())
            metrics = {
                "loss": loss_value,
                "lr": lr,
                "tokens_per_second_per_gpu": tokens_per_second(self._tokens, elapsed),
                "valid_tokens": self._tokens,
                # The window this row's tokens/s covers (steps since the last logged one).
                "step_time_s": elapsed / self._window_steps,
                "steps_in_window": self._window_steps,
            }
            if grad_norm is not None:
                metrics["grad_norm"] = grad_norm
            if self.log_peak_memory_stats:
                metrics.update(memory_stats(self.device))
            metrics.update(extra)
            self.metric_logger.log_dict(metrics, step=global_step)
            if self._pbar is not None:
                self._pbar.set_postfix(loss=f"{loss_value:.4f}", lr=f"{lr:.2e}",
                                       tok_s=f"{metrics['tokens_per_second_per_gpu']:,.0f}",
                                       refresh=False)
            # The next window starts where this one was measured: logging time is counted in
            # the next window, so the windows add up to the whole run's wall time.
            self._tokens, self._window_steps, self._t0 = 0, 0, now
        if self._pbar is not None:
            self._pbar.update(1)

    @contextlib.contextmanager
    def paused(self):
        """Time spent inside (validation) is left out of the training throughput window."""
        t0 = self._read_clock()
        try:
            yield
        finally:
            self._t0 += self._read_clock() - t0

    def log_validation(self, global_step: int, val_loss: float) -> None:
        if self.is_main and self.metric_logger is not None:
            self.metric_logger.log_dict({"val_loss": val_loss}, step=global_step)
        if self._pbar is not None:
            self._pbar.write(f"step {global_step}: val_loss {val_loss:.4f}")

    def end_epoch(self) -> None:
        if self._pbar is not None:
            self._pbar.close()
            self._pbar = None

    def close(self) -> None:
        self.end_epoch()
        if self.metric_logger is not None:
            self.metric_logger.close()
        if self.is_main and self.plot_dir is not None:
            self._plot()

    def _plot(self) -> None:
        # A picture is a convenience: a run that trained must not fail for want of one.
        try:
            from tune_recipes.plotting import plot_runs

            print(f"wrote {plot_runs([self.plot_dir])}  (redraw or compare: tune plot DIR ...)")
        except Exception as e:  # matplotlib missing, a logger that writes no metrics.jsonl
            print(f"note: no metrics.png ({type(e).__name__}: {e})", file=sys.stderr)
