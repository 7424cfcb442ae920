"""Metrics a user can plot: one JSON object per line in ``<log_dir>/metrics.jsonl``."""

import json
import math
import os
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
    are written: a crash loses nothing already logged. Append mode keeps a resumed run's history
    in the same file.
    """

    def __init__(self, log_dir: Union[str, Path], filename: str = "metrics.jsonl") -> None:
        self._fh = None  # NOTE: first, so close()/__del__ work when the open below fails
        self.path = Path(log_dir) / filename
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fh = open(self.path, "a", buffering=1)
        except OSError as e:
            raise ConfigError(
                f"cannot write the metrics file {self.path}: {e.strerror or e}; is output_dir "
                "writable?"
            ) from None

    def drop_rows_after(self, step: int) -> None:
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

    def log(self, name: str, data: Any, step: int) -> None:
        self.log_dict({name: data}, step)

    def log_dict(self, payload: Mapping[str, Any], step: int) -> None:
        row: Dict[str, Any] = {"step": int(step), "time": round(time.time(), 3)}
        row.update({k: _plain(v) for k, v in payload.items()})
        self._fh.write(json.dumps(row) + "\n")

    def log_config(self, config) -> None:
        from omegaconf import OmegaConf

        out = self.path.parent / "config.yaml"
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text(OmegaConf.to_yaml(config, resolve=True))
        os.replace(tmp, out)  # never a half-written config.yaml

    def close(self) -> None:
        if self._fh is not None and not self._fh.closed:
            self._fh.close()

    def __del__(self) -> None:
        self.close()


def read_metrics(path: Union[str, Path], key: Optional[str] = None):
    """Rows of a metrics.jsonl file (or just ``key``'s values, in step order)."""
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    if key is None:
        return rows
    return [r[key] for r in rows if key in r]
