"""Each metric logger a config can name, run through the tiny recipe and read back from what it
wrote (tune_recipes/loggers.py). Three optimizer steps each; the packages come with the
`loggers` extra (in `dev`), and a test skips cleanly where its package is missing."""

import json
import math
import struct
from pathlib import Path

import pytest
from helpers import losses, run_recipe
from tune_recipes.training.metrics import read_metrics

pytestmark = pytest.mark.integration
STEPS = 3


def _run(tmp_path, logger: str, *overrides: str):
    out = tmp_path / logger
    proc = run_recipe("full_finetune_single_device", "tiny/full_single_device", out,
                      [f"max_steps_per_epoch={STEPS}",
                       f"metric_logger._component_=tune_recipes.loggers.{logger}", *overrides])
    jsonl = losses(out)
    assert len(jsonl) == STEPS and all(math.isfinite(x) for x in jsonl)
    cfg = (out / "config.yaml").read_text()  # resolved, as the JSONL logger writes it
    assert "${" not in cfg and f"output_dir: {out}" in cfg
    return out, proc, jsonl


def test_stdout_logger(tmp_path):
    out, proc, jsonl = _run(tmp_path, "StdoutLogger")
    lines = [l for l in proc.stdout.splitlines() if "step " in l and "| loss " in l]
    assert len(lines) == STEPS, proc.stdout
    for step, (line, loss) in enumerate(zip(lines, jsonl), start=1):
        row = line[line.index(f"step {step} |"):]
        assert f"loss {loss:.4g}" in row and "grad_norm" in row and "tensor(" not in row


def test_tensorboard_logger(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, _, jsonl = _run(tmp_path, "TensorBoardLogger")
    (run_dir,) = [p.parent for p in out.glob("run_0_*/events.out.tfevents.*")]
    acc = EventAccumulator(str(run_dir), size_guidance={"tensors": 0, "scalars": 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"]) | set(acc.Tags()["tensors"])
    assert {"loss", "lr", "grad_norm", "tokens_per_second_per_gpu"} <= tags, tags

    def scalars(tag):
        if tag in acc.Tags()["scalars"]:
            return [(e.step, e.value) for e in acc.Scalars(tag)]
        from tensorboard.util import tensor_util
        return [(e.step, float(tensor_util.make_ndarray(e.tensor_proto))) for e in acc.Tensors(tag)]

    got = scalars("loss")
    assert [s for s, _ in got] == list(range(1, STEPS + 1))
    assert [v for _, v in got] == pytest.approx(jsonl, rel=1e-6)  # stored as float32
    assert "config/text_summary" in acc.Tags()["tensors"]  # the config as text


def wandb_records(path: Path):
    """Records of a .wandb transaction log: LevelDB log format (7-byte file header ':W&B'+magic+
    version, then 32 KiB blocks of chunks, each with a 7-byte header: crc32, length, type
    FULL=1/FIRST=2/MIDDLE=3/LAST=4), each record a wandb_internal_pb2.Record."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    pos, block, buf = 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # block trailer padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        buf += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(buf)
            buf = b""
            yield rec


def test_wandb_logger_offline(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    # Nothing may leave the machine: offline by the env and by the logger's own argument.
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_API_KEY", "")
    out, _, jsonl = _run(tmp_path, "WandBLogger", "metric_logger.mode=offline")
    (run_file,) = out.glob("wandb/offline-run-*/run-*.wandb")
    history, config = {}, {}
    for rec in wandb_records(run_file):
        kind = rec.WhichOneof("record_type")
        if kind == "history":
            item = {i.key or ".".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item}
            history[item["global_step"]] = item
        elif kind == "config":
            config.update({i.key or ".".join(i.nested_key): json.loads(i.value_json)
                           for i in rec.config.update})
    assert sorted(history) == list(range(1, STEPS + 1))
    assert [history[s]["loss"] for s in sorted(history)] == pytest.approx(jsonl, rel=1e-12)
    assert all("grad_norm" in h and "lr" in h for h in history.values())
    assert config["output_dir"] == str(out) and config["optimizer"]["lr"] == 3e-3


def test_mlflow_logger_file_store(tmp_path):
    pytest.importorskip("mlflow")
    out, _, jsonl = _run(tmp_path, "MLFlowLogger", "metric_logger.experiment_name=tiny")
    # File store layout: mlruns/<experiment id>/<run id>/{meta.yaml,metrics/,params/,artifacts/}
    (run_dir,) = [p.parent for p in (out / "mlruns").glob("*/*/meta.yaml")]
    rows = [l.split() for l in (run_dir / "metrics" / "loss").read_text().splitlines()]
    assert [int(step) for _, _, step in rows] == list(range(1, STEPS + 1))
    assert [float(v) for _, v, _ in rows] == pytest.approx(jsonl, rel=1e-12)
    assert (run_dir / "metrics" / "grad_norm").is_file() and (run_dir / "metrics" / "lr").is_file()
    assert (run_dir / "params" / "optimizer.lr").read_text() == "0.003"
    assert (run_dir / "artifacts" / "config.yaml").is_file()
    meta = (run_dir / "meta.yaml").read_text()
    assert "status: 3" in meta  # RunStatus.FINISHED
    exp_meta = (run_dir.parent / "meta.yaml").read_text()
    assert "name: tiny" in exp_meta


def test_a_fresh_run_into_an_earlier_runs_output_dir_starts_its_own_metrics(tmp_path):
    # The README command run twice: the second run's metrics.jsonl holds its own steps only,
    # and the first run's rows, config and checkpoints are kept beside it under one name (a
    # resume would continue the run instead).
    out = tmp_path / "run"
    run_recipe("lora_finetune_single_device", "tiny/lora_single_device", out,
               ["max_steps_per_epoch=4", "epochs=2"])
    first_adapter = (out / "epoch_1" / "adapter_model.safetensors").read_bytes()
    proc = run_recipe("lora_finetune_single_device", "tiny/lora_single_device", out,
                      ["max_steps_per_epoch=2", "optimizer.lr=1e-3"])
    assert [json.loads(l)["step"] for l in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    (kept,) = out.glob("metrics.*.jsonl")
    assert len(kept.read_text().splitlines()) == 8
    assert f"kept as {kept.name}" in proc.stderr
    suffix = kept.name[len("metrics."):-len(".jsonl")]
    earlier = out / f"checkpoints.{suffix}"
    assert sorted(p.name for p in earlier.iterdir()) == ["epoch_0", "epoch_1", "recipe_state"]
    assert (earlier / "epoch_1" / "adapter_model.safetensors").read_bytes() == first_adapter
    assert f"moved to {earlier.name}/" in proc.stderr
    assert (out / f"config.{suffix}.yaml").is_file()
    # Only the second run's checkpoint is left to resume: the earlier run's newest epoch is
    # not continued on the second run's metrics (it had been).
    assert sorted(p.name for p in out.glob("epoch_*")) == ["epoch_0"]
    resumed = run_recipe("lora_finetune_single_device", "tiny/lora_single_device", out,
                         ["max_steps_per_epoch=2", "optimizer.lr=1e-3", "epochs=2",
                          "resume_from_checkpoint=True"])
    assert "from epoch_0/ (1 epoch(s) done)" in resumed.stderr, resumed.stderr[-2000:]
    steps = [json.loads(l)["step"] for l in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]


def test_a_run_shorter_than_its_log_interval_logs_its_last_step_and_config(tmp_path):
    """A run shorter than log_every_n_steps still logs its epoch's last step (the steps since
    the last row, here all of them) and keeps its settings in config.yaml, written when setup
    is done, not at the first logged row."""
    out = tmp_path / "run"
    run_recipe("lora_finetune_single_device", "tiny/lora_single_device", out,
               ["max_steps_per_epoch=2", "log_every_n_steps=100", "optimizer.lr=1e-3"])
    assert (out / "epoch_0").is_dir()
    assert "lr: 0.001" in (out / "config.yaml").read_text()
    rows = [r for r in read_metrics(out / "metrics.jsonl") if "loss" in r]
    assert [(r["step"], r["steps_in_window"]) for r in rows] == [(2, 2)]
    assert (out / "metrics.png").is_file()


@pytest.mark.parametrize("logger", ["training.metrics.JsonlMetricLogger", "loggers.TensorBoardLogger"])
def test_a_runs_config_yaml_leaves_out_its_helper_keys_and_runs_again(tmp_path, logger):
    """A config with a helper key (``base_dir``, read only through ``output_dir:
    ${base_dir}/run``) trains; its saved config.yaml holds the resolved values without the
    helper, which nothing reads there: that file passes the key check a run makes (the helper
    kept, it refused the file)."""
    from helpers import tune

    if "TensorBoard" in logger:
        pytest.importorskip("tensorboard")
    from tune_recipes._cli.registry import resolve_config

    text = resolve_config("tiny/full_single_device").path.read_text()
    config = tmp_path / "helper.yaml"
    config.write_text(text.replace("\noutput_dir: ", f"\nbase_dir: {tmp_path}\noutput_dir: ${{base_dir}}/run\n"
                                                     "old_output_dir: ", 1).replace("\nold_output_dir: ", "\n# ", 1))
    out = tmp_path / "run"
    args = ["max_steps_per_epoch=1", f"metric_logger._component_=tune_recipes.{logger}"]
    tune("run", "full_finetune_single_device", "--config", str(config), *args)
    saved = (out / "config.yaml").read_text()
    assert f"output_dir: {out}" in saved and "base_dir" not in saved
    proc = tune("validate", str(out / "config.yaml"), "--recipe", "full_finetune_single_device")
    assert "config is valid" in proc.stdout
