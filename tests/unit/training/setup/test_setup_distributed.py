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
    assert fsdp_options(cfg) == dict(ac_interval=None,
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


def test_tensor_parallel_options_instantiate_the_plan_only_with_a_mesh():
    from types import SimpleNamespace

    from tune_recipes.training.setup.distributed import tensor_parallel_options

    plan_cfg = {"tensor_parallel_plan": {"_component_": "torchtune.models.llama3.base_llama_tp_plan"}}
    plain = SimpleNamespace(mesh=None, tensor_parallel_dim=1)
    assert tensor_parallel_options(OmegaConf.create(plan_cfg), plain) == {}
    tp = SimpleNamespace(mesh="the 2-D mesh", tensor_parallel_dim=2)
    opts = tensor_parallel_options(OmegaConf.create(plan_cfg), tp)
    assert opts["device_mesh"] == "the 2-D mesh"
    assert "layers.*.attn.q_proj" in opts["tensor_parallel_plan"]
    with pytest.raises(ConfigError, match="tensor_parallel_dim=2 needs tensor_parallel_plan"):
        tensor_parallel_options(OmegaConf.create({}), tp)
    with pytest.raises(ConfigError, match="not a non-empty dict"):
        tensor_parallel_options(OmegaConf.create(
            {"tensor_parallel_plan": {"_component_": "builtins.list"}}), tp)


def test_tensor_parallel_model_check_names_the_heads():
    from tune_recipes.models.tiny import tiny_llama3, tiny_llama3_2
    from tune_recipes.training.setup.distributed import check_tensor_parallel_model

    with torch.device("meta"):
        model, tied = tiny_llama3(), tiny_llama3_2()
    check_tensor_parallel_model(model, 2)  # 8 heads, 2 kv heads
    with pytest.raises(ConfigError, match=r"num_kv_heads=2 \(layers.0.attn\)"):
        check_tensor_parallel_model(model, 4)
    with pytest.raises(ConfigError, match="ties its output projection"):
        check_tensor_parallel_model(tied, 2)


def test_shard_and_load_with_a_tensor_parallel_mesh(one_rank):
    """On a 1 x 1 (dp, tp) mesh: the plan's layers become DTensors, the checkpoint comes back
    whole; a plan that names no layer is an error (it would leave silent full replicas)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import ColwiseParallel
    from torchtune import training
    from torchtune.models.llama3 import base_llama_tp_plan

    from tune_recipes.models.tiny import tiny_llama3

    torch.manual_seed(0)
    full = tiny_llama3().state_dict()
    cfg = OmegaConf.create({"_component_": "tune_recipes.models.tiny_llama3"})
    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
    model, _ = shard_and_load(cfg, dtype=torch.float32, device=torch.device("cpu"), world_size=1,
                              full_state_dict=full, device_mesh=mesh,
                              tensor_parallel_plan=base_llama_tp_plan())
    assert isinstance(model.layers[0].attn.q_proj.weight, DTensor)
    assert not isinstance(model.norm.scale, DTensor)  # not in the plan; dp of 1: no FSDP
    gathered = training.gather_cpu_state_dict(model, True, device=None)
    for k, v in full.items():
        assert torch.equal(gathered[k], v), k
    with pytest.warns(UserWarning, match="could not be resolved"), \
            pytest.raises(ConfigError, match=r"tensor_parallel_plan: none of its module names \(decoder"):
        shard_and_load(cfg, dtype=torch.float32, device=torch.device("cpu"), world_size=1,
                       full_state_dict=full, device_mesh=mesh,
                       tensor_parallel_plan={"decoder.*.wq": ColwiseParallel()})
