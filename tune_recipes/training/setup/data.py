"""Dataset and dataloader, the same for every recipe."""

from functools import partial

from omegaconf import ListConfig
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from torchtune import config as tt_config
from torchtune.data import padded_collate_packed
from torchtune.datasets import ConcatDataset

from tune_recipes.config import ConfigError, resolve_component
from tune_recipes.constants import CROSS_ENTROPY_IGNORE_INDEX


def build_dataset(cfg_dataset, tokenizer) -> Dataset:
    """One dataset, or a list of them concatenated."""
    if isinstance(cfg_dataset, ListConfig):
        parts = [tt_config.instantiate(c, tokenizer) for c in cfg_dataset]
        return ConcatDataset(datasets=parts)
    return tt_config.instantiate(cfg_dataset, tokenizer)


def build_dataloader(
    dataset: Dataset,
    *,
    batch_size: int,
    shuffle: bool,
    seed: int,
    pad_id: int,
    collate_fn: str = "torchtune.data.padded_collate_sft",
    ignore_index: int = CROSS_ENTROPY_IGNORE_INDEX,
    world_size: int = 1,
    rank: int = 0,
    drop_last: bool = True,
) -> DataLoader:
    """A dataloader whose order depends only on (seed, epoch, rank), so a resumed run sees
    exactly the batches an uninterrupted one would. Checkpoints are written at epoch
    boundaries, so no dataloader state needs saving (a mid-epoch resume would need it)."""
    packed = getattr(dataset, "packed", False)
    if packed:
        collate = padded_collate_packed
    else:
        if "left_pad_sequence" in collate_fn:
            raise ConfigError("collate_fn: left_pad_sequence is for inference, not training")
        fn = resolve_component(collate_fn, "collate_fn")
        collate = partial(fn, padding_idx=pad_id, ignore_idx=ignore_index)
    sampler = DistributedSampler(
        dataset, num_replicas=world_size, rank=rank, shuffle=shuffle, seed=seed
    )
    return DataLoader(
        dataset=dataset, batch_size=batch_size, sampler=sampler, collate_fn=collate,
        drop_last=drop_last,
    )
