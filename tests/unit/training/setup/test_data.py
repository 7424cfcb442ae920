"""tune_recipes.training.setup.data: dataset and dataloader."""

from pathlib import Path

import pytest
from omegaconf import OmegaConf
from torchtune import config as tt_config

from tune_recipes.config import ConfigError, load_config
from tune_recipes.training.setup.data import build_dataloader, build_dataset

pytestmark = pytest.mark.unit
CONFIG = Path(__file__).resolve().parents[4] / "configs" / "tiny" / "full_single_device.yaml"


def _loader(seed=0, rank=0, world_size=1, **kw):
    cfg = load_config(CONFIG)
    tok = tt_config.instantiate(cfg.tokenizer)
    ds = build_dataset(cfg.dataset, tok)
    return build_dataloader(ds, batch_size=4, shuffle=True, seed=seed, pad_id=tok.pad_id,
                            world_size=world_size, rank=rank, **kw)


def _first_tokens(loader, epoch):
    loader.sampler.set_epoch(epoch)
    return next(iter(loader))["tokens"].tolist()


def test_order_depends_only_on_seed_epoch_and_rank():
    a, b = _loader(seed=0), _loader(seed=0)
    assert _first_tokens(a, 0) == _first_tokens(b, 0)
    assert _first_tokens(a, 1) == _first_tokens(b, 1)
    assert _first_tokens(a, 0) != _first_tokens(a, 1)
    assert _first_tokens(_loader(seed=1), 0) != _first_tokens(a, 0)
    r0, r1 = _loader(rank=0, world_size=2), _loader(rank=1, world_size=2)
    assert _first_tokens(r0, 0) != _first_tokens(r1, 0)


def test_a_list_of_datasets_is_concatenated():
    cfg = load_config(CONFIG)
    tok = tt_config.instantiate(cfg.tokenizer)
    one = build_dataset(cfg.dataset, tok)
    two = build_dataset(OmegaConf.create([cfg.dataset, cfg.dataset]), tok)
    assert len(two) == 2 * len(one)


def test_inference_collate_is_rejected():
    with pytest.raises(ConfigError, match="left_pad_sequence is for inference"):
        _loader(collate_fn="torchtune.data.left_pad_sequence")
