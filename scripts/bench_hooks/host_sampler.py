"""Where a step spends the host's time: a thread that reads every other thread's Python stack at
a fixed interval while the benchmark clock's window runs (``BENCH_HOST_SAMPLES=1`` with
``BENCH_CLOCK``; bench_clock.py starts and stops it).

Each sample names, for each thread, the functions on its stack (``inclusive``: the share of
the window's time with the function anywhere on the stack, e.g. the recipe's loss step and
everything it calls) and the innermost Python function (``leaf``: where the thread was, C calls
such as a kernel launch counted in the Python function that made them). The thread that
started the sampler is ``main``; the others are named with their id (the autograd engine's
device thread, which runs a CUDA backward while ``main`` waits in ``torch.autograd.backward``,
has no Python name: ``thread #<id>``).

NOTE: a sample needs the GIL. A busy thread hands it over at the interpreter's switch
interval, a waiting one (a sleep, a synchronize, backward's wait) at once: counted alike,
samples would overweight the waits. Each sample therefore weighs the time since the one before
it, and while sampling the switch interval is the sampling interval (restored after), so a
busy span is read about as often as a waiting one. A span ended by a wait is still charged to
the wait: wait shares are upper bounds. Sampling did not slow the measured window (one run
each); shares, not a sampled run's tokens/s, are what it is for.
"""

import collections
import os
import sys
import threading
import time

TOP = 80  # functions reported a thread, by share (the stack's ~15 outer frames hold 100%)


def _key(code) -> str:
    folder, name = os.path.split(code.co_filename)
    return f"{os.path.basename(folder)}/{name}:{code.co_firstlineno} {code.co_name}"


class HostSampler:
    def __init__(self, interval: float = 0.001):
        self.interval = interval
        self.samples = 0
        self.seconds = 0.0  # the time the samples stand for
        self._inclusive = collections.defaultdict(collections.Counter)
        self._leaf = collections.defaultdict(collections.Counter)
        self._seen = collections.Counter()  # seconds of samples in which each thread was found
        self._stop = threading.Event()
        self._thread = None
        self._main = None

    def start(self) -> None:
        if self._thread is not None:
            return
        self._main = threading.get_ident()
        self._switch = sys.getswitchinterval()
        sys.setswitchinterval(self.interval)
        self._thread = threading.Thread(target=self._run, name="bench-host-sampler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        sys.setswitchinterval(self._switch)

    def _thread_name(self, ident: int) -> str:
        if ident == self._main:
            return "main"
        thread = threading._active.get(ident)  # noqa: SLF001 - names of Python's own threads
        # with the id: two threads of one name (two progress-bar monitors) stay apart
        return f"{thread.name if thread is not None else 'thread'} #{ident}"

    def _run(self) -> None:
        me = threading.get_ident()
        last = time.perf_counter()
        while not self._stop.is_set():
            time.sleep(self.interval)
            frames = sys._current_frames()  # noqa: SLF001 - the one way to read other stacks
            now = time.perf_counter()
            weight, last = now - last, now
            self.samples += 1
            self.seconds += weight
            for ident, frame in frames.items():
                if ident == me:
                    continue
                name = self._thread_name(ident)
                self._seen[name] += weight
                self._leaf[name][_key(frame.f_code)] += weight
                keys = set()
                while frame is not None:
                    keys.add(_key(frame.f_code))
                    frame = frame.f_back
                for key in keys:
                    self._inclusive[name][key] += weight
            del frames

    def result(self) -> dict:
        threads = {}
        for name, seen in self._seen.most_common():
            threads[name] = {
                "seconds": round(seen, 4),
                "inclusive": [[k, round(n / seen, 4)] for k, n in self._inclusive[name].most_common(TOP)],
                "leaf": [[k, round(n / seen, 4)] for k, n in self._leaf[name].most_common(TOP)],
            }
        return {"samples": self.samples, "seconds": round(self.seconds, 4),
                "interval_s": self.interval, "threads": threads}
