"""What a training run holds on the GPU at its peak of allocated memory, and where each piece
was allocated: ``BENCH_MEMORY_AT_PEAK=1`` beside ``BENCH_CLOCK=PATH`` (sitecustomize.py installs
it in the training process; rank r > 0 of a distributed run writes ``...rank<r>``).

From the process start, before the first CUDA allocation, the caching allocator records every
allocation and free with its Python stack (``torch.cuda.memory._record_memory_history``). At exit
the history is replayed: the moment the live bytes peak, and the allocations live then, summed
by the innermost frame in the recipe's own code or a library it trains with (tune_recipes,
recipes/, torchtune, torchao, bitsandbytes), go to ``PATH.memory.txt``. Memory outside torch's
allocator (bitsandbytes' paged optimizer states) is not in it: bench_clock.py reads that apart.

Recording stacks slows every allocation: a run with it is for reading memory, not a speed row.
"""

import atexit
import os
import sys
from collections import defaultdict
from typing import Dict, List, Tuple

GIB = 2**30
# Where a frame counts as "who allocated it": the first of these, innermost first.
OWN_CODE = ("tune_recipes/", "/recipes/", "torchtune/", "torchao/", "bitsandbytes/")
MAX_ENTRIES = 2_000_000


def live_at_peak(trace: List[dict]) -> Tuple[int, int, List[dict]]:
    """(peak bytes, index of the allocation that reached it, the allocations live then) over
    one device's allocator trace. A free whose allocation is not in the trace (recorded before
    it started, or dropped from a full ring) is ignored."""
    def replay(stop: int):
        live, now, peak, peak_at = {}, 0, 0, -1
        for i, entry in enumerate(trace[:stop]):
            if entry["action"] == "alloc":
                live[entry["addr"]] = entry
                now += entry["size"]
                if now > peak:
                    peak, peak_at = now, i
            elif entry["action"] == "free_completed" and entry["addr"] in live:
                now -= live.pop(entry["addr"])["size"]
        return live, peak, peak_at

    _, peak, peak_at = replay(len(trace))
    live, _, _ = replay(peak_at + 1)
    return peak, peak_at, list(live.values())


def allocated_by(frames: List[dict]) -> str:
    """``file:line function`` of the innermost frame in OWN_CODE (else the innermost frame)."""
    for f in frames:
        if any(k in f["filename"] for k in OWN_CODE):
            return _fmt(f)
    return _fmt(frames[0]) if frames else "(no Python frame)"


def _fmt(frame: dict) -> str:
    path = frame["filename"]
    for k in OWN_CODE:
        if k in path:
            path = k + path.split(k, 1)[1]
            break
    return f"{path}:{frame['line']} {frame['name']}"


def summary(snapshot: Dict, device: int = 0, top: int = 25) -> str:
    """The report ``PATH.memory.txt`` holds, from a ``torch.cuda.memory._snapshot()``."""
    traces = snapshot.get("device_traces") or []
    trace = traces[device] if device < len(traces) else []
    if not trace:
        return "no allocations recorded\n"
    peak, peak_at, live = live_at_peak(trace)
    groups: Dict[str, List[int]] = defaultdict(lambda: [0, 0])
    for entry in live:
        g = groups[allocated_by(entry.get("frames", []))]
        g[0] += entry["size"]
        g[1] += 1
    lines = [f"peak allocated: {peak / GIB:.3f} GiB at trace entry {peak_at} of {len(trace)}"
             + (" (the ring was full: its earliest entries were dropped)" if len(trace) >= MAX_ENTRIES else ""),
             f"live then: {len(live)} allocations; by where they were allocated (GiB, count):"]
    for where, (size, count) in sorted(groups.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(f"{size / GIB:9.3f} {count:6d}  {where}")
    rest = sorted(groups.values(), key=lambda g: -g[0])[top:]
    if rest:
        lines.append(f"{sum(g[0] for g in rest) / GIB:9.3f} {sum(g[1] for g in rest):6d}  ({len(rest)} more places)")
    last = trace[peak_at]
    lines.append(f"the allocation that reached the peak: {last['size'] / GIB:.3f} GiB, stack (innermost first):")
    lines += [f"  {_fmt(f)}" for f in last.get("frames", [])[:12]]
    return "\n".join(lines) + "\n"


def install(path: str) -> None:
    """Record from now on; write the summary to ``path`` at exit (nothing without CUDA)."""
    import torch

    if not torch.cuda.is_available():
        return
    try:
        torch.cuda.memory._record_memory_history(context="alloc", stacks="python", max_entries=MAX_ENTRIES)
    except Exception as e:  # a torch without it: the run goes on, without the report
        print(f"BENCH_MEMORY_AT_PEAK: not recorded ({type(e).__name__}: {e})", file=sys.stderr)
        return

    def write() -> None:
        if torch.cuda.is_initialized():
            with open(path, "w") as f:
                f.write(summary(torch.cuda.memory._snapshot(), device=torch.cuda.current_device()))

    atexit.register(write)


def install_from_env() -> None:
    from bench_clock import rank_path

    install(f"{rank_path(os.environ['BENCH_CLOCK'])}.memory.txt")
