"""tune_recipes.training.reporting.metrics: metrics.jsonl (and its public component path)."""

import pytest
import torch

from tune_recipes.training.reporting.metrics import JsonlMetricLogger, read_metrics

pytestmark = pytest.mark.unit


def test_rows_round_trip_with_tensors_and_non_finite_values(tmp_path):
    logger = JsonlMetricLogger(tmp_path)
    logger.log_dict({"loss": torch.tensor(1.5), "lr": 0.1}, step=1)
    logger.log("loss", float("nan"), step=2)
    logger.close()
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[0]["loss"] == 1.5 and rows[1]["loss"] == "nan"
    assert read_metrics(tmp_path / "metrics.jsonl", "lr") == [0.1]


def test_a_fresh_run_starts_a_new_file_and_keeps_the_earlier_runs_beside_it(tmp_path, capsys):
    from omegaconf import OmegaConf

    first = JsonlMetricLogger(tmp_path)
    first.log_config(OmegaConf.create({"run": 1}))
    for step in (1, 2, 3):
        first.log_dict({"loss": 1.0}, step=step)
    first.close()
    (tmp_path / "metrics.png").write_bytes(b"png of run 1")
    capsys.readouterr()
    # A second fresh run (told nothing before its first row, as a fresh run is).
    second = JsonlMetricLogger(tmp_path)
    second.log_config(OmegaConf.create({"run": 2}))
    second.log_dict({"loss": 2.0}, step=1)
    second.close()
    assert read_metrics(tmp_path / "metrics.jsonl", "loss") == [2.0]
    assert (tmp_path / "config.yaml").read_text().strip() == "run: 2"
    (kept,) = tmp_path.glob("metrics.*.jsonl")
    stamp = kept.name[len("metrics."):-len(".jsonl")]
    assert read_metrics(kept, "step") == [1, 2, 3]
    assert (tmp_path / f"metrics.{stamp}.png").read_bytes() == b"png of run 1"
    assert (tmp_path / f"config.{stamp}.yaml").read_text().strip() == "run: 1"
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"kept as metrics.{stamp}.jsonl" in err, err
    # `tune plot <output_dir>/metrics.<time>.jsonl` draws the kept rows again.
    from tune_recipes.plotting import plot_runs

    assert plot_runs([str(kept)], out=str(tmp_path / "kept.png")) and (tmp_path / "kept.png").is_file()
    # A third run in the same second keeps the second's under a name of its own.
    third = JsonlMetricLogger(tmp_path)
    third.begin_run(None)
    third.close()
    assert len(list(tmp_path.glob("metrics.*.jsonl"))) == 2
    assert (tmp_path / "metrics.jsonl").read_text() == ""


def test_a_resume_continues_the_file_and_an_empty_file_is_not_kept(tmp_path, capsys):
    logger = JsonlMetricLogger(tmp_path)
    logger.log_dict({"loss": 1.0}, step=1)
    logger.close()
    resumed = JsonlMetricLogger(tmp_path)
    resumed.begin_run(1)
    resumed.log_dict({"loss": 2.0}, step=2)
    resumed.close()
    assert read_metrics(tmp_path / "metrics.jsonl", "step") == [1, 2]
    empty = tmp_path / "empty"
    JsonlMetricLogger(empty).close()  # a run that failed before its first row
    JsonlMetricLogger(empty).begin_run(None)
    assert [p.name for p in empty.iterdir()] == ["metrics.jsonl"]
    assert "kept as" not in capsys.readouterr().err


def test_the_configs_component_path_still_resolves():
    from tune_recipes.config import resolve_component

    assert resolve_component("tune_recipes.training.metrics.JsonlMetricLogger") is JsonlMetricLogger


def test_an_unwritable_log_dir_is_one_clear_error_not_an_attribute_error(tmp_path):
    import os

    from tune_recipes.config import ConfigError
    from tune_recipes.training.reporting.metrics import JsonlMetricLogger

    blocker = tmp_path / "file"
    blocker.write_text("")  # a file where the folder should be: fails for root too
    with pytest.raises(ConfigError, match=f"cannot write the metrics file {blocker}/metrics.jsonl: .*; is "
                                          rf"metric_logger.log_dir \({blocker}; output_dir in the shipped configs\) writable"):
        JsonlMetricLogger(blocker)
    if os.geteuid() != 0:
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o500)
        with pytest.raises(ConfigError, match=r"Permission denied; is metric_logger.log_dir \("):
            JsonlMetricLogger(ro)


def test_a_log_dir_under_home_written_with_a_tilde_is_the_home_folder(tmp_path, monkeypatch):
    from omegaconf import OmegaConf

    from tune_recipes.config import load_config

    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "run.yaml").write_text(OmegaConf.to_yaml(
        {"output_dir": "~/runs", "metric_logger": {"log_dir": "${output_dir}"}, "keep": "a~/b"}))
    cfg = load_config(tmp_path / "run.yaml", ["tokenizer.path=~/tok"])
    assert cfg.output_dir == str(tmp_path / "runs") and cfg.tokenizer.path == str(tmp_path / "tok")
    assert cfg.keep == "a~/b"  # only a leading ~ is the home folder
    logger = JsonlMetricLogger(cfg.metric_logger.log_dir)
    logger.close()
    assert logger.path == tmp_path / "runs" / "metrics.jsonl" and logger.path.is_file()


def test_a_resumed_run_drops_the_rows_after_its_checkpoint(tmp_path):
    logger = JsonlMetricLogger(tmp_path)
    for step in (1, 2, 3, 4):
        logger.log("loss", float(step), step)
    logger._fh.write('{"step": 5, "lo')  # torn by a kill
    logger.drop_rows_after(2)
    logger.log("loss", 30.0, 3)
    logger.close()
    assert read_metrics(tmp_path / "metrics.jsonl", "step") == [1, 2, 3]
    assert read_metrics(tmp_path / "metrics.jsonl", "loss") == [1.0, 2.0, 30.0]


def test_a_null_log_dir_is_one_line_naming_the_key():
    from tune_recipes.config import ConfigError

    with pytest.raises(ConfigError, match=r"metric_logger.log_dir is null.*"
                                          r"metric_logger.log_dir=\$\{output_dir\}"):
        JsonlMetricLogger(None)


def test_a_run_that_fails_in_setup_leaves_the_earlier_runs_config_beside_its_rows(tmp_path):
    """config.yaml describes the run whose rows sit beside it: a run whose setup fails after
    log_config (before its first row) writes no config.yaml over the earlier run's."""
    from omegaconf import OmegaConf

    first = JsonlMetricLogger(tmp_path)
    first.log_config(OmegaConf.create({"run": 1}))
    first.log_dict({"loss": 1.0}, step=1)
    first.close()
    failed = JsonlMetricLogger(tmp_path)
    failed.log_config(OmegaConf.create({"run": "failed"}))
    failed.close()  # setup raised: no row, no begin_run
    assert (tmp_path / "config.yaml").read_text().strip() == "run: 1"
    assert read_metrics(tmp_path / "metrics.jsonl", "loss") == [1.0]
    assert not list(tmp_path.glob("config.*.yaml")) and not list(tmp_path.glob("metrics.*.jsonl"))


def test_a_resume_with_other_settings_keeps_the_earlier_config(tmp_path):
    """The settings that made the folder's checkpoints stay on record: config.<k>.yaml."""
    from omegaconf import OmegaConf

    first = JsonlMetricLogger(tmp_path)
    first.log_config(OmegaConf.create({"weight_decay": 0.0}))
    first.log_dict({"loss": 1.0}, step=1)
    first.close()
    same = JsonlMetricLogger(tmp_path)  # a resume with the same settings keeps nothing
    same.log_config(OmegaConf.create({"weight_decay": 0.0}))
    same.drop_rows_after(1)
    same.close()
    assert not list(tmp_path.glob("config.*.yaml"))
    # ... nor does one that differs only in how it started (resume_from_checkpoint)
    for setting in (True, "auto", False):
        resumed = JsonlMetricLogger(tmp_path)
        resumed.log_config(OmegaConf.create({"weight_decay": 0.0, "resume_from_checkpoint": setting}))
        resumed.drop_rows_after(1)
        resumed.close()
    assert not list(tmp_path.glob("config.*.yaml"))
    other = JsonlMetricLogger(tmp_path)
    other.log_config(OmegaConf.create({"weight_decay": 0.5}))
    other.drop_rows_after(1)
    other.log_dict({"loss": 0.5}, step=2)
    other.close()
    assert (tmp_path / "config.yaml").read_text().strip() == "weight_decay: 0.5"
    assert OmegaConf.load(tmp_path / "config.1.yaml").weight_decay == 0.0
    assert read_metrics(tmp_path / "metrics.jsonl", "loss") == [1.0, 0.5]
