"""LoRA/DoRA adapter initialization that does not depend on how the model was built.

Building on the meta device (distributed) or on the device (single) consumes the global RNG
differently, so the builders' own adapter init would differ between a 1-rank, an N-rank and a
single-device run. Here every adapter weight is drawn on the CPU from one generator seeded by
the run's seed, in parameter-name order: the same full tensors on every path (then sharded or
copied), so those runs train identically.
"""

import math
from typing import Dict

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import _CHECKPOINT_PREFIX
from torchtune.modules.peft import DoRALinear, LoRALinear

# Prefixes that wrappers add to module names but not to state-dict keys: activation
# checkpointing's wrapper strips its prefix in state_dict() and re-adds it in load_state_dict(),
# and torch.compile's OptimizedModule does the same with "_orig_mod.".
_WRAPPER_PREFIXES = (_CHECKPOINT_PREFIX, "_orig_mod.")


def state_dict_key(module_or_param_name: str) -> str:
    """The state-dict key of a name from ``named_modules()``/``named_parameters()``.

    NOTE: build state dicts from these names only through this function. A name taken from an
    activation-checkpointed model keeps the wrapper's prefix, and ``load_state_dict`` then adds
    it a second time: the key is "unexpected" and the load fails (or, non-strict, is ignored).
    """
    for prefix in _WRAPPER_PREFIXES:
        module_or_param_name = module_or_param_name.replace(prefix, "")
    return module_or_param_name


def adapter_init_state_dict(model: nn.Module, seed: int) -> Dict[str, torch.Tensor]:
    """Full CPU tensors for every ``lora_a`` (Kaiming-uniform, a=sqrt(5), as LoRA's reference
    init) and ``lora_b`` (zeros) weight of ``model``, which may live on the meta device."""
    gen = torch.Generator().manual_seed(int(seed) + 7919)
    out: Dict[str, torch.Tensor] = {}
    modules = {state_dict_key(name): m for name, m in model.named_modules()}
    for name, module in sorted(modules.items(), key=lambda kv: kv[0]):
        if not isinstance(module, (LoRALinear, DoRALinear)):
            continue
        a = module.lora_a.weight
        fan_in = a.shape[1]
        # kaiming_uniform_(a=sqrt(5)): gain = sqrt(2 / (1 + 5)), bound = gain * sqrt(3 / fan_in)
        bound = math.sqrt(2.0 / 6.0) * math.sqrt(3.0 / fan_in)
        a_init = (torch.rand(a.shape, generator=gen, dtype=torch.float32) * 2 - 1) * bound
        out[f"{name}.lora_a.weight"] = a_init.to(a.dtype)
        out[f"{name}.lora_b.weight"] = torch.zeros(module.lora_b.weight.shape, dtype=a.dtype)
    return out


def initialize_dora_magnitudes(model: nn.Module) -> None:
    """DoRA magnitudes start at the (loaded) base weight's column norms."""
    for m in model.modules():
        if hasattr(m, "initialize_dora_magnitude"):
            m.initialize_dora_magnitude()
