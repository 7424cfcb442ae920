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


def _bf16_chunk(n, v, d, seed, bias=True):
    """A chunk as the loss sees it: bf16 hidden rows, weight and bias, the bf16 logits of their
    product, peaked targets (margins 0-25 above N(0, 2.5^2) background logits)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = (torch.randn(v, d, device="cuda", generator=g) / d**0.5).bfloat16()
    target = torch.randint(0, v, (n,), device="cuda", generator=g)
    wy = w[target].float()
    margin = torch.linspace(0, 25, n, device="cuda")
    h = (2.5 * torch.randn(n, d, device="cuda", generator=g)
         + (margin / (wy * wy).sum(1))[:, None] * wy).bfloat16()
    b = torch.randn(v, device="cuda", generator=g).bfloat16() if bias else None
    logits = h @ w.t()
    if b is not None:
        logits += b
    return h, w, b, target, logits


@pytest.mark.parametrize("bias", [True, False])
def test_exact_target_kernel_equals_torch_path(bias):
    """The kernel recomputes each row's target logit in fp32 (h . W[y] + b[y]) and uses it in
    the log-sum-exp, the loss and the gradient: equal to the torch path given the same exact
    values, identical run to run, and different from using the stored bf16 target logit."""
    from tune_recipes.modules import _triton_ce
    from tune_recipes.modules.loss import _softmax_grad_torch, target_logits

    n, v, d = 96, 128256, 1000  # d not a multiple of the kernel's block
    h, w, b, target, logits = _bf16_chunk(n, v, d, seed=1, bias=bias)
    exact = target_logits(h, w, target, b)
    loss_t, grad_t = _softmax_grad_torch(logits.clone(), target, 0.37, target_logit=exact)
    grads = []
    for _ in range(3):
        buf = logits.clone()
        loss_k = torch.full((n,), float("nan"), device="cuda")
        _, grad_k = _triton_ce.softmax_grad_inplace(buf, target, 0.37, loss_out=loss_k, weight=w,
                                                    hidden=h, bias=b)
        assert grad_k.data_ptr() == buf.data_ptr() and grad_k.dtype == torch.bfloat16
        grads.append(grad_k.clone())
        torch.testing.assert_close(loss_k, loss_t, rtol=1e-5, atol=1e-5)
    for other in grads[1:]:
        assert torch.equal(other, grads[0])
    # Off the target: within one bf16 step. At the target (this test's unsplit mode), p - 1 on
    # the most peaked rows (1 - p down to ~7e-5) carries the fp32 rounding of the log-sum-exp and
    # the exponential, which differ between the two paths' summation orders (a float64 check:
    # ~5e-7 absolute after the 0.37 scale).
    at_target = torch.zeros(n, v, dtype=torch.bool, device="cuda")
    at_target[torch.arange(n, device="cuda"), target] = True
    torch.testing.assert_close(grads[0].float()[~at_target], grad_t.float()[~at_target], rtol=2**-7, atol=1e-30)
    torch.testing.assert_close(grads[0].float()[at_target], grad_t.float()[at_target], rtol=2**-7, atol=4e-6)
    stored_loss, _ = _triton_ce.softmax_grad_inplace(logits.clone(), target, 0.37)
    assert (stored_loss - loss_k).abs().max() > 1e-3  # the bf16 target logit is ~1e-2 off


def test_exact_target_kernel_reads_strided_rows_over_several_blocks():
    """Hidden rows and weight rows with row strides other than D (views into wider buffers, as a
    sliced 3-D hidden gives), D larger than the kernel's block and not a multiple of it (the dot
    product and the hidden term take several passes with a masked tail), split mode, no bias."""
    from tune_recipes.modules import _triton_ce
    from tune_recipes.modules.loss import _softmax_grad_torch, target_logits

    n, v, d = 48, 20000, 5000
    h0, w0, _, target, _ = _bf16_chunk(n, v, d, seed=5, bias=False)
    hidden = torch.zeros(n, d + 40, device="cuda", dtype=torch.bfloat16)[:, :d].copy_(h0)
    weight = torch.zeros(v, d + 24, device="cuda", dtype=torch.bfloat16)[:, :d].copy_(w0)
    assert hidden.stride(0) == d + 40 and weight.stride(0) == d + 24
    logits = hidden @ weight.t()
    coef_t = torch.empty(n, device="cuda")
    loss_t, grad_t = _softmax_grad_torch(logits.clone(), target, 0.5, torch.bfloat16, coef_t,
                                         target_logits(h0, w0, target))
    coef_k, loss_k = torch.empty(n, device="cuda"), torch.empty(n, device="cuda")
    term_k = torch.full((n, d), float("nan"), device="cuda")
    _, grad_k = _triton_ce.softmax_grad_inplace(logits.clone(), target, 0.5, loss_out=loss_k,
                                                target_coef_out=coef_k, weight=weight, hidden=hidden,
                                                hidden_term_out=term_k)
    torch.testing.assert_close(loss_k, loss_t, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(coef_k, coef_t, rtol=1e-5, atol=4e-6)
    torch.testing.assert_close(term_k, coef_k[:, None] * w0[target].float(), rtol=0, atol=0)
    torch.testing.assert_close(grad_k.float(), grad_t.float(), rtol=2**-7, atol=1e-30)


def test_split_target_kernel_equals_torch_path():
    """The Triton kernel's split mode (0 at the target, (softmax[target] - 1) * scale apart, in
    fp32, with the target's logit recomputed) against the torch path's, on bf16 logits."""
    from tune_recipes.modules import _triton_ce
    from tune_recipes.modules.loss import _softmax_grad_torch, target_logits

    n, v, d = 64, 128256, 1000
    h, w, b, target, logits = _bf16_chunk(n, v, d, seed=3)
    coef_t = torch.empty(n, device="cuda")
    loss_t, grad_t = _softmax_grad_torch(logits.clone(), target, 0.37, torch.bfloat16, coef_t,
                                         target_logits(h, w, target, b))
    coef_k = torch.full((n,), float("nan"), device="cuda")
    loss_k = torch.empty(n, device="cuda")
    term_k = torch.full((n, d), float("nan"), device="cuda")
    _, grad_k = _triton_ce.softmax_grad_inplace(logits.clone(), target, 0.37, loss_out=loss_k,
                                                target_coef_out=coef_k, weight=w, hidden=h, bias=b,
                                                hidden_term_out=term_k)
    torch.testing.assert_close(term_k, coef_k[:, None] * w[target].float(), rtol=0, atol=0)
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
def test_cuda_peaked_logits_near_the_bf16_floor(labels):
    """As test_fused_loss.py's small-vocabulary peaked test (bound 2x the bf16 floor), on the
    CUDA path (cuBLAS products, the Triton kernel with the recomputed target logit, the target
    terms' sorted segment sums), default settings (6 chunks); two runs must agree bit for bit
    (no atomics in the target terms)."""
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
    assert err_h <= 2.0 * _bf16_floor(ref_h)
    assert err_w <= 2.0 * _bf16_floor(ref_w)
    assert abs(loss.item() - ref_loss.item()) <= 2e-4 * ref_loss.item()


def test_cuda_peaked_logits_at_llama3_vocab_within_the_fp32_logits_bound():
    """A Llama-3-sized shape on the CUDA path: 2048 x 4096 x 128256, default chunks, gradients
    no worse than a plain fp32-logits loss's (test_fused_loss._fp32_logits_grads, computed here on
    the same inputs) and within 2.5e-3; float64 reference on the GPU."""
    from test_fused_loss import _fp32_logits_grads

    h, w, y = _peaked_inputs(2048, 4096, 128256, seed=3)
    h, w, y = h.detach().cuda().requires_grad_(), w.detach().cuda().requires_grad_(), y.cuda()
    loss = fused_linear_cross_entropy(h, w, y)
    loss.backward()
    ref_loss, (ref_h, ref_w, _) = _reference(h, w, None, y, "mean")
    fp32_h, fp32_w = _fp32_logits_grads(h, w, y)
    err_h, err_w = _rel_l2(h.grad, ref_h), _rel_l2(w.grad, ref_w)
    bound_h, bound_w = _rel_l2(fp32_h, ref_h), _rel_l2(fp32_w, ref_w)
    print(f"llama3 vocab: hidden {err_h:.3e} (fp32 logits {bound_h:.3e}), weight {err_w:.3e} (fp32 logits {bound_w:.3e})")
    assert err_h <= min(2.5e-3, bound_h) and err_w <= min(2.5e-3, bound_w)
    assert abs(loss.item() - ref_loss.item()) <= 1e-4 * ref_loss.item()
