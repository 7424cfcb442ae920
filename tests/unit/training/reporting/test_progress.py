"""StepReporter timing: the clock is read only after the device is synchronized, and every
step's time and tokens land in exactly one logged window."""

import json
import subprocess
import sys

import pytest
import torch

from tune_recipes.training.reporting.progress import StepReporter

pytestmark = pytest.mark.unit


class _Log:
    def __init__(self):
        self.rows = []

    def log_dict(self, payload, step):
        self.rows.append((step, dict(payload)))

    def close(self):
        pass


class _FakeDevice:
    """Queued work finishes only at synchronize(); the clock advances by the queued time."""

    def __init__(self):
        self.events, self.now, self.queued = [], 0.0, 0.0

    def queue(self, seconds):
        self.queued += seconds

    def synchronize(self):
        self.events.append("sync")
        self.now += self.queued
        self.queued = 0.0

    def clock(self):
        self.events.append("clock")
        return self.now


def _reporter(dev, log, every=1):
    return StepReporter(log, log_every_n_steps=every, synchronize=dev.synchronize, clock=dev.clock)


def test_an_epochs_last_step_is_logged_with_the_steps_since_the_last_row():
    """log_every_n_steps=10 over 3 steps, or 4 over 6: the last window is a row, not lost."""
    dev, log = _FakeDevice(), _Log()
    rep = _reporter(dev, log, every=4)
    rep.start_epoch(0, 1, 6)
    for step in range(1, 7):
        dev.queue(1.0)
        rep.add_tokens(10)
        rep.step_done(step, torch.tensor(float(step)), lr=1e-3, epoch_end=step == 6)
    rep.end_epoch()
    assert [s for s, _ in log.rows] == [4, 6]
    last = log.rows[1][1]
    assert last["loss"] == 6.0 and last["steps_in_window"] == 2 and last["valid_tokens"] == 20


def test_clock_is_read_after_the_device_finishes():
    dev, log = _FakeDevice(), _Log()
    rep = _reporter(dev, log)
    rep.start_epoch(0, 1, 3)
    for step in (1, 2, 3):
        dev.events.clear()
        dev.queue(0.5)  # the step's GPU work, still queued when Python reaches step_done
        rep.add_tokens(1000)
        rep.step_done(step, torch.tensor(1.0), lr=1e-3)
        assert dev.events[:2] == ["sync", "clock"], dev.events
    # Without the synchronize the window would be ~0 s and tokens/s unbounded.
    for _, row in log.rows:
        assert row["step_time_s"] == pytest.approx(0.5)
        assert row["tokens_per_second_per_gpu"] == pytest.approx(2000.0)


def test_unlogged_steps_fall_into_the_next_logged_window():
    dev, log = _FakeDevice(), _Log()
    rep = _reporter(dev, log, every=3)
    rep.start_epoch(0, 1, 6)
    for step, (secs, toks) in enumerate([(1.0, 100), (2.0, 200), (3.0, 300),
                                         (0.5, 50), (0.5, 50), (1.0, 100)], start=1):
        dev.queue(secs)
        rep.add_tokens(toks)
        rep.step_done(step, torch.tensor(1.0), lr=1e-3)
    (s1, r1), (s2, r2) = log.rows
    assert (s1, s2) == (3, 6)
    assert r1["valid_tokens"] == 600 and r1["steps_in_window"] == 3
    assert r1["step_time_s"] * r1["steps_in_window"] == pytest.approx(6.0)
    assert r1["tokens_per_second_per_gpu"] == pytest.approx(100.0)
    assert r2["valid_tokens"] == 200 and r2["step_time_s"] * 3 == pytest.approx(2.0)
    # The windows add up to the whole epoch's wall time: nothing uncounted or counted twice.
    assert sum(r["step_time_s"] * r["steps_in_window"] for _, r in log.rows) == pytest.approx(dev.now)


def test_cuda_reporter_lags_by_default_and_synchronizes_without_lag(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(device))
    assert StepReporter(_Log(), device=torch.device("cuda", 0)).lags
    assert not StepReporter(_Log()).lags  # CPU: nothing to overlap
    rep = StepReporter(_Log(), device=torch.device("cuda", 0), lag=False)
    rep.start_epoch(0, 1, 1)
    rep.step_done(1, torch.tensor(1.0), lr=0.0)
    assert len(calls) >= 2  # the window's start and its end


class _Timeline:
    """A device that runs queued work in order; a mark is a point in that queue. Waiting for a
    mark runs the device only up to it (what a CUDA event gives), and records how far."""

    def __init__(self):
        self.queued, self.waits = 0.0, []

    def queue(self, seconds):
        self.queued += seconds

    def mark(self, values):
        return _Mark(self, self.queued, values)


class _Mark:
    def __init__(self, timeline, at, values):
        self.timeline, self.at = timeline, at
        self._values = {k: (float(v) if isinstance(v, torch.Tensor) else v) for k, v in values.items()}

    def values(self):
        self.timeline.waits.append(self.at)
        return dict(self._values)

    def seconds_since(self, earlier):
        return self.at - earlier.at


def test_stopping_for_an_error_writes_the_waiting_row_and_never_raises_its_own(capsys):
    """A step's one-line error comes after the waiting row and the closed bar; a logger that
    fails then is a note, not an exception that would replace the error."""
    tl, log = _Timeline(), _Log()
    rep = StepReporter(log, lag=True, mark=tl.mark, show_progress=True)
    rep.start_epoch(0, 1, 3)
    tl.queue(1.0)
    rep.step_done(1, torch.tensor(1.0), lr=1e-3)
    rep.stop_for_error()
    assert [s for s, _ in log.rows] == [1] and rep._pbar is None

    class _Failing(_Log):
        def log_dict(self, payload, step):
            raise OSError(28, "No space left on device")

    rep = StepReporter(_Failing(), lag=True, mark=tl.mark, show_progress=True)
    rep.start_epoch(0, 1, 3)
    rep.step_done(1, torch.tensor(1.0), lr=1e-3)
    rep.stop_for_error()  # no exception
    assert rep._pbar is None
    assert "the last logged step's row was not written (OSError" in capsys.readouterr().err


def test_lagging_rows_come_one_step_late_and_wait_only_for_their_own_step():
    tl, log = _Timeline(), _Log()
    rep = StepReporter(log, lag=True, mark=tl.mark)
    rep.start_epoch(0, 1, 3)
    for step, secs in enumerate([1.0, 2.0, 4.0], start=1):
        tl.queue(secs)  # this step's work, queued
        rep.add_tokens(100 * step)
        rep.step_done(step, torch.tensor(float(step)), lr=1e-3, grad_norm=torch.tensor(0.5 * step))
        # Only the previous step's row is out, and reading it waited for that step's end only,
        # never for the step just queued.
        assert [s for s, _ in log.rows] == list(range(1, step))
        if step > 1:
            assert tl.waits[-1] == pytest.approx(tl.queued - secs)
    rep.end_epoch()
    assert [s for s, _ in log.rows] == [1, 2, 3]
    for (step, row), secs in zip(log.rows, [1.0, 2.0, 4.0]):
        assert row["loss"] == step and row["grad_norm"] == 0.5 * step and row["valid_tokens"] == 100 * step
        assert row["step_time_s"] == pytest.approx(secs)
        assert row["tokens_per_second_per_gpu"] == pytest.approx(100 * step / secs)


def test_lagging_windows_leave_out_pauses_and_add_up():
    tl, log = _Timeline(), _Log()
    rep = StepReporter(log, log_every_n_steps=2, lag=True, mark=tl.mark)
    rep.start_epoch(0, 1, 4)
    for step in range(1, 5):
        tl.queue(1.0)
        rep.add_tokens(10)
        rep.step_done(step, torch.tensor(1.0), lr=0.0)
        if step == 3:
            with rep.paused():  # validation: 5 s of device work, not training
                tl.queue(5.0)
            assert [s for s, _ in log.rows] == [2]  # paused() wrote the waiting row first
    rep.close()
    (s2, r2), (s4, r4) = log.rows
    assert (s2, s4) == (2, 4)
    assert r2["step_time_s"] == pytest.approx(1.0) and r4["step_time_s"] == pytest.approx(1.0)
    assert sum(r["step_time_s"] * r["steps_in_window"] for _, r in log.rows) == pytest.approx(tl.queued - 5.0)


def test_device_values_on_cpu_read_at_once_and_pass_plain_numbers():
    from tune_recipes.training.reporting.progress import DeviceValues

    t = torch.tensor(2.5)
    v = DeviceValues({"loss": t, "skipped_steps": 3}, torch.device("cpu"), lagged=False)
    t.fill_(7.0)  # later work must not change what was read
    assert v.values() == {"loss": 2.5, "skipped_steps": 3}


def _steps(rep, n=3):
    rep.start_epoch(0, 1, n)
    for step in range(1, n + 1):
        rep.add_tokens(100)
        rep.step_done(step, torch.tensor(2.0), lr=1e-3)


def test_progress_bar_shows_loss_and_tokens_per_second_on_a_terminal(capsys):
    rep = StepReporter(_Log(), show_progress=True)
    rep.start_epoch(0, 1, 3)
    rep.add_tokens(100)
    rep.step_done(1, torch.tensor(2.0), lr=1e-3)
    postfix = rep._pbar.postfix
    assert "loss=2.0000" in postfix and "tok_s=" in postfix
    rep.close()


def test_off_a_terminal_plain_lines_not_a_bar_and_nothing_when_quiet(capsys):
    """pytest captures stdout, so it is not a TTY (a job's log file): no bar and its redraws,
    but a plain line for the first logged step, at most every PLAIN_LINE_EVERY_S after, and
    at the epoch's end, with the epoch's ETA; validation loss too. Quiet: nothing."""
    from tune_recipes.training.reporting.progress import PLAIN_LINE_EVERY_S

    now = [0.0]
    rep = StepReporter(_Log(), clock=lambda: now[0], lag=False)
    assert not rep.show_progress and rep.plain_lines
    rep.start_epoch(0, 2, 10)
    for step in range(1, 11):
        now[0] += PLAIN_LINE_EVERY_S / 4  # a line every fourth step at most
        rep.add_tokens(100)
        rep.step_done(step, torch.tensor(2.0 + step), lr=1e-3, epoch_end=step == 10)
        if step == 5:
            rep.log_validation(5, 1.5)
    rep.close()
    out = capsys.readouterr().out
    assert "\r" not in out
    lines = out.strip().splitlines()
    # The ETA from the rate since the epoch's first line (its first step may hold a compile).
    assert lines == [
        "epoch 1/2, step 1/10 (step 1 of the run): loss 3.0000, lr 1.00e-03, 13 tokens/s",
        "epoch 1/2, step 5/10 (step 5 of the run): loss 7.0000, lr 1.00e-03, 13 tokens/s, epoch ETA 0:38",
        "step 5 of the run: val_loss 1.5000",
        "epoch 1/2, step 9/10 (step 9 of the run): loss 11.0000, lr 1.00e-03, 13 tokens/s, epoch ETA 0:08",
        "epoch 1/2, step 10/10 (step 10 of the run): loss 12.0000, lr 1.00e-03, 13 tokens/s"], lines
    # A stdout that fails (a closed pipe) ends the lines, not the run.
    import sys

    broken = StepReporter(_Log(), clock=lambda: now[0], lag=False)
    real, sys.stdout = sys.stdout, type("Closed", (), {"write": lambda self, s: (_ for _ in ()).throw(
        BrokenPipeError(32, "Broken pipe")), "flush": lambda self: None})()
    try:
        _steps(broken)
    finally:
        sys.stdout = real
    assert not broken.plain_lines and len(broken.metric_logger.rows) == 3
    # Quiet (log_level WARNING), or a logger that prints its own rows: no lines.
    for quiet in (StepReporter(_Log(), show_progress=False), StepReporter(type("StdoutLogger", (_Log,), {})())):
        _steps(quiet)
        quiet.close()
    assert capsys.readouterr().out == ""


def test_log_level_warning_turns_the_bar_off(tmp_path):
    from omegaconf import OmegaConf

    from tune_recipes.training.setup.recipe import build_reporter

    cfg = OmegaConf.create({
        "output_dir": str(tmp_path), "log_level": "WARNING",
        "metric_logger": {"_component_": "tune_recipes.training.metrics.JsonlMetricLogger",
                          "log_dir": str(tmp_path)}})
    assert build_reporter(cfg, torch.device("cpu")).show_progress is False
    cfg.log_level = "INFO"
    assert build_reporter(cfg, torch.device("cpu")).plot_from == str(tmp_path / "metrics.jsonl")


def test_the_picture_is_drawn_from_the_file_the_logger_writes(tmp_path):
    """metric_logger.filename / log_dir elsewhere: the picture is drawn beside that file, under
    its name (train.png: the name a fresh run keeps it under)."""
    from omegaconf import OmegaConf

    from tune_recipes.training.setup.recipe import build_reporter

    cfg = OmegaConf.create({
        "output_dir": str(tmp_path),
        "metric_logger": {"_component_": "tune_recipes.training.metrics.JsonlMetricLogger",
                          "log_dir": str(tmp_path / "logs"), "filename": "train.jsonl"}})
    rep = build_reporter(cfg, torch.device("cpu"))
    assert rep.plot_from == str(tmp_path / "logs" / "train.jsonl")
    _steps(rep)
    rep.close()
    assert (tmp_path / "logs" / "train.png").is_file()


def test_a_logger_that_writes_no_jsonl_gets_no_picture_and_no_note(tmp_path, capsys):
    """torchtune's own DiskLogger (a stock config's) logs as asked: the end of the run says
    nothing about a metrics.png it could not draw."""
    from omegaconf import OmegaConf

    from tune_recipes.training.setup.recipe import build_reporter

    cfg = OmegaConf.create({
        "output_dir": str(tmp_path), "log_level": "WARNING",
        "metric_logger": {"_component_": "torchtune.training.metric_logging.DiskLogger",
                          "log_dir": str(tmp_path / "logs")}})
    rep = build_reporter(cfg, torch.device("cpu"))
    assert rep.plot_from is None
    _steps(rep)
    rep.close()
    assert "metrics.png" not in capsys.readouterr().err
    assert not (tmp_path / "metrics.png").exists() and list((tmp_path / "logs").glob("log_*.txt"))


def test_close_draws_metrics_png_from_the_run_log(tmp_path):
    from tune_recipes.training.metrics import JsonlMetricLogger

    rep = StepReporter(JsonlMetricLogger(tmp_path), plot_from=str(tmp_path))
    _steps(rep)
    rep.close()
    png = tmp_path / "metrics.png"
    assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_failed_plot_does_not_fail_the_run(tmp_path, capsys):
    rep = StepReporter(_Log(), plot_from=str(tmp_path / "no_metrics_here"))
    _steps(rep)
    rep.close()  # no metrics.jsonl: a note, no exception
    assert "no metrics.png" in capsys.readouterr().err


@pytest.mark.gpu
def test_cuda_rows_never_drain_the_queue():
    """On CUDA each row is written a step late and reading it waits for its own step only: the
    step just queued is still running when step_done returns."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    # The ops' first launches load their kernels, which waits for the device: not the
    # reporter's doing (a trace shows the drain at the first torch.full).
    torch.cuda._sleep(1000)
    (torch.full((), 1.0, device="cuda") * 2).item()
    log = _Log()
    rep = StepReporter(log, device=torch.device("cuda"))
    rep.start_epoch(0, 1, 6)
    for step in range(1, 7):
        torch.cuda._sleep(100_000_000)  # the step's GPU work: ~50 ms of spinning
        loss = torch.full((), float(step), device="cuda")
        rep.add_tokens(100)
        rep.step_done(step, loss, lr=0.0, grad_norm=loss * 2)
        queued = torch.cuda.Event()
        queued.record()
        # From the first step: the reporter took its pinned buffers before training (a pinned
        # allocation waits for the device: CUDA's implicit synchronization).
        assert not queued.query(), f"step {step}: the reporter waited for the device to drain"
    rep.end_epoch()
    assert [(s, r["loss"], r["grad_norm"]) for s, r in log.rows] == [(s, float(s), 2.0 * s) for s in range(1, 7)]
    for _, r in log.rows:
        assert r["step_time_s"] > 0.01  # the device's time for the step, not the host's


@pytest.mark.parametrize("ending,returncode", [
    ('raise RuntimeError("step 3 failed")', 1),
    # as `tune run` ends on Ctrl-C (launch.run_script): the traceback, and with it the last
    # reference to the reporter, is gone before the exit handlers run
    ("raise KeyboardInterrupt", 130),
])
def test_a_run_that_dies_mid_epoch_still_writes_its_last_logged_row(tmp_path, ending, returncode):
    """The lagging reporter holds step 2's row when step 3 stops the run; the row reaches
    metrics.jsonl at exit, although the run never reaches close()."""
    script = f"""
import sys
import torch
from tune_recipes.training.reporting.metrics import JsonlMetricLogger
from tune_recipes.training.reporting.progress import StepReporter
class Mark:  # a point in the device's work (a CUDA event and a pinned copy on a GPU)
    def __init__(self, values):
        self._values = values
    def values(self):
        return dict(self._values)
    def seconds_since(self, earlier):
        return 1.0
def train():
    rep = StepReporter(JsonlMetricLogger({str(tmp_path)!r}), lag=True, show_progress=False,
                       mark=Mark)
    rep.start_epoch(0, 1, steps=5)
    for step in (1, 2):
        rep.add_tokens(10)
        rep.step_done(step, torch.tensor(float(step)), lr=1e-3)
    {ending}
try:
    train()
except KeyboardInterrupt:
    sys.exit(130)
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert proc.returncode == returncode, proc.stderr
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["loss"]) for r in rows] == [(1, 1.0), (2, 2.0)]


def test_a_closed_reporter_writes_nothing_more_at_exit(tmp_path):
    from tune_recipes.training.reporting import progress

    rep = StepReporter(_Log(), lag=True, show_progress=False, mark=_Timeline().mark)
    assert rep in progress._REPORTERS
    rep.close()
    assert rep not in progress._REPORTERS


def test_a_row_whose_values_cannot_be_read_is_reported_not_raised(capsys):
    """A failed device at the end (close) or at exit: a note on stderr, the logger still
    closed, and the exit handler has nothing left to retry."""
    from tune_recipes.training.reporting import progress

    class FailingMark:
        def __init__(self, values):
            self.failing = bool(values)

        def values(self):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

        def seconds_since(self, earlier):
            return 1.0

    closed = []
    log = _Log()
    log.close = lambda: closed.append(True)
    rep = StepReporter(log, lag=True, show_progress=False, mark=FailingMark)
    rep.start_epoch(0, 1, steps=2)
    rep.step_done(1, torch.tensor(1.0), lr=1e-3)
    rep.close()
    assert "row was not written (RuntimeError: CUDA error" in capsys.readouterr().err
    assert closed and log.rows == [] and rep not in progress._REPORTERS
    progress._write_waiting_rows()  # nothing pending: silent
    assert capsys.readouterr().err == ""
