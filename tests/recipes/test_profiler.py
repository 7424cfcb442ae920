"""The ``profiler`` key: a recipe run with it on writes a torch.profiler trace of the scheduled
optimizer steps into output_dir (every training recipe gets it from the step driver; one
single-device and one 2-rank recipe are run here)."""

import gzip
import json

import pytest

from helpers import losses, tune
from tune_recipes.constants import CHECKPOINT_SAVE_EVENT

pytestmark = pytest.mark.integration

PROFILE = ["profiler.enabled=True", "profiler.wait_steps=1", "profiler.warmup_steps=1",
           "profiler.active_steps=2", "profiler.num_cycles=1"]


def _trace(directory):
    traces = sorted(directory.rglob("*.pt.trace.json.gz"))
    assert len(traces) == 1, traces
    with gzip.open(traces[0], "rt") as f:
        return json.load(f)


@pytest.mark.parametrize("recipe,config,launch,trace_dirs", [
    ("full_finetune_single_device", "tiny/full_single_device", [], [""]),
    ("lora_finetune_distributed", "tiny/lora_distributed", ["--nproc_per_node", "2"],
     ["rank_0", "rank_1"]),
])
def test_profiler_writes_a_trace_of_the_active_steps(tmp_path, recipe, config, launch, trace_dirs):
    out = tmp_path / "run"
    tune("run", *launch, recipe, "--config", config, f"output_dir={out}",
         "max_steps_per_epoch=4", *PROFILE)
    assert len(losses(out)) == 4
    for sub in trace_dirs:
        # wait 1 + warmup 1 + active 2: the cycle ends at the 4th optimizer step
        trace_dir = out / "profiling_outputs" / sub / "iteration_4"
        events = _trace(trace_dir)["traceEvents"]
        assert len(events) > 100
        steps = sorted({e["name"] for e in events if e.get("name", "").startswith("ProfilerStep#")})
        assert steps == ["ProfilerStep#2", "ProfilerStep#3"]
        assert any(e.get("name") == "aten::mm" for e in events)
        # The last profiled step is the run's last: its window ends with the epoch, so the
        # checkpoint save after it (with its finite check over every weight) stays out of the
        # trace.
        assert not any(e.get("name") == CHECKPOINT_SAVE_EVENT for e in events)
