"""scripts/trace_summary.py on a small synthetic chrome trace: kernels summed per profiled step
by kind (cuDNN's attention kernels as attention, not GEMMs), the GPU's idle gaps charged to the
host op running then, and a trace that holds a checkpoint save flagged (its kernels are not
training)."""

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
        {"name": "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16", "ph": "X", "ts": 17_000,
         "dur": 1_000, "cat": "kernel"},
        # The GPU idles 4-11 ms (step 1's GEMM ends at 4 ms): the host is in item(), inside an
        # outer op; the 1 ms gap 14-15 ms under no host op.
        {"name": "train_step", "ph": "X", "ts": 3_000, "dur": 9_000, "cat": "user_annotation"},
        {"name": "aten::item", "ph": "X", "ts": 5_000, "dur": 5_500, "cat": "cpu_op"},
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
    assert "| attention | 0.5 |" in out and "gemm bf16" not in out
    assert "GPU idle inside the steps: 4.00 ms per step in 2 gaps" in out
    assert "     3.50  aten::item" in out and "     0.50  (no host op)" in out
    assert ("checkpoint save" in out) == with_save
    if with_save:
        assert "1.5 ms on the host" in out
