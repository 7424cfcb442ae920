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
