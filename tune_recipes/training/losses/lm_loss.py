"""One place that turns (model, batch) into the mean next-token loss, for any loss component:
plain cross-entropy on logits, torchtune's chunked cross-entropy, or our fused linear
cross-entropy on hidden states."""

from typing import Dict, Optional

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torchtune import training

from tune_recipes.modules.output import return_hidden_states
from tune_recipes.training.step.batch import shift_labels


class CausalLMLoss:
    def __init__(self, model: nn.Module, loss_fn: nn.Module, compile_loss: bool = False) -> None:
        self.model = model
        self.loss_fn = loss_fn
        self.ignore_index = loss_fn.ignore_index
        self.fused = getattr(loss_fn, "is_fused_linear_loss", False)
        self.projection = None
        if self.fused:
            self.projection = return_hidden_states(model)
        elif hasattr(loss_fn, "num_output_chunks"):
            # Chunked CE: the model returns its logits in chunks, never one [b, s, V] tensor.
            model.set_num_output_chunks(loss_fn.num_output_chunks)
        if compile_loss and not self.fused:
            # The fused loss computes its own chunks; compiling it would only add graph breaks.
            training.compile_loss(loss_fn)

    def __call__(self, batch: Dict[str, torch.Tensor], scaling: float = 1.0,
                 num_tokens: Optional[int] = None) -> torch.Tensor:
        """Mean loss over the batch's unmasked tokens. ``scaling`` is the factor the caller will
        multiply the loss by before backward (used by the fused loss to pre-scale gradients);
        ``num_tokens``, the count of those tokens if known (count_valid_tokens on the CPU
        labels), spares the fused loss its host sync."""
        labels = shift_labels(batch.pop("labels"), self.ignore_index)
        out = self.model(**batch)
        if self.fused:
            if isinstance(self.model, FSDPModule):
                # The output weight lives in the root FSDP unit, which reshards after forward;
                # gather it again (FSDP reduce-scatters its gradient in the usual post-backward).
                self.model.unshard()
            return self.loss_fn(out, self.projection.weight, labels, self.projection.bias,
                                scaling=scaling, num_valid=num_tokens)
        if isinstance(out, list):
            return self.loss_fn(out, labels)
        return self.loss_fn(out.reshape(-1, out.size(-1)), labels.reshape(-1))

    def validation_loss(self, batch: Dict[str, torch.Tensor], num_tokens: int) -> torch.Tensor:
        """The mean loss for validation (call under no_grad; nothing is pre-scaled)."""
        return self(batch, scaling=1.0, num_tokens=num_tokens)
