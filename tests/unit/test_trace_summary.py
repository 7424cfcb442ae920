"""scripts/trace_summary.py on a small synthetic chrome trace: kernels summed per profiled step
by kind (cuDNN's attention kernels as attention, not GEMMs), the GPU's idle gaps charged to the
host op running then, and a trace that holds a checkpoint save flagged (its kernels are not
training)."""

import gzip
import json

import pytest
from script_loader import load_script

from tune_recipes.constants import CHECKPOINT_SAVE_EVENT



def _module():
    return load_script("trace_summary")


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
    assert ("checkpoint save" in out) == with_save
    if with_save:
        assert "1.5 ms on the host" in out


def _x(name, ts, dur, cat, tid=1, corr=None):
    e = {"name": name, "ph": "X", "ts": ts, "dur": dur, "cat": cat, "tid": tid}
    if corr is not None:
        e["args"] = {"correlation": corr}
    return e


def _summary_of(events, tmp_path, capsys) -> str:
    """What scripts/trace_summary.py prints for a trace of ``events``."""
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": events}))
    _module().summarize(path)
    return capsys.readouterr().out


def test_gpu_idle_gaps_are_charged_to_the_op_that_launched_the_next_work(tmp_path, capsys):
    """A gap is measured from the end of the last work on any stream (overlapping kernels), copies
    count as work, and the gap goes to the innermost op around the launch of the work that ends
    it, on the launching thread: not to a shorter op another thread runs at the same time."""
    events = [
        _x("ProfilerStep#1", 0, 20_000, "cpu_op"),
        # Two streams overlap until 6 ms (the later-starting kernel ends first); a copy 6.01-6.1
        # ms leaves no gap (10 us < 20 us).
        _x("k_a", 1_000, 5_000, "kernel", tid=7, corr=1),
        _x("k_b", 2_000, 2_000, "kernel", tid=8, corr=2),
        _x("Memcpy HtoD (Pinned -> Device)", 6_010, 90, "gpu_memcpy", tid=7, corr=3),
        # Gap 1: 6.1 -> 11 ms (4.9 ms), ended by k_c, launched at 10.8 ms by autograd's thread
        # (tid 2) inside MmBackward0; the main thread (tid 1) sits in a shorter aten::item then.
        _x("k_c", 11_000, 1_000, "kernel", tid=7, corr=4),
        _x("cudaLaunchKernel", 10_800, 10, "cuda_runtime", tid=2, corr=4),
        _x("autograd::engine::evaluate_function: MmBackward0", 10_000, 1_000, "cpu_op", tid=2),
        _x("aten::item", 10_700, 200, "cpu_op", tid=1),
        # Gap 2: 12 -> 13 ms, ended by k_d, whose launch was not recorded.
        _x("k_d", 13_000, 1_000, "kernel", tid=7, corr=5),
    ]
    out = _summary_of(events, tmp_path, capsys)
    assert "GPU idle inside the steps: 5.90 ms per step in 2 gaps" in out, out
    # of its 4.9 ms, the host was inside MmBackward0 (from 10.0 ms) for 0.8 ms before the launch
    assert "     4.90    0.80  autograd::engine::evaluate_function: MmBackward0" in out, out
    assert "     1.00       -  (no launch record)" in out and "aten::item" not in out, out


def test_an_idle_gap_spent_inside_the_launching_op_is_told_from_one_spent_reaching_it(tmp_path, capsys):
    """Two gaps of 5 ms, each ended by a kernel its op launched: one op ran 4.9 ms on the host
    before launching (its own work, e.g. building a plan), the other started just before its
    launch (the host was busy before it): the first column is the same, the second tells them
    apart."""
    def op_launching_a_kernel_at(op, op_start, kernel_start, corr, launch=None):
        """``op`` on the host from ``op_start``, launching a 1 ms kernel at ``launch`` (10 us
        before it runs unless given)."""
        launch = kernel_start - 10 if launch is None else launch
        return [_x(op, op_start, launch - op_start + 100, "cpu_op"),
                _x("cudaLaunchKernel", launch, 5, "cuda_runtime", corr=corr),
                _x(f"k{corr}", kernel_start, 1_000, "kernel", tid=7, corr=corr)]

    events = [_x("ProfilerStep#1", 0, 30_000, "cpu_op"), _x("k0", 1_000, 1_000, "kernel", tid=7, corr=1),
              *op_launching_a_kernel_at("aten::_cudnn_attention_forward", 2_050, 7_000, corr=2),
              *op_launching_a_kernel_at("aten::mm", 12_900, 13_000, corr=3),
              # launched before its gap began (13.5 ms; the GPU idles 14 -> 20 ms on a wait):
              # none of that gap is the op's own host work
              *op_launching_a_kernel_at("aten::add", 13_500, 20_000, corr=4, launch=13_550)]
    out = _summary_of(events, tmp_path, capsys)
    assert "     5.00    4.94  aten::_cudnn_attention_forward" in out, out
    assert "     5.00    0.09  aten::mm" in out, out
    assert "     6.00    0.00  aten::add" in out, out


def test_host_waits_are_listed_by_the_ops_around_them_and_a_host_ahead_is_flagged(tmp_path, capsys):
    """A synchronize inside a step (an .item() in a backward) is listed with its three innermost
    ops; one outside the steps is not. A trace whose kernels outlast the steps' wall time (the
    host queued ahead, nothing waited) says so instead of reporting a negative wait."""
    events = [
        _x("ProfilerStep#1", 0, 10_000, "cpu_op"),
        _x("ProfilerStep#2", 10_000, 10_000, "cpu_op"),
        _x("k_long", 500, 25_000, "kernel", tid=7, corr=1),  # runs on past the steps' 20 ms
        _x("MyLossBackward", 1_000, 4_000, "cpu_op", tid=2),
        _x("aten::item", 1_100, 3_000, "cpu_op", tid=2),
        _x("aten::_local_scalar_dense", 1_200, 2_800, "cpu_op", tid=2),
        _x("cudaStreamSynchronize", 1_300, 2_600, "cuda_runtime", tid=2),
        _x("cudaDeviceSynchronize", 21_000, 4_000, "cuda_runtime", tid=1),  # after the steps
    ]
    out = _summary_of(events, tmp_path, capsys)
    assert "host waits for the GPU inside the steps: 0.5 per step, 1.30 ms per step" in out, out
    assert ("    0.5    1.30  cudaStreamSynchronize in aten::_local_scalar_dense < aten::item"
            " < MyLossBackward") in out, out
    assert "cudaDeviceSynchronize" not in out
    assert "GPU span 12.5 ms" in out and "host ran ahead of the GPU" in out, out


def test_work_queued_before_the_profiled_steps_is_not_counted_as_theirs(tmp_path, capsys):
    """With the host ahead of the GPU, the window opens on the previous step's queued work (its
    launches are not in the trace): it is reported apart, not summed into the steps' kernels,
    but it still fills the GPU for the idle-gap count."""
    events = [
        _x("ProfilerStep#1", 0, 10_000, "cpu_op"),
        _x("k_old", 0, 4_000, "kernel", tid=7, corr=1),  # launched before the window
        # A side stream's kernel, launched in the step, ends long before k_new: k_old fills the
        # GPU in between, so there is no gap.
        _x("k_side", 200, 300, "kernel", tid=8, corr=3),
        _x("cudaLaunchKernel", 150, 10, "cuda_runtime", tid=1, corr=3),
        _x("k_new", 4_000, 2_000, "kernel", tid=7, corr=2),
        _x("cudaLaunchKernel", 100, 10, "cuda_runtime", tid=1, corr=2),
        _x("aten::mm", 50, 100, "cpu_op", tid=1),
    ]
    out = _summary_of(events, tmp_path, capsys)
    assert "kernels summed 2.3 ms" in out and "GPU span 5.8 ms" in out, out
    assert "1 kernels (4.0 ms) were not launched inside the profiled steps" in out, out
    assert "GPU idle inside the steps: 0.00 ms per step in 0 gaps" in out, out


def test_a_scope_sums_the_work_its_host_op_launched_and_the_gaps_between(tmp_path, capsys):
    """--scope OP: the kernels launched while OP ran on its thread (not those another thread
    launched meanwhile, nor those launched after it), by kind, with their span and the gaps
    between them: the bound on what compiling the fused loss into the graph could save. A call
    recorded twice (nested, same name) counts once; calls outside the profiled steps not at all."""
    events = [
        _x("ProfilerStep#1", 0, 20_000, "cpu_op"),
        _x("MyLoss", 1_000, 2_000, "cpu_op", tid=1),
        _x("MyLoss", 1_010, 1_900, "user_annotation", tid=1),  # the same call recorded twice
        _x("MyLoss", 25_000, 1_000, "cpu_op", tid=1),           # after the profiled steps
        _x("cudaLaunchKernel", 1_100, 10, "cuda_driver", tid=1, corr=1),
        _x("nvjet_sm90_tst_128x256", 4_000, 3_000, "kernel", tid=7, corr=1),
        _x("cudaLaunchKernel", 1_500, 10, "cuda_runtime", tid=1, corr=2),
        _x("ce_grad", 7_100, 500, "kernel", tid=7, corr=2),                 # 0.1 ms after the GEMM
        _x("cudaLaunchKernel", 1_600, 10, "cuda_runtime", tid=2, corr=3),  # another thread
        _x("k_other", 7_600, 400, "kernel", tid=7, corr=3),
        _x("cudaLaunchKernel", 3_500, 10, "cuda_runtime", tid=1, corr=4),  # after MyLoss
        _x("k_after", 8_000, 400, "kernel", tid=7, corr=4),
    ]
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": events}))
    mod = _module()
    mod.scope(mod.load(path), [e for e in events if e["cat"] == "kernel"], "MyLoss", 1)
    mod.scope(mod.load(path), [], "NoSuchOp", 1)
    out = capsys.readouterr().out
    assert ("scope MyLoss: 1.0 calls per step; per step: host 2.00 ms, 2 kernels summing 3.50 ms "
            "(gemm bf16/fp32 3.00, triton (compiled / fused CE) 0.50), GPU span 3.60 ms, gaps "
            "between its kernels 0.10 ms") in out, out
    assert "scope NoSuchOp: no host op of that name inside the profiled steps" in out
