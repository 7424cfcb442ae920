"""Hooks set from the environment when a Python process starts: scripts/bench_recipes.py puts
this folder first on PYTHONPATH for every run it launches. They apply only to a training process,
never to inductor's compile workers: the clock and the memory cap to both sides' (ours through
``-m tune_recipes``, or any recipe file in a ``recipes`` folder), as each lever below says.

- BENCH_CLOCK=PATH: the benchmark's timer and true peak memory, identical for both sides
  (bench_clock.py says how it measures).
- BENCH_GC_FREEZE=1 (with BENCH_CLOCK=PATH): a full collection and ``gc.freeze()`` when the
  clock's warm-up ends (bench_clock.py): are full collections what stalls a window's step?
- BENCH_HOST_SAMPLES=1 (with BENCH_CLOCK=PATH): every thread's Python stack sampled while the
  window runs (host_sampler.py), the shares in the clock's JSON as ``host_samples``: where a
  step spends the host's time.
- BENCH_GPU_SLEEP_MS=MS (with BENCH_CLOCK=PATH): a sleep kernel of about MS ms (cycles at the
  SM clock NVML reads; no sleep without NVML) queued before each window step, timed by events
  (the clock's ``gpu_sleep_ms_per_step`` and ``window_less_sleeps_ms_per_step``): does more GPU
  work a step lengthen the step by as much (the GPU's timeline sets it) or less (the host's
  does)? A sleep long enough to keep the GPU the slower side leaves the steps' GPU time as the
  window less its sleeps. Not a speed row.
- BENCH_LOADER_WORKERS=N: ours' dataloader fetches and collates in N worker processes, its
  batches in pinned memory (torch's DataLoader ``num_workers``, ``pin_memory``) instead of in
  the training process: what the data path costs a step whose host is busy.
- BENCH_MEMORY_AT_PEAK=1 (with BENCH_CLOCK=PATH): what is live on the GPU at the run's peak of
  allocated memory, by where it was allocated, in PATH.memory.txt (memory_at_peak.py).
- BENCH_MEMORY_CAP_GIB=G: the CUDA caching allocator capped at G GiB
  (``torch.cuda.set_per_process_memory_fraction``), as on a GPU of about G + 0.5 GiB (the CUDA
  context is outside the cap): does the run fit there?
- BENCH_SDPA_NO_CUDNN=1: SDPA without its cuDNN backend (``torch.backends.cuda.enable_cudnn_sdp``),
  both sides. On sm90 torch tries cuDNN attention first, and cuDNN builds an execution plan for
  each new shape (batch, sequence length): padded batches, a new length most steps, may pay
  that build every step.
- BENCH_PAD_MULTIPLE=N: both sides' padded batches go on to a multiple of N tokens (the padding
  never scored): torchtune's ``padded_collate_sft`` for stock, the multiple ours pads to
  (``padded_batch_multiple``: 128 on a GPU by default) for ours; N=1 pads ours to the longest
  row only, as stock does. Its tokens/s counts the added padding: compare label tokens/s.
- BENCH_BACKED_SIZE_OBLIVIOUS=1: torch.compile reasons about every dynamic size as if it
  could be any size (``torch.fx.experimental._config.backed_size_oblivious``), ours only. A
  graph compiled for dynamic lengths otherwise guards on choices Inductor made by the first
  batch's length (compiled per layer on unpacked rows: ``length <= 2559``), and the first
  longer batch compiles it again; this asks whether the lever removes that, and at what speed.
- BENCH_AC_NON_REENTRANT=1: ours' checkpointed layers through torch's non-reentrant checkpoint
  (torchtune's) instead of the reentrant one its eager single-device recipes pick
  (``checkpoint_reentrant`` in tune_recipes/training/setup/activations.py): what the reentrant
  checkpoint's lighter host work buys in a host-bound eager step.
- BENCH_NF4_TORCHAO=1: ours' QLoRA dequantizes its NF4 weights with torchao's own method
  instead of tune_recipes/modules/nf4.py's (the same bits, 13 kernels against 5).
- BENCH_TORCHTUNE_ROPE=1: ours' eager models keep torchtune's Llama RoPE instead of
  tune_recipes/modules/rope.py's (the same bits, 45 operators a call forward and backward
  against 26).
- BENCH_TORCHTUNE_RMS_NORM=1: ours' eager models keep torchtune's RMSNorm (the composite of
  many kernels torch falls back to with a bf16 weight) instead of tune_recipes/modules/rms_norm.py's
  (the same arithmetic through torch's fused kernel).
- BENCH_SDPA_GQA=1: on unpacked data (no mask), attention takes grouped-query k and v as the
  projections made them (SDPA's ``enable_gqa``) instead of torchtune's copies expanded to every
  query head (``expand(...).flatten(1, 2)`` in MultiHeadAttention.forward), which SDPA saves for
  backward: ~0.75 GiB at the 1B (16 layers x 50 MB), ~1.6 GB at 8B. It slices the expanded
  copy back (``k[:, ::group]``), so only while torch.compile traces, where the copy is never
  made: the slice reads the projections' values directly.
- BENCH_TORCHTUNE_MLP=1: ours' compiled full fine-tune keeps torchtune's MLP, whose graph saves
  the down projection's input, instead of recomputing it in backward
  (tune_recipes/modules/swiglu_down.py): what the recompute costs and saves.
- BENCH_EXPANDED_KV=1: ours' attention over document spans gets k and v as views of torchtune's
  copies expanded to every query head (which the attention then saves, keeping the expansion
  alive) instead of one head a group in memory of its own (_one_copy_a_group in
  tune_recipes/modules/document_attention.py).
"""
import os
import sys

# Only the recipe's process (``python -m tune_recipes run``), not inductor's compile workers.
_IS_RECIPE = "tune_recipes" in " ".join(getattr(sys, "orig_argv", []))
# Ours or torchtune's stock recipe file (``python .../recipes/<name>.py --config ...``).
_IS_TRAINING = _IS_RECIPE or any(
    a.endswith(".py") and os.path.basename(os.path.dirname(a)) == "recipes"
    for a in getattr(sys, "orig_argv", []))

if os.environ.get("BENCH_CLOCK") and _IS_TRAINING:
    import bench_clock

    bench_clock.install_from_env()

if os.environ.get("BENCH_MEMORY_AT_PEAK") == "1" and os.environ.get("BENCH_CLOCK") and _IS_TRAINING:
    import memory_at_peak

    memory_at_peak.install_from_env()

if os.environ.get("BENCH_LOADER_WORKERS") and _IS_RECIPE:
    from torchdata.stateful_dataloader import StatefulDataLoader as _StatefulDataLoader

    _loader_init = _StatefulDataLoader.__init__

    def _init_with_workers(self, *args, **kwargs):
        import torch

        kwargs.setdefault("num_workers", int(os.environ["BENCH_LOADER_WORKERS"]))
        kwargs.setdefault("pin_memory", torch.cuda.is_available())
        _loader_init(self, *args, **kwargs)

    _StatefulDataLoader.__init__ = _init_with_workers

if os.environ.get("BENCH_MEMORY_CAP_GIB") and _IS_TRAINING:
    import torch

    if torch.cuda.is_available():
        _total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(float(os.environ["BENCH_MEMORY_CAP_GIB"]) * 2**30 / _total, 0)

if os.environ.get("BENCH_SDPA_NO_CUDNN") == "1" and _IS_TRAINING:
    import torch

    torch.backends.cuda.enable_cudnn_sdp(False)

if os.environ.get("BENCH_PAD_MULTIPLE") and _IS_TRAINING:
    import functools

    # tune_recipes first (its notice filters, before torchtune imports torchao); on stock's side
    # only for its padding function, which patches nothing
    from tune_recipes.data.collate import padded_to_a_multiple as _padded_to_a_multiple
    import torchtune.data

    _multiple = int(os.environ["BENCH_PAD_MULTIPLE"])
    # both sides resolve torchtune's collate by this path
    torchtune.data.padded_collate_sft = functools.partial(
        _padded_to_a_multiple, collate=torchtune.data.padded_collate_sft, pad_to_multiple_of=_multiple)
    if _IS_RECIPE:  # ours: the multiple its padded batches go on to on a GPU
        from tune_recipes.training.setup import data as _data
        from tune_recipes.training.setup import recipe as _recipe

        _data.padded_batch_multiple = _recipe.padded_batch_multiple = lambda device: _multiple

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

if os.environ.get("BENCH_BACKED_SIZE_OBLIVIOUS") == "1" and _IS_RECIPE:
    import torch.fx.experimental._config as _fx_config

    _fx_config.backed_size_oblivious = True

if os.environ.get("BENCH_AC_NON_REENTRANT") == "1" and _IS_RECIPE:
    import tune_recipes.training.setup.activations as _activations

    # The recipes import the name into their own module when they start, after this hook.
    _activations.checkpoint_reentrant = lambda cfg: False

if os.environ.get("BENCH_NF4_TORCHAO") == "1" and _IS_RECIPE:
    import tune_recipes.modules.nf4 as _nf4

    # The LoRA setup imports the name when the recipe starts, after this hook.
    _nf4.use_lean_nf4_dequantization = lambda: False

if os.environ.get("BENCH_TORCHTUNE_ROPE") == "1" and _IS_RECIPE:
    import tune_recipes.modules.rope as _rope

    # The model setup imports the name when the recipe starts, after this hook.
    _rope.use_interleaved_rope = lambda model: 0

if os.environ.get("BENCH_TORCHTUNE_RMS_NORM") == "1" and _IS_RECIPE:
    import tune_recipes.modules.rms_norm as _rms_norm

    # The model setup imports the name when the recipe starts, after this hook.
    _rms_norm.use_fused_rms_norm = lambda model: 0

if os.environ.get("BENCH_TORCHTUNE_MLP") == "1" and _IS_RECIPE:
    import tune_recipes  # noqa: F401 - first: its notice filters, before torchtune imports torchao
    from tune_recipes.training.setup import model as _model

    _model.recompute_down_inputs = lambda model: 0

if os.environ.get("BENCH_EXPANDED_KV") == "1" and _IS_RECIPE:
    import tune_recipes  # noqa: F401 - first: its notice filters, before torchtune imports torchao
    from tune_recipes.modules import document_attention as _document_attention

    _document_attention._one_copy_a_group = (
        lambda t, kv_heads: t if t.shape[1] == kv_heads else t.unflatten(1, (kv_heads, -1))[:, :, 0])
