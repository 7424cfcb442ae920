"""Triton kernel for the fused loss's per-chunk step on CUDA: a program per row reads the row's
logits twice (log-sum-exp, then the gradient) and writes ``(softmax - onehot) * grad_scale``
over them, in place; no other copy of the chunk is made.

The logits arrive in fp32 (the GEMM's fp32 output: rounding them to bf16 first doubled the
gradient error on peaked, trained-LM-like logits) and the gradient leaves in the dtype the two
gradient products want (bf16 for bf16 models). It is written into the first half of each fp32
row's bytes, so the gradient is a [rows, V] view with a row stride of 2V elements: no second
buffer. That is safe because a block's bf16 stores land on fp32 elements at half its column
offset, which this program has already read (a barrier orders the block's own loads first).

The log-sum-exp keeps a running max and sum per lane and reduces across the block once per
row, not once per block: at 128k columns that was about a quarter faster on the H200
(scripts/profile_fused_ce.py, softmax part). It takes one exponential per element, not two.
"""

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
    def ce_grad(logits_ptr, stride_row, grad_ptr, grad_stride_row, target_ptr, loss_ptr, coef_ptr,
                w_ptr, w_stride, hid_ptr, hid_stride, dim, n_rows, n_cols, grad_scale,
                BLOCK: tl.constexpr, NARROWING: tl.constexpr, SPLIT_TARGET: tl.constexpr,
                HIDDEN_TERM: tl.constexpr):
        for row in range(tl.program_id(0), n_rows, tl.num_programs(0)):
            base = logits_ptr + row.to(tl.int64) * stride_row
            gbase = grad_ptr + row.to(tl.int64) * grad_stride_row
            target = tl.load(target_ptr + row)
            # -1e30, not -inf: a lane that only ever sees masked (-inf) columns must not
            # compute exp(-inf - (-inf)) = NaN; its sum stays 0 and drops out below.
            lane_max = tl.full([BLOCK], -1e30, tl.float32)
            lane_sum = tl.zeros([BLOCK], tl.float32)
            for off in range(0, n_cols, BLOCK):
                cols = off + tl.arange(0, BLOCK)
                x = tl.load(base + cols, mask=cols < n_cols, other=-float("inf")).to(tl.float32)
                # One exponential per element: exp(-|x - max|) rescales whichever side is lower.
                d = x - lane_max
                e = tl.exp(-tl.abs(d))
                lane_sum = tl.where(d > 0, lane_sum * e + 1.0, lane_sum + e)
                lane_max = tl.maximum(lane_max, x)
            row_max = tl.max(lane_max, 0)
            lse = row_max + tl.log(tl.sum(lane_sum * tl.exp(lane_max - row_max), 0))
            x_target = tl.load(base + target).to(tl.float32)
            tl.store(loss_ptr + row, lse - x_target)
            if SPLIT_TARGET:
                coef = (tl.exp(x_target - lse) - 1.0) * grad_scale
                tl.store(coef_ptr + row, coef)
                if HIDDEN_TERM:
                    # The row's target term of the hidden gradient, coef * W[target], in fp32:
                    # the hidden-gradient product then adds the rest on top of it.
                    wbase = w_ptr + target.to(tl.int64) * w_stride
                    hbase = hid_ptr + row.to(tl.int64) * hid_stride
                    for off in range(0, dim, BLOCK):
                        dcols = off + tl.arange(0, BLOCK)
                        wv = tl.load(wbase + dcols, mask=dcols < dim, other=0.0).to(tl.float32)
                        tl.store(hbase + dcols, coef * wv, mask=dcols < dim)
            for off in range(0, n_cols, BLOCK):
                cols = off + tl.arange(0, BLOCK)
                mask = cols < n_cols
                x = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32)
                g = tl.exp(x - lse) * grad_scale
                if SPLIT_TARGET:
                    g = tl.where(cols == target, 0.0, g)
                else:
                    g = tl.where(cols == target, g - grad_scale, g)
                if NARROWING:
                    # NOTE: this barrier is what makes writing narrower values over the row
                    # safe: every thread has loaded this block before any thread overwrites
                    # the front half of it. Earlier blocks were read in earlier iterations.
                    tl.debug_barrier()
                tl.store(gbase + cols, g.to(grad_ptr.dtype.element_ty), mask=mask)

    return ce_grad


def softmax_grad_inplace(logits: torch.Tensor, target: torch.Tensor, grad_scale: float,
                         loss_out=None, launch=None, grad_dtype=None, target_coef_out=None,
                         weight=None, hidden_term_out=None):
    """Returns (per-row loss in fp32, written to ``loss_out`` if given; the logits' scaled
    gradient in ``grad_dtype``, default the logits' dtype).

    With ``target_coef_out`` (fp32, one per row) the target's entry is split off: the gradient
    gets 0 there and ``target_coef_out`` gets ``(softmax[target] - 1) * grad_scale`` in fp32
    (tune_recipes.modules.loss explains why). With ``weight`` [V, D] and ``hidden_term_out``
    [rows, D] fp32 as well, row r of ``hidden_term_out`` gets ``coef[r] * weight[target[r]]``.

    The gradient overwrites ``logits``: with the same dtype it is ``logits`` itself; with a
    narrower one (fp32 logits, bf16 gradient) it is a [rows, V] view of the same memory whose
    rows start where the logits' rows start (row stride in elements: 4/2 times the logits')."""
    assert logits.is_cuda and logits.dim() == 2 and logits.stride(1) == 1
    n_rows, n_cols = logits.shape
    grad_dtype = grad_dtype or logits.dtype
    if grad_dtype == logits.dtype:
        grad = logits
    else:
        ratio = logits.element_size() // torch.empty((), dtype=grad_dtype).element_size()
        assert ratio * torch.empty((), dtype=grad_dtype).element_size() == logits.element_size()
        grad = logits.view(grad_dtype)[:, :n_cols]
        assert grad.data_ptr() == logits.data_ptr() and grad.stride(0) == ratio * logits.stride(0)
    per_sm, block, warps = launch or LAUNCH
    device = logits.device.index if logits.device.index is not None else torch.cuda.current_device()
    grid = n_rows if per_sm == 0 else min(n_rows, per_sm * _sm_count(device))
    loss = torch.empty(n_rows, dtype=torch.float32, device=logits.device) if loss_out is None else loss_out
    assert loss.dtype == torch.float32 and loss.is_contiguous() and loss.numel() == n_rows
    split = target_coef_out is not None
    if split:
        assert (target_coef_out.dtype == torch.float32 and target_coef_out.is_contiguous()
                and target_coef_out.numel() == n_rows)
    hidden_term = hidden_term_out is not None
    if hidden_term:
        assert split and weight is not None and weight.stride(1) == 1 and hidden_term_out.stride(1) == 1
        assert hidden_term_out.dtype == torch.float32 and hidden_term_out.shape == (n_rows, weight.shape[1])
    if n_rows:
        _kernel()[(max(1, grid),)](
            logits, logits.stride(0), grad, grad.stride(0), target.contiguous(), loss,
            target_coef_out if split else loss,
            weight if hidden_term else loss, weight.stride(0) if hidden_term else 0,
            hidden_term_out if hidden_term else loss, hidden_term_out.stride(0) if hidden_term else 0,
            weight.shape[1] if hidden_term else 0, n_rows, n_cols, float(grad_scale), BLOCK=block,
            NARROWING=grad is not logits, SPLIT_TARGET=split, HIDDEN_TERM=hidden_term, num_warps=warps,
        )
    return loss, grad


@functools.lru_cache(maxsize=None)
def _target_rows_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def target_rows(gw_ptr, gw_stride, h_ptr, h_stride, sorted_labels_ptr, rows_ptr, coef_ptr,
                    seg_end_ptr, dim, BLOCK_D: tl.constexpr):
        # A program per (sorted position, column block). Only a segment's first position does
        # work: it sums coef * h over the segment's rows in fp32 and adds that to the label's
        # row of the weight gradient, rounding once. The others loop over nothing and store
        # nothing (their seg_end is their own position).
        i = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        mask = cols < dim
        end = tl.load(seg_end_ptr + i)
        acc = tl.zeros([BLOCK_D], tl.float32)
        for j in range(i, end):
            row = tl.load(rows_ptr + j).to(tl.int64)
            c = tl.load(coef_ptr + j)
            acc += c * tl.load(h_ptr + row * h_stride + cols, mask=mask, other=0.0).to(tl.float32)
        label = tl.load(sorted_labels_ptr + i).to(tl.int64)
        write = mask & (end > i)
        g = tl.load(gw_ptr + label * gw_stride + cols, mask=write, other=0.0).to(tl.float32)
        tl.store(gw_ptr + label * gw_stride + cols, (g + acc).to(gw_ptr.dtype.element_ty), mask=write)

    return target_rows


def add_target_rows(grad_weight: torch.Tensor, hidden: torch.Tensor, rows: torch.Tensor,
                    labels: torch.Tensor, coef: torch.Tensor) -> None:
    """grad_weight[labels[t]] += coef[t] * hidden[rows[t]] for every t, summed per label in fp32
    and rounded once per touched row, in one launch after a sort; deterministic (a label's rows
    are summed in sorted order by one program) and without a host sync."""
    n = labels.numel()
    if n == 0:
        return
    assert grad_weight.is_cuda and grad_weight.stride(1) == 1 and hidden.stride(1) == 1
    sorted_labels, order = torch.sort(labels)
    positions = torch.arange(n, device=labels.device)
    starts = torch.ones(n, dtype=torch.bool, device=labels.device)
    starts[1:] = sorted_labels[1:] != sorted_labels[:-1]
    # A segment start's end is the next start (or n): a reverse running minimum over the
    # start positions that follow it. Other positions get end = themselves (no work).
    next_starts = torch.full((n,), n, dtype=torch.long, device=labels.device)
    next_starts[:-1] = torch.where(starts[1:], positions[1:], n)
    seg_end = next_starts.flip(0).cummin(0).values.flip(0)
    seg_end = torch.where(starts, seg_end, positions)
    dim = grad_weight.shape[1]
    block = 1024
    _target_rows_kernel()[(n, -(-dim // block))](
        grad_weight, grad_weight.stride(0), hidden, hidden.stride(0), sorted_labels,
        rows.index_select(0, order).contiguous(), coef.index_select(0, order).float().contiguous(),
        seg_end.contiguous(), dim, BLOCK_D=block, num_warps=4,
    )

