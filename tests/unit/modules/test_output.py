"""tune_recipes.modules.output: a decoder that returns hidden states for the fused loss."""

import pytest
import torch

from tune_recipes.config import ConfigError
from tune_recipes.models.tiny import lora_tiny_llama3, tiny_llama3
from tune_recipes.modules.output import return_hidden_states

pytestmark = pytest.mark.unit


def test_hidden_states_times_the_projection_are_the_logits():
    torch.manual_seed(0)
    model = tiny_llama3()
    tokens = torch.randint(0, 272, (2, 5))
    with torch.no_grad():
        logits = model(tokens)
        proj = return_hidden_states(model)
        hidden = model(tokens)
        assert proj.bias is None and proj.weight is model.output.weight
        torch.testing.assert_close(torch.nn.functional.linear(hidden, proj.weight).float(), logits)


def test_a_lora_output_layer_is_named_in_the_error():
    model = lora_tiny_llama3(["q_proj"], apply_lora_to_output=True)
    with pytest.raises(ConfigError, match="apply_lora_to_output=False"):
        return_hidden_states(model)
