"""tune_recipes.training.step.nonfinite: the on_nonfinite flag, its checks and settings
(the driver's use of it: test_driver.py)."""

import pytest
import torch

from tune_recipes.config import ConfigError
from tune_recipes.training.step.nonfinite import (
    NonFiniteError,
    NonFiniteGuard,
    check_clip_grad_norm,
    check_mode,
    is_finite,
)

pytestmark = pytest.mark.unit
NAN, INF = float("nan"), float("inf")


def test_skip_with_optimizer_in_backward_is_refused():
    with pytest.raises(ConfigError, match="optimizer_in_bwd"):
        check_mode("skip", optimizer_in_bwd=True)
    assert check_mode("raise", optimizer_in_bwd=True) == "raise"


@pytest.mark.parametrize("value, expected", [(None, None), (1, 1.0), ("inf", INF), (0.5, 0.5)])
def test_clip_grad_norm_accepts_positive_inf_and_null(value, expected):
    assert check_clip_grad_norm(value) == expected


@pytest.mark.parametrize("value", [0, -1, -INF, NAN, "x", [1]])
def test_clip_grad_norm_rejects_the_rest_naming_the_key(value):
    with pytest.raises(ConfigError, match="clip_grad_norm="):
        check_clip_grad_norm(value)


@pytest.mark.parametrize("loss, norm, ok", [(1.0, 2.0, True), (NAN, 2.0, False), (1.0, INF, False),
                                            (1.0, None, True), (INF, None, False)])
def test_is_finite(loss, norm, ok):
    assert bool(is_finite(torch.tensor(loss), None if norm is None else torch.tensor(norm))) is ok


def test_the_guard_reports_the_first_bad_step_and_resets_after_a_clean_check():
    g = NonFiniteGuard("raise")
    g.record(torch.tensor(True), 1, "epoch 0, step 1")
    g.check()
    g.record(torch.tensor(False), 2, "epoch 0, step 2")
    g.record(torch.tensor(False), 3, "epoch 0, step 3")
    with pytest.raises(NonFiniteError, match="at epoch 0, step 2;"):
        g.check()
