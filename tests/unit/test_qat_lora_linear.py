"""FakeQuantizedLoRALinear: the LoRA linear of QAT + LoRA, with and without a bias."""

import pytest
import torch
from torchtune.modules.peft import LoRALinear
from torchtune.training.quantization import Int8DynActInt4WeightQATQuantizer

from tune_recipes.modules.qat_lora import FakeQuantizedLoRALinear, qat_configs

pytestmark = pytest.mark.unit


def _lora(use_bias):
    torch.manual_seed(0)
    lora = LoRALinear(256, 64, rank=4, alpha=8, use_bias=use_bias)
    torch.nn.init.normal_(lora.lora_b.weight)  # nonzero adapter: the LoRA path counts too
    if use_bias:
        torch.nn.init.normal_(lora.bias)
    return lora


@pytest.mark.parametrize("use_bias", [False, True])
def test_without_fake_quantization_it_is_the_lora_linear(use_bias):
    lora = _lora(use_bias)
    fq = FakeQuantizedLoRALinear.from_lora_linear(lora, None, None)
    x = torch.randn(3, 5, 256)
    torch.testing.assert_close(fq(x), lora(x), rtol=0, atol=0)
    # Same parameters (shared, not copied): the optimizer trains what the checkpoint saves.
    assert fq.weight is lora.weight and fq.lora_a is lora.lora_a
    assert (fq.bias is lora.bias) if use_bias else not fq.use_bias


def test_bias_is_added_unquantized_to_the_fake_quantized_product():
    with_bias = _lora(True)
    act, wt = qat_configs(Int8DynActInt4WeightQATQuantizer(groupsize=64))
    fq = FakeQuantizedLoRALinear.from_lora_linear(with_bias, act, wt)
    no_bias = _lora(False)
    no_bias.weight = with_bias.weight
    no_bias.lora_a, no_bias.lora_b = with_bias.lora_a, with_bias.lora_b
    fq0 = FakeQuantizedLoRALinear.from_lora_linear(no_bias, act, wt)
    x = torch.randn(2, 7, 256)
    torch.testing.assert_close(fq(x) - fq0(x), with_bias.bias.expand(2, 7, 64), rtol=1e-5, atol=1e-5)
    # Fake quantization is on: the output differs from the plain LoRA linear.
    assert not torch.allclose(fq(x), with_bias(x), atol=1e-4)
