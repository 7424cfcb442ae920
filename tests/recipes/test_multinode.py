"""Past one machine, on one machine: two `tune run` launches as two "nodes", and a torchrun
restart after a rank is killed.

Two nodes (``--nnodes 2 --node_rank 0/1``, one gloo process each, meeting at a local endpoint)
must train exactly as one launch of two processes: the same global batch and token count each
step, so the same losses and final weights (the tiny data is ragged: every rank's token count
differs every step). A rank SIGKILLed mid-epoch under ``--max_restarts 1`` with
``resume_from_checkpoint=auto``: torchrun restarts both processes, they resume from the newest
``step_<n>/``, and the run ends with the weights of an uninterrupted one, no step logged twice.
"""

import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from helpers import _env, assert_runs_agree, assert_same_weights, run_dist, tune_cmd, weights
from tune_recipes.training.metrics import read_metrics

pytestmark = pytest.mark.integration


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(args, out: Path, log: Path) -> subprocess.Popen:
    # The real script in its own process (two launches run at once; the warm test launcher
    # runs one command at a time).
    return subprocess.Popen([*tune_cmd(), "run", *args], stdout=open(log, "w"),
                            stderr=subprocess.STDOUT, env=_env(), start_new_session=True)


def _wait(procs, logs, timeout=240):
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(timeout=max(1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                os.killpg(q.pid, signal.SIGKILL)
            raise
    for p, log in zip(procs, logs):
        assert p.returncode == 0, Path(log).read_text()[-4000:]


@pytest.mark.parametrize("recipe, config, rendezvous", [
    # torchrun's static rendezvous: node ranks as given, rank 0 at --master_addr:--master_port.
    ("full_finetune_distributed", "tiny/full_distributed",
     lambda port: ["--master_addr", "127.0.0.1", "--master_port", str(port)]),
    # c10d (what docs/multinode.md recommends): the nodes meet at an endpoint; dash spellings.
    ("lora_finetune_distributed", "tiny/lora_distributed",
     lambda port: ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                   "--rdzv-id", "two-nodes"]),
])
def test_two_nodes_train_as_one_launch_of_two_processes(tmp_path, recipe, config, rendezvous):
    overrides = ["max_steps_per_epoch=3", "lr_scheduler.num_warmup_steps=1",
                 "gradient_accumulation_steps=2", "batch_size=2"]
    run_dist(2, recipe, config, tmp_path / "one", overrides)
    port = _free_port()
    out = tmp_path / "two"
    logs = [tmp_path / f"node{r}.log" for r in (0, 1)]
    procs = [_launch(["--nnodes", "2", "--node_rank", str(r), "--nproc_per_node", "1",
                      *rendezvous(port), recipe, "--config", config, f"output_dir={out}",
                      *overrides], out, logs[r]) for r in (0, 1)]
    _wait(procs, logs)
    name = "adapter_model.safetensors" if "lora" in recipe else "model-00001-of-00001.safetensors"
    assert_runs_agree(tmp_path / "one", out, steps=3, name=name)
    assert not (out / ".lock").exists()


def _children(pid: int):
    """Processes whose parent is ``pid`` (Linux /proc)."""
    kids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                kids.append(int(entry.name))
    return kids


def _rank_of(pid: int):
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    return next((int(e[5:]) for e in env if e.startswith(b"RANK=")), None)


def _logged_steps(path) -> list:
    """Steps of metrics.jsonl's training rows so far (a line being written is skipped)."""
    steps = []
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return steps
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if "loss" in row:
            steps.append(row["step"])
    return steps


def test_a_killed_rank_is_restarted_and_the_run_resumes_from_its_newest_checkpoint(tmp_path):
    """SIGKILL of rank 1 once a step past the newest mid-epoch checkpoint is logged: torchrun
    (--max_restarts 1) restarts both ranks, resume_from_checkpoint=auto finds that step_<n>/,
    the rows logged after it are dropped and logged again by the resumed run, and the run
    finishes with the uninterrupted run's weights, every step logged once, the lock released."""
    args = ["max_steps_per_epoch=8", "lr_scheduler.num_warmup_steps=1", "save_every_n_steps=3",
            "resume_from_checkpoint=auto"]
    run_dist(2, "full_finetune_distributed", "tiny/full_distributed", tmp_path / "straight", args)
    out, log = tmp_path / "killed", tmp_path / "killed.log"
    proc = _launch(["--nproc_per_node", "2", "--max_restarts", "1", "full_finetune_distributed",
                    "--config", "tiny/full_distributed", f"output_dir={out}", *args], out, log)
    deadline, killed, at_kill = time.monotonic() + 300, None, None
    while killed is None and time.monotonic() < deadline and proc.poll() is None:
        saved = [int(d.name[5:]) for d in out.glob("step_*") if d.name[5:].isdigit()]
        logged = _logged_steps(out / "metrics.jsonl")
        if saved and logged and max(saved) < max(logged) < 8:
            ranks = {_rank_of(p): p for p in _children(proc.pid)}
            if 1 in ranks:
                os.kill(ranks[1], signal.SIGKILL)
                killed, at_kill = ranks[1], (max(saved), max(logged))
        time.sleep(0.01)
    assert killed is not None, log.read_text()[-4000:]
    _wait([proc], [log])
    text = log.read_text()
    assert "resuming from" in text and "/step_" in text.split("resuming from")[1].split("\n")[0]
    steps = [r["step"] for r in read_metrics(out / "metrics.jsonl") if "loss" in r]
    assert steps == list(range(1, 9)), (steps, at_kill)  # a row past the checkpoint, not twice
    assert_same_weights(weights(out), weights(tmp_path / "straight"), rtol=0, atol=0)
    assert not (out / ".lock").exists()
