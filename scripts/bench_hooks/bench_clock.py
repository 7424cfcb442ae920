"""The benchmark's clock: one timer outside both recipes, identical for torchtune's stock recipe
and ours (scripts/bench_recipes.py turns it on with ``BENCH_CLOCK=<json path>``;
sitecustomize.py installs it in the training process).

It wraps every DataLoader iterator of the process. When the recipe asks for batch ``W`` and
again for batch ``W + N`` (``BENCH_CLOCK_WARMUP``, ``BENCH_CLOCK_WINDOW``), it waits for the
GPU (``torch.cuda.synchronize``) and only then reads ``time.perf_counter()``: the span holds the
work of batches ``W .. W+N-1`` whatever each recipe synchronizes (or not) on its own. Tokens are
counted from the batches themselves: every token of the batch (``tokens.numel()``, padding and
pack filler included: that is what the GPU computes) and the label tokens (``labels != -100``).
Batches arrive on the CPU, so counting them never waits for the GPU.

Peak memory is the run's true peak: both recipes reset CUDA's peak counters while they log,
so the hook makes ``torch.cuda.reset_peak_memory_stats`` a no-op in this process and reads
``max_memory_allocated`` / ``max_memory_reserved`` at exit (and, as ``window_peak_*``, when the
window closes: the training steps' peak, before the recipe's final checkpoint save). Memory
outside torch's allocator that the run keeps on the GPU is read apart: bitsandbytes' paged
optimizer states (``PagedAdamW8bit``, torchtune's full configs; CUDA managed memory, which the
optimizer's kernels use on the GPU) as ``paged_gib``, allocated at the first step and held.

Where the window's time went, step by step: ``host_step_seconds``, the host's time from each
batch request of the window to the next (``time.monotonic``, never synchronized, so the GPU
may still be working on earlier steps; the first interval starts and the last ends at the
clock's synchronized reads, so they sum to the window's seconds). Of each, ``host_fetch_seconds``: the
time the host spent inside the loader for that step's batch (fetch, collate; in the training
process, unless the loader has workers). One long interval among
short ones is a stall (a recompile, a host sync, a collection); a spread of two runs of the
same config shows whether one step or every step got slower. Beside them, ``batch_tokens`` (each
window batch's tokens, the work a step's time goes with) and ``graphs_compiled`` (each window
step whose interval saw torch.compile's Dynamo capture new graphs, as [step, graphs]: a step's
time changing with no new graph and no longer batch is not a Dynamo recompile nor the data).
What else can stall or slow a step, read per window step where it happened: ``gc_pauses``
([step, generation, seconds] for each of Python's full collections, and any other of at least
``GC_PAUSE_S``: a full one walks every object the process holds, torch.compile's included),
``allocator_events`` ([step, {counter: change}] where the CUDA caching allocator called
cudaMalloc or cudaFree, or freed its cache to retry an allocation) and ``sm_clock_mhz`` (the
GPU's SM clock as NVML last sampled it at each step's end, over a 1/6 to 1 s period, through
pynvml where it is installed: a GPU slowed by its power or temperature limits shows here, else
null).

With ``BENCH_HOST_SAMPLES=1``, ``host_samples``: every thread's Python stack sampled while the
window runs (host_sampler.py), the share of the window's time each function held.

A lever on top (``BENCH_GC_FREEZE=1``, ``freeze_gc``): when the warm-up ends, before the
clock's first read, one full collection, then ``gc.freeze()`` (every object alive then, the
compiled graphs' included, is left out of later collections): does a full collection inside the
window cost a step its time?

The numbers go to the JSON file ``BENCH_CLOCK`` names (rank r > 0 of a distributed run:
``<path>.rank<r>``), written when the window closes and again at exit.
"""

import atexit
import gc
import json
import os
import time

import torch

IGNORE_INDEX = -100  # torchtune's CROSS_ENTROPY_IGNORE_IDX
GIB = 2**30
GC_PAUSE_S = 0.005  # a young-generation collection this long is reported too
# The collections' own timer, bound once: a gc callback runs inside whatever code allocated, so
# it must not depend on (or disturb) anything patched or mocked later, nor ever raise.
_gc_timer = time.perf_counter
# The loader's timer (``host_fetch_seconds``), bound once for the same reason: it reads apart from
# the clock's own reads and the host-step intervals.
_fetch_timer = time.perf_counter
# torch.cuda.memory_stats() counters that mean the caching allocator went to the driver
ALLOCATOR_COUNTERS = ("num_device_alloc", "num_device_free", "num_alloc_retries")


def _sync_and_read_clock() -> float:
    # NOTE: the synchronize must come first: CUDA work is queued asynchronously, and a clock read
    # before it would time how fast Python queues work, not how fast the GPU does it.
    if _cuda_in_use():
        torch.cuda.synchronize()
    return time.perf_counter()


def _graphs_compiled() -> int:
    """How many graphs torch.compile's Dynamo has captured in this process so far (recompiles
    included)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _cuda_in_use() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def _allocator_counts() -> dict:
    if not _cuda_in_use():
        return {}
    stats = torch.cuda.memory_stats()
    return {k: stats.get(k, 0) for k in ALLOCATOR_COUNTERS}


def _sm_clock_reader():
    """A function returning the GPU's SM clock in MHz (NVML's latest sample, over its 1/6 to 1 s
    period), or None where NVML (pynvml) cannot be read. The device's handle is looked up once:
    torch.cuda.clock_rate() initializes NVML and maps the device index at every call."""
    try:
        import pynvml

        handle = torch.cuda._get_pynvml_handler(torch.cuda.current_device())

        def read() -> int:
            return int(pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM))

        read()
        return read
    except Exception:  # no pynvml, no NVML, a GPU it does not know: say nothing
        return None


class Clock:
    def __init__(self, path: str, warmup: int = 5, window: int = 20, freeze_gc: bool = False,
                 sampler=None, gpu_sleep_ms: float = 0.0):
        if warmup < 0 or window < 1:
            raise ValueError(f"bench clock: need warmup >= 0 and window >= 1, got {warmup}, {window}")
        self.path, self.warmup, self.window, self.freeze_gc = path, warmup, window, freeze_gc
        self.sampler = sampler  # host_sampler.HostSampler, run while the window runs
        # A sleep kernel of about gpu_sleep_ms queued before each window step, timed by events
        # around it: does more GPU work a step lengthen the step by as much (the GPU's timeline
        # sets it) or less (the host's does)? With a sleep long enough to keep the GPU the slower
        # side, the window less its sleeps is the steps' GPU time; shorter, it also holds idle.
        if gpu_sleep_ms < 0:
            raise ValueError(f"bench clock: gpu_sleep_ms must be >= 0, got {gpu_sleep_ms}")
        self.gpu_sleep_ms, self._sleep_cycles, self._sleep_events = gpu_sleep_ms, 0, []
        self.gpu_sleep_seconds, self.gpu_sleep_note = None, None
        self.fetched = 0  # batches handed to the recipe so far
        self.tokens = self.label_tokens = 0  # of batches warmup .. warmup + window - 1
        self.start = self.seconds = None
        self.at_window_end = {}
        self.host_step_seconds, self._last_request, self._requested = [], None, -1
        self.batch_tokens, self.graphs_compiled, self.host_fetch_seconds = [], [], []
        self.gc_pauses, self.allocator_events, self.sm_clock_mhz = [], [], []
        self._step = None  # the window step whose interval is running, else None
        self._gc_started = None
        self._allocator = {}
        self._sm_clock = None  # NVML's reader, looked up when the warm-up ends
        # NOTE: read once here: the first read imports torch._dynamo (~1 s), which must not land
        # inside a timed step.
        self._graphs = _graphs_compiled()
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        try:
            if phase == "start":
                self._gc_started = _gc_timer()
                return
            if self._step is None or self._gc_started is None:
                return
            seconds = _gc_timer() - self._gc_started
            if info["generation"] == 2 or seconds >= GC_PAUSE_S:
                self.gc_pauses.append([self._step, info["generation"], round(seconds, 4)])
        except Exception:  # noqa: BLE001 - never into the code the collection interrupted
            pass

    def before_fetch(self) -> None:
        """The recipe asks for batch number ``self.fetched``."""
        # NOTE: once per batch. At the end of an epoch the request that finds the loader empty
        # fetches nothing, and the next epoch asks again for the same batch number: a second
        # read there would restart the window, or stretch it over the epoch's end.
        if self.fetched == self._requested:
            return
        self._requested = self.fetched
        if self.fetched == self.warmup:
            if self.freeze_gc:  # before the clock starts: the collection itself is not timed
                gc.collect()
                gc.freeze()
            if _cuda_in_use():  # NVML's init and handle lookup, before the clock starts too
                self._sm_clock = _sm_clock_reader()
                if self.gpu_sleep_ms:
                    self._sleep_cycles = _sleep_cycles_for(self.gpu_sleep_ms, self._sm_clock)
                    if not self._sleep_cycles:
                        self.gpu_sleep_note = "no SM clock from NVML: no sleep queued"
            self.start = _sync_and_read_clock()
            if self.sampler is not None:
                self.sampler.start()
        elif self.fetched == self.warmup + self.window:
            if self.sampler is not None:  # before the clock's wait for the GPU, not a step's
                self.sampler.stop()
            self.seconds = _sync_and_read_clock() - self.start
            # the events are complete: read after the synchronize above
            self.gpu_sleep_seconds = sum(a.elapsed_time(b) for a, b in self._sleep_events) / 1e3
        # After the synchronized reads: the intervals span the clock's window exactly.
        now = time.monotonic()
        # the interval starting now: window step fetched - warmup, if inside the window (set
        # first: a collection during the reads below is this interval's)
        ending, step = self._step, self.fetched - self.warmup
        self._step = step if 0 <= step < self.window else None
        if self._sleep_cycles and self._step is not None:
            events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            events[0].record()
            torch.cuda._sleep(self._sleep_cycles)
            events[1].record()
            self._sleep_events.append(events)
        graphs = _graphs_compiled()
        allocator = _allocator_counts()
        if self.warmup < self.fetched <= self.warmup + self.window:
            self.host_step_seconds.append(now - self._last_request)
            if graphs > self._graphs:
                self.graphs_compiled.append([ending, graphs - self._graphs])
            changed = {k: v - self._allocator.get(k, 0) for k, v in allocator.items()
                       if v != self._allocator.get(k, 0)}
            if changed:
                self.allocator_events.append([ending, changed])
            try:
                self.sm_clock_mhz.append(self._sm_clock() if self._sm_clock else None)
            except Exception:  # NVML gone mid-run: null from here on
                self._sm_clock = None
                self.sm_clock_mhz.append(None)
        self._last_request, self._graphs, self._allocator = now, graphs, allocator
        if self.fetched == self.warmup + self.window:
            self.at_window_end = self._peaks("window_")  # training only: before the final save
            self.write()

    def count(self, batch, fetch_seconds: float = 0.0) -> None:
        """``batch``, handed out after ``fetch_seconds`` of the host's time in the loader."""
        if self.warmup <= self.fetched < self.warmup + self.window:
            self.host_fetch_seconds.append(round(fetch_seconds, 5))
            self.tokens += batch["tokens"].numel()
            self.batch_tokens.append(batch["tokens"].numel())
            if "labels" in batch:
                self.label_tokens += int((batch["labels"] != IGNORE_INDEX).sum())
        self.fetched += 1

    def result(self) -> dict:
        out = {"warmup_batches": self.warmup, "window_batches": self.window,
               "batches_fetched": self.fetched}
        if self.seconds is not None:
            out.update(tokens=self.tokens, label_tokens=self.label_tokens, seconds=self.seconds,
                       tokens_per_s=self.tokens / self.seconds,
                       label_tokens_per_s=self.label_tokens / self.seconds,
                       host_step_seconds=[round(t, 4) for t in self.host_step_seconds],
                       host_fetch_seconds=self.host_fetch_seconds,
                       batch_tokens=self.batch_tokens, graphs_compiled=self.graphs_compiled,
                       gc_pauses=self.gc_pauses, allocator_events=self.allocator_events,
                       sm_clock_mhz=self.sm_clock_mhz)
        if self.sampler is not None and self.seconds is not None:
            out["host_samples"] = self.sampler.result()
        if self._sleep_events and self.seconds is not None:
            out.update(gpu_sleep_asked_ms=self.gpu_sleep_ms, gpu_sleep_seconds=self.gpu_sleep_seconds,
                       gpu_sleep_ms_per_step=self.gpu_sleep_seconds / self.window * 1e3,
                       window_less_sleeps_ms_per_step=(self.seconds - self.gpu_sleep_seconds) / self.window * 1e3)
        if self.gpu_sleep_note:
            out["gpu_sleep_note"] = self.gpu_sleep_note
        paged = paged_gib()
        return {**out, **self.at_window_end, **self._peaks(""), **({"paged_gib": paged} if paged else {})}

    @staticmethod
    def _peaks(prefix: str) -> dict:
        if not _cuda_in_use():
            return {}
        return {f"{prefix}peak_alloc_gib": torch.cuda.max_memory_allocated() / GIB,
                f"{prefix}peak_reserved_gib": torch.cuda.max_memory_reserved() / GIB}

    def write(self) -> None:
        if self.fetched == 0:  # a launcher (torchrun, the CLI before it) that trains nothing
            return
        with open(self.path, "w") as f:
            json.dump(self.result(), f, indent=1)


def paged_gib() -> float:
    """GiB of bitsandbytes' paged tensors (its paged optimizers' states), 0.0 without any."""
    import sys

    functional = sys.modules.get("bitsandbytes.functional")
    if functional is None:
        return 0.0
    tensors = functional.GlobalPageManager.get_instance().paged_tensors
    return sum(t.numel() * t.element_size() for t in tensors) / GIB


class ClockedIterator:
    """A DataLoader iterator that tells the clock about every batch it hands out."""

    def __init__(self, inner, clock: Clock):
        self._inner, self._clock = inner, clock

    def __iter__(self):
        return self

    def __next__(self):
        self._clock.before_fetch()
        started = _fetch_timer()
        batch = next(self._inner)
        self._clock.count(batch, _fetch_timer() - started)
        return batch

    def __len__(self):
        return len(self._inner)

    def __getattr__(self, name):  # anything else a loader's iterator offers
        return getattr(self._inner, name)


def install(clock: Clock) -> None:
    """Wrap the iterators of torch's DataLoader and torchdata's StatefulDataLoader (each defines
    its own ``__iter__``), keep peak memory counters from being reset, and write at exit."""
    import torch.utils.data

    classes = [torch.utils.data.DataLoader]
    try:
        from torchdata.stateful_dataloader import StatefulDataLoader

        classes.append(StatefulDataLoader)
    except ImportError:
        pass
    for cls in classes:
        original = cls.__dict__["__iter__"]

        def __iter__(self, _original=original):
            it = _original(self)
            # a subclass's __iter__ may call its parent's: wrap once
            return it if isinstance(it, ClockedIterator) else ClockedIterator(it, clock)

        cls.__iter__ = __iter__
    torch.cuda.reset_peak_memory_stats = torch.cuda.memory.reset_peak_memory_stats = lambda *a, **k: None
    atexit.register(clock.write)


def rank_path(path: str) -> str:
    """This process's file for ``path``: rank r > 0 of a distributed run writes ``<path>.rank<r>``."""
    rank = int(os.environ.get("RANK", "0"))
    return path if rank == 0 else f"{path}.rank{rank}"


def _sampler_from_env():
    if os.environ.get("BENCH_HOST_SAMPLES") != "1":
        return None
    from host_sampler import HostSampler

    return HostSampler()


def _sleep_cycles_for(ms: float, sm_clock=None) -> int:
    """GPU clock cycles that ``torch.cuda._sleep`` spins for about ``ms`` milliseconds at the SM
    clock NVML reads now (the training's clock, at the warm-up's end); 0 without NVML. The
    sleeps are timed again where they run (events around each).

    NOTE: never timed alone instead: a lone one-thread sleep kernel lets the GPU clock down, so
    cycles timed that way ran ~4x shorter than asked inside the training's window."""
    mhz = sm_clock() if sm_clock is not None else None
    return int(ms * mhz * 1e3) if mhz else 0


def install_from_env() -> Clock:
    clock = Clock(rank_path(os.environ["BENCH_CLOCK"]),
                  int(os.environ.get("BENCH_CLOCK_WARMUP", "5")),
                  int(os.environ.get("BENCH_CLOCK_WINDOW", "20")),
                  freeze_gc=os.environ.get("BENCH_GC_FREEZE") == "1",
                  sampler=_sampler_from_env(),
                  gpu_sleep_ms=float(os.environ.get("BENCH_GPU_SLEEP_MS", "0")))
    install(clock)
    return clock
