"""What scripts/bench_recipes.py measures: each side's settings, the models, the data, the cases
and the presets. To add a measurement, add a variant (config overrides for one side) to a case,
or a case (a model on data with its variants) to CASES.

A variant named ``stock_best`` or ``ours_best`` (or marked ``head``) runs every repetition; the
others are levers, run once. Ratios are taken against ``stock_best`` (``stock`` for a shipped
config; else the case's first stock variant).
"""

import yaml

_CHUNKED = {"_component_": "torchtune.modules.loss.CEWithChunkedOutputLoss"}
_FUSED = {"_component_": "tune_recipes.modules.loss.FusedLinearCrossEntropyLoss"}
# Stock's best at every size: compile on, activation checkpointing off (it fits; AC only adds
# recompute at a fixed number of tokens per step).
STOCK_BEST = dict(loss=_CHUNKED, compile=True)
# Ours' best, the README's fastest settings. 1B full: the whole model compiled as one graph,
# the optimizer step compiled, the fused loss, FP8 (tensorwise) with fast accumulation in
# backward, the first layer's MLP gate/up outputs kept in e4m3.
OURS_1B = dict(loss={**_FUSED, "chunk_size": 1312}, compile=True, compile_scope="model",
               compile_optimizer_step=True, enable_fp8_training=True, fp8_fast_accum_backward=True,
               fp8_mlp_activations=True, fp8_mlp_layers=1)
# 1B full on packed instruction data (the README's packed-data command): the same without FP8.
# FP8 is faster there (ours_fp8: 1.50x stock against bf16's 1.21x, both on flex attention) but over 220 steps its loss
# ran up to 1.3% a step above stock's, outside the 0.2% tolerance (docs/benchmarks.md).
# padding_free: each pack without the padding that fills it to 2048 tokens (~15% of these packs'
# tokens), the packs end to end (the shipped configs set it).
OURS_1B_PACKED = dict(loss=_FUSED, compile=True, compile_scope="model", compile_optimizer_step=True,
                      padding_free=True)
# The same with fused AdamW stepped inside backward (no gradient held for the whole model), the
# optimizer step not compiled (not with in-backward): a lever for the packed memory target.
OURS_1B_PACKED_IN_BWD = dict(loss=_FUSED, compile=True, compile_scope="model", optimizer_in_bwd=True,
                             clip_grad_norm=None, padding_free=True)
# 1B full on unpacked instruction data: each micro-batch's rows end to end, the whole model
# compiled. NOTE: its speed rests on flash attention's document spans (bf16 on a GPU that runs
# them): the graph compiles once, dynamic from the first batch. Through flex attention's block
# mask it compiled once static and once dynamic and took minutes before its fifth step on an H200.
OURS_1B_PADDED = dict(loss=_FUSED, compile=True, compile_scope="model", compile_optimizer_step=True,
                      padding_free=True)
# The same compiled per layer: padded rows (no document spans) change length too, and per layer
# only a layer's graph compiles again.
_PADDED_PER_LAYER = {**OURS_1B_PADDED, "compile_scope": "layers"}
# The same on padded rows (no padding_free: 128-token multiples on a GPU).
_PADDED_ROWS = {k: v for k, v in _PADDED_PER_LAYER.items() if k != "padding_free"}
# 8B LoRA: the frozen base in FP8, the adapters' inputs in e4m3, the frozen embedding in CPU
# memory; OURS_8B_LORA also keeps 20 layers' FP8 weights transposed (speed for memory).
OURS_8B_FP8 = dict(loss=_FUSED, compile=True, enable_fp8_training=True, fp8_adapter_inputs=True,
                   embedding_on_cpu=True)
OURS_8B_LORA = dict(**OURS_8B_FP8, fp8_transposed_weight_layers=20)


def _v(name, side, label, head=None, env=None, **cfg):
    """A variant: config overrides on top of its case's config (``env``: extra environment
    variables for its run, e.g. a scripts/bench_hooks lever)."""
    head = name in ("stock_best", "ours_best") if head is None else head
    return dict(name=name, side=side, label=label, head=head, cfg=cfg, env=env or {})


def _on_a_smaller_gpu(gib: int, micro_batch: int, ours: dict) -> list:
    """What ours' memory buys on a GPU of ``gib`` GiB (the allocator capped 0.5 GiB below, bench
    hook BENCH_MEMORY_CAP_GIB): stock's best there, with activation checkpointing, at half the
    micro-batch with gradient accumulation 2, and ours there."""
    cap = {"BENCH_MEMORY_CAP_GIB": str(gib - 0.5)}
    return [_v(f"stock_best_{gib}g", "stock", f"stock: compile, {gib} GiB GPU", env=cap, **STOCK_BEST),
            _v(f"stock_ac_{gib}g", "stock", f"stock: compile + AC, {gib} GiB GPU", env=cap,
               enable_activation_checkpointing=True, **STOCK_BEST),
            _v(f"stock_ga2_{gib}g", "stock", f"stock: compile, batch {micro_batch} x GA 2, {gib} GiB GPU",
               env=cap, batch_size=micro_batch, gradient_accumulation_steps=2, **STOCK_BEST),
            _v(f"ours_best_{gib}g", "ours", f"ours: fastest settings, {gib} GiB GPU", env=cap, **ours)]


# torchao's 8-bit moments at the 1B cases' rate (tune_recipes.optim.AdamW8bit)
_ADAMW8BIT = {"_component_": "tune_recipes.optim.AdamW8bit", "lr": 2e-5}
_LORA = {"lora_attn_modules": ["q_proj", "v_proj", "output_proj"], "apply_lora_to_mlp": True,
         "lora_rank": 8, "lora_alpha": 16}
_ADAMW = {"_component_": "torch.optim.AdamW", "lr": 2e-5, "fused": True}
MODELS = {
    "tiny": dict(recipe="full_finetune_single_device", builder="tune_recipes.models.tiny_llama3",
                 model={"_component_": "tune_recipes.models.tiny_llama3"}, batch_size=4,
                 device="cpu", dtype="fp32", seq_len=512, median_words=24,
                 optimizer={"_component_": "torch.optim.AdamW", "lr": 2e-5},
                 extra={"optimizer_in_bwd": False, "enable_activation_checkpointing": False}),
    # Llama-3.2-1B full fine-tune, 4 sequences (or packs) of 2048 tokens a step.
    "1b": dict(recipe="full_finetune_single_device", builder="torchtune.models.llama3_2.llama3_2_1b",
               model={"_component_": "torchtune.models.llama3_2.llama3_2_1b"}, batch_size=4,
               optimizer=_ADAMW, extra={"optimizer_in_bwd": False, "enable_activation_checkpointing": False}),
    # Llama-3.1-8B LoRA (rank 8 on q/v/output and the MLP), 2 x 2048 tokens a step.
    "8b_lora": dict(recipe="lora_finetune_single_device", builder="torchtune.models.llama3_1.llama3_1_8b",
                    model={"_component_": "torchtune.models.llama3_1.lora_llama3_1_8b", **_LORA},
                    batch_size=2, optimizer={**_ADAMW, "lr": 3e-4},
                    extra={"enable_activation_checkpointing": False, "save_adapter_weights_only": True}),
}
MODELS["8b_qlora"] = {**MODELS["8b_lora"], "model": {
    **MODELS["8b_lora"]["model"], "_component_": "torchtune.models.llama3_1.qlora_llama3_1_8b"}}
# Two GPUs, FSDP2 (the nvidia-h200-x2 kind): per-rank batch 4 x 2048.
_FSDP = {"enable_activation_checkpointing": False, "fsdp_reshard_after_forward": True}
MODELS["1b_2gpu"] = {**MODELS["1b"], "recipe": "full_finetune_distributed", "nproc": 2, "extra": _FSDP}
MODELS["1b_lora_2gpu"] = {**MODELS["1b_2gpu"], "recipe": "lora_finetune_distributed",
                          "model": {"_component_": "torchtune.models.llama3_2.lora_llama3_2_1b", **_LORA},
                          "optimizer": {**_ADAMW, "lr": 3e-4}, "extra": {**_FSDP, "save_adapter_weights_only": True}}

# Full-length rows: a learnable synthetic stream (a random 256-token block from a 4096-token
# sub-vocabulary, repeated), every sequence seq_len long: no padding, no document masks.
# Instruction rows: scripts/make_instruction_data.py, packed with document masks or padded.
DATA = {"synthetic": {"kind": "synthetic", "data_vocab": 4096, "data_repeat": 256},
        "packed": {"kind": "instruct", "packed": True},
        "padded": {"kind": "instruct", "packed": False}}


def _case(model: str, data: str, variants: list, **kw) -> dict:
    """``steps``: the least optimizer steps a run (a loss curve); ``warmup``/``window``: the
    clock's batches (default 5 and 20)."""
    return {"seq_len": 2048, "median_words": 40, **MODELS[model], "data": DATA[data],
            "variants": variants, **kw}


_STOCK = _v("stock_best", "stock", "stock: compile", **STOCK_BEST)
_OURS_1B = _v("ours_best", "ours", "ours: README fastest settings", **OURS_1B)
# The same settings as stock's best but for the loss: what the recipe itself costs.
_SAME = _v("ours_same", "ours", "ours: compile + fused CE, bf16 (stock's settings)", loss=_FUSED, compile=True)
_OURS_1B_LEVERS = [
    _SAME, _v("ours_bf16_model", "ours", "ours: whole model compiled + fused CE, bf16", loss=_FUSED,
              compile=True, compile_scope="model", compile_optimizer_step=True),
    _v("ours_fp8_layers", "ours", "ours: per-layer compile + fused CE + FP8", loss=_FUSED,
       compile=True, enable_fp8_training=True)]
_OURS_8B = _v("ours_best", "ours", "ours: README fastest settings", **OURS_8B_LORA)
_OURS_8B_NO_T = _v("ours_fp8_ain_embcpu", "ours", "ours: fastest without fp8_transposed_weight_layers",
                   **OURS_8B_FP8)
# What QLoRA is for (an 8B fine-tune in less memory), ours' way: the bf16-base LoRA model with its
# frozen base in FP8 instead of NF4, at stock QLoRA's tokens and steps.
_FP8_INSTEAD = _v("ours_fp8_instead", "ours", "ours: FP8 base instead of NF4", head=True,
                  model=MODELS["8b_lora"]["model"], **OURS_8B_FP8)
_QLORA = [_STOCK, _v("ours_best", "ours", "ours: compile + fused CE (NF4)", loss=_FUSED, compile=True),
          _FP8_INSTEAD]


def _without_pack_padding(variant: dict) -> dict:
    """``variant`` with ``padding_free`` as the shipped configs set it: on packed rows the
    recipe then decides whether the packs lose their padding
    (``training.setup.data.packs_without_padding``: not with compiled FP8, as in the 8B LoRA
    settings)."""
    return {**variant, "cfg": {**variant["cfg"], "padding_free": True}}
_SAME_2GPU = [_v("stock_chunked", "stock", "stock, chunked CE", loss=_CHUNKED),
              _v("ours_chunked", "ours", "ours, chunked CE", loss=_CHUNKED),
              _v("ours_fused", "ours", "ours, fused CE", loss=_FUSED)]

CASES = {
    # A CPU dry run of the whole pipeline (both CLIs, the hook, the summary; numbers meaningless);
    # ``--set dataset.packed=False`` runs it padded.
    "tiny_cpu": _case("tiny", "packed", [_v("stock_best", "stock", "stock", loss=_CHUNKED),
                                         _v("ours_best", "ours", "ours: fused CE", loss=_FUSED)],
                      warmup=2, window=4),
    "full_1b": _case("1b", "synthetic", [_STOCK, _OURS_1B, *_OURS_1B_LEVERS, *_on_a_smaller_gpu(20, 2, OURS_1B)]),
    # The published packed table's window: 20 warm-up batches, 40 timed.
    "full_1b_packed": _case("1b", "packed", [
        _STOCK, _v("ours_best", "ours", "ours: README packed-data settings (bf16)", **OURS_1B_PACKED),
        # the packs' padding computed, as before padding_free removed it from packs
        _v("ours_pack_padding", "ours", "ours: packed settings, each pack's padding computed",
           **{**OURS_1B_PACKED, "padding_free": False}),
        # the memory target (0.75x): compile's recompute chooser keeping 70% of the activations
        _v("ours_budget_07", "ours", "ours: packed settings, compiled graphs saving 70% of activations",
           **OURS_1B_PACKED, activation_memory_budget=0.7),
        # what the trained MLPs' recomputed down-projection input and the compact k and v save
        # and cost: each undone (bench hooks)
        _v("ours_torchtune_mlp", "ours", "ours: packed settings, torchtune's MLP (its product saved)",
           env={"BENCH_TORCHTUNE_MLP": "1"}, **OURS_1B_PACKED),
        _v("ours_expanded_kv", "ours", "ours: packed settings, torchtune's MLP, k and v saved as expanded views",
           env={"BENCH_TORCHTUNE_MLP": "1", "BENCH_EXPANDED_KV": "1"}, **OURS_1B_PACKED),
        _SAME, _v("ours_fp8", "ours", "ours: the full-row FP8 settings", **OURS_1B),
        # Which part of the FP8 settings moves the loss (over 220 steps: --steps 220): FP8
        # products alone (no fast accumulation in backward, no e4m3 MLP activations), and those
        # with rowwise scales (a scale a row instead of a tensor).
        _v("ours_fp8_plain", "ours", "ours: packed settings + FP8 tensorwise products only",
           **OURS_1B_PACKED, enable_fp8_training=True),
        _v("ours_fp8_rowwise", "ours", "ours: packed settings + FP8 rowwise products",
           **OURS_1B_PACKED, enable_fp8_training=True, fp8_recipe_name="rowwise"),
        _v("ours_fp8_gw_hp", "ours", "ours: packed settings + FP8 rowwise products, weight gradients in bf16",
           **OURS_1B_PACKED, enable_fp8_training=True, fp8_recipe_name="rowwise_with_gw_hp"),
        _OURS_1B_LEVERS[2],
        _v("ours_in_bwd", "ours", "ours: packed settings, fused AdamW stepped in backward",
           **OURS_1B_PACKED_IN_BWD),
        _v("ours_in_bwd_budget", "ours", "ours: the same, compiled graphs saving 90% of activations",
           **OURS_1B_PACKED_IN_BWD, activation_memory_budget=0.9),
        # Optimizer states in 8 bits (torchtune's shipped 1B full config steps bitsandbytes'
        # 8-bit AdamW): 4.6 GiB of bf16 moments become ~2.3 (one byte each, and a scale a block).
        _v("ours_8bit", "ours", "ours: packed settings, AdamW8bit (torchao's states) after backward",
           **{**OURS_1B_PACKED, "compile_optimizer_step": False}, optimizer=_ADAMW8BIT),
        # the same with its step compiled, alike parameters in batches (29 calls a step at 1B, not 149)
        _v("ours_8bit_compiled", "ours", "ours: packed settings, AdamW8bit stepped in compiled batches",
           **OURS_1B_PACKED, optimizer=_ADAMW8BIT)],
        warmup=20, window=40),
    "full_1b_padded": _case("1b", "padded", [
        _STOCK, _v("ours_best", "ours", "ours: padding-free, whole model compiled, fused CE (bf16)", **OURS_1B_PADDED),
        _v("ours_free_layers", "ours", "ours: padding-free, compiled per layer",
           **_PADDED_PER_LAYER),
        _v("ours_padded", "ours", "ours: compiled per layer on padded rows (128-token multiples)",
           **_PADDED_ROWS),
        _v("ours_padded_longest", "ours", "ours: padded rows, to the longest row only (as stock)",
           env={"BENCH_PAD_MULTIPLE": "1"}, **_PADDED_ROWS),
        # Padded to the longest row, a new length most batches: host work per new shape (in
        # cuDNN attention in the profile). Stock padded to 128-token multiples as ours pads; both
        # padded to the longest without cuDNN attention.
        _v("stock_pad128", "stock", "stock: padded to 128-token multiples", env={"BENCH_PAD_MULTIPLE": "128"},
           **STOCK_BEST),
        *[_v(f"{side}_no_cudnn", side, f"{side}: padded to the longest, SDPA without cuDNN",
             env={"BENCH_SDPA_NO_CUDNN": "1", "BENCH_PAD_MULTIPLE": "1"}, **cfg)
          for side, cfg in (("stock", STOCK_BEST),
                            ("ours", _PADDED_ROWS))],
        _v("ours_fp8", "ours", "ours: the full-row FP8 settings", **OURS_1B), *_OURS_1B_LEVERS,
        # the recompile at Inductor's length bound (per layer: 2559): gone with size-oblivious
        # reasoning, and at what speed? (--env TORCH_LOGS=recompiles --window 150)
        _v("ours_free_layers_oblivious", "ours", "ours: padding-free per layer, size-oblivious dynamic shapes",
           env={"BENCH_BACKED_SIZE_OBLIVIOUS": "1"}, **_PADDED_PER_LAYER),
        _v("ours_best_oblivious", "ours", "ours: padding-free whole model, size-oblivious dynamic shapes",
           env={"BENCH_BACKED_SIZE_OBLIVIOUS": "1"}, **OURS_1B_PADDED),
        # a full garbage collection inside the window (the clock's gc_pauses)? the same with
        # every object alive at the warm-up's end frozen out of later collections
        _v("ours_free_layers_gc_freeze", "ours", "ours: padding-free per layer, gc.freeze() after warm-up",
           env={"BENCH_GC_FREEZE": "1"}, **_PADDED_PER_LAYER),
        # short steps: the optimizer step's fixed cost weighs more than packed
        _v("ours_8bit_compiled", "ours", "ours: padding-free, AdamW8bit stepped in compiled batches",
           **OURS_1B_PADDED, optimizer=_ADAMW8BIT),
        # The 4-row step: host and GPU about equally long (under the profiler it looked
        # host-bound, its GPU idle ~30% of the step):
        # Inductor's C++ wrapper (launches without Python). CUDA graphs a length ran slower
        # (docs/benchmarks.md).
        _v("ours_cpp_wrapper", "ours", "ours: padding-free, whole model compiled with Inductor's C++ wrapper",
           env={"TORCHINDUCTOR_CPP_WRAPPER": "1"}, **OURS_1B_PADDED),
        # where the host's step goes (the clock's host_samples; no slowdown measured), and the
        # data path moved out of the training process
        _v("ours_host_samples", "ours", "ours: padding-free, whole model compiled, host stacks sampled",
           env={"BENCH_HOST_SAMPLES": "1"}, **OURS_1B_PADDED),
        _v("ours_loader_worker", "ours", "ours: padding-free, whole model compiled, one dataloader worker",
           env={"BENCH_LOADER_WORKERS": "1"}, **OURS_1B_PADDED),
        # a 30 ms sleep kernel queued before each window step (BENCH_GPU_SLEEP_MS): does the
        # step lengthen by the sleep (the GPU's timeline sets it) or less (the host's does)?
        # Not a speed row
        _v("ours_gpu_busy", "ours", "ours: padding-free, whole model compiled, a 30 ms sleep kernel before each step",
           env={"BENCH_GPU_SLEEP_MS": "30"}, **OURS_1B_PADDED)],
        warmup=20, window=40, steps=220),  # padded steps are short: a 220-step loss curve too
    # Unpacked rows, 16 a step: about the examples and tokens of a packed step (4 packs of 2048
    # hold ~16 rows), so a per-token rate against packed's is not a rate of smaller steps.
    "full_1b_padded_16": _case("1b", "padded", [
        _STOCK, _v("ours_best", "ours", "ours: padding-free, whole model compiled, fused CE (bf16)", **OURS_1B_PADDED)],
        batch_size=16, warmup=20, window=40),
    "lora_8b": _case("8b_lora", "synthetic", [_STOCK, _OURS_8B, _OURS_8B_NO_T, _SAME,
                                              *_on_a_smaller_gpu(24, 1, OURS_8B_FP8)]),
    "lora_8b_packed": _case("8b_lora", "packed", [
        _STOCK, *map(_without_pack_padding, [_OURS_8B, _OURS_8B_NO_T]), _SAME]),
    "lora_8b_padded": _case("8b_lora", "padded", [_STOCK, _OURS_8B, _OURS_8B_NO_T, _SAME]),
    "qlora_8b": _case("8b_qlora", "synthetic", _QLORA),
    "qlora_8b_packed": _case("8b_qlora", "packed", [_STOCK, *map(_without_pack_padding, _QLORA[1:])]),
    # Loss curves: 220 steps where the loss moves (1B at lr 3e-4; 8B at torchtune's own 3e-4).
    "full_1b_curve": _case("1b", "synthetic", [_STOCK, _OURS_1B], steps=220, optimizer={**_ADAMW, "lr": 3e-4}),
    "lora_8b_curve": _case("8b_lora", "synthetic", [_STOCK, _OURS_8B], steps=220),
    "qlora_8b_curve": _case("8b_qlora", "synthetic", [_STOCK, _FP8_INSTEAD], steps=220),
    # FSDP2 on two GPUs: the same settings on both sides; then each side's best (the distributed
    # recipe compiles per layer).
    "full_1b_2gpu": _case("1b_2gpu", "synthetic", [
        *_SAME_2GPU, _STOCK, _v("ours_best", "ours", "ours: compile + fused CE + FP8 + fast accumulation",
                                compile=True, enable_fp8_training=True, fp8_fast_accum_backward=True, loss=_FUSED)]),
    "lora_1b_2gpu": _case("1b_lora_2gpu", "synthetic", _SAME_2GPU),
}


# Our single-device configs whose torchtune 0.6.1 twin has another name (the same models,
# method and data): ours -> stock's.
STOCK_TWINS = {"llama3_2/8B_to_1B_kd_single_device": "llama3_2/8B_to_1B_KD_lora_single_device"}
SHIPPED_RECIPES = ("full_finetune_single_device", "lora_finetune_single_device",
                   "knowledge_distillation_single_device")


def _base_builder(component: str) -> str:
    module, fn = component.rsplit(".", 1)
    return f"{module}.{fn.removeprefix('qlora_').removeprefix('lora_')}"


def shipped_cases() -> dict:
    """``shipped:<config>`` for each of our single-device fine-tune and distillation configs
    that torchtune 0.6.1 ships under the same name (or the twin STOCK_TWINS names): both as
    shipped, on the padded or packed instruction data as each config's ``dataset.packed``
    says. A distillation case also builds its teacher's checkpoint (``teacher_builder``)."""
    from tune_recipes._cli import registry

    out, stock_root = {}, registry._stock()[1] / "configs"
    for name in registry.list_configs():
        recipe = registry.recipe_for_config(name)
        stock = stock_root / f"{STOCK_TWINS.get(name, name)}.yaml"
        if recipe in SHIPPED_RECIPES and stock.is_file():
            ours = registry.resolve_config(name).path
            ours_cfg = yaml.safe_load(ours.read_text())
            out[f"shipped:{name}"] = dict(
                recipe=recipe, shipped={"stock": stock, "ours": ours},
                builder=_base_builder(ours_cfg["model"]["_component_"]), seq_len=2048,
                median_words=40, data={"kind": "instruct"},
                variants=[_v("stock", "stock", "torchtune 0.6.1's config as shipped", head=True),
                          _v("ours", "ours", "our config as shipped", head=True),
                          _v("ours_padded", "ours", "our config as shipped, padding_free=False",
                             padding_free=False), *_shipped_levers(recipe, ours_cfg)])
            if "teacher_model" in ours_cfg:
                out[f"shipped:{name}"]["teacher_builder"] = _base_builder(ours_cfg["teacher_model"]["_component_"])
    return out


def _shipped_levers(recipe: str, ours: dict) -> list:
    """What a shipped config of ours trades: the allocator's default (no expandable segments),
    compile, packing (what each config's header quotes), the optimizer's memory against speed
    (full fine-tunes), no activation checkpointing, or on every second layer instead of every
    layer, or through torch's non-reentrant checkpoint instead of the reentrant one, torchtune's
    Llama RoPE instead of ours (eager), QLoRA's NF4 weights dequantized by torchao instead of ours,
    a micro-batch twice as large over half the accumulation (the same examples a step), alone and
    compiled."""
    levers = [_v("ours_default_allocator", "ours", "our config, the CUDA allocator's default settings",
                 env={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}),
              _v("ours_compiled", "ours", "our config, compile=True", compile=True),
              # the key a header names, alone: with the shipped padding_free=True the packs
              # leave their padding out
              _v("ours_packed", "ours", "our config, dataset.packed=True (other steps: compare label tokens/s)",
                 dataset={"packed": True})]
    eight_bit = "8bit" in ours["optimizer"]["_component_"]
    ga = ours.get("gradient_accumulation_steps", 1)
    if recipe.startswith("full") and eight_bit:
        levers.append(_v("ours_bf16_adamw", "ours", "our config, torch's fused AdamW stepped after backward",
                         optimizer={"_component_": "torch.optim.AdamW", "lr": ours["optimizer"]["lr"], "fused": True},
                         optimizer_in_bwd=False, clip_grad_norm="inf"))
    elif recipe.startswith("full") and ga == 1:
        levers.append(_v("ours_8bit_in_bwd", "ours", "our config, AdamW8bit (torchao's states, sliced step) stepped in backward",
                         optimizer={"_component_": "tune_recipes.optim.AdamW8bit", "lr": ours["optimizer"]["lr"]},
                         optimizer_in_bwd=True, clip_grad_norm=None))
    if ours.get("enable_activation_checkpointing", False):
        # Does the config's model fit without the recompute (the default a config should take
        # where it does), and how much faster is it then?
        levers.append(_v("ours_no_ac", "ours", "our config, no activation checkpointing",
                         enable_activation_checkpointing=False))
        # Half the recompute for the activation memory of half the layers: where a config's
        # peak is below stock's, the headroom may buy speed.
        levers.append(_v("ours_ac_every_2", "ours", "our config, every second layer checkpointed",
                         enable_activation_checkpointing=False, ac_mode="selective", ac_option=2))
        # The reentrant checkpoint's lighter host work (the recipes' eager default) against
        # torchtune's non-reentrant one, in a step that waits on the host.
        levers.append(_v("ours_ac_non_reentrant", "ours", "our config, torch's non-reentrant checkpoint (torchtune's)",
                         env={"BENCH_AC_NON_REENTRANT": "1"}))
    if not ours.get("compile", False) and "qwen" not in ours["model"]["_component_"]:
        levers.append(_v("ours_torchtune_rope", "ours", "our config, torchtune's RoPE (eager)",
                         env={"BENCH_TORCHTUNE_ROPE": "1"}))
    if not ours.get("compile", False):
        levers.append(_v("ours_torchtune_rms_norm", "ours", "our config, torchtune's RMSNorm (eager)",
                         env={"BENCH_TORCHTUNE_RMS_NORM": "1"}))
    if "qlora" in ours["model"]["_component_"]:
        levers.append(_v("ours_torchao_nf4", "ours", "our config, torchao's NF4 dequantization",
                         env={"BENCH_NF4_TORCHAO": "1"}))
    if ga % 2 == 0:
        levers.append(_v("ours_double_batch", "ours", "our config, twice the micro-batch, half the accumulation",
                         batch_size=2 * ours["batch_size"], gradient_accumulation_steps=ga // 2))
        # both host-time levers at once: a candidate default where the eager step waits on the host
        levers.append(_v("ours_compiled_double_batch", "ours",
                         "our config, compile=True, twice the micro-batch, half the accumulation",
                         compile=True, batch_size=2 * ours["batch_size"], gradient_accumulation_steps=ga // 2))
    return levers


CASES.update(shipped_cases())

# Ours' variant per case whose figures the README's fastest-settings table quotes: the settings
# of its commands and _fast configs (tests/unit/test_readme_fast.py holds them equal).
CLAIM = {"full_1b": "ours_best", "lora_8b": "ours_best", "qlora_8b": "ours_fp8_instead",
         "full_1b_packed": "ours_best", "full_1b_padded": "ours_best", "lora_8b_packed": "ours_best"}
# --preset NAME: cases and the variants of each, every one run every repetition.
PRESETS = {
    # the headline: instruction rows, packed and padded, each side's best
    "instruct": {**{c: ["stock_best", "ours_best"] for c in ("lora_8b_packed", "lora_8b_padded")},
                 "full_1b_padded": ["stock_best", "ours_best", "ours_padded"],
                 "full_1b_packed": ["stock_best", "ours_best", "ours_same", "ours_fp8"],
                 "qlora_8b_packed": ["stock_best", "ours_fp8_instead"]},
    "shipped": {c: ["stock", "ours"] for c in CASES if c.startswith("shipped:")},
    # the reference: full-length rows, each side's best
    "claim": {case: ["stock_best", variant] for case, variant in CLAIM.items()
              if CASES[case]["data"]["kind"] == "synthetic"},
    # what ours' memory buys on a smaller GPU
    "memory": {"full_1b": ["stock_best", *[v["name"] for v in _on_a_smaller_gpu(20, 2, {})]],
               "lora_8b": ["stock_best", *[v["name"] for v in _on_a_smaller_gpu(24, 1, {})]]},
    # 220-step loss curves, each side's best
    "curves": {c: [v["name"] for v in CASES[c]["variants"]] for c in ("full_1b_curve", "lora_8b_curve", "qlora_8b_curve")},
}
PRESET_REPS = {"instruct": 2, "shipped": 1, "claim": 2, "memory": 1, "curves": 1}
