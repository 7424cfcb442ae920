"""tune_recipes.training.setup.distributed: FSDP2 sharding and loading (one gloo rank here; the
2-rank runs are in tests/recipes)."""


import pytest
import torch
from omegaconf import OmegaConf

from tune_recipes.config import ConfigError
from tune_recipes.modules.loss import FusedLinearCrossEntropyLoss
from tune_recipes.training.setup.distributed import (
    check_fused_loss_sharding,
    fsdp_options,
    shard_and_load,
)

pytestmark = pytest.mark.unit


def test_fsdp_options_read_the_sharding_keys():
    cfg = OmegaConf.create({"custom_sharded_layers": ["tok_embeddings"],
                            "fsdp_reshard_after_forward": False})
    assert fsdp_options(cfg) == dict(enable_activation_checkpointing=False,
                                     reshard_after_forward=False,
                                     custom_sharded_layers=["tok_embeddings"],
                                     cpu_offload=False)
    assert fsdp_options(OmegaConf.create({}))["custom_sharded_layers"] is None


def test_fused_loss_needs_the_output_in_the_root_unit():
    check_fused_loss_sharding(torch.nn.CrossEntropyLoss(), ["output"])
    check_fused_loss_sharding(FusedLinearCrossEntropyLoss(), None)
    with pytest.raises(ConfigError, match="root FSDP unit"):
        check_fused_loss_sharding(FusedLinearCrossEntropyLoss(), ["output"])


def test_shard_and_load_gives_the_checkpoint_back(one_rank):
    from tune_recipes.models.tiny import tiny_llama3
    from torchtune import training

    torch.manual_seed(0)
    full = tiny_llama3().state_dict()
    model, keys = shard_and_load(OmegaConf.create({"_component_": "tune_recipes.models.tiny_llama3"}),
                                 dtype=torch.float32, device=torch.device("cpu"), world_size=1,
                                 full_state_dict=full)
    assert keys is None
    gathered = training.gather_cpu_state_dict(model, True, device=None)
    for k, v in full.items():
        assert torch.equal(gathered[k], v), k


def test_fsdp_cpu_offload_from_either_key():
    from omegaconf import OmegaConf

    from tune_recipes.training.setup.distributed import fsdp_cpu_offload_requested, fsdp_options

    assert fsdp_options(OmegaConf.create({}))["cpu_offload"] is False
    assert fsdp_cpu_offload_requested(OmegaConf.create({"fsdp_cpu_offload": True}))
    # the section some of torchtune's distributed LoRA configs carry
    assert fsdp_cpu_offload_requested(OmegaConf.create({"fsdp": {"cpu_offload": True}}))
    assert not fsdp_cpu_offload_requested(OmegaConf.create({"fsdp": {"cpu_offload": False}}))
    assert fsdp_cpu_offload_requested(
        OmegaConf.create({"fsdp_cpu_offload": True, "fsdp": {"cpu_offload": True}}))
    with pytest.raises(ConfigError, match="contradicts"):
        fsdp_cpu_offload_requested(
            OmegaConf.create({"fsdp_cpu_offload": False, "fsdp": {"cpu_offload": True}}))
    with pytest.raises(ConfigError, match="only cpu_offload"):
        fsdp_cpu_offload_requested(OmegaConf.create({"fsdp": {"cpu_ofload": True}}))
