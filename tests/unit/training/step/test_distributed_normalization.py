"""Distributed token normalization with real process groups (2 gloo processes on CPU).

Each rank holds a different number of unmasked tokens. The library's distributed path (loss x
local tokens, all-reduced count, gradients x world_size / global tokens after the data-parallel
average) must equal the single-process gradient over all tokens; the per-rank shortcut
(backward each rank's mean, average) must not. Measured here (fp32, random data): [5, 3] tokens
move the gradient ~20-30%, [1, 64] by well over 100%; balanced [4, 4] is exact.
"""

import os
import queue
import socket
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from tune_recipes.modules.loss import fused_linear_cross_entropy
from tune_recipes.training import StepLossNormalizer

pytestmark = pytest.mark.unit
V, D, IGNORE = 13, 8, -100


def _data(counts, seed=0):
    """One [max_rows, D] batch per rank with ``counts[r]`` unmasked labels."""
    g = torch.Generator().manual_seed(seed)
    rows = max(counts)
    out = []
    for n in counts:
        x = torch.randn(rows, D, generator=g)
        y = torch.randint(0, V, (rows,), generator=g)
        y[n:] = IGNORE
        out.append((x, y))
    return out


def _model():
    torch.manual_seed(0)
    return torch.nn.Linear(D, V)


def _flat_grad(model):
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


# Every (mode, counts) case the tests below check, all computed by one pair of gloo processes
# (spawning a pair costs ~20 s of imports on the CI machine; one pair per case cost ~3 min).
# The "_fused" modes compute the loss with the fused linear cross-entropy, whose gradients are
# pre-scaled in forward by the factor the step declares to it (the in-backward factor is a
# fraction: n * world / global tokens).
CASES = ([("in_bwd", c) for c in ([5, 3], [1, 64], [0, 7])]
         + [("library", c) for c in ([5, 3], [1, 64], [4, 4])]
         + [("shortcut", c) for c in ([5, 3], [1, 64], [4, 4])]
         + [("in_bwd_fused", c) for c in ([5, 3], [1, 64], [0, 7])]
         + [("library_fused", c) for c in ([5, 3], [1, 64])])


def _one_case(rank, world, case_id, counts, mode, q):
    x, y = _data(counts)[rank]
    model = _model()
    n = int((y != IGNORE).sum())
    fused, mode = mode.endswith("_fused"), mode.removesuffix("_fused")
    loss = F.cross_entropy(model(x), y, ignore_index=IGNORE)
    if mode in ("library", "in_bwd"):
        # in_bwd: IN_BACKWARD_GLOBAL, whose gradient must be exact straight out of backward
        # (the optimizer steps there); finish_step then only sums the logged loss.
        norm = StepLossNormalizer(1, optimizer_in_bwd=mode == "in_bwd", distributed=True,
                                  world_size=world)
        if fused:
            loss = fused_linear_cross_entropy(x, model.weight, y, model.bias, ignore_index=IGNORE,
                                              scaling=norm.backward_factor(n), num_valid=n)
        norm.loss_to_backward(loss, n).backward()
    else:  # the per-rank shortcut: each rank backpropagates its own mean
        loss.backward()
    # What FSDP / DDP do to gradients: average over ranks.
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= world
    if mode == "in_bwd":
        # before finish_step: what a hook sees (a list: a shared-memory tensor would vanish
        # with this process if it exits before the parent reads it)
        q.put((case_id, "seen", rank, _flat_grad(model).tolist()))
    logged = norm.finish_step(model.parameters()).item() if mode != "shortcut" else None
    if rank == 0:
        # Plain lists, not tensors: a tensor crosses the queue as a shared-memory handle that
        # dies with this process, and the parent read it after exit at random
        # (ConnectionResetError under load).
        q.put((case_id, "final", _flat_grad(model).tolist(), logged))


def _worker(rank, world, port, q):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    for case_id, (mode, counts) in enumerate(CASES):
        _one_case(rank, world, case_id, counts, mode, q)
    dist.destroy_process_group()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def two_rank_results():
    """{(mode, counts): (grad, logged)} and, for in_bwd, the gradient each rank's hook saw."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, 2, port, q)) for r in range(2)]
    for p in procs:
        p.start()
    expected = sum(3 if mode.startswith("in_bwd") else 1 for mode, _ in CASES)
    final, seen = {}, {}
    deadline = time.monotonic() + 300
    for received in range(expected):
        while True:  # a worker that died (an exception) fails the test now, not at the timeout
            try:
                msg = q.get(timeout=2)
                break
            except queue.Empty:
                codes = [p.exitcode for p in procs]
                if any(c not in (None, 0) for c in codes) or time.monotonic() > deadline:
                    for p in procs:
                        p.terminate()
                    pytest.fail(f"worker exit codes {codes} (None: still running) after "
                                f"{received} of {expected} results")
        if msg[1] == "seen":
            seen.setdefault(msg[0], {})[msg[2]] = torch.tensor(msg[3])
        else:
            final[msg[0]] = (torch.tensor(msg[2], dtype=torch.float32), msg[3])
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    return {(mode, tuple(counts)): (final[i], seen.get(i)) for i, (mode, counts) in enumerate(CASES)}


def _two_ranks(results, counts, mode):
    out, seen = results[(mode, tuple(counts))]
    return out if not mode.startswith("in_bwd") else (out, seen)


def _reference(counts):
    model = _model().double()
    xs, ys = zip(*_data(counts))
    x, y = torch.cat(xs).double(), torch.cat(ys)
    loss = F.cross_entropy(model(x), y, ignore_index=IGNORE)
    loss.backward()
    return _flat_grad(model), loss.item()


def _rel(a, b):
    return float((a.double() - b).norm() / b.norm())


@pytest.mark.parametrize("loss", ["", "_fused"])
@pytest.mark.parametrize("counts", [[5, 3], [1, 64], [0, 7]])
def test_in_backward_global_gradient_is_exact_inside_backward(counts, loss, two_rank_results):
    (grad, logged), seen = _two_ranks(two_rank_results, counts, "in_bwd" + loss)
    ref_grad, ref_loss = _reference(counts)
    for rank in (0, 1):
        assert _rel(seen[rank], ref_grad) < (2e-6 if loss else 1e-6)
    assert torch.equal(grad, seen[0])  # finish_step leaves the gradients alone
    assert logged == pytest.approx(ref_loss, rel=1e-6)


@pytest.mark.parametrize("counts, loss", [([5, 3], ""), ([1, 64], ""), ([4, 4], ""),
                                          ([5, 3], "_fused"), ([1, 64], "_fused")])
def test_library_matches_global_token_mean(counts, loss, two_rank_results):
    grad, logged = _two_ranks(two_rank_results, counts, "library" + loss)
    ref_grad, ref_loss = _reference(counts)
    assert _rel(grad, ref_grad) < (2e-6 if loss else 1e-6)
    assert logged == pytest.approx(ref_loss, rel=1e-6)


def test_per_rank_shortcut_is_wrong_on_ragged_batches(two_rank_results):
    errors = {}
    for counts in ([5, 3], [1, 64], [4, 4]):
        grad, _ = _two_ranks(two_rank_results, counts, "shortcut")
        ref_grad, _ = _reference(counts)
        errors[tuple(counts)] = _rel(grad, ref_grad)
    print("per-rank shortcut relative gradient error:", errors)
    assert errors[(4, 4)] < 1e-6               # balanced: the shortcut happens to be exact
    assert 0.10 < errors[(5, 3)] < 0.50        # mildly ragged: tens of percent off
    assert errors[(1, 64)] > 1.0               # very ragged: off by more than the gradient
