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
    """(peak bytes, index of the event that reached it, {addr: event} live then)."""
    cur = peak = 0
    peak_at = -1
    for i, e in enumerate(trace):
        if e["action"] == "alloc":
            cur += e["size"]
            if cur > peak:
                peak, peak_at = cur, i
        elif e["action"] == "free_requested":  # the allocated-bytes statistic drops here
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
    peak, peak_at, live = replay(trace)
    gib = 2 ** 30
    print(f"{args.snapshot}: {len(trace)} events; replayed peak {peak / gib:.3f} GiB at event {peak_at}")
    try:
        with open(args.snapshot + ".max_allocated") as f:
            print(f"torch.cuda.max_memory_allocated: {int(f.read()) / gib:.3f} GiB "
                  "(equal to the replayed peak when the trace holds every event)")
    except OSError:
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
