"""Run every shipped config as shipped on the GPU machine, and tabulate what happened.

    python3 scripts/gpu_acceptance.py --kind single --out $OUT/acceptance_single.json
    python3 scripts/gpu_acceptance.py --kind distributed --nproc 2 --out $OUT/acceptance_dist.json

Kept as shipped: the model builder (real shapes), the checkpointer and its model_type, batch
size, gradient accumulation, activation checkpointing, compile, dtype, optimizer (fused,
in-backward), loss, clipping, LoRA/QLoRA/DoRA options, QAT quantizer, KD teacher, FSDP options.
Replaced, because that machine cannot download anything: the weights (random init of the real
shapes, written once per builder), the tokenizer (the tiny one; it only supplies a pad id) and
the data (``synthetic_dataset``: every sequence ``tokenizer.max_seq_len`` tokens long, the
longest a shipped config admits, so peak memory is the worst case a user can hit).

Each config runs through the CLI in its own process (`python3 -m tune_recipes run ...`, with
torchrun for distributed ones) until ``--steps`` optimizer steps are logged; then the process is
stopped (checkpoint writing at real sizes is left to ``--save``, since it costs minutes of GPU
time per 8B config; the CPU tests save and reload every shrunk config). Quantize configs run
to completion.

Columns: tokens/s is the median of the recipe's own ``tokens_per_second_per_gpu`` over the
steps after the first; "wall check" divides the tokens over those steps by the wall time between
their metric rows (the logger's own clock) and compares: 1.00 means the reported rate is the
real one.
"""

import argparse
import fnmatch
import json
import os
import queue
import shutil
import signal
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from tune_recipes._cli import registry  # noqa: E402

DEVICE_OVERRIDE = None
DISTRIBUTED = {"full_finetune_distributed", "lora_finetune_distributed", "qat_distributed",
               "qat_lora_finetune_distributed", "knowledge_distillation_distributed"}


def base_builder(component: str) -> str:
    module, fn = component.rsplit(".", 1)
    return f"{module}.{fn.removeprefix('qlora_').removeprefix('lora_')}"


def ensure_checkpoint(builder: str, work: Path) -> Path:
    # The name scripts/bench_recipes.py gives it: with the same --work, both share the files.
    out = work / f"ckpt_{builder.rsplit('.', 1)[-1]}_bf16"
    if not (out / "model.safetensors").exists():
        # Its own process: the random model's GPU memory is returned before training starts.
        subprocess.run([sys.executable, str(REPO / "scripts" / "make_random_checkpoint.py"),
                        "--builder", builder, "--out", str(out)], check=True, cwd=REPO)
    return out


def vocab_size(ckpt: Path) -> int:
    return json.loads((ckpt / "config.json").read_text())["vocab_size"]


def acceptance_config(name: str, work: Path, steps: int, nproc: int) -> tuple:
    path = registry.resolve_config(name).path
    cfg = yaml.safe_load(path.read_text())
    recipe = registry.recipe_for_config(name)
    out_dir = work / "runs" / name.replace("/", "_")
    cfg["output_dir"] = str(out_dir)
    ckpt = ensure_checkpoint(base_builder(cfg["model"]["_component_"]), work)
    cfg["checkpointer"]["checkpoint_dir"] = str(ckpt)
    cfg["checkpointer"]["checkpoint_files"] = ["model.safetensors"]
    cfg["checkpointer"]["output_dir"] = str(out_dir)
    if "teacher_checkpointer" in cfg:
        tckpt = ensure_checkpoint(base_builder(cfg["teacher_model"]["_component_"]), work)
        cfg["teacher_checkpointer"]["checkpoint_dir"] = str(tckpt)
        cfg["teacher_checkpointer"]["checkpoint_files"] = ["model.safetensors"]
        cfg["teacher_checkpointer"]["output_dir"] = str(out_dir / "teacher")
    if "metric_logger" in cfg:
        cfg["metric_logger"]["log_dir"] = str(out_dir)
    if "dataset" in cfg:
        seq_len = (cfg.get("tokenizer") or {}).get("max_seq_len") or 2048
        per_step = cfg["batch_size"] * cfg.get("gradient_accumulation_steps", 1) * nproc
        cfg["tokenizer"] = {"_component_": "tune_recipes.data.tiny_tokenizer", "max_seq_len": None}
        cfg["dataset"] = {"_component_": "tune_recipes.data.synthetic.synthetic_dataset",
                          "num_samples": per_step * (steps + 2), "seq_len": seq_len,
                          "vocab_size": vocab_size(ckpt)}
        cfg["max_steps_per_epoch"] = steps + 1
        cfg["epochs"] = 1
        cfg["log_every_n_steps"] = 1
        cfg["log_peak_memory_stats"] = True
    if DEVICE_OVERRIDE:
        cfg["device"] = DEVICE_OVERRIDE
        cfg["dtype"] = "fp32" if DEVICE_OVERRIDE == "cpu" else cfg.get("dtype")
    cfg_path = work / "configs" / f"{name.replace('/', '_')}.yaml"
    cfg_path.parent.mkdir(parents=True, exist_ok=True)
    cfg_path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return recipe, cfg_path, out_dir, cfg


RUN_TIMEOUT_S = 300


def run_one(name: str, work: Path, steps: int, nproc: int, save: bool, gpu: str = None) -> dict:
    t_start = time.time()
    try:
        recipe, cfg_path, out_dir, cfg = acceptance_config(name, work, steps, nproc)
    except Exception as e:  # a checkpoint that cannot be built is a result too
        return {"config": name, "status": f"setup failed: {e}"[:300]}
    subprocess.run(["rm", "-rf", str(out_dir)])
    out_dir.mkdir(parents=True, exist_ok=True)
    launch = ["--nproc_per_node", str(nproc)] if recipe in DISTRIBUTED else []
    cmd = [sys.executable, "-m", "tune_recipes", "run", *launch, recipe, "--config", str(cfg_path)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpu
    log = work / "logs" / f"{name.replace('/', '_')}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    metrics = out_dir / "metrics.jsonl"
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, cwd=REPO, env=env,
                                start_new_session=True)
        stopped = timed_out = False
        while proc.poll() is None:
            time.sleep(0.5)
            if time.time() - t_start > RUN_TIMEOUT_S:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                timed_out = True
                break
            if recipe == "quantize" or save:
                continue
            if metrics.exists() and len(metrics.read_text().splitlines()) >= steps:
                os.killpg(proc.pid, signal.SIGTERM)
                stopped = True
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
    wall = time.time() - t_start
    row = {"config": name, "recipe": recipe, "wall_s": round(wall, 1),
           "batch": cfg.get("batch_size"), "ga": cfg.get("gradient_accumulation_steps"),
           "ac": cfg.get("enable_activation_checkpointing"), "dtype": cfg.get("dtype")}
    text = log.read_text(errors="replace")
    if timed_out:
        text += f"\nError: no result within {RUN_TIMEOUT_S} s (killed)"
    if recipe == "quantize":
        row["status"] = quantize_status(out_dir, proc.returncode, text, keep=save)
    # What the next config has: a full disk fails runs in ways that look like recipe bugs.
    row["disk_free_gib"] = round(shutil.disk_usage(work).free / 2**30, 1)
    if recipe == "quantize":
        return row
    rows = [json.loads(l) for l in metrics.read_text().splitlines()] if metrics.exists() else []
    if len(rows) < steps:
        row["status"] = _failure(text, proc.returncode) + f" (after {len(rows)} steps)"
        return row
    row["status"] = "ok" if (stopped or proc.returncode == 0) else _failure(text, proc.returncode)
    timed = rows[1:steps]
    row["tokens_per_s"] = round(statistics.median(r["tokens_per_second_per_gpu"] for r in timed))
    tokens = sum(r["valid_tokens"] for r in timed)
    wall_between_rows = rows[steps - 1]["time"] - rows[0]["time"]
    reported = tokens / sum(r["step_time_s"] * r["steps_in_window"] for r in timed)
    row["wall_check"] = round(reported / (tokens / wall_between_rows), 4)
    row["step_s"] = round(statistics.median(r["step_time_s"] for r in timed), 3)
    mem = [r.get("peak_memory_active_gib") for r in rows if r.get("peak_memory_active_gib")]
    row["peak_gib"] = round(max(mem), 2) if mem else None
    row["first_loss"], row["last_loss"] = rows[0]["loss"], rows[steps - 1]["loss"]
    return row


def quantize_status(out_dir: Path, rc, text: str, keep: bool) -> str:
    """"ok" when the quantize run exited 0 and wrote its checkpoint; the checkpoint is then
    deleted unless ``keep`` (``--save``).

    NOTE: the deletion is what keeps a single-device pass on the GPU machine's disk (64 GiB):
    an 8B quantized checkpoint is 5.2 GiB, on top of the random checkpoints (8B and 7B: about
    31 GiB); without it the next config can die with ENOSPC.
    """
    written = sorted(out_dir.glob("model-*.pt"))
    if rc != 0 or not written:
        return _failure(text, rc)
    if not keep:
        for path in written:
            path.unlink()
    return "ok"


def _failure(text: str, rc) -> str:
    if "OutOfMemoryError" in text or "CUDA out of memory" in text:
        return "out of GPU memory"
    lines = [l for l in text.splitlines() if "Error" in l or l.startswith("error:")]
    return f"failed (rc {rc}): {lines[-1].strip()[:200] if lines else text[-200:]}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kind", choices=("single", "distributed", "all"), default="single")
    ap.add_argument("--configs", default="", help="comma-separated names or shell patterns, e.g. "
                    "'llama3_1/*,qwen2_5/7B_*' (default: every config of --kind)")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--lanes", type=int, default=1,
                    help="single-device configs run this many at a time, one GPU each")
    ap.add_argument("--save", action="store_true", help="let each run write its checkpoint")
    ap.add_argument("--device", default=None, help="override device (a CPU dry run: cpu)")
    ap.add_argument("--include-tiny", action="store_true", help="also configs/tiny (dry runs)")
    ap.add_argument("--run-timeout", type=int, default=300, help="seconds per config")
    ap.add_argument("--work", default="/tmp/acceptance")
    ap.add_argument("--out", default="acceptance.json")
    args = ap.parse_args()
    work = Path(args.work)
    names = [c for c in registry.list_configs() if args.include_tiny or not c.startswith("tiny/")]
    global DEVICE_OVERRIDE, RUN_TIMEOUT_S
    DEVICE_OVERRIDE, RUN_TIMEOUT_S = args.device, args.run_timeout
    if args.configs:
        names = [c for c in names if any(fnmatch.fnmatchcase(c, p) for p in args.configs.split(","))]
    single = [c for c in names if registry.recipe_for_config(c) not in DISTRIBUTED]
    dist = [c for c in names if registry.recipe_for_config(c) in DISTRIBUTED]
    import torch

    ngpu = torch.cuda.device_count()
    results = []
    meta = {"date": time.strftime("%Y-%m-%d"), "gpu": torch.cuda.get_device_name(0) if ngpu else "cpu",
            "gpus": ngpu, "torch": torch.__version__, "command": " ".join(sys.argv)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)

    def record(row):
        # Rewritten after every config: a run cut short by the machine's limit keeps its rows.
        results.append(row)
        print(json.dumps(row), flush=True)
        Path(args.out).write_text(json.dumps({"meta": meta, "rows": results}, indent=1))

    if args.kind in ("single", "all"):
        # Checkpoints first (one builder at a time), then the runs, lanes in parallel.
        for c in single:
            acceptance_config(c, work, args.steps, 1)
        lanes = max(1, min(args.lanes, ngpu))
        # NOTE: a lane owns its GPU until its run ends. Binding GPUs to configs by index would
        # let a long run and the next config on the same index share a GPU.
        free_gpus = queue.Queue()
        for g in range(lanes):
            free_gpus.put(str(g))

        def on_free_gpu(config):
            gpu = free_gpus.get()
            try:
                return run_one(config, work, args.steps, 1, args.save, gpu if lanes > 1 else None)
            finally:
                free_gpus.put(gpu)

        with ThreadPoolExecutor(lanes) as pool:
            for row in pool.map(on_free_gpu, single):
                record(row)
    if args.kind in ("distributed", "all"):
        for c in dist:
            if ngpu < args.nproc and args.device != "cpu":
                record({"config": c, "recipe": registry.recipe_for_config(c),
                        "status": f"not run: needs {args.nproc} GPUs, this machine has {ngpu}"})
            else:
                record(run_one(c, work, args.steps, args.nproc, args.save))
    print("\n| config | status | tokens/s | wall check | peak GiB | first loss | last loss |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        fl = f"{r['first_loss']:.3f}" if "first_loss" in r else ""
        ll = f"{r['last_loss']:.3f}" if "last_loss" in r else ""
        print(f"| {r['config']} | {r['status']} | {r.get('tokens_per_s', '')} | "
              f"{r.get('wall_check', '')} | {r.get('peak_gib', '')} | {fl} | {ll} |")


if __name__ == "__main__":
    main()
