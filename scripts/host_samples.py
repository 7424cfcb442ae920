"""Print where the host spent a benchmark window, from the rows of a scripts/bench_recipes.py JSON
whose runs sampled their stacks (``BENCH_HOST_SAMPLES=1``, e.g. the ``ours_host_samples``
variant): per thread, the functions holding the largest shares of the window's time, each with
everything it called (inclusive), and the innermost functions (leaf).

    python scripts/host_samples.py out/hostbound.json [--top 25]
"""

import argparse
import json
import statistics
import sys


def report(row: dict, top: int) -> str:
    samples = row["host_samples"]
    lines = [f"## {row.get('variant', '?')} rep {row.get('rep', 0)}: {samples['samples']} samples over "
             f"{samples['seconds']:.2f} s; median host step "
             f"{1e3 * statistics.median(row['host_step_seconds']):.1f} ms, "
             f"median loader time {1e3 * statistics.median(row['host_fetch_seconds']):.2f} ms"]
    for name, thread in samples["threads"].items():
        share = thread["seconds"] / samples["seconds"] if samples["seconds"] else 0.0
        lines.append(f"### thread {name} (seen {share:.0%} of the window)")
        for kind in ("inclusive", "leaf"):
            lines.append(f"{kind}:")
            lines += [f"  {frac:6.1%}  {key}" for key, frac in thread[kind][:top]]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args(argv)
    bench = json.load(open(args.path))
    rows = [r for r in bench["rows"] if r.get("host_samples")]
    if not rows:
        print(f"{args.path}: no row sampled its host (BENCH_HOST_SAMPLES=1)", file=sys.stderr)
        return 1
    meta = bench.get("meta", {})
    if meta:  # where and with what the window ran
        print("# " + ", ".join(f"{k} {meta[k]}" for k in ("date", "gpu", "commit", "torch", "command")
                               if k in meta) + "\n")
    print("\n\n".join(report(r, args.top) for r in rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
