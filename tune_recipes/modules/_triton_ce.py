"""Triton kernel for the fused loss's per-chunk step on CUDA: a program per row reads the row's
logits twice (fp32 log-sum-exp, then the gradient) and overwrites them in place with
``(softmax - onehot) * grad_scale``; no fp32 copy of the chunk is made.

The log-sum-exp keeps a running max and sum per lane and reduces across the block once per
row, not once per block: at 128k columns that was about a quarter faster on the H200
(scripts/profile_fused_ce.py, softmax part)."""

import functools

import torch

# (programs per multiprocessor, 0 = one program per row; elements per block; warps per
# program). scripts/profile_fused_ce.py times alternatives.
LAUNCH = (0, 4096, 16)


@functools.lru_cache(maxsize=None)
def available() -> bool:
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401  (the kernel needs it)
    except Exception:
        return False
    return torch.cuda.is_available()


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.lru_cache(maxsize=None)
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def ce_grad_inplace(logits_ptr, stride_row, target_ptr, loss_ptr, n_rows, n_cols, grad_scale,
                        BLOCK: tl.constexpr):
        for row in range(tl.program_id(0), n_rows, tl.num_programs(0)):
            base = logits_ptr + row.to(tl.int64) * stride_row
            target = tl.load(target_ptr + row)
            # -1e30, not -inf: a lane that only ever sees masked (-inf) columns must not
            # compute exp(-inf - (-inf)) = NaN; its sum stays 0 and drops out below.
            lane_max = tl.full([BLOCK], -1e30, tl.float32)
            lane_sum = tl.zeros([BLOCK], tl.float32)
            for off in range(0, n_cols, BLOCK):
                cols = off + tl.arange(0, BLOCK)
                x = tl.load(base + cols, mask=cols < n_cols, other=-float("inf")).to(tl.float32)
                new_max = tl.maximum(lane_max, x)
                lane_sum = lane_sum * tl.exp(lane_max - new_max) + tl.exp(x - new_max)
                lane_max = new_max
            row_max = tl.max(lane_max, 0)
            lse = row_max + tl.log(tl.sum(lane_sum * tl.exp(lane_max - row_max), 0))
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


def softmax_grad_inplace(logits: torch.Tensor, target: torch.Tensor, grad_scale: float,
                         loss_out=None, launch=None):
    """Returns (per-row loss in fp32, written to ``loss_out`` if given; ``logits`` overwritten
    with its scaled gradient)."""
    assert logits.is_cuda and logits.dim() == 2 and logits.stride(1) == 1
    n_rows, n_cols = logits.shape
    per_sm, block, warps = launch or LAUNCH
    device = logits.device.index if logits.device.index is not None else torch.cuda.current_device()
    grid = n_rows if per_sm == 0 else min(n_rows, per_sm * _sm_count(device))
    loss = torch.empty(n_rows, dtype=torch.float32, device=logits.device) if loss_out is None else loss_out
    assert loss.dtype == torch.float32 and loss.is_contiguous() and loss.numel() == n_rows
    _kernel()[(max(1, grid),)](
        logits, logits.stride(0), target.contiguous(), loss, n_rows, n_cols, float(grad_scale),
        BLOCK=block, num_warps=warps,
    )
    return loss, logits
