import os
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


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
