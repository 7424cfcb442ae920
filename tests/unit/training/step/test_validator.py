"""Validator: token-weighted mean over the whole set, model mode restored, schedule."""

import pytest
import torch
from torch import nn

from tune_recipes.training.step.validation import Validator, shard_for_rank

pytestmark = pytest.mark.unit


class _Model(nn.Module):
    def forward(self):  # never called: the eval loss below stands in for model + loss
        raise AssertionError


def _batch(per_token_losses, n_valid):
    labels = torch.full((1, len(per_token_losses) + 1), -100)
    labels[0, 1:1 + n_valid] = 1  # the first position never counts (shifted labels)
    return {"labels": labels, "value": torch.tensor(per_token_losses[:n_valid]).mean()}


def test_validation_loss_is_a_token_mean_not_a_mean_of_batch_means():
    batches = [_batch([1.0, 1.0, 1.0, 1.0], 4), _batch([5.0, 0.0, 0.0, 0.0], 1)]
    model = _Model().train()
    seen_modes = []

    def eval_loss(batch, n):
        seen_modes.append(model.training)
        return batch["value"]

    v = Validator(model, eval_loss, batches, ignore_index=-100, device=torch.device("cpu"),
                  distributed=False)
    assert v() == pytest.approx((4 * 1.0 + 1 * 5.0) / 5)  # 1.8; a mean of means would be 3.0
    assert seen_modes == [False, False] and model.training  # eval inside, train restored


def test_batches_without_unmasked_tokens_are_skipped_and_an_empty_set_is_an_error():
    v = Validator(_Model(), lambda b, n: b["value"], [_batch([2.0, 2.0], 2), _batch([9.0], 0)],
                  ignore_index=-100, device=torch.device("cpu"), distributed=False)
    assert v() == pytest.approx(2.0)
    empty = Validator(_Model(), lambda b, n: b["value"], [_batch([9.0], 0)], ignore_index=-100,
                      device=torch.device("cpu"), distributed=False)
    with pytest.raises(RuntimeError, match="no unmasked label"):
        empty()


def test_due_every_n_steps_only_when_set():
    v = Validator(_Model(), None, [], ignore_index=-100, device=torch.device("cpu"),
                  distributed=False, every_n_steps=3)
    assert [s for s in range(1, 10) if v.due(s)] == [3, 6, 9]
    v.every_n_steps = None
    assert not any(v.due(s) for s in range(1, 10))


def test_every_example_on_exactly_one_rank():
    data = list(range(37))
    shards = [list(shard_for_rank(data, 2, r)) for r in (0, 1)]
    assert sorted(shards[0] + shards[1]) == data and len(shards[0]) == 19
    assert shard_for_rank(data, 1, 0) is data
