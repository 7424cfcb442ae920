"""Where a recipe runs: one device, or one rank of a process group (NCCL on GPUs, gloo on CPUs,
so CI can test 2 processes); nothing here calls a CUDA-only API unless the device is CUDA."""

import datetime
import os
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torchtune import utils

from tune_recipes.config import ConfigError


@dataclass(frozen=True)
class Runtime:
    """``world_size``/``rank`` count processes; ``dp_size``/``dp_rank`` count data-parallel
    replicas, which differ under tensor parallelism: the ``tensor_parallel_dim`` ranks of one
    tensor-parallel group hold slices of one model and must see the same batch. Data loading,
    token counts and the data-parallel gradient average go by ``dp_*`` (and all-reduce over
    ``dp_group``); process-level things (who writes, barriers) by ``rank``."""

    device: torch.device
    distributed: bool = False
    world_size: int = 1
    rank: int = 0
    tensor_parallel_dim: int = 1
    dp_size: int = 1
    dp_rank: int = 0
    #: the 2-D ("dp", "tp") device mesh when tensor_parallel_dim > 1, else None
    mesh: Optional[object] = None

    def __post_init__(self) -> None:
        if self.mesh is None and self.tensor_parallel_dim == 1 and self.distributed:
            # Pure data parallelism: every process is its own replica.
            object.__setattr__(self, "dp_size", self.world_size)
            object.__setattr__(self, "dp_rank", self.rank)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def dp_group(self):
        """The process group of this rank's data-parallel peers (None: all processes)."""
        return None if self.mesh is None else self.mesh["dp"].get_group()

    def close(self) -> None:
        if self.distributed and dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()


#: what the recipes ask of PyTorch's CUDA caching allocator unless the user's environment says
#: otherwise (PYTORCH_CUDA_ALLOC_CONF or PYTORCH_ALLOC_CONF)
CUDA_ALLOCATOR_SETTINGS = "expandable_segments:True"


def prefer_expandable_segments(device: torch.device) -> bool:
    """Grow CUDA memory in expandable segments, unless the user's environment configures the
    allocator. Returns whether the setting was applied.

    Batches of instruction rows change length every step (padded to a multiple, or laid end to
    end). The default allocator caches freed blocks inside fixed segments: a request larger than
    any cached block takes a new segment, and segments never merge, so memory reserved grows
    well past the peak ever allocated (a Qwen2.5-1.5B LoRA at batch 4 x 4 on an H200: 38.4 GiB
    reserved on 15.0 allocated). An expandable segment maps more pages onto the end of one
    address range instead, so reserved memory stays within a few percent of the peak allocated
    (docs/benchmarks.md)."""
    if device.type != "cuda" or any(
            name in os.environ for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")):
        return False
    # NOTE: set through the runtime call, not the environment variable: the allocator reads the
    # variable once, when CUDA starts, and a config's components may already have started it.
    # Segments mapped before this call stay as they are; the recipes call it before loading
    # anything onto the GPU.
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)  # torch >= 2.9
    if setter is None:
        setter = torch._C._cuda_cudaCachingAllocator_set_allocator_settings
    setter(CUDA_ALLOCATOR_SETTINGS)
    return True


def single_device(device_name: str) -> Runtime:
    device = utils.get_device(device_name)
    prefer_expandable_segments(device)
    return Runtime(device)


def init_distributed(device_name: str, tensor_parallel_dim: int = 1) -> Runtime:
    """Start the process group for ``device_name`` ("cuda" or "cpu"): NCCL for CUDA, gloo for
    CPU. Must run under torchrun (``tune run --nproc_per_node N``).

    ``tensor_parallel_dim > 1``: a 2-D device mesh (dp = world_size / tensor_parallel_dim, tp),
    row-major, so each tensor-parallel group is ``tensor_parallel_dim`` consecutive ranks (on one
    node with ``tune run``). DTensor tensor parallelism runs on gloo too (CI tests it on CPU).
    """
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
        # NCCL for CUDA tensors, gloo for CPU ones: with fsdp_cpu_offload the gradients (and
        # so the clipping norm's reduction) live on the CPU, which NCCL alone refuses ("No
        # backend type associated with device type cpu", seen on 2 H200s).
        backend = "cuda:nccl,cpu:gloo"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    prefer_expandable_segments(device)
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    tp = int(tensor_parallel_dim)
    if tp < 1 or world_size % tp != 0:
        # Before the process group starts: a config error, not a hung rendezvous.
        raise ConfigError(f"tensor_parallel_dim={tp}: the world size ({world_size} processes) "
                          "must be a multiple of it")
    if not dist.is_initialized():
        # An explicit timeout: with a composite backend string torch's default is 30 min, not
        # NCCL's 10, so a hung collective would take three times as long to be reported.
        dist.init_process_group(backend=backend, timeout=datetime.timedelta(minutes=10))
    world_size, rank = dist.get_world_size(), dist.get_rank()
    if tp == 1:
        return Runtime(device, distributed=True, world_size=world_size, rank=rank)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (world_size // tp, tp), mesh_dim_names=("dp", "tp"))
    return Runtime(device, distributed=True, world_size=world_size, rank=rank,
                   tensor_parallel_dim=tp, dp_size=mesh["dp"].size(),
                   dp_rank=mesh["dp"].get_local_rank(), mesh=mesh)
