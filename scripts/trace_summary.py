"""Where a profiled step's GPU time goes: sums the kernels of a torch.profiler chrome trace
(``.json`` or ``.json.gz``, as torchtune's profiler writes them) by kind, per profiled step.

    python3 scripts/trace_summary.py [--top N] [--scope OP] /tmp/bw/prof_ours_best [more ...]

(--top N: list the N kernels with the most time per trace; 12 unless set. --scope OP, repeatable:
also the device work launched while the host op OP ran, e.g. ``_FusedLinearCrossEntropy``, the
fused loss, which runs outside the compiled graph: what compiling it in could save is at most
its work other than GEMMs and its own kernel, plus the gaps between its kernels.)

Kinds are matched on kernel names (first match wins): attention (before the GEMMs: cuDNN's
SDPA kernels carry "sm90_" in their names), FP8 GEMMs, other GEMMs, Triton kernels (compiled
elementwise/reduction code and our fused loss), optimizer, collectives, copies, the rest.
"GPU busy" is the union of kernel intervals; "step wall" the span of the ProfilerStep
annotations: their difference is time the GPU waited on the host. Only work launched inside the
profiled steps is summed: work queued before them (the host's lead, when it runs ahead of the
GPU) is reported apart. Where it waited: each gap of
more than 20 us between device work (kernels, copies) inside the profiled steps is charged to
the innermost host op (a CPU op, or a Python function when the trace has stacks) around the
launch of the work that ends the gap, on the launching thread (backward launches from
autograd's own thread), summed by name; beside it, the part of those gaps the host spent inside
that op before the launch (the op's own host work, such as a plan built per shape); the rest of
a gap is the host reaching the op, launch latency or waits on other work. Gaps under 20 us, and before the first or after the
last piece of work, are not counted. The host's waits for the GPU inside the steps (CUDA
synchronize calls, e.g. an ``.item()``) are listed by the op around them: each drains the
GPU's queue.
"""

import gzip
import json
import re
import sys
from pathlib import Path

from tune_recipes.constants import CHECKPOINT_SAVE_EVENT

KINDS = [
    # cuDNN's SDPA kernels (cudnn_generated_fort_native_sdpa_sm90_flash_bprop_..., and its
    # cudnn::fusion helpers) before the GEMM patterns, which match "sm90_".
    ("attention", re.compile(r"flash|fmha|attn|attention|sdpa|cudnn::fusion", re.I)),
    # cuBLAS's nvjet kernels name FP8 inputs with a q after the arch (nvjet_sm90_qqtst, _qrtst).
    ("gemm fp8", re.compile(r"e4m3|e5m2|f8f8|fp8|_f8_|nvjet_sm\d+_q", re.I)),
    ("gemm bf16/fp32", re.compile(r"gemm|nvjet|cutlass|xmma|cublas|sm90_", re.I)),
    ("optimizer", re.compile(r"adam|multi_tensor|foreach", re.I)),
    ("triton (compiled / fused CE)", re.compile(r"^triton|ce_grad", re.I)),
    ("collectives", re.compile(r"nccl", re.I)),
    ("copies / casts", re.compile(r"copy|memcpy|memset|cast|fill", re.I)),
]


GAP_US = 20  # smaller gaps between kernels are launch latency, not waiting
DEVICE_WORK = ("kernel", "gpu_memcpy", "gpu_memset")
HOST_OPS = ("cpu_op", "python_function", "user_annotation")


def load(path: Path) -> list:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as fh:
        return json.load(fh)["traceEvents"]


def union_ms(intervals):
    total, end = 0.0, -1.0
    for s, e in sorted(intervals):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total / 1000


def summarize(path: Path) -> None:
    events = load(path)
    kernels = [e for e in events if e.get("cat") in DEVICE_WORK and "dur" in e]
    steps = _profiled_steps(events)
    n_steps = max(1, len({s["name"] for s in steps}))
    all_work = kernels  # the GPU's idle gaps count any work, whoever queued it
    kernels, queued_before = _launched_in_steps(events, kernels, steps)
    by_kind = {}
    for k in kernels:
        kind = _kind(k["name"])
        by_kind[kind] = by_kind.get(kind, 0.0) + k["dur"] / 1000
    busy = union_ms([(k["ts"], k["ts"] + k["dur"]) for k in kernels])
    wall = sorted(s["dur"] for s in steps)[len(steps) // 2] / 1000 * n_steps if steps else 0.0  # median
    total = sum(by_kind.values())
    span = (max(k["ts"] + k["dur"] for k in kernels) - min(k["ts"] for k in kernels)) / 1000 if kernels else 0.0
    print(f"\n{path} : {n_steps} profiled steps, per step: wall (median) {wall / n_steps:.1f} ms, "
          f"GPU busy {busy / n_steps:.1f} ms, kernels summed {total / n_steps:.1f} ms, "
          f"GPU span {span / n_steps:.1f} ms")
    if queued_before:
        print(f"NOTE: {len(queued_before)} kernels ({sum(k['dur'] for k in queued_before) / 1000:.1f} ms) "
              "were not launched inside the profiled steps (the previous step's work, queued "
              "before the window while the host ran ahead of the GPU) and are not counted above")
    if steps and busy > wall * 1.02:
        # No sync in the step: the host queues the steps' work faster than the GPU runs it, so
        # the work of the profiled steps ends after their annotations do.
        print("NOTE: the GPU is busier than the steps' wall time: the host ran ahead of the GPU, "
              "so the wall is the host's; the GPU's own time per step is the span")
    # The recipes mark checkpoint saves: a profiled window that holds one counts the save's
    # kernels as training.
    saves = [e for e in events if e.get("name") == CHECKPOINT_SAVE_EVENT and "dur" in e
             and e.get("cat") != "gpu_user_annotation"]
    if saves:
        print(f"NOTE: the trace holds {len(saves)} checkpoint save(s) ({CHECKPOINT_SAVE_EVENT}, "
              f"{sum(e['dur'] for e in saves) / 1000:.1f} ms on the host): their kernels are in "
              "the sums above")
    print("| kind | ms per step | share of kernel time |\n|---|---|---|")
    for kind, ms in sorted(by_kind.items(), key=lambda kv: -kv[1]):
        print(f"| {kind} | {ms / n_steps:.1f} | {100 * ms / total:.1f}% |")
    top = {}
    for k in kernels:
        top[k["name"]] = top.get(k["name"], 0.0) + k["dur"] / 1000
    print("top kernels (ms per step):")
    for name, ms in sorted(top.items(), key=lambda kv: -kv[1])[:TOP]:
        print(f"  {ms / n_steps:7.2f}  {name[:110]}")
    if steps:
        host_waits(events, steps, n_steps)
        idle(events, all_work, steps, n_steps)
    for op_name in SCOPES:
        scope(events, kernels, op_name, n_steps)


def _profiled_steps(events):
    """The ProfilerStep annotations' host side. Each step is annotated twice (a CPU op and a
    GPU user annotation of the same name); the CPU one's time is the wall time."""
    return [e for e in events if str(e.get("name", "")).startswith("ProfilerStep#") and "dur" in e
            and e.get("cat") != "gpu_user_annotation"]


def _kind(kernel_name: str) -> str:
    """The first of KINDS whose pattern matches the kernel's name, else "other"."""
    return next((name for name, pat in KINDS if pat.search(kernel_name)), "other")


def _innermost(ops, queries, depth=1, with_start=False):
    """For each (ts, key) in ``queries``, the name of the shortest op in ``ops`` [(start, end,
    name), ...] that contains ts, or None: one sweep over both, sorted by time. With depth > 1,
    the names of that many innermost ops, inner first, joined by " < ". ``with_start``: (name,
    the innermost op's start) instead of the name."""
    ops, found, active, i = sorted(ops), {}, [], 0
    for ts, key in sorted(queries):
        while i < len(ops) and ops[i][0] <= ts:
            active.append(ops[i])
            i += 1
        active = [op for op in active if op[1] >= ts]
        inner = sorted(active, key=lambda op: op[1] - op[0])[:depth]
        name = " < ".join(op[2] for op in inner) if inner else None
        found[key] = (name, inner[0][0] if inner else None) if with_start else name
    return found


def _window(steps):
    """The profiled steps' span on the host clock: (first start, last end)."""
    return min(s["ts"] for s in steps), max(s["ts"] + s["dur"] for s in steps)


def _launches(events):
    """Each launch's correlation id -> (host thread, host time) of its CUDA runtime/driver call."""
    return {e["args"]["correlation"]: (e.get("tid"), e["ts"]) for e in events
            if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}


def _launched_in_steps(events, work, steps):
    """Split device work into what the profiled steps launched and what was queued before them.
    When the host runs ahead of the GPU, the window opens while the GPU still runs the previous
    step's work, whose launches were not recorded (tens of ms of it). A trace without any launch
    records keeps all its work."""
    launched = _launches(events)
    if not launched or not steps:
        return work, []
    lo, hi = _window(steps)
    inside, before = [], []
    for k in work:
        _, ts = launched.get(k.get("args", {}).get("correlation"), (None, None))
        (inside if ts is not None and lo <= ts <= hi else before).append(k)
    return inside, before


SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


def _ops_by_thread(events):
    ops = {}
    for e in events:
        if e.get("cat") in HOST_OPS and "dur" in e and not str(e.get("name", "")).startswith("ProfilerStep#"):
            ops.setdefault(e.get("tid"), []).append((e["ts"], e["ts"] + e["dur"], e["name"]))
    return ops


def host_waits(events, steps, n_steps) -> None:
    """The host's waits for the GPU inside the profiled steps (CUDA synchronize calls: an
    ``.item()``, a device-to-host copy, an explicit synchronize), charged to the innermost host op
    around each, on its thread. A wait inside a step drains the GPU's queue: after it the GPU
    idles while the host launches the next work."""
    lo, hi = _window(steps)
    waits = [e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver")
             and e.get("name") in SYNC_CALLS and lo <= e["ts"] <= hi and "dur" in e]
    if not waits:
        print("host waits for the GPU inside the steps: none")
        return
    ops, by_tid = _ops_by_thread(events), {}
    for n, w in enumerate(waits):
        by_tid.setdefault(w.get("tid"), []).append((w["ts"], n))
    names = {}
    for tid, qs in by_tid.items():
        names.update(_innermost(ops.get(tid, []), qs, depth=3))
    charged = {}
    for n, w in enumerate(waits):
        key = f"{w['name']} in {names.get(n) or '(no op)'}"
        count, ms = charged.get(key, (0, 0.0))
        charged[key] = (count + 1, ms + w["dur"] / 1000)
    print(f"host waits for the GPU inside the steps: {len(waits) / n_steps:.1f} per step, "
          f"{sum(ms for _, ms in charged.values()) / n_steps:.2f} ms per step (per step: count, ms):")
    for key, (count, ms) in sorted(charged.items(), key=lambda kv: -kv[1][1])[:TOP]:
        print(f"  {count / n_steps:5.1f} {ms / n_steps:7.2f}  {key[:160]}")


def idle(events, work, steps, n_steps) -> None:
    """GPU idle time inside the profiled steps: every gap of more than GAP_US between device
    work (kernels, copies, memsets; any stream) is charged to the innermost host op, on the
    launching thread, around the launch of the work that ends the gap: what the host was doing
    when it finally queued the next piece of work (module docstring)."""
    lo, hi = _window(steps)
    gaps, end = [], None
    for k in sorted((k for k in work if lo <= k["ts"] <= hi), key=lambda k: k["ts"]):
        if end is not None and k["ts"] - end > GAP_US:
            gaps.append((end, k["ts"], k.get("args", {}).get("correlation")))
        end = k["ts"] + k["dur"] if end is None else max(end, k["ts"] + k["dur"])
    launches = _launches(events)
    ops_by_thread = _ops_by_thread(events)
    queries = {}
    for n, (_, _, corr) in enumerate(gaps):
        if corr in launches:
            tid, ts = launches[corr]
            queries.setdefault(tid, []).append((ts, n))
    found = {}
    for tid, qs in queries.items():
        found.update(_innermost(ops_by_thread.get(tid, []), qs, with_start=True))
    charged, inside = {}, {}
    for n, (g0, g1, corr) in enumerate(gaps):
        name, start = found.get(n, (None, None))
        name = name or ("(launched outside any op)" if corr in launches else "(no launch record)")
        charged[name] = charged.get(name, 0.0) + (g1 - g0) / 1000
        if start is not None:  # the part of the gap the host spent in this op before the launch
            launch = launches[corr][1]
            inside[name] = inside.get(name, 0.0) + max(0.0, min(g1, launch) - max(g0, start)) / 1000
    total = sum(charged.values())
    print(f"GPU idle inside the steps: {total / n_steps:.2f} ms per step in {len(gaps)} gaps "
          f"> {GAP_US} us; by the host op that launched the work ending each gap (ms per step), "
          "and of that the part the host spent inside the op before its launch (its own host "
          "work, e.g. planning; the rest: the host reaching the op, launch latency, waits):")
    for name, ms in sorted(charged.items(), key=lambda kv: -kv[1])[:TOP]:
        own = f"{inside[name] / n_steps:7.2f}" if name in inside else "      -"
        print(f"  {ms / n_steps:7.2f} {own}  {name[:110]}")


def scope(events, work, op_name, n_steps) -> None:
    """The device work launched while a host op named ``op_name`` ran, on the op's thread, per
    step: its host time, its kernels summed by kind, their span on the GPU per call, and the
    gaps between them (launch latency and anything else that kept the GPU from its next kernel)."""
    steps = _profiled_steps(events)
    lo, hi = _window(steps) if steps else (float("-inf"), float("inf"))
    ops = sorted((e for e in events if e.get("name") == op_name and e.get("cat") in HOST_OPS
                  and "dur" in e and lo <= e["ts"] <= hi), key=lambda e: (e["ts"], -e["dur"]))
    # The same call can be recorded twice (a CPU op and a Python function or annotation of one
    # name, nested): only the outermost of each counts.
    outer = []
    for e in ops:
        if not any(o.get("tid") == e.get("tid") and o["ts"] <= e["ts"] and e["ts"] + e["dur"] <= o["ts"] + o["dur"]
                   for o in outer):
            outer.append(e)
    ops = outer
    if not ops:
        print(f"scope {op_name}: no host op of that name inside the profiled steps")
        return
    launches = _launches(events)
    calls = [[] for _ in ops]
    for k in work:
        tid, ts = launches.get(k.get("args", {}).get("correlation"), (None, None))
        for n, op in enumerate(ops):
            if ts is not None and op.get("tid") == tid and op["ts"] <= ts <= op["ts"] + op["dur"]:
                calls[n].append(k)
                break
    by_kind, span, gaps, count = {}, 0.0, 0.0, 0
    for mine in calls:
        mine.sort(key=lambda k: k["ts"])
        count += len(mine)
        for k in mine:
            kind = _kind(k["name"])
            by_kind[kind] = by_kind.get(kind, 0.0) + k["dur"] / 1000
        if mine:
            span += (max(k["ts"] + k["dur"] for k in mine) - mine[0]["ts"]) / 1000
            end = mine[0]["ts"]
            for k in mine:
                gaps += max(0.0, k["ts"] - end) / 1000
                end = max(end, k["ts"] + k["dur"])
    kinds = ", ".join(f"{kind} {ms / n_steps:.2f}" for kind, ms in sorted(by_kind.items(), key=lambda kv: -kv[1]))
    print(f"scope {op_name}: {len(ops) / n_steps:.1f} calls per step; per step: host "
          f"{sum(op['dur'] for op in ops) / 1000 / n_steps:.2f} ms, {count / n_steps:.0f} kernels "
          f"summing {sum(by_kind.values()) / n_steps:.2f} ms ({kinds or 'none'}), GPU span "
          f"{span / n_steps:.2f} ms, gaps between its kernels {gaps / n_steps:.2f} ms")


TOP = 12  # kernels listed per trace; --top N sets it
SCOPES = []  # host ops whose device work is also summed; --scope OP adds one


def main():
    global TOP
    args = sys.argv[1:]
    while args[:1] in (["--top"], ["--scope"]):
        if len(args) < 2:
            sys.exit(f"{args[0]} needs a value (--top N, --scope OP)")
        if args[0] == "--top":
            TOP = int(args[1])
        else:
            SCOPES.append(args[1])
        args = args[2:]
    for arg in args:
        p = Path(arg)
        files = sorted(p.rglob("*.json*")) if p.is_dir() else [p]
        for f in files:
            if f.name.endswith((".json", ".json.gz")):
                summarize(f)


if __name__ == "__main__":
    main()
