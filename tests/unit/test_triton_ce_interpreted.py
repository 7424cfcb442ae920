"""The fused loss's Triton kernels (tune_recipes/modules/_triton_ce.py) on the CPU, through
Triton's interpreter (TRITON_INTERPRET=1), against the torch path and float64 sums. Runs where
Triton is installed (the GPU machine; a CPU machine with ``pip install triton``), in a child
process so the interpreted kernels never mix with compiled ones; skipped elsewhere (CI's CPU
install has no Triton: the GPU tests in test_fused_loss_gpu.py cover the compiled kernels).

Narrow outputs are fp16 here, not bf16: Triton 3.6's interpreter rounds fp32 to bf16 wrongly
when the rounding carries into the exponent (1.9969 -> 1.0, not 2.0); the kernels are
dtype-generic, and bf16 is covered on the GPU."""

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.unit


def _run(case: str) -> None:
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    import numpy
    import triton

    if (tuple(int(x) for x in numpy.__version__.split(".")[:2]) >= (2, 4)
            and tuple(int(x) for x in triton.__version__.split(".")[:2]) <= (3, 6)):
        # Triton 3.6's interpreter turns 1-element arrays into Python ints, which numpy 2.4
        # refuses ("only 0-dimensional arrays can be converted"): every kernel fails there.
        pytest.skip(f"Triton {triton.__version__}'s interpreter does not run on numpy {numpy.__version__} (< 2.4 does)")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, __file__, case], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.mark.parametrize("case", ["split_softmax", "strided_rows", "target_rows"])
def test_kernel_under_the_interpreter(case):
    _run(case)


def split_softmax():
    """Split mode with the target's logit recomputed from hidden, weight and bias, and the
    hidden term, on fp16 and fp32 logits (the gradient written over them), against the torch
    path given the same exact target logits; a stored target logit far off changes nothing."""
    from tune_recipes.modules import _triton_ce
    from tune_recipes.modules.loss import _softmax_grad_torch, target_logits

    v, n, d = 3000, 6, 40
    g = torch.Generator().manual_seed(0)
    weight = (torch.randn(v, d, generator=g) / d**0.5).bfloat16()
    target = torch.randint(0, v, (n,), generator=g)
    target[-1] = v - 1
    wy = weight[target].float()
    margin = torch.linspace(0, 20, n)
    hidden = (2.5 * torch.randn(n, d, generator=g) + (margin / (wy * wy).sum(1))[:, None] * wy).bfloat16()
    bias = torch.randn(v, generator=g).bfloat16()
    exact = target_logits(hidden, weight, target, bias)
    for dtype, rtol in ((torch.float16, 2**-10), (torch.float32, 1e-5)):
        logits = (hidden.float() @ weight.float().t() + bias.float()).to(dtype)
        logits[torch.arange(n), target] += 0.25  # the stored target logit must not be used
        coef_t = torch.empty(n)
        loss_t, grad_t = _softmax_grad_torch(logits.clone(), target, 0.37, dtype, coef_t, exact)
        coef_k, loss_k, term_k = torch.empty(n), torch.empty(n), torch.empty(n, d)
        buf = logits.clone()
        _, grad_k = _triton_ce.softmax_grad_inplace(buf, target, 0.37, loss_out=loss_k,
                                                    target_coef_out=coef_k, weight=weight,
                                                    hidden=hidden, bias=bias, hidden_term_out=term_k,
                                                    launch=(0, 1024, 4))
        assert grad_k.data_ptr() == buf.data_ptr() and grad_k.dtype == dtype
        torch.testing.assert_close(loss_k, loss_t, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(coef_k, coef_t, rtol=1e-5, atol=4e-6)
        torch.testing.assert_close(grad_k.float(), grad_t.float(), rtol=rtol, atol=1e-7)
        assert torch.count_nonzero(grad_k[torch.arange(n), target]) == 0
        torch.testing.assert_close(term_k, coef_k[:, None] * weight[target].float(), rtol=0, atol=0)


def strided_rows():
    """Hidden and weight rows with row strides other than D and D over several blocks of the
    kernel (a block of 16: the dot product and the hidden term take 3 passes, a masked tail),
    split mode without bias, against the torch path."""
    from tune_recipes.modules import _triton_ce
    from tune_recipes.modules.loss import _softmax_grad_torch, target_logits

    v, n, d = 700, 5, 40
    g = torch.Generator().manual_seed(2)
    w0 = (torch.randn(v, d, generator=g) / d**0.5).bfloat16()
    target = torch.randint(0, v, (n,), generator=g)
    h0 = (2.5 * torch.randn(n, d, generator=g) + 3.0 * w0[target].float()).bfloat16()
    hidden = torch.zeros(n, d + 8, dtype=torch.bfloat16)[:, :d].copy_(h0)
    weight = torch.zeros(v, d + 16, dtype=torch.bfloat16)[:, :d].copy_(w0)
    logits = hidden.float() @ weight.float().t()
    coef_t = torch.empty(n)
    loss_t, grad_t = _softmax_grad_torch(logits.clone(), target, 0.5, torch.float32, coef_t,
                                         target_logits(h0, w0, target))
    coef_k, loss_k, term_k = torch.empty(n), torch.empty(n), torch.empty(n, d)
    _, grad_k = _triton_ce.softmax_grad_inplace(logits.clone(), target, 0.5, loss_out=loss_k,
                                                target_coef_out=coef_k, weight=weight, hidden=hidden,
                                                hidden_term_out=term_k, launch=(0, 16, 1))
    torch.testing.assert_close(loss_k, loss_t, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(coef_k, coef_t, rtol=1e-5, atol=4e-6)
    torch.testing.assert_close(grad_k, grad_t, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(term_k, coef_k[:, None] * w0[target].float(), rtol=0, atol=0)


def target_rows():
    """add_target_rows against a float64 scatter-add: one label filling several pieces (its sum
    goes through the per-piece partials), labels at 0 and V-1, a row map that skips rows,
    dims that are not a multiple of the column block, an out-of-range label never written."""
    from test_fused_loss import _assert_target_rows_added
    from tune_recipes.modules import _triton_ce

    g = torch.Generator().manual_seed(1)
    n, v, d = 3 * _triton_ce.PIECE + 7, 50, 37
    labels = torch.randint(0, v, (n,), generator=g)
    labels[: 2 * _triton_ce.PIECE + 5] = 17  # spans three pieces once sorted
    labels[-1], labels[-2] = 0, v - 1
    rows = torch.randperm(2 * n, generator=g)[:n]
    hidden = torch.randn(2 * n, d, generator=g).bfloat16()
    coef = torch.randn(n, generator=g)
    for dtype in (torch.float32, torch.float16):
        before = torch.randn(v, d, generator=g).to(dtype)
        gw = before.clone()
        _triton_ce.add_target_rows(gw, hidden, rows, labels, coef)
        _assert_target_rows_added(gw, before, labels, rows, hidden, coef)
    # Out of range: nothing written (the loss asserts on such labels before it gets here).
    gw = torch.zeros(v + 2, d)
    inner = gw[1:v + 1]
    _triton_ce.add_target_rows(inner, hidden, rows[:3], torch.tensor([-1, v, 3]), coef[:3])
    assert torch.count_nonzero(gw[0]) == 0 and torch.count_nonzero(gw[v + 1]) == 0
    assert torch.count_nonzero(gw[4]) > 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # test_fused_loss's helpers
    globals()[sys.argv[1]]()
