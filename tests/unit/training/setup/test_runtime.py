"""tune_recipes.training.setup.runtime: where a recipe runs."""

import pytest
import torch

from tune_recipes.config import ConfigError
from tune_recipes.training.setup.runtime import (
    CUDA_ALLOCATOR_SETTINGS, Runtime, init_distributed, prefer_expandable_segments, single_device)

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


def test_cuda_process_group_also_has_a_cpu_backend(monkeypatch, allocator_calls):
    """CPU-offloaded FSDP reduces CPU tensors: the group must carry gloo beside NCCL. Each rank
    asks for expandable segments as a single-device run does."""
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
    assert allocator_calls == ["expandable_segments:True"]


@pytest.fixture
def allocator_calls(monkeypatch):
    """The settings strings handed to the allocator, with the real setter replaced."""
    calls = []
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.delenv(name, raising=False)
    if hasattr(torch._C, "_accelerator_setAllocatorSettings"):
        monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", calls.append)
    else:
        monkeypatch.setattr(torch._C, "_cuda_cudaCachingAllocator_set_allocator_settings", calls.append)
    return calls


def test_cuda_asks_for_expandable_segments(allocator_calls):
    assert prefer_expandable_segments(torch.device("cuda", 0))
    assert allocator_calls == ["expandable_segments:True"] == [CUDA_ALLOCATOR_SETTINGS]


def test_a_single_cuda_device_asks_for_expandable_segments(allocator_calls, monkeypatch):
    from tune_recipes.training.setup import runtime

    monkeypatch.setattr(runtime.utils, "get_device", lambda name: torch.device("cuda", 0))
    assert single_device("cuda") == Runtime(torch.device("cuda", 0))
    assert allocator_calls == ["expandable_segments:True"]


def test_cpu_leaves_the_allocator_alone(allocator_calls):
    assert not prefer_expandable_segments(torch.device("cpu"))
    single_device("cpu")
    assert allocator_calls == []


@pytest.mark.parametrize("name", ["PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"])
def test_the_users_allocator_settings_win(allocator_calls, monkeypatch, name):
    monkeypatch.setenv(name, "max_split_size_mb:128")
    assert not prefer_expandable_segments(torch.device("cuda", 0))
    assert allocator_calls == []


GROWING_ALLOCATIONS = """
import torch
from tune_recipes.training.setup.runtime import single_device
single_device("cuda")
mib = 2 ** 20
sizes = [64 * mib * k for k in range(1, 11)]  # each request larger than any block freed before it
for size in sizes:
    x = torch.empty(size, dtype=torch.uint8, device="cuda")
    del x
print(torch.cuda.memory_reserved() / max(sizes))
"""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_growing_requests_reuse_one_segment_on_cuda(monkeypatch):
    """The default allocator keeps every freed block (reserving the sum of the sizes, 5.5x the
    largest here); expandable segments grow one range, reserving about the largest."""
    import subprocess
    import sys

    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.delenv(name, raising=False)
    out = subprocess.run([sys.executable, "-c", GROWING_ALLOCATIONS], capture_output=True,
                         text=True, check=True)
    assert float(out.stdout.split()[-1]) <= 1.25, out.stdout + out.stderr
