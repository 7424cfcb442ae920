"""Fused output projection + cross-entropy that never materializes the full logits.

For hidden states H [N, D], the output weight W [V, D] (optional bias b [V]) and labels y [N],
the loss is CE(H W^T + b, y) over the rows whose label is not ``ignore_index``. The rows are
processed in chunks; each chunk computes its logits (in the model's dtype), the log-sum-exp, its
loss and — in the same forward — its gradients w.r.t. H, W and b. Only the gradients survive the forward,
pre-multiplied by ``scaling`` (the factor the caller will multiply the loss by before
backward). Backward then multiplies them by ``grad_output / scaling``, which is exactly 1.0 in
the common case and then costs nothing.

Accuracy: a row's logit gradient is ``softmax - onehot``, and on a trained LM's peaked logits its
target entry, ``softmax[y] - 1``, dominates it. So the target is never taken from the rounded
logits and its term never rounded to bf16:
- the target's logit is recomputed in fp32 (``h . W[y]``, one dot product per row) and used in the
  log-sum-exp, the loss and ``coef = softmax[y] - 1``; the other logits stay bf16 (rounding the
  target's logit with them doubled the gradient error on peaked logits: 4.8e-3 vs 2.4e-3);
- the hidden gradient starts from ``coef * W[y]`` in fp32 and adds the rest's product before its
  one rounding; the weight gradient's chunk products accumulate only the rest, and ``coef * h``
  is summed per label in fp32 and added once after the chunks.
On the H200 at 8192 x 4096 x 128256 (docs/benchmarks.md) both gradients come within ~15% of
the bf16 rounding of the exact gradients on peaked logits: 1.89e-3 / 1.90e-3 against 1.66e-3
(1.66e-3 on near-uniform logits). Keeping all logits in fp32 as well gives 1.66e-3 at twice the
logits' memory and 3-4% more time; a plain fp32-logits loss without the target split gives
~2.3e-3 (tests/unit/test_fused_loss.py).

Backward rules (tests/unit/test_fused_loss.py covers each):
- ``scaling == 0`` with a non-zero grad_output raises: the saved gradients were zeroed in
  forward and cannot be recovered (no NaN is produced);
- ``grad_output == 0`` returns zero gradients, whatever ``scaling`` is;
- the multiply is out of place, so the saved gradients are never modified: ``backward`` with
  ``retain_graph=True`` twice accumulates exactly twice the gradients, and
  ``torch.autograd.grad`` works;
- a factor of exactly 1.0 returns the saved tensors themselves (no copy);
- the upstream gradient is read from the device (a host sync) unless the caller declared it
  (``declare_grad_output``; the recipes' step does);
- second derivatives (``create_graph=True``) raise instead of returning wrong numbers.
"""

from typing import Optional, Tuple, Union

import torch
from torch import nn

from tune_recipes.constants import CROSS_ENTROPY_IGNORE_INDEX

# Bytes of one chunk's logits: the loss's one large temporary (the chunk's gradient is written
# over it). Each chunk also reads the whole [V, D] weight for two products and re-reads and
# re-writes the whole weight gradient when W trains, so larger chunks are faster and smaller
# ones leaner: 0.6-0.8 ms a chunk at 128256 x 4096 on an H200. 160 MiB is 654 bf16 rows at
# V=128256: a forward+backward at 8192 x 4096 (30% of labels ignored) runs in 9 chunks within
# 1.2 GiB above its inputs, the weight gradient included (fp32 models: 327 rows a chunk).
# NOTE: the logits stay in the model's dtype on purpose. fp32 logits would need 320 MiB for the
# same 9 chunks (1.337 GiB) and 2-4% more time; what they would fix, the target's rounding, is
# fixed here by recomputing that one logit in fp32 (see above).
DEFAULT_CHUNK_BYTES = 160 * 1024**2


def _as_float(scaling: Union[float, int, torch.Tensor]) -> float:
    """A 0-dim tensor scale becomes one Python float, once, here at the boundary."""
    if isinstance(scaling, torch.Tensor):
        if scaling.numel() != 1:
            raise ValueError(f"scaling must be a scalar, got a tensor of shape {tuple(scaling.shape)}")
        return float(scaling.item())
    return float(scaling)


def wide_dtype(compute_dtype: torch.dtype) -> torch.dtype:
    """The dtype of the loss's per-row sums and target terms: at least fp32."""
    return torch.promote_types(compute_dtype, torch.float32)


def target_logits(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                  bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Each row's target logit, ``hidden[r] . weight[target[r]] (+ bias[target[r]])``, summed in
    at least fp32 and never rounded to the model's dtype (the torch path; the CUDA kernel
    computes the same dot products itself)."""
    wide = wide_dtype(hidden.dtype)
    x = (hidden.to(wide) * weight.index_select(0, target).to(wide)).sum(1)
    return x if bias is None else x + bias.index_select(0, target).to(wide)


def _softmax_grad_torch(logits: torch.Tensor, target: torch.Tensor, grad_scale: float,
                        grad_dtype: Optional[torch.dtype] = None,
                        target_coef_out: Optional[torch.Tensor] = None,
                        target_logit: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Reference path (CPU, or CUDA without Triton): per-row loss, and the logits' gradient
    ``(softmax - onehot) * grad_scale`` in ``grad_dtype`` (default: the logits' dtype). With
    ``target_logit`` (fp32 or wider) that value replaces each row's stored target logit. With
    ``target_coef_out`` the target's entry is split off as in the Triton kernel: 0 in the
    gradient, ``(softmax[target] - 1) * grad_scale`` in ``target_coef_out``. Like the kernel it
    uses ``logits`` as scratch: fp32 and wider logits are overwritten (bf16/fp16 ones are upcast
    into a new buffer); callers that need them afterwards pass a copy."""
    # fp32 at least (bf16 logits are upcast; fp64 stays fp64 for reference checks).
    lf = logits.to(wide_dtype(logits.dtype))
    rows = torch.arange(target.numel(), device=target.device)
    if target_logit is not None:
        lf[rows, target] = target_logit.to(lf.dtype)
    lse = torch.logsumexp(lf, dim=-1)
    loss_rows = lse - lf.gather(1, target[:, None]).squeeze(1)
    probs = torch.exp(lf.sub_(lse[:, None]))
    if target_coef_out is None:
        probs[rows, target] -= 1.0
    else:
        target_coef_out.copy_((probs[rows, target] - 1.0) * grad_scale)
        probs[rows, target] = 0.0
    probs.mul_(grad_scale)
    return loss_rows, probs.to(grad_dtype or logits.dtype)


def _uses_kernels(t: torch.Tensor, target_coef: torch.Tensor) -> bool:
    """Whether the chunk step and the target terms run as the Triton kernels: CUDA, fp32 target
    terms (bf16, fp16 or fp32 models) and Triton installed; otherwise the torch reference path."""
    if not (t.is_cuda and target_coef.dtype == torch.float32):
        return False
    from tune_recipes.modules import _triton_ce

    return _triton_ce.available()


def _softmax_grad(logits: torch.Tensor, target: torch.Tensor, grad_scale: float, loss_out: torch.Tensor,
                  target_coef_out: torch.Tensor, weight: torch.Tensor, hidden: torch.Tensor,
                  bias: Optional[torch.Tensor], hidden_term_out: Optional[torch.Tensor]):
    """With each row's target logit recomputed exactly from ``hidden`` and ``weight`` (+ ``bias``):
    writes the per-row losses to ``loss_out``, the split-off target terms to ``target_coef_out``
    and, if given, ``target_coef_out[r] * weight[target[r]]`` to ``hidden_term_out`` (the hidden
    gradient's target terms, fp32 or wider); returns the rest of the logits' gradient in the
    logits' dtype (on CUDA written over the logits)."""
    if _uses_kernels(logits, target_coef_out):
        from tune_recipes.modules import _triton_ce

        return _triton_ce.softmax_grad_inplace(logits, target, grad_scale, loss_out=loss_out,
                                               target_coef_out=target_coef_out, weight=weight,
                                               hidden=hidden, bias=bias, hidden_term_out=hidden_term_out)[1]
    loss_rows, grad = _softmax_grad_torch(logits, target, grad_scale, logits.dtype, target_coef_out,
                                          target_logits(hidden, weight, target, bias))
    loss_out.copy_(loss_rows)
    if hidden_term_out is not None:
        torch.mul(weight.index_select(0, target), target_coef_out[:, None], out=hidden_term_out)
    return grad


class _LogitsProduct:
    """``out = h @ weight.T (+ bias)`` in the model's dtype, rounded once, and ``hidden_grad``,
    the other product with the weight, ``out += grad_logits @ weight`` with ``out`` fp32 (it
    already holds the chunk's target terms, which must not be rounded): on CUDA the bf16 GEMMs
    do it directly (``torch.addmm(..., out_dtype=torch.float32)``, torch >= 2.11); on the CPU
    (no such kernel as of torch 2.13, and slow bf16 GEMMs) both products run on fp32 copies of
    the operands, which computes the same exact products."""

    def __init__(self, weight: torch.Tensor, out_dtype: torch.dtype):
        self.weight, self.out_dtype = weight, out_dtype
        self.direct = weight.dtype == out_dtype or weight.is_cuda
        self._upcast = None

    def _wide_weight(self) -> torch.Tensor:
        if self._upcast is None:  # once per call, not per chunk
            self._upcast = self.weight.to(self.out_dtype)
        return self._upcast

    def __call__(self, h: torch.Tensor, out: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        if not self.direct:
            # CPU, bf16/fp16: the same products in fp32, rounded once (CPU bf16 GEMMs without
            # native support ran ~5-10x slower than fp32 ones on the CI machine).
            wide = h.to(self.out_dtype) @ self._wide_weight().t()
            return out.copy_(wide if bias is None else wide.add_(bias))
        if bias is None:
            return torch.mm(h, self.weight.t(), out=out)
        # The bias inside the product: one rounding to the logits' dtype, not two.
        return torch.addmm(bias, h, self.weight.t(), out=out)

    def hidden_grad(self, grad_logits: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if w.dtype == self.out_dtype:
            return out.addmm_(grad_logits, w)
        if self.direct:
            return torch.addmm(out, grad_logits, w, out_dtype=self.out_dtype, out=out)
        return out.addmm_(grad_logits.to(self.out_dtype), self._wide_weight())


def _weight_grad_mm(acc: torch.Tensor, grad_logits: torch.Tensor, h: torch.Tensor, first: bool) -> None:
    """acc = grad_logits^T @ h on the first chunk (acc is uninitialized: no zero-fill and no
    read of it), acc += grad_logits^T @ h after. Accumulates in acc's dtype without a [V, D]
    temporary where the backend can (cuBLAS: bf16 inputs, fp32 output)."""
    a = grad_logits.t()
    narrow = (torch.bfloat16, torch.float16)
    if not acc.is_cuda and (acc.dtype in narrow or grad_logits.dtype in narrow):
        # CPU: in at least fp32 and rounded once into acc, as cuBLAS does (and 5-10x faster than
        # a CPU bf16 GEMM without native support, measured on the CI machine).
        wide = wide_dtype(acc.dtype)
        part = a.to(wide) @ h.to(wide)
        acc.copy_(part if first else part.add_(acc))
    elif acc.dtype == grad_logits.dtype:
        if first:
            torch.mm(a, h, out=acc)
        else:
            acc.addmm_(a, h)
    else:  # CUDA: bf16 inputs, fp32 accumulator
        if first:
            torch.mm(a, h, out_dtype=acc.dtype, out=acc)
        else:
            torch.addmm(acc, a, h, out_dtype=acc.dtype, out=acc)


def _add_target_terms(grad_weight: torch.Tensor, labels: torch.Tensor, coef: torch.Tensor,
                      hidden_rows, block_rows: int) -> None:
    """grad_weight[y_t] += coef_t * h_t for every valid row t: the target terms of the weight
    gradient, which the chunk products left out. Rows with the same label are summed in fp32
    first, so each touched row of grad_weight is rounded once (a label whose rows straddle
    blocks: once per block). ``hidden_rows(idx)`` gives the hidden states of valid rows ``idx``.

    Why apart: a row's gradient is dominated by its target entry, softmax - 1, while the rest
    is small. Summed through the chunks into a bf16 accumulator, that large term would be
    rounded again at every later chunk; kept apart, the accumulator only holds the small rest,
    and on peaked logits the weight gradient's error drops to the bf16 rounding of the result.

    This is the CPU path (CUDA: _triton_ce.add_target_rows, one launch, each row rounded once).
    No host sync: labels are sorted, equal labels share a segment id, and each block of sorted
    rows sums its segments. A block's unused segment slots repeat its last segment (label and
    sum), so duplicate index_put writes store identical values."""
    n, dim = labels.numel(), grad_weight.shape[1]
    if n == 0:
        return
    sorted_labels, order = torch.sort(labels, stable=True)
    segment = torch.zeros(n, dtype=torch.long, device=labels.device)
    segment[1:] = (sorted_labels[1:] != sorted_labels[:-1]).cumsum(0)
    wide = torch.promote_types(grad_weight.dtype, coef.dtype)
    for start in range(0, n, block_rows):
        stop = min(start + block_rows, n)
        m = stop - start
        idx = order[start:stop]
        local = segment[start:stop] - segment[start]
        terms = hidden_rows(idx).to(wide).mul_(coef.index_select(0, idx).to(wide)[:, None])
        # index_put_ with accumulate (not index_add_): deterministic on CUDA, so runs repeat bit
        # for bit.
        sums = torch.zeros(m, dim, dtype=wide, device=labels.device).index_put_((local,), terms, accumulate=True)
        del terms
        seg_labels = torch.empty(m, dtype=labels.dtype, device=labels.device).scatter_(
            0, local, sorted_labels[start:stop])
        # NOTE: slots past the block's last segment are filled with a copy of it; dropping this
        # would write uninitialized labels (or a stale row) into grad_weight.
        fill = torch.clamp(torch.arange(m, device=labels.device), max=local[-1])
        seg_labels, sums = seg_labels[fill], sums[fill]
        grad_weight[seg_labels] = sums.add_(grad_weight[seg_labels].to(wide)).to(grad_weight.dtype)


def _check_label_range(labels: torch.Tensor, vocab: int, ignore_index: int) -> None:
    """Every label that is not ignore_index must index the vocabulary: an out-of-range one would
    otherwise make the CUDA kernels read (and the target terms write) outside the weight and its
    gradient. On the CPU a clear error; on CUDA a device-side assert (no host sync)."""
    if labels.numel() == 0:
        return
    if labels.is_cuda:
        torch._assert_async(((labels >= 0) & (labels < vocab)).all(),
                            f"a label outside [0, {vocab}) that is not ignore_index={ignore_index}")
        return
    bad = labels[(labels < 0) | (labels >= vocab)]
    if bad.numel():
        raise ValueError(f"labels must be in [0, {vocab}) (the output weight's rows) or "
                         f"ignore_index={ignore_index}; got {bad[0].item()}")


# Chunks start at multiples of this many rows (when the chunk size allows it).
CHUNK_ROW_MULTIPLE = 16


def chunk_rows(n_rows: int, vocab: int, element_size: int, chunk_size: Optional[int] = None) -> int:
    """Rows per chunk: at most ``chunk_size`` (default: DEFAULT_CHUNK_BYTES of logits of
    ``element_size`` bytes), spread evenly so the last chunk is not a sliver (every chunk costs
    one weight-gradient pass), and a multiple of CHUNK_ROW_MULTIPLE wherever the limit is at
    least that.

    NOTE: keep the multiple. Each chunk hands the Triton kernel slices of per-row buffers
    (labels, losses, target terms) that start at the chunk's first row, and Triton compiles
    one variant per pointer alignment (16 bytes or not). With an arbitrary chunk size, the
    number of valid labels (which changes with every batch of variable-length or masked data)
    moved the chunk starts across alignments, and each new combination stalled training for a
    0.4-0.9 s compile; starts at multiples of 16 rows are 16-byte aligned for every dtype."""
    max_rows = chunk_size or max(1, DEFAULT_CHUNK_BYTES // (vocab * element_size))
    m = CHUNK_ROW_MULTIPLE
    if max_rows >= m:
        max_rows -= max_rows % m
    n_chunks = -(-n_rows // max_rows)
    rows = -(-n_rows // max(1, n_chunks))
    if max_rows >= m:
        rows = min(max_rows, -(-rows // m) * m)
    return rows


def _chunked_loss_and_grads(hidden, weight, bias, labels, ignore_index, reduction, scaling,
                            need_hidden, need_weight, need_bias, chunk_size, weight_grad_fp32=False,
                            num_valid=None):
    n_rows, dim = hidden.shape
    vocab = weight.shape[0]
    compute_dtype = hidden.dtype
    if weight.dtype != compute_dtype:
        raise TypeError(f"hidden is {hidden.dtype} but the output weight is {weight.dtype}")
    lg_dtype = wide_dtype(compute_dtype)  # per-row sums and target terms
    grad_bias = torch.zeros(vocab, dtype=lg_dtype, device=weight.device) if need_bias else None
    # Rows with ignored labels cost nothing: only the valid ones are gathered, a chunk at a
    # time. Their count sizes the chunks: given by the caller (recipes count the labels on the
    # CPU) it costs no host sync; otherwise nonzero() syncs once to learn it.
    valid = labels != ignore_index
    if num_valid is None:
        valid_idx = valid.nonzero().squeeze(1)
    else:
        valid_idx = torch.nonzero_static(valid, size=num_valid).squeeze(1)
        # A wrong count would silently drop or invent rows: check it on the device, no sync.
        torch._assert_async(valid.sum() == num_valid, "num_valid does not match the labels")
    n_valid = valid_idx.numel()
    all_valid = n_valid == n_rows
    denom = float(n_valid) if reduction == "mean" else 1.0
    grad_scale = scaling / denom if n_valid > 0 else 0.0

    # The weight gradient sums over every chunk. By default it accumulates in the weight's dtype
    # (one rounding per chunk, as autograd does for torchtune's chunked loss), but only the small
    # non-target part of each row's gradient goes through it (the target terms are added once,
    # in fp32, by _add_target_terms). With weight_grad_fp32=True it accumulates in fp32 and is
    # rounded once: a [V, D] fp32 buffer (2 GiB more at 128256 x 4096).
    acc_dtype = torch.promote_types(weight.dtype, torch.float32) if weight_grad_fp32 else weight.dtype
    if n_valid == 0:
        grad_hidden = torch.zeros_like(hidden) if need_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=weight.dtype, device=weight.device) if need_weight else None
        loss_sum = torch.zeros((), dtype=torch.float32, device=hidden.device)
        loss = loss_sum / denom if reduction == "mean" else loss_sum
        return loss, grad_hidden, grad_weight, (grad_bias.to(weight.dtype) if need_bias else None)
    # Written (not accumulated) by the first chunk, so it needs no zero-fill.
    grad_weight = torch.empty(weight.shape, dtype=acc_dtype, device=weight.device) if need_weight else None

    rows = chunk_rows(n_valid, vocab, hidden.element_size(), chunk_size)
    y_valid = labels if all_valid else labels.index_select(0, valid_idx)
    _check_label_range(y_valid, vocab, ignore_index)
    # Per-row losses (fp32, fp64 for fp64 inputs), summed once at the end: no per-chunk
    # reduction launches.
    loss_rows = torch.empty(n_valid, dtype=lg_dtype, device=hidden.device)
    # Each row's target term, (softmax[target] - 1) * grad_scale, kept apart from the rest of
    # the row's gradient (see _add_target_terms).
    target_coef = torch.empty(n_valid, dtype=lg_dtype, device=hidden.device)
    # The chunk's hidden gradient before its one rounding (a [rows, D] fp32 scratch).
    hidden_grad_buf = torch.empty(min(rows, n_valid), dim, dtype=lg_dtype, device=hidden.device) if need_hidden else None
    # One logits buffer serves every chunk (the chunk's gradient is written over it on CUDA).
    logits_buf = torch.empty(min(rows, n_valid), vocab, dtype=compute_dtype, device=hidden.device)
    logits_mm = _LogitsProduct(weight, lg_dtype)
    # The weight as the kernel reads its rows (W[y] for the target logits and terms): made
    # row-contiguous once per call, not once per chunk (a [V, D] copy each time otherwise).
    weight_rows = weight if weight.stride(1) == 1 else weight.contiguous()
    # Every row written: no zero-fill. With ignored rows, the valid rows are gathered, a chunk
    # at a time, into a compact [n_valid, D] buffer whose slot then takes the chunk's hidden
    # gradient; the zero-filled [N, D] gradient is made after the loop, once the logits buffer
    # is free (so the ignored rows' zeros never sit beside the largest temporary).
    grad_hidden = torch.empty_like(hidden) if need_hidden and all_valid else None
    compact = None
    if not all_valid:
        compact = torch.empty(n_valid if need_hidden else min(rows, n_valid), dim, dtype=compute_dtype,
                              device=hidden.device)
    for start in range(0, n_valid, rows):
        stop = min(start + rows, n_valid)
        if all_valid:
            h = hidden[start:stop]
        else:
            idx = valid_idx[start:stop]
            slot = compact[start:stop] if need_hidden else compact[:stop - start]
            h = torch.index_select(hidden, 0, idx, out=slot)
        y = y_valid[start:stop]
        logits = logits_mm(h, out=logits_buf[:stop - start], bias=bias)
        coef = target_coef[start:stop]
        hidden_acc = hidden_grad_buf[:stop - start] if need_hidden else None
        grad_logits = _softmax_grad(logits, y, grad_scale, loss_rows[start:stop], coef, weight_rows, h, bias,
                                    hidden_acc)
        if need_bias:
            grad_bias += grad_logits.float().sum(0)
            grad_bias.index_put_((y,), coef.to(grad_bias.dtype), accumulate=True)
        if need_weight:
            # The rest of the rows' gradient; their target terms are added after the loop.
            _weight_grad_mm(grad_weight, grad_logits, h, first=start == 0)
        if need_hidden:
            # hidden_acc holds the target terms, coef * W[y], in fp32 (from _softmax_grad); the
            # rest's product goes on top; one rounding. Without ignored rows straight into the
            # gradient; with them into the slot whose gathered rows the products have consumed.
            logits_mm.hidden_grad(grad_logits, out=hidden_acc)
            (grad_hidden[start:stop] if all_valid else h).copy_(hidden_acc)
    # NOTE: the views too (h, slot, hidden_acc), or their buffers stay alive.
    del logits_buf, logits, grad_logits, h, logits_mm, hidden_grad_buf, hidden_acc, coef, weight_rows
    slot = None
    if need_weight:
        rows_of_valid = torch.arange(n_rows, device=hidden.device) if all_valid else valid_idx
        if _uses_kernels(hidden, target_coef):
            from tune_recipes.modules import _triton_ce

            _triton_ce.add_target_rows(grad_weight, hidden, rows_of_valid, y_valid, target_coef)
        else:
            _add_target_terms(grad_weight, y_valid, target_coef,
                              lambda idx: hidden.index_select(0, rows_of_valid.index_select(0, idx)),
                              block_rows=max(1, rows * vocab // (5 * dim)))
    if need_hidden and not all_valid:
        grad_hidden = torch.zeros_like(hidden).index_copy_(0, valid_idx, compact)
    del compact
    loss = loss_rows.sum() / denom
    if need_weight and grad_weight.dtype != weight.dtype:
        grad_weight = grad_weight.to(weight.dtype)
    return loss, grad_hidden, grad_weight, (grad_bias.to(weight.dtype) if need_bias else None)


class _FusedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, ignore_index, reduction, scaling, chunk_size,
                weight_grad_fp32, num_valid):
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        loss, g_h, g_w, g_b = _chunked_loss_and_grads(
            hidden, weight, bias, labels, ignore_index, reduction, scaling,
            need_hidden, need_weight, need_bias and bias is not None, chunk_size,
            weight_grad_fp32, num_valid,
        )
        ctx.scaling = scaling
        ctx.save_for_backward(g_h, g_w, g_b)
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        if torch.is_grad_enabled():
            raise RuntimeError(
                "FusedLinearCrossEntropy computes its gradients in forward and has no second "
                "derivative: backward with create_graph=True is not supported"
            )
        g_h, g_w, g_b = ctx.saved_tensors
        declared = getattr(ctx, "declared_grad_output", None)
        if declared is not None:
            # Set by declare_grad_output for this one backward; a second one (retain_graph)
            # reads the tensor again.
            ctx.declared_grad_output = None
            go = declared
            # Checked on the device, without a sync: a caller that declared a value and then
            # backwarded something else fails loudly instead of scaling the gradients wrongly.
            torch._assert_async(
                (grad_output.double() - declared).abs() <= _DECLARED_RTOL * abs(declared),
                "FusedLinearCrossEntropy: the gradient reaching the loss differs from the value "
                "given to declare_grad_output",
            )
        else:
            go = float(grad_output.item())
        if go == 0.0:
            # Chain rule: a zero upstream gradient gives zero gradients, whatever the scaling.
            zeros = [None if g is None else torch.zeros_like(g) for g in (g_h, g_w, g_b)]
            return (*zeros, None, None, None, None, None, None, None)
        if ctx.scaling == 0.0:
            raise RuntimeError(
                f"FusedLinearCrossEntropy was called with scaling=0, so its saved gradients are "
                f"zero, but backward received grad_output={go}: the unscaled gradients cannot be "
                "recovered. Pass the factor the loss is multiplied by before backward as scaling."
            )
        factor = go / ctx.scaling
        if factor == 1.0:
            # The common case (grad_output == scaling): hand out the saved tensors, no copy.
            return g_h, g_w, g_b, None, None, None, None, None, None, None
        # Out of place: the saved tensors stay intact for a retain_graph second backward.
        scaled = [None if g is None else g * factor for g in (g_h, g_w, g_b)]
        return (*scaled, None, None, None, None, None, None, None)


# How far the gradient that reaches the loss may differ from the declared value: autograd rounds
# ``mean_loss * factor``'s gradient to the loss's dtype once (fp32: 6e-8 relative).
_DECLARED_RTOL = 1e-6


def declare_grad_output(loss: torch.Tensor, grad_output: float) -> bool:
    """Tell the fused loss's next backward the gradient that will reach ``loss``, so that it
    need not read it from the device. Returns False (and does nothing) when ``loss`` is not the
    fused loss's own output, e.g. a sum of it and another term.

    Only a caller that builds the backward itself knows this value: ``loss * factor`` then
    ``.backward()`` sends exactly ``factor`` (rounded once to the loss's dtype, which is ignored
    here: at most 6e-8 relative in fp32), ``loss.backward()`` exactly 1.0. The backward rules
    are unchanged; they use the declared value instead of ``grad_output.item()``, and the device
    checks, without a sync, that the gradient that arrived is that value (within 1e-6
    relative): a wrong declaration is an error (on a GPU, a device-side assert at the next sync),
    never silently scaled gradients.

    NOTE: this is a speed measure, keep it. The ``.item()`` is a host sync at the start of
    backward: the host waits for the forward to finish on the GPU, and the GPU then idles while
    the host launches the backward (1.0-1.3 ms a step in the profile of the compiled FP8 1B full
    fine-tune, and the host's lead over the GPU is lost, so the forward's launch gaps of the
    next step are exposed too).
    """
    if not isinstance(loss.grad_fn, _FusedLinearCrossEntropy._backward_cls):
        return False
    loss.grad_fn.declared_grad_output = float(grad_output)
    return True


def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    *,
    ignore_index: int = CROSS_ENTROPY_IGNORE_INDEX,
    reduction: str = "mean",
    scaling: Union[float, torch.Tensor] = 1.0,
    chunk_size: Optional[int] = None,
    weight_grad_fp32: bool = False,
    num_valid: Optional[int] = None,
) -> torch.Tensor:
    """CE(hidden @ weight.T + bias, labels) without materializing the [N, V] logits.

    ``hidden`` is [B, T, D] or [N, D] (bf16 or fp32, same dtype as ``weight``); ``labels``
    [B, T] or [N]. ``scaling`` is the factor the caller multiplies the loss by before backward.
    ``num_valid``, if the caller knows it, is the number of labels that are not
    ``ignore_index``: it saves the one host sync (it is checked on the device).
    """
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(f"hidden {tuple(hidden.shape)} and labels {tuple(labels.shape)} disagree")
    if hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"hidden dim {hidden.shape[-1]} != weight in_features {weight.shape[1]}")
    h2 = hidden.reshape(-1, hidden.shape[-1])
    y = labels.reshape(-1)
    if not torch.is_grad_enabled():
        # Validation (no_grad): the loss alone. NOTE: not through the autograd Function, whose
        # needs_input_grad stays True under no_grad, so it would compute and keep every gradient
        # (the [V, D] weight gradient included) for a backward that never comes.
        return _chunked_loss_and_grads(
            h2, weight, bias, y, ignore_index, reduction, 1.0, False, False, False, chunk_size,
            num_valid=None if num_valid is None else int(num_valid))[0]
    return _FusedLinearCrossEntropy.apply(
        h2, weight, bias, y, ignore_index, reduction, _as_float(scaling), chunk_size,
        weight_grad_fp32, None if num_valid is None else int(num_valid),
    )


class FusedLinearCrossEntropyLoss(nn.Module):
    """Config component: ``loss: {_component_: tune_recipes.modules.loss.FusedLinearCrossEntropyLoss}``.

    Recipes detect it (``is_fused_linear_loss``), make the model return hidden states instead of
    logits (tune_recipes.modules.output.return_hidden_states) and call it with the output
    projection's weight.
    """

    is_fused_linear_loss = True

    def __init__(self, ignore_index: int = CROSS_ENTROPY_IGNORE_INDEX, reduction: str = "mean",
                 chunk_size: Optional[int] = None, weight_grad_fp32: bool = False) -> None:
        super().__init__()
        self.weight_grad_fp32 = weight_grad_fp32
        self.ignore_index = ignore_index
        self.reduction = reduction
        self.chunk_size = chunk_size

    def forward(self, hidden, weight, labels, bias=None, scaling=1.0, num_valid=None):
        return fused_linear_cross_entropy(
            hidden, weight, labels, bias, ignore_index=self.ignore_index,
            reduction=self.reduction, scaling=scaling, chunk_size=self.chunk_size,
            weight_grad_fp32=self.weight_grad_fp32, num_valid=num_valid,
        )
