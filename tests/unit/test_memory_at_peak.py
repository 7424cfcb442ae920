"""scripts/bench_hooks/memory_at_peak.py: replaying the CUDA allocator's history to what was
live at the peak of allocated memory, summed by who allocated it."""

import os
import subprocess
import sys

import pytest
import torch
from script_loader import SCRIPTS

sys.path.insert(0, str(SCRIPTS / "bench_hooks"))
import memory_at_peak  # noqa: E402

pytestmark = pytest.mark.unit

TORCH = {"filename": "/venv/site-packages/torch/nn/functional.py", "line": 10, "name": "linear"}
LOSS = {"filename": "/repo/tune_recipes/modules/loss.py", "line": 327, "name": "forward"}
RECIPE = {"filename": "/repo/recipes/full_finetune_single_device.py", "line": 200, "name": "train"}
ADAM = {"filename": "/venv/site-packages/torchao/optim/adam.py", "line": 142, "name": "step"}
GIB = 2**30


def _alloc(addr, gib, *frames):
    return {"action": "alloc", "addr": addr, "size": int(gib * GIB), "frames": list(frames)}


def _free(addr, action="free_completed"):
    return {"action": action, "addr": addr, "size": 0, "frames": []}


TRACE = [
    _alloc(1, 1.0, TORCH, LOSS, RECIPE),  # 1.0
    _alloc(2, 0.5, ADAM, RECIPE),  # 1.5
    _free(1, "free_requested"),  # not yet reusable: still counted
    _free(1),  # 0.5
    _free(99),  # allocated before the trace: ignored
    _alloc(3, 2.0, TORCH),  # 2.5
    _alloc(4, 0.25, TORCH, LOSS, RECIPE),  # 2.75: the peak
    _free(3),  # 0.75
    _alloc(5, 1.5, ADAM),  # 2.25
]


def test_the_peak_and_what_was_live_then():
    peak, at, live = memory_at_peak.live_at_peak(TRACE)
    assert peak == int(2.75 * GIB) and at == 6
    assert sorted(e["addr"] for e in live) == [2, 3, 4]  # 1 freed before, 5 allocated after


def test_the_report_sums_by_the_innermost_frame_of_the_recipe_or_its_libraries():
    report = memory_at_peak.summary({"device_traces": [TRACE]})
    lines = report.splitlines()
    assert lines[0].startswith("peak allocated: 2.750 GiB at trace entry 6 of 9")
    rows = [line.split(None, 2) for line in lines[2:5]]
    # largest first; a stack with no frame of ours or a library's goes by its innermost frame
    assert rows == [["2.000", "1", "/venv/site-packages/torch/nn/functional.py:10 linear"],
                    ["0.500", "1", "torchao/optim/adam.py:142 step"],
                    ["0.250", "1", "tune_recipes/modules/loss.py:327 forward"]]
    assert "the allocation that reached the peak: 0.250 GiB" in report
    assert memory_at_peak.summary({"device_traces": [[]]}) == "no allocations recorded\n"


def test_the_hook_is_set_up_in_a_training_process_and_idle_without_cuda(tmp_path):
    """sitecustomize installs it beside the clock; without CUDA it records and writes nothing."""
    clock = tmp_path / "run.clock.json"
    env = {**os.environ, "PYTHONPATH": str(SCRIPTS / "bench_hooks"), "CUDA_VISIBLE_DEVICES": "",
           "BENCH_CLOCK": str(clock), "BENCH_MEMORY_AT_PEAK": "1"}
    out = subprocess.run([sys.executable, "-c", "import sys; print('memory_at_peak' in sys.modules)",
                          "tune_recipes"], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "True", out.stderr[-2000:]
    assert not (tmp_path / "run.clock.json.memory.txt").exists()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_real_allocator_history_names_the_allocating_line(tmp_path):
    torch.cuda.memory._record_memory_history(context="alloc", stacks="python", max_entries=10_000)
    try:
        base = torch.empty(2**20, device="cuda")  # 4 MiB, freed before the peak
        del base
        held = torch.empty(2**24, device="cuda")  # 64 MiB: the peak's
        report = memory_at_peak.summary(torch.cuda.memory._snapshot(), device=torch.cuda.current_device())
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    top = report.splitlines()[2]
    assert top.split()[0] == f"{64 / 1024:.3f}" and "test_memory_at_peak.py" in top, report
    del held
