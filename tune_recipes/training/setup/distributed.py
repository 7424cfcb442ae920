"""FSDP2 sharding (and tensor parallelism under it) and loading for the distributed recipes.

Runs on GPUs with NCCL and on CPUs with gloo (so CI can test 2 processes); nothing here calls a
CUDA-only API unless the device is CUDA.
"""

from typing import Any, Dict, List, Optional

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module
from torchtune import config as tt_config, training
from torchtune.utils import get_logger

from tune_recipes.config import ConfigError
from tune_recipes.validation import brief, fsdp_offload_problem, tensor_parallel_model_problem
from tune_recipes.modules.document_attention import route_document_attention
from tune_recipes.modules.peft import adapter_init_state_dict, initialize_dora_magnitudes
from tune_recipes.training.setup import activations
from tune_recipes.training.setup.model import (
    adapter_does_not_fit,
    build_model,
    check_lora_keys,
    check_resumed_adapter_shapes,
    does_not_fit,
    weights_do_not_fit,
)

log = get_logger("INFO")


def check_tied_embedding_sharding(model: nn.Module, custom_sharded_layers) -> None:
    """With tied embeddings the output projection multiplies by ``tok_embeddings.weight``
    outside the embedding's own forward; sharded as its own FSDP unit, that weight is resharded
    by then and the product fails (mixed Tensor and DTensor) in the first forward."""
    from torchtune.modules import TiedLinear

    if "tok_embeddings" in (custom_sharded_layers or []) and isinstance(
        getattr(model, "output", None), TiedLinear
    ):
        raise ConfigError(
            "custom_sharded_layers: this model ties its output projection to tok_embeddings "
            "(Llama-3.2 1B/3B, Qwen2.5 up to 3B), so tok_embeddings cannot be its own FSDP "
            "unit; remove 'tok_embeddings' (and 'output', which it does not have) from "
            "custom_sharded_layers"
        )


def shard_and_load(
    cfg_model,
    *,
    dtype: torch.dtype,
    device: torch.device,
    world_size: int,
    full_state_dict: Dict[str, Any],
    adapter_state_dict: Optional[Dict[str, Any]] = None,
    adapter_init_seed: Optional[int] = None,
    ac_interval: Optional[int] = None,
    reshard_after_forward: bool = True,
    custom_sharded_layers: Optional[List[str]] = None,
    cpu_offload: bool = False,
    before_shard=None,
    device_mesh=None,
    tensor_parallel_plan: Optional[Dict[str, Any]] = None,
    key: str = "model",
):
    """Build the model on the meta device, shard it with FSDP2 (each transformer layer, any
    ``custom_sharded_layers``, then the root) and load full state dicts shard by shard.

    ``before_shard(model)`` runs on the meta model before sharding (e.g. marking LoRA params
    trainable or swapping in fake-quantized linears). For LoRA pass ``adapter_state_dict`` (a
    resumed adapter) or ``adapter_init_seed`` (fresh adapters from the seeded, build-independent
    init of tune_recipes.modules.peft): the base weights then load non-strictly and the
    result is ``(model, (base_missing, base_unexpected, adapter_missing, adapter_unexpected))``.
    Otherwise loading is strict and the second element is None. ``key``: the config key that
    builds it (``teacher_model``), named by a one-line error.

    ``cpu_offload`` (``fsdp_cpu_offload``): FSDP2's ``CPUOffloadPolicy`` through torchtune's
    ``shard_model``: sharded parameters, gradients and optimizer states live in pinned CPU
    memory, copied to the GPU for each all-gather, and the optimizer steps on the CPU (much less
    GPU memory, much slower steps). On a CPU device there is nothing to offload (and FSDP2's
    policy needs an accelerator to pin memory): a warning, and the run is as with it off.

    ``device_mesh`` (a 2-D ("dp", "tp") mesh, ``Runtime.mesh``) with ``tensor_parallel_plan``
    (``tensor_parallel_options``): tensor parallelism as torchtune 0.6.1 does it: attention
    modules count their local heads (``prepare_mha_for_tp``), the plan's layers become DTensor
    slices over the tp dimension (``parallelize_module``), then FSDP2 shards over the dp
    dimension only (none when it has size 1, as in stock). Loading slices the full state dict
    onto each parameter's own mesh and placements.
    """
    if cpu_offload and device.type != "cuda":
        if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
            log.warning("fsdp_cpu_offload: the model runs on %s, where parameters already are in "
                        "CPU memory; nothing to offload, sharding as if off", device.type)
        cpu_offload = False
    model = build_model(cfg_model, dtype, torch.device("meta"), key=key)
    if before_shard is not None:
        before_shard(model)
    route_document_attention(model)  # document-masked batches: see modules.document_attention
    fresh_adapters = adapter_state_dict is None and adapter_init_seed is not None
    if fresh_adapters:
        adapter_state_dict = adapter_init_state_dict(model, adapter_init_seed)
    check_tied_embedding_sharding(model, custom_sharded_layers)
    if device_mesh is None:
        dp_mesh = init_device_mesh(device.type, (world_size,))
    else:
        tp_mesh, dp_mesh = device_mesh["tp"], device_mesh["dp"]
        if tensor_parallel_plan is None:
            raise ConfigError(f"tensor_parallel_dim={tp_mesh.size()} needs "
                              "tensor_parallel_plan._component_")
        # NOTE: before activation checkpointing, whose wrappers rename the layers
        # (layers.0._checkpoint_wrapped_module.attn...) so the plan's names would match
        # nothing; and before FSDP, which shards the tensor-parallel slices over dp.
        check_tensor_parallel_model(model, tp_mesh.size())
        training.prepare_mha_for_tp(model, tp_mesh)
        parallelize_module(model, tp_mesh, parallelize_plan=dict(tensor_parallel_plan))
        # NOTE: a plan whose names match nothing leaves every rank a full replica that trains
        # the same numbers (all ranks see one batch), so nothing else would ever show it.
        params = list(model.parameters())
        sliced = sum(isinstance(p, DTensor) for p in params)
        if sliced == 0:
            raise ConfigError(f"tensor_parallel_plan: none of its module names "
                              f"({', '.join(sorted(tensor_parallel_plan))}) matches a layer of "
                              f"{getattr(cfg_model, '_component_', 'the model')}")
        if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
            log.info("tensor parallelism: %d of %d parameters sliced over %d ranks, FSDP2 over "
                     "%d replicas", sliced, len(params), tp_mesh.size(), dp_mesh.size())
    # Activation checkpointing of the layers ac_interval names (setup.activations), before FSDP
    # wraps them.
    activations.apply_activation_checkpointing(model, ac_interval)
    # Pure tensor parallelism (dp of 1) has nothing to shard: no FSDP2, as in stock (so
    # custom_sharded_layers, fsdp_reshard_after_forward and fsdp_cpu_offload do nothing then).
    if dp_mesh.size() > 1 or device_mesh is None:
        conditions = [
            lambda n, m: training.get_shard_conditions(n, m, names_to_match=custom_sharded_layers)
        ]
        try:
            training.shard_model(model, conditions, cpu_offload=cpu_offload,
                                 reshard_after_forward=reshard_after_forward, dp_mesh=dp_mesh)
        except AssertionError as e:
            # torchao's NF4 split (QLoRA): each base weight's quantization blocks must divide
            # evenly among the ranks; real model sizes do, small ones may not.
            if "not divisible by" not in str(e):
                raise
            raise ConfigError(
                f"{key}: {cfg_model.get('_component_')} with a quantized (NF4) base cannot be "
                f"sharded over {dp_mesh.size()} ranks ({brief(e)}: a base weight has fewer "
                "quantization blocks than ranks, or not a multiple of them); use fewer ranks or "
                "a larger model, or set quantize_base=False") from None
    with training.set_default_dtype(dtype), device:
        for m in model.modules():
            # RoPE caches are buffers built at init; meta init left them empty.
            if hasattr(m, "rope_init"):
                m.rope_init()
            if fresh_adapters and hasattr(m, "initialize_dora_magnitude"):
                # NOTE: fresh DoRA magnitudes are in no state dict: given storage here (the
                # module's own tensors, before the load fills the others), they are computed
                # from the loaded base weights afterwards (initialize_dora_magnitudes).
                m.to_empty(device="cpu" if cpu_offload else device, recurse=False)
    keys = None
    try:
        if adapter_state_dict is None:
            training.load_from_full_model_state_dict(model, full_state_dict, device, strict=True,
                                                     cpu_offload=cpu_offload)
        else:
            a_missing, a_unexpected = training.load_from_full_model_state_dict(
                model, adapter_state_dict, device, strict=False, cpu_offload=cpu_offload)
            b_missing, b_unexpected = training.load_from_full_model_state_dict(
                model, full_state_dict, device, strict=False, cpu_offload=cpu_offload)
            keys = (b_missing, b_unexpected, a_missing, a_unexpected)
    except (RuntimeError, AttributeError) as e:
        # NOTE: torchtune's sharded load looks every checkpoint key up in the model first: a
        # key the model lacks (a checkpoint with more layers) is an AttributeError on None.
        error = weights_do_not_fit(e, cfg_model, key) if isinstance(e, RuntimeError) \
            else _keys_the_model_lacks(model, full_state_dict, adapter_state_dict, cfg_model, key)
        if error is None:
            raise
        raise error from None
    training.validate_no_params_on_meta_device(model)
    return model, keys


def _keys_the_model_lacks(model: nn.Module, full_state_dict: Dict[str, Any],
                          adapter_state_dict: Optional[Dict[str, Any]], cfg_model,
                          key: str) -> Optional[ConfigError]:
    """The one-line error for checkpoint keys ``model`` has no weight for (as a single-device
    load names them); None when there are none (another failure)."""
    try:
        own = set(model.state_dict())
    except Exception:  # noqa: BLE001 - a state-dict hook that cannot run here: the original error stands
        return None
    for state_dict, what in ((full_state_dict, key), (adapter_state_dict or {}, "adapter")):
        extra = [k for k in state_dict if k not in own]
        if extra:
            shown = ", ".join(f'"{k}"' for k in extra[:3]) + (", ..." if len(extra) > 3 else "")
            detail = f"Unexpected key(s) in state_dict: {shown}"
            if what == "adapter":
                return adapter_does_not_fit(detail)
            return does_not_fit(cfg_model, key, detail)
    return None


def shard_and_load_lora(cfg_model, spec, *, dtype: torch.dtype, device: torch.device,
                        world_size: int, base_state_dict: Dict[str, Any],
                        adapter_state_dict: Optional[Dict[str, Any]], seed: int,
                        ac_interval: Optional[int] = None,
                        reshard_after_forward: bool = True,
                        custom_sharded_layers: Optional[List[str]] = None,
                        cpu_offload: bool = False,
                        extra_before_shard=None) -> nn.Module:
    """``shard_and_load`` for a LoRA model: only adapters train; fresh adapters come from the
    seeded init (the same tensors as the single-device recipe's), resumed ones from
    ``adapter_state_dict``; DoRA magnitudes start from the loaded base; missing/unexpected keys
    are checked against the LoRA ``spec``. ``extra_before_shard(meta_model)`` runs after the
    adapters are marked trainable (e.g. QAT swaps)."""
    from torchtune.modules.peft import (
        get_adapter_params,
        set_trainable_params,
    )

    def before(meta_model):
        params = get_adapter_params(meta_model)
        if not params:
            raise ConfigError(f"model: {cfg_model._component_} has no LoRA adapters")
        set_trainable_params(meta_model, params)
        if adapter_state_dict is not None:
            check_resumed_adapter_shapes(meta_model, adapter_state_dict)
        if extra_before_shard is not None:
            extra_before_shard(meta_model)

    model, (b_miss, b_unexp, a_miss, a_unexp) = shard_and_load(
        cfg_model, dtype=dtype, device=device, world_size=world_size,
        full_state_dict=base_state_dict, adapter_state_dict=adapter_state_dict,
        adapter_init_seed=seed, ac_interval=ac_interval,
        reshard_after_forward=reshard_after_forward, custom_sharded_layers=custom_sharded_layers,
        cpu_offload=cpu_offload, before_shard=before,
    )
    if adapter_state_dict is None:
        initialize_dora_magnitudes(model)
        a_miss = None  # the seeded init holds only lora_a/lora_b
    check_lora_keys(cfg_model, spec, b_miss, b_unexp, a_miss, a_unexp)
    return model


def check_tensor_parallel_model(model: nn.Module, tensor_parallel_dim: int) -> None:
    """``tensor_parallel_model_problem`` (heads split evenly, untied output) as a ConfigError.
    The config check already ran it in the parent process; this guards direct callers."""
    problem = tensor_parallel_model_problem(model, tensor_parallel_dim)
    if problem:
        raise ConfigError(problem)


def tensor_parallel_options(cfg, runtime) -> Dict[str, Any]:
    """``shard_and_load`` keyword arguments for ``tensor_parallel_dim``/``tensor_parallel_plan``:
    the runtime's 2-D mesh and the instantiated plan (nothing when tensor_parallel_dim is 1;
    the plan is then ignored, as in stock)."""
    if runtime.mesh is None:
        return {}
    plan_cfg = cfg.get("tensor_parallel_plan", None)
    if plan_cfg is None:
        raise ConfigError(f"tensor_parallel_dim={runtime.tensor_parallel_dim} needs "
                          "tensor_parallel_plan._component_ (e.g. "
                          "torchtune.models.llama3.base_llama_tp_plan)")
    plan = tt_config.instantiate(plan_cfg)
    if not isinstance(plan, dict) or not plan:
        raise ConfigError(f"tensor_parallel_plan: {plan_cfg.get('_component_')} returned "
                          f"{type(plan).__name__}, not a non-empty dict of module name -> "
                          "ParallelStyle")
    return dict(device_mesh=runtime.mesh, tensor_parallel_plan=plan)


def check_fused_loss_sharding(loss_fn, custom_sharded_layers) -> None:
    """The fused loss reads the output weight after the model's forward, from the root FSDP
    unit; a separately sharded output/embedding would hand it a shard. (With tensor
    parallelism it is refused by the config check, tune_recipes.validation.)"""
    custom = custom_sharded_layers or []
    if getattr(loss_fn, "is_fused_linear_loss", False) and (
        "output" in custom or "tok_embeddings" in custom
    ):
        raise ConfigError(
            "custom_sharded_layers: the fused loss uses the output weight after the model's "
            "forward, so 'output'/'tok_embeddings' must stay in the root FSDP unit; remove them"
        )


def fsdp_cpu_offload_requested(cfg) -> bool:
    """``fsdp_cpu_offload``, or the ``fsdp: {cpu_offload: ...}`` section some of torchtune's
    distributed LoRA configs carry instead (stock's recipes never read that section; every one
    of our distributed recipes does, as another spelling of the flat key). A malformed section
    or two spellings that disagree raise the error ``tune validate`` reports for the same config
    (one check: ``tune_recipes.validation.fsdp_offload_problem``)."""
    problem = fsdp_offload_problem(cfg)
    if problem:
        raise ConfigError(problem)
    flat = cfg.get("fsdp_cpu_offload", None)
    nested = (cfg.get("fsdp", None) or {}).get("cpu_offload", None)
    return bool(flat if flat is not None else (nested or False))


def fsdp_options(cfg) -> Dict[str, Any]:
    """The sharding keys of a distributed config (and its activation checkpointing), as
    ``shard_and_load`` keyword arguments."""
    custom = cfg.get("custom_sharded_layers", None)
    return dict(
        ac_interval=activations.ac_interval(cfg),
        reshard_after_forward=cfg.get("fsdp_reshard_after_forward", True),
        custom_sharded_layers=list(custom) if custom else None,
        cpu_offload=fsdp_cpu_offload_requested(cfg),
    )
