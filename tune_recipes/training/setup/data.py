"""Dataset and dataloader, the same for every recipe."""

from functools import partial

from omegaconf import ListConfig
from torch.utils.data import DataLoader, Dataset
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler
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


def make_collate(dataset: Dataset, *, pad_id: int, collate_fn: str, ignore_index: int):
    """The batch collation for ``dataset``: packed sequences, or padding by ``collate_fn``."""
    # NOTE: torchtune's PackedDataset has no ``packed`` attribute (only its ConcatDataset sets
    # one): test the type too, or a single packed dataset is padded like an unpacked one and
    # its examples attend to each other across pack boundaries, silently.
    from torchtune.datasets import PackedDataset

    if isinstance(dataset, PackedDataset) or getattr(dataset, "packed", False):
        return padded_collate_packed
    if "left_pad_sequence" in collate_fn:
        raise ConfigError("collate_fn: left_pad_sequence is for inference, not training")
    fn = resolve_component(collate_fn, "collate_fn")
    return partial(fn, padding_idx=pad_id, ignore_idx=ignore_index)


def build_validation_dataloader(cfg, tokenizer, *, ignore_index: int, world_size: int = 1,
                                rank: int = 0):
    """``dataset_val`` in a fixed order, each example on exactly one rank, nothing dropped;
    None when the config has no ``dataset_val``."""
    if cfg.get("dataset_val") is None:
        return None
    from tune_recipes.training.step.validation import shard_for_rank

    dataset = build_dataset(cfg.dataset_val, tokenizer)
    collate = make_collate(dataset, pad_id=tokenizer.pad_id, ignore_index=ignore_index,
                           collate_fn=cfg.get("collate_fn", "torchtune.data.padded_collate_sft"))
    return DataLoader(shard_for_rank(dataset, world_size, rank),
                      batch_size=cfg.get("batch_size_val", None) or cfg.batch_size,
                      shuffle=False, collate_fn=collate, drop_last=False)


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
) -> StatefulDataLoader:
    """A dataloader whose order depends only on (seed, epoch, rank), so a resumed run sees
    exactly the batches an uninterrupted one would.

    torchdata's ``StatefulDataLoader`` with its ``StatefulDistributedSampler`` (the same order
    as torch's ``DistributedSampler``): ``state_dict()`` mid-epoch records how many samples
    this rank has drawn, and after ``sampler.set_epoch(epoch)`` and ``load_state_dict`` the
    next iterator continues after them (mid-epoch checkpoints, ``save_every_n_steps``).
    Plain ints and dicts, so the recipe state still loads with ``weights_only=True``.
    """
    collate = make_collate(dataset, pad_id=pad_id, collate_fn=collate_fn, ignore_index=ignore_index)
    sampler = StatefulDistributedSampler(
        dataset, num_replicas=world_size, rank=rank, shuffle=shuffle, seed=seed
    )
    return StatefulDataLoader(
        dataset=dataset, batch_size=batch_size, sampler=sampler, collate_fn=collate,
        drop_last=drop_last,
    )
