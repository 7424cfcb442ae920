"""Metric loggers for ``metric_logger._component_``: stdout, TensorBoard, W&B, MLflow.

Every recipe calls ``log_config(cfg)`` once, ``log_dict(metrics, step)`` per logged step and
``close()`` at the end (torchtune's ``MetricLoggerInterface``). These classes take the
``log_dir`` our configs already pass (``log_dir: ${output_dir}``), so switching is one override:

    tune run lora_finetune_single_device --config tiny/lora_single_device \\
        metric_logger._component_=tune_recipes.loggers.TensorBoardLogger

What they add to torchtune 0.6.1's loggers (which are used underneath where they work):

- ``config.yaml`` (resolved) in ``output_dir``, as our ``JsonlMetricLogger`` writes; torchtune's
  write ``torchtune_config.yaml`` with interpolations unresolved.
- ``metrics.jsonl`` too (``jsonl=True``, the default), so ``tune plot`` and the end-of-run plot
  work whichever logger a run used.
- torchtune's ``MLFlowLogger`` takes no ``log_dir``: our configs fail with it unless
  ``~metric_logger.log_dir`` is added (its ``StdoutLogger`` ignores the key). Ours accept it.
- MLflow: a local file store under ``log_dir/mlruns`` by default (MLflow 3.x refuses file stores
  unless ``MLFLOW_ALLOW_FILE_STORE=true``; we set it for file URIs only), through an
  ``MlflowClient`` bound to that URI instead of torchtune's process-global ``mlflow.set_*`` calls
  (which keep the first URI set in a process and read an attribute, ``_nested_run``, that its
  logger never sets).
"""

import os
import time
from pathlib import Path
from typing import Any, Dict, Mapping, Optional, Union

from omegaconf import DictConfig, OmegaConf

from tune_recipes.validation import resolved_config, resolved_config_yaml

PathLike = Union[str, Path]


def _scalar(value: Any) -> Any:
    """A Python number for a 0-d tensor (grad norms arrive as tensors); anything else as is."""
    item = getattr(value, "item", None)
    return item() if callable(item) and getattr(value, "ndim", 1) == 0 else value


def write_config(config: DictConfig, log_dir: Optional[PathLike]) -> Optional[Path]:
    """Write ``config.yaml`` (interpolations resolved) to ``output_dir`` (else ``log_dir``).

    An earlier run's different ``config.yaml`` there (a resume with other settings, which may
    still fail) is kept as ``config.<k>.yaml``, the first free k: the settings that made the
    folder's checkpoints stay on record."""
    where = config.get("output_dir", None) if isinstance(config, DictConfig) else None
    where = where or log_dir
    if where is None:
        return None
    out = Path(where) / "config.yaml"
    out.parent.mkdir(parents=True, exist_ok=True)
    text = resolved_config_yaml(config)
    from tune_recipes.training.reporting.metrics import keep_a_different_config

    keep_a_different_config(out, text)
    out.write_text(text)
    return out


class _WithJsonl:
    """Mixin: also append every row to ``log_dir/metrics.jsonl`` (the file ``tune plot``
    reads) and write ``config.yaml``."""

    def _init_jsonl(self, log_dir: Optional[PathLike], jsonl: bool) -> None:
        self._log_dir = Path(log_dir) if log_dir is not None else None
        self._jsonl = None
        if jsonl and self._log_dir is not None:
            from tune_recipes.training.metrics import JsonlMetricLogger

            self._jsonl = JsonlMetricLogger(self._log_dir)

    @property
    def path(self) -> Optional[Path]:
        """The metrics.jsonl file written beside the backend's own records (None: none)."""
        return self._jsonl.path if self._jsonl is not None else None

    def _jsonl_row(self, payload: Mapping[str, Any], step: int) -> None:
        if self._jsonl is not None:
            self._jsonl.log_dict(payload, step)

    def begin_run(self, resume_step: Optional[int]) -> None:
        """Fresh (None) or resumed at ``resume_step``: metrics.jsonl is started anew (an
        earlier run's kept aside) or continued (``JsonlMetricLogger.begin_run``); the other
        backend keeps its own history."""
        if self._jsonl is not None:
            self._jsonl.begin_run(resume_step)

    def drop_rows_after(self, step: int) -> None:
        """A resumed run drops the rows a killed run logged after its checkpoint (the file
        ``tune plot`` and resume read; the other backend keeps its own history)."""
        if self._jsonl is not None:
            self._jsonl.drop_rows_after(step)

    def _write_config(self, config: DictConfig) -> Optional[Path]:
        """``write_config``, after the metrics.jsonl logger has read the config.yaml it
        replaces (a fresh run keeps the earlier run's beside its rows)."""
        if self._jsonl is not None:
            where = config.get("output_dir", None) if isinstance(config, DictConfig) else None
            self._jsonl.remember_config(Path(where or self._log_dir) / "config.yaml")
        return write_config(config, self._log_dir)

    def _close_jsonl(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()


class StdoutLogger(_WithJsonl):
    """One line per logged step (``step 3 | loss 5.518 | lr 0.00075 | ...``), written through
    tqdm so the progress bar is not torn apart."""

    def __init__(self, log_dir: Optional[PathLike] = None, jsonl: bool = True) -> None:
        self._init_jsonl(log_dir, jsonl)

    def log(self, name: str, data: Any, step: int) -> None:
        self.log_dict({name: data}, step)

    def log_dict(self, payload: Mapping[str, Any], step: int) -> None:
        from tqdm import tqdm

        payload = {k: _scalar(v) for k, v in payload.items()}
        parts = [f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in payload.items()]
        tqdm.write(" | ".join([f"step {step}", *parts]))
        self._jsonl_row(payload, step)

    def log_config(self, config: DictConfig) -> None:
        self._write_config(config)

    def close(self) -> None:
        self._close_jsonl()


def _torchtune_tensorboard():
    from torchtune.training.metric_logging import TensorBoardLogger

    return TensorBoardLogger


class TensorBoardLogger(_WithJsonl):
    """torchtune's TensorBoard logger (event files in ``log_dir/run_<rank>_<time>/`` with
    ``organize_logs=True``, else in ``log_dir``), plus config.yaml, the config as TensorBoard
    text, and metrics.jsonl. View with ``tensorboard --logdir <output_dir>``."""

    def __init__(self, log_dir: PathLike, organize_logs: bool = True, jsonl: bool = True,
                 **kwargs) -> None:
        self._tb = _torchtune_tensorboard()(log_dir=str(log_dir), organize_logs=organize_logs,
                                            **kwargs)
        self.log_dir = self._tb.log_dir  # where the event file is
        self._view_dir = log_dir
        self._init_jsonl(log_dir, jsonl)

    def where(self) -> str:
        return (f"TensorBoard: event files in {self.log_dir} "
                f"(view: tensorboard --logdir {self._view_dir})")

    def log(self, name: str, data: Any, step: int) -> None:
        self.log_dict({name: data}, step)

    def log_dict(self, payload: Mapping[str, Any], step: int) -> None:
        payload = {k: _scalar(v) for k, v in payload.items()}
        self._tb.log_dict(payload, step)
        self._jsonl_row(payload, step)

    def log_config(self, config: DictConfig) -> None:
        self._write_config(config)
        if self._tb._writer is not None:
            text = resolved_config_yaml(config)
            # Markdown: indent by 4 so TensorBoard shows it as a code block.
            self._tb._writer.add_text("config", "\n".join("    " + l for l in text.splitlines()))

    def close(self) -> None:
        self._tb.close()
        self._close_jsonl()


class WandBLogger(_WithJsonl):
    """torchtune's Weights & Biases logger with the run folder under ``log_dir``
    (``log_dir/wandb/``), plus config.yaml and metrics.jsonl.

    ``mode``: ``online``, ``offline`` (nothing leaves the machine; ``wandb sync <run dir>``
    uploads later) or ``disabled``; None lets ``WANDB_MODE`` / wandb's settings decide. Other
    keys (``project``, ``entity``, ``group``, ``name``, ``tags``, ...) go to ``wandb.init``.
    """

    def __init__(self, log_dir: Optional[PathLike] = None, project: str = "tune-recipes",
                 mode: Optional[str] = None, jsonl: bool = True, **kwargs) -> None:
        from torchtune.training.metric_logging import WandBLogger as _TorchtuneWandB

        if mode is not None:
            kwargs["mode"] = mode
        try:
            self._wb = _TorchtuneWandB(project=project,
                                       log_dir=str(log_dir) if log_dir is not None else None,
                                       **kwargs)
        except Exception as e:
            # wandb.init's own refusals (no API key where it cannot prompt, a bad mode) as one
            # line; the schema refuses a missing key before the run (validation.py,
            # metric_logger_problem), this is the last line for what it cannot see.
            from wandb.errors import Error as WandbError

            if not isinstance(e, WandbError):
                raise
            from tune_recipes.config import ConfigError

            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ConfigError(f"metric_logger (W&B): {first}; or set metric_logger.mode=offline "
                              "or disabled") from None
        self._init_jsonl(log_dir, jsonl)

    def where(self) -> Optional[str]:
        run = self.run
        # None on a process other than rank 0; mode=disabled: a stand-in run that writes nothing.
        if run is None or getattr(run, "disabled", False):
            return None
        url = getattr(run, "url", None)
        if url:
            return f"W&B: run {run.name or run.id} at {url}"
        run_dir = Path(run.dir).parent  # run.dir is the run's files/ folder
        return f"W&B: offline run in {run_dir} (upload later: wandb sync {run_dir})"

    @property
    def run(self):
        return self._wb._wandb.run

    def log(self, name: str, data: Any, step: int) -> None:
        self.log_dict({name: data}, step)

    def log_dict(self, payload: Mapping[str, Any], step: int) -> None:
        payload = {k: _scalar(v) for k, v in payload.items()}
        self._wb.log_dict(payload, step)
        self._jsonl_row(payload, step)

    def log_config(self, config: DictConfig) -> None:
        path = self._write_config(config)
        run = self.run
        if run is not None:
            run.config.update(resolved_config(config),
                              allow_val_change=self._wb.config_allow_val_change)
            if path is not None:
                run.save(str(path), base_path=str(path.parent), policy="now")

    def close(self) -> None:
        self._wb.close()
        self._close_jsonl()


def _check_server(tracking_uri: str, timeout_s: float = 5.0) -> None:
    """An ``http(s)://`` tracking server that does not accept a connection is one line now.
    NOTE: without this, MLflow's client retries each request with backoff for minutes,
    printing nothing, before the run fails with a traceback."""
    import socket
    from urllib.parse import urlparse

    url = urlparse(tracking_uri)
    if url.scheme not in ("http", "https") or not url.hostname:
        return
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((url.hostname, port), timeout=timeout_s).close()
    except OSError as e:
        from tune_recipes.config import ConfigError

        raise ConfigError(f"metric_logger.tracking_uri={tracking_uri}: cannot connect to the MLflow "
                          f"server ({e.strerror or e}); start it, or leave tracking_uri unset "
                          "for a local store in log_dir/mlruns") from None


class MLFlowLogger(_WithJsonl):
    """MLflow tracking through an ``MlflowClient`` bound to ``tracking_uri``.

    ``tracking_uri``: default ``MLFLOW_TRACKING_URI``, else a file store in ``log_dir/mlruns``
    (``mlflow ui --backend-store-uri <that uri>`` shows it; the UI needs the full ``mlflow``
    package, logging needs only ``mlflow-skinny``). A ``file:`` store sets
    ``MLFLOW_ALLOW_FILE_STORE=true`` (MLflow 3.x refuses file stores otherwise). The config is
    logged flattened as params (``optimizer.lr``) and as the artifact ``config.yaml``.
    """

    def __init__(self, log_dir: Optional[PathLike] = None, tracking_uri: Optional[str] = None,
                 experiment_name: Optional[str] = None, run_name: Optional[str] = None,
                 run_id: Optional[str] = None, jsonl: bool = True) -> None:
        from mlflow.tracking import MlflowClient

        tracking_uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
        if tracking_uri is None:
            if log_dir is None:
                raise ValueError("MLFlowLogger needs log_dir or tracking_uri")
            tracking_uri = (Path(log_dir).resolve() / "mlruns").as_uri()
        if tracking_uri.startswith("file:") or "://" not in tracking_uri:
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        _check_server(tracking_uri)
        self.tracking_uri = tracking_uri
        self._client = MlflowClient(tracking_uri=tracking_uri)
        if run_id is None:
            name = experiment_name or os.environ.get("MLFLOW_EXPERIMENT_NAME") or "tune-recipes"
            exp = self._client.get_experiment_by_name(name)
            exp_id = exp.experiment_id if exp is not None else self._client.create_experiment(name)
            run_id = self._client.create_run(exp_id, run_name=run_name).info.run_id
        self.run_id = run_id
        self._closed = False
        self._init_jsonl(log_dir, jsonl)

    def where(self) -> str:
        # A server (http/https/databricks) is viewed at its address; a store on this machine
        # (a file: or sqlite: URI, or a plain path) through `mlflow ui`.
        served = self.tracking_uri.split(":", 1)[0] in ("http", "https", "databricks")
        view = self.tracking_uri if served else f"mlflow ui --backend-store-uri {self.tracking_uri}"
        return f"MLflow: run {self.run_id} in {self.tracking_uri} (view: {view})"

    def log(self, name: str, data: Any, step: int) -> None:
        self.log_dict({name: data}, step)

    def log_dict(self, payload: Mapping[str, Any], step: int) -> None:
        from mlflow.entities import Metric

        payload = {k: _scalar(v) for k, v in payload.items()}
        now = int(time.time() * 1000)
        metrics = [Metric(k, float(v), now, int(step)) for k, v in payload.items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool)]
        self._client.log_batch(self.run_id, metrics=metrics)
        self._jsonl_row(payload, step)

    def log_config(self, config: DictConfig) -> None:
        from mlflow.entities import Param
        from torchtune.training.metric_logging import flatten_dict

        path = self._write_config(config)
        flat: Dict[str, Any] = flatten_dict(resolved_config(config))
        params = [Param(k, str(v)[:6000]) for k, v in flat.items()]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
            self._client.log_batch(self.run_id, params=params[i:i + 100])
        if path is not None:
            self._client.log_artifact(self.run_id, str(path))

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._client.set_terminated(self.run_id)
            self._close_jsonl()
