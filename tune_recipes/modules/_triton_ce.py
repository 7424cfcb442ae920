"""Triton kernels of the fused loss on CUDA.

``softmax_grad_inplace``, the per-chunk step: a program per row reads the row's logits twice
(log-sum-exp, then the gradient) and writes ``(softmax - onehot) * grad_scale`` over them, in
place; no other copy of the chunk is made. In split mode (what the loss uses) the target's entry
is written as 0 and ``(softmax[target] - 1) * grad_scale`` goes to a per-row fp32 coefficient
instead, with ``coef * W[target]`` written as the row's fp32 start of the hidden gradient.
``add_target_rows`` then adds ``coef * h`` to the weight gradient, summed per label in fp32
(tune_recipes/modules/loss.py says why).

The logits arrive in the model's dtype (bf16: the GEMM's bf16 output), but the one logit that
matters most is not taken from them: with ``hidden`` given, each program first recomputes its
row's target logit as an fp32 dot product ``h . W[target]`` (+ bias) and uses that value in the
log-sum-exp, the loss and the target coefficient. On a trained LM's peaked logits the target's
rounding to bf16 was what doubled the gradient error; the other logits' roundings cost little
(loss.py gives the numbers).

The log-sum-exp keeps a running max and sum per lane and reduces across the block once per
row, not once per block: at 128k columns that is about a quarter faster on the H200. It takes
one exponential per element, not two.
"""

import functools
import os

import torch

# (programs per multiprocessor, 0 = one program per row; elements per block; warps per
# program): the fastest of the layouts timed on an H200 at a 128256-column vocabulary.
LAUNCH = (0, 4096, 16)


@functools.lru_cache(maxsize=None)
def available() -> bool:
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401  (the kernel needs it)
    except Exception:
        return False
    return torch.cuda.is_available()


def _on_kernel_device(t: torch.Tensor) -> bool:
    """CUDA, or any device under Triton's interpreter (TRITON_INTERPRET=1: the CPU tests)."""
    return t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.lru_cache(maxsize=None)
def _kernel():
    import triton
    import triton.language as tl

    # NOTE: n_rows is not specialized. Triton compiles a variant per value class of each integer
    # argument (== 1, divisible by 16); the row count of a chunk changes with every batch of
    # variable-length data, and each new class cost a compile of 0.4-0.9 s in the middle of a
    # training run. It only bounds the row loop, where specializing gains nothing.
    @triton.jit(do_not_specialize=["n_rows"])
    def ce_grad(logits_ptr, stride_row, target_ptr, loss_ptr, coef_ptr, w_ptr, w_stride, h_ptr,
                h_stride, bias_ptr, hid_ptr, hid_stride, dim, n_rows, n_cols, grad_scale,
                BLOCK: tl.constexpr, SPLIT_TARGET: tl.constexpr, EXACT_TARGET: tl.constexpr,
                HAS_BIAS: tl.constexpr, HIDDEN_TERM: tl.constexpr):
        for row in range(tl.program_id(0), n_rows, tl.num_programs(0)):
            base = logits_ptr + tl.cast(row, tl.int64) * stride_row
            target = tl.load(target_ptr + row)
            in_range = (target >= 0) & (target < n_cols)
            wbase = w_ptr + tl.cast(target, tl.int64) * w_stride
            if EXACT_TARGET:
                # The target's logit in fp32, h . W[target] (+ bias), not its stored rounding.
                hbase = h_ptr + tl.cast(row, tl.int64) * h_stride
                acc = tl.zeros([BLOCK], tl.float32)
                for off in range(0, dim, BLOCK):
                    dcols = off + tl.arange(0, BLOCK)
                    dmask = (dcols < dim) & in_range
                    acc += (tl.load(wbase + dcols, mask=dmask, other=0.0).to(tl.float32)
                            * tl.load(hbase + dcols, mask=dmask, other=0.0).to(tl.float32))
                x_target = tl.sum(acc, 0)
                if HAS_BIAS:
                    x_target += tl.load(bias_ptr + target, mask=in_range, other=0.0).to(tl.float32)
            else:
                x_target = tl.load(base + target, mask=in_range, other=0.0).to(tl.float32)
            # -1e30, not -inf: a lane that only ever sees masked (-inf) columns must not
            # compute exp(-inf - (-inf)) = NaN; its sum stays 0 and drops out below.
            lane_max = tl.full([BLOCK], -1e30, tl.float32)
            lane_sum = tl.zeros([BLOCK], tl.float32)
            for off in range(0, n_cols, BLOCK):
                cols = off + tl.arange(0, BLOCK)
                x = tl.load(base + cols, mask=cols < n_cols, other=-float("inf")).to(tl.float32)
                if EXACT_TARGET:
                    x = tl.where(cols == target, x_target, x)
                # One exponential per element: exp(-|x - max|) rescales whichever side is lower.
                d = x - lane_max
                e = tl.exp(-tl.abs(d))
                lane_sum = tl.where(d > 0, lane_sum * e + 1.0, lane_sum + e)
                lane_max = tl.maximum(lane_max, x)
            row_max = tl.max(lane_max, 0)
            lse = row_max + tl.log(tl.sum(lane_sum * tl.exp(lane_max - row_max), 0))
            tl.store(loss_ptr + row, lse - x_target)
            if SPLIT_TARGET:
                coef = (tl.exp(x_target - lse) - 1.0) * grad_scale
                tl.store(coef_ptr + row, coef)
                if HIDDEN_TERM:
                    # The row's target term of the hidden gradient, coef * W[target], in fp32:
                    # the hidden-gradient product then adds the rest on top of it.
                    obase = hid_ptr + tl.cast(row, tl.int64) * hid_stride
                    for off in range(0, dim, BLOCK):
                        dcols = off + tl.arange(0, BLOCK)
                        wv = tl.load(wbase + dcols, mask=(dcols < dim) & in_range, other=0.0).to(tl.float32)
                        tl.store(obase + dcols, coef * wv, mask=dcols < dim)
            for off in range(0, n_cols, BLOCK):
                cols = off + tl.arange(0, BLOCK)
                mask = cols < n_cols
                x = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32)
                g = tl.exp(x - lse) * grad_scale
                if SPLIT_TARGET:
                    g = tl.where(cols == target, 0.0, g)
                else:
                    g = tl.where(cols == target, tl.exp(x_target - lse) * grad_scale - grad_scale, g)
                tl.store(base + cols, g.to(logits_ptr.dtype.element_ty), mask=mask)

    return ce_grad


def softmax_grad_inplace(logits: torch.Tensor, target: torch.Tensor, grad_scale: float,
                         loss_out=None, launch=None, target_coef_out=None, weight=None,
                         hidden=None, bias=None, hidden_term_out=None):
    """Returns (per-row loss in fp32, written to ``loss_out`` if given; the logits' scaled
    gradient, written over ``logits`` in their dtype).

    With ``weight`` [V, D] and ``hidden`` [rows, D] (the rows whose logits these are), the
    target's logit is recomputed in fp32 as ``hidden[r] . weight[target[r]]`` (``+ bias[target[r]]``
    with ``bias``) and used instead of its stored value. With ``target_coef_out`` (fp32, one per
    row) the target's entry is split off: the gradient gets 0 there and ``target_coef_out`` gets
    ``(softmax[target] - 1) * grad_scale`` in fp32 (tune_recipes.modules.loss explains why).
    With ``weight`` and ``hidden_term_out`` [rows, D] fp32 as well, row r of ``hidden_term_out``
    gets ``coef[r] * weight[target[r]]``."""
    assert _on_kernel_device(logits) and logits.dim() == 2 and logits.stride(1) == 1
    n_rows, n_cols = logits.shape
    per_sm, block, warps = launch or LAUNCH
    if per_sm == 0:
        grid = n_rows
    else:
        device = logits.device.index if logits.device.index is not None else torch.cuda.current_device()
        grid = min(n_rows, per_sm * _sm_count(device))
    loss = torch.empty(n_rows, dtype=torch.float32, device=logits.device) if loss_out is None else loss_out
    assert loss.dtype == torch.float32 and loss.is_contiguous() and loss.numel() == n_rows
    split = target_coef_out is not None
    if split:
        assert (target_coef_out.dtype == torch.float32 and target_coef_out.is_contiguous()
                and target_coef_out.numel() == n_rows)
    exact = hidden is not None
    hidden_term = hidden_term_out is not None
    if exact or hidden_term:
        weight = weight if weight.stride(1) == 1 else weight.contiguous()
        assert weight.shape[0] == n_cols
    if exact:
        hidden = hidden if hidden.stride(1) == 1 else hidden.contiguous()
        assert hidden.shape == (n_rows, weight.shape[1])
        assert bias is None or (bias.is_contiguous() and bias.numel() == n_cols)
    else:
        assert bias is None
    if hidden_term:
        assert split and hidden_term_out.stride(1) == 1
        assert hidden_term_out.dtype == torch.float32 and hidden_term_out.shape == (n_rows, weight.shape[1])
    if n_rows:
        _kernel()[(max(1, grid),)](
            logits, logits.stride(0), target.contiguous(), loss,
            target_coef_out if split else loss,
            weight if weight is not None else loss, weight.stride(0) if weight is not None else 0,
            hidden if exact else loss, hidden.stride(0) if exact else 0,
            bias if bias is not None else loss,
            hidden_term_out if hidden_term else loss, hidden_term_out.stride(0) if hidden_term else 0,
            weight.shape[1] if weight is not None else 0, n_rows, n_cols, float(grad_scale), BLOCK=block,
            SPLIT_TARGET=split, EXACT_TARGET=exact, HAS_BIAS=bias is not None, HIDDEN_TERM=hidden_term,
            num_warps=warps,
        )
    return loss, logits


# Sorted rows per piece in add_target_rows: a program sums at most this many rows of one label
# directly, plus one partial sum per further piece the label spans (so a label that fills the
# batch, e.g. unmasked padding, is not summed row by row by a single program).
PIECE = 64


@functools.lru_cache(maxsize=None)
def _target_rows_kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def piece_partials(partial_ptr, h_ptr, h_stride, rows_ptr, coef_ptr, seg_end_ptr, dim,
                       PIECE: tl.constexpr, BLOCK_D: tl.constexpr):
        # Piece b's share of the label its first sorted row belongs to: the sum of coef * h over
        # the piece's rows of that label (only read when the label started in an earlier piece).
        b = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        mask = cols < dim
        first = b * PIECE
        end = tl.minimum(tl.load(seg_end_ptr + first), first + PIECE)
        acc = tl.zeros([BLOCK_D], tl.float32)
        for j in range(first, end):
            row = tl.load(rows_ptr + j).to(tl.int64)
            acc += tl.load(coef_ptr + j) * tl.load(h_ptr + row * h_stride + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(partial_ptr + tl.cast(b, tl.int64) * dim + cols, acc, mask=mask)

    @triton.jit
    def label_rows(gw_ptr, gw_stride, n_labels, h_ptr, h_stride, sorted_labels_ptr, rows_ptr,
                   coef_ptr, seg_end_ptr, starts_ptr, partial_ptr, dim,
                   PIECE: tl.constexpr, BLOCK_D: tl.constexpr):
        # A program per (sorted position, column block); only a label's first sorted row does
        # work: its rows in this piece directly, then the partial sums of the pieces it goes on
        # into, in order (deterministic), added to the label's weight-gradient row and rounded
        # once. Labels outside [0, n_labels) are never written (the caller asserts on them).
        i = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        mask = cols < dim
        is_start = tl.load(starts_ptr + i) != 0
        end = tl.where(is_start, tl.load(seg_end_ptr + i), i)
        piece = i // PIECE
        acc = tl.zeros([BLOCK_D], tl.float32)
        for j in range(i, tl.minimum(end, (piece + 1) * PIECE)):
            row = tl.load(rows_ptr + j).to(tl.int64)
            acc += tl.load(coef_ptr + j) * tl.load(h_ptr + row * h_stride + cols, mask=mask, other=0.0).to(tl.float32)
        for b in range(piece + 1, (end + PIECE - 1) // PIECE):
            acc += tl.load(partial_ptr + tl.cast(b, tl.int64) * dim + cols, mask=mask, other=0.0)
        label = tl.load(sorted_labels_ptr + i).to(tl.int64)
        write = mask & is_start & (label >= 0) & (label < n_labels)
        ptrs = gw_ptr + label * gw_stride + cols
        g = tl.load(ptrs, mask=write, other=0.0).to(tl.float32)
        tl.store(ptrs, (g + acc).to(gw_ptr.dtype.element_ty), mask=write)

    return piece_partials, label_rows


def add_target_rows(grad_weight: torch.Tensor, hidden: torch.Tensor, rows: torch.Tensor,
                    labels: torch.Tensor, coef: torch.Tensor) -> None:
    """grad_weight[labels[t]] += coef[t] * hidden[rows[t]] for every t, summed per label in fp32
    and rounded once per touched row; deterministic (fixed summation order) and without a host
    sync. Labels are sorted; a label's rows are summed by its first sorted row's program, at
    most PIECE of them directly and the rest as per-piece partial sums (a first launch)."""
    n = labels.numel()
    if n == 0:
        return
    assert _on_kernel_device(grad_weight) and grad_weight.stride(1) == 1
    hidden = hidden if hidden.stride(1) == 1 else hidden.contiguous()
    sorted_labels, order = torch.sort(labels, stable=True)
    positions = torch.arange(n, device=labels.device)
    starts = torch.ones(n, dtype=torch.bool, device=labels.device)
    starts[1:] = sorted_labels[1:] != sorted_labels[:-1]
    # Each position's label ends at the next start (or n): a reverse running minimum over the
    # start positions that follow it.
    next_starts = torch.full((n,), n, dtype=torch.long, device=labels.device)
    next_starts[:-1] = torch.where(starts[1:], positions[1:], n)
    seg_end = next_starts.flip(0).cummin(0).values.flip(0).contiguous()
    dim = grad_weight.shape[1]
    block = 1024 if dim >= 1024 else max(16, 1 << (dim - 1).bit_length())
    n_pieces = -(-n // PIECE)
    rows_sorted = rows.index_select(0, order).contiguous()
    coef_sorted = coef.index_select(0, order).float().contiguous()
    partial = torch.empty(n_pieces, dim, dtype=torch.float32, device=grad_weight.device)
    piece_partials, label_rows = _target_rows_kernels()
    col_blocks = -(-dim // block)
    piece_partials[(n_pieces, col_blocks)](partial, hidden, hidden.stride(0), rows_sorted, coef_sorted,
                                           seg_end, dim, PIECE=PIECE, BLOCK_D=block, num_warps=4)
    label_rows[(n, col_blocks)](grad_weight, grad_weight.stride(0), grad_weight.shape[0], hidden,
                                hidden.stride(0), sorted_labels, rows_sorted, coef_sorted, seg_end,
                                starts.to(torch.int8), partial, dim, PIECE=PIECE, BLOCK_D=block,
                                num_warps=4)
