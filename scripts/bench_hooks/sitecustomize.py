"""Levers measured before any of them becomes a config key: set from the environment when a
Python process starts. bench_recipes.py puts this folder first on PYTHONPATH for the variants
that name one (``_HOOKS``), so only their runs see it.

- BENCH_ACTIVATION_MEMORY_BUDGET=0.9: torch.compile's partitioner keeps at most that fraction of
  the activations it would save, recomputing the cheapest ops in backward instead
  (torch._functorch.config.activation_memory_budget; torchtitan's "memory_budget" mode).
- BENCH_FP8_AUTO_FILTER=1: FP8 only where torchao's tensorwise heuristic expects a gain (it
  leaves layers with K <= 4096 and N <= 1024 in bf16: the 1B's k_proj and v_proj).
"""
import os

if os.environ.get("BENCH_ACTIVATION_MEMORY_BUDGET"):
    import torch._functorch.config as functorch_config

    functorch_config.activation_memory_budget = float(os.environ["BENCH_ACTIVATION_MEMORY_BUDGET"])

if os.environ.get("BENCH_FP8_AUTO_FILTER") == "1":
    try:
        from torchao.float8.float8_linear_utils import _auto_filter_for_recipe

        from tune_recipes.training.setup import fp8
    except ImportError:  # a process that is not a recipe run (the stock side never sets this)
        pass
    else:
        _auto = _auto_filter_for_recipe("tensorwise", filter_fqns=[])

        def _keep(module, fqn):
            return fp8.should_convert(module, fqn) and _auto(module, fqn)

        # model.py imported convert_to_fp8 by name: its default filter is what it calls.
        fp8.convert_to_fp8.__defaults__ = (_keep,)
