"""tune_recipes.optim.AdamW8bit: torchao's AdamW8bit stepping large parameters in row slices.
Reference: torchao's own AdamW8bit on the same parameters and gradients, bit for bit."""

import warnings

import pytest
import torch
from torch._dynamo.utils import counters
from torchao.optim import AdamW8bit as TorchaoAdamW8bit
from torchao.optim.subclass_8bit import OptimState8bit

from tune_recipes.optim import AdamW8bit
from tune_recipes.training.checkpointing.io import load_recipe_state


def _shapes_and_grads(steps):
    # 1000 x 64 bf16: 64,000 elements, quantized, sliced at chunk_numel=5000 into 16 slices of
    # 64 rows (the last 40); 4096 x 3: rows of 3 (not a divisor of the block); 64: a bias,
    # kept in fp32 by torchao and never sliced.
    g = torch.Generator().manual_seed(1)
    shapes = [((1000, 64), torch.bfloat16), ((4096, 3), torch.float32), ((64,), torch.float32)]
    params = [torch.randn(s, generator=g).to(d) for s, d in shapes]
    grads = [[torch.randn(s, generator=g).to(d) for s, d in shapes] for _ in range(steps)]
    return params, grads


def _train(cls, params, grads, state_dict=None, **kwargs):
    """``len(grads)`` steps of ``cls`` from copies of ``params``; the trained parameters and the
    optimizer."""
    params = [torch.nn.Parameter(p.clone()) for p in params]
    opt = cls(params, lr=1e-2, **kwargs)
    if state_dict is not None:
        opt.load_state_dict(state_dict)
    for step_grads in grads:
        for p, grad in zip(params, step_grads):
            p.grad = grad
        opt.step()
    return params, opt


def _saved_copy(state_dict, path):
    """``state_dict`` saved to ``path`` and read back as a resume reads the recipe state
    (``load_recipe_state``: weights_only): loading the same dict twice would share its ``step``
    tensors, which each optimizer increments in place."""
    torch.save(state_dict, path)
    return load_recipe_state(path)


def _assert_same_states(their_state: dict, our_state: dict, local=lambda t: t) -> None:
    """Both moments equal bit for bit: an 8-bit state's codes and block scales, or the full
    precision tensor torchao keeps for a small parameter (``local``: a DTensor's shard)."""
    for key in ("exp_avg", "exp_avg_sq"):
        sa, sb = local(their_state[key]), local(our_state[key])
        if isinstance(sa, OptimState8bit):
            assert torch.equal(sa.codes, sb.codes) and torch.equal(sa.scale, sb.scale), key
        else:
            assert torch.equal(sa, sb), key


def test_row_slices_cover_every_row_once_on_block_boundaries():
    opt = AdamW8bit([torch.nn.Parameter(torch.zeros(1))], chunk_numel=5000)
    for rows, row_numel in [(1000, 64), (4096, 3), (7, 1024), (128256, 16)]:
        p = torch.empty(rows, row_numel)
        slices = list(opt.row_slices(p))
        assert len(slices) > 1, (rows, row_numel)
        covered = [r for s in slices for r in range(s.start, s.stop)]
        assert covered == list(range(rows)), (rows, row_numel)
        for s in slices:
            # every slice starts four quantization blocks in (aligned codes and scales)
            assert s.start * row_numel % (4 * opt.block_size) == 0, (rows, row_numel, s)
            # at most chunk_numel elements unless one aligned group of rows is already more
            assert (s.stop - s.start) * row_numel <= max(5000, 4 * opt.block_size), (rows, s)
    # small parameters step whole
    assert list(opt.row_slices(torch.empty(70, 70))) == [None]


@pytest.mark.parametrize("stochastic", [False, True], ids=["round_nearest", "bf16_stochastic_round"])
def test_sliced_steps_equal_torchaos_bit_for_bit(stochastic):
    """Eager (torchao's update itself, uncompiled): the sliced steps give the same parameters and
    the same 8-bit codes and block scales as torchao's unsliced step; with stochastic rounding
    too, from the same random state (on the CPU's generator the slices draw the same bits)."""
    init, grads = _shapes_and_grads(3)
    with torch.compiler.set_stance("force_eager"):
        torch.manual_seed(5)
        theirs, their_opt = _train(TorchaoAdamW8bit, init, grads, bf16_stochastic_round=stochastic)
        torch.manual_seed(5)
        ours, our_opt = _train(AdamW8bit, init, grads, chunk_numel=5000, bf16_stochastic_round=stochastic)
    assert len(list(our_opt.row_slices(ours[0]))) == 16  # it did slice
    for a, b in zip(theirs, ours):
        assert torch.equal(a, b)
    assert not torch.equal(ours[0], init[0])  # it trained
    for a, b in zip(theirs, ours):
        _assert_same_states(their_opt.state[a], our_opt.state[b])


def test_the_update_is_compiled_once_a_process_not_once_a_call(monkeypatch):
    """torchao's step builds a torch.compile wrapper for every parameter at every step (host
    time as large as the call's); ours builds it once, however many parameters and steps."""
    import tune_recipes.optim as optim

    built = []
    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda *a, **k: built.append(a[0].__name__) or real_compile(*a, **k))
    optim.compiled_update.cache_clear()
    init, grads = _shapes_and_grads(3)
    with torch.compiler.set_stance("force_eager"):
        _train(AdamW8bit, init, grads, chunk_numel=5000)
        _train(AdamW8bit, init, grads)
        assert built == ["single_param_adam"]
        _train(TorchaoAdamW8bit, init, grads)  # the reference: one wrapper a parameter a step
    assert built.count("single_param_adam") == 1 + 3 * len(init)
    optim.compiled_update.cache_clear()


def test_a_large_parameter_steps_through_one_update_call_per_slice(monkeypatch):
    """The step itself uses the slices (the CPU results are equal either way; only the calls
    show it): 16 row slices of the 1000 x 64 parameter, 4 of the 4096 x 3, the bias whole."""
    import tune_recipes.optim as optim

    shapes = []
    real = optim.compiled_update()
    monkeypatch.setattr(optim, "compiled_update", lambda: lambda *a: shapes.append(tuple(a[0].shape)) or real(*a))
    init, grads = _shapes_and_grads(1)
    with torch.compiler.set_stance("force_eager"):
        _train(AdamW8bit, init, grads, chunk_numel=5000)
    assert shapes == [(64, 64)] * 15 + [(40, 64)] + [(1024, 3)] * 4 + [(64,)]


@pytest.mark.parametrize("first,then", [(TorchaoAdamW8bit, AdamW8bit), (AdamW8bit, TorchaoAdamW8bit)],
                         ids=["torchao_to_ours", "ours_to_torchao"])
def test_each_resumes_the_others_state_dict(first, then):
    """States are torchao's: one step of either class, saved, resumes in the other to the same
    parameters as three uninterrupted steps, bit for bit."""
    init, grads = _shapes_and_grads(3)
    sliced = {"chunk_numel": 5000}
    with torch.compiler.set_stance("force_eager"):
        straight, _ = _train(AdamW8bit, init, grads, **sliced)
        after_one, opt = _train(first, init, grads[:1], **(sliced if first is AdamW8bit else {}))
        saved = opt.state_dict()
        resumed, _ = _train(then, [p.detach() for p in after_one], grads[1:], state_dict=saved,
                            **(sliced if then is AdamW8bit else {}))
    for a, b in zip(straight, resumed):
        assert torch.equal(a, b)


@pytest.mark.parametrize("bad", [0, -1])
def test_chunk_numel_must_be_positive(bad):
    with pytest.raises(ValueError, match="chunk_numel must be positive"):
        AdamW8bit([torch.nn.Parameter(torch.zeros(1))], chunk_numel=bad)


def test_amsgrad_is_refused_by_name_before_training():
    """torchao's own class accepts amsgrad=True and fails at its first step on its 8-bit state;
    ours refuses it when built, naming the key."""
    params = [torch.nn.Parameter(torch.randn(64, 64))]
    with pytest.raises(ValueError, match="amsgrad=True"):
        AdamW8bit(params, amsgrad=True)
    theirs = TorchaoAdamW8bit(params, amsgrad=True)
    params[0].grad = torch.randn(64, 64)
    with torch.compiler.set_stance("force_eager"), pytest.raises(NotImplementedError):
        theirs.step()
    # a group that comes with amsgrad later (added, or from a loaded state) is refused at step
    ours = AdamW8bit(params)
    ours.param_groups[0]["amsgrad"] = True
    with pytest.raises(RuntimeError, match="amsgrad=True"):
        ours.step()


def test_a_state_made_with_a_larger_block_resumes_sliced_on_its_own_blocks(tmp_path):
    """Slices align to the state's block size, not the optimizer's: a state saved with 4,096-element
    blocks (16 times the default) resumes in an optimizer built with the default 256 and steps,
    sliced, as torchao's would (aligned to 256, a slice would start inside a block)."""
    g = torch.Generator().manual_seed(3)
    init = [torch.randn(2048, 64, generator=g)]
    grads = [[torch.randn(2048, 64, generator=g)] for _ in range(2)]
    with torch.compiler.set_stance("force_eager"):
        _, first = _train(TorchaoAdamW8bit, init, grads[:1], block_size=4096)
        saved = first.state_dict()
        theirs, _ = _train(TorchaoAdamW8bit, init, grads[1:], state_dict=_saved_copy(saved, tmp_path / "a.pt"), block_size=4096)
        ours, opt = _train(AdamW8bit, init, grads[1:], state_dict=_saved_copy(saved, tmp_path / "b.pt"), chunk_numel=2000)
    state = opt.state[ours[0]]["exp_avg"]
    assert state.block_size == 4096 and len(list(opt.row_slices(ours[0], state.block_size))) == 8
    assert torch.equal(theirs[0], ours[0])


def _second_step_peak_above_start(params, opt) -> int:
    """Bytes the CUDA allocator's peak rose above what was allocated before ``opt``'s second
    step (random gradients each step; the first compiles and creates the states). Frees the
    parameters' memory after."""
    for _ in range(2):
        for p in params:
            p.grad = torch.randn_like(p)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        opt.step()
        torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - start
    params.clear()
    opt.param_groups.clear()
    opt.state.clear()
    torch.cuda.empty_cache()
    return peak


@pytest.mark.gpu
def test_sliced_compiled_step_keeps_its_fp32_temporaries_to_a_slice():
    """The point of the slices, on CUDA, compiled: torchao's step of a
    2^27-element bf16 parameter allocates two fp32 copies of it (1 GiB) above the parameter,
    gradient and states; ours, at chunk_numel=2^24, under a quarter of that. Peak memory is
    read around the second step (the first compiles and creates the states)."""
    numel, chunk = 2**27, 2**24

    def step_peak_above_start(cls, **kwargs):
        torch.manual_seed(0)
        p = torch.nn.Parameter(torch.randn(numel // 4096, 4096, device="cuda", dtype=torch.bfloat16))
        return _second_step_peak_above_start([p], cls([p], lr=1e-3, **kwargs))

    theirs = step_peak_above_start(TorchaoAdamW8bit)
    ours = step_peak_above_start(AdamW8bit, chunk_numel=chunk)
    assert theirs >= 0.9 * 2 * 4 * numel, theirs  # the cause: two fp32 moments materialized
    assert ours <= 0.25 * theirs, (ours, theirs)


@pytest.mark.gpu
def test_batched_compiled_step_keeps_its_fp32_temporaries_to_a_batch():
    """compile_whole_step on CUDA: eight bf16 parameters of 2^24 elements at chunk_numel=2^25
    step two a call, so the call's fp32 temporaries stay near 8 bytes x 2^25 (two copies of its
    new moments: 256 MiB), under half the 1 GiB of eight parameters' at once (the bound of the
    slice test above: 16 bytes x chunk_numel). Peak read around the second step (the first
    compiles and creates the states)."""
    numel, chunk, count = 2**24, 2**25, 8
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(numel // 4096, 4096, device="cuda", dtype=torch.bfloat16))
              for _ in range(count)]
    opt = AdamW8bit(params, lr=1e-3, chunk_numel=chunk, compile_whole_step=True)
    peak = _second_step_peak_above_start(params, opt)
    assert peak <= 16 * chunk, (peak, 16 * chunk)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_compiled_as_shipped_equals_torchaos_compiled_step_bit_for_bit(device):
    """As the recipes run it (compiled, inductor; CPU and CUDA inductor fuse differently, so both
    are checked): the same parameters and 8-bit states as torchao's compiled step, sliced
    parameter included. ~10 s of CPU compile, kept in the default run: this is the shipped path."""
    init, grads = _shapes_and_grads(2)
    init = [p.to(device) for p in init]
    grads = [[g.to(device) for g in step] for step in grads]
    theirs, their_opt = _train(TorchaoAdamW8bit, init, grads)
    counters.clear()
    ours, our_opt = _train(AdamW8bit, init, grads, chunk_numel=5000)
    # One graph per slice shape ((64, 64), the last (40, 64), (1024, 3)), not one per slice (20)
    # or per step: a slice's offset into its parameter is no new graph.
    assert counters["stats"]["unique_graphs"] <= 3, dict(counters["stats"])
    for a, b in zip(theirs, ours):
        assert torch.equal(a, b)
        sa, sb = their_opt.state[a]["exp_avg_sq"], our_opt.state[b]["exp_avg_sq"]
        if isinstance(sa, OptimState8bit):
            assert torch.equal(sa.codes, sb.codes) and torch.equal(sa.scale, sb.scale)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_the_whole_step_in_one_graph_equals_torchaos_step_bit_for_bit(device, monkeypatch):
    """``compile_whole_step`` (``compile_optimizer_step``): the parameters that step whole (the
    4096 x 3 with 8-bit states, the bias with fp32 ones) update in one compiled call a step;
    the large one still steps a slice a call. Parameters, states and step counts as torchao's
    compiled step, bit for bit, with the learning rate changed between steps (filled in place,
    as the schedulers do) and no graph compiled after the first step."""
    import tune_recipes.optim as optim

    init, grads = _shapes_and_grads(3)
    init = [p.to(device) for p in init]
    grads = [[g.to(device) for g in step] for step in grads]
    rates = [1e-2, 5e-3, 2e-3]

    def train(cls, **kwargs):
        params = [torch.nn.Parameter(p.clone()) for p in init]
        opt, graphs = cls(params, lr=rates[0], **kwargs), []
        for step_grads, rate in zip(grads, rates):
            opt.param_groups[0]["lr"].fill_(rate)
            for p, grad in zip(params, step_grads):
                p.grad = grad
            opt.step()
            graphs.append(counters["stats"]["unique_graphs"])
        return params, opt, graphs

    theirs, their_opt, _ = train(TorchaoAdamW8bit)
    calls = {"one": [], "each": []}
    one, each = optim.compiled_update(), optim.compiled_update_each()
    monkeypatch.setattr(optim, "compiled_update", lambda: lambda *a: calls["one"].append(tuple(a[0].shape)) or one(*a))
    monkeypatch.setattr(optim, "compiled_update_each",
                        lambda: lambda *a: calls["each"].append([tuple(p.shape) for p in a[0]]) or each(*a))
    counters.clear()
    ours, our_opt, graphs = train(AdamW8bit, chunk_numel=20_000, compile_whole_step=True)
    assert calls["each"] == [[(4096, 3)], [(64,)]] * 3  # a call a step each: unalike
    assert calls["one"] == ([(304, 64)] * 3 + [(88, 64)]) * 3  # the 1000 x 64 in 4 slices
    assert graphs[1] == graphs[2] == graphs[0], graphs  # compiled at the first step only
    for a, b, start in zip(theirs, ours, init):
        assert torch.equal(a, b)
        assert not torch.equal(b, start)  # it trained
        sa, sb = their_opt.state[a], our_opt.state[b]
        assert sa["step"].item() == sb["step"].item() == 3
        _assert_same_states(sa, sb)
    assert isinstance(our_opt.state[ours[1]]["exp_avg"], OptimState8bit)  # 8-bit in the graph


def test_alike_parameters_step_in_batches_that_share_one_graph(monkeypatch):
    """Four 64 x 64 parameters (8-bit states) and two biases, at most two parameters a call:
    two calls of two 64 x 64 parameters (one graph for both) and one of the biases, each step;
    parameters and states as torchao's compiled step, bit for bit."""
    import tune_recipes.optim as optim

    monkeypatch.setattr(optim, "PARAMS_A_CALL", 2)
    g = torch.Generator().manual_seed(3)
    shapes = [(64, 64), (64,), (64, 64), (64, 64), (64,), (64, 64)]
    init = [torch.randn(s, generator=g) for s in shapes]
    grads = [[torch.randn(s, generator=g) for s in shapes] for _ in range(2)]
    theirs, their_opt = _train(TorchaoAdamW8bit, init, grads)
    calls, each = [], optim.compiled_update_each()
    monkeypatch.setattr(optim, "compiled_update_each",
                        lambda: lambda *a: calls.append([tuple(p.shape) for p in a[0]]) or each(*a))
    torch._dynamo.reset()
    counters.clear()
    ours, our_opt = _train(AdamW8bit, init, grads, compile_whole_step=True)
    assert calls == [[(64, 64)] * 2, [(64, 64)] * 2, [(64,)] * 2] * 2
    assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])  # not 3 or 6
    for a, b in zip(theirs, ours):
        assert torch.equal(a, b)
        _assert_same_states(their_opt.state[a], our_opt.state[b])


def test_alike_batches_keep_order_and_bound_count_and_elements():
    from tune_recipes.optim import alike_batches

    entries = [(torch.empty(n), tag) for n, tag in
               [(10, "a"), (5, "b"), (10, "a"), (10, "a"), (10, "a"), (30, "a"), (5, "b")]]
    batches = alike_batches(entries, key=lambda e: e[1], most_numel=25, most=2)
    assert [[e[0].numel() for e in b] for b in batches] == [[10, 10], [10, 10], [30], [5, 5]]
    # a lone entry larger than most_numel is a batch of its own; nothing is lost or repeated
    assert sorted(id(e) for b in batches for e in b) == sorted(map(id, entries))


@pytest.mark.parametrize("block_size", [0, -4, "abc", 2.5])
def test_a_block_size_that_is_not_a_positive_integer_is_refused_by_name(block_size):
    with pytest.raises(ValueError, match=f"block_size must be a positive integer.*{block_size!r}"):
        AdamW8bit([torch.nn.Parameter(torch.zeros(64, 64))], block_size=block_size)


def test_a_block_size_that_leaves_states_in_full_precision_says_so():
    def states(block_size):
        p = torch.nn.Parameter(torch.randn(64, 128))
        p.grad = torch.randn_like(p)
        opt = AdamW8bit([p], block_size=block_size)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt.step()
        said = [str(w.message) for w in caught if "block_size" in str(w.message)]
        return opt.state[p]["exp_avg"], said

    full, said = states(7)  # 8192 elements: 7 does not divide them
    assert not isinstance(full, OptimState8bit) and said and "block_size=7" in said[0]
    eight_bit, said = states(256)
    assert isinstance(eight_bit, OptimState8bit) and not said


@pytest.fixture
def two_rank_mesh():
    """Rank 0 of a 2-rank CPU mesh, in this process (torch's fake process group: collectives do
    nothing, which the optimizer step never calls)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield init_device_mesh("cpu", (2,))
    finally:
        dist.destroy_process_group()


def _sharded(t, mesh):
    """Rank 0's shard of ``t`` as FSDP2 lays it out: a DTensor sharded on rows."""
    from torch.distributed.tensor import DTensor, Shard

    local = t.chunk(2)[0].clone()
    return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=t.shape, stride=t.stride())


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_an_fsdp2_shard_steps_in_slices_as_torchao_steps_the_dtensor(two_rank_mesh, compiled, monkeypatch):
    """FSDP2's parameters (DTensors sharded on rows): ours steps each local shard, in row slices
    where it is large, to the same parameters and 8-bit states as torchao's step of the whole
    DTensor, bit for bit."""
    import tune_recipes.optim as optim

    init, grads = _shapes_and_grads(2)
    init = [_sharded(p, two_rank_mesh) for p in init]
    grads = [[_sharded(g, two_rank_mesh) for g in step] for step in grads]
    stance = "default" if compiled else "force_eager"
    with torch.compiler.set_stance(stance):
        theirs, their_opt = _train(TorchaoAdamW8bit, init, grads)
        shapes = []
        real = optim.compiled_update()
        monkeypatch.setattr(optim, "compiled_update",
                            lambda: lambda *a: shapes.append((type(a[0]), tuple(a[0].shape))) or real(*a))
        ours, our_opt = _train(AdamW8bit, init, grads, chunk_numel=5000)
    # rank 0's 500 x 64 shard in 8 slices of 64 rows (the last 52), the 2048 x 3 shard in 2, the
    # 32-element bias shard whole: local tensors, not DTensors
    assert shapes[:11] == ([(torch.Tensor, (64, 64))] * 7 + [(torch.Tensor, (52, 64))]
                           + [(torch.Tensor, (1024, 3))] * 2 + [(torch.Tensor, (32,))]), shapes
    for a, b, start in zip(theirs, ours, init):
        assert isinstance(b, torch.distributed.tensor.DTensor)
        assert torch.equal(a.to_local(), b.to_local())
        assert not torch.equal(b.to_local(), start.to_local())  # it trained
        _assert_same_states(their_opt.state[a], our_opt.state[b], local=lambda t: t.to_local())
