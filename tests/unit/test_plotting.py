"""tune_recipes.plotting: reading metrics.jsonl the way runs write it, and the PNG it draws."""

import json
import math
from pathlib import Path

import pytest

from tune_recipes._cli.main import main
from tune_recipes.plotting import PlotError, load_metrics, plot_runs, run_labels

pytestmark = pytest.mark.unit


def _write(path: Path, rows, tail: str = "") -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + tail)
    return path


def _rows(n, loss0=5.0, start=1):
    return [{"step": s, "time": 1000.0 + s, "loss": loss0 / s, "lr": 1e-3 * s,
             "tokens_per_second_per_gpu": 100.0 + s, "valid_tokens": 500, "grad_norm": 2.0 / s,
             "step_time_s": 0.5} for s in range(start, start + n)]


def test_load_metrics_keys_steps_and_values(tmp_path):
    m = load_metrics(_write(tmp_path / "a", _rows(4)))
    assert m["loss"] == ([1, 2, 3, 4], [5.0, 2.5, 5.0 / 3, 1.25])
    assert set(m) >= {"loss", "lr", "grad_norm", "tokens_per_second_per_gpu", "step_time_s"}
    assert "time" not in m and "step" not in m


def test_resumed_run_keeps_the_last_value_of_a_repeated_step(tmp_path):
    # Interrupted after step 3, resumed from the step-2 checkpoint: steps 3-4 logged again.
    rows = _rows(3) + [dict(r, loss=r["loss"] + 10) for r in _rows(2, start=3)]
    steps, losses = load_metrics(_write(tmp_path / "r", rows))["loss"]
    assert steps == [1, 2, 3, 4]
    assert losses[2] == pytest.approx(5.0 / 3 + 10) and losses[3] == pytest.approx(1.25 + 10)


def test_validation_rows_merge_with_training_rows_at_the_same_step(tmp_path):
    rows = _rows(4) + [{"step": 2, "time": 0, "val_loss": 3.0}, {"step": 4, "val_loss": 2.0}]
    m = load_metrics(_write(tmp_path / "v", rows))
    assert m["val_loss"] == ([2, 4], [3.0, 2.0])
    assert m["loss"][1][1] == 2.5  # the validation row did not erase the training loss


def test_nan_inf_strings_missing_keys_and_a_torn_last_line(tmp_path):
    rows = [{"step": 1, "loss": "nan", "lr": 1e-3}, {"step": 2, "loss": "inf", "grad_norm": "-inf"},
            {"step": 3, "loss": 2.0, "note": "text", "flag": True, "maybe": None}]
    m = load_metrics(_write(tmp_path / "n", rows, tail='{"step": 4, "loss": 1.'))
    steps, losses = m["loss"]
    assert steps == [1, 2, 3] and math.isnan(losses[0]) and losses[1] == math.inf
    assert m["grad_norm"] == ([2], [-math.inf]) and m["lr"] == ([1], [1e-3])
    assert "note" not in m and "flag" not in m and "maybe" not in m
    assert "tokens_per_second_per_gpu" not in m


def test_labels_name_each_run_and_disambiguate(tmp_path):
    a, b = _write(tmp_path / "x" / "run", _rows(2)), _write(tmp_path / "y" / "run", _rows(2))
    c = _write(tmp_path / "other", _rows(2))
    assert run_labels([a, c]) == ["run", "other"]
    assert run_labels([a, b]) == ["x/run", "y/run"]
    assert run_labels([a / "metrics.jsonl"]) == ["run"]


def _png_pixels(path: Path):
    from matplotlib.image import imread

    return imread(str(path))  # float RGBA in [0, 1]


def test_plot_writes_a_nonblank_png_next_to_the_first_run(tmp_path):
    a = _write(tmp_path / "a", _rows(20) + [{"step": 10, "val_loss": 0.9}, {"step": 20, "val_loss": 0.5}])
    b = _write(tmp_path / "b", _rows(12, loss0=7.0))
    out = plot_runs([a, b])
    assert out == a / "metrics.png"
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    img = _png_pixels(out)
    h, w = img.shape[:2]
    assert w >= 1000 and h >= 700
    # Not blank: many pixels differ from the white background, and the two run colours
    # (matplotlib's C0 blue and C1 orange) are both there.
    rgb = img[..., :3]
    assert (rgb.sum(-1) < 2.9).mean() > 0.02
    blue = ((abs(rgb[..., 0] - 0x1F / 255) < 0.05) & (abs(rgb[..., 2] - 0xB4 / 255) < 0.05)).sum()
    orange = ((abs(rgb[..., 0] - 1.0) < 0.05) & (abs(rgb[..., 1] - 0x7F / 255) < 0.05)
              & (rgb[..., 2] < 0.1)).sum()
    assert blue > 100 and orange > 100


def test_plot_with_missing_and_nonfinite_values_still_draws(tmp_path):
    run = _write(tmp_path / "sparse", [{"step": 1, "loss": "nan"}, {"step": 2, "loss": 3.0},
                                       {"step": 3, "loss": 2.0}])
    out = plot_runs([run], out=tmp_path / "deep" / "p.png")
    assert out.is_file() and _png_pixels(out).shape[1] >= 1000


def test_missing_metrics_is_a_clear_error(tmp_path):
    with pytest.raises(PlotError, match="no metrics.jsonl in"):
        plot_runs([tmp_path])
    with pytest.raises(PlotError, match="nope: no such file or folder"):
        plot_runs([tmp_path / "nope"])
    # A run whose logger wrote another file name: named, to give instead.
    (tmp_path / "train.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    with pytest.raises(PlotError, match="it holds train.jsonl: give that file"):
        plot_runs([tmp_path])


def test_tune_plot_cli(tmp_path, capsys):
    a, b = _write(tmp_path / "a", _rows(5)), _write(tmp_path / "b", _rows(5))
    assert main(["plot", str(a)]) == 0
    assert (a / "metrics.png").is_file() and "wrote" in capsys.readouterr().out
    assert main(["plot", str(a), str(b), "--out", str(tmp_path / "both.png")]) == 0
    assert (tmp_path / "both.png").is_file()
    (tmp_path / "empty").mkdir()
    assert main(["plot", str(tmp_path / "empty")]) == 2
    assert "tune: error: no metrics.jsonl in" in capsys.readouterr().err
    assert main(["plot", str(tmp_path / "nope")]) == 2
    assert "nope: no such file or folder" in capsys.readouterr().err


# ------------------------------------------------- where the picture goes, and folders without a log
def _two_runs_in_one_output_dir(out_dir: Path) -> Path:
    """A run, then a fresh run in the same output_dir (the first one's rows and picture kept
    aside by the logger, as a recipe's does); returns the first run's kept log."""
    from tune_recipes.training.metrics import JsonlMetricLogger

    first = JsonlMetricLogger(out_dir)
    for step in (1, 2, 3):
        first.log_dict({"loss": 5.0 / step}, step=step)
    first.close()
    plot_runs([out_dir])  # the first run's picture, drawn at its end
    second = JsonlMetricLogger(out_dir)
    second.begin_run(None)
    for step in (1, 2):
        second.log_dict({"loss": 3.0 / step}, step=step)
    second.close()
    (kept,) = out_dir.glob("metrics.*.jsonl")
    return kept


def test_an_earlier_runs_kept_log_is_drawn_into_its_own_picture(tmp_path, capsys):
    out_dir = tmp_path / "r4"
    kept = _two_runs_in_one_output_dir(out_dir)
    kept_png = kept.with_suffix(".png")
    assert kept_png.is_file()  # the first run's picture, kept under the log's name
    (out_dir / "metrics.png").write_bytes(b"the current run's picture")
    kept_png.unlink()
    capsys.readouterr()
    assert main(["plot", str(kept)]) == 0
    assert capsys.readouterr().out.strip() == f"wrote {kept_png}"
    assert kept_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out_dir / "metrics.png").read_bytes() == b"the current run's picture"
    # The output_dir itself, or its metrics.jsonl, still draws the current run's metrics.png.
    assert plot_runs([out_dir / "metrics.jsonl"]) == out_dir / "metrics.png"


def test_overlaying_a_run_and_its_kept_predecessor_writes_the_first_ones_picture(tmp_path):
    out_dir = tmp_path / "r4"
    kept = _two_runs_in_one_output_dir(out_dir)
    (out_dir / "metrics.png").write_bytes(b"the current run's picture")
    assert plot_runs([kept, out_dir]) == kept.with_suffix(".png")
    assert (out_dir / "metrics.png").read_bytes() == b"the current run's picture"
    # The legend tells the two logs of one folder apart.
    assert run_labels([kept, out_dir]) == [f"r4/{kept.name}", "r4"]
    assert run_labels([out_dir, kept, tmp_path]) == ["r4", f"r4/{kept.name}", tmp_path.name]
    # Led by the current run, the overlay is the current run's picture, as before.
    assert plot_runs([out_dir, kept]) == out_dir / "metrics.png"


def test_the_default_picture_is_the_logs_own(tmp_path):
    from tune_recipes.plotting import plot_path

    run = _write(tmp_path / "run", _rows(2))
    assert plot_path(run) == plot_path(run / "metrics.jsonl") == run / "metrics.png"
    # Beside a metrics.jsonl, metrics.png is that log's: another log draws under its own name.
    (run / "exported.jsonl").write_text(json.dumps(_rows(1)[0]) + "\n")
    assert plot_path(run / "exported.jsonl") == run / "exported.png"
    # A logger's own filename (metric_logger.filename): its name too, as the end of its run
    # draws it and a fresh run keeps it aside; that log kept aside: its own name.
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "train.jsonl").write_text(json.dumps(_rows(1)[0]) + "\n")
    (logs / "train.20261205-215244.jsonl").write_text(json.dumps(_rows(1)[0]) + "\n")
    assert plot_path(logs / "train.jsonl") == logs / "train.png"
    assert plot_path(logs / "train.20261205-215244.jsonl") == logs / "train.20261205-215244.png"


def test_a_picture_given_for_a_log_is_one_line_and_never_drawn_over(tmp_path, capsys):
    run = _write(tmp_path / "run", _rows(3))
    plot_runs([run])
    assert main(["plot", str(run / "metrics.png")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert f"{run / 'metrics.png'} is not a metrics log (not text)" in err
    # A log whose picture name would be itself (a log saved as .png): refused, never replaced.
    log_as_png = run / "rows.png"
    log_as_png.write_text((run / "metrics.jsonl").read_text())
    with pytest.raises(PlotError, match="is a log being plotted"):
        plot_runs([log_as_png])
    assert log_as_png.read_text() == (run / "metrics.jsonl").read_text()


def test_a_run_that_logged_with_torchtunes_disklogger_is_named_as_such(tmp_path, capsys):
    from torchtune.training.metric_logging import DiskLogger

    run = tmp_path / "st1"
    logger = DiskLogger(log_dir=str(run / "logs"))  # as a stock config sets it
    logger.log_dict({"loss": 2.0}, step=1)
    logger.close()
    capsys.readouterr()
    assert main(["plot", str(run)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is it a run's output_dir" not in err
    assert f"no metrics.jsonl in {run}: the run wrote none" in err
    assert f"its metric logger wrote logs/{logger.path_to_log_file().name}" in err
    assert ("metric_logger._component_=tune_recipes.training.metrics.JsonlMetricLogger"
            in err)
    # The folder of the logs themselves, and an output_dir known by its checkpoints.
    with pytest.raises(PlotError, match="the run wrote none"):
        plot_runs([run / "logs"])
    ckpt_only = tmp_path / "ckpt"
    (ckpt_only / "epoch_0").mkdir(parents=True)
    (ckpt_only / "config.yaml").write_text("seed: 0\n")
    with pytest.raises(PlotError, match=r"the run wrote none \(it holds config.yaml, epoch_0/\)"):
        plot_runs([ckpt_only])
    # Not a run's folder: the message as before.
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "notes.txt").write_text("")
    with pytest.raises(PlotError, match=r"no metrics.jsonl in .*plain \(is it a run's output_dir\?\)"):
        plot_runs([tmp_path / "plain"])


def test_the_logger_named_in_the_hint_is_the_one_the_shipped_configs_use():
    from tune_recipes._cli import registry
    from tune_recipes.config import resolve_component
    from tune_recipes.plotting import JSONL_LOGGER
    from tune_recipes.training.metrics import JsonlMetricLogger

    spelled = {line.split(":", 1)[1].strip()
               for path in registry.configs_dir().rglob("*.yaml")
               for line in path.read_text().splitlines()
               if line.strip().startswith("_component_:") and "JsonlMetricLogger" in line}
    assert spelled == {JSONL_LOGGER}
    assert resolve_component(JSONL_LOGGER) is JsonlMetricLogger


def test_a_stock_configs_logs_folder_with_a_metrics_jsonl_is_pointed_at(tmp_path):
    # metric_logger._component_ switched to ours, log_dir left at the stock ${output_dir}/logs.
    run = tmp_path / "st2"
    _write(run / "logs", _rows(2))
    with pytest.raises(PlotError, match=r"it holds logs/metrics.jsonl: give that file"):
        plot_runs([run])
