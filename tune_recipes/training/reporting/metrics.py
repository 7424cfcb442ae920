"""Metrics a user can plot: one JSON object per line in ``<log_dir>/metrics.jsonl``."""

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Dict, Mapping, Optional, Union

import torch

from tune_recipes.config import ConfigError


def _plain(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/inf; keep them visible, not dropped
    return value


class JsonlMetricLogger:
    """Appends ``{"step": s, "time": t, <name>: value, ...}`` lines to ``log_dir/filename``.

    Same interface as torchtune's metric loggers (``log``, ``log_dict``, ``log_config``,
    ``close``), so any of them can be swapped in through the config. Lines are flushed as they
    are written: a crash loses nothing already logged.

    A resume continues the file; a fresh run starts a new one. ``begin_run(resume_step)`` says
    which (``drop_rows_after(step)`` is the resume's form of it); a logger that is told nothing
    before its first row is a fresh run's. A fresh run into a ``log_dir`` that holds an earlier
    run's rows keeps them: ``metrics.jsonl``, ``metrics.png`` and ``config.yaml`` are renamed to
    ``metrics.<time>.jsonl``, ``metrics.<time>.png`` and ``config.<time>.yaml`` (the earlier
    file's last write) and one line says so.

    ``log_config`` writes ``config.yaml`` when the run begins (its first row, or the resume's
    ``begin_run``), so a run that fails during setup leaves the earlier run's config beside the
    earlier run's rows; a resume with other settings keeps the earlier, different config as
    ``config.<k>.yaml``.
    """

    def __init__(self, log_dir: Optional[Union[str, Path]], filename: str = "metrics.jsonl") -> None:
        self._fh = None  # NOTE: first, so close()/__del__ work when the open below fails
        if log_dir is None:
            raise ConfigError("metric_logger.log_dir is null: this logger writes "
                              "<log_dir>/metrics.jsonl; set metric_logger.log_dir=${output_dir}")
        self.path = Path(log_dir) / filename
        self._begun = False
        # config.yaml as it was before log_config replaced it, kept aside with the earlier
        # run's rows if this run turns out fresh (log_config comes before begin_run).
        self._earlier_config: Optional[str] = None
        # log_config's text, written when the run begins (see the class docstring).
        self._pending_config: Optional[str] = None
        # The earlier run's config.<k>.yaml (kept when it resumed with other settings), as the
        # folder holds them before this run writes anything (a logger that writes config.yaml
        # itself may add one for this run's own start).
        self._earlier_resume_configs = _resume_configs(Path(log_dir))
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # Append mode writes nothing yet: whether the rows are kept aside or continued is
            # decided by begin_run.
            self._fh = open(self.path, "a", buffering=1)
        except OSError as e:
            raise ConfigError(
                f"cannot write the metrics file {self.path}: {e.strerror or e}; is "
                f"metric_logger.log_dir ({log_dir}; output_dir in the shipped configs) writable?"
            ) from None

    def begin_run(self, resume_step: Optional[int]) -> None:
        """``resume_step`` None: a fresh run (an earlier run's rows are kept aside, see the class
        docstring); an int: a resumed run continuing from that step (rows after it dropped).
        Only the first call counts; the first row logged without one means a fresh run."""
        if self._begun:
            return
        self._begun = True
        if resume_step is None:
            self._keep_earlier_run()
        else:
            self._drop_rows_after(resume_step)
        if self._pending_config is not None:
            self._write_config(self._pending_config)
            self._pending_config = None

    def drop_rows_after(self, step: int) -> None:
        """A resumed run: ``begin_run(step)``. (The name the recipes' setup calls.)"""
        if self._begun:
            self._drop_rows_after(step)
        else:
            self.begin_run(step)

    def _keep_earlier_run(self) -> None:
        if not self.path.is_file() or self.path.stat().st_size == 0:
            return
        self._fh.close()
        suffix = earlier_run_suffix(self.path)
        stem = self.path.stem
        kept = [self.path.with_name(f"{stem}.{suffix}{self.path.suffix}")]
        os.replace(self.path, kept[0])
        png = self.path.with_suffix(".png")
        if png.is_file():
            kept.append(png.with_name(f"{stem}.{suffix}.png"))
            os.replace(png, kept[-1])
        config = self.path.parent / "config.yaml"
        config_kept = self.path.parent / f"config.{suffix}.yaml"
        if self._earlier_config is not None:
            config_kept.write_text(self._earlier_config)
            kept.append(config_kept)
        elif config.is_file():
            os.replace(config, config_kept)
            kept.append(config_kept)
        # The earlier run's own earlier configs go with it: beside this run's config.yaml they
        # would read as this run's.
        for k, resumed in self._earlier_resume_configs.items():
            if resumed.is_file():
                kept.append(resumed.with_name(f"config.{suffix}.{k}.yaml"))
                os.replace(resumed, kept[-1])
        # A logger that wrote config.yaml at log_config (``loggers.write_config``) kept the
        # earlier one as config.<k>.yaml then, not yet knowing this run is fresh: it is the
        # config.<suffix>.yaml just kept, twice.
        if self._earlier_config is not None:
            for k, copy in _resume_configs(self.path.parent).items():
                if k not in self._earlier_resume_configs and copy.read_text() == self._earlier_config:
                    copy.unlink()
        self._fh = open(self.path, "a", buffering=1)
        print(f"{self.path.parent} held an earlier run's metrics: kept as "
              f"{', '.join(p.name for p in kept)}; this run starts a new {self.path.name} "
              "(a resume continues the file)", file=sys.stderr)

    def _drop_rows_after(self, step: int) -> None:
        """Keep only rows logged at or before ``step``: a resumed run continues from its
        checkpoint's step, and the rows a killed run logged after it would appear twice.
        Rewritten to a temporary file and renamed, so a kill here loses nothing."""
        self._fh.close()
        lines = self.path.read_text().splitlines(keepends=True)
        kept = []
        for line in lines:
            try:
                row_step = json.loads(line)["step"]
            except (ValueError, KeyError, TypeError):
                continue  # a line torn by a kill
            if row_step <= step:
                kept.append(line if line.endswith("\n") else line + "\n")
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text("".join(kept))
        os.replace(tmp, self.path)
        self._fh = open(self.path, "a", buffering=1)

    def remember_config(self, config_file: Path) -> None:
        """Called before ``config_file`` (config.yaml) is replaced: a fresh run keeps the
        earlier one beside the earlier rows."""
        if not self._begun and self._earlier_config is None and Path(config_file).is_file():
            self._earlier_config = Path(config_file).read_text()

    def log(self, name: str, data: Any, step: int) -> None:
        self.log_dict({name: data}, step)

    def log_dict(self, payload: Mapping[str, Any], step: int) -> None:
        if not self._begun:
            self.begin_run(None)
        row: Dict[str, Any] = {"step": int(step), "time": round(time.time(), 3)}
        row.update({k: _plain(v) for k, v in payload.items()})
        self._fh.write(json.dumps(row) + "\n")

    def log_config(self, config) -> None:
        from tune_recipes.validation import resolved_config_yaml

        text = resolved_config_yaml(config)
        if self._begun:
            self._write_config(text)
        else:
            self._pending_config = text

    def _write_config(self, text: str) -> None:
        out = self.path.parent / "config.yaml"
        keep_a_different_config(out, text)  # a resume with other settings
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text(text)
        os.replace(tmp, out)  # never a half-written config.yaml

    def close(self) -> None:
        if self._fh is not None and not self._fh.closed:
            self._fh.close()

    def __del__(self) -> None:
        self.close()


def _resume_configs(folder: Path) -> Dict[str, Path]:
    """The ``config.<k>.yaml`` files in ``folder`` (``keep_a_different_config``'s), by k."""
    found = {p.name[len("config."):-len(".yaml")]: p for p in folder.glob("config.*.yaml")}
    return {k: p for k, p in sorted(found.items()) if k.isdigit()}


def keep_a_different_config(out: Path, text: str) -> Optional[Path]:
    """Before ``out`` (config.yaml) is replaced by ``text``: an earlier, different one is kept as
    ``config.<k>.yaml``, the first free k (returned)."""
    if not out.is_file():
        return None
    earlier = out.read_text()
    if earlier == text or _same_settings(earlier, text):
        return None
    k = 1
    while (out.parent / f"config.{k}.yaml").exists():
        k += 1
    kept = out.parent / f"config.{k}.yaml"
    kept.write_text(earlier)
    return kept


# Keys whose value says how a run started, not what it trains: a resume of a run started
# without them is the same run (no copy of its config.yaml is kept for it).
_HOW_STARTED = ("resume_from_checkpoint",)


def _same_settings(earlier: str, text: str) -> bool:
    import yaml

    try:
        a, b = yaml.safe_load(earlier), yaml.safe_load(text)
    except yaml.YAMLError:
        return False
    if not isinstance(a, dict) or not isinstance(b, dict):
        return False
    return ({k: v for k, v in a.items() if k not in _HOW_STARTED}
            == {k: v for k, v in b.items() if k not in _HOW_STARTED})


def time_stamp(seconds: float) -> str:
    """A file time as the names of kept runs show it (``20261204-192141``)."""
    return time.strftime("%Y%m%d-%H%M%S", time.localtime(seconds))


def earlier_run_suffix(metrics_file: Path) -> str:
    """The name an earlier run's files are kept under when a fresh run starts beside them
    (``metrics.<suffix>.jsonl``, ``config.<suffix>.yaml``, its checkpoints in
    ``checkpoints.<suffix>/``): the time of ``metrics_file``'s last write, then ``-2``, ``-3``
    ... until ``metrics.<suffix>.jsonl`` is free. The same answer before and after the
    checkpoints move, so the earlier run's files share one name."""
    metrics_file = Path(metrics_file)
    stamp = time_stamp(metrics_file.stat().st_mtime)
    suffix, n = stamp, 1
    while metrics_file.with_name(f"{metrics_file.stem}.{suffix}{metrics_file.suffix}").exists():
        n += 1
        suffix = f"{stamp}-{n}"
    return suffix


def read_metrics(path: Union[str, Path], key: Optional[str] = None):
    """Rows of a metrics.jsonl file (or just ``key``'s values, in step order)."""
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    if key is None:
        return rows
    return [r[key] for r in rows if key in r]
