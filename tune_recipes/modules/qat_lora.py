"""QAT + LoRA linears that work with torchao 0.15.

torchtune 0.6.1's ``swap_lora_linear_with_qat`` builds ``QATLoRALinear``, which asserts that its
configs are instances of torchao's old ``FakeQuantizeConfig``; torchao 0.15's quantizers return
``IntxFakeQuantizeConfig`` objects, so that assert fails. This module provides the same layer on
torchao's current API (``FakeQuantizerBase.from_config``), without touching site-packages.
"""


import torch
import torch.nn.functional as F
from torch import nn
from torchtune.modules.peft import LoRALinear

from tune_recipes.config import ConfigError


def _fake_quantizer(config) -> nn.Module:
    if config is None:
        return nn.Identity()
    from torchao.quantization.qat.fake_quantizer import FakeQuantizerBase

    return FakeQuantizerBase.from_config(config)


class FakeQuantizedLoRALinear(LoRALinear):
    """y = fake_quant(W_frozen) @ fake_quant(x) + b + (alpha / r) * B A x

    The bias (Qwen2's q/k/v projections have one) is added unquantized, as torchao's own
    fake-quantized linear does.

    A ``LoRALinear`` (same parameter names, same adapter protocol, so PEFT export, merging and
    ``get_adapter_params`` work unchanged) whose frozen base path sees the quantization it will
    get after ``convert``.
    """

    @classmethod
    def from_lora_linear(cls, lora: LoRALinear, activation_config, weight_config
                         ) -> "FakeQuantizedLoRALinear":
        if getattr(lora, "_quantize_base", False):
            raise ConfigError("QAT + LoRA cannot also quantize the base to NF4 (quantize_base)")
        group = getattr(weight_config, "group_size", None)
        if group is not None and lora.in_dim % group != 0:
            raise ConfigError(
                f"quantizer.groupsize={group} does not divide a LoRA linear's in_dim={lora.in_dim}"
            )
        dropout = lora.dropout.p if isinstance(lora.dropout, nn.Dropout) else 0.0
        # Build on the parameters' device (meta under FSDP: nothing allocated), then share them.
        with torch.device(lora.weight.device):
            new = cls(lora.in_dim, lora.out_dim, lora.rank, lora.alpha, dropout=dropout,
                      use_bias=lora.use_bias)
        new.weight = lora.weight
        if lora.use_bias:
            new.bias = lora.bias
        new.lora_a = lora.lora_a
        new.lora_b = lora.lora_b
        new.disabled = lora.disabled
        new.activation_fake_quantizer = _fake_quantizer(activation_config)
        new.weight_fake_quantizer = _fake_quantizer(weight_config)
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = F.linear(self.activation_fake_quantizer(x), self.weight_fake_quantizer(self.weight),
                        self.bias if self.use_bias else None)
        if self.disabled:
            return base
        return base + (self.alpha / self.rank) * self.lora_b(self.lora_a(self.dropout(x)))


def swap_lora_linears_for_qat(module: nn.Module, activation_config, weight_config) -> int:
    """Replace every ``LoRALinear`` under ``module`` in place; returns how many were swapped."""
    swapped = 0
    for name, child in module.named_children():
        if isinstance(child, LoRALinear) and not isinstance(child, FakeQuantizedLoRALinear):
            setattr(module, name,
                    FakeQuantizedLoRALinear.from_lora_linear(child, activation_config, weight_config))
            swapped += 1
        else:
            swapped += swap_lora_linears_for_qat(child, activation_config, weight_config)
    return swapped


def qat_configs(quantizer):
    """(activation, weight) fake-quantize configs of a torchao QAT quantizer."""
    try:
        return quantizer.get_activation_fake_quantize_config(), quantizer.get_weight_fake_quantize_config()
    except AttributeError:
        raise ConfigError(
            f"quantizer {type(quantizer).__name__} exposes no fake-quantize configs; QAT + LoRA "
            "needs Int8DynActInt4WeightQATQuantizer or Int4WeightOnlyQATQuantizer"
        ) from None
