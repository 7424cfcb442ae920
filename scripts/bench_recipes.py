"""Our recipes vs torchtune 0.6.1's stock recipes, each at its best settings, side by side.

    python3 scripts/bench_recipes.py --cases full_1b,lora_8b --reps 2 --out results/recipes.json
    python3 scripts/bench_recipes.py --cases tiny_cpu --reps 2 --out /tmp/r.json   # CPU dry run
    python3 scripts/bench_recipes.py --plot results/recipes.json                    # chart again
    python3 scripts/bench_recipes.py --preset claim --reps 2 --out results/claim.json  # issue #15's table

Each run writes the JSON (every run's row, as it finishes), a PNG chart and the Markdown table
(``.md``) beside ``--out``.

Each case builds a random-init checkpoint with the real model's shapes (nothing can be
downloaded on the benchmark machine) and runs its variants, each in its own process through its
own CLI (stock: torchtune's recipe file; ours: ``python -m tune_recipes run``), on the same
synthetic fixed-length data, with the same tokens per optimizer step (a smaller micro-batch is
made up by gradient accumulation) and the same number of steps. Variants marked ``head`` (each
side's best settings) run every repetition, in alternating order (stock, ours, ...; then the
reverse); the others (one lever each) run in the first repetition only.

Throughput is measured the same way for both sides: tokens over the wall time between metric
rows after the warm-up rows. Both recipes wait for the GPU before a row is written (stock's
``loss.item()`` before its clock read; ours, on CUDA, writes step k's row one step late, after
waiting on a CUDA event recorded at the end of step k: ``DeviceValues`` in
tune_recipes/training/reporting/progress.py), so the row times are synchronized; the recipe's
own median tokens/s is recorded beside it as a cross-check.
Peak memory: the largest ``torch.cuda.max_memory_allocated`` a run logs (stock's
``peak_memory_alloc``, ours ``peak_memory_active_gib``; the same counter).

Data: uniform random tokens by default; with ``data_vocab``/``data_repeat`` (tune_recipes.data
.synthetic) a learnable stream, so a long run's loss curve shows whether FP8 follows bf16.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import yaml

REPO = Path(__file__).resolve().parents[1]
H200_BF16_TFLOPS = 790.0  # dense bf16 matmul rate measured on the lent H200 (docs/benchmarks.md)

_CHUNKED = {"_component_": "torchtune.modules.loss.CEWithChunkedOutputLoss"}
_FUSED = {"_component_": "tune_recipes.modules.loss.FusedLinearCrossEntropyLoss"}


def _profiler(tag):
    """torchtune's profiler key: CPU + CUDA activities over 3 optimizer steps after 7."""
    return {"_component_": "torchtune.training.setup_torch_profiler", "enabled": True,
            "output_dir": f"/tmp/bw/prof_{tag}", "cpu": True, "cuda": True, "profile_memory": False,
            "with_stack": False, "record_shapes": False, "with_flops": False,
            "wait_steps": 5, "warmup_steps": 2, "active_steps": 3, "num_cycles": 1}


def _v(name, side, label, head=False, steps=None, env=None, ref=None, **cfg):
    """A variant: config overrides on top of the case's common config (``env``: extra
    environment variables for its run; ``ref``: the variant whose loss curve this one's is
    compared with, when not the ``_fp8``-less name)."""
    return dict(name=name, side=side, label=label, head=head, steps=steps, cfg=cfg, env=env or {},
                ref=ref)


# The same three variants the earlier runs used (identical settings, only the recipe/loss differ).
_SAME_SETTINGS = [
    _v("stock_chunked", "stock", "torchtune 0.6.1 stock recipe, chunked CE", head=True, loss=_CHUNKED),
    _v("ours_chunked", "ours", "tune-recipes, chunked CE", head=True, loss=_CHUNKED),
    _v("ours_fused", "ours", "tune-recipes, fused linear CE", head=True, loss=_FUSED),
]

# Llama-3.2-1B full fine-tune on two GPUs (FSDP2), per-rank batch 4 x 2048: the 2-GPU cases
# share everything but the steps and variants.
_FULL_1B_2GPU = dict(
    recipe="full_finetune_distributed", nproc=2,
    builder="torchtune.models.llama3_2.llama3_2_1b", ckpt="full_1b", params=1.236e9,
    model={"_component_": "torchtune.models.llama3_2.llama3_2_1b"},
    batch_size=4, seq_len=2048,
    extra={"enable_activation_checkpointing": False, "fsdp_reshard_after_forward": True},
    optimizer={"_component_": "torch.optim.AdamW", "lr": 2e-5, "fused": True},
)

# Learnable synthetic data for the loss curves: each sequence is a random 256-token block from a
# 4096-token sub-vocabulary, repeated (unigram statistics + in-context copying to learn).
_CURVE_DATA = {"data_vocab": 4096, "data_repeat": 256}

# Llama-3.1-8B LoRA (rank 8 on q/v/output and the MLP), 2 x 2048 tokens a step: lora_8b and its
# loss-curve case share everything but the steps, learning rate and variants.
_LORA_8B = dict(
    recipe="lora_finetune_single_device", lora=True,
    builder="torchtune.models.llama3_1.llama3_1_8b", params=8.03e9,
    model={"_component_": "torchtune.models.llama3_1.lora_llama3_1_8b",
           "lora_attn_modules": ["q_proj", "v_proj", "output_proj"],
           "apply_lora_to_mlp": True, "lora_rank": 8, "lora_alpha": 16},
    batch_size=2, seq_len=2048, warmup=5, data=_CURVE_DATA,
    extra={"enable_activation_checkpointing": False, "save_adapter_weights_only": True},
)

# Ours' 1B settings since session 11: the whole model compiled + fused CE + FP8 + the optimizer
# step compiled (full_1b's levers vary one thing on top of it).
_CSTEP_1B = dict(loss=_FUSED, compile=True, compile_scope="model", enable_fp8_training=True,
                 compile_optimizer_step=True)

# Session 12 (s12e): + FP8 fast accumulation in backward + loss chunks of 1312 rows, 1.303x.
# (Measured through scripts/bench_hooks' BENCH_FP8_FAST_ACCUM, now the key below.)
_FAST_1B = dict(**{**_CSTEP_1B, "loss": {**_FUSED, "chunk_size": 1312}}, fp8_fast_accum_backward=True)

# Issue #15's claimed settings (CLAIM below names their variants): the 1B full fine-tune (s13-s15:
# _FAST_1B + the first layer's MLP gate/up outputs in e4m3), and the 8B LoRA's FP8 base with the
# adapters' e4m3 inputs and the embedding in CPU memory, + 20 layers' weights transposed.
_CLAIM_1B = dict(**_FAST_1B, fp8_mlp_activations=True, fp8_mlp_layers=1)
_FP8_LORA = dict(loss=_FUSED, compile=True, enable_fp8_training=True, fp8_adapter_inputs=True,
                 embedding_on_cpu=True)
_CLAIM_8B_LORA = dict(**_FP8_LORA, fp8_transposed_weight_layers=20)
# torchtune's shipped 8B LoRA learning rate (lora_8b_curve runs 1e-3 to make the loss move).
_LR3E4 = {"_component_": "torch.optim.AdamW", "lr": 3e-4, "fused": True}


def _hooks(**env) -> dict:
    """A variant's env that turns on scripts/bench_hooks (put first on the path by ``run``) with
    these hook settings, e.g. ``_hooks(BENCH_SDPA_GQA="1")``."""
    return {"BENCH_HOOKS": "1", **env}


def _capped(gib: float) -> dict:
    """A variant's env: the CUDA caching allocator capped at ``gib`` GiB (bench hook
    BENCH_MEMORY_CAP_GIB), as on a smaller GPU; the CUDA context (~0.5 GiB) is outside it."""
    return _hooks(BENCH_MEMORY_CAP_GIB=str(gib))


def _stock_on_a_smaller_gpu(gpu_gib: int, micro_batch: int) -> list:
    """Stock's three options on a GPU of ``gpu_gib`` GiB (the allocator capped 0.5 GiB below):
    its best as is, with activation checkpointing, and at half the micro-batch
    (``micro_batch``) with GA 2 (s16d/s16e ran the first two), named ``stock_best_<N>g``,
    ``stock_ac_<N>g``, ``stock_ga2_<N>g``."""
    cap = gpu_gib - 0.5
    common = dict(loss=_CHUNKED, compile=True, env=_capped(cap))
    return [
        _v(f"stock_best_{gpu_gib}g", "stock",
           f"stock: compile, allocator capped at {cap} GiB (a {gpu_gib} GiB GPU)", **common),
        _v(f"stock_ac_{gpu_gib}g", "stock",
           f"stock: compile + activation checkpointing, capped at {cap} GiB",
           enable_activation_checkpointing=True, **common),
        _v(f"stock_ga2_{gpu_gib}g", "stock",
           f"stock: compile, batch {micro_batch} x GA 2, capped at {cap} GiB",
           batch_size=micro_batch, gradient_accumulation_steps=2, **common),
    ]

CASES = {
    # A CPU dry run of the whole pipeline (checks configs and both CLIs; numbers meaningless).
    "tiny_cpu": dict(
        recipe="full_finetune_single_device",
        builder="tune_recipes.models.tiny_llama3",
        model={"_component_": "tune_recipes.models.tiny_llama3"},
        batch_size=4, seq_len=64, steps=8, vocab=272, device="cpu", dtype="fp32", warmup=2,
        params=0.0, data={"data_vocab": 64, "data_repeat": 16},
        extra={"optimizer_in_bwd": False, "enable_activation_checkpointing": False},
        optimizer={"_component_": "torch.optim.AdamW", "lr": 2e-5},
        variants=[
            _v("stock_best", "stock", "stock", head=True, loss=_CHUNKED),
            _v("ours_best", "ours", "ours: fused CE, batch 2 x GA 2", head=True, loss=_FUSED,
               batch_size=2, gradient_accumulation_steps=2),
            _v("ours_inbwd_curve", "ours", "ours: fused CE, in-backward optimizer", steps=12,
               loss=_FUSED, optimizer_in_bwd=True),
        ],
    ),
    # data_1b's pipeline on the CPU (spread lengths, packed and padded, both recipes).
    "tiny_data_cpu": dict(
        recipe="full_finetune_single_device",
        builder="tune_recipes.models.tiny_llama3",
        model={"_component_": "tune_recipes.models.tiny_llama3"},
        batch_size=4, seq_len=64, steps=8, vocab=272, device="cpu", dtype="fp32", warmup=2,
        params=0.0, variable_tokens=True, data={"data_vocab": 64, "median_len": 16},
        extra={"optimizer_in_bwd": False, "enable_activation_checkpointing": False},
        optimizer={"_component_": "torch.optim.AdamW", "lr": 2e-5},
        variants=[
            _v("stock_best", "stock", "stock, packed", head=True, loss=_CHUNKED, packed=True),
            _v("ours_best", "ours", "ours: fused CE, packed", head=True, loss=_FUSED, packed=True),
            _v("stock_padded", "stock", "stock, padded", head=True, loss=_CHUNKED),
            _v("ours_padded", "ours", "ours: fused CE, padded", head=True, loss=_FUSED),
        ],
    ),
    # Issue #15: Llama-3.2-1B full fine-tune, 4 x 2048 tokens per optimizer step.
    # Stock's best (issue #15's table and docs/benchmarks.md): compile on, AC off (59,334 tok/s
    # at batch 4 vs 44,038 eager; AC only adds recompute, and a larger micro-batch cannot raise
    # tokens per step here). Ours' best (head row): the fused loss, FP8 (tensorwise) and the
    # whole model compiled as one graph, with one optimizer step after backward (session 10:
    # there the in-backward optimizer saves no memory and costs 1%).
    "full_1b": dict(
        recipe="full_finetune_single_device",
        builder="torchtune.models.llama3_2.llama3_2_1b",
        model={"_component_": "torchtune.models.llama3_2.llama3_2_1b"},
        batch_size=4, seq_len=2048, steps=30, warmup=5, params=1.236e9, data=_CURVE_DATA,
        extra={"optimizer_in_bwd": False, "enable_activation_checkpointing": False},
        optimizer={"_component_": "torch.optim.AdamW", "lr": 2e-5, "fused": True},
        variants=[
            _v("stock_best", "stock", "stock: compile", head=True, loss=_CHUNKED, compile=True),
            # What ours' memory buys, on a 20 GiB GPU (the allocator capped at 19.5 GiB): stock's
            # best reserved ~21.9 GiB (s15), ours' claim ~16.6; stock would need activation
            # checkpointing (its shipped config's default) there. The capped runs show which fit.
            *_stock_on_a_smaller_gpu(20, micro_batch=2),
            _v("ours_claim_20g", "ours", "ours: the claimed settings, capped at 19.5 GiB",
               env=_capped(19.5), **_CLAIM_1B),
            # Session 9's best (per-layer compile); the head row is now ours_best_model_step.
            _v("ours_best", "ours", "ours: compile + fused CE + FP8 + optimizer in backward",
               loss=_FUSED, compile=True, enable_fp8_training=True, optimizer_in_bwd=True),
            # Levers one at a time; the two 220-step runs are also the FP8 vs bf16 loss curve.
            _v("ours_fused", "ours", "ours: compile + fused CE (bf16)", steps=220,
               loss=_FUSED, compile=True),
            _v("ours_fused_fp8", "ours", "ours: compile + fused CE + FP8", steps=220,
               loss=_FUSED, compile=True, enable_fp8_training=True),
            _v("ours_fused_inbwd", "ours", "ours: compile + fused CE + optimizer in backward",
               loss=_FUSED, compile=True, optimizer_in_bwd=True),
            # The one-step logging lag alone: the same as ours_best, but every logged step
            # waits for the device (training/reporting/progress.py), as before 2026-12-01.
            _v("ours_best_sync", "ours", "ours: best, each logged step waiting for the GPU",
               loss=_FUSED, compile=True, enable_fp8_training=True, optimizer_in_bwd=True,
               env={"TUNE_RECIPES_SYNC_LOGGING": "1"}),
            _v("ours_best_model", "ours", "ours: best, the whole model compiled as one graph",
               loss=_FUSED, compile=True, compile_scope="model", enable_fp8_training=True,
               optimizer_in_bwd=True),
            # With the whole model one graph, its compiled backward returns every gradient at
            # once, so the in-backward optimizer saves no memory there: its ~146 per-parameter
            # steps then run back to back after backward, each a Python call and a small kernel.
            # One fused AdamW step over all parameters instead (same peak, fewer launches).
            # Ours' best on the H200 since 2026-12-01 (session 10): 1.235x at 0.752x.
            _v("ours_best_model_step", "ours",
               "ours: compile (whole model) + fused CE + FP8, one optimizer step after backward",
               head=True, loss=_FUSED, compile=True, compile_scope="model", enable_fp8_training=True),
            # The optimizer step compiled too (compile_optimizer_step): 4.52 vs 6.44 ms alone.
            _v("ours_best_model_cstep", "ours",
               "ours: compile (whole model) + fused CE + FP8, one compiled optimizer step",
               head=True, **_CSTEP_1B),
            # Session 11 levers on top of it: inductor's coordinate-descent tuning of its Triton
            # kernels (31.6 ms a step in session 10's profile, the FP8 casts included), and the
            # fused loss in half-size chunks (80 MiB of logits instead of 160: the peak was
            # 0.04 GiB over 0.75x stock's, and a chunk's logits are part of it if the peak falls
            # in the loss).
            _v("ours_best_model_cstep_cdt", "ours",
               "ours: whole model + compiled optimizer step, coordinate-descent tuning",
               **_CSTEP_1B, env={"TORCHINDUCTOR_COORDINATE_DESCENT_TUNING": "1"}),
            _v("ours_best_model_cstep_c328", "ours",
               "ours: whole model + compiled optimizer step, loss chunks of 328 rows",
               **{**_CSTEP_1B, "loss": {**_FUSED, "chunk_size": 328}}),
            # Activation memory budgets. 0.9 (session 11; measured through scripts/bench_hooks,
            # now the key activation_memory_budget) took 0.61 GiB off; the 0.04 GiB over needs far
            # less: 0.98 and 0.95, the smallest recompute under 0.75x stock, at what speed (next).
            *[_v(f"ours_best_model_cstep_amb{round(budget * 100)}", "ours",
                 f"ours: whole model + compiled optimizer step, activation memory budget {budget}",
                 **_CSTEP_1B, activation_memory_budget=budget) for budget in (0.9, 0.98, 0.95)],
            # FP8 left off the 1B's small k/v projections (torchao's tensorwise heuristic).
            _v("ours_best_model_cstep_autofilter", "ours",
               "ours: whole model + compiled optimizer step, FP8 off the small k/v projections",
               **_CSTEP_1B, env=_hooks(BENCH_FP8_AUTO_FILTER="1")),
            # Session 12: the backward FP8 products with cuBLAS's fast accumulation too (torchao
            # uses it only forward; scripts/bench_fp8_accum.py), and loss chunks of twice the
            # default (half the chunks: each re-reads the [V, D] weight and its gradient).
            _v("ours_best_model_cstep_fastacc", "ours",
               "ours: whole model + compiled optimizer step, FP8 fast accumulation in backward too",
               **_CSTEP_1B, fp8_fast_accum_backward=True),
            _v("ours_best_model_cstep_c1312", "ours",
               "ours: whole model + compiled optimizer step, loss chunks of 1312 rows",
               **{**_CSTEP_1B, "loss": {**_FUSED, "chunk_size": 1312}}),
            # Both (s12c: +3.2% and +0.8%, one run each) as a head row, and with the smallest
            # activation memory budget planned (0.95; the key's first run on a GPU).
            _v("ours_best_model_fast", "ours",
               "ours: whole model + compiled optimizer step + FP8 fast accumulation + loss chunks of 1312",
               head=True, **_FAST_1B),
            # The MLP's gate/up outputs saved in e4m3, one scale per tensor (fp8_mlp_activations):
            # in every layer, in the first only (fp8_mlp_layers: 1), and session 12's per-token
            # form (bench hook). Session 13 ran the first two as ..._mlp8t and ..._mlp8t_l1 (hooks)
            # and the third as ..._mlp8.
            _v("ours_best_model_fast_mlp8", "ours",
               "ours: the same + the MLP's gate/up products kept in e4m3 for backward",
               head=True, **_FAST_1B, fp8_mlp_activations=True),
            _v("ours_best_model_fast_mlp8_l1", "ours", "ours: the same, first layer's MLP only",
               head=True, **_CLAIM_1B),
            # The claim with grouped-query k/v handed to SDPA as projected (bench hook
            # BENCH_SDPA_GQA): torchtune's copies expanded to 32 heads, saved for backward, are
            # ~0.75 GiB here; the claim's memory margin is 0.004 of stock's.
            _v("ours_claim_gqa", "ours", "ours: the claim, k/v not expanded for attention (SDPA enable_gqa)",
               ref="ours_best_model_fast_mlp8_l1", env=_hooks(BENCH_SDPA_GQA="1"), **_CLAIM_1B),
            # Issue #15's rowwise lever at recipe level (until now measured on projection stacks,
            # 0.89-0.97x bf16): session 11's best with fp8_recipe_name rowwise.
            _v("ours_best_model_cstep_rowwise", "ours",
               "ours: whole model compiled + fused CE + FP8 rowwise + compiled optimizer step",
               **_CSTEP_1B, fp8_recipe_name="rowwise"),
            # Session 14: the same with the fused loss's old host sync (A/B of declare_grad_output),
            # and under CUDA graphs.
            _v("ours_best_model_fast_mlp8_l1_sync", "ours",
               "ours: best + fp8_mlp_layers 1, the fused loss reading grad_output (host sync)",
               **_CLAIM_1B,
               env=_hooks(BENCH_FLCE_READ_GRAD_OUTPUT="1")),
            # Per-layer compile with FP8 + fast accumulation: 78,851 tok/s at 15.00 GiB over
            # full_1b_curve's 220 steps in s14b, beside 78,294 for best + fp8_mlp_layers 1 over
            # these 30 (same machine, s14a): at 30 steps here, against the best.
            _v("ours_fused_fp8_fastacc", "ours",
               "ours: per-layer compile + fused CE + FP8 + fast accumulation in backward",
               loss=_FUSED, compile=True, enable_fp8_training=True, fp8_fast_accum_backward=True),
            _v("ours_best_model_fast_mlp8_l1_cg", "ours",
               "ours: best + fp8_mlp_layers 1, compiled with mode=reduce-overhead",
               **_CLAIM_1B,
               env=_hooks(BENCH_COMPILE_MODE="reduce-overhead")),
            # Is the step waiting on the host? (s13prof: GPU busy 100.4 ms of ~105-107.) The whole
            # model under CUDA graphs (bench hook).
            _v("ours_best_model_fast_cg", "ours", "ours: s12e's best, compiled with mode=reduce-overhead",
               **_FAST_1B, env=_hooks(BENCH_COMPILE_MODE="reduce-overhead")),
            # cuDNN's attention is 12.8 ms of the step (s13prof): torch's flash kernel, and
            # FlashAttention-4 (bench hook; FA4 needs the wheels of scripts/fa4_wheels.sh).
            _v("ours_best_model_fast_flash", "ours", "ours: s12e's best, SDPA's flash kernel instead of cuDNN's",
               **_FAST_1B, env=_hooks(BENCH_SDPA_IMPL="flash")),
            _v("ours_best_model_fast_fa4", "ours", "ours: s12e's best, FlashAttention-4 instead of cuDNN's",
               **_FAST_1B, env=_hooks(BENCH_SDPA_IMPL="FA4")),
            _v("ours_best_model_fast_mlp8_rows", "ours",
               "ours: the same, g and u scaled per token (session 12's form)",
               **_FAST_1B, fp8_mlp_activations=True, env=_hooks(BENCH_FP8_MLP_PER_ROW="1")),
            *[_v(f"ours_best_model_fast_amb{round(budget * 100)}", "ours",
                 f"ours: the same, activation memory budget {budget}", **_FAST_1B,
                 activation_memory_budget=budget) for budget in (0.95, 0.99, 0.98)],
            # Where its peak memory is (not a speed row): every CUDA allocation recorded, the
            # snapshot replayed by scripts/memory_peak.py.
            _v("ours_best_model_cstep_memsnap", "ours",
               "ours: whole model + compiled optimizer step, allocations recorded (not a speed row)",
               steps=8, **_CSTEP_1B,
               env=_hooks(BENCH_MEMORY_SNAPSHOT="/tmp/bw/memsnap_1b")),
            _v("ours_best_ac", "ours", "ours: best + activation checkpointing",
               loss=_FUSED, compile=True, enable_fp8_training=True, optimizer_in_bwd=True,
               enable_activation_checkpointing=True),
            # Where the time goes: each side's best under torch.profiler (steps 7-9; not speed rows).
            _v("stock_best_profiled", "stock", "stock: compile, profiled (not a speed row)", steps=10,
               loss=_CHUNKED, compile=True, profiler=_profiler("stock_best")),
            _v("ours_best_profiled", "ours", "ours: best, profiled (not a speed row)", steps=10,
               loss=_FUSED, compile=True, enable_fp8_training=True, optimizer_in_bwd=True,
               profiler=_profiler("ours_best")),
            _v("ours_best_model_profiled", "ours", "ours: best, whole model compiled, profiled (not a speed row)",
               steps=10, loss=_FUSED, compile=True, compile_scope="model", enable_fp8_training=True,
               optimizer_in_bwd=True, profiler=_profiler("ours_best_model")),
            # Session 13: where s12e's best spends its step, and what fp8_mlp_activations adds.
            _v("ours_best_model_fast_profiled", "ours", "ours: s12e's best, profiled (not a speed row)",
               steps=10, **_FAST_1B, profiler=_profiler("ours_best_model_fast")),
            # (s13prof ran this one with per-token scales, the default then.)
            _v("ours_best_model_fast_mlp8_profiled", "ours",
               "ours: s12e's best + fp8_mlp_activations, profiled (not a speed row)",
               steps=10, **_FAST_1B, fp8_mlp_activations=True, profiler=_profiler("ours_best_model_fast_mlp8")),
            _v("ours_best_model_step_profiled", "ours",
               "ours: whole model compiled, one optimizer step, profiled (not a speed row)",
               steps=10, loss=_FUSED, compile=True, compile_scope="model", enable_fp8_training=True,
               profiler=_profiler("ours_best_model_step")),
        ],
    ),
    # FP8 vs bf16 where the loss moves: full_1b's curve at lr 2e-5 falls only 12.19 -> 12.12 in
    # 220 steps; at 3e-4 the model learns the synthetic stream's copying.
    "full_1b_curve": dict(
        recipe="full_finetune_single_device",
        builder="torchtune.models.llama3_2.llama3_2_1b", ckpt="full_1b",
        model={"_component_": "torchtune.models.llama3_2.llama3_2_1b"},
        batch_size=4, seq_len=2048, steps=220, warmup=5, params=1.236e9, data=_CURVE_DATA,
        extra={"optimizer_in_bwd": False, "enable_activation_checkpointing": False},
        optimizer={"_component_": "torch.optim.AdamW", "lr": 3e-4, "fused": True},
        variants=[
            _v("ours_fused", "ours", "ours: compile + fused CE (bf16), lr 3e-4", loss=_FUSED, compile=True),
            _v("ours_fused_fp8", "ours", "ours: compile + fused CE + FP8, lr 3e-4", loss=_FUSED,
               compile=True, enable_fp8_training=True),
            _v("ours_fused_fp8_fastacc", "ours",
               "ours: compile + fused CE + FP8, fast accumulation in backward too, lr 3e-4",
               loss=_FUSED, compile=True, enable_fp8_training=True, fp8_fast_accum_backward=True),
            _v("ours_fused_fp8_fastacc_mlp8", "ours",
               "ours: compile + fused CE + FP8 + fast accumulation + MLP gate/up kept in e4m3, lr 3e-4",
               loss=_FUSED, compile=True, enable_fp8_training=True, fp8_fast_accum_backward=True,
               fp8_mlp_activations=True),
            # Issue #15's claim, as the claim ran (full_1b's ours_best_model_fast_mlp8_l1), against
            # stock's best over the same 220 steps and data: the curves above vary one setting
            # at a time under per-layer compile.
            _v("stock_best", "stock", "stock: compile, lr 3e-4", loss=_CHUNKED, compile=True),
            _v("ours_claim", "ours", "ours: full_1b's claimed settings (best + fp8_mlp_layers 1), lr 3e-4",
               ref="stock_best", **_CLAIM_1B),
        ],
    ),
    # torchtune's shipped 1B config steps inside backward; same here, for both recipes.
    "full_1b_inbwd": dict(
        recipe="full_finetune_single_device",
        builder="torchtune.models.llama3_2.llama3_2_1b",
        model={"_component_": "torchtune.models.llama3_2.llama3_2_1b"},
        batch_size=4, seq_len=2048, steps=25, ckpt="full_1b", params=1.236e9,
        extra={"optimizer_in_bwd": True, "enable_activation_checkpointing": False},
        optimizer={"_component_": "torch.optim.AdamW", "lr": 2e-5, "fused": True},
        variants=_SAME_SETTINGS,
    ),
    # Two GPUs, FSDP2 (run on the nvidia-h200-x2 kind): per-rank batch 4 x 2048.
    "full_1b_2gpu": dict(**_FULL_1B_2GPU, steps=20, variants=_SAME_SETTINGS),
    # Issue #15's last lever, FP8 full fine-tunes distributed (the nvidia-h200-x2 kind; not lent
    # in sessions 13-18): each side's best on two GPUs, per-rank batch 4 x 2048. The distributed
    # recipe compiles per layer (no compile_scope or compiled optimizer step there), so ours' best
    # is compile + fused CE + FP8 + fast accumulation in backward; its bf16 twin is the lever.
    "full_1b_2gpu_fp8": dict(
        **_FULL_1B_2GPU, steps=30,
        variants=[
            _v("stock_best", "stock", "stock: compile", head=True, loss=_CHUNKED, compile=True),
            _v("ours_fp8", "ours", "ours: compile + fused CE + FP8 + fast accumulation in backward",
               head=True, loss={**_FUSED, "chunk_size": 1312}, compile=True,
               enable_fp8_training=True, fp8_fast_accum_backward=True),
            _v("ours_bf16", "ours", "ours: compile + fused CE (bf16)",
               loss={**_FUSED, "chunk_size": 1312}, compile=True),
        ],
    ),
    "lora_1b_2gpu": dict(
        recipe="lora_finetune_distributed", nproc=2, lora=True,
        builder="torchtune.models.llama3_2.llama3_2_1b", ckpt="full_1b", params=1.236e9,
        model={"_component_": "torchtune.models.llama3_2.lora_llama3_2_1b",
               "lora_attn_modules": ["q_proj", "v_proj", "output_proj"],
               "apply_lora_to_mlp": True, "lora_rank": 8, "lora_alpha": 16},
        batch_size=4, seq_len=2048, steps=20,
        extra={"enable_activation_checkpointing": False, "fsdp_reshard_after_forward": True,
               "save_adapter_weights_only": True},
        optimizer={"_component_": "torch.optim.AdamW", "lr": 3e-4, "fused": True},
        variants=_SAME_SETTINGS,
    ),
    # Issue #15: Llama-3.1-8B LoRA, 2 x 2048 tokens per optimizer step. Stock's best: compile,
    # AC off (fits: 42 GiB eager). Ours: compile + fused CE; AC and activation offloading are
    # the memory levers.
    "lora_8b": dict(
        **_LORA_8B, steps=20,
        optimizer={"_component_": "torch.optim.AdamW", "lr": 3e-4, "fused": True},
        variants=[
            _v("stock_best", "stock", "stock: compile", head=True, loss=_CHUNKED, compile=True),
            # What ours' memory buys, on a 24 GiB GPU (capped at 23.5 GiB): stock's best allocates
            # 34.86 GiB; ours without transposed weights 21.43 (~22.6 reserved, s15e's QLoRA twin).
            *_stock_on_a_smaller_gpu(24, micro_batch=1),
            _v("ours_fp8_ain_embcpu_24g", "ours",
               "ours: FP8 base + FP8 adapter inputs + embedding in CPU memory, capped at 23.5 GiB",
               env=_capped(23.5), **_FP8_LORA),
            _v("ours_best", "ours", "ours: compile + fused CE", head=True, loss=_FUSED,
               compile=True),
            _v("ours_fused_ac", "ours", "ours: compile + fused CE + activation checkpointing",
               loss=_FUSED, compile=True, enable_activation_checkpointing=True),
            _v("ours_fused_ac_offload", "ours",
               "ours: compile + fused CE + AC + activation offloading", loss=_FUSED,
               compile=True, enable_activation_checkpointing=True,
               enable_activation_offloading=True),
            # The frozen base projections in FP8 (tune_recipes/modules/fp8_lora.py). Here
            # ours_best is compile + fused CE, so this is also "ours best + FP8".
            _v("ours_fused_fp8", "ours", "ours: compile + fused CE + FP8 base projections",
               loss=_FUSED, compile=True, enable_fp8_training=True),
            # Selective layer checkpointing (ac_mode/ac_option, torchtune's keys): layers 10,
            # 20 and 30 of 32 recompute their forward, for ~3/32 of the activations.
            _v("ours_fused_fp8_sac", "ours", "ours: FP8 base projections + checkpointing every 10th layer",
               loss=_FUSED, compile=True, enable_fp8_training=True, ac_mode="selective", ac_option=10),
            # The frozen embedding table in pinned CPU memory (embedding_on_cpu): -0.98 GiB at 8B.
            _v("ours_fused_fp8_embcpu", "ours", "ours: FP8 base projections + embedding in CPU memory",
               loss=_FUSED, compile=True, enable_fp8_training=True, embedding_on_cpu=True),
            _v("ours_fused_fp8_embcpu_sac16", "ours",
               "ours: FP8 base + embedding in CPU memory + checkpointing every 16th layer",
               loss=_FUSED, compile=True, enable_fp8_training=True, embedding_on_cpu=True,
               ac_mode="selective", ac_option=16),
            # The MLP's gate/up products kept in e4m3 for backward (fp8_mlp_activations).
            _v("ours_fused_fp8_mlp8", "ours", "ours: FP8 base projections + MLP activations in FP8",
               loss=_FUSED, compile=True, enable_fp8_training=True, fp8_mlp_activations=True),
            _v("ours_fused_fp8_mlp8_embcpu", "ours",
               "ours: FP8 base + MLP activations in FP8 + embedding in CPU memory",
               loss=_FUSED, compile=True, enable_fp8_training=True, fp8_mlp_activations=True,
               embedding_on_cpu=True),
            # The same with one scale per tensor for g and u (bench hook): in the 1B full
            # fine-tune per tensor cost 2.3% where per token cost 10-12% (session 13); LoRA's
            # per-token form cost 8.9% here (session 8).
            _v("ours_fused_fp8_mlp8t_embcpu", "ours",
               "ours: FP8 base + MLP activations in FP8 (one scale per tensor) + embedding in CPU memory",
               loss=_FUSED, compile=True, enable_fp8_training=True, fp8_mlp_activations=True,
               embedding_on_cpu=True, env=_hooks(BENCH_FP8_MLP_PER_ROW="0")),
            # The adapters' weight gradients from the FP8 base product's e4m3 input
            # (fp8_adapter_inputs): backward keeps 1 byte of each adapter input instead of 2.
            _v("ours_fp8_ain_embcpu", "ours",
               "ours: FP8 base + FP8 adapter inputs + embedding in CPU memory", **_FP8_LORA),
            # The memory fp8_adapter_inputs frees, spent on speed: layers 0-19 keep their FP8
            # weights transposed too (fp8_transposed_weight_layers), no transpose copy in their
            # backward; ~0.2 GiB a layer at 8B, so ~25.7 GiB (0.74x stock) predicted.
            _v("ours_fp8_ain_embcpu_t20", "ours",
               "ours: FP8 base + FP8 adapter inputs + embedding in CPU memory + 20 layers' weights also transposed",
               head=True, **_CLAIM_8B_LORA),
            _v("ours_fp8_ain_embcpu_t20_gqa", "ours", "ours: the claim, k/v not expanded for attention (SDPA enable_gqa)",
               ref="ours_fp8_ain_embcpu_t20", env=_hooks(BENCH_SDPA_GQA="1"), **_CLAIM_8B_LORA),
            _v("ours_fused_fp8_model", "ours", "ours: FP8 base projections, the whole model compiled",
               loss=_FUSED, compile=True, compile_scope="model", enable_fp8_training=True),
            # Where the time goes at 8B: each side's best under torch.profiler (steps 7-9).
            _v("stock_best_profiled", "stock", "stock: compile, profiled (not a speed row)", steps=10,
               loss=_CHUNKED, compile=True, profiler=_profiler("stock_best_8b")),
            _v("ours_fp8_embcpu_profiled", "ours", "ours: FP8 base + embedding in CPU memory, profiled (not a speed row)",
               steps=10, loss=_FUSED, compile=True, enable_fp8_training=True, embedding_on_cpu=True,
               profiler=_profiler("ours_fp8_embcpu_8b")),
        ],
    ),
    # Issue #15's QLoRA half: Llama-3.1-8B QLoRA (NF4 base), 2 x 2048 tokens per step, on the
    # lora_8b checkpoint. FP8 base projections do not apply (the base is NF4); ours' levers are
    # the fused loss and the frozen embedding in CPU memory.
    "qlora_8b": dict(
        **{**_LORA_8B, "model": {**_LORA_8B["model"],
                                 "_component_": "torchtune.models.llama3_1.qlora_llama3_1_8b"}},
        ckpt="lora_8b", steps=20,
        optimizer={"_component_": "torch.optim.AdamW", "lr": 3e-4, "fused": True},
        variants=[
            _v("stock_best", "stock", "stock: compile", head=True, loss=_CHUNKED, compile=True),
            _v("ours_best", "ours", "ours: compile + fused CE", head=True, loss=_FUSED, compile=True),
            _v("ours_fused_embcpu", "ours", "ours: compile + fused CE + embedding in CPU memory",
               head=True, loss=_FUSED, compile=True, embedding_on_cpu=True),
            # What QLoRA is for (an 8B fine-tune in less memory), ours' way: the bf16-base LoRA
            # builder with the frozen base in FP8 (e4m3, one scale per tensor: finer than NF4's
            # 4 bits), FP8 adapter inputs and the embedding in CPU memory. Not NF4: a different
            # quantization of the same frozen base, compared at stock QLoRA's tokens and steps.
            _v("ours_fp8_instead", "ours",
               "ours: FP8 base instead of NF4 + FP8 adapter inputs + embedding in CPU memory",
               head=True, model=_LORA_8B["model"], **_FP8_LORA),
        ],
    ),
    # Issue #15's data-path lever: Llama-3.2-1B full fine-tune on sequences of realistic spread
    # (log-normal lengths, median 350 tokens, clipped to [16, 2048]: mean ~500), 4 sequences a
    # step padded to the batch's longest, or 4 packs of 2048 tokens (torchtune's PackedDataset;
    # on CUDA torchtune's model then masks attention per document with flex attention). The
    # steps hold different numbers of real tokens, so the rates are each recipe's own count of
    # label tokens per second (``variable_tokens``), not batch x seq_len over the wall clock.
    # Ours padded has no FP8: with compile, every new batch length recompiles the FP8 layers.
    "data_1b": dict(
        recipe="full_finetune_single_device",
        builder="torchtune.models.llama3_2.llama3_2_1b", ckpt="full_1b", params=1.236e9,
        model={"_component_": "torchtune.models.llama3_2.llama3_2_1b"},
        batch_size=4, seq_len=2048, steps=30, warmup=5, variable_tokens=True,
        data={"median_len": 350},
        extra={"optimizer_in_bwd": False, "enable_activation_checkpointing": False},
        optimizer={"_component_": "torch.optim.AdamW", "lr": 2e-5, "fused": True},
        variants=[
            _v("stock_best", "stock", "stock: compile, packed", head=True, loss=_CHUNKED,
               compile=True, packed=True),
            _v("ours_best", "ours", "ours: compile + fused CE + FP8 + optimizer in backward, packed",
               loss=_FUSED, compile=True, enable_fp8_training=True, optimizer_in_bwd=True,
               packed=True),
            # Why ours (FP8) ran 0.94x stock packed but 1.14x on fixed-length batches: the same
            # without FP8, and with the whole model compiled.
            _v("ours_packed_nofp8", "ours", "ours: compile + fused CE + optimizer in backward, packed",
               loss=_FUSED, compile=True, optimizer_in_bwd=True, packed=True),
            # Ours' best packed (session 10: 1.094x; per-layer FP8 0.85-0.94x).
            _v("ours_packed_model", "ours",
               "ours: compile (whole model) + fused CE + FP8, one optimizer step, packed",
               head=True, loss=_FUSED, compile=True, compile_scope="model", enable_fp8_training=True, packed=True),
            # The 1B claim's settings on packed data (issue #15 asks the data path measured with
            # the current settings), and its profile (steps 8-10, not a speed row).
            _v("ours_claim_packed", "ours", "ours: the 1B claim's settings, packed", head=True,
               packed=True, **_CLAIM_1B),
            # The same with attention traced into the whole-model graph (bench hook
            # BENCH_FLEX_IN_GRAPH): torchtune's flex attention call is a graph break per layer.
            _v("ours_claim_packed_flex", "ours",
               "ours: the 1B claim's settings, packed, flex attention inside the compiled graph",
               head=True, packed=True, ref="ours_claim_packed", **_CLAIM_1B,
               # the logs (s17g_logs.tgz) say whether any step recompiled or broke the graph
               env=_hooks(BENCH_FLEX_IN_GRAPH="1", TORCH_LOGS="recompiles,graph_breaks")),
            _v("ours_claim_packed_profiled", "ours",
               "ours: the 1B claim's settings, packed, profiled (not a speed row)", steps=10,
               packed=True, profiler=_profiler("data_ours_claim_packed"), **_CLAIM_1B),
            _v("stock_padded", "stock", "stock: compile, padded", head=True, loss=_CHUNKED,
               compile=True),
            # Why per-layer FP8 ran below no FP8 on packed data (163 vs 129 ms a step, session
            # 10): both under the profiler, steps 8-10 (not speed rows).
            _v("ours_best_profiled", "ours", "ours: per-layer FP8, packed, profiled (not a speed row)",
               steps=10, loss=_FUSED, compile=True, enable_fp8_training=True, optimizer_in_bwd=True,
               packed=True, profiler=_profiler("data_ours_best")),
            _v("ours_packed_nofp8_profiled", "ours", "ours: no FP8, packed, profiled (not a speed row)",
               steps=10, loss=_FUSED, compile=True, optimizer_in_bwd=True, packed=True,
               profiler=_profiler("data_ours_packed_nofp8")),
            _v("ours_padded", "ours", "ours: compile + fused CE + optimizer in backward, padded",
               head=True, loss=_FUSED, compile=True, optimizer_in_bwd=True),
        ],
    ),
    # FP8 LoRA vs bf16 where the loss moves: lora_8b's 20 steps at lr 3e-4 barely do
    # (12.61 -> 12.59); 220 steps at 1e-3 on the same checkpoint and data (issue #15 asks
    # 200+ steps for a lower-precision option; the first FP8 curve, 2026-12-01, ran 120).
    "lora_8b_curve": dict(
        **_LORA_8B, ckpt="lora_8b", steps=220,
        optimizer={"_component_": "torch.optim.AdamW", "lr": 1e-3, "fused": True},
        variants=[
            _v("ours_fused", "ours", "ours: compile + fused CE (bf16), lr 1e-3", loss=_FUSED,
               compile=True),
            _v("ours_fused_fp8", "ours", "ours: compile + fused CE + FP8 base, lr 1e-3",
               loss=_FUSED, compile=True, enable_fp8_training=True),
            _v("ours_fused_fp8_mlp8", "ours",
               "ours: FP8 base + MLP activations in FP8, lr 1e-3", loss=_FUSED, compile=True,
               enable_fp8_training=True, fp8_mlp_activations=True),
            _v("ours_fp8_ain", "ours", "ours: FP8 base + FP8 adapter inputs, lr 1e-3",
               loss=_FUSED, compile=True, enable_fp8_training=True, fp8_adapter_inputs=True),
            # The same numerics as ours_fp8_ain (the stored transposed weight holds the same
            # e4m3 values): its curve checks that on the GPU, with the post-review function.
            _v("ours_fp8_ain_t20", "ours",
               "ours: FP8 base + FP8 adapter inputs + 20 layers' weights transposed, lr 1e-3",
               loss=_FUSED, compile=True, enable_fp8_training=True, fp8_adapter_inputs=True,
               fp8_transposed_weight_layers=20),
            # Issue #15's claim as lora_8b ran it (+ embedding in CPU memory), against stock's best.
            _v("stock_best", "stock", "stock: compile, lr 1e-3", loss=_CHUNKED, compile=True),
            _v("ours_claim", "ours", "ours: lora_8b's claimed settings (ours_fp8_ain_embcpu_t20), lr 1e-3",
               ref="stock_best", **_CLAIM_8B_LORA),
            # If ours' claim stays above stock beyond each side's run-to-run spread (s17a): the
            # claim without FP8 adapter inputs, which added ~0.01 nats at step 200 in session 10.
            _v("ours_claim_no_ain", "ours", "ours: the 8B LoRA claim without FP8 adapter inputs, lr 1e-3",
               ref="stock_best", **{k: v for k, v in _CLAIM_8B_LORA.items() if k != "fp8_adapter_inputs"}),
            # Why ours' first loss differs between machines (12.6249 in session 16, 12.6291 in 17,
            # the same within each) while stock's moves 1e-4: each run compiles afresh (caches
            # off). The telling comparison is fresh against fresh_det: if inductor's on-device
            # benchmarking picks kernels that change the numerics, their step-0 losses differ, and
            # the deterministic one (no such benchmarking) should match across machines in later
            # sessions. Two fresh runs agreeing would not rule it out (one machine's timings
            # usually pick the same). 6 steps: only the first losses matter.
            _v("ours_claim_fresh", "ours", "ours: the 8B LoRA claim, compiled afresh each run",
               steps=6, env={"TORCHINDUCTOR_FORCE_DISABLE_CACHES": "1"}, **_CLAIM_8B_LORA),
            _v("ours_claim_fresh_det", "ours",
               "ours: the 8B LoRA claim, compiled afresh each run, inductor's deterministic mode",
               steps=6, env={"TORCHINDUCTOR_FORCE_DISABLE_CACHES": "1", "TORCHINDUCTOR_DETERMINISTIC": "1"},
               **_CLAIM_8B_LORA),
            # The same pair at torchtune's 8B LoRA learning rate, 3e-4: at 1e-3 both sides spike
            # and two of stock's own runs end 0.06% apart (s16b, s16g).
            _v("stock_best_lr3e4", "stock", "stock: compile, lr 3e-4", loss=_CHUNKED, compile=True,
               optimizer=_LR3E4),
            _v("ours_claim_lr3e4", "ours", "ours: lora_8b's claimed settings, lr 3e-4",
               ref="stock_best_lr3e4", optimizer=_LR3E4, **_CLAIM_8B_LORA),
        ],
    ),
    # The QLoRA claim's curve: stock's NF4 QLoRA against ours' FP8 base in its place (qlora_8b's
    # ours_fp8_instead), 220 steps at lr 1e-3 on lora_8b_curve's data.
    "qlora_8b_curve": dict(
        **{**_LORA_8B, "model": {**_LORA_8B["model"],
                                 "_component_": "torchtune.models.llama3_1.qlora_llama3_1_8b"}},
        ckpt="lora_8b", steps=220,
        optimizer={"_component_": "torch.optim.AdamW", "lr": 1e-3, "fused": True},
        variants=[
            _v("stock_best", "stock", "stock: compile, NF4, lr 1e-3", loss=_CHUNKED, compile=True),
            _v("ours_claim", "ours", "ours: FP8 base instead of NF4 (qlora_8b's ours_fp8_instead), lr 1e-3",
               ref="stock_best", model=_LORA_8B["model"], **_FP8_LORA),
            # The same pair at torchtune's 8B QLoRA learning rate, 3e-4 (s17b: at 1e-3 one of
            # stock's two NF4 runs ended 1.1% above the other on the last-20 mean, with 33 spikes).
            _v("stock_best_lr3e4", "stock", "stock: compile, NF4, lr 3e-4", loss=_CHUNKED, compile=True,
               optimizer=_LR3E4),
            _v("ours_claim_lr3e4", "ours", "ours: FP8 base instead of NF4, lr 3e-4",
               ref="stock_best_lr3e4", model=_LORA_8B["model"], optimizer=_LR3E4, **_FP8_LORA),
        ],
    ),
}


# Issue #15's claim: ours' variant per case whose settings the README's "Fastest settings on one
# H200" commands give (tests/unit/test_readme_fast.py holds them equal).
CLAIM = {"full_1b": "ours_best_model_fast_mlp8_l1", "lora_8b": "ours_fp8_ain_embcpu_t20",
         "qlora_8b": "ours_fp8_instead"}

# --preset NAME: cases and the variants of each, every one run every repetition.
PRESETS = {
    # the claim table: stock's best against ours', per case
    "claim": {case: ["stock_best", variant] for case, variant in CLAIM.items()},
    # the claims' 220-step loss curves against stock's on the same data
    "curves": {case: ["stock_best", "ours_claim"]
               for case in ("full_1b_curve", "lora_8b_curve", "qlora_8b_curve")},
    # what ours' memory buys on a smaller GPU (the allocator capped): stock's best there, stock
    # with activation checkpointing there, ours there; stock's uncapped best as the reference
    "memory": {"full_1b": ["stock_best", "stock_best_20g", "stock_ac_20g", "stock_ga2_20g",
                           "ours_claim_20g"],
               "lora_8b": ["stock_best", "stock_best_24g", "stock_ac_24g", "stock_ga2_24g",
                           "ours_fp8_ain_embcpu_24g"]},
}
# Repetitions when --reps is not given. NOTE: curves run twice: at lr 1e-3 the 8B curves spike,
# and two runs of stock's own settings differ by up to 0.06% on the last-20 mean (s16b, s16g);
# a gap to stock means something only beside that run-to-run spread of each side.
PRESET_REPS = {"claim": 2, "curves": 2, "memory": 1}


def write_config(path: Path, case: dict, variant: dict, ckpt: Path, out_dir: Path):
    """One run's YAML: the case's common config, then the variant's overrides. The micro-batch
    may differ between variants; gradient accumulation keeps tokens per step the same."""
    over = dict(variant["cfg"])
    loss = over.pop("loss")
    batch = over.pop("batch_size", case["batch_size"])
    packed = over.pop("packed", False)
    ga = over.pop("gradient_accumulation_steps", 1)
    if batch * ga != case["batch_size"]:
        raise ValueError(f"{variant['name']}: batch {batch} x GA {ga} != the case's "
                         f"{case['batch_size']} sequences per step")
    steps = variant["steps"] or case["steps"]
    data = case.get("data", {})
    stock = variant["side"] == "stock"
    cfg = {
        "output_dir": str(out_dir),
        "model": case["model"],
        "tokenizer": {"_component_": "tune_recipes.data.tiny_tokenizer", "max_seq_len": None},
        "dataset": {"_component_": "tune_recipes.data.synthetic.synthetic_dataset",
                    # Spread lengths: enough sequences to fill the steps' packs (~4 a pack).
                    "num_samples": case["batch_size"] * (steps + 2)
                    * (-(-case["seq_len"] // data["median_len"]) if data.get("median_len") else 1),
                    "seq_len": case["seq_len"],
                    "vocab_size": data.get("data_vocab", case.get("vocab", 128256)),
                    "repeat": data.get("data_repeat", 0),
                    **({"median_len": data["median_len"]} if data.get("median_len") else {}),
                    **({"packed": True} if packed else {})},
        "checkpointer": {"_component_": "torchtune.training.FullModelHFCheckpointer",
                         "checkpoint_dir": str(ckpt), "checkpoint_files": ["model.safetensors"],
                         "model_type": "LLAMA3", "output_dir": str(out_dir)},
        "resume_from_checkpoint": False,
        "seed": 0, "shuffle": False, "batch_size": batch, "epochs": 1,
        "max_steps_per_epoch": steps, "gradient_accumulation_steps": ga,
        "optimizer": case["optimizer"], "loss": loss, "clip_grad_norm": None,
        # torchtune's distributed LoRA recipe requires a scheduler key; same one for everyone.
        "lr_scheduler": {"_component_": "torchtune.training.lr_schedulers.get_cosine_schedule_with_warmup",
                         "num_warmup_steps": 0},
        "compile": False, "device": case.get("device", "cuda"), "dtype": case.get("dtype", "bf16"),
        "metric_logger": {"_component_": "tune_recipes.training.metrics.JsonlMetricLogger",
                          "log_dir": str(out_dir)},
        "log_every_n_steps": 1, "log_peak_memory_stats": True,
        **case["extra"], **over,
    }
    if stock and "single_device" in case["recipe"]:
        cfg.setdefault("enable_activation_offloading", False)
    if stock and "distributed" in case["recipe"]:
        cfg["profiler"] = {"_component_": "torchtune.training.setup_torch_profiler", "enabled": False}
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return cfg


def run(cmd, log: Path, timeout: float, env=None) -> float:
    env = dict(env or {})
    if env.pop("BENCH_HOOKS", None):  # scripts/bench_hooks/sitecustomize.py, first on the path
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(REPO / "scripts" / "bench_hooks"), os.environ.get("PYTHONPATH")) if p)
    t0 = time.time()
    with open(log, "w") as fh:
        try:
            proc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, cwd=REPO, timeout=timeout,
                                  env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            rc = f"timeout after {timeout:.0f} s"
    if rc != 0:
        text = log.read_text()
        # The ranks' own error lines say why; torchrun's summary after them does not.
        rank_lines = [l for l in text.splitlines() if l.startswith("[rank0]") or "Error" in l]
        tail = "\n".join(rank_lines[-25:]) or text[-3000:]
        # NOTE: the reason goes last too: a row keeps only the error's tail, and s15a's row lost
        # "timeout after 200 s" from the front to the log lines of a run that had finished.
        # A capped run (BENCH_MEMORY_CAP_GIB) that does not fit exits 1 like any other error.
        oom = isinstance(rc, int) and ("OutOfMemoryError" in text or "CUDA out of memory" in text)
        reason = f"out of memory (exit {rc})" if oom else rc
        raise RuntimeError(f"{' '.join(map(str, cmd))} failed ({rc}):\n{tail}\n[failed: {reason}]")
    return time.time() - t0


def summarize(out_dir: Path, tokens_per_step: Optional[int], warmup: int = 5) -> dict:
    """Wall-clock tokens/s between the rows after ``warmup``, the recipe's own median beside it,
    peak allocated memory, and every step's loss. ``tokens_per_step=None`` (steps of varying
    length): ``tokens_per_s`` is the recipe's own median (label tokens per second).

    NOTE: the run's last row is left out of the wall clock. Ours writes a row one step late on
    CUDA (when the next step is queued) but the last one at the epoch's end, right when its step
    finishes: a span ending there is a fraction of a step short, which overstated our tokens/s
    by ~5% on 2026-12-01 (71,364 vs the recipe's own 67,793 on full_1b) until this was fixed."""
    rows = [json.loads(l) for l in (out_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "loss" in r]
    if len(rows) < 3:
        raise RuntimeError(f"{out_dir}: {len(rows)} logged steps; the timing needs at least 3")
    warmup = max(0, min(warmup, len(rows) - 3))
    timed = rows[warmup:-1]
    wall = timed[-1]["time"] - timed[0]["time"]
    reported = statistics.median(r["tokens_per_second_per_gpu"] for r in timed[1:])
    if tokens_per_step is None:
        tps_wall = reported
    else:
        tps_wall = tokens_per_step * (len(timed) - 1) / wall if wall > 0 else 0.0
    mem = [r.get("peak_memory_alloc", r.get("peak_memory_active_gib")) for r in rows]
    mem = [m for m in mem if m is not None]
    res = [r.get("peak_memory_reserved", r.get("peak_memory_reserved_gib")) for r in rows]
    res = [m for m in res if m is not None]
    return {"steps": len(rows), "tokens_per_s": round(tps_wall),
            "reported_median_tokens_per_s": round(reported),
            "peak_alloc_gib": round(max(mem), 2) if mem else None,
            "peak_reserved_gib": round(max(res), 2) if res else None,
            "final_loss": rows[-1]["loss"], "losses": [round(r["loss"], 5) for r in rows]}


def schedule(case: dict, reps: int, names: Optional[list] = None):
    """(rep, variant) in run order: head variants every repetition, alternating direction;
    lever variants once, after the heads of the first repetition. ``names`` (a preset's list):
    those variants, in that order, every repetition."""
    if names is not None:
        by_name = {v["name"]: v for v in case["variants"]}
        unknown = [n for n in names if n not in by_name]
        if unknown:
            raise ValueError(f"no variant(s) {unknown} in this case; it has {sorted(by_name)}")
        heads, levers = [by_name[n] for n in names], []
    else:
        heads = [v for v in case["variants"] if v["head"]]
        levers = [v for v in case["variants"] if not v["head"]]
    order = []
    for rep in range(reps):
        these = heads if rep % 2 == 0 else heads[::-1]
        order += [(rep, v) for v in these]
        if rep == 0:
            order += [(0, v) for v in levers]
    return order


def flops_per_token_factor(case: dict, variant: dict) -> int:
    """Matmul FLOPs per token per parameter (attention's score/value products not counted):
    forward 2, backward 4 for a full fine-tune, 2 for LoRA (input gradients only; the frozen
    base has no weight gradient), + 2 when activation checkpointing recomputes the forward."""
    factor = 2 + (2 if case.get("lora") else 4)
    ac = variant["cfg"].get("enable_activation_checkpointing",
                            case["extra"].get("enable_activation_checkpointing", False))
    return factor + (2 if ac else 0)


def aggregate(case_name: str, case: dict, rows: list) -> list:
    """One line per variant: mean and each repetition's tokens/s, peak memory, ratios to stock's
    best, and model TFLOP/s against the H200's bf16 rate."""
    out = []
    stock = [r for r in rows if r.get("variant") == "stock_best" and "error" not in r]
    stock_tps = statistics.mean(r["tokens_per_s"] for r in stock) if stock else None
    stock_mem = max((r["peak_alloc_gib"] or 0 for r in stock), default=0) or None  # None on CPU
    for v in case["variants"]:
        runs = [r for r in rows if r.get("variant") == v["name"]]
        if not runs:  # left out by --only (or by the run that was merged)
            continue
        ok = [r for r in runs if "error" not in r]
        # "runs": the runs measured; a failed one is counted apart, not averaged in.
        line = {"case": case_name, "variant": v["name"], "label": v["label"], "runs": len(ok)}
        if len(ok) < len(runs):
            line["failed_runs"] = len(runs) - len(ok)
        if not ok:
            line["error"] = runs[0]["error"][-300:] if runs else "not run"
            out.append(line)
            continue
        tps = statistics.mean(r["tokens_per_s"] for r in ok)
        mem = max(r["peak_alloc_gib"] or 0 for r in ok)
        tflops = flops_per_token_factor(case, v) * case.get("params", 0) * tps / 1e12
        line.update(tokens_per_s=round(tps), each=[r["tokens_per_s"] for r in ok],
                    reported=[r["reported_median_tokens_per_s"] for r in ok], peak_alloc_gib=mem,
                    steps=ok[0]["steps"], final_loss=ok[0]["final_loss"],
                    model_tflops=round(tflops, 1),
                    pct_of_bf16_peak=round(100 * tflops / H200_BF16_TFLOPS, 1))
        if stock_tps:
            line.update(speedup_vs_stock=round(tps / stock_tps, 3),
                        memory_vs_stock=round(mem / stock_mem, 3) if stock_mem else None)
        out.append(line)
    return out


def merge_rows(parts: list) -> list:
    """The rows of separate runs in one list, each (case, variant)'s repetitions numbered on
    from those of the parts before (every run starts at rep 0: s16g's repeat of s16b's stock
    curve would otherwise replace it as the reference). A row keeps its own number as
    ``source_rep`` and its part's index as ``source``."""
    rows, taken = [], {}
    for n, part in enumerate(parts):
        offset = dict(taken)
        for r in part:
            key = (r["case"], r["variant"])
            rep = offset.get(key, 0) + r.get("rep", 0)
            rows.append({**r, "rep": rep, "source_rep": r.get("rep", 0), "source": n})
            taken[key] = max(taken.get(key, 0), rep + 1)
    return rows


def _curve_ref(case: str, name: str) -> Optional[str]:
    """The variant a loss curve is compared with: the variant's own ``ref`` (e.g. stock's curve
    for ours' claimed settings), else the same name without ``_fp8`` (FP8 against bf16)."""
    for v in CASES.get(case, {}).get("variants", []):
        if v["name"] == name and v.get("ref"):
            return v["ref"]
    return name.replace("_fp8", "") if "_fp8" in name else None


def _spikes(losses: list, jump: float = 0.1) -> int:
    """Steps whose loss stands more than ``jump`` above both neighbours (single-step spikes)."""
    return sum(losses[i] - max(losses[i - 1], losses[i + 1]) > jump for i in range(1, len(losses) - 1))


def _rolling_median(losses: list, half: int = 2) -> list:
    return [statistics.median(losses[max(0, i - half):i + half + 1]) for i in range(len(losses))]


def _signed_percent(fraction: float) -> str:
    """``fraction`` as a signed percentage with 2 decimals; a gap that rounds to zero prints
    "+0.00%", not "-0.00%" (a tiny negative is no gap at that precision)."""
    text = f"{100 * fraction:+.2f}%"
    return "+0.00%" if text == "-0.00%" else text


def _tail_stats(losses: list) -> dict:
    """One run's end of curve, unrounded: the means of its last 20 and last 50 losses, the mean of
    its 5-step rolling medians over the last 50 (one spike does not move it), its spike count."""
    n = len(losses)
    last50 = slice(max(0, n - 50), n)
    return {"last20": statistics.mean(losses[max(0, n - 20):]), "last50": statistics.mean(losses[last50]),
            "rolling_last50": statistics.mean(_rolling_median(losses)[last50]), "spikes": _spikes(losses)}


def compare_curves(case: str, ref: dict, run: dict, kind: str) -> dict:
    """Two runs' losses step by step over their shared steps. NOTE: the keys "bf16" and "fp8"
    name the reference and the compared run (kept from the first FP8-vs-bf16 curves, which older
    result files hold); the reference may be stock's bf16 run, or the same variant's rep 0.
    Spikes dominate the largest differences and the last-20 mean at lr 1e-3 (s16b), so the
    5-step rolling medians' gap and each run's spike count are reported too."""
    a, b = ref["losses"], run["losses"]
    n = min(len(a), len(b))
    a, b = a[:n], b[:n]
    diffs = [abs(x - y) for x, y in zip(a, b)]
    sa, sb = _tail_stats(a), _tail_stats(b)
    return {"case": case, "kind": kind, "bf16": ref["variant"], "fp8": run["variant"],
            "rep_bf16": ref.get("rep", 0), "rep_fp8": run.get("rep", 0), "steps": n,
            "bf16_first_last": [a[0], a[n - 1]], "fp8_first_last": [b[0], b[n - 1]],
            "max_abs_diff": round(max(diffs), 4),
            "max_rel_diff": round(max(d / x for d, x in zip(diffs, a)), 4),
            "median_abs_diff": round(statistics.median(diffs), 4),
            "max_abs_diff_last50": round(max(diffs[max(0, n - 50):]), 4),
            "mean_last20_bf16": round(sa["last20"], 4), "mean_last20_fp8": round(sb["last20"], 4),
            "mean_last50_bf16": round(sa["last50"], 4), "mean_last50_fp8": round(sb["last50"], 4),
            "rolling_median_gap_last50": round(sb["rolling_last50"] - sa["rolling_last50"], 4),
            "spikes_bf16": sa["spikes"], "spikes_fp8": sb["spikes"]}


def loss_curves(rows: list) -> list:
    """Each curve against its reference (``_curve_ref``) run in the same repetition, and each
    later repetition against the same variant's first ("repeat": the run-to-run spread of
    identical settings, what a gap between two variants is read against)."""
    found = []
    by = {(r["case"], r["variant"], r.get("rep", 0)): r for r in rows
          if "error" not in r and r.get("losses")}
    for (case, name, rep), r in by.items():
        ref_name = _curve_ref(case, name)
        if ref_name and (case, ref_name, rep) in by:
            found.append(compare_curves(case, by[(case, ref_name, rep)], r, "reference"))
        if rep > 0 and (case, name, 0) in by:
            found.append(compare_curves(case, by[(case, name, 0)], r, "repeat"))
    return found


def curve_runs(rows: list) -> list:
    """Every run of a curve variant that has a reference, and of that reference, side by side:
    each run's last-20 mean, mean of the 5-step rolling medians over the last 50 steps, and
    spike count; the median over runs of the rolling-median statistic on each side, their
    relative gap, and (with 2+ reference runs) how many of the variant's runs lie above and below
    the reference's range. Every run is cut to the pool's shortest, as ``compare_curves`` cuts a
    pair; ``settings_differ`` names a side whose runs' overrides or env differ (a variant
    redefined between merged runs).
    NOTE: at lr 1e-3 the 8B curves diverge between identical runs from step 1 (nondeterministic
    kernels) and a single run can end in a spike episode (s17a: +1.4% on the last-20 mean
    against its own repeat), so one pair of runs says little; this pools every run that
    ``merge_rows`` numbered, from one bench run or several."""
    by = {}
    for r in rows:
        if "error" not in r and r.get("losses"):
            by.setdefault((r["case"], r["variant"]), []).append(r)
    found = []
    for (case, name), runs in by.items():
        ref_name = _curve_ref(case, name)
        ref_runs = by.get((case, ref_name))
        if not ref_runs or len(runs) + len(ref_runs) < 3:  # one run a side: loss_curves says it all
            continue
        steps = min(len(r["losses"]) for r in runs + ref_runs)

        def stats(side):
            out = []
            for r in side:
                t = _tail_stats(r["losses"][:steps])
                out.append({"rep": r.get("rep", 0), "last20": round(t["last20"], 4),
                            "rolling_last50": round(t["rolling_last50"], 4), "spikes": t["spikes"]})
            return out

        mine, theirs = stats(runs), stats(ref_runs)
        mid = statistics.median(r["rolling_last50"] for r in mine)
        ref_mid = statistics.median(r["rolling_last50"] for r in theirs)
        lo, hi = min(r["rolling_last50"] for r in theirs), max(r["rolling_last50"] for r in theirs)
        ranged = len(theirs) >= 2  # one reference run is a point, not a range
        found.append({"case": case, "variant": name, "ref": ref_name, "steps": steps,
                      "runs": mine, "ref_runs": theirs,
                      "median_rolling_last50": round(mid, 4), "ref_median_rolling_last50": round(ref_mid, 4),
                      "gap_rel": round((mid - ref_mid) / ref_mid, 5),
                      "above_ref_range": sum(r["rolling_last50"] > hi for r in mine) if ranged else None,
                      "below_ref_range": sum(r["rolling_last50"] < lo for r in mine) if ranged else None,
                      "settings_differ": [n for n, side in ((name, runs), (ref_name, ref_runs))
                                          if len({json.dumps([r.get("overrides"), r.get("env")], sort_keys=True)
                                                  for r in side}) > 1]})
    return found


def _panel_title(ax, text: str) -> None:
    """A panel's title, wrapped at 70 characters: a longer one ran past the panel's edge and was
    cut off in the PNG (the gap at its end with it)."""
    import textwrap

    ax.set_title(textwrap.fill(text, 70), fontsize=9)


def plot(result: dict, path: Path) -> list:
    """The chart (PNG at ``path``); returns the titles of the panels as drawn (wrapped lines),
    column by column."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = [s for s in result["summary"] if "error" not in s]
    cases = list(dict.fromkeys(s["case"] for s in summary))
    # The chart shows up to two curves against their references, rep 0 first (one per case
    # before a second rep of the same case); "repeat" comparisons are in the table only.
    curves = sorted((c for c in result.get("loss_curves", []) if c.get("kind", "reference") == "reference"),
                    key=lambda c: c.get("rep_fp8", 0))
    # With a pool of runs (curve_runs), the last panel shows every run of the last pooled pair
    # (a merge lists the newest variant last) as 5-step rolling medians, the statistic the pool
    # compares; the curve panels above it take what is left of the two.
    pooled = result.get("curve_runs", [])[-1:]
    shown = curves[:2 - len(pooled)]
    ncol = len(cases) + (1 if shown or pooled else 0)
    fig, axes = plt.subplots(2, max(ncol, 1), figsize=(5.5 * max(ncol, 1), 8), squeeze=False)
    for j, case in enumerate(cases):
        lines = [s for s in summary if s["case"] == case]
        names = [s["variant"] for s in lines]
        colors = ["tab:gray" if n.startswith("stock") else "tab:blue" for n in names]
        for i, (key, title) in enumerate((("tokens_per_s", "tokens/s (higher is better)"),
                                          ("peak_alloc_gib", "peak allocated GiB (lower is better)"))):
            ax = axes[i][j]
            ax.bar(range(len(lines)), [s[key] for s in lines], color=colors)
            if key == "tokens_per_s":
                for k, s in enumerate(lines):
                    ax.scatter([k] * len(s["each"]), s["each"], color="k", s=8, zorder=3)
            ax.set_xticks(range(len(lines)))
            ax.set_xticklabels(names, rotation=35, ha="right", fontsize=8)
            _panel_title(ax, f"{case}: {title}")
    rows = {(r["case"], r["variant"], r.get("rep", 0)): r for r in result["rows"] if "losses" in r}
    for i, c in enumerate(shown):
        ax = axes[i][ncol - 1]
        for name, rep, style in ((c["bf16"], c.get("rep_bf16", 0), "-"),
                                 (c["fp8"], c.get("rep_fp8", 0), "--")):
            ax.plot(rows[(c["case"], name, rep)]["losses"], style, label=f"{name} rep {rep}")
        _panel_title(ax, f"{c['case']}: loss, {c['fp8']} vs {c['bf16']} (max |diff| {c['max_abs_diff']})")
        ax.set_xlabel("step")
        ax.legend(fontsize=8)
    for p in pooled:
        ax = axes[len(shown)][ncol - 1]
        for name, runs, color, style in ((p["ref"], p["ref_runs"], "tab:gray", "-"),
                                          (p["variant"], p["runs"], "tab:orange", "--")):
            for k, run_stats in enumerate(runs):
                losses = rows[(p["case"], name, run_stats["rep"])]["losses"][:p.get("steps")]
                ax.plot(_rolling_median(losses), style, color=color, linewidth=1,
                        label=f"{name}, {len(runs)} run{'s' if len(runs) != 1 else ''}" if k == 0 else None)
        _panel_title(ax, f"{p['case']}: rolling medians, {p['variant']} vs {p['ref']} "
                         f"({_signed_percent(p['gap_rel'])})")
        ax.set_xlabel("step")
        ax.legend(fontsize=8)
    if shown or pooled:
        for i in range(len(shown) + len(pooled), 2):
            axes[i][ncol - 1].axis("off")
    meta = result["meta"]
    fig.suptitle(f"tune-recipes vs torchtune 0.6.1, {meta['gpu']}, torch {meta['torch']}, {meta['date']}",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    titles = [axes[i][j].get_title() for j in range(axes.shape[1]) for i in range(2) if axes[i][j].axison]
    plt.close(fig)
    return titles


def print_table(result: dict, path: Optional[Path] = None) -> None:
    """The summary as a Markdown table (and the loss curves' comparisons), printed and, with
    ``path``, written there."""
    lines = []
    add = lines.append
    add("\n| case | variant | tokens/s (each rep) | x stock | peak alloc GiB | x stock | model TFLOP/s (% bf16 peak) | steps | final loss |")
    add("|---|---|---|---|---|---|---|---|---|")
    for s in result["summary"]:
        if "error" in s:
            add(f"| {s['case']} | {s['label']} | error: {s['error'][-80:]!r} | | | | | | |")
            continue
        each = " / ".join(f"{x:,}" for x in s["each"])
        if s.get("failed_runs"):
            each += f"; {s['failed_runs']} failed"
        add(f"| {s['case']} | {s['label']} | {s['tokens_per_s']:,} ({each}) | "
            f"{s.get('speedup_vs_stock', '')} | {s['peak_alloc_gib']} | {s.get('memory_vs_stock', '')} | "
            f"{s['model_tflops']} ({s['pct_of_bf16_peak']}%) | {s['steps']} | {s['final_loss']:.4f} |")
    for c in result.get("loss_curves", []):
        reps = (f" (rep {c['rep_fp8']} vs rep {c['rep_bf16']}{', the same settings again' if c['kind'] == 'repeat' else ''})"
                if "kind" in c else "")
        add(f"loss curve {c['case']} {c['fp8']} vs {c['bf16']}{reps}: {c['steps']} steps, max |diff| "
            f"{c['max_abs_diff']} (rel {c['max_rel_diff']}), last-20 mean {c['mean_last20_fp8']} vs "
            f"{c['mean_last20_bf16']}"
            + (f", median |diff| {c['median_abs_diff']}, last-50 max |diff| {c['max_abs_diff_last50']}, "
               f"last-50 mean {c['mean_last50_fp8']} vs {c['mean_last50_bf16']}"
               if "median_abs_diff" in c else "")
            + (f", 5-step rolling medians' gap over the last 50 {c['rolling_median_gap_last50']:+}, "
               f"spikes {c['spikes_fp8']} vs {c['spikes_bf16']}" if "kind" in c else ""))
    for c in result.get("curve_runs", []):
        each = lambda runs, key: " / ".join(f"{r[key]}" for r in runs)
        runs_word = lambda k: f"{k} run" + ("s" if k != 1 else "")
        add(f"curve runs {c['case']} {c['variant']} ({runs_word(len(c['runs']))}) vs {c['ref']} "
            f"({runs_word(len(c['ref_runs']))}): last-20 means {each(c['runs'], 'last20')} vs "
            f"{each(c['ref_runs'], 'last20')}; rolling-median last-50 means "
            f"{each(c['runs'], 'rolling_last50')} vs {each(c['ref_runs'], 'rolling_last50')}, "
            f"medians of runs {c['median_rolling_last50']} vs {c['ref_median_rolling_last50']} "
            f"({_signed_percent(c['gap_rel'])})"
            + (f", of {len(c['runs'])} runs {c['above_ref_range']} above and {c['below_ref_range']} below "
               f"{c['ref']}'s range" if c.get("above_ref_range") is not None else "")
            + f"; spikes {each(c['runs'], 'spikes')} vs {each(c['ref_runs'], 'spikes')}"
            + (f"; over the first {c['steps']} steps" if "steps" in c else "")
            + (f"; SETTINGS DIFFER between the runs of {', '.join(c['settings_differ'])}"
               if c.get("settings_differ") else ""))
    text = "\n".join(lines)
    print(text, flush=True)
    if path is not None:
        path.write_text(text.lstrip("\n") + "\n")


def versions() -> dict:
    import torch

    meta = {"date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "command": " ".join(sys.argv)}
    for mod in ("torchtune", "torchao", "triton"):
        try:
            meta[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001 - a version string is informational
            meta[mod] = None
    meta["commit"] = code_commit()
    return meta


def code_commit() -> Optional[str]:
    """The commit the benchmarked code is at: ``BENCH_COMMIT`` where set (the GPU machine gets a
    copy of the working tree without .git: put the commit in the command), else git's HEAD, with
    "+dirty" when tracked files differ from it; None when neither says."""
    if os.environ.get("BENCH_COMMIT"):
        return os.environ["BENCH_COMMIT"]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                              text=True, timeout=30)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD"], cwd=REPO, timeout=30).returncode != 0
        return head.stdout.strip() + ("+dirty" if dirty else "")
    except (OSError, subprocess.TimeoutExpired):
        return None


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="recipes.json")
    ap.add_argument("--cases", default=None, help="comma-separated cases (default full_1b); with "
                    "--preset, which of the preset's cases to run")
    ap.add_argument("--reps", type=int, default=None,
                    help="repetitions of the head variants (default 2; with --preset, PRESET_REPS)")
    ap.add_argument("--only", default=None, help="comma-separated variant names to run")
    ap.add_argument("--every-rep", action="store_true",
                    help="with --only: each named variant every repetition, in the --only order, "
                         "alternating (without it a variant that is not a head runs once)")
    ap.add_argument("--preset", choices=sorted(PRESETS), default=None,
                    help="instead of --cases: claim (stock's best vs ours' per case), curves (the "
                         "claims' 220-step loss curves vs stock's), memory (stock with activation "
                         "checkpointing beside ours without); each listed variant every repetition")
    ap.add_argument("--work", default="/tmp/bench_recipes")
    ap.add_argument("--run-timeout", type=float, default=420, help="seconds per run")
    ap.add_argument("--plot", default=None, help="only draw the chart of this results JSON")
    ap.add_argument("--merge", nargs="+", default=None,
                    help="results JSONs of separate runs (e.g. heads and levers) to combine into --out: "
                         "rows concatenated, ratios to stock recomputed, table and chart redrawn")
    return ap


def plan_runs(args, ap) -> dict:
    """{case: [(rep, variant), ...]} in run order, from --cases/--preset/--reps/--only. Refuses,
    before any run or checkpoint (device time): an unknown case, a case outside the preset, and
    an --only name that this selection never runs (a typo, or a variant of another case)."""
    wanted = (args.cases or ("" if args.preset else "full_1b")).split(",")
    wanted = [name for name in wanted if name]
    unknown = [name for name in wanted if name not in CASES]
    if unknown:
        ap.error(f"--cases: no case(s) {unknown}; cases: {', '.join(CASES)}")
    # a name listed twice would run twice a rep under --every-rep
    listed = list(dict.fromkeys(args.only.split(","))) if args.only else None
    if args.preset and args.every_rep:
        ap.error("--every-rep is for --only lists; a preset runs each of its variants every repetition already")
    if args.preset:
        outside = [name for name in wanted if name not in PRESETS[args.preset]]
        if outside:
            ap.error(f"--cases: {outside} not in --preset {args.preset} ({', '.join(PRESETS[args.preset])})")
        selection = {name: names for name, names in PRESETS[args.preset].items()
                     if not wanted or name in wanted}
    elif args.every_rep:
        if not args.only:
            ap.error("--every-rep names its variants with --only")
        selection = {name: [n for n in listed if n in {v["name"] for v in CASES[name]["variants"]}]
                     for name in wanted}
    else:
        selection = {name: None for name in wanted}
    if args.reps is None:
        args.reps = PRESET_REPS[args.preset] if args.preset else 2
    only = set(listed) if listed else None
    plan = {}
    for name, names in selection.items():
        runs = [(rep, v) for rep, v in schedule(CASES[name], args.reps, names) if only is None or v["name"] in only]
        if runs:
            plan[name] = runs
    if only:
        never = sorted(only - {v["name"] for runs in plan.values() for _, v in runs})
        if never:
            ap.error(f"--only: {never} not run by this selection (cases {', '.join(selection)}"
                     f"{', preset ' + args.preset if args.preset else ''})")
    if not plan:
        ap.error("nothing to run")
    return plan


def main():
    ap = build_parser()
    args = ap.parse_args()
    if args.merge:
        parts = [json.loads(Path(f).read_text()) for f in args.merge]
        # The runs' own commands and commits stay with each part: "commit" and "command" here
        # are the merge's (the first part's would misname every other part's runs).
        dates = sorted({part["meta"].get("date") or "?" for part in parts})
        merged = {"meta": {**parts[0]["meta"], "command": " ".join(sys.argv), "commit": code_commit(),
                           "date": dates[0] if len(dates) == 1 else f"{dates[0]}..{dates[-1]}",
                           "merged_from": args.merge,
                           "parts": [{"file": f, **{k: part["meta"].get(k) for k in ("command", "commit", "date", "gpu", "torch")}}
                                     for f, part in zip(args.merge, parts)]},
                  "rows": merge_rows([part["rows"] for part in parts]), "summary": []}
        for name in dict.fromkeys(r["case"] for r in merged["rows"]):
            merged["summary"] += aggregate(name, CASES[name], [r for r in merged["rows"] if r["case"] == name])
        merged["loss_curves"] = loss_curves(merged["rows"])
        merged["curve_runs"] = curve_runs(merged["rows"])
        out = Path(args.out)
        out.write_text(json.dumps(merged, indent=1))
        plot(merged, out.with_suffix(".png"))
        print_table(merged, out.with_suffix(".md"))
        return
    if args.plot:
        result = json.loads(Path(args.plot).read_text())
        plot(result, Path(args.plot).with_suffix(".png"))
        print_table(result, Path(args.plot).with_suffix(".md"))
        return
    plan = plan_runs(args, ap)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    py = sys.executable
    result = {"meta": versions(), "rows": [], "summary": []}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for name, runs in plan.items():
        case = CASES[name]
        ckpt = work / f"ckpt_{case.get('ckpt', name)}"
        if not (ckpt / "model.safetensors").exists():
            t0 = time.time()
            run([py, "scripts/make_random_checkpoint.py", "--builder", case["builder"],
                 "--out", str(ckpt), "--dtype", case.get("dtype", "bf16")], work / f"ckpt_{name}.log",
                args.run_timeout)
            print(f"checkpoint {name}: {time.time() - t0:.0f} s", flush=True)
        tokens_per_step = None if case.get("variable_tokens") else case["batch_size"] * case["seq_len"]
        for rep, variant in runs:
            tag = f"{name}_{variant['name']}_rep{rep}"
            out_dir = work / tag
            subprocess.run(["rm", "-rf", str(out_dir)])
            cfg_path = work / f"{tag}.yaml"
            write_config(cfg_path, case, variant, ckpt, out_dir)
            if variant["side"] == "stock":
                # The stock recipe file itself (torchtune's CLI imports its downloaders, whose
                # dependencies the benchmark machine may lack).
                import torchtune

                stock_file = Path(torchtune.__file__).resolve().parent.parent / "recipes" / f"{case['recipe']}.py"
                cmd = [py, str(stock_file), "--config", str(cfg_path)]
                if case.get("nproc"):
                    cmd = [py, "-m", "torch.distributed.run", "--nproc_per_node",
                           str(case["nproc"]), str(stock_file), "--config", str(cfg_path)]
            else:
                cmd = [py, "-m", "tune_recipes", "run", case["recipe"], "--config", str(cfg_path)]
                if case.get("nproc"):
                    cmd[4:4] = ["--nproc_per_node", str(case["nproc"])]
            row = {"case": name, "variant": variant["name"], "label": variant["label"], "rep": rep,
                   "side": variant["side"], "overrides": {k: v for k, v in variant["cfg"].items()},
                   "env": variant.get("env", {})}  # a lever set from the environment shows here
            try:
                wall = run(cmd, work / f"{tag}.log", args.run_timeout, variant.get("env"))
                row.update(wall_s=round(wall, 1),
                           **summarize(out_dir, tokens_per_step, case.get("warmup", 5)))
            except RuntimeError as e:
                row["error"] = str(e)[-1500:]
            result["rows"].append(row)
            print(json.dumps({k: v for k, v in row.items() if k not in ("losses", "overrides", "env")}),
                  flush=True)
            out.write_text(json.dumps(result, indent=1))  # after every run: a timeout keeps rows
        result["summary"] += aggregate(name, case, [r for r in result["rows"] if r["case"] == name])
    result["loss_curves"] = loss_curves(result["rows"])
    result["curve_runs"] = curve_runs(result["rows"])
    out.write_text(json.dumps(result, indent=1))
    plot(result, out.with_suffix(".png"))
    print_table(result, out.with_suffix(".md"))


if __name__ == "__main__":
    main()
