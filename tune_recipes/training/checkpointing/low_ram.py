"""``low_cpu_ram``: save a LoRA/QLoRA run's merged model without a full extra copy in CPU RAM.

The default save takes ``model.state_dict()`` (for QLoRA, torchtune's state-dict hook
dequantizes *every* NF4 weight into CPU memory at once), copies it (the merge adds the adapter
deltas in place, never into the live weights), and merges: about two copies of the model in
anonymous CPU memory at the peak.

Here the state dict is built tensor by tensor into one memory-mapped scratch file in the run's
``output_dir``: each weight is dequantized (NF4) on its device, copied into its slot of the
file and dropped before the next, and each adapter is merged into its slot in place, one module
at a time. The slots are file-backed page cache (written back to disk, evictable under
pressure), not anonymous memory. What still lives in anonymous memory: one weight at a time, the
adapters, and what torchtune's checkpointer does when writing (HF format: permuted q/k
projections and one output file's bytes; docs/recipes/lora_finetune_single_device.md has the
measurement).

torchtune 0.6.1's version of the key (``_low_ram_reparametrize_as_dtype_state_dict_post_hook``)
also maps the dequantized weights from a file, but always ``/tmp/fake_state_dict.pt`` (shared by
every run on the machine, left behind) and merges outside it. Ours is scratch space in
``output_dir`` (needs the model's size free there), unlinked as soon as it is mapped, and the
result is the same file bytes as with ``low_cpu_ram`` off (tests/recipes/test_low_cpu_ram.py).
"""

import functools
import os
import tempfile
from pathlib import Path
from typing import Dict, Optional

import numpy as np
import torch
from torch import nn

_ALIGN = 64  # bytes: every slot starts aligned for any dtype view


def _is_adapter_key(key: str) -> bool:
    # torchtune's get_adapter_state_dict rule: LoRA matrices and DoRA magnitudes.
    return "lora" in key or "magnitude" in key


def _reparametrize_hook(model: nn.Module):
    """torchtune's NF4 dequantizing state-dict hook on ``model`` (QLoRA builders register it
    on the root), as (hook id, its dtype), or None."""
    from torchtune.modules.common_utils import reparametrize_as_dtype_state_dict_post_hook

    for hook_id, hook in model._state_dict_hooks.items():
        if isinstance(hook, functools.partial) and \
                hook.func is reparametrize_as_dtype_state_dict_post_hook:
            return hook_id, hook.keywords.get("dtype", torch.bfloat16)
    return None


def _raw_state_dict(model: nn.Module):
    """``model.state_dict()`` without the NF4 hook (its whole point is to dequantize every
    weight at once, which is what this module avoids), and the dtype that hook would give."""
    found = _reparametrize_hook(model)
    if found is None:
        return model.state_dict(), None
    hook_id, dtype = found
    hooks = model._state_dict_hooks
    # NOTE: only that hook is set aside (other root hooks, e.g. fusion models' key renames,
    # still run), and every hook is back in its order whatever happens.
    original = list(hooks.items())
    del hooks[hook_id]
    try:
        return model.state_dict(), dtype
    finally:
        hooks.clear()
        hooks.update(original)


def _slot_dtype(key: str, value: torch.Tensor, nf4_dtype, dora_modules, adapters) -> torch.dtype:
    from torchao.dtypes.nf4tensor import NF4Tensor

    module = key[: -len(".weight")] if key.endswith(".weight") else None
    if module in dora_modules:
        # torchtune's DoRA merge returns the weight in the adapter's dtype.
        return adapters[f"{module}.lora_a.weight"].dtype
    if isinstance(value, NF4Tensor):
        return nf4_dtype if nf4_dtype is not None else value.dtype
    return value.dtype


def file_backed_state_dict(model: nn.Module, scratch_dir: Path) -> Dict[str, torch.Tensor]:
    """The model's full state dict on the CPU, as ``model.state_dict()`` plus a copy would give
    it (NF4 weights dequantized to the dtype torchtune's hook uses), but every non-adapter
    tensor in its own slot of one memory-mapped file in ``scratch_dir``, filled one tensor at a
    time. Adapters (small) are ordinary CPU copies. The tensors may be modified in place."""
    from torchao.dtypes.nf4tensor import NF4Tensor

    raw, nf4_dtype = _raw_state_dict(model)
    adapters = {k: v for k, v in raw.items() if _is_adapter_key(k)}
    dora_modules = {k[: -len(".magnitude")] for k in adapters if k.endswith(".magnitude")}
    plan, total = {}, 0
    for k, v in raw.items():
        if k in adapters:
            continue
        dtype = _slot_dtype(k, v, nf4_dtype, dora_modules, adapters)
        nbytes = v.numel() * torch.empty((), dtype=dtype).element_size()
        plan[k] = (tuple(v.shape), dtype, total, nbytes)
        total += -(-nbytes // _ALIGN) * _ALIGN
    scratch_dir = Path(scratch_dir)
    scratch_dir.mkdir(parents=True, exist_ok=True)
    fd, path = tempfile.mkstemp(prefix=".low_cpu_ram_", suffix=".bin", dir=scratch_dir)
    try:
        os.close(fd)
        mapped = np.memmap(path, dtype=np.uint8, mode="w+", shape=(max(total, 1),))
    finally:
        # NOTE: unlinked at once: the mapping keeps the space until the state dict is dropped,
        # and no run (or crash) leaves a model-sized file behind.
        os.unlink(path)
    out: Dict[str, torch.Tensor] = {}
    for k, v in raw.items():
        if k in adapters:
            out[k] = v.detach().to("cpu", copy=True)
            continue
        shape, dtype, offset, nbytes = plan[k]
        # NOTE: one numpy view per tensor, so each has its own storage: safetensors refuses
        # to write tensors that share one (and torch.save would write the whole file).
        slot = torch.from_numpy(mapped[offset: offset + nbytes]).view(dtype).view(shape)
        v = v.detach()
        if isinstance(v, NF4Tensor):
            # Dequantized on v's device to the hook's dtype first, as the default save does
            # (a DoRA slot then upcasts it: NF4 -> fp32 directly would round differently).
            v = v.to(nf4_dtype if nf4_dtype is not None else v.dtype)
        slot.copy_(v)
        out[k] = slot
    return out


def merge_lora_in_place(state_dict: Dict[str, torch.Tensor], rank: int, alpha: float
                        ) -> Dict[str, torch.Tensor]:
    """torchtune's ``get_merged_lora_ckpt``, one module at a time, each merged weight written
    back into its own (file-backed) tensor: the same numbers, never more than one module's
    temporaries. Adapter keys are removed, as torchtune does."""
    from torchtune.modules.peft import get_merged_lora_ckpt

    modules = [k[: -len(".lora_a.weight")] for k in list(state_dict) if k.endswith(".lora_a.weight")]
    for module in modules:
        part = {f"{module}.{s}": state_dict[f"{module}.{s}"]
                for s in ("weight", "lora_a.weight", "lora_b.weight", "magnitude")
                if f"{module}.{s}" in state_dict}
        slot = state_dict[f"{module}.weight"]
        merged = get_merged_lora_ckpt(part, rank=rank, alpha=alpha)[f"{module}.weight"]
        if merged is not slot:
            # DoRA builds a new tensor (in the slot's dtype, planned so); LoRA added in place.
            slot.copy_(merged)
        for s in ("lora_a.weight", "lora_b.weight", "magnitude"):
            state_dict.pop(f"{module}.{s}", None)
    return state_dict
