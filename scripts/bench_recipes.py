"""Our recipes vs torchtune 0.6.1's stock recipes, side by side, on the same data and steps.

    python3 scripts/bench_recipes.py --preset instruct --cases full_1b_packed --out r/packed.json
    python3 scripts/bench_recipes.py --preset claim --cases full_1b --out r/claim_1b.json
    python3 scripts/bench_recipes.py --cases shipped:llama3_2/1B_lora_single_device --reps 1 --out r/s.json
    python3 scripts/bench_recipes.py --preset curves --cases full_1b_curve --out r/curve_1b.json
    python3 scripts/bench_recipes.py --cases tiny_cpu --reps 1 --out /tmp/r.json   # CPU dry run
    python3 scripts/bench_recipes.py --merge r/a.json r/b.json --out r/all.json      # one table

A case (scripts/bench_cases.py, the data of what is measured) is a model on data with variants,
config overrides for one side (stock: torchtune's recipe file; ours: ``python -m tune_recipes
run``), each run in its own process.
``stock_best``/``ours_best``: each side's best settings (ours': the README's fastest settings),
every repetition, alternating; other variants are levers, run once. ``shipped:<config>``: our
shipped config against torchtune's same-named one, each as shipped, pointed only at the bench's
checkpoint (random init of the real shapes), tokenizer, data and output_dir.

Data: ``synthetic`` rows of full length (the reference), or ``packed``/``padded``: instruction
rows of spread lengths (scripts/make_instruction_data.py) through torchtune's ``alpaca_dataset``,
packed with document masks or padded per batch; both sides use the byte-level
``tune_recipes.data.tiny_tokenizer`` (offline; its ids are valid in every model's vocabulary).

Clock (scripts/bench_hooks/bench_clock.py, the same for both sides): the GPU synchronized when
batch W and W+N are fetched; tokens/s = every token of those N batches over the time between;
label tokens/s; the run's true peak memory. MFU: model FLOPs (6 x params a token for a full
fine-tune, 4 for LoRA, + 2 with activation checkpointing; a distillation teacher's forward,
2 x its params, added) over the H200's dense bf16 rate.
Writes the JSON as rows finish, then a Markdown table (.md) and a chart (.png) beside ``--out``.
"""

import argparse
import importlib.util
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import yaml

REPO = Path(__file__).resolve().parents[1]
HOOKS = REPO / "scripts" / "bench_hooks"
H200_BF16_TFLOPS = 790.0  # dense bf16 matmul rate measured on the H200 (docs/benchmarks.md)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_cases import CASES, CLAIM, PRESET_REPS, PRESETS  # noqa: E402,F401 - CLAIM: the README's test


# ---------------------------------------------------------------------------- configs
def write_config(path: Path, case: dict, variant: dict, ckpt: Path, out_dir: Path,
                 data_file: Optional[Path] = None, steps: int = 30, overrides: Optional[dict] = None,
                 teacher_ckpt: Optional[Path] = None) -> dict:
    """One run's YAML: the case's config (or the shipped config as shipped) with the variant's
    overrides, then ``overrides`` (dotted keys, ``--set``). Returns the config written.
    ``teacher_ckpt``: a distillation config's teacher checkpoint (its ``teacher_checkpointer``)."""
    dataset = {"_component_": "torchtune.datasets.alpaca_dataset", "source": "json",
               "data_files": str(data_file or "instruct.json"), "split": "train"}
    tokenizer = {"_component_": "tune_recipes.data.tiny_tokenizer", "max_seq_len": case["seq_len"]}
    if case.get("shipped"):
        cfg = yaml.safe_load(case["shipped"][variant["side"]].read_text())
        cfg["tokenizer"] = {**tokenizer, "max_seq_len": cfg.get("tokenizer", {}).get("max_seq_len")}
        cfg["dataset"] = {**dataset, "packed": bool(cfg.get("dataset", {}).get("packed", False))}
        cfg["checkpointer"].update(checkpoint_dir=str(ckpt), checkpoint_files=["model.safetensors"],
                                   output_dir=str(out_dir), recipe_checkpoint=None)
        if "teacher_checkpointer" in cfg:
            if teacher_ckpt is None:
                raise ValueError(f"{case['shipped'][variant['side']]}: a teacher_checkpointer, and no teacher checkpoint")
            cfg["teacher_checkpointer"].update(checkpoint_dir=str(teacher_ckpt), checkpoint_files=["model.safetensors"],
                                               output_dir=str(out_dir), recipe_checkpoint=None)
        cfg.update(output_dir=str(out_dir), resume_from_checkpoint=False, epochs=1, max_steps_per_epoch=steps)
        for key, value in variant["cfg"].items():  # a variant of a shipped config
            # a section's keys merge into the shipped section; one naming a component replaces it
            merge = isinstance(value, dict) and "_component_" not in value and isinstance(cfg.get(key), dict)
            cfg[key] = {**cfg[key], **value} if merge else value
    else:
        over = dict(variant["cfg"])
        batch, ga = over.pop("batch_size", case["batch_size"]), over.pop("gradient_accumulation_steps", 1)
        if batch * ga != case["batch_size"]:
            raise ValueError(f"{variant['name']}: batch {batch} x GA {ga} != {case['batch_size']} a step")
        data = case["data"]
        if data["kind"] == "synthetic":
            dataset = {"_component_": "tune_recipes.data.synthetic.synthetic_dataset",
                       "num_samples": case["batch_size"] * (steps + 2), "seq_len": case["seq_len"],
                       "vocab_size": data["data_vocab"], "repeat": data["data_repeat"]}
        else:
            dataset["packed"] = data["packed"]
        cfg = {
            "output_dir": str(out_dir), "model": case["model"], "tokenizer": tokenizer, "dataset": dataset,
            "checkpointer": {"_component_": "torchtune.training.FullModelHFCheckpointer",
                             "checkpoint_dir": str(ckpt), "checkpoint_files": ["model.safetensors"],
                             "model_type": "LLAMA3", "output_dir": str(out_dir)},
            "resume_from_checkpoint": False, "seed": 0, "shuffle": False, "batch_size": batch,
            "epochs": 1, "max_steps_per_epoch": steps, "gradient_accumulation_steps": ga,
            "optimizer": case["optimizer"], "clip_grad_norm": None,
            # torchtune's distributed recipes require a scheduler key; the same one for both.
            "lr_scheduler": {"_component_": "torchtune.training.lr_schedulers.get_cosine_schedule_with_warmup",
                             "num_warmup_steps": 0},
            "compile": False, "device": case.get("device", "cuda"), "dtype": case.get("dtype", "bf16"),
            "metric_logger": {"_component_": "tune_recipes.training.metrics.JsonlMetricLogger",
                              "log_dir": str(out_dir)},
            "log_every_n_steps": 1, "log_peak_memory_stats": True, **case["extra"], **over,
        }
        if variant["side"] == "stock" and "single_device" in case["recipe"]:
            cfg.setdefault("enable_activation_offloading", False)  # stock reads it unguarded
        if variant["side"] == "stock" and "distributed" in case["recipe"]:
            cfg["profiler"] = {"_component_": "torchtune.training.setup_torch_profiler", "enabled": False}
    for key, value in (overrides or {}).items():
        *parents, leaf = key.split(".")
        node = cfg
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return cfg


# ---------------------------------------------------------------------------- runner
def random_checkpoint(work: Path, builder: str, dtype: str, timeout: float) -> Path:
    """``work``/ckpt_<builder>_<dtype>: random-init weights of ``builder``'s shapes, built once."""
    ckpt = work / f"ckpt_{builder.rsplit('.', 1)[-1]}_{dtype}"
    if not (ckpt / "model.safetensors").exists():
        # NOTE: built aside and renamed into place (atomic): a bench on another GPU may be
        # looking for the same checkpoint meanwhile, and must never read half of one.
        t0, tmp = time.time(), ckpt.with_name(f"{ckpt.name}.{os.getpid()}")
        run([sys.executable, "scripts/make_random_checkpoint.py", "--builder", builder,
             "--out", str(tmp), "--dtype", dtype], work / f"{ckpt.name}.log", timeout, {})
        try:
            tmp.rename(ckpt)
        except OSError:  # the other bench's copy came first
            subprocess.run(["rm", "-rf", str(tmp)])
        print(f"checkpoint {ckpt.name}: {time.time() - t0:.0f} s", flush=True)
    return ckpt


def run(cmd, log: Path, timeout: float, env: dict) -> float:
    """``cmd`` in its own process, scripts/bench_hooks first on its path; its wall seconds. A
    failure raises with the log's error lines, the reason last (a row keeps the tail)."""
    path = os.pathsep.join(p for p in (str(HOOKS), os.environ.get("PYTHONPATH")) if p)
    t0 = time.time()
    with open(log, "w") as fh:
        try:
            rc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, cwd=REPO, timeout=timeout,
                                env={**os.environ, "PYTHONUNBUFFERED": "1", **env, "PYTHONPATH": path}).returncode
        except subprocess.TimeoutExpired:
            rc = f"timeout after {timeout:.0f} s"
    if rc != 0:
        text = log.read_text(errors="replace")
        lines = [l for l in text.splitlines() if l.startswith("[rank0]") or "Error" in l]
        reason = f"out of memory (exit {rc})" if "CUDA out of memory" in text or "OutOfMemoryError" in text else rc
        raise RuntimeError(("\n".join(lines[-25:]) or text[-3000:]) + f"\n[failed: {reason}]")
    return time.time() - t0


def command(case: dict, variant: dict, cfg_path: Path) -> list:
    py, nproc = sys.executable, case.get("nproc")
    if variant["side"] == "ours":
        launch = ["--nproc_per_node", str(nproc)] if nproc else []
        return [py, "-m", "tune_recipes", "run", *launch, case["recipe"], "--config", str(cfg_path)]
    # The stock recipe file itself (torchtune's CLI imports its downloaders, whose dependencies
    # the benchmark machine may lack).
    import torchtune

    stock = Path(torchtune.__file__).resolve().parent.parent / "recipes" / f"{case['recipe']}.py"
    launch = [py, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc)] if nproc else [py]
    return [*launch, str(stock), "--config", str(cfg_path)]


def read_run(clock_file: Path, out_dir: Path) -> dict:
    """A run's row: the clock's numbers and, where the run logged them, its losses."""
    clock = json.loads(clock_file.read_text()) if clock_file.exists() else {"batches_fetched": 0}
    if "tokens_per_s" not in clock:
        raise RuntimeError(f"the run fetched {clock['batches_fetched']} batches: too few for the clock")
    row = {k: round(v, 3) if isinstance(v, float) else v for k, v in clock.items()}
    if (out_dir / "metrics.jsonl").exists():
        logged = [json.loads(l) for l in (out_dir / "metrics.jsonl").read_text().splitlines() if l.strip()]
        row["losses"] = [round(r["loss"], 5) for r in logged if "loss" in r]
    return row


# What a run saves that the benchmark never reads: its model and recipe-state checkpoints.
SAVED_WEIGHTS = ("*.safetensors", "*.pt", "*.bin")


def drop_saved_weights(out_dir: Path) -> None:
    """Delete the checkpoints a run saved under ``out_dir`` (finished or failed), keeping its
    metrics and logs. NOTE: keep this. Each run saves the whole model at its end (15 GiB for an
    8B); a few of those fill the GPU machine's 64 GiB disk, and the next run then fails at its
    own save, after its clock, losing its row."""
    for pattern in SAVED_WEIGHTS:
        for path in out_dir.rglob(pattern):
            path.unlink()


def schedule(case: dict, reps: int, names: Optional[list] = None) -> list:
    """(rep, variant) in run order: heads every repetition, alternating direction; the others
    once, after the heads of the first. ``names`` (a preset's list): those, every repetition."""
    by_name = {v["name"]: v for v in case["variants"]}
    if names is not None and set(names) - set(by_name):
        raise ValueError(f"no variant(s) {sorted(set(names) - set(by_name))} in this case; it has {sorted(by_name)}")
    heads = [by_name[n] for n in names] if names is not None else [v for v in by_name.values() if v["head"]]
    levers = [] if names is not None else [v for v in by_name.values() if not v["head"]]
    order = []
    for rep in range(reps):
        order += [(rep, v) for v in (heads if rep % 2 == 0 else heads[::-1])]
        order += [(0, v) for v in levers] if rep == 0 else []
    return order


def run_shape(case: dict, variant: dict, min_steps: Optional[int],
              window: Optional[int] = None) -> tuple:
    """(sequences a micro-batch, micro-batches a step, warmup batches, window batches, steps) of
    a run: the case's warmup and window (default 5 and 20 batches; ``window``, --window, instead
    of the case's) rounded up to whole optimizer steps, and one step more than they need, so
    that the recipe fetches batch warmup + window (where the clock stops) whichever way it
    stops."""
    if case.get("shipped"):
        shipped = yaml.safe_load(case["shipped"][variant["side"]].read_text())
        batch, ga = shipped["batch_size"], shipped.get("gradient_accumulation_steps", 1)
    else:
        ga = variant["cfg"].get("gradient_accumulation_steps", 1)
        batch = case["batch_size"] // ga
    w, n = (ga * -(-count // ga) for count in (case.get("warmup", 5), window or case.get("window", 20)))
    return batch, ga, w, n, max(min_steps or 0, case.get("steps", 0), (w + n) // ga + 1)


def _params(ckpt: Path) -> float:
    """Parameters in a random checkpoint (its one safetensors file, bf16 or fp32)."""
    return (ckpt / "model.safetensors").stat().st_size / (4 if "fp32" in ckpt.name else 2)


def run_variant(name: str, case: dict, rep: int, variant: dict, shape: tuple, ckpt: Path,
                data_file: Optional[Path], args, overrides: dict, teacher_ckpt: Optional[Path] = None) -> dict:
    """One run, config to row."""
    batch, ga, warmup, window, steps = shape
    work, tag = Path(args.work), f"{name}_{variant['name']}_rep{rep}".replace("/", "_").replace(":", "_")
    out_dir, cfg_path, clock_file = work / tag, work / f"{tag}.yaml", work / f"{tag}.clock.json"
    subprocess.run(["rm", "-rf", str(out_dir), str(clock_file)])
    if args.profile:  # torchtune's profiler, CPU + CUDA over 3 steps once the clock's warm-up is
        # over (recompiles and autotuning done), for scripts/trace_summary.py
        overrides = {**overrides, "profiler": {
            "_component_": "torchtune.training.setup_torch_profiler", "enabled": True, "output_dir": str(
                work / f"prof_{tag}"), "cpu": True, "cuda": True, "wait_steps": max(5, warmup), "warmup_steps": 2,
            "active_steps": 3, "num_cycles": 1}}
    cfg = write_config(cfg_path, case, variant, ckpt, out_dir, data_file, steps, overrides, teacher_ckpt)
    row = {"case": name, "variant": variant["name"], "label": variant["label"], "rep": rep,
           "side": variant["side"], "overrides": {**variant["cfg"], **overrides}, "env": {**variant["env"], **args.env},
           "params": _params(ckpt), "teacher_params": _params(teacher_ckpt) if teacher_ckpt else 0,
           # LoRA by the recipe or, for a distillation student, by its model builder
           "lora": "lora" in case["recipe"] or "lora_" in str(cfg.get("model", {}).get("_component_", "")),
           "ac": bool(cfg.get("enable_activation_checkpointing")),
           "batch_size": batch, "ga": ga}
    env = {**row["env"], "BENCH_CLOCK": str(clock_file), "BENCH_CLOCK_WARMUP": str(warmup),
           "BENCH_CLOCK_WINDOW": str(window)}
    try:
        row["wall_s"] = round(run(command(case, variant, cfg_path), work / f"{tag}.log", args.run_timeout, env), 1)
        row.update(read_run(clock_file, out_dir))
    except RuntimeError as e:
        row["error"] = str(e)[-1500:]
    drop_saved_weights(out_dir)
    return row


# ---------------------------------------------------------------------------- summarizer
def flops_per_token_factor(lora: bool, activation_checkpointing: bool) -> int:
    """Matmul FLOPs per token per parameter (attention's score/value products not counted):
    forward 2, backward 4 for a full fine-tune, 2 for LoRA (input gradients only: the frozen
    base has no weight gradient), + 2 when activation checkpointing recomputes the forward."""
    return 2 + (2 if lora else 4) + (2 if activation_checkpointing else 0)


def aggregate(case_name: str, case: dict, rows: list) -> list:
    """One line per variant: mean tokens/s (and each repetition's), label tokens/s, peak
    allocated and reserved GiB, ratios to stock's reference (``stock_best``, or ``stock`` for
    a shipped config, else the first of stock's), MFU, and the last loss."""
    lines, sides = [], {v["name"]: v["side"] for v in case["variants"]}
    for v in case["variants"]:
        runs = [r for r in rows if r["variant"] == v["name"]]
        ok = [r for r in runs if "error" not in r]
        line = {"case": case_name, "variant": v["name"], "label": v["label"], "runs": len(ok),
                "failed_runs": len(runs) - len(ok)}
        if runs and not ok:
            lines.append({**line, "error": runs[0]["error"]})  # error_cell cuts it to fit
        elif ok:
            tps = statistics.mean(r["tokens_per_s"] for r in ok)
            # paged_gib: bitsandbytes' paged optimizer states, on the GPU but outside torch's counts
            peaks = [max(((r.get(k) or 0) + (r.get("paged_gib") or 0) if r.get(k) else 0) for r in ok) or None
                     for k in ("peak_alloc_gib", "peak_reserved_gib")]
            flops = (flops_per_token_factor(ok[0]["lora"], ok[0]["ac"]) * ok[0]["params"]
                     + 2 * ok[0].get("teacher_params", 0)) * tps
            lines.append({**line, "tokens_per_s": round(tps), "each": [round(r["tokens_per_s"]) for r in ok],
                          "label_tokens_per_s": round(statistics.mean(r["label_tokens_per_s"] for r in ok)),
                          "peak_alloc_gib": peaks[0] and round(peaks[0], 2),
                          "peak_reserved_gib": peaks[1] and round(peaks[1], 2),
                          "mfu": round(flops / (H200_BF16_TFLOPS * 1e12), 3),
                          "final_loss": (ok[0].get("losses") or [None])[-1]})
    stock = [l for l in lines if "error" not in l and sides[l["variant"]] == "stock"]
    ref = next((l for l in stock if l["variant"] in ("stock_best", "stock")), stock[0] if stock else None)
    for line in lines:
        if ref and "error" not in line:
            line["speed_vs_stock"] = round(line["tokens_per_s"] / ref["tokens_per_s"], 3)
            # NOTE: padding counts in tokens/s (the GPU computes it); on padded or padding-free
            # batches the label tokens are the work both sides share: compare those.
            line["label_speed_vs_stock"] = round(line["label_tokens_per_s"] / ref["label_tokens_per_s"], 3)
            for key, ratio in (("peak_alloc_gib", "alloc_vs_stock"), ("peak_reserved_gib", "reserved_vs_stock")):
                if line[key] and ref[key]:
                    line[ratio] = round(line[key] / ref[key], 3)
    return lines


def loss_gaps(rows: list) -> list:
    """Each run of ours against stock's reference run of the same case and repetition, over
    their shared steps: the largest relative difference, and the gap of the last-50 means."""
    ref = {(r["case"], r["rep"]): r["losses"] for r in rows
           if r["variant"] in ("stock_best", "stock") and r.get("losses")}
    found = []
    for r in rows:
        a, b = ref.get((r["case"], r["rep"])), r.get("losses")
        if r["side"] == "ours" and a and b:
            n = min(len(a), len(b))
            tail = slice(max(0, n - 50), n)
            found.append({"case": r["case"], "variant": r["variant"], "rep": r["rep"], "steps": n,
                          "max_rel_diff": round(max(abs(x - y) / abs(x) for x, y in zip(a[:n], b[:n])), 4),
                          "last50_gap_rel": round(statistics.mean(b[tail]) / statistics.mean(a[tail]) - 1, 5)})
    return found


def error_cell(error: str) -> str:
    """A failed run's error for a table cell: its last exception line (the message, from its
    start) and the reason, each cut to fit, the cell's pipes escaped."""
    lines = [l.strip() for l in error.splitlines() if l.strip()]
    reason = lines.pop() if lines and lines[-1].startswith("[failed") else ""
    message = next((l for l in reversed(lines) if "Error" in l or "Exception" in l), lines[-1] if lines else "")
    message = re.sub(r"^\[rank\d+\]:?\s*", "", message)
    return " ".join(x[:160] for x in (message, reason) if x).replace("|", "\\|")


def table(result: dict) -> str:
    """The summary as a Markdown table, and the loss gaps below it."""
    out = ["| case | variant | tokens/s (each rep) | label tokens/s | x stock | label x stock | "
           "peak alloc GiB (+ paged) | peak reserved GiB (+ paged) | alloc x stock | reserved x stock | MFU | last loss |",
           "|---" * 12 + "|"]
    for s in result["summary"]:
        if "error" in s:
            out.append(f"| {s['case']} | {s['label']} | error: {error_cell(s['error'])} ||||||||||")
            continue
        each = " / ".join(f"{x:,}" for x in s["each"]) + (f"; {s['failed_runs']} failed" if s["failed_runs"] else "")
        loss = f"{s['final_loss']:.4f}" if s["final_loss"] is not None else ""
        out.append(f"| {s['case']} | {s['label']} | {s['tokens_per_s']:,} ({each}) | {s['label_tokens_per_s']:,} | "
                   f"{s.get('speed_vs_stock', '')} | {s.get('label_speed_vs_stock', '')} | "
                   f"{s['peak_alloc_gib']} | {s['peak_reserved_gib']} | "
                   f"{s.get('alloc_vs_stock', '')} | {s.get('reserved_vs_stock', '')} | {100 * s['mfu']:.1f}% | {loss} |")
    for g in result["loss_gaps"]:
        out.append(f"loss {g['case']} {g['variant']} rep {g['rep']} vs stock over {g['steps']} steps: "
                   f"max rel diff {g['max_rel_diff']}, last-50 mean gap {100 * g['last50_gap_rel']:+.3f}%")
    return "\n".join(out) + "\n"


def plot(result: dict, path: Path) -> None:
    """The chart: per case, tokens/s and peak allocated GiB of each variant (stock gray)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = [s for s in result["summary"] if "error" not in s]
    cases = list(dict.fromkeys(s["case"] for s in summary)) or ["(no rows)"]
    fig, axes = plt.subplots(2, len(cases), figsize=(5 * len(cases), 8), squeeze=False)
    for j, case in enumerate(cases):
        lines = [s for s in summary if s["case"] == case]
        for i, (key, title) in enumerate((("tokens_per_s", "tokens/s"), ("peak_alloc_gib", "peak allocated GiB"))):
            axes[i][j].bar(range(len(lines)), [s[key] or 0 for s in lines],
                           color=["tab:gray" if s["variant"].startswith("stock") else "tab:blue" for s in lines])
            axes[i][j].set_xticks(range(len(lines)), [s["variant"] for s in lines], rotation=35, ha="right", fontsize=8)
            axes[i][j].set_title(f"{case}: {title}", fontsize=9)
    meta = result["meta"]
    fig.suptitle(f"tune-recipes vs torchtune 0.6.1, {meta['gpu']}, torch {meta['torch']}, {meta['date']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_outputs(result: dict, out: Path) -> None:
    """The summary and loss gaps into the JSON at ``out``; the table (printed, and .md) and chart (.png)."""
    result["summary"] = [line for name in dict.fromkeys(r["case"] for r in result["rows"])
                         for line in aggregate(name, CASES[name], [r for r in result["rows"] if r["case"] == name])]
    result["loss_gaps"] = loss_gaps(result["rows"])
    out.write_text(json.dumps(result, indent=1))
    print(table(result), flush=True)
    out.with_suffix(".md").write_text(table(result))
    plot(result, out.with_suffix(".png"))


def merge_rows(parts: list) -> list:
    """Separate runs' rows in one list, each (case, variant)'s reps numbered on from the parts before."""
    rows, taken = [], {}
    for part in parts:
        offset = dict(taken)
        for r in part:
            key = (r["case"], r["variant"])
            rows.append({**r, "rep": offset.get(key, 0) + r["rep"]})
            taken[key] = max(taken.get(key, 0), rows[-1]["rep"] + 1)
    return rows


def versions() -> dict:
    import torch

    meta = {"date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "commit": code_commit(),
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "command": " ".join(sys.argv)}
    for mod in ("torchtune", "torchao", "triton"):  # triton: absent on a CPU machine
        meta[mod] = importlib.util.find_spec(mod) and __import__(mod).__version__
    return meta


def code_commit() -> Optional[str]:
    """``BENCH_COMMIT`` where set (the GPU machine's copy of the tree has no .git: put the
    commit in the command), else git's HEAD, "+dirty" when tracked files differ from it."""
    if os.environ.get("BENCH_COMMIT"):
        return os.environ["BENCH_COMMIT"]
    git = dict(cwd=REPO, capture_output=True, text=True, timeout=30)
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], **git)
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD"], **git).returncode != 0
    except (OSError, subprocess.TimeoutExpired):
        return None
    return head.stdout.strip() + ("+dirty" if dirty else "") if head.returncode == 0 else None


# ---------------------------------------------------------------------------- CLI
def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="recipes.json")
    ap.add_argument("--cases", default=None, help="comma-separated cases (default full_1b_packed); "
                    "with --preset, which of the preset's cases to run")
    ap.add_argument("--preset", choices=sorted(PRESETS), default=None,
                    help="instead of --cases: " + "; ".join(f"{k}: {', '.join(v)}" for k, v in PRESETS.items()))
    ap.add_argument("--reps", type=int, default=None, help="repetitions of the head variants (default 2, "
                    "or the preset's PRESET_REPS)")
    ap.add_argument("--only", default=None, help="comma-separated variant names to run")
    ap.add_argument("--window", type=int, default=None, help="batches the clock times (default the "
                    "case's, 20 or 40): longer windows, less run-to-run spread, more device time")
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps a run, at least what the "
                    "clock needs (e.g. 220 for a loss curve)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a config override for every run (dotted key, YAML value); repeatable")
    ap.add_argument("--env", action="append", default=[], metavar="NAME=VALUE", help="an environment variable "
                    "for every run, e.g. BENCH_MEMORY_CAP_GIB=19.5 (scripts/bench_hooks); repeatable")
    ap.add_argument("--profile", action="store_true", help="also profile each run (torchtune's profiler)")
    ap.add_argument("--work", default="/tmp/bench_recipes")
    ap.add_argument("--run-timeout", type=float, default=420, help="seconds per run")
    ap.add_argument("--plot", default=None, help="only redraw the table and chart of this results JSON")
    ap.add_argument("--merge", nargs="+", default=None, help="results JSONs of separate runs to combine "
                    "into --out: rows concatenated, ratios recomputed, table and chart redrawn")
    return ap


def plan_runs(args, ap) -> dict:
    """{case: [(rep, variant), ...]} in run order. Refuses, before any checkpoint is built, an
    unknown case, a case outside the preset, and an --only name this selection never runs."""
    wanted = [c for c in (args.cases or ("" if args.preset else "full_1b_packed")).split(",") if c]
    if [c for c in wanted if c not in CASES]:
        ap.error(f"--cases: no case(s) {[c for c in wanted if c not in CASES]}; cases: {', '.join(CASES)}")
    preset = PRESETS.get(args.preset, {})
    if args.preset and [c for c in wanted if c not in preset]:
        ap.error(f"--cases: {[c for c in wanted if c not in preset]} not in --preset {args.preset} "
                 f"({', '.join(preset)})")
    selection = {c: names for c, names in preset.items() if not wanted or c in wanted} if args.preset \
        else dict.fromkeys(wanted)
    args.reps = args.reps or PRESET_REPS.get(args.preset, 2)
    only = set(args.only.split(",")) if args.only else None
    # --only names what to compare: each named variant every repetition, alternating (a lever
    # left to the case's schedule would run once)
    plan = {c: schedule(CASES[c], args.reps, [v["name"] for v in CASES[c]["variants"] if v["name"] in only])
            if only else schedule(CASES[c], args.reps, names) for c, names in selection.items()}
    plan = {c: runs for c, runs in plan.items() if runs}
    never = sorted((only or set()) - {v["name"] for runs in plan.values() for _, v in runs})
    if never:
        ap.error(f"--only: {never} not run by this selection (cases {', '.join(selection)})")
    if not plan:
        ap.error("nothing to run")
    for flag, value in (("--window", args.window), ("--steps", args.steps), ("--reps", args.reps)):
        if value is not None and value < 1:
            ap.error(f"{flag} {value}: expected at least 1")
    return plan


def main():
    ap = build_parser()
    args = ap.parse_args()
    if args.merge or args.plot:
        parts = [json.loads(Path(f).read_text()) for f in (args.merge or [args.plot])]
        meta = {**parts[0]["meta"], "parts": [p["meta"] for p in parts]} if args.merge else parts[0]["meta"]
        out = Path(args.out if args.merge else args.plot)
        return write_outputs({"meta": meta, "rows": merge_rows([p["rows"] for p in parts])}, out)
    for flag, items in (("--set", args.set), ("--env", args.env)):
        if [i for i in items if "=" not in i]:
            ap.error(f"{flag} {[i for i in items if '=' not in i][0]!r}: expected NAME=VALUE")
    overrides = {k: yaml.safe_load(v) for k, _, v in (i.partition("=") for i in args.set)}
    args.env = dict(i.partition("=")[::2] for i in args.env)
    plan = plan_runs(args, ap)
    work, out = Path(args.work), Path(args.out)
    work.mkdir(parents=True, exist_ok=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {"meta": versions(), "rows": []}
    for name, runs in plan.items():
        case = CASES[name]
        dtype = case.get("dtype", "bf16")
        ckpt = random_checkpoint(work, case["builder"], dtype, args.run_timeout)
        teacher_ckpt = random_checkpoint(work, case["teacher_builder"], dtype, args.run_timeout) \
            if case.get("teacher_builder") else None
        shapes = {v["name"]: run_shape(case, v, args.steps, args.window) for _, v in runs}
        data_file = None
        if case["data"]["kind"] == "instruct":  # one file for the case: the same rows on both sides
            # enough for every run, with a margin: a pack holds ~seq_len / (6 x median_words + 200)
            # rows (~6 bytes a word, a token a byte, ~200 for alpaca's prompt)
            per_seq = max(1, case["seq_len"] // (6 * case["median_words"] + 200))
            rows = max(int(1.5 * (steps + 2) * batch * ga * case.get("nproc", 1) * per_seq) + 64
                       for batch, ga, _, _, steps in shapes.values())
            data_file = work / f"instruct_{case['median_words']}w_{rows}.json"
            if not data_file.exists():
                run([sys.executable, "scripts/make_instruction_data.py", "--rows", str(rows), "--median-words",
                     str(case["median_words"]), "--out", str(data_file)], work / "data.log", 120, {})
        for rep, v in runs:
            row = run_variant(name, case, rep, v, shapes[v["name"]], ckpt, data_file, args, overrides,
                              teacher_ckpt)
            result["rows"].append(row)
            print(json.dumps({k: x for k, x in row.items() if k not in ("losses", "overrides", "env")}), flush=True)
            out.write_text(json.dumps(result, indent=1))  # after every run: a timeout keeps the rows
    write_outputs(result, out)


if __name__ == "__main__":
    main()
