"""The GPU scripts' CPU-checkable parts, so that device time is not spent finding their bugs:
every benchmark config of ours is valid, a shipped config keeps everything but the bench's
pointers, the summary's arithmetic, the run plans of scripts/gpu_session.sh, the bench hooks."""

import json
import os
import re
import shlex
import shutil
import subprocess
import sys

import pytest
import yaml
from script_loader import SCRIPTS, load_script


def _bench():
    return load_script("bench_recipes")


def test_every_bench_variant_of_ours_is_a_valid_config(tmp_path, capsys):
    from tune_recipes._cli.main import main

    bench = _bench()
    invalid, checked = [], 0
    for case_name, case in bench.CASES.items():
        for variant in case["variants"]:
            if variant["side"] != "ours":  # stock runs torchtune's own recipe file
                continue
            path = tmp_path / f"{case_name}_{variant['name']}.yaml".replace("/", "_").replace(":", "_")
            bench.write_config(path, case, variant, tmp_path / "ckpt", tmp_path / path.stem, tmp_path / "d.json",
                               teacher_ckpt=tmp_path / "teacher_ckpt")
            # --recipe: the top-level keys are checked against the recipe the case runs;
            # --portable: not the paths or the device (a CPU machine, no checkpoint). It also
            # skips a component whose package is not installed, so that is asserted apart.
            rc = main(["validate", "--portable", str(path), "--recipe", case["recipe"]])
            printed = capsys.readouterr()
            checked += 1
            if rc != 0 or "not checked here" in printed.out:
                invalid.append((case_name, variant["name"], (printed.err + printed.out)[-300:]))
    assert not invalid
    assert checked >= 25  # the headline cases and every shipped single-device config with a twin


@pytest.mark.parametrize("config", ["llama3_1/8B_lora_single_device", "llama3_2/8B_to_1B_kd_single_device"])
@pytest.mark.parametrize("side", ["stock", "ours"])
def test_a_shipped_config_runs_as_shipped_but_for_the_benchs_files(side, config, tmp_path):
    """Shipped mode changes only what points at files (checkpoint, teacher checkpoint, tokenizer,
    data, output) and the step limit; everything that sets the speed (batch, GA, compile, AC,
    loss, optimizer, dtype, packing) stays as the config ships it, on either side. The
    distillation config's twin in torchtune has another name, and its teacher a checkpoint of its
    own."""
    bench = _bench()
    case = bench.CASES[f"shipped:{config}"]
    assert "site-packages" in str(case["shipped"]["stock"]) or "recipes/configs" in str(case["shipped"]["stock"])
    shipped = yaml.safe_load(case["shipped"][side].read_text())
    variant = next(v for v in case["variants"] if v["side"] == side)
    cfg = bench.write_config(tmp_path / "c.yaml", case, variant, tmp_path / "ckpt", tmp_path / "out",
                             tmp_path / "rows.json", steps=7, teacher_ckpt=tmp_path / "teacher")
    pointers = {"output_dir", "checkpointer", "teacher_checkpointer", "tokenizer", "dataset",
                "max_steps_per_epoch", "epochs", "resume_from_checkpoint"}
    if "teacher_model" in shipped:
        assert case["teacher_builder"] == "torchtune.models.llama3_1.llama3_1_8b"
        assert case["builder"] == "torchtune.models.llama3_2.llama3_2_1b"
        assert cfg["teacher_checkpointer"]["checkpoint_dir"] == str(tmp_path / "teacher")
        assert cfg["teacher_checkpointer"]["checkpoint_files"] == ["model.safetensors"]
        with pytest.raises(ValueError, match="no teacher checkpoint"):
            bench.write_config(tmp_path / "d.yaml", case, variant, tmp_path / "ckpt", tmp_path / "out")
    else:
        assert "teacher_builder" not in case
    assert {k: v for k, v in cfg.items() if k not in pointers} == {k: v for k, v in shipped.items() if k not in pointers}
    assert cfg["max_steps_per_epoch"] == 7 and cfg["output_dir"] == str(tmp_path / "out")
    assert cfg["checkpointer"]["model_type"] == shipped["checkpointer"]["model_type"]
    assert cfg["checkpointer"]["checkpoint_dir"] == str(tmp_path / "ckpt")
    assert cfg["dataset"] == {"_component_": "torchtune.datasets.alpaca_dataset", "source": "json",
                              "data_files": str(tmp_path / "rows.json"), "split": "train",
                              "packed": bool(shipped["dataset"].get("packed", False))}
    assert cfg["tokenizer"]["max_seq_len"] == shipped["tokenizer"].get("max_seq_len")
    assert yaml.safe_load((tmp_path / "c.yaml").read_text()) == cfg


def test_the_shipped_levers_change_only_what_they_name(tmp_path):
    """Each lever of a shipped case is its config as shipped but for what its name trades: the
    allocator setting (an environment variable), the optimizer (full fine-tunes), or the split
    of a step's examples into micro-batches."""
    bench = _bench()

    def config(case_name, variant_name):
        case = bench.CASES[case_name]
        variant = next(v for v in case["variants"] if v["name"] == variant_name)
        return variant, bench.write_config(tmp_path / "c.yaml", case, variant, tmp_path / "ckpt",
                                           tmp_path / "out", tmp_path / "rows.json", steps=7)

    def differs(case_name, variant_name):
        _, ours = config(case_name, "ours")
        variant, cfg = config(case_name, variant_name)
        return variant, {k: (ours.get(k), cfg.get(k)) for k in ours.keys() | cfg.keys() if ours.get(k) != cfg.get(k)}

    variant, diff = differs("shipped:qwen2_5/1.5B_lora_single_device", "ours_default_allocator")
    assert diff == {} and variant["env"] == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}
    _, diff = differs("shipped:qwen2_5/1.5B_lora_single_device", "ours_double_batch")
    assert diff == {"batch_size": (2, 4), "gradient_accumulation_steps": (8, 4)}  # 16 examples a step
    _, diff = differs("shipped:qwen2_5/1.5B_lora_single_device", "ours_compiled")
    assert diff == {"compile": (False, True)}
    _, diff = differs("shipped:qwen2_5/1.5B_lora_single_device", "ours_packed")
    assert set(diff) == {"dataset"}  # the key a header names, alone: padding_free as shipped
    assert diff["dataset"][1] == {**diff["dataset"][0], "packed": True}  # the bench's rows, packed
    for shipped_name in ("llama3_2/3B_full_single_device", "llama3_1/8B_full_single_device"):  # AdamW8bit
        shipped = yaml.safe_load((SCRIPTS.parent / "configs" / f"{shipped_name}.yaml").read_text())
        assert shipped["optimizer"]["_component_"] == "tune_recipes.optim.AdamW8bit", shipped_name
        _, diff = differs(f"shipped:{shipped_name}", "ours_bf16_adamw")
        assert set(diff) == {"optimizer", "optimizer_in_bwd", "clip_grad_norm"}, shipped_name
        assert diff["clip_grad_norm"] == (None, "inf")
        assert diff["optimizer"][1] == {"_component_": "torch.optim.AdamW", "lr": diff["optimizer"][0]["lr"], "fused": True}
        assert diff["optimizer_in_bwd"] == (True, False)
    names = {v["name"] for v in bench.CASES["shipped:llama3_2/1B_full_single_device"]["variants"]}
    assert "ours_8bit_in_bwd" in names and "ours_bf16_adamw" not in names  # bf16 AdamW as shipped


def test_a_run_shape_counts_whole_optimizer_steps_and_fetches_past_the_window():
    """The clock's warmup and window are rounded up to whole optimizer steps (a window that
    ends inside a step would time part of its optimizer work), and the run has one step more,
    so the batch where the window closes is fetched."""
    bench = _bench()
    shipped = bench.CASES["shipped:llama3_1/8B_lora_single_device"]
    ga = yaml.safe_load(shipped["shipped"]["stock"].read_text())["gradient_accumulation_steps"]
    batch, got_ga, warmup, window, steps = bench.run_shape(shipped, shipped["variants"][0], None)
    assert got_ga == ga and warmup % ga == 0 and window % ga == 0 and warmup >= 5 and window >= 20
    assert steps * ga >= warmup + window + 1
    case = bench.CASES["lora_8b_padded"]
    assert bench.run_shape(case, case["variants"][0], None) == (2, 1, 5, 20, 26)
    case = bench.CASES["full_1b_packed"]  # the published packed table's window
    assert bench.run_shape(case, case["variants"][0], None) == (4, 1, 20, 40, 61)
    assert bench.run_shape(case, case["variants"][0], 220)[-1] == 220  # --steps: a loss curve
    # --window: the clock's window instead of the case's, whole optimizer steps, one step more
    assert bench.run_shape(case, case["variants"][0], None, 60) == (4, 1, 20, 60, 81)
    _, ga, _, window, steps = bench.run_shape(shipped, shipped["variants"][0], None, 30)
    assert window % ga == 0 and window >= 30 and steps == (warmup + window) // ga + 1


def _row(variant, side, tps, alloc, reserved, rep=0, losses=None, **kw):
    return dict(case="full_1b", variant=variant, side=side, rep=rep, tokens_per_s=tps, label_tokens_per_s=tps / 2,
                peak_alloc_gib=alloc, peak_reserved_gib=reserved, params=1e9, lora=False, ac=False,
                losses=losses or [2.0, 1.0], **kw)


def test_the_summary_averages_reps_takes_ratios_to_stock_and_the_mfu(tmp_path, capsys):
    bench = _bench()
    rows = [_row("stock_best", "stock", 100.0, 20.0, 22.0), _row("stock_best", "stock", 300.0, 21.0, 24.0, rep=1),
            _row("ours_best", "ours", 260.0, 15.0, 18.0, losses=[2.0, 1.1]),
            dict(case="full_1b", variant="ours_best", side="ours", rep=1, error="boom\n[failed: timeout after 1 s]")]
    lines = {s["variant"]: s for s in bench.aggregate("full_1b", bench.CASES["full_1b"], rows)}
    stock, ours = lines["stock_best"], lines["ours_best"]
    assert stock["tokens_per_s"] == 200 and stock["each"] == [100, 300] and stock["label_tokens_per_s"] == 100
    assert stock["peak_alloc_gib"] == 21.0 and stock["peak_reserved_gib"] == 24.0  # the largest of the reps
    assert ours["runs"] == 1 and ours["failed_runs"] == 1
    assert ours["speed_vs_stock"] == 1.3 and ours["alloc_vs_stock"] == round(15 / 21, 3)
    assert ours["label_speed_vs_stock"] == 1.3  # label tokens: 130 against stock's 100
    assert ours["reserved_vs_stock"] == 0.75
    assert ours["mfu"] == round(6 * 1e9 * 260 / 790e12, 3)  # 6 x params x tokens/s over 790 TFLOP/s
    lora = dict(rows[2], lora=True, ac=True)
    assert bench.aggregate("full_1b", bench.CASES["full_1b"], [lora])[0]["mfu"] == round(6 * 1e9 * 260 / 790e12, 3)
    student = dict(lora, teacher_params=8e9)  # a distillation step: the teacher's forward added
    assert bench.aggregate("full_1b", bench.CASES["full_1b"], [student])[0]["mfu"] == \
        round((6 * 1e9 + 2 * 8e9) * 260 / 790e12, 3)
    (gap,) = bench.loss_gaps(rows)
    assert gap["variant"] == "ours_best" and gap["max_rel_diff"] == 0.1 and gap["last50_gap_rel"] == round(1.55 / 1.5 - 1, 5)

    out = tmp_path / "r.json"
    bench.write_outputs({"meta": {"gpu": "cpu", "torch": "x", "date": "d"}, "rows": rows}, out)
    table = out.with_suffix(".md").read_text()
    assert "| full_1b | ours: README fastest settings | 260 (260; 1 failed) | 130 | 1.3 | 1.3 | 15.0 | 18.0 |" in table
    assert "loss full_1b ours_best rep 0 vs stock over 2 steps: max rel diff 0.1, last-50 mean gap +3.333%" in table
    assert out.with_suffix(".png").exists() and json.loads(out.read_text())["summary"][1]["speed_vs_stock"] == 1.3


def test_paged_optimizer_states_count_in_the_summarys_peaks():
    """A run's paged_gib (bitsandbytes' paged states, read by the clock) is added to its peaks."""
    bench = _bench()
    rows = [_row("stock_best", "stock", 100.0, 10.0, 12.0, paged_gib=6.0), _row("ours_best", "ours", 200.0, 15.0, 16.0)]
    lines = {s["variant"]: s for s in bench.aggregate("full_1b", bench.CASES["full_1b"], rows)}
    assert lines["stock_best"]["peak_alloc_gib"] == 16.0 and lines["stock_best"]["peak_reserved_gib"] == 18.0
    assert lines["ours_best"]["alloc_vs_stock"] == round(15 / 16, 3)


def test_merged_runs_number_each_variants_reps_on():
    bench = _bench()
    a = [_row("stock_best", "stock", 1, 1, 1), _row("stock_best", "stock", 1, 1, 1, rep=1)]
    b = [_row("stock_best", "stock", 1, 1, 1), _row("ours_best", "ours", 1, 1, 1)]
    assert [(r["variant"], r["rep"]) for r in bench.merge_rows([a, b])] == [
        ("stock_best", 0), ("stock_best", 1), ("stock_best", 2), ("ours_best", 0)]


def test_a_failed_runs_table_cell_shows_the_exception_from_its_start_and_the_reason():
    """The error cell keeps the message a reader needs (the exception line, not the tail of a
    long one) and the reason, and escapes pipes that would split the Markdown row."""
    bench = _bench()
    error = ("[rank0]: Traceback (most recent call last):\n[rank0]:   File \"x.py\", line 1\n"
             "[rank0]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB | "
             + "y" * 300 + "\n[failed: out of memory (exit 1)]")
    cell = bench.error_cell(error)
    assert cell.startswith("torch.OutOfMemoryError: CUDA out of memory.") and "\\|" in cell
    assert cell.endswith("[failed: out of memory (exit 1)]") and len(cell) < 400
    # through the summary a run's failure goes through (it keeps the error whole for the cell)
    rows = [dict(case="full_1b", variant="ours_best", side="ours", rep=0, error=error)]
    summary = bench.aggregate("full_1b", bench.CASES["full_1b"], rows)
    assert "| error: torch.OutOfMemoryError: CUDA out of memory." in bench.table({"summary": summary, "loss_gaps": []})


def test_a_failed_run_keeps_its_reason_last(tmp_path):
    """A row keeps only the error's tail: the reason (timeout, out of memory) goes last."""
    bench = _bench()
    log = tmp_path / "run.log"
    with pytest.raises(RuntimeError) as err:
        bench.run([sys.executable, "-c", "print('x' * 5000); import time; time.sleep(5)"], log, 1, {})
    assert str(err.value)[-1500:].rstrip().endswith("[failed: timeout after 1 s]")
    oom = "import sys; print('torch.OutOfMemoryError: CUDA out of memory. Tried'); sys.exit(1)"
    with pytest.raises(RuntimeError) as err:
        bench.run([sys.executable, "-c", oom], log, 30, {})
    assert str(err.value).rstrip().endswith("[failed: out of memory (exit 1)]")


def test_a_finished_runs_saved_checkpoints_are_dropped_and_its_metrics_kept(tmp_path):
    """A run's end-of-epoch model and recipe state go (a few 8B ones fill the GPU machine's
    disk); what the benchmark reads stays."""
    bench = _bench()
    kept = [tmp_path / "metrics.jsonl", tmp_path / "epoch_0" / "config.json", tmp_path / "log.txt"]
    dropped = [tmp_path / "epoch_0" / "model-00001-of-00004.safetensors", tmp_path / "recipe_state" / "recipe_state.pt",
               tmp_path / "epoch_0" / "adapter_model.bin"]
    for path in kept + dropped:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("x")
    bench.drop_saved_weights(tmp_path)
    assert [p.exists() for p in kept] == [True] * 3 and [p.exists() for p in dropped] == [False] * 3


def test_a_preset_runs_each_listed_variant_every_repetition_in_alternating_order():
    bench = _bench()
    for preset, selection in bench.PRESETS.items():
        for case_name, names in selection.items():
            order = [(rep, v["name"]) for rep, v in bench.schedule(bench.CASES[case_name], 2, names)]
            assert order == [(0, n) for n in names] + [(1, n) for n in reversed(names)], (preset, case_name)
    assert len(bench.PRESETS["shipped"]) >= 7
    with pytest.raises(ValueError, match="stock_bset"):
        bench.schedule(bench.CASES["full_1b"], 1, ["stock_bset"])
    # without a preset: heads every repetition, each lever once after the first repetition's heads
    case = bench.CASES["full_1b_packed"]
    order = [(rep, v["name"]) for rep, v in bench.schedule(case, 2)]
    assert order[:2] == [(0, "stock_best"), (0, "ours_best")] and order[-2:] == [(1, "ours_best"), (1, "stock_best")]
    assert len(order) == 4 + len(case["variants"]) - 2


@pytest.mark.parametrize("argv, message", [
    (["--preset", "claim", "--cases", "full_1b,full_1b_packed"], "['full_1b_packed'] not in --preset claim"),
    (["--cases", "full_1b,ful_8b"], "no case(s) ['ful_8b']"),
    (["--cases", "full_1b", "--only", "stock_best,ours_fp8_ain_embcpu"], "['ours_fp8_ain_embcpu'] not run"),
    (["--cases", "tiny_cpu", "--set", "compile"], "--set 'compile': expected NAME=VALUE"),
    (["--cases", "tiny_cpu", "--window", "0"], "--window 0: expected at least 1"),
])
def test_a_bad_selection_is_refused_before_anything_is_built(argv, message, monkeypatch, capsys, tmp_path):
    bench = _bench()
    monkeypatch.setattr("sys.argv", ["bench_recipes.py", *argv, "--work", str(tmp_path / "w"),
                                     "--out", str(tmp_path / "r.json")])
    with pytest.raises(SystemExit):
        bench.main()
    assert message in capsys.readouterr().err
    assert not (tmp_path / "w").exists()  # nothing built, nothing run


def test_the_results_name_the_code_commit(monkeypatch):
    """The GPU machine's copy of the tree has no .git: BENCH_COMMIT, set in the command, names
    the commit; here, in a clone, git's HEAD does."""
    bench = _bench()
    monkeypatch.setenv("BENCH_COMMIT", "abc1234")
    assert bench.versions()["commit"] == "abc1234"
    monkeypatch.delenv("BENCH_COMMIT")
    if shutil.which("git") is None:
        pytest.skip("no git")
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=bench.REPO, capture_output=True,
                          text=True).stdout.strip()
    if not head:
        pytest.skip("not a git checkout")
    assert bench.code_commit().split("+")[0] == head


def _gpu_script_commands(script: str):
    """The argv (after the script's name) of each scripts/<script> call in gpu_session.sh, as the
    shell would pass it: continuations joined, the step's defaults (``${REPS:-1}``) substituted."""
    text = (SCRIPTS / "gpu_session.sh").read_text().replace("\\\n", " ")
    found = []
    for line in text.splitlines():
        if not re.match(rf"\s*(\w+\)\s+)?{script} ", line):  # a call, after its step's label
            continue
        words = shlex.split(line.replace(";;", ""), comments=True)
        words = words[1:] if words[0].endswith(")") else words
        if words[:1] == [script]:
            found.append([re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", w) for w in words[2:]])  # defaults
    return found


def test_every_benchmark_step_of_the_gpu_script_plans_runs():
    """Device time is not spent finding a typo: every bench step of gpu_session.sh parses, and
    plans at least one run of each case it names."""
    bench = _bench()
    commands = _gpu_script_commands("bench")
    assert len(commands) >= 10
    for argv in commands:
        ap = bench.build_parser()
        args = ap.parse_args(argv)
        plan = bench.plan_runs(args, ap)
        assert plan and all(plan.values()), argv
        if args.cases:
            assert set(plan) == set(args.cases.split(",")), argv


def test_only_runs_each_named_variant_every_repetition_alternating():
    """An A/B of a lever (``--only ours,ours_default_allocator --reps 2``) runs both sides twice,
    in alternating order; without --only a lever runs once."""
    bench = _bench()
    ap = bench.build_parser()
    case = "shipped:qwen2_5/1.5B_lora_single_device"
    args = ap.parse_args(["--cases", case, "--only", "ours,ours_default_allocator,stock", "--reps", "2"])
    runs = [(rep, v["name"]) for rep, v in bench.plan_runs(args, ap)[case]]
    assert runs == [(0, "stock"), (0, "ours"), (0, "ours_default_allocator"),
                    (1, "ours_default_allocator"), (1, "ours"), (1, "stock")]
    args = ap.parse_args(["--cases", case, "--reps", "2"])
    names = [v["name"] for _, v in bench.plan_runs(args, ap)[case]]
    assert names.count("ours") == 2 and names.count("ours_default_allocator") == 1


def test_every_acceptance_step_of_the_gpu_script_selects_configs_of_its_kind():
    from fnmatch import fnmatchcase

    from tune_recipes._cli import registry

    acceptance = load_script("gpu_acceptance")
    steps = _gpu_script_commands("accept")
    assert {kind for kind, _ in steps} == {"single", "distributed"}
    covered = {"single": set(), "distributed": set()}
    for kind, patterns in steps:
        chosen = [c for c in registry.list_configs() if any(fnmatchcase(c, p) for p in patterns.split(","))
                  and (registry.recipe_for_config(c) in acceptance.DISTRIBUTED) == (kind == "distributed")]
        assert chosen, (kind, patterns)
        covered[kind] |= set(chosen)
    every = [c for c in registry.list_configs() if not c.startswith("tiny/")]
    assert covered["single"] | covered["distributed"] == set(every)  # every shipped config, once a pass


def test_the_gpu_script_parses():
    if shutil.which("bash") is None:
        pytest.skip("no bash")
    assert subprocess.run(["bash", "-n", str(SCRIPTS / "gpu_session.sh")]).returncode == 0


def test_acceptance_quantize_status_deletes_the_checkpoint_unless_saved(tmp_path):
    """An acceptance pass deletes each quantized checkpoint once checked (an 8B one is 5.2 GiB of
    the GPU machine's 64 GiB disk), keeps it with --save, and fails a run that wrote none."""
    acceptance = load_script("gpu_acceptance")
    written = tmp_path / "model-8da4w.pt"
    written.write_bytes(b"x")
    assert acceptance.quantize_status(tmp_path, 0, "", keep=True) == "ok"
    assert written.exists()
    assert acceptance.quantize_status(tmp_path, 0, "", keep=False) == "ok"
    assert not written.exists()
    status = acceptance.quantize_status(tmp_path, 0, "RuntimeError: nothing written", keep=False)
    assert status.startswith("failed") and "nothing written" in status
    written.write_bytes(b"x")
    status = acceptance.quantize_status(tmp_path, 1, "OSError: [Errno 28] No space left", keep=False)
    assert "No space left" in status and written.exists()


def test_instruction_rows_spread_around_the_median_and_keep_their_prefix(tmp_path):
    data = load_script("make_instruction_data")
    rows = data.instruction_rows(400, 90)
    words = sorted(sum(len(r[k].split()) for k in ("instruction", "input", "output")) for r in rows)
    assert 50 <= words[200] <= 110 and words[20] < 45 and words[380] > 150  # log-normal spread
    assert {tuple(r) for r in rows} == {("instruction", "input", "output")}
    assert 0.35 < sum(not r["input"] for r in rows) / 400 < 0.65
    assert data.instruction_rows(50, 90) == rows[:50]  # the same first rows whatever the count
    data.main(["--rows", "3", "--median-words", "90", "--out", str(tmp_path / "d.json")])
    assert json.loads((tmp_path / "d.json").read_text()) == rows[:3]


def test_the_memory_cap_hook_applies_to_ours_and_stocks_training_process_only(tmp_path):
    """The hooks must reach both sides' training processes (ours through ``-m tune_recipes``,
    stock through its recipe file) and nothing else (inductor's workers): a script in a
    ``recipes`` folder counts, another does not."""
    probe = "import sys; print('torch' in sys.modules)"
    (tmp_path / "recipes").mkdir()
    (tmp_path / "recipes" / "lora_finetune_single_device.py").write_text(probe)
    (tmp_path / "other.py").write_text(probe)
    env = {**os.environ, "PYTHONPATH": str(SCRIPTS / "bench_hooks"), "BENCH_MEMORY_CAP_GIB": "19.5"}
    seen = {}
    for name in ("recipes/lora_finetune_single_device.py", "other.py"):
        out = subprocess.run([sys.executable, str(tmp_path / name)], env=env, capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        seen[name] = out.stdout.strip()
    assert seen == {"recipes/lora_finetune_single_device.py": "True", "other.py": "False"}


def _run_hook_probe(code: str, **hook_env):
    """``code`` run in a fresh Python whose argv names tune_recipes (the hooks apply to the
    recipe's process only), scripts/bench_hooks first on its path, ``hook_env`` set and CUDA
    hidden (torchtune would make packed masks on a GPU); its output, after it exited cleanly."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SCRIPTS / "bench_hooks"), str(SCRIPTS.parent)]),
           "CUDA_VISIBLE_DEVICES": "", **hook_env}
    out = subprocess.run([sys.executable, "-c", code, "tune_recipes"], env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return out


_GQA_PROBE = """
import torch
from tune_recipes.models.tiny import tiny_llama3

gqa_flags = []


def recording_backend(gm, example_inputs):  # what the compiled graph calls, run eagerly
    gqa_flags.extend(n.kwargs.get("enable_gqa", False) for n in gm.graph.nodes
                     if "scaled_dot_product_attention" in str(n.target))
    return gm.forward


torch.manual_seed(0)
model = tiny_llama3()
tokens = torch.randint(0, 272, (2, 64))
out = torch.compile(model, backend=recording_backend)(tokens)
out.pow(2).mean().backward()
grads = {n: p.grad.clone() for n, p in model.named_parameters()}
model.zero_grad()
ref = model(tokens)  # eagerly: torchtune's expanded copies
ref.pow(2).mean().backward()
print("gqa", sum(gqa_flags), "of", len(gqa_flags))
print("logits_rel", float((out - ref).abs().max() / ref.abs().max()))
print("grad_rel", max(float((grads[n] - p.grad).norm() / p.grad.norm()) for n, p in model.named_parameters()))
"""


def test_the_sdpa_gqa_hook_hands_unexpanded_kv_to_attention_with_the_same_gradients():
    """BENCH_SDPA_GQA=1: in the compiled graph, each layer's SDPA takes k/v with the tiny
    model's 2 kv heads (``enable_gqa``) instead of torchtune's copies expanded to its 8 query
    heads; logits and every parameter's gradient equal the eager model's (fp32, 1e-6 relative)."""
    out = _run_hook_probe(_GQA_PROBE, BENCH_SDPA_GQA="1")
    assert "gqa 2 of 2" in out.stdout, out.stdout  # both layers
    values = {line.split()[0]: float(line.split()[1]) for line in out.stdout.splitlines()
              if line.startswith(("logits_rel", "grad_rel"))}
    assert values["logits_rel"] < 1e-6 and values["grad_rel"] < 1e-6, out.stdout


_PAD_PROBE = """
import torch
import torchtune.data
from torchtune.config._utils import _get_component_from_path

rows = [{"tokens": [5] * n, "labels": [6] * n} for n in (3, 130)]
collate = _get_component_from_path("torchtune.data.padded_collate_sft")  # as both recipes resolve it
batch = collate(rows, padding_idx=0, ignore_idx=-100)
print("shape", *batch["tokens"].shape)
print("scored", int((batch["labels"] != -100).sum()))
print("cudnn_sdp", torch.backends.cuda.cudnn_sdp_enabled())
from tune_recipes.training.setup import data, recipe

multiple = recipe.padded_batch_multiple("cuda")  # what the recipes' setup asks for on a GPU
assert data.padded_batch_multiple("cuda") == multiple  # and the validation loader's
ours = data.make_collate(rows, pad_id=0, collate_fn="torchtune.data.padded_collate_sft", ignore_index=-100,
                         pad_to_multiple_of=multiple)(rows)
print("ours_shape", *ours["tokens"].shape)
"""


def test_the_padding_and_cudnn_levers_pad_collated_rows_and_turn_cudnn_attention_off():
    """BENCH_PAD_MULTIPLE=128 pads torchtune's collate (both sides resolve it by name) on to 256
    tokens with nothing more scored; BENCH_SDPA_NO_CUDNN=1 turns SDPA's cuDNN backend off;
    without them, neither happens (ours pads to 128-token multiples itself). BENCH_PAD_MULTIPLE=1
    pads ours' batches to the longest row only, as stock's."""
    levers = _run_hook_probe(_PAD_PROBE, BENCH_PAD_MULTIPLE="128", BENCH_SDPA_NO_CUDNN="1").stdout
    assert "shape 2 256" in levers and "scored 133" in levers and "cudnn_sdp False" in levers, levers
    assert "ours_shape 2 256" in levers, levers
    plain = _run_hook_probe(_PAD_PROBE).stdout
    assert "shape 2 130" in plain and "scored 133" in plain and "cudnn_sdp True" in plain, plain
    assert "ours_shape 2 256" in plain, plain
    longest = _run_hook_probe(_PAD_PROBE, BENCH_PAD_MULTIPLE="1").stdout
    assert "shape 2 130" in longest and "ours_shape 2 130" in longest, longest


def test_the_size_oblivious_lever_sets_torchs_config_in_our_recipes_process():
    probe = "import torch.fx.experimental._config as c; print('oblivious', c.backed_size_oblivious)"
    assert "oblivious True" in _run_hook_probe(probe, BENCH_BACKED_SIZE_OBLIVIOUS="1").stdout
    assert "oblivious False" in _run_hook_probe(probe).stdout


# Each lever undoes one change through the name a recipe or setup imports after the
# hook ran: (the lever, a probe printing what that name does, without it, with it).
_EAGER_LEVERS = [
    ("BENCH_AC_NON_REENTRANT",
     "from omegaconf import OmegaConf\n"
     "from tune_recipes.training.setup.activations import checkpoint_reentrant\n"
     "print('result', checkpoint_reentrant(OmegaConf.create({})))", "True", "False"),
    ("BENCH_TORCHTUNE_ROPE",  # the tiny model's two attentions, or none
     "from tune_recipes.models import tiny_llama3\n"
     "from tune_recipes.training.setup import model\n"
     "print('result', model.use_interleaved_rope(tiny_llama3()))", "2", "0"),
    ("BENCH_TORCHTUNE_RMS_NORM",  # the tiny model's five norms, or none
     "from tune_recipes.models import tiny_llama3\n"
     "from tune_recipes.training.setup import model\n"
     "print('result', model.use_fused_rms_norm(tiny_llama3()))", "5", "0"),
    ("BENCH_NF4_TORCHAO",
     "from tune_recipes.training.setup import model\n"
     "print('result', model.use_lean_nf4_dequantization())", "True", "False"),
    ("BENCH_TORCHTUNE_MLP",  # the tiny model's two MLPs, or none
     "from tune_recipes.models import tiny_llama3\n"
     "from tune_recipes.training.setup import model\n"
     "print('result', model.recompute_down_inputs(tiny_llama3()))", "2", "0"),
    ("BENCH_EXPANDED_KV",  # k at 2 of 8 heads: its own 2-head memory, or the 8-head expansion's
     "import torch\n"
     "from tune_recipes.modules import document_attention\n"
     "k = torch.zeros(1, 2, 4, 8).unsqueeze(2).expand(1, 2, 4, 4, 8).flatten(1, 2)\n"
     "print('result', document_attention._one_copy_a_group(k, 2).untyped_storage().nbytes())", "256", "1024"),
]


@pytest.mark.parametrize("lever,probe,without,with_lever", _EAGER_LEVERS, ids=[l[0] for l in _EAGER_LEVERS])
def test_an_eager_lever_reaches_the_name_the_recipe_imports(lever, probe, without, with_lever):
    assert f"result {with_lever}" in _run_hook_probe(probe, **{lever: "1"}).stdout
    assert f"result {without}" in _run_hook_probe(probe).stdout


@pytest.mark.slow
def test_the_tiny_case_runs_both_sides_end_to_end_on_the_same_batches(tmp_path):
    """The CPU dry run, as a user runs it: both CLIs (stock's recipe file, ours through ``python
    -m tune_recipes run``) on the instruction rows, packed, timed by the hook; both sides count
    the same tokens and label tokens in the window (the same batches) and log the same losses."""
    out = tmp_path / "r.json"
    done = subprocess.run([sys.executable, str(SCRIPTS / "bench_recipes.py"), "--cases", "tiny_cpu", "--reps", "1",
                           "--work", str(tmp_path / "w"), "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {r["variant"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"stock_best", "ours_best"} and not [r for r in rows.values() if "error" in r]
    stock, ours = rows["stock_best"], rows["ours_best"]
    assert stock["tokens"] == ours["tokens"] == 4 * 4 * 512  # 4 packs of 512 a batch, batches 2..5
    assert stock["label_tokens"] == ours["label_tokens"] > 0
    assert stock["losses"] == pytest.approx(ours["losses"], rel=1e-4)
    assert "| tiny_cpu | ours: fused CE |" in out.with_suffix(".md").read_text()
    # Each run's saved checkpoints are deleted once read (a few 8B ones fill the GPU machine's
    # disk); its metrics stay, and so does the input checkpoint every run loads.
    work = tmp_path / "w"
    run_dirs = [d for d in work.iterdir() if d.is_dir() and d.name.startswith("tiny_cpu_")]
    assert len(run_dirs) == 2, sorted(p.name for p in work.iterdir())
    for d in run_dirs:
        assert not [p for p in d.rglob("*") if p.suffix in (".safetensors", ".pt", ".bin")], d
    assert (work / "tiny_cpu_ours_best_rep0" / "metrics.jsonl").exists()
    assert list(work.glob("ckpt_*/model.safetensors"))


def test_the_optimizer_host_bench_steps_every_parameter_with_an_optimizer_of_its_own(tmp_path):
    import torch

    bench = load_script("bench_optimizer_host")
    from tune_recipes.models import tiny_llama3

    shapes = bench.parameter_shapes("tune_recipes.models.tiny_llama3")
    assert sorted(shapes) == sorted(tuple(p.shape) for p in tiny_llama3().parameters())
    built, stepped = [], []

    class Spy(torch.optim.SGD):
        def __init__(self, params, lr):
            super().__init__(params, lr=lr)
            built.append(self)
            self.first = self.param_groups[0]["params"][0].detach().clone()

        def step(self, closure=None):
            stepped.append(self)
            return super().step(closure)

    row = bench.time_optimizer(Spy, shapes, "cpu", warmup=2, steps=3, lr=0.5)
    assert row["params"] == len(shapes) == len(built)
    # one parameter an optimizer, each stepped at every warm-up and timed step
    assert [len(o.param_groups[0]["params"]) for o in built] == [1] * len(shapes)
    assert sorted(map(id, stepped)) == sorted(map(id, built * 5))
    assert not any(torch.equal(o.param_groups[0]["params"][0].detach(), o.first) for o in built)
    assert row["host_ms"] > 0 and row["optimizer"].endswith("Spy")

    out = tmp_path / "host.json"
    rows = bench.main(["--model", "tune_recipes.models.tiny_llama3", "--device", "cpu",
                       "--optimizers", "torch.optim.AdamW, torch.optim.SGD", "--passes", "2",
                       "--warmup", "1", "--steps", "1", "--out", str(out)])
    assert [(r["optimizer"], r["pass"]) for r in rows] == [
        ("torch.optim.AdamW", 0), ("torch.optim.SGD", 0), ("torch.optim.AdamW", 1),
        ("torch.optim.SGD", 1)]
    assert json.loads(out.read_text())["rows"] == rows


def test_the_optimizer_host_bench_after_backward_steps_one_optimizer_built_as_the_recipes_build_it(monkeypatch):
    """``--after-backward``: one optimizer over every parameter, from the recipes' own
    ``build_optimizer`` (``--compiled``: as ``compile_optimizer_step: True`` builds it), stepped
    at every warm-up and timed step."""
    import torch

    import tune_recipes.training.step.optim as optim

    bench = load_script("bench_optimizer_host")
    shapes = bench.parameter_shapes("tune_recipes.models.tiny_llama3")
    built, real_build = [], optim.build_optimizer

    def spy(cfg, model, **kwargs):
        opt = real_build(cfg, model, **kwargs)
        built.append((kwargs, opt, [p.detach().clone() for p in model.parameters()]))
        return opt

    monkeypatch.setattr(optim, "build_optimizer", spy)
    row = bench.time_optimizer(torch.optim.AdamW, shapes, "cpu", warmup=1, steps=2, lr=0.5,
                               after_backward=True)
    [(kwargs, opt, before)] = built
    assert kwargs == {"compile_step": False} and row["mode"] == "after backward"
    assert len(opt.param_groups[0]["params"]) == row["params"] == len(shapes)
    assert all(not torch.equal(p.detach(), b) for p, b in zip(opt.param_groups[0]["params"], before))
    assert all(float(s["step"]) == 3 for s in opt.state.values())  # 1 warm-up + 2 timed steps
    with pytest.raises(SystemExit, match="--optimizers torch.optim.SGD: compile_optimizer_step=True"):
        bench.main(["--device", "cpu", "--model", "tune_recipes.models.tiny_llama3", "--optimizers",
                    "torch.optim.SGD", "--after-backward", "--compiled"])


@pytest.mark.parametrize("argv,named", [
    (["--optimizers", "torch.optim.NoSuchAdam"], "--optimizers torch.optim.NoSuchAdam: cannot import"),
    (["--optimizers", ","], "--optimizers ',': name at least one"),
    (["--optimizers", "torch.nn.Linear"], "--optimizers torch.nn.Linear: not a torch.optim.Optimizer"),
    (["--model", "no_such_module.builder"], "--model no_such_module.builder: cannot import"),
    (["--model", "torch.nn.Linear"], "--model torch.nn.Linear: not a model builder"),
    (["--lr", "-1"], "--lr -1.0: expected a positive"),
    (["--steps", "0"], "--steps 0: expected at least 1"),
    (["--device", "foo"], "--device foo:"),
    (["--out", "{tmp}/no_folder/x.json"], "its folder does not exist"),
    (["--compiled"], "--compiled: only with --after-backward"),
])
def test_the_optimizer_host_bench_names_a_bad_flag_before_measuring(argv, named, tmp_path, capsys):
    bench = load_script("bench_optimizer_host")
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    with pytest.raises(SystemExit) as exit_:
        bench.main(["--device", "cpu", "--model", "tune_recipes.models.tiny_llama3", *argv])
    said = f"{exit_.value.code} {capsys.readouterr().err}"
    assert named in said, said


def test_pack_padding_counts_what_the_padding_free_packs_leave_out(tmp_path):
    """scripts/pack_padding.py's padding share is the share of packed tokens that packs laid end
    to end without their padding (the recipes' collate) no longer hold."""
    import torch
    from torchtune.datasets import alpaca_dataset

    from tune_recipes.data import tiny_tokenizer
    from tune_recipes.data.collate import packed_padding_free_collate

    rows = tmp_path / "rows.json"
    load_script("make_instruction_data").main(["--rows", "120", "--median-words", "20", "--out", str(rows)])
    stats = load_script("pack_padding").pack_padding(str(rows), seq_len=512)
    packs = alpaca_dataset(tiny_tokenizer(max_seq_len=512), source="json", data_files=str(rows),
                           split="train", packed=True)
    kept = packed_padding_free_collate(list(packs), pad_to_multiple_of=1)["tokens"].numel()
    assert stats["packs"] == len(packs) > 1
    assert 0 < stats["padding_share"] < 0.5
    assert abs(stats["padding_share"] - (1 - kept / (len(packs) * 512))) < 1e-12
    assert torch.isclose(torch.tensor(stats["padding_a_pack"] * stats["packs"]),
                         torch.tensor(float(len(packs) * 512 - kept)))


def test_the_host_samples_report_lists_each_thread_by_its_shares(tmp_path, capsys):
    """scripts/host_samples.py: the sampled rows of a bench JSON, each thread's functions by their
    share of the window, the median host step and fetch; a JSON without samples is an error."""
    sys.path.insert(0, str(SCRIPTS))
    import host_samples

    sampled = {"variant": "ours_host_samples", "rep": 0, "host_step_seconds": [0.04, 0.05, 0.03, 0.04],
               "host_fetch_seconds": [0.001, 0.002, 0.003, 0.002],
               "host_samples": {"samples": 50, "seconds": 0.12, "interval_s": 0.001, "threads": {
                   "main": {"seconds": 0.12, "inclusive": [["step/driver.py:367 backward", 0.5]],
                            "leaf": [["autograd/graph.py:966 _engine_run_backward", 0.5]]}}}}
    path = tmp_path / "b.json"
    path.write_text(json.dumps({"meta": {"gpu": "H100", "commit": "abc1234"},
                                "rows": [{"variant": "ours_best"}, sampled]}))
    assert host_samples.main([str(path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("# gpu H100, commit abc1234\n")
    assert "ours_host_samples" in out and "ours_best" not in out
    assert "median host step 40.0 ms, median loader time 2.00 ms" in out
    assert " 50.0%  step/driver.py:367 backward" in out
    path.write_text(json.dumps({"rows": [{"variant": "ours_best"}]}))
    assert host_samples.main([str(path)]) == 1


def test_lora_update_seen_measures_what_each_eager_precision_keeps():
    """scripts/lora_update_seen.py: fp32's forward keeps the whole adapter change at every LoRA
    output and sees fp64's loss change (its reference is sound); bf16's eager forward, which
    rounds the base output before adding the adapter's, keeps visibly less of a small step."""
    proc = subprocess.run([sys.executable, str(SCRIPTS / "lora_update_seen.py"), "--small", "--no-compile",
                           "--layers", "1", "--seq-len", "64", "--vocab", "512", "--lr", "3e-4", "--seeds", "2"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    means = {r.split("|")[1].strip(): float(r.split("|")[2]) for r in proc.stdout.splitlines()
             if r.startswith("| ") and "---" not in r and "mean" not in r}
    assert abs(means["fp32 eager: kept at the LoRA outputs"] - 1) < 1e-4
    assert abs(means["fp32 eager: loss change / fp64's"] - 1) < 0.01
    assert means["bf16 eager: kept at the LoRA outputs"] < 0.95
    assert means["fp64 loss change"] < 0  # a step down the gradient lowers the loss
