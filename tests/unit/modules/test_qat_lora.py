"""tune_recipes.modules.qat_lora: LoRA linears whose frozen base is fake-quantized."""

import pytest
import torch

from tune_recipes.config import ConfigError
from tune_recipes.models.tiny import lora_tiny_llama3
from tune_recipes.modules.qat_lora import FakeQuantizedLoRALinear, qat_configs, swap_lora_linears_for_qat

pytestmark = pytest.mark.unit


def test_swap_replaces_every_lora_linear_once_and_keeps_parameter_names():
    from torchtune.training.quantization import Int8DynActInt4WeightQATQuantizer

    torch.manual_seed(0)
    model = lora_tiny_llama3(["q_proj", "v_proj"], lora_rank=4)
    names = [n for n, _ in model.named_parameters()]
    swapped = swap_lora_linears_for_qat(model, *qat_configs(Int8DynActInt4WeightQATQuantizer(groupsize=32)))
    assert swapped == 4  # 2 layers x (q_proj, v_proj)
    assert swap_lora_linears_for_qat(model, *qat_configs(Int8DynActInt4WeightQATQuantizer(groupsize=32))) == 0
    assert [n for n, _ in model.named_parameters()] == names
    assert isinstance(model.layers[0].attn.q_proj, FakeQuantizedLoRALinear)
    out = model(torch.randint(0, 272, (1, 4)))
    assert torch.isfinite(out).all()


def test_a_quantizer_without_fake_quant_configs_is_a_config_error():
    with pytest.raises(ConfigError, match="QAT \\+ LoRA"):
        qat_configs(object())
