"""The fused loss on CUDA (Triton kernel path) against a float64 reference."""

import pytest
import torch

from test_fused_loss import _inputs, _reference, _rel_l2
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
