"""tune_recipes.loggers in-process: formatting, config.yaml, metrics.jsonl, MLflow store binding."""

import json

import pytest
import torch
from omegaconf import OmegaConf

from tune_recipes import loggers

pytestmark = pytest.mark.unit


def _cfg(out):
    return OmegaConf.create({"output_dir": str(out), "optimizer": {"lr": 3e-3},
                             "metric_logger": {"log_dir": "${output_dir}"}})


def test_stdout_logger_prints_numbers_not_tensors_and_writes_jsonl(tmp_path, capsys):
    lg = loggers.StdoutLogger(log_dir=tmp_path)
    lg.log_config(_cfg(tmp_path))
    lg.log_dict({"loss": 5.54455, "grad_norm": torch.tensor(8.8271), "valid_tokens": 202}, step=1)
    lg.close()
    line = capsys.readouterr().out.strip()
    assert line == "step 1 | loss 5.545 | grad_norm 8.827 | valid_tokens 202"
    row = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert row["step"] == 1 and row["grad_norm"] == pytest.approx(8.8271)
    cfg = (tmp_path / "config.yaml").read_text()
    assert f"log_dir: {tmp_path}" in cfg  # resolved


def test_a_resumed_run_drops_the_killed_runs_later_rows_through_every_jsonl_logger(tmp_path, capsys):
    # build_reporter calls drop_rows_after on whichever logger the config names; the loggers
    # that also write metrics.jsonl must pass it on, or resumed steps appear twice.
    lg = loggers.StdoutLogger(log_dir=tmp_path)
    for step in (1, 2, 3, 4):
        lg.log_dict({"loss": float(step)}, step=step)
    lg.close()
    resumed = loggers.StdoutLogger(log_dir=tmp_path)
    resumed.drop_rows_after(2)
    resumed.log_dict({"loss": 30.0}, step=3)
    resumed.close()
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["loss"]) for r in rows] == [(1, 1.0), (2, 2.0), (3, 30.0)]
    loggers.StdoutLogger(log_dir=tmp_path / "none", jsonl=False).drop_rows_after(1)  # no file: no-op


def test_jsonl_off(tmp_path, capsys):
    lg = loggers.StdoutLogger(log_dir=tmp_path, jsonl=False)
    lg.log_dict({"loss": 1.0}, step=1)
    lg.close()
    assert not (tmp_path / "metrics.jsonl").exists()


def test_mlflow_loggers_in_one_process_write_to_their_own_stores(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    for name in ("a", "b"):
        lg = loggers.MLFlowLogger(log_dir=tmp_path / name, experiment_name=name, jsonl=False)
        lg.log_dict({"loss": 2.0 if name == "a" else 3.0, "grad_norm": torch.tensor(1.5)}, step=7)
        lg.close()
    for name, loss in (("a", 2.0), ("b", 3.0)):
        (metric,) = (tmp_path / name / "mlruns").glob("*/*/metrics/loss")
        _, value, step = metric.read_text().split()
        assert float(value) == loss and step == "7"


@pytest.mark.parametrize("make", [
    lambda d: loggers.StdoutLogger(log_dir=d),
    lambda d: loggers.TensorBoardLogger(log_dir=d),
])
def test_every_jsonl_logger_starts_a_fresh_runs_metrics_anew(make, tmp_path, capsys):
    # The rows and config.yaml of an earlier run into the same output_dir are kept aside.
    first = make(tmp_path)
    first.log_config(_cfg(tmp_path))
    first.log_dict({"loss": 1.0}, step=1)
    first.log_dict({"loss": 1.0}, step=2)
    first.close()
    second = make(tmp_path)
    second.log_config(_cfg(tmp_path))
    second.log_dict({"loss": 2.0}, step=1)
    second.close()
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["loss"]) for r in rows] == [(1, 2.0)]
    (kept,) = tmp_path.glob("metrics.*.jsonl")
    assert len(kept.read_text().splitlines()) == 2
    assert len(list(tmp_path.glob("config.*.yaml"))) == 1
    assert "held an earlier run's metrics" in capsys.readouterr().err


def test_wandb_refusing_to_start_is_one_config_error(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    from wandb.errors import UsageError

    import torchtune.training.metric_logging as ml

    def refuse(**kwargs):
        raise UsageError("No API key configured. Use `wandb login` to log in.")

    monkeypatch.setattr(ml, "WandBLogger", refuse)
    from tune_recipes.config import ConfigError

    with pytest.raises(ConfigError, match=r"metric_logger \(W&B\): No API key configured.*"
                                          r"metric_logger.mode=offline"):
        loggers.WandBLogger(log_dir=tmp_path)


def test_an_mlflow_server_that_does_not_answer_is_one_line_at_once(tmp_path):
    # MLflow's client would retry for minutes, silently; the logger tries to connect first.
    import socket
    import time

    from tune_recipes.config import ConfigError

    with socket.socket() as s:  # a port nothing listens on: bound, never listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        start = time.monotonic()
        with pytest.raises(ConfigError, match=rf"metric_logger.tracking_uri=http://127.0.0.1:{port}: "
                                              r"cannot connect to the MLflow server"):
            loggers.MLFlowLogger(log_dir=tmp_path, tracking_uri=f"http://127.0.0.1:{port}")
    assert time.monotonic() - start < 10


def test_an_earlier_different_config_in_the_folder_is_kept_not_overwritten(tmp_path):
    first = OmegaConf.create({"output_dir": str(tmp_path), "optimizer": {"lr": 1.0}})
    out = loggers.write_config(first, None)
    loggers.write_config(first, None)  # the same settings again: nothing to keep
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml"]
    second = OmegaConf.create({"output_dir": str(tmp_path), "optimizer": {"lr": 2.0}})
    loggers.write_config(second, None)
    third = OmegaConf.create({"output_dir": str(tmp_path), "optimizer": {"lr": 3.0}})
    loggers.write_config(third, None)
    assert OmegaConf.load(out).optimizer.lr == 3.0
    assert OmegaConf.load(tmp_path / "config.1.yaml").optimizer.lr == 1.0
    assert OmegaConf.load(tmp_path / "config.2.yaml").optimizer.lr == 2.0


def _jsonl_logger(d):
    from tune_recipes.training.metrics import JsonlMetricLogger

    return JsonlMetricLogger(log_dir=d)


@pytest.mark.parametrize("make", [
    _jsonl_logger,
    lambda d: loggers.StdoutLogger(log_dir=d),
    lambda d: loggers.TensorBoardLogger(log_dir=d),
], ids=["jsonl", "stdout", "tensorboard"])
def test_a_fresh_run_moves_the_earlier_runs_resume_configs_aside_with_it(make, tmp_path):
    """config.<k>.yaml (an earlier run resumed with other settings) is that run's: a fresh run
    keeps it under the earlier run's suffix, not beside its own config.yaml, and leaves no copy
    of the earlier config there either."""
    def run(lr, resume_step=None):
        logger = make(tmp_path)
        logger.log_config(OmegaConf.create({"output_dir": str(tmp_path), "optimizer": {"lr": lr}}))
        logger.begin_run(resume_step)
        logger.log_dict({"loss": lr}, step=1 if resume_step is None else resume_step + 1)
        logger.close()

    run(1.0)
    run(2.0, resume_step=1)  # a resume: the rows continue, the earlier settings kept aside
    assert OmegaConf.load(tmp_path / "config.1.yaml").optimizer.lr == 1.0
    run(3.0)  # a fresh run
    configs = sorted(p.name for p in tmp_path.glob("config*.yaml"))
    assert len(configs) == 3 and "config.1.yaml" not in configs, configs
    (metrics_kept,) = tmp_path.glob("metrics.*.jsonl")
    suffix = metrics_kept.name[len("metrics."):-len(".jsonl")]
    assert OmegaConf.load(tmp_path / f"config.{suffix}.yaml").optimizer.lr == 2.0
    assert OmegaConf.load(tmp_path / f"config.{suffix}.1.yaml").optimizer.lr == 1.0
    assert OmegaConf.load(tmp_path / "config.yaml").optimizer.lr == 3.0


@pytest.mark.parametrize("component,expect", [
    ("TensorBoardLogger", r"TensorBoard: event files in {d}/run_0_\S+ \(view: tensorboard --logdir {d}\)"),
    ("MLFlowLogger", r"MLflow: run \w+ in file://{d}/mlruns \(view: mlflow ui --backend-store-uri file://{d}/mlruns\)"),
    ("WandBLogger", r"W&B: offline run in {d}/wandb/offline-run-\S+ \(upload later: wandb sync {d}/wandb/offline-run-\S+\)"),
])
def test_a_logger_writing_beyond_metrics_jsonl_says_where_at_the_start(component, expect, tmp_path,
                                                                      monkeypatch, caplog):
    """A user opening TensorBoard, MLflow or W&B needs the folder, store or run: the run's
    setup prints it once (through the recipes' reporter setup)."""
    import re

    from tune_recipes.training.setup.recipe import build_reporter

    pytest.importorskip({"TensorBoardLogger": "tensorboard", "MLFlowLogger": "mlflow",
                         "WandBLogger": "wandb"}[component])
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    logger = {"_component_": f"tune_recipes.loggers.{component}", "log_dir": str(tmp_path)}
    if component == "WandBLogger":
        logger["mode"] = "offline"
    cfg = OmegaConf.create({"output_dir": str(tmp_path), "metric_logger": logger})
    with caplog.at_level("INFO"):
        rep = build_reporter(cfg, torch.device("cpu"))
    try:
        lines = caplog.messages
        pattern = re.compile(expect.format(d=re.escape(str(tmp_path))))
        assert sum(bool(pattern.search(l)) for l in lines) == 1, lines
    finally:
        rep.close()


def test_a_disabled_wandb_run_names_no_folder(tmp_path, monkeypatch, caplog):
    """mode=disabled writes nothing: no line pointing at a run folder that is never made."""
    from tune_recipes.training.setup.recipe import build_reporter

    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = OmegaConf.create({"output_dir": str(tmp_path), "metric_logger": {
        "_component_": "tune_recipes.loggers.WandBLogger", "log_dir": str(tmp_path),
        "mode": "disabled"}})
    with caplog.at_level("INFO"):
        rep = build_reporter(cfg, torch.device("cpu"))
    rep.close()
    assert not [m for m in caplog.messages if m.startswith("W&B:")], caplog.messages
