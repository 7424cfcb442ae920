"""Where a recipe runs: one device, or one rank of a process group (NCCL on GPUs, gloo on CPUs,
so CI can test 2 processes); nothing here calls a CUDA-only API unless the device is CUDA."""

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torchtune import utils

from tune_recipes.config import ConfigError


@dataclass(frozen=True)
class Runtime:
    device: torch.device
    distributed: bool = False
    world_size: int = 1
    rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def close(self) -> None:
        if self.distributed and dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()


def single_device(device_name: str) -> Runtime:
    return Runtime(utils.get_device(device_name))


def init_distributed(device_name: str) -> Runtime:
    """Start the process group for ``device_name`` ("cuda" or "cpu"): NCCL for CUDA, gloo for
    CPU. Must run under torchrun (``tune run --nproc_per_node N``)."""
    if "RANK" not in os.environ:
        raise ConfigError(
            "distributed recipes run under torchrun: use `tune run --nproc_per_node N <recipe> "
            "--config ...` (N=1 is fine)"
        )
    want_cuda = device_name.startswith("cuda")
    if want_cuda and not torch.cuda.is_available():
        raise ConfigError("device=cuda but CUDA is not available; set device=cpu")
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if want_cuda:
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend=backend)
    return Runtime(device, distributed=True, world_size=dist.get_world_size(),
                   rank=dist.get_rank())
