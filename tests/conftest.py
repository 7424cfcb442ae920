import os
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]

# NOTE: under pytest-xdist (pyproject's -n 2) each worker is a process of its own, and torch
# gives each as many intra-op threads as the machine has cores: on CI's 2 cores, 2 workers x 2
# threads oversubscribe them, and a bf16 CPU test ran 53 s there against 15 s alone. Each
# worker gets its share of the cores. (torchrun's ranks already run with OMP_NUM_THREADS=1.)
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // _WORKERS))


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session", autouse=True)
def _isolated_cache(tmp_path_factory):
    # Tests build the tiny checkpoint in their own cache, never in the user's home.
    if "TUNE_RECIPES_CACHE" not in os.environ:
        os.environ["TUNE_RECIPES_CACHE"] = str(tmp_path_factory.mktemp("tune_recipes_cache"))
    yield


@pytest.fixture
def one_rank():
    """A one-process gloo group in this test's process (FSDP2 and DTensor code paths that need
    an initialized process group), destroyed afterwards."""
    import socket

    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture
def saved_bytes():
    """``saved_bytes(fn)`` -> (``fn()``'s result, bytes of the tensors autograd saved for
    backward while it ran: numel x element size of each save, shared storage counted again)."""
    def measure(fn):
        total = 0

        def pack(t):
            nonlocal total
            total += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = fn()
        return out, total

    return measure


@pytest.fixture
def padding_free_batches():
    """``make(device)``: three padding-free batches of random tokens (rows of 50-300 tokens,
    two or three a batch, so the row length changes every batch), document spans as their
    mask, moved as the step driver moves them: for "compiles once over every length" tests."""
    from tune_recipes.data.collate import padding_free_collate
    from tune_recipes.training.step.batch import to_device

    def make(device):
        g = torch.Generator().manual_seed(0)
        batches = []
        for lengths in ([50, 70], [100, 120, 30], [300, 40]):
            rows = [{"tokens": torch.randint(1, 272, (n,), generator=g),
                     "labels": torch.randint(1, 272, (n,), generator=g)} for n in lengths]
            batches.append(to_device(padding_free_collate(rows, spans=True), torch.device(device)))
        return batches

    return make
