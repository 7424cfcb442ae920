"""Where a run's peak of allocated CUDA memory is, and what is live there.

Reads a torch.cuda.memory snapshot whose allocation trace was recorded from the process's start
(scripts/bench_hooks: BENCH_MEMORY_SNAPSHOT=PATH), replays its alloc / free events to the moment
the allocated bytes peak, and lists the blocks live then, grouped by where they were allocated:
the innermost frame outside torch's own files (for compiled code, the generated file's line,
whose text is printed when the file is still there, as on the machine that ran it).

    python3 scripts/memory_peak.py /tmp/bw/memsnap.12345 [--top 30]
"""
import argparse
import collections
import json
import linecache
import os
import pickle


def _where(frames):
    for fr in frames:
        f = fr.get("filename", "")
        if "/torch/" in f and "torchinductor" not in f:
            continue
        text = linecache.getline(f, fr.get("line", 0)).strip()
        return f"{os.path.basename(f)}:{fr.get('line')} {fr.get('name')}" + (f"  | {text[:90]}" if text else "")
    return "(torch internals)" if frames else "(no stack)"


def replay(trace):
    """(peak bytes, index of the event that reached it, {addr: event} live then).

    The trace's sizes are the requested bytes (torch's ``requested_bytes`` statistic), not the
    rounded blocks ``max_memory_allocated`` counts: the replayed peak is a little lower than
    that. A trace whose ring buffer wrapped starts mid-run: its frees of blocks allocated
    before it are counted in ``unmatched_frees`` (the peak is then not the run's)."""
    cur = peak = 0
    peak_at = -1
    seen = set()
    replay.unmatched_frees = 0
    for i, e in enumerate(trace):
        if e["action"] == "alloc":
            seen.add(e["addr"])
            cur += e["size"]
            if cur > peak:
                peak, peak_at = cur, i
        elif e["action"] == "free_requested":  # the allocator's statistics drop here
            if e["addr"] not in seen:
                replay.unmatched_frees += 1
            seen.discard(e["addr"])
            cur -= e["size"]
    live = {}
    for e in trace[:peak_at + 1]:
        if e["action"] == "alloc":
            live[e["addr"]] = e
        elif e["action"] == "free_requested":
            live.pop(e["addr"], None)
    return peak, peak_at, live


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("snapshot")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--device", type=int, default=0)
    args = ap.parse_args()
    with open(args.snapshot, "rb") as f:
        snap = pickle.load(f)
    trace = snap["device_traces"][args.device]
    if not any(e["action"] == "alloc" for e in trace):
        raise SystemExit(f"{args.snapshot}: no allocation in the trace of device {args.device}")
    peak, peak_at, live = replay(trace)
    gib = 2 ** 30
    print(f"{args.snapshot}: {len(trace)} events; replayed peak {peak / gib:.3f} GiB at event {peak_at}")
    if replay.unmatched_frees:
        print(f"WARNING: {replay.unmatched_frees} frees of blocks allocated before the trace starts: "
              "it does not hold the whole run (raise max_entries), so this peak may not be the run's")
    try:
        with open(args.snapshot + ".peaks.json") as f:
            peaks = json.load(f)
        print(f"the process's own peaks: requested {peaks['requested_bytes_peak'] / gib:.3f} GiB "
              f"(what the replay sums: equal when the trace holds the whole run), allocated "
              f"{peaks['allocated_bytes_peak'] / gib:.3f} GiB (rounded blocks: max_memory_allocated)")
    except (OSError, KeyError, TypeError):
        pass
    groups = collections.defaultdict(lambda: [0, 0])
    for e in live.values():
        g = groups[_where(e.get("frames", []))]
        g[0] += e["size"]
        g[1] += 1
    print(f"{'GiB':>7} {'blocks':>6}  allocated at")
    for where, (size, n) in sorted(groups.items(), key=lambda kv: -kv[1][0])[:args.top]:
        print(f"{size / gib:7.3f} {n:6d}  {where}")
    # What the peak's event was, and the events just before it (is it a forward, a backward, the loss?).
    print("the peak's allocation:", _where(trace[peak_at].get("frames", [])),
          f"{trace[peak_at]['size'] / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
