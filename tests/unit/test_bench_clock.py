"""scripts/bench_hooks/bench_clock.py, the benchmark's timer for both sides: it waits for the GPU
before each clock read, times exactly batches W .. W+N-1, counts every token and the label
tokens of those batches, and reports the run's true peak memory (nobody can reset it)."""

import gc
import json
import os
import subprocess
import sys

import pytest
import torch
from script_loader import SCRIPTS

sys.path.insert(0, str(SCRIPTS / "bench_hooks"))
import bench_clock  # noqa: E402


@pytest.fixture(autouse=True)
def _gc_callbacks_restored():
    """Each Clock hooks Python's collector; a test's clocks leave with the test."""
    before = list(gc.callbacks)
    yield
    gc.callbacks[:] = before


def _batches(n, rows=2, seq=8):
    out = []
    for k in range(n):
        labels = torch.full((rows, seq), k, dtype=torch.long)
        labels[:, :k % seq] = bench_clock.IGNORE_INDEX  # batch k: k ignored positions a row
        out.append({"tokens": torch.zeros(rows, seq, dtype=torch.long), "labels": labels})
    return out


def test_the_clock_synchronizes_before_each_read_and_times_batches_w_to_w_plus_n(monkeypatch, tmp_path):
    events, now = [], iter([10.0, 12.5])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: events.append("sync"))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: 3 * 2**30)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda *a: 4 * 2**30)

    def clock():
        events.append("clock")
        return next(now)

    monkeypatch.setattr(bench_clock.time, "perf_counter", clock)

    def loader():
        for k, batch in enumerate(_batches(10)):
            events.append(f"fetch {k}")
            yield batch

    path = tmp_path / "clock.json"
    timer = bench_clock.Clock(str(path), warmup=2, window=5)
    for _ in bench_clock.ClockedIterator(loader(), timer):
        pass
    # The GPU waits before the clock is read, at the request for batch 2 and for batch 7.
    assert events[:2] == ["fetch 0", "fetch 1"]
    assert events[2:5] == ["sync", "clock", "fetch 2"]
    assert events[9:12] == ["sync", "clock", "fetch 7"] and events.count("clock") == 2
    result = json.loads(path.read_text())  # written when the window closed
    assert result["tokens"] == 5 * 2 * 8  # batches 2..6, every token
    assert result["label_tokens"] == sum(2 * (8 - k) for k in range(2, 7))
    assert result["seconds"] == 2.5 and result["tokens_per_s"] == 80 / 2.5
    assert result["label_tokens_per_s"] == result["label_tokens"] / 2.5
    assert result["peak_alloc_gib"] == 3.0 and result["peak_reserved_gib"] == 4.0
    assert result["window_peak_alloc_gib"] == 3.0 and result["window_peak_reserved_gib"] == 4.0
    assert timer.fetched == 10


def test_the_host_time_of_each_window_step_is_kept_in_order(monkeypatch, tmp_path):
    """``host_step_seconds``: one interval per batch of the window, from each request to the
    next, in order, read after the clock's synchronized reads (so they span its window); a
    stalled step stands out. An epoch ending inside the window (3-batch epochs here: the loader
    found empty, then asked again for the same batch) adds no interval and moves no read."""
    events = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: events.append("sync"))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: 0)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda *a: 0)
    clock_reads = iter([10.0, 17.0])
    monkeypatch.setattr(bench_clock.time, "perf_counter", lambda: events.append("clock") or next(clock_reads))
    requests = iter([0.0, 1.0, 2.0, 2.5, 3.0, 6.0, 6.5, 7.0, 8.0, 9.0])  # batch 4's step stalls

    def monotonic():
        events.append("host")
        return next(requests)

    monkeypatch.setattr(bench_clock.time, "monotonic", monotonic)
    timer = bench_clock.Clock(str(tmp_path / "c.json"), warmup=2, window=5)
    batches = _batches(9)
    for epoch in range(3):
        for _ in bench_clock.ClockedIterator(iter(batches[3 * epoch:3 * epoch + 3]), timer):
            pass
    result = json.loads((tmp_path / "c.json").read_text())
    assert result["host_step_seconds"] == [0.5, 0.5, 3.0, 0.5, 0.5]  # batches 2..6
    assert result["batch_tokens"] == [16] * 5 and result["graphs_compiled"] == []
    assert events[2:5] == ["sync", "clock", "host"] and events.count("clock") == 2
    # one host read per batch number asked for (0..9: the last finds the loader empty)
    assert result["seconds"] == 7.0 and events.count("host") == 10 and timer.fetched == 9


def test_a_run_too_short_for_the_window_reports_no_rate(tmp_path):
    timer = bench_clock.Clock(str(tmp_path / "c.json"), warmup=2, window=5)
    batches = bench_clock.ClockedIterator(iter(_batches(10)), timer)
    for _ in range(7):  # the recipe stops before it asks for batch 7
        next(batches)
    timer.write()
    result = json.loads((tmp_path / "c.json").read_text())
    assert "tokens_per_s" not in result and result["batches_fetched"] == 7
    with pytest.raises(ValueError, match="window >= 1"):
        bench_clock.Clock("x", warmup=0, window=0)


_RECIPE = """
import torch
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader

rows = [{"tokens": torch.zeros(8, dtype=torch.long), "labels": torch.full((8,), -100)} for _ in range(12)]
rows[5]["labels"][:3] = 1
torch.cuda.reset_peak_memory_stats()  # the recipes' logging: a no-op here (on a CPU it would raise)
for loader in (StatefulDataLoader(rows[:6], batch_size=2), DataLoader(rows[6:], batch_size=2)):
    for batch in loader:
        pass
"""


@pytest.mark.parametrize("fetch", [True, False])
def test_the_hook_times_both_loaders_of_a_recipe_process_and_writes_at_exit(tmp_path, fetch):
    """Through sitecustomize, as a run of either side sees it: a script in a ``recipes`` folder
    that iterates torchdata's and torch's loaders (6 batches of 2 x 8 tokens; the clock counts
    batches 1..4 across both), and that resets CUDA's peak counters. A process that fetches no
    batch (a launcher) writes nothing."""
    (tmp_path / "recipes").mkdir()
    script = tmp_path / "recipes" / "full_finetune_single_device.py"
    script.write_text(_RECIPE if fetch else "import torch\n")
    env = {**os.environ, "PYTHONPATH": str(SCRIPTS / "bench_hooks"), "CUDA_VISIBLE_DEVICES": "",
           "BENCH_CLOCK": str(tmp_path / "clock.json"), "BENCH_CLOCK_WARMUP": "1", "BENCH_CLOCK_WINDOW": "4"}
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    if not fetch:
        assert not (tmp_path / "clock.json").exists()
        return
    result = json.loads((tmp_path / "clock.json").read_text())
    assert result["batches_fetched"] == 6 and result["tokens"] == 4 * 2 * 8
    assert result["label_tokens"] == 3 and result["tokens_per_s"] > 0



def test_bitsandbytes_paged_states_are_read_apart(monkeypatch, tmp_path):
    """Paged optimizer states (CUDA managed memory, outside torch's allocator counts) are read
    from bitsandbytes' page manager, when bitsandbytes is loaded, as ``paged_gib``."""
    import types

    monkeypatch.delitem(sys.modules, "bitsandbytes.functional", raising=False)
    assert bench_clock.paged_gib() == 0.0
    manager = types.SimpleNamespace(paged_tensors=[torch.zeros(2**20, dtype=torch.uint8),
                                                   torch.zeros(2**18, dtype=torch.float32)])
    functional = types.SimpleNamespace(GlobalPageManager=types.SimpleNamespace(get_instance=lambda: manager))
    monkeypatch.setitem(sys.modules, "bitsandbytes.functional", functional)
    assert bench_clock.paged_gib() == 2 * 2**20 / 2**30
    clock = bench_clock.Clock(str(tmp_path / "clock.json"))
    clock.count(_batches(1)[0])
    assert clock.result()["paged_gib"] == 2 * 2**20 / 2**30


def test_each_rank_of_a_distributed_run_writes_its_own_file(monkeypatch):
    """Rank 0 (or a single process) writes the path the bench named; rank r > 0 beside it, so
    two ranks' clocks (and memory reports) never overwrite each other."""
    monkeypatch.delenv("RANK", raising=False)
    assert bench_clock.rank_path("/w/run.clock.json") == "/w/run.clock.json"
    monkeypatch.setenv("RANK", "0")
    assert bench_clock.rank_path("/w/run.clock.json") == "/w/run.clock.json"
    monkeypatch.setenv("RANK", "3")
    assert bench_clock.rank_path("/w/run.clock.json") == "/w/run.clock.json.rank3"


def test_the_window_steps_that_compiled_new_graphs_are_named(monkeypatch, tmp_path):
    """``graphs_compiled``: [window step, graphs] for each step whose interval saw torch.compile
    make graphs (here: a function compiled, then recompiled for a new length, inside the
    window's steps 1 and 3), nothing for the others, none before the window."""
    import torch._dynamo

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    double = torch.compile(lambda x: x * 2, backend="eager", dynamic=False)
    timer = bench_clock.Clock(str(tmp_path / "c.json"), warmup=2, window=5)
    lengths = {0: 3, 3: 4, 5: 5}  # batch -> a length to compile for in its step
    for k, _ in enumerate(bench_clock.ClockedIterator(iter(_batches(8)), timer)):
        if k in lengths:
            double(torch.ones(lengths[k]))
    result = json.loads((tmp_path / "c.json").read_text())
    # batch 3 is the window's step 1 (batches 2..6), batch 5 its step 3; batch 0 before it
    assert result["graphs_compiled"] == [[1, 1], [3, 1]]
    torch._dynamo.reset()


def test_full_collections_inside_the_window_are_named_by_step(tmp_path):
    """``gc_pauses``: [window step, generation, seconds] for each full collection while a window
    step runs (here one forced in the step of batch 4, the window's step 2, and one in the
    dataloader's fetch of batch 6, which belongs to step 4), none before or after the window."""
    timer = bench_clock.Clock(str(tmp_path / "c.json"), warmup=2, window=5)

    def loader():
        for k, batch in enumerate(_batches(9)):
            if k in (0, 6, 8):
                gc.collect()  # inside the fetch of batch k
            yield batch

    for k, _ in enumerate(bench_clock.ClockedIterator(loader(), timer)):
        if k in (1, 4):
            gc.collect()
    result = json.loads((tmp_path / "c.json").read_text())
    assert [(step, gen) for step, gen, _ in result["gc_pauses"]] == [(2, 2), (4, 2)]
    assert all(seconds > 0 for *_, seconds in result["gc_pauses"])


def test_allocator_calls_and_the_sm_clock_are_read_per_window_step(monkeypatch, tmp_path):
    """``allocator_events``: the steps in which the caching allocator went to the driver, with
    the counters' changes; ``sm_clock_mhz``: the SM clock at each step's end (null without
    NVML)."""
    counts = {"num_device_alloc": 10, "num_device_free": 0, "num_alloc_retries": 0}
    clocks = iter([1980, 1980, 1410, 1980, 1980])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: 0)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda *a: 0)
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda *a: dict(counts))
    looked_up = []
    monkeypatch.setattr(bench_clock, "_sm_clock_reader",
                        lambda: looked_up.append(1) or (lambda: next(clocks)))
    timer = bench_clock.Clock(str(tmp_path / "c.json"), warmup=2, window=5)
    for k, _ in enumerate(bench_clock.ClockedIterator(iter(_batches(8)), timer)):
        if k == 1:  # before the window
            counts["num_device_alloc"] += 5
        if k == 3:  # the window's step 1
            counts["num_device_alloc"] += 2
        if k == 5:  # step 3: the cache freed to retry an allocation
            counts["num_device_free"] += 7
            counts["num_alloc_retries"] += 1
    result = json.loads((tmp_path / "c.json").read_text())
    assert result["allocator_events"] == [
        [1, {"num_device_alloc": 2}], [3, {"num_device_free": 7, "num_alloc_retries": 1}]]
    assert result["sm_clock_mhz"] == [1980, 1980, 1410, 1980, 1980]
    assert looked_up == [1]  # NVML's handle looked up once, not at every step

    monkeypatch.setattr(bench_clock, "_sm_clock_reader", lambda: None)  # no pynvml
    timer = bench_clock.Clock(str(tmp_path / "d.json"), warmup=1, window=3)
    for _ in bench_clock.ClockedIterator(iter(_batches(5)), timer):
        pass
    assert json.loads((tmp_path / "d.json").read_text())["sm_clock_mhz"] == [None] * 3


def test_without_pynvml_the_sm_clock_reader_is_none(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_pynvml(name, *a, **k):
        if name == "pynvml":
            raise ModuleNotFoundError("No module named 'pynvml'")
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_pynvml)
    assert bench_clock._sm_clock_reader() is None


def test_the_gc_freeze_lever_freezes_once_when_the_warmup_ends(monkeypatch, tmp_path):
    """``freeze_gc`` (BENCH_GC_FREEZE=1): one full collection and ``gc.freeze()`` at the request
    for the window's first batch, before the clock's first read; never without the lever."""
    events, reads = [], iter(range(1, 100))
    monkeypatch.setattr(gc, "collect", lambda *a: events.append(("collect", timer.fetched)) or 0)
    monkeypatch.setattr(gc, "freeze", lambda: events.append(("freeze", timer.fetched)))
    monkeypatch.setattr(bench_clock, "_sync_and_read_clock", lambda: events.append("clock") or next(reads))
    timer = bench_clock.Clock(str(tmp_path / "c.json"), warmup=2, window=3, freeze_gc=True)
    for _ in bench_clock.ClockedIterator(iter(_batches(6)), timer):
        pass
    assert events == [("collect", 2), ("freeze", 2), "clock", "clock"]
    events.clear()
    timer = bench_clock.Clock(str(tmp_path / "d.json"), warmup=2, window=3)
    for _ in bench_clock.ClockedIterator(iter(_batches(6)), timer):
        pass
    assert events == ["clock", "clock"]


def test_the_loader_time_of_each_window_step_is_its_own(tmp_path):
    """``host_fetch_seconds``: the host's time inside the loader for each window batch, the
    slow fetch (batch 4, the window's step 2) in its own place."""
    import time

    def loader():
        for k, batch in enumerate(_batches(8)):
            if k == 4:
                time.sleep(0.05)
            yield batch

    timer = bench_clock.Clock(str(tmp_path / "c.json"), warmup=2, window=5)
    for _ in bench_clock.ClockedIterator(loader(), timer):
        pass
    fetch = json.loads((tmp_path / "c.json").read_text())["host_fetch_seconds"]
    assert len(fetch) == 5
    assert fetch[2] >= 0.05 and max(fetch[:2] + fetch[3:]) < 0.05


def test_the_host_sampler_names_where_the_main_thread_spent_the_window(tmp_path):
    """BENCH_HOST_SAMPLES=1: stacks sampled only while the window runs; a window step that
    spends most of its time in one function shows that function's share of the time, inclusive
    of what it calls, and the innermost function as the leaf. The busy function holds the GIL,
    so it is sampled less often than the sleep beside it: only the samples' weights (the time
    each stands for) give it its ~85% share."""
    import time

    from host_sampler import HostSampler

    def busy_inner(seconds):
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            pass

    def heavy_step():
        busy_inner(0.04)

    switch = sys.getswitchinterval()
    sampler = HostSampler(interval=0.001)
    timer = bench_clock.Clock(str(tmp_path / "c.json"), warmup=2, window=5, sampler=sampler)
    for k, _ in enumerate(bench_clock.ClockedIterator(iter(_batches(8)), timer)):
        if k == 1:  # before the window: not sampled
            assert sampler.samples == 0
            continue
        if 2 <= k < 7:
            heavy_step()
            time.sleep(0.005)
    samples = json.loads((tmp_path / "c.json").read_text())["host_samples"]
    assert sys.getswitchinterval() == switch  # restored when the window closed
    main = samples["threads"]["main"]
    shares = dict(main["inclusive"])
    step_share = next(v for k, v in shares.items() if k.endswith(" heavy_step"))
    leaf_share = next(v for k, v in main["leaf"] if k.endswith(" busy_inner"))
    assert step_share > 0.7 and leaf_share > 0.7
    assert main["seconds"] >= 0.15 and samples["samples"] >= 10
    assert not sampler._thread.is_alive()  # stopped when the window closed
    taken = sampler.samples
    time.sleep(0.01)
    assert sampler.samples == taken


def test_the_gpu_sleep_lever_queues_one_timed_sleep_a_window_step(monkeypatch, tmp_path):
    """BENCH_GPU_SLEEP_MS: before each window step a sleep kernel of the asked length at the SM
    clock NVML reads when the warm-up ends, with events around it; the clock reports the sleeps'
    own time and the window less them, per step."""
    sleeps, now = [], iter([10.0, 10.5])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: 0)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda *a: 0)
    monkeypatch.setattr(torch.cuda, "_sleep", sleeps.append)
    monkeypatch.setattr(bench_clock.time, "perf_counter", lambda: next(now))
    monkeypatch.setattr(bench_clock, "_sm_clock_reader", lambda: (lambda: 1500))

    class Event:  # each sleep takes 30 ms on the device's timeline
        def __init__(self, enable_timing=False):
            assert enable_timing

        def record(self, stream=None):
            pass

        def elapsed_time(self, end):
            return 30.0

    monkeypatch.setattr(torch.cuda, "Event", Event)
    timer = bench_clock.Clock(str(tmp_path / "c.json"), warmup=2, window=5, gpu_sleep_ms=30)
    for _ in bench_clock.ClockedIterator(iter(_batches(8)), timer):
        pass
    result = json.loads((tmp_path / "c.json").read_text())
    assert sleeps == [30 * 1500 * 1000] * 5  # window steps only: 30 ms at 1,500 MHz
    assert result["gpu_sleep_seconds"] == pytest.approx(0.15) and result["gpu_sleep_asked_ms"] == 30
    assert result["gpu_sleep_ms_per_step"] == pytest.approx(30.0)
    assert result["window_less_sleeps_ms_per_step"] == pytest.approx((0.5 - 0.15) / 5 * 1e3)

    sleeps.clear()  # no SM clock from NVML: no sleep (cycles timed alone run short), said so
    now = iter([10.0, 10.5])
    monkeypatch.setattr(bench_clock, "_sm_clock_reader", lambda: None)
    timer = bench_clock.Clock(str(tmp_path / "e.json"), warmup=2, window=5, gpu_sleep_ms=30)
    for _ in bench_clock.ClockedIterator(iter(_batches(8)), timer):
        pass
    result = json.loads((tmp_path / "e.json").read_text())
    assert sleeps == [] and "no SM clock" in result["gpu_sleep_note"]
    assert "window_less_sleeps_ms_per_step" not in result
    with pytest.raises(ValueError, match="gpu_sleep_ms must be >= 0"):
        bench_clock.Clock(str(tmp_path / "f.json"), gpu_sleep_ms=-1)

    sleeps.clear()  # without the lever: no sleep, no such fields
    now = iter([10.0, 10.5])
    timer = bench_clock.Clock(str(tmp_path / "d.json"), warmup=2, window=5)
    for _ in bench_clock.ClockedIterator(iter(_batches(8)), timer):
        pass
    result = json.loads((tmp_path / "d.json").read_text())
    assert sleeps == [] and not any(k.startswith(("gpu_sleep", "window_less")) for k in result)
