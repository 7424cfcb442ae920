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
