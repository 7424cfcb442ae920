"""Random-token data for throughput benchmarks (no tokenizer files needed).

With ``repeat > 0`` each sequence is one random block of ``repeat`` tokens tiled to its length:
a stream a model can learn (the block's tokens, then copying it), so a long run's loss curve
falls and precision options (FP8 vs bf16) can be compared on it. Throughput does not depend
on the token values.

By default every sequence is ``seq_len`` tokens long. With ``median_len > 0`` the lengths
spread like an instruction-tuning set's: log-normal around ``median_len`` (``len_sigma`` its
log-space spread; 0.9 puts about a fifth of the sequences under half the median and ~4%
over 5x it), clipped to [``min_len``, ``seq_len``]. That is the data on which padding
wastes work and packing does not. ``packed=True`` returns the same sequences packed by
torchtune's ``PackedDataset`` into ``seq_len``-token packs (no sequence split across packs),
and the ``packed`` key is what torchtune's recipes read to collate packs."""

import math
from typing import Union

import torch
from torch.utils.data import Dataset


class SyntheticTokens(Dataset):
    """``num_samples`` sequences of uniform random token ids, ``seq_len`` long or of spread
    lengths (module docstring); every label counts."""

    def __init__(self, num_samples: int, seq_len: int, vocab_size: int, seed: int = 0,
                 repeat: int = 0, median_len: int = 0, len_sigma: float = 0.9,
                 min_len: int = 16) -> None:
        g = torch.Generator().manual_seed(seed)
        if median_len > 0:
            if not 0 < min_len <= median_len <= seq_len:
                raise ValueError(f"synthetic_dataset: need 0 < min_len <= median_len <= seq_len, got "
                                 f"min_len={min_len}, median_len={median_len}, seq_len={seq_len}")
            draws = torch.randn(num_samples, generator=g, dtype=torch.float64)
            lengths = (math.log(median_len) + len_sigma * draws).exp().round().clamp(min_len, seq_len)
            self._lengths = lengths.long().tolist()
        else:
            self._lengths = [seq_len] * num_samples
        if repeat > 0:
            blocks = torch.randint(0, vocab_size, (num_samples, repeat), generator=g)
            self._data = blocks.repeat(1, -(-seq_len // repeat))[:, :seq_len]
        else:
            self._data = torch.randint(0, vocab_size, (num_samples, seq_len), generator=g)

    def __len__(self) -> int:
        return self._data.shape[0]

    def __getitem__(self, i):
        tokens = self._data[i, : self._lengths[i]].tolist()
        return {"tokens": tokens, "labels": list(tokens)}


def synthetic_dataset(tokenizer=None, num_samples: int = 256, seq_len: int = 2048,
                      vocab_size: int = 128256, seed: int = 0, repeat: int = 0, median_len: int = 0,
                      len_sigma: float = 0.9, min_len: int = 16,
                      packed: bool = False) -> Union[SyntheticTokens, Dataset]:
    """Config component; ``tokenizer`` is accepted (recipes pass it) and unused."""
    ds = SyntheticTokens(num_samples, seq_len, vocab_size, seed, repeat, median_len, len_sigma, min_len)
    if not packed:
        return ds
    from torchtune.datasets import PackedDataset

    pad_id = getattr(tokenizer, "pad_id", 0) if tokenizer is not None else 0
    return PackedDataset(ds, max_seq_len=seq_len, padding_idx=pad_id, split_across_pack=False)
