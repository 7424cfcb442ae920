"""tune_recipes.training.setup.profiling: the ``profiler`` key as a step-driver hook."""

import gzip
import json

import pytest
import torch
from omegaconf import DictConfig

from tune_recipes.config import ConfigError
from tune_recipes.training.setup.profiling import ProfilerHook, setup_profiler

pytestmark = pytest.mark.unit

CPU = torch.device("cpu")


def test_off_unless_enabled(tmp_path):
    assert setup_profiler(None, output_dir=str(tmp_path), device=CPU) is None
    off = DictConfig({"_component_": "torchtune.training.setup_torch_profiler", "enabled": False})
    assert setup_profiler(off, output_dir=str(tmp_path), device=CPU) is None


def test_only_torchs_profiler_is_accepted(tmp_path):
    with pytest.raises(ConfigError, match="setup_torch_profiler"):
        setup_profiler(DictConfig({"_component_": "my.profiler", "enabled": True}),
                       output_dir=str(tmp_path), device=CPU)


class _FakeProfiler:
    def __init__(self):
        self.calls = []

    def start(self):
        self.calls.append("start")

    def step(self):
        self.calls.append("step")

    def stop(self):
        self.calls.append("stop")


def test_hook_starts_before_the_first_step_and_steps_once_per_optimizer_step():
    prof = _FakeProfiler()
    hook = ProfilerHook(prof, "unused")
    for global_step in range(3):
        hook.before_step(global_step)
    hook.close()
    hook.close()  # a second close does nothing
    assert prof.calls == ["start", "step", "step", "step", "stop"]
    assert hook.metrics() == {}


def test_an_epochs_last_step_ends_with_the_epoch_not_at_the_next_step():
    """Two epochs of two steps: each step() call closes exactly one optimizer step's window, the
    last one of each epoch at end_epoch (before the epoch's checkpoint), none twice."""
    prof = _FakeProfiler()
    hook = ProfilerHook(prof, "unused")
    for epoch in range(2):
        for global_step in (2 * epoch, 2 * epoch + 1):
            hook.before_step(global_step)
            prof.calls.append(f"train {global_step}")
        hook.end_epoch()
        prof.calls.append("save")
    hook.close()
    assert prof.calls == ["start", "train 0", "step", "train 1", "step", "save",
                          "train 2", "step", "train 3", "step", "save", "stop"]


def _trace_events(directory):
    traces = sorted(directory.rglob("*.pt.trace.json.gz"))
    assert len(traces) == 1, traces
    with gzip.open(traces[0], "rt") as f:
        return json.load(f)["traceEvents"]


@pytest.mark.parametrize("distributed", [False, True])
def test_schedule_writes_one_trace_of_the_active_steps(tmp_path, distributed):
    cfg = DictConfig({"enabled": True, "wait_steps": 1, "warmup_steps": 1, "active_steps": 2,
                      "num_cycles": 1})  # no _component_, no output_dir: the defaults
    hook = setup_profiler(cfg, output_dir=str(tmp_path), device=CPU, rank=1,
                          distributed=distributed)
    expected = tmp_path / "profiling_outputs" / ("rank_1" if distributed else "")
    assert hook.output_dir == str(expected).rstrip("/")
    x = torch.ones(4, 4)
    for global_step in range(5):
        hook.before_step(global_step)
        with torch.profiler.record_function(f"my_step_{global_step}"):
            x = x @ x
    hook.close()
    names = {e.get("name") for e in _trace_events(expected)}
    # wait (step 0) and warmup (step 1) are not recorded; the 2 active steps are
    assert {"my_step_2", "my_step_3"} <= names
    assert not names & {"my_step_0", "my_step_1", "my_step_4"}
