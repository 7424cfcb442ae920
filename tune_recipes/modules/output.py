"""Let a torchtune decoder return its final hidden states, for a loss that applies the output
projection itself (the fused linear + cross-entropy loss)."""

import types
from typing import Optional

import torch
from torch import nn
from torchtune.modules import TiedLinear

from tune_recipes.config import ConfigError


class OutputProjection:
    """The output layer's weight (and bias), looked up at call time so it follows whatever
    module currently owns the parameter (tied embeddings, FSDP-managed parameters)."""

    def __init__(self, module: nn.Module, tied: bool) -> None:
        self.module = module
        self.tied = tied

    @property
    def weight(self) -> torch.Tensor:
        return self.module.weight

    @property
    def bias(self) -> Optional[torch.Tensor]:
        return None if self.tied else getattr(self.module, "bias", None)


def return_hidden_states(model: nn.Module) -> OutputProjection:
    """Make ``model(...)`` return normed hidden states [b, s, d] instead of logits.

    torchtune 0.6.1's ``TransformerDecoder`` has no switch for this: its ``unembed`` applies the
    norm, the output layer and an fp32 upcast. This replaces ``unembed`` on this instance with
    the norm alone (keeping the hidden states in the model dtype) and returns the projection
    for the loss to use.
    """
    out = getattr(model, "output", None)
    if isinstance(out, TiedLinear):
        proj = OutputProjection(out.tied_module, tied=True)
    elif type(out) is nn.Linear:
        proj = OutputProjection(out, tied=False)
    else:
        raise ConfigError(
            f"loss: the fused linear cross-entropy needs a plain linear output layer, but "
            f"model.output is {type(out).__name__}"
            + (" (a LoRA-adapted head: set model.apply_lora_to_output=False)"
               if "LoRA" in type(out).__name__ or "DoRA" in type(out).__name__ else "")
            + "; or use loss._component_=torch.nn.CrossEntropyLoss"
        )
    if not hasattr(model, "unembed") or not hasattr(model, "norm"):
        raise ConfigError(f"model {type(model).__name__} has no unembed/norm to bypass")

    def unembed_hidden_states(self, h):
        return self.norm(h)

    model.unembed = types.MethodType(unembed_hidden_states, model)
    return proj
