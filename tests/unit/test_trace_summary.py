"""scripts/trace_summary.py on a small synthetic chrome trace: kernels summed per profiled step
by kind, and a trace that holds a checkpoint save flagged (its kernels are not training)."""

import gzip
import importlib.util
import json
from pathlib import Path

import pytest

from tune_recipes.constants import CHECKPOINT_SAVE_EVENT

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "trace_summary.py"


def _module():
    spec = importlib.util.spec_from_file_location("trace_summary", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _trace(path, with_save):
    events = [
        {"name": "ProfilerStep#1", "ph": "X", "ts": 0, "dur": 10_000, "cat": "cpu_op"},
        {"name": "ProfilerStep#2", "ph": "X", "ts": 10_000, "dur": 10_000, "cat": "cpu_op"},
        # 2 steps: 6 ms of an FP8 GEMM and 2 ms of a Triton kernel in all
        {"name": "nvjet_sm90_qqtst_128x128", "ph": "X", "ts": 1_000, "dur": 3_000, "cat": "kernel"},
        {"name": "nvjet_sm90_qqtst_128x128", "ph": "X", "ts": 11_000, "dur": 3_000, "cat": "kernel"},
        {"name": "triton_poi_fused_add_0", "ph": "X", "ts": 15_000, "dur": 2_000, "cat": "kernel"},
    ]
    if with_save:
        events.append({"name": CHECKPOINT_SAVE_EVENT, "ph": "X", "ts": 18_000, "dur": 1_500,
                       "cat": "user_annotation"})
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)


@pytest.mark.parametrize("with_save", [False, True])
def test_sums_per_step_by_kind_and_flags_a_checkpoint_save(tmp_path, capsys, with_save):
    path = tmp_path / "t.pt.trace.json.gz"
    _trace(path, with_save)
    _module().summarize(path)
    out = capsys.readouterr().out
    assert "2 profiled steps" in out
    assert "| gemm fp8 | 3.0 |" in out and "| triton (compiled / fused CE) | 1.0 |" in out
    assert ("checkpoint save" in out) == with_save
    if with_save:
        assert "1.5 ms on the host" in out
