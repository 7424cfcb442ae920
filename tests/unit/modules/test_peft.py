"""tune_recipes.modules.peft: adapter init and state-dict keys are independent of activation
checkpointing and compile."""

import pytest
import torch
from torchtune import training
from torchtune.modules import TransformerSelfAttentionLayer

from tune_recipes.models.tiny import lora_tiny_llama3
from tune_recipes.modules.peft import adapter_init_state_dict, state_dict_key

pytestmark = pytest.mark.unit


def _lora():
    torch.manual_seed(0)
    return lora_tiny_llama3(["q_proj", "v_proj"], apply_lora_to_mlp=True, lora_rank=4)


def test_state_dict_key_strips_wrapper_prefixes():
    assert state_dict_key("layers.0._checkpoint_wrapped_module.attn.q_proj.lora_a") == \
        "layers.0.attn.q_proj.lora_a"
    assert state_dict_key("_orig_mod.layers.1.mlp.w1") == "layers.1.mlp.w1"
    assert state_dict_key("output.weight") == "output.weight"


def test_adapter_init_loads_into_an_activation_checkpointed_model():
    plain, wrapped = _lora(), _lora()
    training.set_activation_checkpointing(wrapped, auto_wrap_policy={TransformerSelfAttentionLayer})
    init_plain = adapter_init_state_dict(plain, seed=3)
    init_wrapped = adapter_init_state_dict(wrapped, seed=3)
    # Same keys and the same tensors, whatever wrapped the layers.
    assert init_plain.keys() == init_wrapped.keys()
    for k in init_plain:
        assert torch.equal(init_plain[k], init_wrapped[k]), k
    missing, unexpected = wrapped.load_state_dict(init_wrapped, strict=False)
    assert unexpected == []  # the bug: keys with the wrapper prefix were all "unexpected"
    assert all("lora" not in k for k in missing)
    sd = wrapped.state_dict()
    for k, v in init_wrapped.items():
        assert torch.equal(sd[k], v), k
