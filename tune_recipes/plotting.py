"""Draw a run's ``metrics.jsonl`` (or several runs, overlaid) into one PNG.

    from tune_recipes.plotting import plot_runs
    plot_runs(["outputs/run_a", "outputs/run_b"])       # -> outputs/run_a/metrics.png
    plot_runs(["outputs/run_a/metrics.20261205-215244.jsonl"])
                                              # -> outputs/run_a/metrics.20261205-215244.png

Four panels against the optimizer step: loss (train solid, validation ``val_loss`` dashed with
markers), learning rate, gradient norm, tokens/s per GPU. One colour per run; the legend names
each run by its folder.

Reading is forgiving, because the log is written by runs that crash, resume and change: a key a
run never logged leaves its panel empty ("no data"), NaN/inf (stored as the strings "nan",
"inf", "-inf", since JSON has none) are read back as floats and left out of the lines (the
panel says how many), an unfinished last line (a killed run) is skipped, and a step logged
twice (a resumed run repeats the steps after its last checkpoint) keeps the value logged last.

Matplotlib is used through its object API with the Agg canvas only: no display, no pyplot
global state, safe to call at the end of a training run.
"""

import json
import math
import re
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple, Union

from tune_recipes.constants import EPOCH_DIR_PATTERN, STEP_DIR_PATTERN

METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "metrics.png"
# The logger whose metrics.jsonl this module reads, as the shipped configs name it (its
# package sits above this one, so it is named here rather than imported).
JSONL_LOGGER = "tune_recipes.training.metrics.JsonlMetricLogger"

# (metric keys drawn in the panel, y label, panel title). The first key of the loss panel is
# drawn solid, the second dashed.
PANELS: List[Tuple[Tuple[str, ...], str, str]] = [
    (("loss", "val_loss"), "loss (token mean)", "loss"),
    (("lr",), "learning rate", "learning rate"),
    (("grad_norm",), "gradient norm (before clipping)", "gradient norm"),
    (("tokens_per_second_per_gpu",), "tokens / s / GPU", "throughput"),
]

Series = Tuple[List[int], List[float]]
PathLike = Union[str, Path]


class PlotError(ValueError):
    """A run folder without a readable metrics log; the message names the path."""


def _number(value) -> Optional[float]:
    """A metric value as a float; ``"nan"``/``"inf"`` strings included; None if not a number."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)  # "nan", "inf", "-inf", "Infinity", "1e-4"
        except ValueError:
            return None
    return None


def metrics_path(run: PathLike) -> Path:
    """``run`` itself if it is a file, else ``run/metrics.jsonl``."""
    p = Path(run)
    return p if p.is_file() else p / METRICS_FILE


def plot_path(run: PathLike) -> Path:
    """The picture ``plot_runs`` draws ``run`` into by default: its log's name with ``.png``.
    An output_dir or its ``metrics.jsonl``: ``metrics.png``; an earlier run's rows kept as
    ``metrics.<time>.jsonl``: ``metrics.<time>.png`` (the name its picture was kept under); a
    log named by ``metric_logger.filename`` (``train.jsonl``): ``train.png``. NOTE: the same
    name the metrics logger keeps an earlier run's picture under (``_keep_earlier_run``), so a
    fresh run never draws over another run's picture."""
    return metrics_path(run).with_suffix(".png")


# A run's checkpoint folders: epoch_<n>/, step_<n>/, recipe_state/.
_CHECKPOINT_FOLDERS = [re.compile(p) for p in (EPOCH_DIR_PATTERN, STEP_DIR_PATTERN, r"^recipe_state$")]


def _run_folder_signs(folder: Path) -> List[str]:
    """What marks ``folder`` as a training run's output_dir (or its logs folder): a config
    written by the run, checkpoint folders, torchtune DiskLogger logs (``log_<time>.txt``);
    empty when nothing does."""
    signs = [f.name for f in (folder / "config.yaml", folder / "torchtune_config.yaml")
             if f.is_file()]
    signs += sorted(f"{d.name}/" for d in folder.iterdir()
                    if d.is_dir() and any(p.match(d.name) for p in _CHECKPOINT_FOLDERS))
    return signs


def _disk_logs(folder: Path) -> List[str]:
    """torchtune DiskLogger logs in ``folder`` or one level down (stock configs log into
    ``${output_dir}/logs``), relative to ``folder``."""
    return sorted(str(f.relative_to(folder)) for pattern in ("log_*.txt", "*/log_*.txt")
                  for f in folder.glob(pattern) if f.is_file())


def _no_metrics_error(run: PathLike) -> PlotError:
    """Why ``run``, a folder, has nothing to plot, and what to give or change instead."""
    folder = Path(run)
    try:
        others = sorted(f.name for f in folder.glob("*.jsonl")) + sorted(
            str(f.relative_to(folder)) for f in folder.glob(f"*/{METRICS_FILE}"))
        disk_logs = _disk_logs(folder)
        signs = _run_folder_signs(folder)
    except OSError as e:
        return PlotError(f"cannot read {run}: {e.strerror or e}")
    if others:
        return PlotError(f"no {METRICS_FILE} in {run}; it holds {', '.join(others[:3])}: give "
                         "that file (a metric logger's filename or log_dir)")
    if disk_logs or signs:
        what = (f"its metric logger wrote {disk_logs[0]}, a torchtune DiskLogger log"
                if disk_logs else f"it holds {', '.join(signs[:3])}")
        return PlotError(
            f"no {METRICS_FILE} in {run}: the run wrote none ({what}); `tune plot` reads the "
            f"{METRICS_FILE} of our JsonlMetricLogger: train with "
            f"metric_logger._component_={JSONL_LOGGER} (the loggers of tune_recipes.loggers "
            "write it too)")
    return PlotError(f"no {METRICS_FILE} in {run} (is it a run's output_dir?)")


def metric_rows(text: str) -> List[dict]:
    """The rows of a metrics.jsonl file's ``text``, in order; a line cut short by a killed run
    (or anything not a JSON object) is skipped."""
    rows = []
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def load_metrics(run: PathLike) -> Dict[str, Series]:
    """Every numeric metric of a run as ``{key: (steps, values)}``, steps ascending and unique.

    ``run`` is an output dir or a metrics.jsonl file. For a step logged more than once, each
    key keeps the value of the last row that has it (a resumed run overwrites the steps it
    repeats; a validation row logged separately at the same step merges with the training row).
    """
    path = metrics_path(run)
    if not Path(run).exists():
        raise PlotError(f"{run}: no such file or folder (give a run's output_dir or its "
                        f"{METRICS_FILE})")
    if not path.is_file():
        raise _no_metrics_error(run)
    try:
        text = path.read_text()
    except UnicodeDecodeError:
        raise PlotError(f"{path} is not a metrics log (not text); give a run's output_dir or "
                        f"its {METRICS_FILE}") from None
    except OSError as e:
        raise PlotError(f"cannot read {path}: {e.strerror or e}") from None
    by_key: Dict[str, Dict[int, float]] = {}
    for row in metric_rows(text):
        if _number(row.get("step")) is None:
            continue
        step = int(_number(row["step"]))
        for key, value in row.items():
            if key in ("step", "time"):
                continue
            x = _number(value)
            if x is not None:
                by_key.setdefault(key, {})[step] = x  # later rows win
    return {k: (sorted(v), [v[s] for s in sorted(v)]) for k, v in by_key.items()}


def run_labels(runs: Sequence[PathLike]) -> List[str]:
    """Short legend names: each run folder's name, or more of its path where names collide;
    two logs of one folder (a run and the earlier run kept beside it as
    ``metrics.<time>.jsonl``) are told apart by the name of any log but ``metrics.jsonl``."""
    paths = [metrics_path(r).resolve() for r in runs]

    def label(path: Path, depth: int, with_file: bool) -> str:
        folder = "/".join(path.parent.parts[-depth:])
        return f"{folder}/{path.name}" if with_file and path.name != METRICS_FILE else folder

    for with_file in (False, True):
        for depth in range(1, 1 + max(len(p.parent.parts) for p in paths)):
            labels = [label(p, depth, with_file) for p in paths]
            if len(set(labels)) == len(labels):
                return labels
    return [str(p) for p in paths]  # the same log twice


def _finite(series: Series) -> Tuple[List[int], List[float], int]:
    """The series with non-finite values as NaN (matplotlib leaves a gap in the line there,
    and inf would break the axis limits), and how many there were."""
    steps, values = series
    clean = [v if math.isfinite(v) else math.nan for v in values]
    return steps, clean, sum(1 for v in values if not math.isfinite(v))


def plot_runs(runs: Sequence[PathLike], out: Optional[PathLike] = None,
              title: Optional[str] = None) -> Path:
    """Draw ``runs`` (output dirs or metrics.jsonl files) into a PNG; returns its path.

    Default ``out``: the first run's own picture (``plot_path``): ``metrics.png`` in its folder,
    or for a kept earlier run's ``metrics.<time>.jsonl`` its ``metrics.<time>.png``.
    """
    if not runs:
        raise PlotError("no run to plot")
    data = [load_metrics(r) for r in runs]
    for run, metrics in zip(runs, data):
        if not metrics:
            raise PlotError(f"{metrics_path(run)} holds no readable row (none with a step and a "
                            "number): nothing to plot")
    labels = run_labels(runs)
    out = Path(out) if out is not None else plot_path(runs[0])

    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    formats = FigureCanvasAgg.get_supported_filetypes()
    if out.suffix == "":
        # NOTE: matplotlib adds .png to a name without a suffix; name it here, so the path
        # returned (and printed by `tune plot`) is the file written.
        out = out.with_name(out.name + ".png")
    elif out.suffix.lstrip(".").lower() not in formats:
        raise PlotError(f"{out}: cannot draw a {out.suffix} file; name a .png (or "
                        f"{', '.join('.' + f for f in sorted(formats) if f != 'png')})")
    if any(out.resolve() == metrics_path(r).resolve() for r in runs):
        raise PlotError(f"{out} is a log being plotted: the picture would replace it; name "
                        "another file to draw into (--out)")

    # Fixed margins, not layout="constrained": the panels never change, and the constraint
    # solver took 0.8 s of a 1.7 s plot at the end of every run.
    fig = Figure(figsize=(12, 8), dpi=110)
    fig.subplots_adjust(left=0.07, right=0.98, bottom=0.07, top=0.86 if title else 0.89,
                        hspace=0.32, wspace=0.2)
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, 2, sharex=True).ravel()
    colors = [f"C{i % 10}" for i in range(len(runs))]
    for ax, (keys, ylabel, panel_title) in zip(axes, PANELS):
        dropped = 0
        drawn = False
        drawn_values: List[float] = []
        for metrics, label, color in zip(data, labels, colors):
            for i, key in enumerate(keys):
                if key not in metrics:
                    continue
                steps, values, n_bad = _finite(metrics[key])
                dropped += n_bad
                finite = [v for v in values if not math.isnan(v)]
                if not finite:
                    continue
                drawn = True
                drawn_values += finite
                style = dict(linestyle="-", linewidth=1.6) if i == 0 else dict(
                    linestyle="--", linewidth=1.6, marker="o", markersize=4)
                if len(finite) == 1:  # a line through one point draws nothing
                    style.update(marker="o", markersize=5)
                ax.plot(steps, values, color=color, label=label if i == 0 else None, **style)
        if not drawn:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes,
                    color="0.5", fontsize=12)
        if len(keys) > 1 and any(keys[1] in m for m in data):
            panel_title += ": train solid, validation dashed"
        if keys == ("grad_norm",) and drawn_values and min(drawn_values) > 0 \
                and max(drawn_values) > 100 * min(drawn_values):
            # One spike would flatten every other step into the axis.
            ax.set_yscale("log")
            panel_title += " (log scale)"
        if dropped:
            panel_title += f" ({dropped} non-finite value{'s' if dropped > 1 else ''} not drawn)"
        ax.set_title(panel_title, fontsize=11)
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        if ax.get_yscale() == "linear":
            ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 4))
    for ax in axes[2:]:
        ax.set_xlabel("optimizer step")
    for ax in axes[:2]:
        ax.tick_params(labelbottom=True)
        ax.set_xlabel("optimizer step")
    # One legend for the figure: a colour per run (line styles are explained in the loss title).
    handles, names = [], []
    for ax in axes:
        for h, n in zip(*ax.get_legend_handles_labels()):
            if n not in names:
                handles.append(h)
                names.append(n)
    if handles:
        fig.legend(handles, names, loc="upper center", ncols=min(len(names), 4), fontsize=10,
                   frameon=False, bbox_to_anchor=(0.5, 0.95 if title else 0.99))
    if title:
        fig.suptitle(title, fontsize=12, y=0.99)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out)
    except OSError as e:
        raise PlotError(f"cannot write {out}: {e.strerror or e}") from None
    return out
