"""The fused loss on CUDA (Triton kernel path) against a float64 reference."""

import pytest
import torch

from test_fused_loss import _assert_target_rows_added, _bf16_floor, _inputs, _peaked_inputs, _reference, _rel_l2
from tune_recipes.modules.loss import fused_linear_cross_entropy

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2.5e-3)])
@pytest.mark.parametrize("ignored_frac", [0.0, 0.3])
@pytest.mark.parametrize("weight_grad_fp32", [True, False])
def test_cuda_matches_float64_reference(dtype, tol, ignored_frac, weight_grad_fp32):
    h, w, b, y = _inputs(1024, 256, 5000, ignored_frac, dtype, 5)
    h, w, b = (t.detach().cuda().requires_grad_() for t in (h, w, b))
    y = y.cuda()
    loss = fused_linear_cross_entropy(h, w, y, b, chunk_size=300, weight_grad_fp32=weight_grad_fp32)
    loss.backward()
    ref_loss, ref = _reference(h.cpu(), w.cpu(), b.cpu(), y.cpu(), "mean")
    assert abs(loss.item() - ref_loss.item()) <= tol * abs(ref_loss.item())
    # bf16 accumulation of the weight gradient: one rounding per chunk (up to 4 chunks here),
    # bounded as in test_fused_loss.py by tol * sqrt(chunks / 2).
    w_tol = tol if (weight_grad_fp32 or dtype == torch.float32) else tol * 2**0.5
    for t, r, t_tol in zip((h, w, b), ref, (tol, w_tol, tol)):
        assert _rel_l2(t.grad.cpu(), r) <= t_tol


def test_triton_kernel_equals_torch_path():
    from tune_recipes.modules import _triton_ce
    from tune_recipes.modules.loss import _softmax_grad_torch

    assert _triton_ce.available()
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(64, 70000, device="cuda", generator=g).bfloat16() * 4
    target = torch.randint(0, 70000, (64,), device="cuda", generator=g)
    loss_t, grad_t = _softmax_grad_torch(logits.clone(), target, 0.37)
    loss_k = torch.full((64,), float("nan"), device="cuda")
    _, grad_k = _triton_ce.softmax_grad_inplace(logits.clone(), target, 0.37, loss_out=loss_k)
    torch.testing.assert_close(loss_k, loss_t, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad_k.float(), grad_t.float(), rtol=1e-2, atol=1e-6)


def test_fp32_logits_narrowed_in_place_equal_torch_path():
    """fp32 logits in, bf16 gradient written over the same memory: every value must be the
    torch path's bf16 rounding of the same fp32 gradient (up to one bf16 step for exp's last
    bits), and identical run to run. A missing barrier would show as stale or mixed values."""
    from tune_recipes.modules import _triton_ce
    from tune_recipes.modules.loss import _softmax_grad_torch

    v, n = 128256, 96
    g = torch.Generator(device="cuda").manual_seed(1)
    logits = torch.randn(n, v, device="cuda", generator=g) * 2.5
    target = torch.randint(0, v, (n,), device="cuda", generator=g)
    logits[torch.arange(n, device="cuda"), target] += 15.0  # peaked, like a trained LM
    loss_t, grad_t = _softmax_grad_torch(logits.clone(), target, 0.37, torch.bfloat16)
    grads = []
    for _ in range(3):
        buf = logits.clone()
        loss_k = torch.full((n,), float("nan"), device="cuda")
        _, grad_k = _triton_ce.softmax_grad_inplace(buf, target, 0.37, loss_out=loss_k,
                                                    grad_dtype=torch.bfloat16)
        assert grad_k.dtype == torch.bfloat16 and grad_k.shape == (n, v)
        assert grad_k.data_ptr() == buf.data_ptr() and grad_k.stride() == (2 * v, 1)
        grads.append(grad_k.clone())
        torch.testing.assert_close(loss_k, loss_t, rtol=1e-5, atol=1e-5)
    for other in grads[1:]:
        assert torch.equal(other, grads[0])
    torch.testing.assert_close(grads[0].float(), grad_t.float(), rtol=2**-7, atol=1e-30)


def test_split_target_kernel_equals_torch_path():
    """The Triton kernel's split mode (0 at the target, (softmax[target] - 1) * scale apart, in
    fp32) against the torch path's, on fp32 logits narrowed to bf16 in place."""
    from tune_recipes.modules import _triton_ce
    from tune_recipes.modules.loss import _softmax_grad_torch

    v, n = 128256, 64
    g = torch.Generator(device="cuda").manual_seed(3)
    logits = torch.randn(n, v, device="cuda", generator=g) * 2.5
    target = torch.randint(0, v, (n,), device="cuda", generator=g)
    logits[torch.arange(n, device="cuda"), target] += torch.linspace(0, 25, n, device="cuda")
    coef_t = torch.empty(n, device="cuda")
    loss_t, grad_t = _softmax_grad_torch(logits.clone(), target, 0.37, torch.bfloat16, coef_t)
    coef_k = torch.full((n,), float("nan"), device="cuda")
    loss_k = torch.empty(n, device="cuda")
    weight = torch.randn(v, 1000, device="cuda", generator=g).bfloat16()
    term_k = torch.full((n, 1000), float("nan"), device="cuda")
    _, grad_k = _triton_ce.softmax_grad_inplace(logits.clone(), target, 0.37, loss_out=loss_k,
                                                grad_dtype=torch.bfloat16, target_coef_out=coef_k,
                                                weight=weight, hidden_term_out=term_k)
    torch.testing.assert_close(term_k, coef_k[:, None] * weight[target].float(), rtol=0, atol=0)
    assert torch.count_nonzero(grad_k[torch.arange(n, device="cuda"), target]) == 0
    # (p - 1) * 0.37 in fp32: p carries the fp32 rounding of a log-sum-exp up to ~35, a few
    # 2^-24 * 35 absolute, times 0.37.
    torch.testing.assert_close(coef_k, coef_t, rtol=1e-5, atol=4e-6)
    torch.testing.assert_close(loss_k, loss_t, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad_k.float(), grad_t.float(), rtol=2**-7, atol=1e-30)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_target_rows_kernel_sums_per_label_and_rounds_once(dtype):
    """_triton_ce.add_target_rows against a float64 scatter-add: repeated labels (one label in
    300 rows, spread out), a row map that skips rows (ignored labels), untouched rows bit-equal;
    in bf16 each touched row is the exact sum rounded once (within one bf16 step)."""
    from tune_recipes.modules import _triton_ce

    g = torch.Generator(device="cuda").manual_seed(0)
    n, v, d = 1000, 5000, 3000  # d not a multiple of the column block
    labels = torch.randint(0, v, (n,), device="cuda", generator=g)
    labels[::3] = 17
    rows = torch.randperm(2 * n, device="cuda", generator=g)[:n]
    hidden = torch.randn(2 * n, d, device="cuda", generator=g).bfloat16()
    coef = torch.randn(n, device="cuda", generator=g)
    before = torch.randn(v, d, device="cuda", generator=g).to(dtype)
    gw = before.clone()
    _triton_ce.add_target_rows(gw, hidden, rows, labels, coef)
    _assert_target_rows_added(gw, before, labels, rows, hidden, coef)
    again = before.clone()
    _triton_ce.add_target_rows(again, hidden, rows, labels, coef)
    assert torch.equal(again, gw)  # deterministic


@pytest.mark.parametrize("labels", ["random", "repeated"])
def test_cuda_peaked_logits_within_ten_percent_of_the_bf16_floor(labels):
    """As test_fused_loss.py's peaked test, on the CUDA path (cuBLAS fp32-output products, the
    Triton kernel, the target terms' sorted segment sums), default settings (6 chunks); two
    runs must agree bit for bit (no atomics in the target terms)."""
    h, w, y = _peaked_inputs(1024, 256, 8192, seed=2, n_labels=7 if labels == "repeated" else None)
    h, w = (t.detach().cuda().requires_grad_() for t in (h, w))
    grads = []
    for _ in range(2):
        h.grad = w.grad = None
        loss = fused_linear_cross_entropy(h, w, y.cuda(), chunk_size=120)
        loss.backward()
        grads.append((h.grad.clone(), w.grad.clone()))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])
    ref_loss, (ref_h, ref_w, _) = _reference(h.cpu(), w.cpu(), None, y, "mean")
    err_h, err_w = _rel_l2(h.grad.cpu(), ref_h), _rel_l2(w.grad.cpu(), ref_w)
    print(f"peaked {labels}: hidden {err_h:.3e} (floor {_bf16_floor(ref_h):.3e}), "
          f"weight {err_w:.3e} (floor {_bf16_floor(ref_w):.3e})")
    assert err_h <= 1.1 * _bf16_floor(ref_h)
    assert err_w <= 1.1 * _bf16_floor(ref_w)
    assert abs(loss.item() - ref_loss.item()) <= 1e-5 * ref_loss.item()
