"""The math of token-exact loss normalization (tune_recipes.training.step.normalization).

Tolerances: fp32 comparisons use rtol=1e-6 (a multiply by n then by 1/n may round the last bit);
references are computed in float64.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from tune_recipes.config import ConfigError
from tune_recipes.training import (
    NormalizationPath,
    StepLossNormalizer,
    complete_optimizer_step,
    count_valid_tokens,
    grad_norm_and_clip_,
    normalization_path,
    scale_grads_,
)

pytestmark = pytest.mark.unit
IGNORE = -100
V, D = 11, 6


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Linear(D, V)


def _batch(n_rows, n_valid, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n_rows, D, generator=g)
    y = torch.randint(0, V, (n_rows,), generator=g)
    y[n_valid:] = IGNORE
    return x, y


def _grads(model):
    return [p.grad.detach().clone() for p in model.parameters()]


def _run(normalizer, model, micro_batches):
    for p in model.parameters():
        p.grad = None
    for x, y in micro_batches:
        n = int((y != IGNORE).sum())
        loss = F.cross_entropy(model(x), y, ignore_index=IGNORE)
        normalizer.loss_to_backward(loss, n, where="test").backward()
    logged = normalizer.finish_step(model.parameters())
    return _grads(model), logged


def _reference_grads(micro_batches, seed=0):
    """float64: gradient of (sum of per-token CE over all micro-batches) / total tokens."""
    model = _model(seed).double()
    total = sum(int((y != IGNORE).sum()) for _, y in micro_batches)
    loss = sum(F.cross_entropy(model(x.double()), y, ignore_index=IGNORE, reduction="sum")
               for x, y in micro_batches) / total
    loss.backward()
    return _grads(model), loss.item()


def _forced_rescale(ga=1):
    """The non-skip path at GA=1: what the recipe did before the skip existed."""
    n = StepLossNormalizer(ga)
    n.path = NormalizationPath.RESCALE
    return n


def test_paths_are_chosen_by_configuration():
    assert StepLossNormalizer(1).path == "skip"
    assert StepLossNormalizer(4).path == "rescale"
    assert StepLossNormalizer(1, optimizer_in_bwd=True).path == "in_backward"
    assert StepLossNormalizer(1, distributed=True, world_size=2).path == "rescale"


@pytest.mark.parametrize("n_valid", [1, 3, 5, 8])
def test_skip_equals_non_skip_gradients(n_valid):
    batch = [_batch(8, n_valid, seed=n_valid)]
    skip_grads, skip_loss = _run(StepLossNormalizer(1), _model(), batch)
    full_grads, full_loss = _run(_forced_rescale(), _model(), batch)
    ref_grads, ref_loss = _reference_grads(batch)
    for a, b, r in zip(skip_grads, full_grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-8)
        torch.testing.assert_close(a.double(), r, rtol=1e-5, atol=1e-7)
    # Logged loss: denominator 1.0 on the skip path equals running/num_tokens on the other.
    assert skip_loss.item() == pytest.approx(full_loss.item(), rel=1e-6)
    assert skip_loss.item() == pytest.approx(ref_loss, rel=1e-5)


def test_skip_path_does_not_touch_gradients(monkeypatch):
    calls = []
    import tune_recipes.training.step.normalization as norm

    monkeypatch.setattr(norm, "scale_grads_", lambda *a, **k: calls.append(a))
    _run(StepLossNormalizer(1), _model(), [_batch(8, 5, 1)])
    assert calls == []
    _run(StepLossNormalizer(2), _model(), [_batch(4, 3, 1), _batch(4, 2, 2)])
    assert len(calls) == 1


@pytest.mark.parametrize("normalizer", [StepLossNormalizer(1), _forced_rescale()],
                         ids=["skip", "rescale"])
def test_a_step_with_no_label_token_is_one_config_error_on_every_path(normalizer):
    """Nothing to train on: a data problem, named (where, and what to change), on the skip
    path at its one micro-batch, on the rescale path when the step closes."""
    x, y = _batch(8, 0, seed=3)
    model = _model()
    with pytest.raises(ConfigError) as err:
        loss = F.cross_entropy(model(x), y, ignore_index=IGNORE)
        normalizer.loss_to_backward(loss, 0, where="epoch 2, step 7").backward()
        normalizer.finish_step(model.parameters())
    msg = str(err.value)
    assert "epoch 2, step 7" in msg and "max_seq_len" in msg and "no unmasked" in msg
    assert "set on_nonfinite=skip" in msg


def test_the_no_label_line_offers_skipping_only_where_the_run_can_skip():
    """With the optimizer in backward on_nonfinite=skip is refused at setup: the line for a
    step without label tokens does not offer it there."""
    x, y = _batch(8, 0, seed=3)
    model = _model()
    normalizer = StepLossNormalizer(1, optimizer_in_bwd=True)
    with pytest.raises(ConfigError) as err:
        loss = F.cross_entropy(model(x), y, ignore_index=IGNORE)
        normalizer.loss_to_backward(loss, 0, where="epoch 0, step 1").backward()
    assert "no unmasked" in str(err.value) and "on_nonfinite" not in str(err.value)


@pytest.mark.parametrize("normalizer", [StepLossNormalizer(1), _forced_rescale()],
                         ids=["skip", "rescale"])
def test_a_skipped_empty_step_logs_its_loss_and_extras_as_nan(normalizer):
    """on_nonfinite=skip: a step without label tokens gives zero gradients, and its loss and
    extras (e.g. distillation's terms) are 0/0 on every path, not a 0.0 that reads as measured."""
    import math

    normalizer.skip_empty_steps = True
    x, y = _batch(8, 0, seed=3)
    model = _model()
    for p in model.parameters():
        p.grad = None
    loss = F.cross_entropy(model(x), y, ignore_index=IGNORE)
    normalizer.loss_to_backward(loss, 0, where="s", extras={"kd": loss * 2}).backward()
    logged = normalizer.finish_step(model.parameters())
    assert normalizer.last_step_empty
    assert math.isnan(logged.item()) and math.isnan(normalizer.extras["kd"].item())
    assert all(bool((p.grad == 0).all()) for p in model.parameters())


def test_a_micro_batch_with_no_label_token_leaves_the_step_to_the_others():
    """batch_size 1 with accumulation: one example cut before its response must not stop the
    run; the step is the exact mean over the tokens its other micro-batches hold."""
    empty, mb1, mb2 = _batch(4, 0, seed=20), _batch(4, 3, seed=21), _batch(4, 2, seed=22)
    grads, logged = _run(StepLossNormalizer(3), _model(), [mb1, empty, mb2])
    ref_grads, ref_loss = _reference_grads([mb1, mb2])
    for a, r in zip(grads, ref_grads):
        torch.testing.assert_close(a.double(), r, rtol=1e-5, atol=1e-7)
    assert logged.item() == pytest.approx(ref_loss, rel=1e-5)
    # Every micro-batch empty: the step has nothing to train on.
    norm = StepLossNormalizer(2)
    with pytest.raises(ConfigError, match=r"^Every micro-batch of the step ending at test has no unmasked label"):
        _run(norm, _model(), [empty, empty])


def test_gradient_accumulation_two_passes_equal_one_combined_pass():
    # Ragged: 5 and 2 valid tokens; the exact step loss weights them 5:2, not 1:1.
    mb1, mb2 = _batch(4, 4, seed=10), _batch(4, 2, seed=11)
    mb1[1][4:] = IGNORE
    ga_grads, ga_loss = _run(StepLossNormalizer(2), _model(), [mb1, mb2])
    combined = (torch.cat([mb1[0], mb2[0]]), torch.cat([mb1[1], mb2[1]]))
    one_grads, one_loss = _run(StepLossNormalizer(1), _model(), [combined])
    ref_grads, ref_loss = _reference_grads([mb1, mb2])
    for a, b, r in zip(ga_grads, one_grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(a.double(), r, rtol=1e-5, atol=1e-7)
    assert ga_loss.item() == pytest.approx(one_loss.item(), rel=1e-6)
    assert ga_loss.item() == pytest.approx(ref_loss, rel=1e-5)
    # And the naive mean of micro-batch means is measurably different here.
    naive = 0.5 * sum(F.cross_entropy(_model()(x), y, ignore_index=IGNORE) for x, y in [mb1, mb2])
    assert abs(naive.item() - ref_loss) > 1e-3


@pytest.mark.parametrize("max_norm", [0.05, float("inf")])
def test_clip_grad_norm_identical_on_both_paths(max_norm):
    batch = [_batch(8, 5, seed=4)]
    norms, grads, unclipped = [], [], []
    for norm in (StepLossNormalizer(1), _forced_rescale()):
        model = _model()
        g, _ = _run(norm, model, batch)
        unclipped.append(g)
        norms.append(grad_norm_and_clip_(model.parameters(), max_norm))
        grads.append(_grads(model))
    torch.testing.assert_close(norms[0], norms[1], rtol=1e-6, atol=0)
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-9)
    if max_norm == float("inf"):
        # Measuring only: the gradients are untouched.
        for path in range(2):
            for a, b in zip(grads[path], unclipped[path]):
                assert torch.equal(a, b)
    else:
        total = math.sqrt(sum(float((x ** 2).sum()) for x in grads[0]))
        assert total == pytest.approx(max_norm, rel=1e-4)


def test_grad_norm_none_means_no_clip_and_no_norm():
    model = _model()
    _run(StepLossNormalizer(1), model, [_batch(8, 5, 1)])
    before = _grads(model)
    assert grad_norm_and_clip_(model.parameters(), None) is None
    for a, b in zip(before, _grads(model)):
        assert torch.equal(a, b)


def test_optimizer_steps_on_every_path():
    """The skip gate must never skip optimizer.step()/zero_grad() (a past regression)."""

    class Sched:
        lr = 0.1

        def step(self):
            pass

    for norm in (StepLossNormalizer(1), StepLossNormalizer(2)):
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        w0 = model.weight.detach().clone()
        mbs = [_batch(4, 3, s) for s in range(norm.gradient_accumulation_steps)]
        for x, y in mbs:
            loss = F.cross_entropy(model(x), y, ignore_index=IGNORE)
            norm.loss_to_backward(loss, int((y != IGNORE).sum())).backward()
        complete_optimizer_step(norm, model.parameters(), opt, Sched(), clip_grad_norm=1.0)
        assert not torch.equal(w0, model.weight), norm.path
        assert all(p.grad is None for p in model.parameters()), norm.path


def test_finish_step_checks_micro_batch_count():
    norm = StepLossNormalizer(2)
    x, y = _batch(4, 3, 0)
    norm.loss_to_backward(F.cross_entropy(_model()(x), y, ignore_index=IGNORE), 3)
    with pytest.raises(RuntimeError, match="expected gradient_accumulation_steps=2"):
        norm.finish_step([])


def test_incompatible_flags_rejected():
    with pytest.raises(ValueError, match="gradient_accumulation_steps=1"):
        StepLossNormalizer(2, optimizer_in_bwd=True)
    with pytest.raises(ValueError, match=">= 1"):
        StepLossNormalizer(0)


def test_count_valid_tokens_uses_shifted_labels():
    labels = torch.tensor([[5, 6, -100, 7], [-100, -100, 1, 2]])
    # position 0 never counts (it is nobody's target after the shift)
    assert count_valid_tokens(labels) == 2 + 2
    assert isinstance(count_valid_tokens(labels), int)


def test_scale_grads_passes_a_python_float_even_given_a_tensor(monkeypatch):
    """The factor reaches _foreach_mul_ as a Python float (the fast scalar overload), even when
    the caller hands over a 0-dim tensor; every gradient is scaled."""
    model = _model()
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    seen = []
    real = torch._foreach_mul_
    monkeypatch.setattr(torch, "_foreach_mul_", lambda grads, s: (seen.append(s), real(grads, s)))
    scale_grads_(model.parameters(), torch.tensor(0.25))
    assert len(seen) == 1 and type(seen[0]) is float and seen[0] == 0.25
    for p in model.parameters():
        assert torch.all(p.grad == 0.25)


def test_scale_grads_skips_parameters_without_gradients():
    model = _model()
    model.weight.grad = torch.ones_like(model.weight)
    scale_grads_(model.parameters(), 0.5)
    assert model.bias.grad is None and torch.all(model.weight.grad == 0.5)


def test_normalization_path_is_one_decision_from_three_flags():
    P = NormalizationPath
    assert normalization_path(distributed=False, gradient_accumulation_steps=1) is P.SKIP
    assert normalization_path(distributed=False, gradient_accumulation_steps=4) is P.RESCALE
    # Never the skip when distributed, even with one rank and GA 1.
    assert normalization_path(distributed=True, gradient_accumulation_steps=1) is P.RESCALE
    assert normalization_path(distributed=False, gradient_accumulation_steps=1,
                              optimizer_in_bwd=True) is P.IN_BACKWARD
    with pytest.raises(ConfigError, match="gradient_accumulation_steps=1"):
        normalization_path(distributed=False, gradient_accumulation_steps=2, optimizer_in_bwd=True)
    assert normalization_path(distributed=True, gradient_accumulation_steps=1,
                              optimizer_in_bwd=True) is P.IN_BACKWARD_GLOBAL
    with pytest.raises(ConfigError, match="gradient_accumulation_steps=1"):
        normalization_path(distributed=True, gradient_accumulation_steps=2, optimizer_in_bwd=True)
    assert "no scale_grads" in P.SKIP.describe()


def test_normalizer_with_one_rank_is_still_distributed():
    norm = StepLossNormalizer(1, distributed=True, world_size=1)
    assert norm.distributed and norm.path is NormalizationPath.RESCALE
    with pytest.raises(ValueError, match="needs distributed=True"):
        StepLossNormalizer(1, world_size=2)


def test_backward_factor_matches_what_loss_to_backward_applies():
    loss = torch.tensor(2.0)
    for norm in (StepLossNormalizer(1), StepLossNormalizer(2)):
        got = norm.loss_to_backward(loss, 5)
        assert got.item() == pytest.approx(2.0 * norm.backward_factor(5))
    assert StepLossNormalizer(1).backward_factor(5) == 1.0
    assert StepLossNormalizer(2).backward_factor(5) == 5.0


def test_extras_are_token_weighted_like_the_loss():
    norm = StepLossNormalizer(2)
    norm.loss_to_backward(torch.tensor(1.0), 3, extras={"kd": torch.tensor(1.0)})
    norm.loss_to_backward(torch.tensor(4.0), 1, extras={"kd": torch.tensor(4.0)})
    logged = norm.finish_step([])
    assert logged.item() == pytest.approx((3 * 1.0 + 1 * 4.0) / 4)
    assert norm.extras["kd"].item() == pytest.approx(logged.item())


def _mixed_tp_params():
    """What tensor parallelism leaves: a planned layer's gradient is a DTensor on a device mesh,
    a norm's a plain tensor (one foreach op over both fails: 'mixed torch.Tensor and DTensor')."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    g = torch.Generator().manual_seed(0)
    full, plain = torch.randn(4, 6, generator=g), torch.randn(5, generator=g)
    sliced = torch.nn.Parameter(distribute_tensor(torch.zeros(4, 6), mesh, [Shard(0)]))
    sliced.grad = distribute_tensor(full.clone(), mesh, [Shard(0)])
    norm_weight = torch.nn.Parameter(torch.zeros(5))
    norm_weight.grad = plain.clone()
    return [sliced, norm_weight], full, plain


@pytest.mark.parametrize("max_norm", [1.0, 100.0, math.inf])
def test_clip_and_scale_over_dtensor_and_plain_gradients(one_rank, max_norm):
    params, full, plain = _mixed_tp_params()
    total = torch.cat([full.flatten(), plain]).norm()
    norm = grad_norm_and_clip_(params, max_norm)
    torch.testing.assert_close(norm, total)
    coef = min(1.0, max_norm / (total.item() + 1e-6))  # no clipping when the norm is below
    torch.testing.assert_close(params[0].grad.full_tensor(), full * coef)
    torch.testing.assert_close(params[1].grad, plain * coef)
    scale_grads_(params, 0.5)
    torch.testing.assert_close(params[0].grad.full_tensor(), full * coef * 0.5)
    torch.testing.assert_close(params[1].grad, plain * coef * 0.5)


@pytest.mark.parametrize("ga, in_bwd", [(1, False), (2, False), (1, True)])
def test_fused_loss_backward_reads_nothing_from_the_device(monkeypatch, ga, in_bwd):
    """loss_to_backward declares the gradient that reaches the fused loss (1.0 on the skip and
    in-backward paths, the token count on the rescale path), so its backward does no .item()
    host sync; the gradients still match the float64 reference."""
    from tune_recipes.modules.loss import fused_linear_cross_entropy

    batches = [_batch(8, n, seed=n) for n in (5, 3)][:ga]
    model = _model()
    norm = StepLossNormalizer(ga, optimizer_in_bwd=in_bwd)
    assert norm.path == ("in_backward" if in_bwd else "skip" if ga == 1 else "rescale")
    reads = []
    real_item = torch.Tensor.item
    for x, y in batches:
        n = int((y != IGNORE).sum())
        loss = fused_linear_cross_entropy(x, model.weight, y, model.bias, ignore_index=IGNORE,
                                          scaling=norm.backward_factor(n), num_valid=n)
        to_backward = norm.loss_to_backward(loss, n)
        monkeypatch.setattr(torch.Tensor, "item", lambda t: reads.append(1) or real_item(t))
        to_backward.backward()
        monkeypatch.setattr(torch.Tensor, "item", real_item)
    norm.finish_step(model.parameters())
    assert reads == []
    for a, r in zip(_grads(model), _reference_grads(batches)[0]):
        torch.testing.assert_close(a.double(), r, rtol=1e-5, atol=1e-7)

