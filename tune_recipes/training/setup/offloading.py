"""``enable_activation_offloading``: keep the activations saved for backward in CPU memory.

torchtune's ``OffloadActivations`` (built by ``training.get_act_offloading_ctx_manager``) is a
saved-tensors hook: during the forward it copies every activation autograd saves (above 1 KiB,
parameters excluded) to pinned CPU memory on a side CUDA stream, and copies it back in backward,
overlapped with compute. It skips the output projection (moving [b, s, V] logits out and back
costs more than it saves). With activation checkpointing on, only each layer's input is saved,
so this offloads a handful of tensors per layer; without it, every intermediate would cross the
PCIe bus twice, which is why (as in stock) offloading requires
``enable_activation_checkpointing: True``.

Trade-off: GPU memory for activations drops to about one layer's worth, paid in host memory and
in copy time that the side stream mostly hides (not yet measured here: see docs/configs.md).

On a CPU device there is nothing to offload (activations already live in CPU memory) and
torchtune's context cannot even be built without CUDA (it takes ``torch.cuda.default_stream()``),
so the key is accepted, a one-line warning says it does nothing, and training runs exactly as
with it off. (Stock raises instead; a CPU run of a GPU config should not fail on a memory knob.)

A recipe calls two functions::

    self._offload = activation_offloading_wanted(cfg, device)   # __init__: checks the flags
    offload_activations(self._model, self._offload)             # setup: after the model exists

``offload_activations`` enters the context around the model's own forward (pre/post forward
hooks on the root module), so the loss code is unchanged, a distillation teacher (another
module, run under no_grad) is untouched, and a fused loss that applies the output projection
after the forward never offloads it.
"""

import contextlib
from typing import Optional

import torch
from omegaconf import DictConfig
from torch import nn
from torchtune import training
from torchtune.utils import get_logger

from tune_recipes.config import ConfigError
from tune_recipes.validation import activation_offloading_problem

log = get_logger("INFO")


def activation_offloading_wanted(cfg: DictConfig, device: torch.device, is_main: bool = True) -> bool:
    """Whether this run offloads activations: ``enable_activation_offloading`` checked against
    the other flags (a ConfigError) and the device (False, with a warning, on CPU)."""
    if not cfg.get("enable_activation_offloading", False):
        return False
    # The same check `tune validate` makes, so a config it passes does not fail here.
    problem = activation_offloading_problem(cfg)
    if problem:
        raise ConfigError(problem)
    if device.type != "cuda":
        if is_main:
            log.warning("enable_activation_offloading: the model runs on %s, where activations "
                        "already are in CPU memory; nothing to offload, training as if off",
                        device.type)
        return False
    return True


def wrap_forward(model: nn.Module, ctx: contextlib.AbstractContextManager) -> None:
    """Run every forward of ``model`` inside ``ctx`` (a reusable saved-tensors hooks context)."""
    model.register_forward_pre_hook(lambda *args: ctx.__enter__())
    model.register_forward_hook(lambda *args: ctx.__exit__(None, None, None), always_call=True)


def offload_activations(model: nn.Module, enabled: bool) -> Optional[contextlib.AbstractContextManager]:
    """Install torchtune's offloading context around ``model``'s forward when ``enabled``
    (from ``activation_offloading_wanted``); returns the context, or None."""
    if not enabled:
        return None
    ctx = training.get_act_offloading_ctx_manager(model, True)
    wrap_forward(model, ctx)
    return ctx
