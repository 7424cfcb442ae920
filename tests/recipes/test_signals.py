"""Ctrl-C and SIGTERM end `tune run` in one line wherever they land, and release the lock.

Start-up (imports, config load, checks, model build) takes seconds: a signal at several points
of it must end in one line without a traceback, as during training. SIGTERM (``kill``, a
scheduler stopping a job) is handled as Ctrl-C: one line, exit 143, the output_dir lock gone.
"""

import json
import signal
import subprocess
import time

import pytest

from helpers import _env, read_metrics, tune_cmd

pytestmark = pytest.mark.integration


def _default_sigint():
    # NOTE: keep. A test run started in the background (`cmd &` in a script, as CI may) ignores
    # SIGINT, and an ignored SIGINT is inherited: `tune` then (rightly, as under nohup) never
    # sees Ctrl-C. A terminal's `tune` has the default disposition; so does this child.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _start(tmp_path, *overrides):
    return subprocess.Popen(
        [*tune_cmd(), "run", "full_finetune_single_device", "--config", "tiny/full_single_device",
         f"output_dir={tmp_path / 'out'}", *overrides],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(),
        preexec_fn=_default_sigint)


def _wait_for_the_handlers(proc, timeout=120.0):
    """Until `tune`'s main has installed its SIGTERM handler (Linux's SigCgt mask in
    /proc/PID/status; Python catches SIGINT from the start, SIGTERM only once tune does): the
    first moment of start-up the one-line promise covers, whatever the machine's load."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            status = open(f"/proc/{proc.pid}/status").read()
        except OSError:
            pytest.skip("no /proc: cannot tell when the handlers are in place")
        caught = int(next(line.split()[1] for line in status.splitlines()
                          if line.startswith("SigCgt:")), 16)
        if caught & (1 << (signal.SIGTERM - 1)):
            return
        time.sleep(0.01)


def _signalled(proc, sig, rc):
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == rc, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    said = [line for line in err.splitlines() if "interrupted" in line or "terminated" in line]
    assert len(said) == 1, err[-3000:]
    return said[0]


@pytest.mark.parametrize("sig, rc, word", [(signal.SIGINT, 130, "interrupted"),
                                           (signal.SIGTERM, 143, "terminated (SIGTERM)")])
# NOTE: counted from the handlers' installation: before it (the interpreter and `import
# tune_recipes`, under a second) Python's own handling applies.
@pytest.mark.parametrize("after_s", [0.0, 1.5, 4.0])
def test_a_signal_during_start_up_is_one_line(tmp_path, sig, rc, word, after_s):
    proc = _start(tmp_path)
    _wait_for_the_handlers(proc)
    time.sleep(after_s)
    if proc.poll() is not None:
        pytest.skip("the run ended before the signal")
    line = _signalled(proc, sig, rc)
    assert word in line
    assert not (tmp_path / "out" / ".lock").exists()


def test_sigterm_during_training_says_where_the_run_stood_and_releases_the_lock(tmp_path):
    proc = _start(tmp_path, "max_steps_per_epoch=1000", "save_every_n_steps=2")
    metrics = tmp_path / "out" / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.is_file() and len(metrics.read_text().splitlines()) >= 3 \
                and (tmp_path / "out" / "step_2").is_dir():
            break
        time.sleep(0.05)
    assert (tmp_path / "out" / ".lock").is_file()
    json.loads((tmp_path / "out" / ".lock").read_text())
    line = _signalled(proc, signal.SIGTERM, 143)
    assert line.startswith("terminated (SIGTERM) at step ")
    assert "resume with: tune run full_finetune_single_device" in line
    assert "resume_from_checkpoint=True" in line
    assert not (tmp_path / "out" / ".lock").exists()


def test_ctrl_c_under_torchrun_is_one_line_with_the_launch_to_resume(tmp_path):
    """A terminal's Ctrl-C reaches `tune` and every rank (one process group): the ranks stop
    silently, torchrun's agent stops, and `tune` says once where the run stood."""
    import os

    out = tmp_path / "out"
    proc = subprocess.Popen(
        [*tune_cmd(), "run", "--nproc_per_node", "2", "full_finetune_distributed", "--config",
         "tiny/full_distributed", f"output_dir={out}", "max_steps_per_epoch=1000",
         "save_every_n_steps=2"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(),
        start_new_session=True, preexec_fn=_default_sigint)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and proc.poll() is None and not (out / "step_2").is_dir():
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-3000:]
    lines = [line for line in err.splitlines() if "interrupted" in line or "stopped by" in line]
    assert len(lines) == 1 and lines[0].startswith("tune: stopped by SIGINT after step "), err
    # the step the line names is the last the run logged (log_every_n_steps=1: the last it ran)
    logged = [r["step"] for r in read_metrics(out / "metrics.jsonl") if "loss" in r]
    assert lines[0].startswith(f"tune: stopped by SIGINT after step {logged[-1]} (the last in "
                               "metrics.jsonl); newest checkpoint "), lines[0]
    assert "resume with: tune run --nproc_per_node 2 full_finetune_distributed" in lines[0]
    assert "Traceback" not in err and not (out / ".lock").exists()


def _ranks_of(out):
    """PIDs of the processes whose command line names ``out`` (the ranks, and `tune`)."""
    import os

    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmdline = open(f"/proc/{entry}/cmdline", "rb").read().decode(errors="replace")
            except OSError:
                continue
            if str(out) in cmdline and "tune_recipes._cli.launch" in cmdline:
                pids.append(int(entry))
    return pids


def test_the_ranks_end_when_tune_is_killed(tmp_path):
    """SIGKILL of `tune` (torchrun's agent; an OOM killer, a scheduler) runs no handler, and
    torchrun starts each rank in a session of its own: the ranks must not train on without it."""
    import os

    out = tmp_path / "out"
    proc = subprocess.Popen(
        [*tune_cmd(), "run", "--nproc_per_node", "2", "full_finetune_distributed", "--config",
         "tiny/full_distributed", f"output_dir={out}", "epochs=1000", "save_every_n_steps=2"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=_env())
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and proc.poll() is None and not (out / "step_2").is_dir():
        time.sleep(0.05)
    ranks = _ranks_of(out)
    assert proc.poll() is None and len(ranks) == 2, ranks
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 30  # (a rank ends within a second; the epochs take minutes)
    while time.monotonic() < deadline and _ranks_of(out):
        time.sleep(0.1)
    left = _ranks_of(out)
    for pid in left:  # never leave them behind, even when the test fails
        os.kill(pid, signal.SIGKILL)
    assert not left, f"ranks {left} still ran 30 s after tune was killed"


def test_a_rank_whose_launcher_died_while_it_started_ends_at_once(tmp_path):
    """The race die_with_launcher closes: `tune` killed while a rank's interpreter starts. The
    rank reads the launcher PID `tune` exported, not its parent as it finds it then (init)."""
    import os
    import sys

    from tune_recipes._cli.launch import LAUNCHER_PID_ENV

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # a PID that was the launcher's and is no more
    code = ("import time; from tune_recipes._cli.launch import die_with_launcher; "
            "die_with_launcher(); time.sleep(30); print('still running')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={**_env(), LAUNCHER_PID_ENV: str(gone.pid)})
    assert proc.returncode == -signal.SIGTERM and "still running" not in proc.stdout, proc
    # Its launcher alive (this test's process): it runs on.
    proc = subprocess.run([sys.executable, "-c", code.replace("30", "0")], capture_output=True,
                          text=True, timeout=60, env={**_env(), LAUNCHER_PID_ENV: str(os.getpid())})
    assert proc.returncode == 0 and "still running" in proc.stdout, proc
