"""``tune_recipes.training.metrics.JsonlMetricLogger`` is the ``metric_logger`` component path
every shipped config (and users' configs) name; the code lives in ``reporting/metrics.py``."""

from tune_recipes.training.reporting.metrics import JsonlMetricLogger, read_metrics

__all__ = ["JsonlMetricLogger", "read_metrics"]
