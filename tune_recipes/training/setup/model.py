"""Single-device models, ready to train (the distributed ones: ``setup.distributed``)."""

import json
import os
from pathlib import Path
from typing import Any, Callable, Dict, Optional

import torch
from omegaconf import DictConfig
from torch import nn
from torchtune import config as tt_config, training
from torchao.dtypes.nf4tensor import NF4Tensor
from torchtune.utils import get_logger

from tune_recipes.config import ConfigError
from tune_recipes.modules.fp8_lora import convert_lora_to_fp8
from tune_recipes.modules.document_attention import mark_varying_lengths_dynamic, route_document_attention
from tune_recipes.modules.fp8_mlp import convert_mlps_to_fp8_saved
from tune_recipes.modules.host_embedding import keep_embedding_on_cpu
from tune_recipes.modules.nf4 import use_lean_nf4_dequantization
from tune_recipes.modules.rms_norm import use_fused_rms_norm
from tune_recipes.modules.rope import use_interleaved_rope
from tune_recipes.modules.swiglu_down import recompute_down_inputs
from tune_recipes.modules.peft import adapter_init_state_dict, initialize_dora_magnitudes
from tune_recipes.training.checkpointing.io import ADAPTER_CONFIG_FILE, LoRASpec
from tune_recipes.training.setup.activations import apply_activation_checkpointing
from tune_recipes.training.setup.fp8 import convert_to_fp8
from tune_recipes.validation import activation_memory_budget_value, brief

log = get_logger("INFO")


def _keep_mlp_products_in_fp8(model: nn.Module, fp8_mlp_layers: Optional[int], products: str) -> None:
    """``fp8_mlp_activations`` for both setups: the swap (``modules.fp8_mlp``) and its log line."""
    mlps = convert_mlps_to_fp8_saved(model, max_mlps=fp8_mlp_layers)
    which = ""
    if fp8_mlp_layers:
        layers = "layer 0" if fp8_mlp_layers == 1 else f"layers 0-{fp8_mlp_layers - 1}"
        which = f" (fp8_mlp_layers={fp8_mlp_layers}: {layers})"
    log.info("fp8_mlp_activations: %d MLPs keep their %s in float8 e4m3 for backward%s",
             len(mlps), products, which)


def setup_full_model(cfg_model: DictConfig, *, dtype, device, state_dict: Dict[str, Any],
                     compile_model: bool = False, ac_interval: Optional[int] = None,
                     ac_reentrant: bool = False,
                     before_load: Optional[Callable[[nn.Module], nn.Module]] = None,
                     fp8_recipe: Optional[str] = None, compile_scope: Optional[str] = None,
                     activation_memory_budget: Optional[float] = None,
                     fp8_fast_accum_backward: bool = False,
                     fp8_mlp_activations: bool = False,
                     fp8_mlp_layers: Optional[int] = None, key: str = "model") -> nn.Module:
    """A model whose every parameter trains: built in ``dtype`` on ``device``, then
    ``before_load(model)`` (e.g. QAT's swap to fake-quantized linears, which keeps parameter
    names), the swap to FP8 linears when ``fp8_recipe`` names a torchao float8 recipe
    (``setup.fp8``), compile (or, eager, ``compile_or_lighten``'s lighter RoPE and RMSNorm),
    activation checkpointing of the layers ``ac_interval`` names (``setup.activations``: None none, 1 every
    layer, k every k-th; ``ac_reentrant``: through torch's reentrant checkpoint,
    ``setup.activations.checkpoint_reentrant``), and ``state_dict`` loaded strictly.
    ``compile_scope``: ``layers`` (default, torchtune's: each transformer layer its own graph) or
    ``model`` (the whole forward one graph: one guard check and one autograd wrapper a step
    instead of one per layer, fusion across layer boundaries, a longer first compile).
    ``activation_memory_budget``: see ``set_activation_memory_budget`` (compile only).
    ``fp8_fast_accum_backward``: see ``setup.fp8.convert_to_fp8`` (FP8 only).
    ``key``: the model's config key, for errors (``teacher_model``: a distillation teacher).
    ``fp8_mlp_activations``: each MLP (``fp8_mlp_layers`` N: the first N layers') keeps its
    gate and up products in float8 e4m3 for backward and runs its down product itself
    (``modules.fp8_mlp``; FP8 or not)."""
    model = build_model(cfg_model, dtype, device, key=key)
    if before_load is not None:
        model = before_load(model)
    # Before compile (which must trace the Float8Linear forward) and before the load (names
    # are unchanged, so the strict load below also checks the swap).
    convert_to_fp8(model, fp8_recipe, fast_accum_backward=fp8_fast_accum_backward)
    if fp8_mlp_activations:
        # After the FP8 swap (the MLP reads its down projection's FP8 settings), before compile.
        _keep_mlp_products_in_fp8(model, fp8_mlp_layers, "gate and up products")
    route_document_attention(model)  # document-masked batches: see modules.document_attention
    compile_or_lighten(model, compile_model, compile_scope, activation_memory_budget)
    apply_activation_checkpointing(model, ac_interval, reentrant=ac_reentrant)
    load_weights(model, state_dict, cfg_model, key=key)
    training.validate_expected_param_dtype(model.named_parameters(), dtype=dtype)
    return model


def compile_or_lighten(model: nn.Module, compile_model: bool, compile_scope: Optional[str] = None,
                       activation_memory_budget: Optional[float] = None) -> None:
    """Compiled: ``compile_layers_or_model``. Eager: Llama's RoPE and every RMSNorm computed in
    fewer kernels, the same arithmetic (``modules.rope``, ``modules.rms_norm``). NOTE: not
    under compile, where Inductor fuses torchtune's forms into single kernels anyway and the
    compiled runs measured in docs/benchmarks.md keep their graphs."""
    if compile_model:
        compile_layers_or_model(model, compile_scope, activation_memory_budget)
    else:
        use_interleaved_rope(model)
        use_fused_rms_norm(model)


def build_model(cfg_model: DictConfig, dtype: torch.dtype, device: torch.device,
                key: str = "model") -> nn.Module:
    """``<key>._component_`` built with its arguments in ``dtype`` on ``device``; a builder's
    refusal of them (torchtune's raise ValueError or AssertionError, e.g. LoRA on an output
    projection tied to the embeddings) as one line naming the key and the builder."""
    try:
        with training.set_default_dtype(dtype), device:
            return tt_config.instantiate(cfg_model)
    except (ValueError, AssertionError) as e:
        raise ConfigError(f"{key}: {cfg_model.get('_component_')} refused its arguments "
                          f"({type(e).__name__}: {brief(e)})") from None


def adapter_does_not_fit(detail: str) -> ConfigError:
    """The one line for a resumed adapter trained with other LoRA settings (``detail``: what
    differs), wherever it is found."""
    return ConfigError(
        f"model: the adapter being resumed does not fit this run's LoRA settings ({detail}); "
        "model.lora_rank, lora_alpha, lora_attn_modules, apply_lora_to_mlp, "
        "apply_lora_to_output and use_dora must be the checkpoint's (see the run's config.yaml)")


def check_resumed_adapter_shapes(model: nn.Module, adapter_state_dict: Dict[str, Any]) -> None:
    """A resumed adapter's tensors against the freshly built model's (a meta model's too):
    another ``lora_rank`` is one line naming the first that differs, not torch's size-mismatch
    list. Keys the model lacks are left to ``check_lora_keys``.

    NOTE: the parameters, not ``model.state_dict()``: a QLoRA model's state-dict hook
    dequantizes every NF4 base weight to a CPU copy (the whole model, on every resume), and
    fails outright on the meta model the distributed recipes shard."""
    own = dict(model.named_parameters())
    for key, value in adapter_state_dict.items():
        if key in own and tuple(own[key].shape) != tuple(value.shape):
            raise adapter_does_not_fit(f"{key} is {list(value.shape)} in the checkpoint, "
                                       f"{list(own[key].shape)} in this run's model")


def check_resumed_adapter_scale(cfg_model: DictConfig, checkpoint: Path) -> None:
    """A resumed adapter trained with another ``lora_alpha`` fits every tensor shape, yet
    scales each update differently (alpha / rank): the loss jumped on the first resumed step.
    The checkpoint's PEFT ``adapter_config.json`` records its alpha (DoRA runs write none:
    not checked)."""
    try:
        saved = json.loads((checkpoint / ADAPTER_CONFIG_FILE).read_text())
    except (OSError, ValueError):
        return
    alpha = saved.get("lora_alpha") if isinstance(saved, dict) else None
    configured = cfg_model.get("lora_alpha", None)
    try:
        differs = alpha is not None and configured is not None and float(alpha) != float(configured)
    except (TypeError, ValueError):
        return
    if differs:
        raise adapter_does_not_fit(f"lora_alpha is {alpha} in the checkpoint, {configured} in "
                                   "this run's config")


def check_lora_keys(cfg_model: DictConfig, lora, base_missing, base_unexpected, lora_missing,
                    lora_unexpected) -> None:
    """torchtune's check that only the LoRA ``lora`` spec's adapters lack base weights (and
    the adapter dict holds only adapters), with its AssertionError (a base checkpoint of
    another model or format) as one line naming ``model`` and the checkpoint to compare."""
    from torchtune.modules.peft import validate_missing_and_unexpected_for_lora

    try:
        validate_missing_and_unexpected_for_lora(
            lora_attn_modules=lora.attn_modules, apply_lora_to_mlp=lora.apply_to_mlp,
            apply_lora_to_output=lora.apply_to_output, base_missing=base_missing,
            base_unexpected=base_unexpected, lora_missing=lora_missing,
            lora_unexpected=lora_unexpected)
    except AssertionError as e:
        reason = brief(e)
        if "loading adapter" in reason or "from adapter state dict" in reason:
            # Only a resumed run loads an adapter: one trained with other LoRA settings.
            raise adapter_does_not_fit(reason) from None
        raise ConfigError(
            f"model: {cfg_model.get('_component_')} does not fit the checkpoint's weights "
            f"({reason}); check model._component_ and checkpointer._component_ against "
            "checkpointer.checkpoint_dir") from None


def load_weights(model: nn.Module, state_dict: Dict[str, Any], cfg_model: DictConfig,
                 strict: bool = True, key: str = "model"):
    """``model.load_state_dict``, with weights of other shapes (a checkpoint of another model
    size or family than ``<key>._component_`` builds) as one line naming the config key, the
    builder and the first mismatched weight, not torch's list of every one."""
    try:
        return model.load_state_dict(state_dict, strict=strict)
    except RuntimeError as e:
        error = weights_do_not_fit(e, cfg_model, key)
        if error is None:
            raise
        raise error from None


def weights_do_not_fit(e: RuntimeError, cfg_model: DictConfig, key: str = "model") -> Optional[ConfigError]:
    """torch's "Error(s) in loading state_dict" (every mismatched weight, on every rank) as the
    one-line ConfigError naming ``key``, its builder and the first mismatch; None for any other
    RuntimeError."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    if not lines or not lines[0].startswith("Error(s) in loading state_dict"):
        return None
    mismatches = [line for line in lines[1:] if line.startswith("size mismatch")]
    return does_not_fit(cfg_model, key, brief((mismatches or lines[1:] or [""])[0]))


def does_not_fit(cfg_model: DictConfig, key: str, detail: str) -> ConfigError:
    """The one line for a checkpoint whose weights ``<key>._component_`` does not build."""
    return ConfigError(
        f"{key}: {cfg_model.get('_component_')} does not fit the checkpoint's weights "
        f"({detail}); check {key}._component_ against "
        f"{key.replace('model', 'checkpointer')}.checkpoint_dir")


def set_activation_memory_budget(budget: Optional[float]) -> None:
    """``activation_memory_budget``: how much of the activations a compiled graph saves for
    backward (torch._functorch.config.activation_memory_budget), from 0 (the least its
    partitioner can reach: it recomputes everything it can, as if the graph were checkpointed)
    to 1 (torch's default plan). In between, the partitioner recomputes the ops it estimates
    cheapest (by FLOPs: pointwise ops first, matrix products last) in backward instead of
    saving their outputs. None leaves torch's setting as it is (as ``cudnn_deterministic_mode:
    null`` does), so a caller that set it in its own code keeps it. Measured:
    docs/benchmarks.md.

    NOTE: the setting is process-wide and read when a graph is traced, and torch.compile reuses
    a graph it already traced for another instance of the same module class without checking
    it. So a change of value clears dynamo's compiled code (torch._dynamo.reset()); a recipe
    calls this before its first compile, where that clears nothing."""
    import torch._dynamo
    import torch._functorch.config as functorch_config

    problem = activation_memory_budget_value(budget)
    if problem:
        raise ConfigError(f"activation_memory_budget={budget}: {problem}")
    if budget is None:
        return
    value = float(budget)
    if value != functorch_config.activation_memory_budget:
        torch._dynamo.reset()
        functorch_config.activation_memory_budget = value
    if value < 1.0:
        log.info("activation memory budget %g: compiled graphs recompute the cheapest ops in "
                 "backward instead of saving them (0: all they can, 1: torch's default)", value)


def compile_layers(model: nn.Module, verbose: bool = True) -> None:
    """torchtune's per-transformer-layer compile, and padding-free batches' lengths dynamic from
    the first batch (``mark_varying_lengths_dynamic``): one compile for every length.

    NOTE: single device only. Under FSDP2 each sharded layer's pre-forward hook hands the layer
    a new tensor (its backward bookkeeping) without the mark, so the distributed recipes keep
    torchtune's compile: a first-length graph, then a dynamic one."""
    training.compile_model(model, verbose=verbose)
    mark_varying_lengths_dynamic(model)


def compile_layers_or_model(model: nn.Module, scope: Optional[str],
                            activation_memory_budget: Optional[float] = None) -> None:
    """torch.compile per transformer layer (``layers``/None, as torchtune) or the whole model,
    under ``activation_memory_budget`` (``set_activation_memory_budget``), each trained SwiGLU
    MLP recomputing its down projection's input in backward (``modules.swiglu_down``). Route the
    model's document attention first (``route_document_attention``), so that it compiles into
    the graphs."""
    set_activation_memory_budget(activation_memory_budget)
    recomputing = recompute_down_inputs(model)
    if recomputing:
        log.info("compile: %d MLPs recompute their down projection's input in backward "
                 "(modules.swiglu_down)", recomputing)
    if scope in (None, "layers"):
        compile_layers(model)
    elif scope == "model":
        model.compile(backend=os.environ.get("TORCH_COMPILE_BACKEND", "inductor"))
    else:
        raise ConfigError(f"compile_scope={scope}: expected layers or model")


def embedding_on_cpu_wanted(cfg: DictConfig, device: torch.device) -> bool:
    """``embedding_on_cpu``, checked before any work: it needs a CUDA device (the tied-embedding
    refusal comes when the model is built)."""
    wanted = bool(cfg.get("embedding_on_cpu", False))
    if wanted and torch.device(device).type != "cuda":
        raise ConfigError(f"embedding_on_cpu=True needs device=cuda (device={torch.device(device).type}: "
                          "the table is in CPU memory already); set embedding_on_cpu=False")
    return wanted


def setup_lora_model(cfg_model: DictConfig, *, dtype, device, seed: int,
                     base_state_dict: Dict[str, Any],
                     lora_state_dict: Optional[Dict[str, Any]],
                     compile_model: bool = False,
                     ac_interval: Optional[int] = None, ac_reentrant: bool = False,
                     fp8: bool = False, compile_scope: Optional[str] = None,
                     embedding_on_cpu: bool = False, fp8_mlp_activations: bool = False,
                     fp8_adapter_inputs: bool = False, fp8_transposed_weight_layers: int = 0,
                     activation_memory_budget: Optional[float] = None,
                     fp8_mlp_layers: Optional[int] = None):
    """A single-device LoRA/QLoRA/DoRA model, ready to train: built in ``dtype`` on
    ``device``, only the adapters trainable, the base weights loaded, the adapters from
    ``lora_state_dict`` (a resume) or a seeded init, DoRA magnitudes from the base weights, and
    both loads checked against the LoRA layout; ``ac_interval`` and ``ac_reentrant`` as in
    ``setup_full_model``; with
    ``fp8`` the frozen base projections then compute in FP8 (``modules.fp8_lora``; their bf16
    weights move to CPU memory, under the same names); with ``embedding_on_cpu`` the frozen token
    embedding stays in pinned CPU memory and each step's rows are read from there
    (``modules.host_embedding``); with ``fp8_mlp_activations`` each MLP (``fp8_mlp_layers`` N:
    the first N layers') keeps its intermediate products in FP8 for backward
    (``modules.fp8_mlp``); with ``fp8_adapter_inputs`` (and ``fp8``)
    the adapters' weight gradients read the FP8 base product's e4m3 input, so backward keeps 1
    byte of each adapter input instead of 2 (``modules.fp8_lora``); with
    ``fp8_transposed_weight_layers`` N the first N transformer layers' FP8 weights are also kept
    transposed, so their backward needs no transpose copy; ``activation_memory_budget`` as in
    ``setup_full_model``. Returns ``(model, LoRASpec)``."""
    from torchtune.modules.peft import (
        get_adapter_params,
        set_trainable_params,
    )

    resuming = bool(lora_state_dict)
    model = build_model(cfg_model, dtype, device)
    if resuming:
        check_resumed_adapter_shapes(model, lora_state_dict)
    adapter_params = get_adapter_params(model)
    if not adapter_params:
        raise ConfigError(
            f"model: {cfg_model._component_} has no LoRA adapters; use a lora_*/qlora_* "
            "builder or the full_finetune_single_device recipe"
        )
    lora = LoRASpec.from_model_config(cfg_model)  # after the check: it reads the lora_* keys
    set_trainable_params(model, adapter_params)
    if (not compile_model and any(isinstance(p, NF4Tensor) for p in model.parameters())
            and use_lean_nf4_dequantization()):
        log.info("QLoRA: NF4 base weights dequantized by tune_recipes.modules.nf4 (torchao's "
                 "values, fewer kernels)")
    route_document_attention(model)  # document-masked batches: see modules.document_attention
    compile_or_lighten(model, compile_model, compile_scope, activation_memory_budget)
    apply_activation_checkpointing(model, ac_interval, reentrant=ac_reentrant)
    base_missing, base_unexpected = load_weights(model, base_state_dict, cfg_model, strict=False)
    if not lora_state_dict:
        # Seeded, build-independent adapter init: the same as the distributed recipes'.
        lora_state_dict = adapter_init_state_dict(model, seed)
    lora_missing, lora_unexpected = model.load_state_dict(lora_state_dict, strict=False)
    if not resuming:
        # DoRA magnitudes start from the loaded base weights (a resumed run loads them);
        # the init dict holds only lora_a/lora_b, so its "missing" keys are expected.
        initialize_dora_magnitudes(model)
        lora_missing = None
    check_lora_keys(cfg_model, lora, base_missing, base_unexpected, lora_missing, lora_unexpected)
    training.validate_expected_param_dtype(adapter_params.items(), dtype=dtype)
    if fp8:
        # NOTE: after both loads (each base weight is quantized here, once, from the loaded
        # values) and before the first forward (compile above only marks the layers; they are
        # traced at their first call, with the FP8 modules in place).
        converted = convert_lora_to_fp8(model, fp8_adapter_inputs=fp8_adapter_inputs,
                                        transposed_weight_layers=fp8_transposed_weight_layers)
        log.info("FP8 LoRA: %d frozen base projections in float8 e4m3 (tensorwise); their bf16 "
                 "weights are in CPU memory%s%s", len(converted),
                 "; the adapters' weight gradients read their e4m3 inputs" if fp8_adapter_inputs else "",
                 f"; layers 0-{fp8_transposed_weight_layers - 1} also keep them transposed for backward"
                 if fp8_transposed_weight_layers else "")
    if fp8_mlp_activations:
        # After the FP8 base conversion: the swapped MLPs call their down projection's base
        # product themselves, FP8 or not.
        _keep_mlp_products_in_fp8(model, fp8_mlp_layers, "intermediate products")
    if embedding_on_cpu:
        held = keep_embedding_on_cpu(model)
        log.info("embedding_on_cpu: the token embedding (%.2f GiB) is in pinned CPU memory",
                 held / 1024**3)
    return model, lora
