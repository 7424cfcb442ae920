"""Levers measured before any of them becomes a config key: set from the environment when a
Python process starts. bench_recipes.py puts this folder first on PYTHONPATH for the variants
that set BENCH_HOOKS, so only their runs see it. (Session 11's activation memory budget was
measured this way; it is now the key ``activation_memory_budget``.)

- BENCH_MEMORY_SNAPSHOT=PATH: the recipe's process records every CUDA allocation from its
  start and writes torch's memory snapshot to PATH.<pid> at exit, for scripts/memory_peak.py.
- BENCH_FP8_AUTO_FILTER=1: FP8 only where torchao's tensorwise heuristic expects a gain (it
  leaves layers with K <= 4096 and N <= 1024 in bf16: the 1B's k_proj and v_proj).
- BENCH_FP8_FAST_ACCUM=1: the backward FP8 products (input and weight gradients) also use
  cuBLAS's fast accumulation, which torchao turns on only for the forward product
  (scripts/bench_fp8_accum.py times and measures both settings alone).
"""
import os
import sys

# Only the recipe's process (``python -m tune_recipes run``), not inductor's compile workers.
_IS_RECIPE = "tune_recipes" in " ".join(getattr(sys, "orig_argv", []))

if os.environ.get("BENCH_MEMORY_SNAPSHOT") and _IS_RECIPE:
    import atexit

    import torch

    # From the start, so that replaying the trace sees every live block (scripts/memory_peak.py).
    torch.cuda.memory._record_memory_history(context="alloc", stacks="python",
                                             max_entries=2_000_000)

    def _dump(path=f"{os.environ['BENCH_MEMORY_SNAPSHOT']}.{os.getpid()}"):
        import json

        torch.cuda.memory._dump_snapshot(path)
        stats = torch.cuda.memory_stats()
        with open(path + ".peaks.json", "w") as f:  # what memory_peak.py checks its replay against
            json.dump({"requested_bytes_peak": stats.get("requested_bytes.all.peak"),
                       "allocated_bytes_peak": stats.get("allocated_bytes.all.peak")}, f)

    atexit.register(_dump)

if os.environ.get("BENCH_FP8_AUTO_FILTER") == "1" and _IS_RECIPE:
    from torchao.float8.float8_linear_utils import _auto_filter_for_recipe

    from tune_recipes.training.setup import fp8

    _auto = _auto_filter_for_recipe("tensorwise", filter_fqns=[])

    def _keep(module, fqn):
        return fp8.should_convert(module, fqn) and _auto(module, fqn)

    # model.py imported convert_to_fp8 by name: its default filter is what it calls.
    fp8.convert_to_fp8.__defaults__ = (_keep,)

if os.environ.get("BENCH_FP8_FAST_ACCUM") == "1" and _IS_RECIPE:
    import dataclasses

    from torchao.float8 import Float8LinearConfig
    from torchao.float8.config import Float8GemmConfig

    _from_recipe_name = Float8LinearConfig.from_recipe_name

    def _fast_everywhere(recipe_name):
        fast = Float8GemmConfig(use_fast_accum=True)
        return dataclasses.replace(_from_recipe_name(recipe_name), gemm_config_output=fast,
                                   gemm_config_grad_input=fast, gemm_config_grad_weight=fast)

    # fp8.convert_to_fp8 imports Float8LinearConfig when it runs: the class's method is what it calls.
    Float8LinearConfig.from_recipe_name = staticmethod(_fast_everywhere)
