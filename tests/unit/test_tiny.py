"""tune_recipes.models / tune_recipes.data: the tiny offline model, tokenizer and data."""

import pytest
import torch

from tune_recipes.data import TINY_VOCAB_SIZE, tiny_alpaca_dataset, tiny_tokenizer
from tune_recipes.data.synthetic import synthetic_dataset
from tune_recipes.models import build_tiny_llama3_checkpoint, lora_tiny_llama3, tiny_llama3

pytestmark = pytest.mark.unit


def test_tiny_model_speaks_the_tiny_vocabulary():
    torch.manual_seed(0)
    out = tiny_llama3()(torch.randint(0, TINY_VOCAB_SIZE, (1, 4)))
    assert out.shape == (1, 4, TINY_VOCAB_SIZE)
    assert any("lora_a" in n for n, _ in lora_tiny_llama3(["q_proj"]).named_parameters())


def test_checkpoint_builder_is_deterministic_and_cached():
    first = build_tiny_llama3_checkpoint()
    assert build_tiny_llama3_checkpoint() == first
    assert build_tiny_llama3_checkpoint(variant="teacher") != first


def test_tiny_data_is_ragged_and_tokenized():
    ds = tiny_alpaca_dataset(tiny_tokenizer())
    counts = {sum(l != -100 for l in ds[i]["labels"]) for i in range(16)}
    assert len(counts) > 1  # what makes the token-weighting tests mean something


def test_synthetic_data_is_seeded_and_fully_labelled():
    a, b = synthetic_dataset(num_samples=3, seq_len=5, vocab_size=11), synthetic_dataset(
        num_samples=3, seq_len=5, vocab_size=11)
    assert a[2] == b[2] and a[2]["tokens"] == a[2]["labels"] and len(a) == 3


def test_synthetic_repeat_tiles_one_block_per_sequence():
    ds = synthetic_dataset(num_samples=4, seq_len=10, vocab_size=50, repeat=4)
    for i in range(4):
        t = ds[i]["tokens"]
        assert len(t) == 10 and t[4:8] == t[:4] and t[8:] == t[:2] and t == ds[i]["labels"]
    assert ds[0]["tokens"][:4] != ds[1]["tokens"][:4]


def test_synthetic_spread_lengths_follow_the_log_normal_and_pack():
    """median_len spreads the lengths log-normally (median near median_len, clipped to
    [min_len, seq_len], a fifth under half the median at len_sigma 0.9); packed=True packs the
    same sequences into seq_len-token packs (torchtune's PackedDataset) without losing or
    splitting any."""
    import statistics

    from torchtune.datasets import PackedDataset

    ds = synthetic_dataset(num_samples=2000, seq_len=512, vocab_size=97, median_len=100, min_len=8)
    lengths = [len(ds[i]["tokens"]) for i in range(len(ds))]
    assert 90 <= statistics.median(lengths) <= 110
    assert min(lengths) >= 8 and max(lengths) == 512  # the tail reaches the clip
    assert 0.17 <= sum(n < 50 for n in lengths) / len(lengths) <= 0.27
    assert all(ds[i]["tokens"] == ds[i]["labels"] for i in range(5))
    packed = synthetic_dataset(num_samples=2000, seq_len=512, vocab_size=97, median_len=100,
                               min_len=8, packed=True)
    assert isinstance(packed, PackedDataset)
    # In order, every sequence lands whole in a pack; a pack's padding, if any, is its last entry.
    j = 0
    for i in range(len(packed)):
        assert len(packed[i]["tokens"]) == 512
        entries = packed[i]["seq_lens"].tolist()
        assert sum(entries) == 512
        for k, n in enumerate(entries):
            if j < len(lengths) and n == lengths[j]:
                j += 1
            else:
                assert k == len(entries) - 1, (i, entries)  # the padding
    assert j == len(lengths)
    assert len(packed) < len(ds) / 2


def test_synthetic_spread_lengths_reject_inconsistent_bounds():
    import pytest

    with pytest.raises(ValueError, match="min_len=300, median_len=100"):
        synthetic_dataset(num_samples=4, seq_len=512, vocab_size=97, median_len=100, min_len=300)
