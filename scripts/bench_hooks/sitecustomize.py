"""Levers measured before any of them becomes a config key: set from the environment when a
Python process starts. bench_recipes.py puts this folder first on PYTHONPATH for the variants
that set BENCH_HOOKS, so only their runs see it. (Session 11's activation memory budget was
measured this way; it is now the key ``activation_memory_budget``; session 12's
BENCH_FP8_FAST_ACCUM, FP8 fast accumulation in the backward products, is now the key
``fp8_fast_accum_backward``.)

- BENCH_MEMORY_SNAPSHOT=PATH: the recipe's process records every CUDA allocation from its
  start and writes torch's memory snapshot to PATH.<pid> at exit, for scripts/memory_peak.py.
- BENCH_FP8_AUTO_FILTER=1: FP8 only where torchao's tensorwise heuristic expects a gain (it
  leaves layers with K <= 4096 and N <= 1024 in bf16: the 1B's k_proj and v_proj).
- BENCH_FP8_MLP_PER_ROW=1 / 0: ``fp8_mlp_activations`` keeps g and u with one e4m3 scale per
  token (1: session 12's form; a full fine-tune now scales per tensor, the per-token kernels
  cost 10-12% of a 1B step) or per tensor (0: also with LoRA, which keeps per-token scales by
  default, measured at 8B with them). Session 13's runs also set BENCH_FP8_MLP_TENSORWISE=1 and BENCH_FP8_MLP_LAYERS=N
  here, before per-tensor scales became the default and N the key ``fp8_mlp_layers``.
- BENCH_COMPILE_MODE=MODE: every ``nn.Module.compile`` in the recipe's process (the whole-model
  compile of ``compile_scope: model``, and torchtune's per-layer one) with torch.compile's
  ``mode`` MODE, e.g. ``reduce-overhead`` (CUDA graphs: no per-kernel launch from Python). The
  1B best step's GPU is busy 100.4 of ~105-107 ms (s13prof against the unprofiled rate): if
  the host is what it waits on, CUDA graphs remove it.
- BENCH_SDPA_IMPL=flash / FA4: SDPA without cuDNN's attention (which torch picks on the H200),
  so the flash path runs: torch's built-in kernel, or FlashAttention-4 once activated through
  torch's flash-impl registry (wheels: scripts/fa4_wheels.sh; gpu_session.sh steps fa4a, fa4).
- BENCH_FLCE_READ_GRAD_OUTPUT=1: the step does not declare the gradient that reaches the fused
  loss, so its backward reads it with ``.item()`` (a host sync a step) as before session 14:
  the A/B of ``declare_grad_output``.
- BENCH_MEMORY_CAP_GIB=G: the CUDA caching allocator of the training process (ours or stock's
  recipe file) capped at G GiB (``torch.cuda.set_per_process_memory_fraction``), as on a GPU of
  about G + 0.5 GiB (the CUDA context is outside the cap): does the run fit there?
- BENCH_FLEX_IN_GRAPH=1: on packed data (a BlockMask), attention calls ``flex_attention``
  itself, so torch.compile traces it into the model's graph. torchtune calls a separately
  compiled flex attention behind ``torch.compiler.disable``, which cuts every layer's graph in
  two (session 10: the packed 1B ran 1.094x, against 1.3x on fixed-length batches). Only with
  ``compile: True``: eagerly, flex_attention runs its unfused reference.
- BENCH_SDPA_GQA=1: on unpacked data (no mask), attention takes grouped-query k and v as the
  projections made them (SDPA's ``enable_gqa``) instead of torchtune's copies expanded to every
  query head (``expand(...).flatten(1, 2)`` in MultiHeadAttention.forward), which SDPA saves for
  backward: ~0.75 GiB at the 1B (16 layers x 50 MB), ~1.6 GB at 8B. It slices the expanded
  copy back (``k[:, ::group]``), so only while torch.compile traces, where the copy is never
  made: the slice reads the projections' values directly.
"""
import os
import sys

# Only the recipe's process (``python -m tune_recipes run``), not inductor's compile workers.
_IS_RECIPE = "tune_recipes" in " ".join(getattr(sys, "orig_argv", []))
# Ours or torchtune's stock recipe file (``python .../recipes/<name>.py --config ...``).
_IS_TRAINING = _IS_RECIPE or any(
    a.endswith(".py") and os.path.basename(os.path.dirname(a)) == "recipes"
    for a in getattr(sys, "orig_argv", []))

if os.environ.get("BENCH_MEMORY_CAP_GIB") and _IS_TRAINING:
    import torch

    if torch.cuda.is_available():
        _total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(float(os.environ["BENCH_MEMORY_CAP_GIB"]) * 2**30 / _total, 0)

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

    # model.py imported convert_to_fp8 by name: its default filter is what it calls (the
    # first of its defaults; the others stay).
    fp8.convert_to_fp8.__defaults__ = (_keep, *fp8.convert_to_fp8.__defaults__[1:])

if os.environ.get("BENCH_FP8_MLP_PER_ROW") in ("0", "1") and _IS_RECIPE:
    from tune_recipes.modules import fp8_mlp

    # per_row's default (None: the measured choice) on the function object, which model.py
    # imported by name.
    fp8_mlp.convert_mlps_to_fp8_saved.__defaults__ = (os.environ["BENCH_FP8_MLP_PER_ROW"] == "1", None)

if os.environ.get("BENCH_COMPILE_MODE") and _IS_RECIPE:
    import torch

    _module_compile = torch.nn.Module.compile

    def _compile_with_mode(self, *args, **kwargs):
        kwargs.setdefault("mode", os.environ["BENCH_COMPILE_MODE"])
        return _module_compile(self, *args, **kwargs)

    # compile_layers_or_model's whole-model branch and torchtune's compile_model both call it.
    torch.nn.Module.compile = _compile_with_mode

if os.environ.get("BENCH_SDPA_IMPL") in ("flash", "FA4") and _IS_RECIPE:
    import torch

    if os.environ["BENCH_SDPA_IMPL"] == "FA4":
        from torch.nn.attention import activate_flash_attention_impl

        activate_flash_attention_impl("FA4")
    # Off: cuDNN and the memory-efficient kernel; flash is then SDPA's first choice (math stays
    # as the fallback for calls flash cannot take).
    torch.backends.cuda.enable_cudnn_sdp(False)
    torch.backends.cuda.enable_mem_efficient_sdp(False)

if os.environ.get("BENCH_FLCE_READ_GRAD_OUTPUT") == "1" and _IS_RECIPE:
    from tune_recipes.training.step import normalization

    normalization.declare_grad_output = lambda loss, grad_output: False

if os.environ.get("BENCH_FLEX_IN_GRAPH") == "1" and _IS_RECIPE:
    import tune_recipes  # noqa: F401 - first: its notice filters, before torchtune imports torchao
    import torch
    from torch.nn.attention.flex_attention import BlockMask, flex_attention
    from torchtune.modules import attention as tt_attention

    _attention_factory = tt_attention._sdpa_or_flex_attention

    def _attention_traced_on_block_masks():
        fallback = _attention_factory()

        def _attention_call(q, k, v, mask, dropout_p, is_causal):
            # NOTE: only while torch.compile traces: called eagerly (compile off, or a frame
            # dynamo gave up on), flex_attention runs its unfused reference (the whole score
            # matrix, ~2 GiB a layer at 4 x 32 heads x 2048^2), so torchtune's compiled call
            # stays the eager path.
            if isinstance(mask, BlockMask) and torch.compiler.is_compiling():
                if dropout_p > 0.0:
                    raise ValueError("flex attention has no dropout; set attn_dropout=0")
                return flex_attention(q, k, v, block_mask=mask)
            return fallback(q, k, v, mask, dropout_p, is_causal)

        return _attention_call

    # MultiHeadAttention.__init__ calls the factory through its module's globals.
    tt_attention._sdpa_or_flex_attention = _attention_traced_on_block_masks

if os.environ.get("BENCH_SDPA_GQA") == "1" and _IS_RECIPE:
    import tune_recipes  # noqa: F401 - first: its notice filters, before torchtune imports torchao
    import torch
    from torchtune.modules import attention as tt_attention

    _mha_init = tt_attention.MultiHeadAttention.__init__

    def _init_with_grouped_kv(self, *args, **kwargs):
        _mha_init(self, *args, **kwargs)
        group = self.num_heads // self.num_kv_heads
        if group == 1:
            return
        expanded_call = self._attention_call

        def _attention_call(q, k, v, mask, dropout_p, is_causal):
            # k, v: [b, num_kv_heads * group, s, d], query head h reading kv head h // group,
            # as enable_gqa pairs them; every group-th head is the projection's own.
            if mask is None and torch.compiler.is_compiling():
                return torch.nn.functional.scaled_dot_product_attention(
                    q, k[:, ::group], v[:, ::group], dropout_p=dropout_p, is_causal=is_causal,
                    enable_gqa=True)
            return expanded_call(q, k, v, mask, dropout_p, is_causal)

        self._attention_call = _attention_call

    tt_attention.MultiHeadAttention.__init__ = _init_with_grouped_kv
