"""Optimizers the shipped configs name: torchao's, with less memory and host time a step."""

import functools
import math
import warnings
from typing import Iterator, Optional

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor
from torchao.optim import AdamW8bit as TorchaoAdamW8bit
from torchao.optim.adam import single_param_adam
from torchao.optim.subclass_8bit import OptimState8bit


@functools.lru_cache(maxsize=1)
def compiled_update():
    """torchao's one-parameter Adam update, compiled once per process.

    NOTE: keep it built once. torchao's own step calls ``torch.compile`` on it for every
    parameter at every step, and building that wrapper costs about as much host time as the
    compiled call itself (0.14 ms each at a 64 x 64 parameter on a CPU: a step of 0.38 ms against
    0.18 here). Stepped inside backward, that host time is paid once per parameter per step
    while the GPU waits."""
    return torch.compile(single_param_adam, fullgraph=True, dynamic=False)


def _update_each(params, grads, steps, exp_avgs, exp_avg_sqs, lr, beta1, beta2, weight_decay,
                 eps, is_adamw, stochastic_rounds):
    """torchao's one-parameter update for each of a list of parameters: traced as one graph by
    ``compiled_update_each``.
    NOTE: the step counts are advanced before the call, eagerly, as torchao does: they are CPU
    tensors, and advancing them in the graph would compile a CPU kernel into a GPU step."""
    for p, grad, step, m, v, stochastic_round in zip(params, grads, steps, exp_avgs,
                                                     exp_avg_sqs, stochastic_rounds):
        single_param_adam(p, grad, step, m, v, None, lr, beta1, beta2, weight_decay, eps,
                          is_adamw, stochastic_round)


@functools.lru_cache(maxsize=1)
def compiled_update_each():
    """``_update_each`` through ``torch.compile``: one graph for a batch of parameters
    (``alike_batches``)."""
    return torch.compile(_update_each, fullgraph=True, dynamic=False)


# The most parameters one compiled update takes. NOTE: the compile's time grows with the
# parameters in a graph (~4 s each on a 2-core CPU), and a batch of alike parameters (same
# shapes, dtypes and state kinds) reuses the graph of another such batch: a transformer's
# repeated layers compile a few small graphs, not one graph of every parameter.
PARAMS_A_CALL = 8


def alike_batches(entries: list, key, most_numel: int, most: Optional[int] = None) -> list:
    """``entries`` in batches of alike ones (equal ``key(entry)``, first-seen order kept), each
    batch at most ``most`` entries and, where more than one, at most ``most_numel`` elements
    (the first tensor of an entry counted): so one call's fp32 temporaries (Inductor may hold a
    batch's all at once) stay under ~8 bytes x ``most_numel``, as a sliced parameter's do."""
    most = most or PARAMS_A_CALL
    by_key: dict = {}
    for entry in entries:
        by_key.setdefault(key(entry), []).append(entry)
    batches = []
    for alike in by_key.values():
        batch, numel = [], 0
        for entry in alike:
            n = entry[0].numel()
            if batch and (len(batch) == most or numel + n > most_numel):
                batches.append(batch)
                batch, numel = [], 0
            batch.append(entry)
            numel += n
        batches.append(batch)
    return batches


def _update_signature(entry) -> tuple:
    """What one compiled update's graph is specialized on, for an entry (param, grad, step, m,
    v, stochastic round) of ``AdamW8bit.step``."""
    param, grad, _, m, v, stochastic_round = entry

    def kind(t):
        return (type(t), t.shape, t.dtype, getattr(t, "block_size", None), getattr(t, "signed", None))

    return (param.shape, param.dtype, grad.dtype, kind(m), kind(v), stochastic_round)


class AdamW8bit(TorchaoAdamW8bit):
    """torchao's ``AdamW8bit`` (states in 8 bits, block-wise scales), stepping a parameter of
    more than ``chunk_numel`` elements a slice of rows at a time.

    torchao compiles one update per parameter, and inductor materializes the new first and
    second moments in fp32 before quantizing them (each block's scale is a reduction over them):
    two fp32 copies of the parameter alive at once. For Llama-3.1-8B's 525M-element embedding
    and output projection that is 3.9 GiB, measured as the top of the 8B full config's peak on
    an H200 (``BENCH_MEMORY_AT_PEAK``, docs/benchmarks.md). Here such a parameter steps a slice
    of whole rows at a time, on views of the parameter, its gradient and its states cut on
    quantization-block boundaries: every block's scale and every element come out as in one
    update (``bf16_stochastic_round`` aside: each slice draws its own random bits), and the
    temporaries stay under ~8 bytes x ``chunk_numel``.

    The update is torchao's own (``single_param_adam``), compiled once a process instead of once
    a call (``compiled_update``).

    ``compile_whole_step`` (the recipes' ``compile_optimizer_step``): a param group's parameters
    that step whole (no larger than ``chunk_numel``, not DTensors of unmatched shards) update a
    batch of alike ones a compiled call (``alike_batches``: up to ``PARAMS_A_CALL`` parameters of
    the same shape, ``chunk_numel`` elements in all), instead of one call a parameter: each call
    is host work (guards, a launch a kernel), which at Llama-3.2-1B's 146 parameters came to more
    time a step than the update's kernels. Batches of the same shapes share one graph (at that
    model 25 calls and 6 graphs a step, and the tied embedding's 4 slices, 2 graphs, as before:
    29 compiled calls where one a parameter made 149). The same arithmetic per parameter (bit-identical on the
    CPU; stochastic rounding draws other random bits); a parameter whose gradient is None on
    some steps and not on others changes the batches, and new batches compile.

    States, ``state_dict`` and checkpoints are torchao's: either class resumes the other's.
    A DTensor (FSDP2) parameter steps its local shard, sliced the same way: the update is
    elementwise within each quantization block, and a shard's states are built from the shard
    (torchao's ``_new_buffer``), so the shard's update is the DTensor's (tested on a 2-rank
    mesh). torchao steps the DTensor whole: for an 8B embedding's shard over two GPUs that is
    ~2 GiB of temporaries by the single-GPU measurement's arithmetic (two fp32 copies of 262M
    elements); the distributed saving itself is not measured.
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 amsgrad=False, *, block_size=256, bf16_stochastic_round=False,
                 chunk_numel: int = 2**26, compile_whole_step: bool = False) -> None:
        if amsgrad:
            # torchao 0.15's own AdamW8bit fails at its first step with amsgrad (its 8-bit
            # state has no elementwise maximum): refuse it here, by name, before training.
            raise ValueError("AdamW8bit: amsgrad=True is not supported by torchao's 8-bit "
                             "states; use optimizer.amsgrad=False or torch.optim.AdamW")
        if chunk_numel < 1:
            raise ValueError(f"AdamW8bit: chunk_numel must be positive, got {chunk_numel}")
        if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
            raise ValueError(f"AdamW8bit: block_size must be a positive integer (elements per "
                             f"quantization block; 256 by default), got {block_size!r}")
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, block_size=block_size,
                         bf16_stochastic_round=bf16_stochastic_round)
        self.chunk_numel = chunk_numel
        self.compile_whole_step = compile_whole_step

    def row_slices(self, p: Tensor, block_size: Optional[int] = None) -> Iterator[Optional[slice]]:
        """``None`` (step ``p`` whole), or slices of ``p``'s first dimension, each at most
        ``chunk_numel`` elements where whole rows allow it, each starting on a multiple of four
        quantization blocks of ``block_size`` (the state's own: a resumed state may have been
        made with another): so every slice of a state starts a block, and its codes and scales
        stay 16-byte aligned (inductor copies a misaligned input, which would defeat the point)."""
        rows = p.shape[0] if p.dim() else 1
        if isinstance(p, DTensor) or p.numel() <= self.chunk_numel or rows < 2:
            # A DTensor's rows are not local: ``step`` passes a shard's local tensor.
            yield None
            return
        row_numel = p.numel() // rows
        align = 4 * (block_size or self.block_size)
        rows_multiple = align // math.gcd(row_numel, align)
        step = max(rows_multiple, (self.chunk_numel // row_numel) // rows_multiple * rows_multiple)
        for start in range(0, rows, step):
            yield slice(start, min(start + step, rows))

    @torch.no_grad()
    def step(self, closure=None) -> Optional[Tensor]:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        update = compiled_update()
        # One compiled update per distinct (shape, flags): a fixed set for a model, as in torchao.
        with torch._dynamo.utils.disable_cache_limit():
            for group in self.param_groups:
                if not isinstance(group["lr"], Tensor):
                    raise RuntimeError("AdamW8bit keeps lr as a tensor: change it with "
                                       "optimizer.param_groups[i]['lr'].fill_(new_lr)")
                if group["amsgrad"]:  # a group added or loaded after __init__'s check
                    raise RuntimeError("AdamW8bit: a param group has amsgrad=True, which "
                                       "torchao's 8-bit states do not support")
                beta1, beta2 = group["betas"]
                together = []  # (param, grad, step, m, v, stochastic round), in alike_batches
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    if p.grad.is_sparse:
                        raise RuntimeError("AdamW8bit does not take sparse gradients")
                    state = self.state[p]
                    if not state:  # the keys and buffers torchao's own step creates
                        state["step"] = torch.tensor(0.0)
                        state["exp_avg"] = self._new_buffer(p, True)
                        state["exp_avg_sq"] = self._new_buffer(p, False)
                    state["step"] += 1
                    m, v = state["exp_avg"], state["exp_avg_sq"]
                    # NOTE: p.detach(): compiled with FSDP2's DTensors, p itself misbehaves
                    # (torchao does the same); the gradient is passed on its own.
                    param, grad = p.detach(), p.grad
                    if local_shards_line_up(param, grad, m, v):
                        # no_grad: to_local() is the DTensor's own local tensor, updated in place
                        param, grad, m, v = (t.to_local() for t in (param, grad, m, v))
                    stochastic_round = self.bf16_stochastic_round and p.dtype is torch.bfloat16
                    block_size = m.block_size if isinstance(m, OptimState8bit) else None
                    slices = list(self.row_slices(param, block_size))
                    if (self.compile_whole_step and slices == [None]
                            and not isinstance(param, DTensor)):
                        together.append((param, grad, state["step"], m, v, stochastic_round))
                        continue
                    for rows in slices:
                        update(cut(param, rows), cut(grad, rows), state["step"], cut(m, rows),
                               cut(v, rows), None, group["lr"], beta1, beta2,
                               group["weight_decay"], group["eps"], self.is_adamw,
                               stochastic_round)
                for batch in alike_batches(together, _update_signature, self.chunk_numel):
                    params, grads, steps, ms, vs, rounds = (list(x) for x in zip(*batch))
                    compiled_update_each()(params, grads, steps, ms, vs, group["lr"], beta1,
                                           beta2, group["weight_decay"], group["eps"],
                                           self.is_adamw, rounds)
        return loss

    def _new_buffer(self, p: Tensor, signed: bool):
        out = super()._new_buffer(p, signed)
        local_p = p.to_local() if isinstance(p, DTensor) else p
        local = out.to_local() if isinstance(out, DTensor) else out
        if local_p.numel() >= 4096 and not isinstance(local, OptimState8bit):
            # torchao keeps a parameter's states in full precision, 4x the memory, when
            # block_size does not divide its (local: FSDP2's shard) size; smaller ones are kept
            # so on purpose. Say so rather than run out of memory.
            warnings.warn(f"AdamW8bit: block_size={self.block_size} does not divide the size of "
                          "some parameters (or of their shards); their states stay in full "
                          "precision (4x the memory). A power of two such as 256 divides the "
                          "usual model dimensions")
        return out


def local_shards_line_up(param: Tensor, *others: Tensor) -> bool:
    """Whether ``param`` is a DTensor and each of ``others`` (its gradient and states) a DTensor
    of the same mesh, placements and local shape, so that element i of one local tensor is
    element i of each other (FSDP2's parameters, gradients and torchao's states are)."""
    if not isinstance(param, DTensor):
        return False
    return all(isinstance(t, DTensor) and t.device_mesh == param.device_mesh
               and t.placements == param.placements
               and t.to_local().shape == param.to_local().shape for t in others)


def cut(t: Tensor, rows: Optional[slice]) -> Tensor:
    """``t``'s ``rows`` (a view), or all of it for ``None``. An 8-bit state's rows are views of
    its codes and block scales (rows start and end on block boundaries, ``row_slices``), made
    here rather than by torchao's slice op, which also copies the quantization map each call."""
    if rows is None:
        return t
    if not isinstance(t, OptimState8bit):
        return t[rows]
    row_numel = t.numel() // t.shape[0]
    first, last = rows.start * row_numel // t.block_size, rows.stop * row_numel // t.block_size
    return OptimState8bit(t.codes[rows], t.scale[first:last], t.qmap, t.signed)
