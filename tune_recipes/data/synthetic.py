"""Fixed-length random-token data for throughput benchmarks (no tokenizer files needed).

With ``repeat > 0`` each sequence is one random block of ``repeat`` tokens tiled to ``seq_len``:
a stream a model can learn (the block's tokens, then copying it), so a long run's loss curve
falls and precision options (FP8 vs bf16) can be compared on it. Throughput does not depend
on the token values."""

import torch
from torch.utils.data import Dataset


class SyntheticTokens(Dataset):
    """``num_samples`` sequences of ``seq_len`` uniform random token ids; every label counts."""

    def __init__(self, num_samples: int, seq_len: int, vocab_size: int, seed: int = 0,
                 repeat: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        if repeat > 0:
            blocks = torch.randint(0, vocab_size, (num_samples, repeat), generator=g)
            self._data = blocks.repeat(1, -(-seq_len // repeat))[:, :seq_len]
        else:
            self._data = torch.randint(0, vocab_size, (num_samples, seq_len), generator=g)

    def __len__(self) -> int:
        return self._data.shape[0]

    def __getitem__(self, i):
        tokens = self._data[i].tolist()
        return {"tokens": tokens, "labels": list(tokens)}


def synthetic_dataset(tokenizer=None, num_samples: int = 256, seq_len: int = 2048,
                      vocab_size: int = 128256, seed: int = 0, repeat: int = 0) -> SyntheticTokens:
    """Config component; ``tokenizer`` is accepted (recipes pass it) and unused."""
    return SyntheticTokens(num_samples, seq_len, vocab_size, seed, repeat)
