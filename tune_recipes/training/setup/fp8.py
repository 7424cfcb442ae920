"""``enable_fp8_training``: the transformer's linear layers compute in FP8 (torchao float8).

torchao's ``convert_to_float8_training`` swaps ``nn.Linear`` modules for ``Float8Linear``: the
weights, optimizer states and master copy stay in the training dtype; each forward casts the
input and the weight to float8 e4m3 with a dynamic scale (one per tensor for ``tensorwise``, one
per row for ``rowwise``), and backward casts the output gradient to e5m2, so the three matmuls
of a linear layer run on the FP8 tensor cores (about twice the bf16 rate on Hopper). Parameter
names do not change, so checkpoints load and save exactly as in bf16.

``fp8_recipe_name`` picks torchao's recipe: ``tensorwise`` (default; the fastest
on an H200, docs/benchmarks.md), ``rowwise`` (finer scales, more robust to outliers, slower there),
``rowwise_with_gw_hp`` (rowwise, weight gradient in high precision).

Trade-offs: the casts are separate memory-bound kernels unless ``compile: True`` fuses them into
their neighbours; without compile FP8 is usually *slower* than bf16, so a run without compile
gets a warning (not an error: it still trains, and an eager run is what one debugs with). Loss
curves follow bf16 within a small tolerance rather than bit-for-bit (docs/benchmarks.md).

LoRA (``lora_finetune_single_device``) does not use torchao: only the adapters train, so the
frozen base projections are quantized to FP8 once and only their input gradient is computed
(tune_recipes/modules/fp8_lora.py: half the base weights' GPU memory, ``tensorwise`` only, no
QLoRA or DoRA). Its recipe calls ``fp8_lora_wanted`` instead of ``fp8_recipe_wanted`` and hands
the answer to ``setup_lora_model(fp8=...)``.

A full fine-tune recipe calls two functions::

    self._fp8 = fp8_recipe_wanted(cfg, device)      # __init__: None, or the recipe name
    convert_to_fp8(model, self._fp8)                # on the built (or meta) model, before
                                                    # compile, sharding and the state-dict load
"""

import dataclasses
from typing import Callable, List, Optional

import torch
from omegaconf import DictConfig
from torch import nn
from torchtune.utils import get_logger

from tune_recipes.config import ConfigError
from tune_recipes.validation import FP8_RECIPES, dataset_packed, dataset_unpacked, fp8_lora_problem

log = get_logger("INFO")

# Modules never converted, by fully-qualified name (see should_convert).
SKIPPED_FQNS = ("output",)


def fp8_recipe_wanted(cfg: DictConfig, device: torch.device, is_main: bool = True,
                      has_compile_scope: bool = False) -> Optional[str]:
    """The torchao float8 recipe this run trains with, or None when ``enable_fp8_training`` is
    off. A ConfigError where FP8 cannot run: a non-CUDA device or a GPU without FP8 tensor
    cores (compute capability below 8.9, i.e. before Ada/Hopper). Warnings (main rank) for the
    settings measured slow: no compile; compile on unpacked data; and, for a recipe with a
    ``compile_scope`` key (``has_compile_scope``: the full fine-tune), packed data."""
    if not cfg.get("enable_fp8_training", False):
        return None
    name = cfg.get("fp8_recipe_name", None) or "tensorwise"
    if name not in FP8_RECIPES:
        raise ConfigError(f"fp8_recipe_name={name}: expected one of {', '.join(FP8_RECIPES)}")
    if device.type != "cuda":
        raise ConfigError(
            f"enable_fp8_training=True needs a CUDA GPU with FP8 tensor cores (compute "
            f"capability >= 8.9: Ada, Hopper or newer); this run's device is {device.type}. "
            "Set enable_fp8_training=False")
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        raise ConfigError(
            f"enable_fp8_training=True needs FP8 tensor cores (compute capability >= 8.9); "
            f"{torch.cuda.get_device_name(device)} is {major}.{minor}. "
            "Set enable_fp8_training=False")
    if not cfg.get("compile", False) and is_main:
        log.warning("enable_fp8_training without compile: the float8 casts run as separate "
                    "kernels and the step is usually slower than bf16; set compile=True")
    elif dataset_unpacked(cfg.get("dataset", None)) and is_main:
        # Measured on 2 H200s (torch 2.11, torchao 0.15): the tiny model's first step compiled in
        # 17 s; its second batch, 6 tokens shorter, set off a dynamic-shape recompile of the FP8
        # layers that had not finished within the smoke test's 240 s (docs/benchmarks.md).
        log.warning("enable_fp8_training with compile on unpacked data: every new batch length "
                    "recompiles the FP8 layers with dynamic shapes, which can take minutes per "
                    "recompile (torch 2.11); pack the dataset (dataset.packed=True) or give the "
                    "batches one fixed length")
    elif has_compile_scope and is_main and dataset_packed(cfg.get("dataset", None)):
        # Measured on one H200 (Llama-3.2-1B full, packed instruction rows, docs/benchmarks.md):
        # the README's FP8 settings ran 1.50x stock's compiled recipe against bf16's 1.21x (both
        # on flex attention, before flash attention's document spans), but
        # over 220 steps their loss ran up to 1.3% a step above stock's (0.46% over the last
        # 50), outside the 0.2% a step the benchmarks hold FP8 to: the packed-data config stays
        # bf16.
        log.warning("enable_fp8_training on packed data: faster than bf16 on an H200 (Llama-3.2-1B "
                    "full, 1.50x against bf16's 1.21x torchtune's compiled recipe, both on flex "
                    "attention), but its loss "
                    "ran up to %s a step above torchtune's bf16 run over 220 steps; compare the loss curves "
                    "(tune plot) before relying on it, or set enable_fp8_training=False", "1.3%")
    return name


def fp8_lora_wanted(cfg: DictConfig, device: torch.device, is_main: bool = True) -> bool:
    """Whether a LoRA run computes its frozen base projections in FP8. A ConfigError where it
    cannot: QLoRA, DoRA or an ``fp8_recipe_name`` other than ``tensorwise``
    (validation.fp8_lora_problem), then ``fp8_recipe_wanted``'s device checks."""
    problem = fp8_lora_problem(cfg)
    if problem:
        raise ConfigError(problem)
    return fp8_recipe_wanted(cfg, device, is_main) is not None


def should_convert(module: nn.Module, fqn: str) -> bool:
    """Whether the module at ``fqn`` trains in FP8.

    NOTE: two kinds of Linear stay in the training dtype, on purpose:
    - the output projection (LM head): its [tokens, vocab] product is the logits, so its
      rounding error goes straight into the softmax and the loss (torchtitan's float8 converter
      skips it by default too; FP8 there is untested here). It is also the layer our fused
      linear-CE loss computes on its own; a tied head (TiedLinear) is not an nn.Linear.
    - layers whose in or out features are not multiples of 16: the FP8 matmul
      (torch._scaled_mm) needs both dims of each operand divisible by 16, and torchao does not
      check this when it swaps, so such a layer would fail at its first forward on the GPU.
    """
    if not isinstance(module, nn.Linear):
        return False
    if fqn in SKIPPED_FQNS or fqn.split(".")[-1] in SKIPPED_FQNS:
        return False
    return module.in_features % 16 == 0 and module.out_features % 16 == 0


def convert_to_fp8(model: nn.Module, recipe_name: Optional[str],
                   module_filter: Callable[[nn.Module, str], bool] = should_convert,
                   fast_accum_backward: bool = False) -> List[str]:
    """Swap the model's eligible ``nn.Linear`` modules for torchao's ``Float8Linear`` in place
    (``recipe_name`` None: nothing). Returns the converted modules' names. Call it before
    compile, FSDP sharding and loading the state dict (parameter names are unchanged).

    ``fast_accum_backward`` (the key ``fp8_fast_accum_backward``): the two backward products
    (input and weight gradients) also use cuBLAS's fast FP8 accumulation, which torchao's
    recipes turn on for the forward product only. On Hopper the precise mode promotes the
    tensor cores' partial sums to fp32 at intervals; fast mode keeps them in the tensor cores'
    narrower accumulator. Its error is far below the e5m2 rounding the output gradient already
    has (docs/benchmarks.md: measured per product and as a 220-step loss curve, tensorwise).
    With ``rowwise_with_gw_hp`` the weight gradient is not an FP8 product; only the input
    gradient's accumulation changes there."""
    if recipe_name is None:
        return []
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    converted: List[str] = []

    def keep(module: nn.Module, fqn: str) -> bool:
        ok = module_filter(module, fqn)
        if ok and isinstance(module, nn.Linear):
            converted.append(fqn)
        return ok

    config = Float8LinearConfig.from_recipe_name(recipe_name)
    # NOTE: pad_inner_dim: the weight-gradient matmul's inner dimension is the micro-batch's
    # token count, which torch._scaled_mm also needs to be a multiple of 16; padded batches of
    # real data rarely are. torchao pads such operands with zeros (a no-op in value) instead of
    # failing mid-run; at aligned sizes the pad is empty.
    config = dataclasses.replace(config, pad_inner_dim=True)
    if fast_accum_backward:
        from torchao.float8.config import Float8GemmConfig

        fast = Float8GemmConfig(use_fast_accum=True)
        config = dataclasses.replace(config, gemm_config_grad_input=fast, gemm_config_grad_weight=fast)
    convert_to_float8_training(model, module_filter_fn=keep, config=config)
    if not converted:
        raise ConfigError("enable_fp8_training=True, but the model has no nn.Linear whose "
                          "dims are multiples of 16 (the output projection is never converted)")
    log.info("FP8 training (torchao float8, %s%s): %d linear layers converted", recipe_name,
             ", fast accumulation in backward too" if fast_accum_backward else "", len(converted))
    return converted
