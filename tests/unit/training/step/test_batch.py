"""tune_recipes.training.step.batch: token count, label shift, device move."""

import pytest
import torch

from tune_recipes.constants import CROSS_ENTROPY_IGNORE_INDEX as IGNORE
from tune_recipes.training.step.batch import count_valid_tokens, shift_labels, to_device

pytestmark = pytest.mark.unit


def test_count_valid_tokens_skips_the_first_position_and_is_an_int():
    labels = torch.tensor([[5, 6, IGNORE, 7], [IGNORE, IGNORE, 1, 2]])
    assert count_valid_tokens(labels) == 4
    assert type(count_valid_tokens(labels)) is int
    assert count_valid_tokens(torch.tensor([[3, 0, 0]]), ignore_index=0) == 0


def test_shift_labels_scores_position_t_on_token_t_plus_1():
    labels = torch.tensor([[1, 2, 3], [4, IGNORE, 6]])
    shifted = shift_labels(labels)
    assert shifted.tolist() == [[2, 3, IGNORE], [IGNORE, 6, IGNORE]]
    # The shifted labels hold exactly the counted tokens.
    assert int((shifted != IGNORE).sum()) == count_valid_tokens(labels)


def test_to_device_moves_tensors_only():
    batch = {"tokens": torch.ones(2, dtype=torch.long), "meta": "keep"}
    out = to_device(batch, torch.device("cpu"))
    assert out["meta"] == "keep" and torch.equal(out["tokens"], batch["tokens"])
