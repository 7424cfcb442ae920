"""The ``profiler`` config key: a torch.profiler trace of a few optimizer steps.

Built by torchtune's ``setup_torch_profiler`` (the stock key layout, its wait/warmup/active/
num_cycles schedule and its trace handler, which writes ``iteration_<n>/*.pt.trace.json.gz``
for chrome://tracing or perfetto.dev). The schedule counts *optimizer steps*, as in stock: with
``gradient_accumulation_steps: 4`` one profiled step holds four forward/backward passes.

    profiler:
      _component_: torchtune.training.setup_torch_profiler
      enabled: True
      output_dir: ${output_dir}/profiling_outputs
      wait_steps: 5
      warmup_steps: 3
      active_steps: 2
      num_cycles: 1

Off unless ``enabled: True`` (no key, or ``enabled: False``, costs nothing). Where we differ
from stock, on purpose: CUDA/XPU activities are only requested on a CUDA/XPU device (on a CPU
run they would only add warnings), a missing ``output_dir`` means ``<output_dir>/
profiling_outputs`` rather than a ``profiler_output`` folder in the working directory, and each
rank of a distributed run writes under its own ``rank_<r>/`` (stock names every rank's file
``r0-...``).

The profiler runs as a ``StepHook`` of the step driver, so every recipe gets it from
``setup_step_driver`` without a line of its own: it starts before the first step, steps the
schedule before each later step, and takes its last step and stops when the driver closes.
An epoch's last step ends when the epoch does (``end_epoch``), not at the next step or at
close, so the epoch-end checks, validation and checkpoint save are not counted in that step.
A window that ends with the run's last step (the usual "profile the last steps") then holds no
save; before this it held the save's pass over every weight, ~2 ms a step of kernels at
Llama-3.2-1B. NOTE: torch.profiler cannot pause, so where the active window goes on past an
epoch's end, the epoch-end work lands in the next step's window instead; mid-epoch saves and
step-interval validation stay inside their step. Saves are marked (``CHECKPOINT_SAVE_EVENT``)
and scripts/trace_summary.py says when a trace holds one.
"""

from pathlib import Path
from typing import Any, Dict, Optional

import torch
from omegaconf import DictConfig, OmegaConf
from torchtune import config as tt_config
from torchtune.utils import get_logger

from tune_recipes.config import ConfigError

log = get_logger("INFO")

PROFILER_COMPONENT = "torchtune.training.setup_torch_profiler"


class ProfilerHook:
    """Drives a ``torch.profiler.profile`` from the step driver's hooks (``StepHook``)."""

    def __init__(self, profiler: torch.profiler.profile, output_dir: str) -> None:
        self.profiler = profiler
        self.output_dir = output_dir
        self._started = False
        # Whether the last step's window is already closed (by end_epoch).
        self._step_closed = False

    def before_step(self, global_step: int) -> None:
        if not self._started:
            self.profiler.start()
            self._started = True
        elif not self._step_closed:
            self.profiler.step()  # the previous optimizer step is over
        self._step_closed = False

    def end_epoch(self) -> None:
        """The epoch's last step is over: close its window before the epoch-end work."""
        if self._started and not self._step_closed:
            self.profiler.step()
            self._step_closed = True

    def metrics(self) -> Dict[str, Any]:
        return {}

    def close(self) -> None:
        """End of training: close the last step and write any trace still being recorded."""
        if self._started:
            if not self._step_closed:
                self.profiler.step()
            self.profiler.stop()
            self._started = False


def setup_profiler(cfg_profiler: Optional[DictConfig], *, output_dir: str, device: torch.device,
                   rank: int = 0, distributed: bool = False) -> Optional[ProfilerHook]:
    """The ``profiler`` section of a config as a driver hook, or None when it is off."""
    if cfg_profiler is None or not cfg_profiler.get("enabled", False):
        return None
    cfg = OmegaConf.to_container(cfg_profiler, resolve=True)
    component = cfg.setdefault("_component_", PROFILER_COMPONENT)
    if component != PROFILER_COMPONENT:
        raise ConfigError(f"profiler._component_ must be {PROFILER_COMPONENT}, got {component}")
    cfg["cuda"] = cfg.get("cuda", True) and device.type == "cuda"
    cfg["xpu"] = cfg.get("xpu", True) and device.type == "xpu"
    trace_dir = Path(cfg.get("output_dir") or Path(output_dir) / "profiling_outputs")
    if distributed:
        trace_dir = trace_dir / f"rank_{rank}"
    cfg["output_dir"] = str(trace_dir)
    try:
        # Now, not when the first trace is written steps later (torchtune's handler makes it).
        trace_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"profiler.output_dir={trace_dir}: cannot create it "
                          f"({e.strerror or e})") from None
    profiler, used = tt_config.instantiate(DictConfig(cfg))
    if rank == 0:
        log.info("profiler on: %s", dict(used))
    return ProfilerHook(profiler, str(trace_dir))
