"""Progress bar and per-step metrics, the same in every recipe."""

import sys
import time
from typing import Optional

import torch
from tqdm import tqdm

from tune_recipes.training.state import memory_stats, tokens_per_second


class StepReporter:
    """Owns the progress bar and the metric logger calls of a training loop.

    ``add_tokens`` after each micro-batch; ``step_done`` at each optimizer step. Only every
    ``log_every_n_steps``-th step reads the loss back from the device (one sync per logged step).
    With ``is_main=False`` (non-zero ranks) nothing is shown or logged.
    """

    def __init__(self, metric_logger, log_every_n_steps: int = 1, device: Optional[torch.device] = None,
                 log_peak_memory_stats: bool = False, is_main: bool = True) -> None:
        self.metric_logger = metric_logger
        self.log_every_n_steps = max(1, int(log_every_n_steps))
        self.device = device or torch.device("cpu")
        self.log_peak_memory_stats = log_peak_memory_stats
        self.is_main = is_main
        self._pbar = None
        self._tokens = 0
        self._t0 = time.perf_counter()

    def start_epoch(self, epoch: int, total_epochs: int, steps: int) -> None:
        if self.is_main:
            self._pbar = tqdm(total=steps, desc=f"epoch {epoch + 1}/{total_epochs}",
                              dynamic_ncols=True, file=sys.stdout)
        self._tokens, self._t0 = 0, time.perf_counter()

    def add_tokens(self, num_tokens: int) -> None:
        self._tokens += num_tokens

    def step_done(self, global_step: int, loss: torch.Tensor, lr: float,
                  grad_norm: Optional[torch.Tensor] = None, **extra) -> None:
        if self.is_main and global_step % self.log_every_n_steps == 0:
            elapsed = time.perf_counter() - self._t0
            loss_value = float(loss.item())
            metrics = {
                "loss": loss_value,
                "lr": lr,
                "tokens_per_second_per_gpu": tokens_per_second(self._tokens, elapsed),
                "valid_tokens": self._tokens,
            }
            if grad_norm is not None:
                metrics["grad_norm"] = grad_norm
            if self.log_peak_memory_stats:
                metrics.update(memory_stats(self.device))
            metrics.update(extra)
            self.metric_logger.log_dict(metrics, step=global_step)
            if self._pbar is not None:
                self._pbar.set_postfix(loss=f"{loss_value:.4f}", lr=f"{lr:.2e}", refresh=False)
        if self._pbar is not None:
            self._pbar.update(1)
        self._tokens, self._t0 = 0, time.perf_counter()

    def end_epoch(self) -> None:
        if self._pbar is not None:
            self._pbar.close()
            self._pbar = None

    def close(self) -> None:
        self.end_epoch()
        if self.metric_logger is not None:
            self.metric_logger.close()
