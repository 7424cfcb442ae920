"""Run ``tune ...`` commands from a warm, forked process instead of a fresh interpreter.

Every recipe test launches ``tune run``; a fresh interpreter spends ~6.5 s of a 2-core CI
machine importing torch, torchao and torchtune before the recipe reads its config, which was
most of the suite's time. Here one server process per pytest worker imports them once, does no
computation (so no OpenMP or other thread pool exists when it forks), and forks a child per
command. The child calls the same entry point as the ``tune`` script (``tune_recipes._cli.main``)
with the command's arguments, stdout and stderr going to files, and exits with its status.
Distributed commands take the same path: the child runs torchrun in-process as ``tune run
--nproc_per_node`` does, and torchrun starts fresh rank processes, exactly as for a user.

What a forked child does not repeat is interpreter start-up and those imports; tests of start-up
itself (``tune --help``, Ctrl-C, a script path) still use the real script
(``helpers.tune_subprocess``). ``TUNE_TESTS_WARM=0`` sends every command through the real
script.
"""

import json
import os
import signal
import subprocess
import sys
import traceback

# Imported before forking; each is imported by every recipe run anyway.
WARM_IMPORTS = (
    "torch", "torchao", "torchtune", "torchtune.training", "torchtune.modules.peft",
    "torchtune.datasets", "torch.distributed.run", "safetensors.torch", "matplotlib.pyplot",
    "tune_recipes", "tune_recipes._cli.main", "tune_recipes.training.setup.recipe",
)


def _serve() -> None:
    import importlib

    for name in WARM_IMPORTS:
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    requests, replies = sys.stdin, sys.stdout
    for line in requests:
        req = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _child(req)  # never returns
        replies.write(json.dumps({"pid": pid}) + "\n")
        replies.flush()
        _, status = os.waitpid(pid, 0)
        rc = os.waitstatus_to_exitcode(status)
        replies.write(json.dumps({"rc": rc}) + "\n")
        replies.flush()


def _child(req) -> None:
    code = 1
    try:
        os.setsid()  # its own process group, for a timeout to signal
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        out = os.open(req["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        err = os.open(req["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(out, 1)
        os.dup2(err, 2)
        sys.stdin = open(0, closefd=False)
        sys.stdout = open(1, "w", buffering=1, closefd=False)
        sys.stderr = open(2, "w", buffering=1, closefd=False)
        os.environ.clear()
        os.environ.update(req["env"])
        # What a fresh `tune` would differ in: OMP_NUM_THREADS is read when torch starts (it
        # already has, in the server), and sys.path[0] is the script's folder, not this one's.
        import torch

        if os.environ.get("OMP_NUM_THREADS"):
            torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
        here = os.path.dirname(os.path.abspath(__file__))
        sys.path[:] = [os.path.dirname(sys.executable)] + [
            p for p in sys.path if p not in ("", here, os.getcwd())]
        sys.argv = ["tune", *req["argv"]]
        from tune_recipes._cli.main import main

        try:
            code = main(req["argv"]) or 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            if not isinstance(e.code, (int, type(None))):
                print(e.code, file=sys.stderr)
        except BaseException:
            traceback.print_exc()
            code = 1
        # NOTE: os._exit skips interpreter shutdown, so run what shutdown would: atexit
        # handlers (the output_dir lock is released by one) and the stream flushes.
        import atexit

        atexit._run_exitfuncs()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


class WarmLauncher:
    """One server per pytest worker; ``run(argv, env, timeout)`` -> (rc, stdout, stderr)."""

    def __init__(self) -> None:
        self.proc = None

    def _start(self, env) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "import warm_launcher as w; w._serve()"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0,
            env={**env, "PYTHONPATH": os.pathsep.join(
                [os.path.dirname(os.path.abspath(__file__)), env.get("PYTHONPATH", "")])},
        )
        self._buffer = b""

    def _reply(self, timeout=None):
        """The server's next JSON line, or None after ``timeout`` seconds without one."""
        import select
        import time

        deadline = None if timeout is None else time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buffer:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 65536)
            if not chunk:
                raise RuntimeError("the warm launcher's server died")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)

    def run(self, argv, env, timeout, workdir):
        if self.proc is None or self.proc.poll() is not None:
            self._start(env)
        os.makedirs(workdir, exist_ok=True)
        out, err = os.path.join(workdir, "stdout"), os.path.join(workdir, "stderr")
        request = {"argv": list(argv), "env": env, "stdout": out, "stderr": err}
        self.proc.stdin.write((json.dumps(request) + "\n").encode())
        pid = self._reply()["pid"]
        reply = self._reply(timeout)
        if reply is None:
            # SIGTERM first: an in-process torchrun passes it on to its ranks (they run in
            # sessions of their own, out of reach of killpg); then SIGKILL what is left.
            for sig, grace in ((signal.SIGTERM, 20), (signal.SIGKILL, None)):
                try:
                    os.killpg(pid, sig)
                except ProcessLookupError:
                    pass
                if self._reply(grace) is not None:
                    break
            raise subprocess.TimeoutExpired(["tune", *argv], timeout)
        with open(out) as f_out, open(err) as f_err:
            return reply["rc"], f_out.read(), f_err.read()

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=30)
