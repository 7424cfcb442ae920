"""tune_recipes.training.setup.runtime: where a recipe runs."""

import pytest
import torch

from tune_recipes.config import ConfigError
from tune_recipes.training.setup.runtime import Runtime, init_distributed, single_device

pytestmark = pytest.mark.unit


def test_single_device_is_rank_zero_of_one():
    rt = single_device("cpu")
    assert rt == Runtime(torch.device("cpu")) and rt.is_main and not rt.distributed
    rt.close()  # nothing to tear down
    assert not Runtime(torch.device("cpu"), distributed=True, world_size=2, rank=1).is_main


def test_distributed_outside_torchrun_says_how_to_launch(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(ConfigError, match="--nproc_per_node"):
        init_distributed("cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only message")
def test_cuda_without_cuda_is_a_config_error(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ConfigError, match="set device=cpu"):
        init_distributed("cuda")


def test_data_parallel_rank_and_size_are_the_process_ones_without_tensor_parallelism():
    rt = Runtime(torch.device("cpu"), distributed=True, world_size=4, rank=3)
    assert (rt.dp_size, rt.dp_rank, rt.dp_group, rt.tensor_parallel_dim) == (4, 3, None, 1)
    assert (single_device("cpu").dp_size, single_device("cpu").dp_rank) == (1, 0)


def test_tensor_parallel_dim_must_divide_the_world_before_any_rendezvous(monkeypatch):
    import torch.distributed as dist

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    started = []
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: started.append(a))
    with pytest.raises(ConfigError, match=r"tensor_parallel_dim=2: the world size \(3 processes\)"):
        init_distributed("cpu", tensor_parallel_dim=2)
    assert not started


def test_cuda_process_group_also_has_a_cpu_backend(monkeypatch):
    """CPU-offloaded FSDP reduces CPU tensors: the group must carry gloo beside NCCL."""
    import torch.distributed as dist

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    started = []
    monkeypatch.setattr(dist, "init_process_group", lambda **k: started.append((k["backend"], k["timeout"].total_seconds())))
    monkeypatch.setattr(dist, "get_world_size", lambda: 1)
    monkeypatch.setattr(dist, "get_rank", lambda: 0)
    rt = init_distributed("cuda")
    assert started == [("cuda:nccl,cpu:gloo", 600.0)] and rt.device == torch.device("cuda", 0)
