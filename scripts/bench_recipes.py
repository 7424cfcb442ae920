"""Our single-device recipes vs torchtune 0.6.1's stock recipes, side by side, one GPU.

    python3 scripts/bench_recipes.py --out results/recipes.json [--cases full_1b,lora_8b]

Each case builds a random-init checkpoint with the real model's shapes (nothing can be
downloaded on the benchmark machine), writes one config per variant (same model, data, batch,
optimizer, loss; only the recipe differs, plus our fused-loss variant), runs each through its
own CLI for a fixed number of steps on synthetic fixed-length data, and reads tokens/s (median
over the steps after warm-up) and peak allocated memory from each run's metrics.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]

CASES = {
    # A CPU dry run of the whole pipeline (checks configs and both CLIs; numbers meaningless).
    "tiny_cpu": dict(
        recipe="full_finetune_single_device",
        builder="tune_recipes.models.tiny_llama3",
        model={"_component_": "tune_recipes.models.tiny_llama3"},
        batch_size=4, seq_len=64, steps=8, vocab=272, device="cpu", dtype="fp32",
        extra={"optimizer_in_bwd": False, "enable_activation_checkpointing": False},
        optimizer={"_component_": "torch.optim.AdamW", "lr": 2e-5},
    ),
    "full_1b": dict(
        recipe="full_finetune_single_device",
        builder="torchtune.models.llama3_2.llama3_2_1b",
        model={"_component_": "torchtune.models.llama3_2.llama3_2_1b"},
        batch_size=4, seq_len=2048, steps=25,
        extra={"optimizer_in_bwd": False, "enable_activation_checkpointing": False},
        optimizer={"_component_": "torch.optim.AdamW", "lr": 2e-5, "fused": True},
    ),
    # torchtune's shipped 1B config steps inside backward; same here, for both recipes.
    "full_1b_inbwd": dict(
        recipe="full_finetune_single_device",
        builder="torchtune.models.llama3_2.llama3_2_1b",
        model={"_component_": "torchtune.models.llama3_2.llama3_2_1b"},
        batch_size=4, seq_len=2048, steps=25, ckpt="full_1b",
        extra={"optimizer_in_bwd": True, "enable_activation_checkpointing": False},
        optimizer={"_component_": "torch.optim.AdamW", "lr": 2e-5, "fused": True},
    ),
    # Two GPUs, FSDP2 (run on the nvidia-h200-x2 kind): per-rank batch 4 x 2048.
    "full_1b_2gpu": dict(
        recipe="full_finetune_distributed", nproc=2,
        builder="torchtune.models.llama3_2.llama3_2_1b", ckpt="full_1b",
        model={"_component_": "torchtune.models.llama3_2.llama3_2_1b"},
        batch_size=4, seq_len=2048, steps=20,
        extra={"enable_activation_checkpointing": False, "fsdp_reshard_after_forward": True},
        optimizer={"_component_": "torch.optim.AdamW", "lr": 2e-5, "fused": True},
    ),
    "lora_1b_2gpu": dict(
        recipe="lora_finetune_distributed", nproc=2,
        builder="torchtune.models.llama3_2.llama3_2_1b", ckpt="full_1b",
        model={"_component_": "torchtune.models.llama3_2.lora_llama3_2_1b",
               "lora_attn_modules": ["q_proj", "v_proj", "output_proj"],
               "apply_lora_to_mlp": True, "lora_rank": 8, "lora_alpha": 16},
        batch_size=4, seq_len=2048, steps=20,
        extra={"enable_activation_checkpointing": False, "fsdp_reshard_after_forward": True,
               "save_adapter_weights_only": True},
        optimizer={"_component_": "torch.optim.AdamW", "lr": 3e-4, "fused": True},
    ),
    "lora_8b": dict(
        recipe="lora_finetune_single_device",
        builder="torchtune.models.llama3_1.llama3_1_8b",
        model={"_component_": "torchtune.models.llama3_1.lora_llama3_1_8b",
               "lora_attn_modules": ["q_proj", "v_proj", "output_proj"],
               "apply_lora_to_mlp": True, "lora_rank": 8, "lora_alpha": 16},
        batch_size=2, seq_len=2048, steps=20,
        extra={"enable_activation_checkpointing": True, "save_adapter_weights_only": True},
        optimizer={"_component_": "torch.optim.AdamW", "lr": 3e-4, "fused": True},
    ),
}


def write_config(path: Path, case: dict, ckpt: Path, out_dir: Path, loss: dict, stock: bool):
    cfg = {
        "output_dir": str(out_dir),
        "model": case["model"],
        "tokenizer": {"_component_": "tune_recipes.data.tiny_tokenizer", "max_seq_len": None},
        "dataset": {"_component_": "tune_recipes.data.synthetic.synthetic_dataset",
                    "num_samples": case["batch_size"] * (case["steps"] + 2),
                    "seq_len": case["seq_len"], "vocab_size": case.get("vocab", 128256)},
        "checkpointer": {"_component_": "torchtune.training.FullModelHFCheckpointer",
                         "checkpoint_dir": str(ckpt), "checkpoint_files": ["model.safetensors"],
                         "model_type": "LLAMA3", "output_dir": str(out_dir)},
        "resume_from_checkpoint": False,
        "seed": 0, "shuffle": False, "batch_size": case["batch_size"], "epochs": 1,
        "max_steps_per_epoch": case["steps"], "gradient_accumulation_steps": 1,
        "optimizer": case["optimizer"], "loss": loss, "clip_grad_norm": None,
        # torchtune's distributed LoRA recipe requires a scheduler key; same one for everyone.
        "lr_scheduler": {"_component_": "torchtune.training.lr_schedulers.get_cosine_schedule_with_warmup",
                         "num_warmup_steps": 0},
        "compile": False, "device": case.get("device", "cuda"), "dtype": case.get("dtype", "bf16"),
        "metric_logger": {"_component_": "tune_recipes.training.metrics.JsonlMetricLogger",
                          "log_dir": str(out_dir)},
        "log_every_n_steps": 1, "log_peak_memory_stats": True,
        **case["extra"],
    }
    if stock and case["recipe"] == "lora_finetune_single_device":
        cfg["enable_activation_offloading"] = False
    if stock and case["recipe"] == "full_finetune_single_device":
        cfg["enable_activation_offloading"] = False
    if stock and "distributed" in case["recipe"]:
        cfg["profiler"] = {"_component_": "torchtune.training.setup_torch_profiler", "enabled": False}
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))


def run(cmd, log: Path) -> float:
    t0 = time.time()
    with open(log, "w") as fh:
        proc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, cwd=REPO,
                              env={**os.environ, "PYTHONUNBUFFERED": "1"})
    if proc.returncode != 0:
        text = log.read_text()
        # The ranks' own error lines say why; torchrun's summary after them does not.
        rank_lines = [l for l in text.splitlines() if l.startswith("[rank0]") or "Error" in l]
        tail = "\n".join(rank_lines[-25:]) or text[-3000:]
        raise RuntimeError(f"{' '.join(map(str, cmd))} failed:\n{tail}")
    return time.time() - t0


def summarize(out_dir: Path, warmup: int = 5) -> dict:
    rows = [json.loads(l) for l in (out_dir / "metrics.jsonl").read_text().splitlines()]
    tps = [r["tokens_per_second_per_gpu"] for r in rows[warmup:]]
    mem = [r.get("peak_memory_alloc", r.get("peak_memory_active_gib")) for r in rows]
    mem = [m for m in mem if m is not None]
    return {"steps": len(rows), "tokens_per_s": round(statistics.median(tps)),
            "peak_alloc_gib": round(max(mem), 2) if mem else None,
            "final_loss": rows[-1]["loss"]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="recipes.json")
    ap.add_argument("--cases", default="full_1b")
    ap.add_argument("--work", default="/tmp/bench_recipes")
    ap.add_argument("--order", choices=("stock-first", "ours-first"), default="stock-first",
                    help="which variant runs first (separate processes; checks order effects)")
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    py = sys.executable
    results = []
    for name in args.cases.split(","):
        case = CASES[name]
        ckpt = work / f"ckpt_{case.get('ckpt', name)}"
        if not (ckpt / "model.safetensors").exists():
            run([py, "scripts/make_random_checkpoint.py", "--builder", case["builder"],
                 "--out", str(ckpt), "--dtype", case.get("dtype", "bf16")], work / f"ckpt_{name}.log")
        chunked = {"_component_": "torchtune.modules.loss.CEWithChunkedOutputLoss"}
        fused = {"_component_": "tune_recipes.modules.loss.FusedLinearCrossEntropyLoss"}
        variants = [
            ("torchtune 0.6.1 stock recipe, chunked CE", True, chunked),
            ("tune-recipes, chunked CE", False, chunked),
            ("tune-recipes, fused linear CE", False, fused),
        ]
        if args.order == "ours-first":
            variants.reverse()
        for label, stock, loss in variants:
            tag = f"{name}_{'stock' if stock else 'ours'}_{loss['_component_'].split('.')[-1]}"
            out_dir = work / tag
            subprocess.run(["rm", "-rf", str(out_dir)])
            cfg_path = work / f"{tag}.yaml"
            write_config(cfg_path, case, ckpt, out_dir, loss, stock)
            if stock:
                # The stock recipe file itself (torchtune's CLI imports its downloaders, whose
                # dependencies the benchmark machine may lack).
                import torchtune

                stock_file = Path(torchtune.__file__).resolve().parent.parent / "recipes" / f"{case['recipe']}.py"
                cmd = [py, str(stock_file), "--config", str(cfg_path)]
                if case.get("nproc"):
                    cmd = [py, "-m", "torch.distributed.run", "--nproc_per_node",
                           str(case["nproc"]), str(stock_file), "--config", str(cfg_path)]
            else:
                cmd = [py, "-m", "tune_recipes", "run", case["recipe"], "--config", str(cfg_path)]
                if case.get("nproc"):
                    cmd[4:4] = ["--nproc_per_node", str(case["nproc"])]
            try:
                wall = run(cmd, work / f"{tag}.log")
                row = {"case": name, "variant": label, "wall_s": round(wall, 1), **summarize(out_dir)}
            except RuntimeError as e:
                row = {"case": name, "variant": label, "error": str(e)[-1500:]}
            results.append(row)
            print(json.dumps(row), flush=True)
    import torch

    meta = {"date": time.strftime("%Y-%m-%d"),
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "torch": torch.__version__, "command": " ".join(sys.argv)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"meta": meta, "rows": results}, indent=1))
    print("\n| case | variant | tokens/s | peak alloc GiB | final loss |")
    print("|---|---|---|---|---|")
    for r in results:
        if "error" in r:
            print(f"| {r['case']} | {r['variant']} | error | | |")
        else:
            print(f"| {r['case']} | {r['variant']} | {r['tokens_per_s']} | {r['peak_alloc_gib']} | {r['final_loss']:.4f} |")


if __name__ == "__main__":
    main()
