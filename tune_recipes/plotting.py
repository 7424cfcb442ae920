"""Draw a run's ``metrics.jsonl`` (or several runs, overlaid) into one PNG.

    from tune_recipes.plotting import plot_runs
    plot_runs(["outputs/run_a", "outputs/run_b"])       # -> outputs/run_a/metrics.png

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
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple, Union

METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "metrics.png"

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
        others = sorted(f.name for f in Path(run).glob("*.jsonl")) if Path(run).is_dir() else []
        hint = (f"; it holds {', '.join(others[:3])}: give that file (a metric logger's "
                "filename)" if others else " (is it a run's output_dir?)")
        raise PlotError(f"no {METRICS_FILE} in {run}{hint}")
    by_key: Dict[str, Dict[int, float]] = {}
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by a killed run
        if not isinstance(row, dict) or _number(row.get("step")) is None:
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
    """Short legend names: each run folder's name, or more of its path where names collide."""
    dirs = [metrics_path(r).resolve().parent for r in runs]
    for depth in range(1, 1 + max(len(d.parts) for d in dirs)):
        labels = ["/".join(d.parts[-depth:]) for d in dirs]
        if len(set(labels)) == len(labels):
            return labels
    return [str(d) for d in dirs]  # the same folder twice


def _finite(series: Series) -> Tuple[List[int], List[float], int]:
    """The series with non-finite values as NaN (matplotlib leaves a gap in the line there,
    and inf would break the axis limits), and how many there were."""
    steps, values = series
    clean = [v if math.isfinite(v) else math.nan for v in values]
    return steps, clean, sum(1 for v in values if not math.isfinite(v))


def plot_runs(runs: Sequence[PathLike], out: Optional[PathLike] = None,
              title: Optional[str] = None) -> Path:
    """Draw ``runs`` (output dirs or metrics.jsonl files) into a PNG; returns its path.

    Default ``out``: ``metrics.png`` in the first run's folder.
    """
    if not runs:
        raise PlotError("no run to plot")
    data = [load_metrics(r) for r in runs]
    for run, metrics in zip(runs, data):
        if not metrics:
            raise PlotError(f"{metrics_path(run)} holds no readable row (none with a step and a "
                            "number): nothing to plot")
    labels = run_labels(runs)
    out = Path(out) if out is not None else metrics_path(runs[0]).parent / PLOT_FILE

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
