"""Profile torchtune 0.6.1's stock full_finetune_single_device and ours on the same config, in
process, with torch.profiler; prints the top ops by self CUDA time and by self CPU time and the
wall time per step. Used to attribute the single-device throughput gap in docs/benchmarks.md.

    python3 scripts/profile_recipes.py --ckpt /tmp/bench_recipes/ckpt_full_1b --steps 8
"""

import argparse
import runpy
import sys
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_recipes  # noqa: E402


def profile(label, recipe_cls, cfg, out_dir):
    recipe = recipe_cls(cfg)
    recipe.setup(cfg)
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    t0 = time.perf_counter()
    with torch.profiler.profile(activities=acts) as prof:
        recipe.train()
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    print(f"\n===== {label}: {wall:.2f}s for train() incl. checkpoint save")
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=12, max_name_column_width=60))
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=60))
    prof.export_chrome_trace(str(out_dir / f"trace_{label}.json"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--out", default="/tmp/prof")
    ap.add_argument("--order", default="stock,ours", help="which runs first pays cold caches")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    case = dict(bench_recipes.CASES["full_1b"], steps=args.steps)
    import torchtune

    stock_file = Path(torchtune.__file__).resolve().parent.parent / "recipes" / "full_finetune_single_device.py"
    ours_file = Path(__file__).resolve().parents[1] / "recipes" / "full_finetune_single_device.py"
    chunked = {"_component_": "torchtune.modules.loss.CEWithChunkedOutputLoss"}
    runs = {"stock": (stock_file, True), "ours": (ours_file, False)}
    for label in args.order.split(","):
        path, stock = runs[label]
        cfg_path = out / f"{label}.yaml"  # noqa
        bench_recipes.write_config(cfg_path, case, Path(args.ckpt), out / label, chunked, stock)
        cfg = OmegaConf.load(cfg_path)
        mod = runpy.run_path(str(path), run_name=f"profiled_{label}")
        cls = mod["FullFinetuneRecipeSingleDevice"]
        profile(label, cls, cfg, out)


if __name__ == "__main__":
    main()
