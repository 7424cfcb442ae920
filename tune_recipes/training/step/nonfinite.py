"""Non-finite loss or gradient norm: caught at the step it happens, never saved.

``on_nonfinite`` (a recipe config key):

- ``raise`` (default): every step ANDs "loss and grad norm are finite" into a flag that stays
  on the device, with the number of the first bad step; no host sync is added per step. The
  flag is read where the host waits for the device anyway: at each logged step
  (``log_every_n_steps``; on CUDA one step later, with that step's row, so the host never
  waits for the device to drain), at the end of each epoch and before every checkpoint save. A bad
  flag stops the run with epoch, step and batches of the *first* bad step; the weights it
  produced are never written, because the check runs before every save.
- ``skip``: a bad step's update is dropped (gradients zeroed, no ``optimizer.step``), the LR
  schedule and step count still advance, and ``skipped_steps`` (a running total) is logged.
  Deciding before ``optimizer.step`` needs the flag on the host: one sync per step in this
  mode. Without ``clip_grad_norm`` the gradient norm is measured for the check (one extra pass
  over the gradients).

``optimizer_in_bwd`` steps inside backward, before any check can run: ``raise`` still stops the
run before a save, ``skip`` is refused.
"""

from typing import Dict, List, Optional, Tuple

import torch
from torchtune.utils import get_logger

from tune_recipes.config import ConfigError
from tune_recipes.training.reporting.progress import DeviceValues
from tune_recipes.validation import NONFINITE_MODES, skip_in_backward_problem

log = get_logger("INFO")

MODES = NONFINITE_MODES


class NonFiniteError(ConfigError):
    """The loss or gradient norm became NaN/inf. A ConfigError so the recipe reports it in one
    line; the usual cause is a config value (``optimizer.lr``, no ``clip_grad_norm``)."""


def check_mode(mode: str, optimizer_in_bwd: bool) -> str:
    if mode not in MODES:
        raise ConfigError(f"on_nonfinite={mode!r}: expected one of {', '.join(MODES)}")
    problem = skip_in_backward_problem(mode, optimizer_in_bwd)
    if problem:
        raise ConfigError(problem)
    return mode


def check_clip_grad_norm(value) -> Optional[float]:
    """``clip_grad_norm``: null, a positive number, or inf. A negative one flips the gradients."""
    if value is None:
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"clip_grad_norm={value!r}: expected a positive number, inf or null") from None
    if not number > 0:  # also catches NaN
        raise ConfigError(
            f"clip_grad_norm={value!r} must be > 0 (inf measures the norm without clipping; "
            "null disables it)"
        )
    return number


def is_finite(loss: torch.Tensor, grad_norm: Optional[torch.Tensor]) -> torch.Tensor:
    """A 0-dim bool tensor on the loss's device; no host sync."""
    ok = torch.isfinite(loss.detach()).all()
    if grad_norm is not None:
        ok = ok & torch.isfinite(grad_norm.detach().to(ok.device)).all()
    return ok


class NonFiniteGuard:
    """Accumulates the per-step finiteness flag (``record``) and stops the run (``check``)."""

    def __init__(self, mode: str = "raise") -> None:
        self.mode = mode
        self.skipped_steps = 0
        self._first_bad: Optional[torch.Tensor] = None  # -1, or the first bad step's number
        self._where: Dict[int, str] = {}  # steps since the last check -> "epoch e, step s, ..."

    def allow_update(self, loss: torch.Tensor, grad_norm: Optional[torch.Tensor],
                     params: List[torch.nn.Parameter], step: int, where: str,
                     why: Optional[str] = None) -> bool:
        """Called between clipping and ``optimizer.step`` for step ``step`` (1-based, as
        logged). ``raise``: record the flag on the device and return True (no sync). ``skip``:
        read it now and return whether the optimizer may step. ``why``: the cause of a loss
        known to be non-finite (a step without label tokens), for the warning."""
        if self.mode == "raise":
            self.record(is_finite(loss, grad_norm), step, where)
            return True
        if grad_norm is None:
            # No clipping configured: measure the norm, the check needs it.
            from tune_recipes.training.step.normalization import grad_norm_and_clip_

            grad_norm = grad_norm_and_clip_(params, float("inf"))
        if bool(is_finite(loss, grad_norm)):  # the per-step host sync of skip mode
            return True
        self.skipped_steps += 1
        log.warning("skipped the update of %s: %s (on_nonfinite=skip; %d skipped so far)", where,
                    why or "non-finite loss or gradient norm", self.skipped_steps)
        return False

    def record(self, ok: torch.Tensor, step: int, where: str) -> None:
        """Note step ``step`` (1-based global step) and its finiteness, on the device."""
        if self._first_bad is None:
            self._first_bad = torch.full((), -1, dtype=torch.long, device=ok.device)
        self._first_bad = torch.where((self._first_bad < 0) & ~ok,
                                      torch.full_like(self._first_bad, step), self._first_bad)
        self._where[step] = where

    def stage(self, step: int, device: torch.device) -> Optional[Tuple[DeviceValues, int]]:
        """The flag as of step ``step``, copied to the host without waiting: ``check(staged)``
        reads it later (one step late, when the host runs ahead of the device)."""
        if self._first_bad is None:
            return None
        return DeviceValues({"first_bad": self._first_bad}, device, lagged=device.type == "cuda"), step

    def check(self, staged: Optional[Tuple[DeviceValues, int]] = None) -> None:
        """Raise ``NonFiniteError`` if any step since the start (or up to a ``stage``d step)
        was non-finite: one host sync, or with ``staged`` a wait for that step's work only."""
        if self._first_bad is None:
            return
        if staged is None:
            bad, upto = int(self._first_bad.item()), None
        else:
            bad, upto = int(staged[0].values()["first_bad"]), staged[1]
        if bad >= 0:
            where = self._where.get(bad, f"step {bad}")
            raise NonFiniteError(
                f"non-finite loss or gradient norm at {where}; stopped without saving these "
                "weights (lower optimizer.lr, set clip_grad_norm, check the data; or "
                "on_nonfinite=skip to drop such steps)"
            )
        self._where = {} if upto is None else {s: w for s, w in self._where.items() if s > upto}
