"""Triton kernel for the fused loss's per-chunk step on CUDA: one program per row reads the
row's logits twice (fp32 log-sum-exp, then the gradient) and overwrites them in place with
``(softmax - onehot) * grad_scale``; no fp32 copy of the chunk is made."""

import functools

import torch


@functools.lru_cache(maxsize=None)
def available() -> bool:
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401  (the kernel needs it)
    except Exception:
        return False
    return torch.cuda.is_available()


@functools.lru_cache(maxsize=None)
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def ce_grad_inplace(logits_ptr, stride_row, target_ptr, loss_ptr, n_cols, grad_scale,
                        BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        base = logits_ptr + row * stride_row
        target = tl.load(target_ptr + row)
        run_max = -float("inf")
        run_sum = 0.0
        for off in range(0, n_cols, BLOCK):
            cols = off + tl.arange(0, BLOCK)
            x = tl.load(base + cols, mask=cols < n_cols, other=-float("inf")).to(tl.float32)
            new_max = tl.maximum(run_max, tl.max(x, 0))
            run_sum = run_sum * tl.exp(run_max - new_max) + tl.sum(tl.exp(x - new_max), 0)
            run_max = new_max
        lse = run_max + tl.log(run_sum)
        x_target = tl.load(base + target).to(tl.float32)
        tl.store(loss_ptr + row, lse - x_target)
        for off in range(0, n_cols, BLOCK):
            cols = off + tl.arange(0, BLOCK)
            mask = cols < n_cols
            x = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32)
            g = tl.exp(x - lse) * grad_scale
            g = tl.where(cols == target, g - grad_scale, g)
            tl.store(base + cols, g.to(logits_ptr.dtype.element_ty), mask=mask)

    return ce_grad_inplace


def softmax_grad_inplace(logits: torch.Tensor, target: torch.Tensor, grad_scale: float):
    """Returns (per-row loss in fp32, ``logits`` overwritten with its scaled gradient)."""
    assert logits.is_cuda and logits.dim() == 2 and logits.stride(1) == 1
    n_rows, n_cols = logits.shape
    loss = torch.empty(n_rows, dtype=torch.float32, device=logits.device)
    _kernel()[(n_rows,)](
        logits, logits.stride(0), target.contiguous(), loss, n_cols, float(grad_scale),
        BLOCK=4096, num_warps=16,
    )
    return loss, logits
