"""The GPU scripts' CPU-checkable parts, so that device time is not spent finding their bugs:
every bench_recipes.py variant of ours is a valid config, and memory_peak.py replays an
allocation trace to the right peak and names what is live there."""

import pickle
import shlex
import shutil
import subprocess

import pytest
from script_loader import SCRIPTS, load_script



_module = load_script


def test_every_bench_variant_of_ours_is_a_valid_config(tmp_path, capsys):
    from tune_recipes._cli.main import main

    bench = _module("bench_recipes")
    invalid = []
    for case_name, case in bench.CASES.items():
        for variant in case["variants"]:
            if variant["side"] != "ours":  # stock runs torchtune's own recipe file
                continue
            path = tmp_path / f"{case_name}_{variant['name']}.yaml"
            bench.write_config(path, case, variant, tmp_path / "ckpt", tmp_path / path.stem)
            # --recipe: the top-level keys are checked against the recipe the case runs;
            # --portable: not the paths or the device (a CPU machine, no checkpoint). It also
            # skips a component whose package is not installed, so that is asserted apart.
            rc = main(["validate", "--portable", str(path), "--recipe", case["recipe"]])
            printed = capsys.readouterr()
            if rc != 0 or "not checked here" in printed.out:
                invalid.append((case_name, variant["name"], (printed.err + printed.out)[-300:]))
    assert not invalid


def _event(action, addr, size, filename="", line=0):
    frames = [{"filename": "/site-packages/torch/nn/modules/module.py", "line": 1, "name": "_call_impl"}]
    if filename:
        frames.insert(1, {"filename": filename, "line": line, "name": "f"})
    return {"action": action, "addr": addr, "size": size, "frames": frames}


def test_memory_peak_replays_to_the_peak_and_groups_the_live_blocks(tmp_path, capsys):
    mib = 2 ** 20
    trace = [
        {"action": "segment_alloc", "addr": 0, "size": 512 * mib, "frames": []},  # reserved, not allocated
        _event("alloc", 1, 100 * mib, "/work/optim.py", 10),
        _event("alloc", 2, 50 * mib, "/work/model.py", 20),
        _event("alloc", 3, 50 * mib, "/work/model.py", 20),
        _event("free_requested", 2, 50 * mib),      # the allocated bytes drop here...
        _event("free_completed", 2, 50 * mib),      # ...not again here
        _event("alloc", 4, 120 * mib, "/work/loss.py", 30),   # the peak: 100 + 50 + 120
        _event("free_requested", 4, 120 * mib),
        _event("alloc", 5, 60 * mib, "/work/loss.py", 30),
    ]
    path = tmp_path / "snap.pickle"
    path.write_bytes(pickle.dumps({"device_traces": [trace], "segments": []}))
    mod = _module("memory_peak")
    peak, at, live = mod.replay(trace)
    assert (peak, at) == (270 * mib, 6)
    assert sorted(live) == [1, 3, 4]
    import sys

    argv, sys.argv = sys.argv, ["memory_peak.py", str(path)]
    try:
        mod.main()
    finally:
        sys.argv = argv
    out = capsys.readouterr().out
    assert "replayed peak 0.264 GiB at event 6" in out
    # Grouped by the innermost frame outside torch, largest first.
    lines = [l for l in out.splitlines() if l.strip().startswith("0.")]
    assert [l.split()[2] for l in lines[:3]] == ["loss.py:30", "optim.py:10", "model.py:20"]


def test_memory_peak_says_when_the_trace_does_not_hold_the_whole_run(tmp_path, capsys):
    mib = 2 ** 20
    # The ring buffer wrapped: block 9 was allocated before the first recorded event.
    trace = [_event("free_requested", 9, 10 * mib), _event("alloc", 1, 20 * mib, "/work/a.py", 1)]
    path = tmp_path / "snap.pickle"
    path.write_bytes(pickle.dumps({"device_traces": [trace], "segments": []}))
    (tmp_path / "snap.pickle.peaks.json").write_text(
        '{"requested_bytes_peak": 31457280, "allocated_bytes_peak": 33554432}')
    import sys

    argv, sys.argv = sys.argv, ["memory_peak.py", str(path)]
    try:
        _module("memory_peak").main()
    finally:
        sys.argv = argv
    out = capsys.readouterr().out
    assert "WARNING: 1 frees of blocks allocated before the trace starts" in out
    assert "requested 0.029 GiB" in out and "allocated 0.031 GiB" in out


def test_attention_bench_checks_each_backend_against_fp32_math():
    """bench_attention.py's CPU path: the same inputs through the chosen SDPA backend and the fp32
    math reference (on the CPU both are math, so the errors are zero; on the GPU a wrong kernel
    would show ~1)."""
    row = _module("bench_attention").run_one("math", "tiny", 1, "cpu")
    assert row["out_rel_err"] < 1e-6 and row["grad_rel_err"] < 1e-6, row


def test_a_failed_repetition_is_counted_apart_and_its_reason_kept(tmp_path, capsys):
    """s15a: one of ours' two runs hit the run timeout after finishing its steps. The summary
    said runs 2 over one measured rep, and the row's error tail had lost the reason."""
    bench = _module("bench_recipes")
    case = bench.CASES["full_1b"]
    ok = dict(case="full_1b", variant="stock_best", rep=0, tokens_per_s=100, reported_median_tokens_per_s=101,
              peak_alloc_gib=2.0, steps=30, final_loss=1.0)
    ours = dict(ok, variant="ours_best_model_fast_mlp8_l1", tokens_per_s=130, peak_alloc_gib=1.5)
    rows = [ok, dict(ok, rep=1), ours, dict(case="full_1b", variant=ours["variant"], rep=1, error="x")]
    lines = {s["variant"]: s for s in bench.aggregate("full_1b", case, rows)}
    assert lines["stock_best"]["runs"] == 2 and "failed_runs" not in lines["stock_best"]
    assert lines[ours["variant"]]["runs"] == 1 and lines[ours["variant"]]["failed_runs"] == 1
    assert lines[ours["variant"]]["speedup_vs_stock"] == 1.3
    bench.print_table({"summary": list(lines.values())}, tmp_path / "table.md")
    assert "130 (130; 1 failed)" in capsys.readouterr().out
    assert "130 (130; 1 failed)" in (tmp_path / "table.md").read_text()  # the table beside the JSON

    log = tmp_path / "run.log"
    with pytest.raises(RuntimeError) as err:
        bench.run(["python3", "-c", "print('x' * 5000); import time; time.sleep(5)"], log, timeout=1)
    assert str(err.value)[-1500:].rstrip().endswith("[failed: timeout after 1 s]")
    # s16d: stock's capped run ran out of memory; its row's tail said only "[failed: 1]".
    oom = "import sys; print('torch.OutOfMemoryError: CUDA out of memory. Tried'); sys.exit(1)"
    with pytest.raises(RuntimeError) as err:
        bench.run(["python3", "-c", oom], log, timeout=30)
    assert str(err.value).rstrip().endswith("[failed: out of memory (exit 1)]")
    with pytest.raises(RuntimeError) as err:  # a timeout stays a timeout, whatever the log says
        bench.run(["python3", "-c", "print('CUDA out of memory'); import time; time.sleep(5)"], log, timeout=1)
    assert str(err.value).rstrip().endswith("[failed: timeout after 1 s]")


def test_a_claim_curve_is_compared_with_stock_and_an_fp8_curve_with_bf16(capsys):
    """The claimed settings' 220-step curves name stock's run as their reference; the older
    FP8 curves keep their bf16 twin. Differences are taken step by step over the shared steps."""
    bench = _module("bench_recipes")
    stock = [3.0, 2.0, 1.5, 1.25]
    rows = [dict(case="full_1b_curve", variant="stock_best", rep=0, losses=stock),
            dict(case="full_1b_curve", variant="ours_claim", rep=0, losses=[3.0, 2.5, 1.5, 1.0]),
            dict(case="full_1b_curve", variant="ours_fused", rep=0, losses=stock),
            dict(case="full_1b_curve", variant="ours_fused_fp8", rep=0, losses=[3.5, 2.0, 1.5, 1.25])]
    curves = {c["fp8"]: c for c in bench.loss_curves(rows)}
    assert set(curves) == {"ours_claim", "ours_fused_fp8"}
    claim = curves["ours_claim"]
    assert claim["bf16"] == "stock_best" and curves["ours_fused_fp8"]["bf16"] == "ours_fused"
    assert claim["max_abs_diff"] == 0.5 and claim["median_abs_diff"] == 0.125
    assert claim["mean_last50_fp8"] == 2.0 and claim["mean_last50_bf16"] == 1.9375
    bench.print_table({"summary": [], "loss_curves": list(curves.values())})
    assert "ours_claim vs stock_best (rep 0 vs rep 0): 4 steps" in capsys.readouterr().out


def test_a_second_repetition_is_compared_with_its_reference_and_with_its_own_first_run(capsys):
    """s16b/s16g: two runs of stock's own settings differ by up to 0.4 at single-step spikes;
    the curves preset runs each side twice, and each rep-1 curve is compared with the same rep
    of its reference and with its own rep 0 (the run-to-run spread). Spikes are counted and the
    5-step rolling medians' gap is taken, which one spike does not move."""
    bench = _module("bench_recipes")
    flat = [2.0] * 12
    spiked = flat[:5] + [3.0] + flat[6:]                   # one spike at step 5
    shifted = [x + 0.25 for x in flat]
    rows = [dict(case="lora_8b_curve", variant="stock_best", rep=0, losses=flat),
            dict(case="lora_8b_curve", variant="ours_claim", rep=0, losses=spiked),
            dict(case="lora_8b_curve", variant="stock_best", rep=1, losses=spiked),
            dict(case="lora_8b_curve", variant="ours_claim", rep=1, losses=shifted),
            dict(case="lora_8b_curve", variant="ours_claim", rep=2, error="x")]
    pairs = {(c["fp8"], c["rep_fp8"], c["bf16"], c["rep_bf16"]): c for c in bench.loss_curves(rows)}
    assert set(pairs) == {("ours_claim", 0, "stock_best", 0), ("ours_claim", 1, "stock_best", 1),
                          ("stock_best", 1, "stock_best", 0), ("ours_claim", 1, "ours_claim", 0)}
    one_spike = pairs[("ours_claim", 0, "stock_best", 0)]
    assert one_spike["kind"] == "reference" and one_spike["max_abs_diff"] == 1.0
    assert one_spike["spikes_fp8"] == 1 and one_spike["spikes_bf16"] == 0
    assert one_spike["rolling_median_gap_last50"] == 0.0   # the spike is not a shift
    shift = pairs[("ours_claim", 1, "stock_best", 1)]       # against rep 1 of stock: spiked
    assert shift["rolling_median_gap_last50"] == 0.25 and shift["spikes_bf16"] == 1
    repeat = pairs[("stock_best", 1, "stock_best", 0)]
    assert repeat["kind"] == "repeat" and repeat["median_abs_diff"] == 0.0
    bench.print_table({"summary": [], "loss_curves": [repeat]})
    assert "stock_best vs stock_best (rep 1 vs rep 0, the same settings again)" in capsys.readouterr().out


def test_merged_runs_keep_every_repetition_and_compare_a_repeat_with_the_first():
    """s16g ran stock's curve again in a separate run (rep 0 there too): merged with s16b, it
    becomes rep 1 of stock_best (compared with s16b's stock as a repeat), not a replacement of
    the reference ours_claim is compared with."""
    bench = _module("bench_recipes")
    first = [dict(case="lora_8b_curve", variant="stock_best", rep=0, losses=[3.0, 2.0, 1.0]),
             dict(case="lora_8b_curve", variant="ours_claim", rep=0, losses=[3.0, 2.5, 1.0])]
    again = [dict(case="lora_8b_curve", variant="stock_best", rep=0, losses=[3.0, 2.0, 1.5])]
    rows = bench.merge_rows([first, again])
    assert [(r["variant"], r["rep"], r["source"], r["source_rep"]) for r in rows] == [
        ("stock_best", 0, 0, 0), ("ours_claim", 0, 0, 0), ("stock_best", 1, 1, 0)]
    pairs = {(c["kind"], c["fp8"], c["rep_fp8"], c["rep_bf16"]): c for c in bench.loss_curves(rows)}
    assert set(pairs) == {("reference", "ours_claim", 0, 0), ("repeat", "stock_best", 1, 0)}
    assert pairs[("reference", "ours_claim", 0, 0)]["max_abs_diff"] == 0.5  # against s16b's own stock
    assert pairs[("repeat", "stock_best", 1, 0)]["max_abs_diff"] == 0.5


def test_every_run_of_a_curve_and_of_its_reference_is_pooled_with_the_medians_gap(capsys):
    """s17a: one of ours' runs ended in a spike episode that its own repeat did not; a gap read
    from one pair of runs is then mostly chance. Pooled over runs (merged from several bench
    runs), each side's median of the rolling-median last-50 means is compared, and each of
    ours' runs is placed against the range of stock's runs."""
    bench = _module("bench_recipes")
    flat = lambda level: [level] * 60
    spiked = flat(2.0)
    spiked[52] = spiked[57] = 3.0                          # two single-step spikes in the tail
    stock = [dict(case="lora_8b_curve", variant="stock_best", rep=0, losses=flat(2.0))]
    again = [dict(case="lora_8b_curve", variant="stock_best", rep=0, losses=flat(2.1)),
             dict(case="lora_8b_curve", variant="ours_claim", rep=0, losses=flat(2.2)),
             dict(case="lora_8b_curve", variant="ours_claim", rep=1, losses=spiked),
             dict(case="lora_8b_curve", variant="ours_claim", rep=2, losses=flat(1.9)),
             dict(case="lora_8b_curve", variant="ours_claim", rep=3, error="x", losses=flat(9.0))]
    (pooled,) = bench.curve_runs(bench.merge_rows([stock, again]))
    assert (pooled["variant"], pooled["ref"]) == ("ours_claim", "stock_best")
    assert [r["rolling_last50"] for r in pooled["ref_runs"]] == [2.0, 2.1]
    ours = {r["rep"]: r for r in pooled["runs"]}
    assert set(ours) == {0, 1, 2}                            # the failed run is left out
    assert ours[1]["spikes"] == 2 and ours[1]["last20"] == 2.1
    assert ours[1]["rolling_last50"] == 2.0                  # the rolling medians drop the spikes
    assert pooled["median_rolling_last50"] == 2.0            # of 2.2, 2.0, 1.9
    assert pooled["ref_median_rolling_last50"] == 2.05
    assert pooled["above_ref_range"] == 1 and pooled["below_ref_range"] == 1  # 2.2 above, 1.9 below
    bench.print_table({"summary": [], "curve_runs": [pooled]})
    out = capsys.readouterr().out
    assert "ours_claim (3 runs) vs stock_best (2 runs)" in out and "1 above and 1 below" in out
    assert pooled["steps"] == 60 and pooled["settings_differ"] == []
    # one run a side: the pair's own comparison (loss_curves) says it all
    assert bench.curve_runs([stock[0], again[1]]) == []
    # one reference run is a point, not a range; a longer run is cut to the pool's shortest
    longer = dict(case="lora_8b_curve", variant="ours_claim", rep=1, losses=flat(2.2) + [5.0] * 40)
    (short_ref,) = bench.curve_runs([stock[0], again[1], longer])
    assert short_ref["above_ref_range"] is None and short_ref["steps"] == 60
    assert [r["rolling_last50"] for r in short_ref["runs"]] == [2.2, 2.2]
    bench.print_table({"summary": [], "curve_runs": [short_ref]})
    out = capsys.readouterr().out
    assert "vs stock_best (1 run)" in out and "range" not in out
    # a gap that rounds to zero is printed without a minus sign
    bench.print_table({"summary": [], "curve_runs": [dict(short_ref, gap_rel=-0.00003)]})
    assert "(+0.00%)" in capsys.readouterr().out
    # a variant redefined between merged runs is pooled, and said to be
    redefined = dict(again[1], rep=1, overrides={"compile": False})
    (mixed,) = bench.curve_runs([stock[0], again[0], again[1], redefined])
    assert mixed["settings_differ"] == ["ours_claim"]


def test_a_merge_of_recorded_runs_pools_them_and_names_each_parts_command_and_commit(tmp_path, monkeypatch):
    """Session 17 pooled s16b (no commit recorded) with s17a (25f1a00) from docs/results: the
    merged file names the merge's own command and each part's, not the first part's alone."""
    import json

    bench = _module("bench_recipes")
    results = SCRIPTS.parent / "docs" / "results"
    parts = [results / "2026-12-02_issue15_s16b_curve_lora_8b_h200.json",
             results / "2026-12-02_issue15_s17a_curves_lora_8b_h200.json"]
    out = tmp_path / "merged.json"
    monkeypatch.setattr("sys.argv", ["bench_recipes.py", "--merge", *map(str, parts), "--out", str(out)])
    bench.main()
    merged = json.loads(out.read_text())
    assert "--merge" in merged["meta"]["command"]
    assert [p["commit"] for p in merged["meta"]["parts"]] == [None, "25f1a00"]
    assert "s16b_curve_lora_8b" in merged["meta"]["parts"][0]["command"]
    (pooled,) = merged["curve_runs"]                     # ours' claim: 1 + 2 runs, stock's 1 + 2
    assert len(pooled["runs"]) == 3 and len(pooled["ref_runs"]) == 3
    assert out.with_suffix(".png").exists() and "curve runs" in out.with_suffix(".md").read_text()
    assert merged["meta"]["date"] == "2026-12-02" and merged["meta"]["parts"][1]["file"] == str(parts[1])
    # the chart: rep 0's pair, then every run of the pool (the last panel)
    titles = bench.plot(merged, tmp_path / "chart.png")
    assert titles[-2:] == ["lora_8b_curve: loss, ours_claim vs stock_best (max |diff| 0.3731)",
                           "lora_8b_curve: rolling medians, ours_claim vs stock_best (+0.00%)"]
    # a pool with no same-rep pair to draw still gets its panel
    lone = {**merged, "loss_curves": []}
    assert bench.plot(lone, tmp_path / "lone.png") == [
        "lora_8b_curve: tokens/s (higher is better)", "lora_8b_curve: peak allocated GiB (lower is better)",
        "lora_8b_curve: rolling medians, ours_claim vs stock_best (+0.00%)"]


def test_a_gap_that_rounds_to_zero_prints_without_a_minus_sign():
    bench = _module("bench_recipes")
    assert [bench._signed_percent(x) for x in (-3e-6, 0.0, 3e-6, -0.0006, 0.00044, 0.0125)] == [
        "+0.00%", "+0.00%", "+0.00%", "-0.06%", "+0.04%", "+1.25%"]


def test_the_chart_of_a_recorded_run_wraps_its_long_titles(tmp_path):
    """s18b's chart as first drawn cut its pooled panel's title, with the gap, at the PNG's edge."""
    import json

    bench = _module("bench_recipes")
    recorded = SCRIPTS.parent / "docs" / "results" / "2026-12-02_issue15_s18b_curves_qlora_8b_lr3e4_h200.json"
    titles = bench.plot(json.loads(recorded.read_text()), tmp_path / "chart.png")
    assert max(len(line) for t in titles for line in t.splitlines()) <= 70
    assert titles[-1].replace("\n", " ") == (
        "qlora_8b_curve: rolling medians, ours_claim_lr3e4 vs stock_best_lr3e4 (+0.04%)")


def test_a_long_panel_title_is_wrapped_inside_the_panel_with_nothing_lost():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bench = _module("bench_recipes")
    text = "qlora_8b_curve: rolling medians, ours_claim_lr3e4 vs stock_best_lr3e4 (+0.04%)"
    fig, ax = plt.subplots()
    bench._panel_title(ax, text)
    drawn = ax.get_title()
    plt.close(fig)
    assert len(drawn.splitlines()) == 2 and max(map(len, drawn.splitlines())) <= 70
    assert drawn.replace("\n", " ") == text


def test_a_preset_runs_each_listed_variant_every_repetition_in_alternating_order():
    bench = _module("bench_recipes")
    for preset, selection in bench.PRESETS.items():
        for case_name, names in selection.items():
            order = [(rep, v["name"]) for rep, v in bench.schedule(bench.CASES[case_name], 2, names)]
            assert order == [(0, n) for n in names] + [(1, n) for n in reversed(names)], (preset, case_name)
    with pytest.raises(ValueError, match="stock_bset"):
        bench.schedule(bench.CASES["full_1b"], 1, ["stock_bset"])
    # without a preset: heads every repetition, each lever once after the first repetition's heads
    case = bench.CASES["lora_8b"]
    heads = [v["name"] for v in case["variants"] if v["head"]]
    order = [(rep, v["name"]) for rep, v in bench.schedule(case, 2)]
    assert order[:len(heads)] == [(0, n) for n in heads] and order[-len(heads):] == [(1, n) for n in heads[::-1]]
    assert len(order) == 2 * len(heads) + len(case["variants"]) - len(heads)


def test_every_rep_runs_the_only_variants_of_each_case_every_repetition():
    """s18a: the lr 3e-4 curves are levers (not heads), which run once under --reps 2 unless
    --every-rep runs each --only variant every repetition, in alternating order, per case."""
    bench = _module("bench_recipes")
    ap = bench.build_parser()
    argv = ["--cases", "lora_8b_curve,qlora_8b_curve", "--only", "stock_best_lr3e4,ours_claim_lr3e4",
            "--reps", "2"]
    pair = ["stock_best_lr3e4", "ours_claim_lr3e4"]
    plan = bench.plan_runs(ap.parse_args(argv + ["--every-rep"]), ap)
    for case in ("lora_8b_curve", "qlora_8b_curve"):
        assert [(rep, v["name"]) for rep, v in plan[case]] == [(0, n) for n in pair] + [(1, n) for n in pair[::-1]]
    twice_named = bench.plan_runs(ap.parse_args(argv[:3] + ["ours_claim_lr3e4,ours_claim_lr3e4", "--every-rep"]), ap)
    assert [(rep, v["name"]) for rep, v in twice_named["lora_8b_curve"]] == [(0, "ours_claim_lr3e4"), (1, "ours_claim_lr3e4")]
    once = bench.plan_runs(ap.parse_args(argv), ap)       # without it: each lever once
    assert [(rep, v["name"]) for rep, v in once["lora_8b_curve"]] == [(0, n) for n in pair]


@pytest.mark.parametrize("argv, message", [
    (["--preset", "memory", "--cases", "full_1b,qlora_8b"], "['qlora_8b'] not in --preset memory"),
    (["--cases", "full_1b,ful_8b"], "no case(s) ['ful_8b']"),
    (["--cases", "lora_8b_curve", "--every-rep"], "--every-rep names its variants with --only"),
    (["--cases", "lora_8b_curve", "--every-rep", "--only", "ours_claim_lr3e"], "ours_claim_lr3e"),
    (["--preset", "curves", "--every-rep", "--only", "ours_claim"], "--every-rep is for --only lists"),
])
def test_a_case_outside_the_preset_or_unknown_is_refused_before_any_run(argv, message, monkeypatch, capsys, tmp_path):
    bench = _module("bench_recipes")
    monkeypatch.setattr("sys.argv", ["bench_recipes.py", *argv, "--work", str(tmp_path / "w"),
                                     "--out", str(tmp_path / "r.json")])
    with pytest.raises(SystemExit):
        bench.main()
    assert message in capsys.readouterr().err
    assert not (tmp_path / "w").exists()  # nothing built, nothing run


def test_the_memory_cap_hook_applies_to_ours_and_stocks_training_process_only(tmp_path):
    """BENCH_MEMORY_CAP_GIB must reach both sides' training processes (ours through ``-m
    tune_recipes``, stock through its recipe file) and nothing else (inductor's workers): a
    script in a ``recipes`` folder counts, another does not."""
    import os
    import sys

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
    recipe's process only, ``_IS_RECIPE``), scripts/bench_hooks first on its path, ``hook_env``
    set and CUDA hidden (torchtune would make packed masks on a GPU); its output, after it
    exited cleanly."""
    import os
    import sys

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SCRIPTS / "bench_hooks"), str(SCRIPTS.parent)]),
           "CUDA_VISIBLE_DEVICES": "", **hook_env}
    out = subprocess.run([sys.executable, "-c", code, "tune_recipes"], env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return out


_FLEX_PROBE = """
import torch
from torch._dynamo.utils import counters
from torch.nn.attention.flex_attention import create_block_mask
from torchtune.modules.attention_utils import create_block_causal_mask
from tune_recipes.models.tiny import tiny_llama3


def block_mask(lens, seq_len):
    # As torchtune's packed collate builds it: the document ids in a closure cell of mask_mod.
    doc = torch.cat([torch.full((n,), i) for i, n in enumerate(lens)])[None]

    def mask_mod(b, h, q_idx, kv_idx):
        return (doc[b, q_idx] == doc[b, kv_idx]) & (q_idx >= kv_idx)

    return create_block_mask(mask_mod, 1, None, seq_len, seq_len, device="cpu")


torch.manual_seed(0)
model = tiny_llama3().eval()
# aot_eager: inductor's CPU flex template cannot lower RoPE's strided views (torch 2.13); the
# GPU's Triton template can. The graph capture is dynamo's either way.
compiled = torch.compile(model, backend="aot_eager")
S = 384  # three 128-token blocks: full, partial and empty ones, in different counts per batch
for lens in ([40, 300, 44], [20, 30, 78, 256]):
    tokens = torch.randint(0, 272, (1, S))
    pos = torch.cat([torch.arange(n) for n in lens])[None]
    with torch.no_grad():
        ref = model(tokens, mask=create_block_causal_mask([torch.tensor(lens)]), input_pos=pos)
        out = compiled(tokens, mask=block_mask(lens, S), input_pos=pos)
    print("max_rel", float((out - ref).abs().max() / ref.abs().max()))
print("graphs", counters["stats"]["unique_graphs"], "breaks", sum(counters["graph_break"].values()))
try:  # eagerly the BlockMask goes to torchtune's own call: on the CPU, SDPA, which refuses it
    with torch.no_grad():
        model(tokens, mask=block_mask(lens, S), input_pos=pos)
    print("eager: flex")
except TypeError:
    print("eager: torchtune's call")
"""


def test_the_flex_in_graph_hook_compiles_packed_attention_into_one_graph():
    """BENCH_FLEX_IN_GRAPH=1: on a packed batch's BlockMask, attention is ``flex_attention``
    traced by torch.compile (torchtune's call sits behind ``torch.compiler.disable``, a graph
    break in every layer). Checked on the CPU (forward: CPU flex attention has no backward):
    the whole model is one graph with no break and no recompile for a second batch's mask, and
    its logits equal the dense document mask's SDPA (fp32, 1e-6 relative). Called eagerly, the
    hook hands the BlockMask to torchtune's own call (CPU: SDPA, which cannot take one), so
    with the hook or its compile-only gate broken the probe fails. CUDA is hidden: torchtune
    would make its masks on the GPU."""
    out = _run_hook_probe(_FLEX_PROBE, BENCH_FLEX_IN_GRAPH="1")
    lines = out.stdout.split("\n")
    rel = [float(line.split()[1]) for line in lines if line.startswith("max_rel")]
    assert len(rel) == 2 and max(rel) < 1e-6, out.stdout
    assert "graphs 1 breaks 0" in out.stdout, out.stdout
    assert "eager: torchtune's call" in out.stdout, out.stdout


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
    heads; logits and every parameter's gradient equal the eager model's (fp32, 1e-6 relative).
    Whether the copies are gone from memory is the GPU's to show (inductor; here the graph runs
    eagerly)."""
    out = _run_hook_probe(_GQA_PROBE, BENCH_SDPA_GQA="1")
    assert "gqa 2 of 2" in out.stdout, out.stdout  # both layers
    values = {line.split()[0]: float(line.split()[1]) for line in out.stdout.splitlines()
              if line.startswith(("logits_rel", "grad_rel"))}
    assert values["logits_rel"] < 1e-6 and values["grad_rel"] < 1e-6, out.stdout


def test_the_results_name_the_code_commit(monkeypatch):
    """The GPU machine's copy of the tree has no .git: BENCH_COMMIT, set in the command, names
    the commit; here, in a clone, git's HEAD does (session 15's files lacked it)."""
    bench = _module("bench_recipes")
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


def _session_bench_commands():
    """The bench_recipes.py command lines of scripts/gpu_session.sh (continuations joined), as
    argv lists without the redirections."""
    text = (SCRIPTS / "gpu_session.sh").read_text().replace("\\\n", " ")
    found = []
    for line in text.splitlines():
        code = line.split("#", 1)[0].strip()
        if code.startswith("bench_on "):  # bench_on GPU CASE VARIANTS REPS NAME
            for call in code.split(";"):
                words = shlex.split(call)
                if words[:1] == ["bench_on"]:
                    found.append(["--cases", words[2], "--only", words[3], "--reps", words[4]])
        elif "scripts/bench_recipes.py" in code:
            argv = shlex.split(code.split("scripts/bench_recipes.py", 1)[1].split(">")[0])
            if not any(a.startswith("$") and not a.startswith("$OUT") for a in argv):  # bench_on's body
                found.append(argv)
    return found


def test_every_bench_command_of_the_gpu_session_script_plans_runs(capsys):
    """Device time is not spent finding a typo: every bench_recipes.py command in
    gpu_session.sh parses and plans at least one run, and each --only name it gives is run by its
    selection of cases (plan_runs refuses one that is not, before any run)."""
    bench = _module("bench_recipes")
    commands = _session_bench_commands()
    assert len(commands) > 40
    for argv in commands:
        ap = bench.build_parser()
        args = ap.parse_args(argv)
        if args.merge or args.plot:
            continue
        plan = bench.plan_runs(args, ap)
        assert plan and all(runs for runs in plan.values()), argv
    # and the refusal itself: lora_8b's variant asked of full_1b
    ap = bench.build_parser()
    with pytest.raises(SystemExit):
        bench.plan_runs(ap.parse_args(["--cases", "full_1b", "--only", "stock_best,stock_ga2_24g"]), ap)
    assert "--only: ['stock_ga2_24g'] not run by this selection (cases full_1b)" in capsys.readouterr().err


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
