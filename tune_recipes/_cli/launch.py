"""How ``tune run`` starts a recipe: in this process, or under torchrun with its launcher
arguments; and what a signal does to either.

``python -m tune_recipes._cli.launch <recipe.py> [args ...]`` runs a recipe script as
``__main__``, the way ``python <recipe.py> [args ...]`` would. Under torchrun each process
starts here rather than in the script itself, so ``import tune_recipes`` (and its noise
filters, tune_recipes/_cli/quiet.py) runs before the recipe's own ``import torchtune``.

Launcher arguments are torchrun's own, from its parser (``torch.distributed.run.
get_args_parser``): every spelling torchrun accepts (``--nproc_per_node`` and
``--nproc-per-node``, ``--rdzv_endpoint`` and ``--rdzv-endpoint`` ...) is accepted with
torchrun's meaning, and a torch upgrade brings its new options along. ``tune run`` decides only
how the recipe starts in each process (``-m tune_recipes._cli.launch``), so ``--module``,
``--no-python`` and ``--run-path`` are not offered. Any launcher argument runs the recipe under
torchrun; none runs it in the ``tune`` process. On one node without a rendezvous endpoint,
torchrun's ``--standalone`` is added: a local rendezvous on a free port, so two runs on one
machine never collide. torchrun itself reports a bad launcher value as a traceback from inside
its agent, or not at all (a ``--node_rank`` past ``--nnodes`` waits for ever); here each is one
line (a ConfigError) before anything starts.

SIGTERM (``kill``, a scheduler stopping a job) is handled as Ctrl-C: ``tune``'s ``main``
installs ``raise_terminated`` before anything slow is imported (this module imports no torch at
import time), so a signal during start-up ends in one line too. A signal whose exception a
finalizer or callback swallowed is sent again (``redeliver_swallowed_interrupt``).
"""

import argparse
import functools
import os
import runpy
import signal
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional

import tune_recipes  # noqa: F401  (installs the filters)
from tune_recipes.config import ConfigError


# ------------------------------------------------------------------- signals
class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread by ``raise_terminated``: handled where Ctrl-C is
    (``_cli/launch.run_script``, ``_cli/main.main``), so the exit handlers run (the output_dir
    lock is released) and one line says where the run stood."""


def raise_terminated(signum, frame) -> None:
    raise Terminated()


# NOTE: a signal's handler runs at whatever Python code the main thread is in. When that is a
# finalizer or a weakref callback (an import's module-lock callback, a ``__del__``), the
# interpreter prints "Exception ignored in ..." and carries on, so a Ctrl-C or SIGTERM would be
# lost and the run would train to its end. This hook sends a swallowed interrupt's signal again
# from a helper thread, so the handler runs once more, after the callback has returned.
REDELIVER_AFTER_S = 0.01


def redeliver_swallowed_interrupt(unraisable) -> None:
    """``sys.unraisablehook`` while ``tune`` runs: a KeyboardInterrupt (or Terminated) that a
    callback swallowed is raised again as its signal; anything else goes to the hook before."""
    if isinstance(unraisable.exc_value, KeyboardInterrupt):
        sig = signal.SIGTERM if isinstance(unraisable.exc_value, Terminated) else signal.SIGINT
        resend = threading.Timer(REDELIVER_AFTER_S, os.kill, (os.getpid(), sig))
        resend.daemon = True
        _resends.append(resend)
        resend.start()
        return
    _hook_before(unraisable)


_hook_before = sys.__unraisablehook__
_resends = []  # redeliveries not yet sent are cancelled when the handlers are restored


def handle_sigterm():
    """Install ``raise_terminated`` for SIGTERM, and ``redeliver_swallowed_interrupt`` as
    ``sys.unraisablehook``; returns what to restore (None where handlers cannot be set: not the
    main thread, e.g. an app that embeds ``main``)."""
    global _hook_before
    try:
        previous_handler = signal.signal(signal.SIGTERM, raise_terminated)
    except ValueError:
        return None
    previous_hook = sys.unraisablehook
    if previous_hook is not redeliver_swallowed_interrupt:
        _hook_before = previous_hook
    sys.unraisablehook = redeliver_swallowed_interrupt
    return previous_handler, previous_hook


def restore_sigterm(previous: Optional[object]) -> None:
    if previous is not None:
        previous_handler, previous_hook = previous
        while _resends:
            _resends.pop().cancel()
        signal.signal(signal.SIGTERM, previous_handler)
        sys.unraisablehook = previous_hook


def how_stopped(e: KeyboardInterrupt) -> str:
    return "terminated (SIGTERM)" if isinstance(e, Terminated) else "interrupted"


def exit_code(e: KeyboardInterrupt) -> int:
    """128 + the signal's number, as a shell reports a process the signal ended."""
    return 128 + (signal.SIGTERM if isinstance(e, Terminated) else signal.SIGINT)


# What a gloo collective raises in a rank whose peer has died (torch words it so). The peer's
# own error line says why; the traceback of this consequence would bury it.
_PEER_GONE = ("Connection closed by peer", "Connection reset by peer",
              "typically caused by a remote worker crashing")


def peer_gone(e: BaseException) -> bool:
    """Whether ``e``, raised in a torchrun rank, only says another rank of the run ended."""
    return ("TORCHELASTIC_RUN_ID" in os.environ and isinstance(e, RuntimeError)
            and any(words in str(e) for words in _PEER_GONE))


# Set by `tune` before torchrun starts the ranks: its PID, the parent each rank must find alive.
LAUNCHER_PID_ENV = "TUNE_RECIPES_LAUNCHER_PID"


def die_with_launcher() -> None:
    """A torchrun rank ends (SIGTERM, whose default ends it at once) when its agent dies,
    whatever killed the agent: torchrun starts each rank in a session of its own, so a SIGKILL
    of `tune` (an OOM killer, a job scheduler) would otherwise leave the ranks training, holding
    output_dir and the GPUs. Linux's parent-death signal; elsewhere nothing. Checkpoints are
    written crash-safe, so ending mid-step loses only the steps since the last one."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    # NOTE: the PID `tune` exported, not os.getppid() read now: a launcher that died while this
    # interpreter started (imports take a fraction of a second) has already left it orphaned.
    try:
        parent = int(os.environ[LAUNCHER_PID_ENV])
    except (KeyError, ValueError):  # started by torchrun directly
        parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1  # <linux/prctl.h>
        if libc.prctl(pr_set_pdeathsig, int(signal.SIGTERM), 0, 0, 0) != 0:
            return
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the launcher died before the signal was set
        os.kill(os.getpid(), signal.SIGTERM)


def reports_to_tune(script: Path) -> bool:
    """Whether ``script`` is one of ours (or a copy of one): it trains through tune_recipes,
    whose step driver and checkpoint writer record where the run stands. torchtune's recipes
    never import it."""
    try:
        return "tune_recipes" in script.read_text(errors="replace")
    except OSError:
        return False


# ------------------------------------------------------------------ launching
def run_script(path: Path, args: List[str]) -> None:
    """Execute ``path`` as ``__main__`` with ``sys.argv = [path, *args]``; like ``python path``,
    the script's folder comes first on ``sys.path``."""
    try:
        # The first import of torch (through the training package): seconds in which a torchrun
        # rank, started by `tune` a moment ago, may already get the Ctrl-C torchrun passes on.
        from tune_recipes.training.reporting import run_status
    except KeyboardInterrupt as e:
        if "TORCHELASTIC_RUN_ID" not in os.environ:
            raise  # `tune` itself: its main() prints the line for a stop before training
        sys.exit(exit_code(e))  # a rank: `tune` (torchrun's agent) prints the line for all
    run_status.reset()  # a run of its own, also where one process runs several (tests)
    sys.argv = [str(path), *args]
    sys.path.insert(0, str(Path(path).parent))
    try:
        runpy.run_path(str(path), run_name="__main__")
    except KeyboardInterrupt as e:
        # Ctrl-C (or SIGTERM, raised as Terminated by `tune`'s handler): one line (where the
        # run stood and how to resume), not a traceback; sys.exit runs the exit handlers,
        # which release the output_dir lock.
        from tune_recipes.training.reporting.run_status import interrupted_message

        if "TORCHELASTIC_RUN_ID" in os.environ:
            # A torchrun rank: `tune` (torchrun's agent) prints the one line for all of them.
            sys.exit(exit_code(e))
        if reports_to_tune(Path(path)):
            line = interrupted_message(Path(path), list(args), how=how_stopped(e))
        else:
            # torchtune's own recipe (a name we do not ship): its steps and checkpoints are not
            # known here, and "at step 0; no checkpoint saved" would be false.
            line = (f"{how_stopped(e)}: {Path(path).stem} is torchtune's recipe, which reports "
                    "no steps or checkpoints to tune (its output above says where it stood)")
        print(f"\n{line}", file=sys.stderr)
        sys.exit(exit_code(e))
    except RuntimeError as e:
        if not peer_gone(e):
            raise
        print(f"tune: error: rank {os.environ.get('RANK', '?')} stopped: another process of "
              "the run ended first (its error, or torchrun's line if it was killed, says why)",
              file=sys.stderr)
        sys.exit(1)


# ------------------------------------------------------------ torchrun launch
# torchrun options tune run sets itself (how each process starts the recipe), and the
# positionals it replaces with RECIPE --config CONFIG [overrides].
_NOT_OFFERED = {"help", "training_script", "training_script_args", "module", "no_python",
                "run_path"}
C10D_DEFAULT_PORT = 29400  # torchrun's default port for a c10d endpoint without one


@functools.lru_cache(maxsize=1)
def _torchrun_actions():
    from torch.distributed.run import get_args_parser

    return [a for a in get_args_parser()._actions if a.dest not in _NOT_OFFERED]


def add_launcher_arguments(parser: argparse.ArgumentParser) -> None:
    """torchrun's options on ``parser``, in a group of their own, with no defaults: the
    parsed namespace holds only those the user gave (torchrun applies its defaults, and its
    ``PET_*`` environment variables, when it parses them again)."""
    from torch.distributed.run import get_args_parser

    group = parser.add_argument_group(
        "launcher (torchrun's arguments; any of them runs the recipe under torchrun)")
    for action in get_args_parser()._actions:
        if action.dest in _NOT_OFFERED:
            continue
        action.default = argparse.SUPPRESS
        group._add_action(action)


def _option(action) -> str:
    # The underscore spelling where there is one (what torchtune's docs and ours show).
    longs = [o for o in action.option_strings if o.startswith("--")]
    return next((o for o in longs if "_" in o), longs[0] if longs else action.option_strings[0])


def given_launcher_argv(args: argparse.Namespace) -> List[str]:
    """The launcher arguments the user gave, written back as torchrun arguments."""
    out: List[str] = []
    for action in _torchrun_actions():
        if not hasattr(args, action.dest):
            continue
        value = getattr(args, action.dest)
        if action.nargs == 0:  # a flag
            if value:
                out.append(_option(action))
        elif isinstance(value, list):  # torchrun's comma-separated lists; ",," escapes a comma
            out += [_option(action), ",".join(v.replace(",", ",,") for v in value)]
        else:
            out += [_option(action), str(value)]
    return out


@dataclass
class Launch:
    """What torchrun will start on this node."""

    argv: List[str]  # torchrun's arguments, before the module and the recipe's own
    nproc_per_node: int
    min_nodes: int
    max_nodes: int
    max_restarts: int = 0


def _local_world_size(value: str) -> int:
    from torch.distributed.run import determine_local_world_size

    try:
        n = int(value)
    except ValueError:
        if value == "gpu":
            import torch

            if not torch.cuda.is_available() or torch.cuda.device_count() < 1:
                raise ConfigError("--nproc_per_node gpu: this machine has no CUDA device; give a "
                                  "number of processes (CPU processes use gloo)") from None
        try:
            n = determine_local_world_size(value)
        except ValueError:
            raise ConfigError(f"--nproc_per_node {value}: expected a number of processes, or "
                              "gpu, cpu or auto (one per device)") from None
    if n < 1:
        raise ConfigError(f"--nproc_per_node {value}: expected an integer >= 1")
    return n


def _torchrun_namespace(argv: List[str]) -> argparse.Namespace:
    """``argv`` parsed by torchrun's own parser (its defaults and ``PET_*`` variables applied);
    a value it rejects (from a ``PET_*`` variable: the command line was checked already) is
    one ConfigError."""
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()

    def error(message: str):
        raise ConfigError(f"torchrun: {message}")

    parser.error = error
    return parser.parse_args([*argv, "RECIPE"])


def plan_launch(args: argparse.Namespace) -> Optional[Launch]:
    """The torchrun launch ``args`` asks for (None: no launcher argument, one process in this
    one), every launcher mistake a one-line ConfigError."""
    given = given_launcher_argv(args)
    if not given:
        return None
    from torch.distributed.elastic.rendezvous.api import rendezvous_handler_registry
    from torch.distributed.elastic.rendezvous.utils import (
        _parse_rendezvous_config,
        parse_rendezvous_endpoint,
    )
    from torch.distributed.run import parse_min_max_nnodes

    ns = _torchrun_namespace(given)
    try:
        min_nodes, max_nodes = parse_min_max_nnodes(ns.nnodes)
    except (ValueError, RuntimeError):
        raise ConfigError(f"--nnodes {ns.nnodes}: expected a number of nodes N or a range "
                          "MIN:MAX") from None
    if not 0 < min_nodes <= max_nodes:
        raise ConfigError(f"--nnodes {ns.nnodes}: expected N >= 1, or MIN:MAX with "
                          "1 <= MIN <= MAX")
    nproc = _local_world_size(ns.nproc_per_node)
    if ns.max_restarts < 0:
        raise ConfigError(f"--max_restarts {ns.max_restarts}: expected an integer >= 0")
    # NOTE: the registry, not a fixed list: a plugin can register its own backend.
    backends = sorted(getattr(rendezvous_handler_registry, "_registry", {}) or ())
    if backends and ns.rdzv_backend not in backends:
        raise ConfigError(f"--rdzv_backend {ns.rdzv_backend}: expected one of "
                          f"{', '.join(backends)} (c10d needs no service of its own)")
    if ns.rdzv_endpoint:
        try:
            _, port = parse_rendezvous_endpoint(ns.rdzv_endpoint, C10D_DEFAULT_PORT)
        except ValueError:
            port = -1
        if not 0 <= port <= 65535:
            raise ConfigError(f"--rdzv_endpoint {ns.rdzv_endpoint}: expected HOST:PORT "
                              "(the first node's address and a free port)")
    if ns.master_port is not None and not 0 < ns.master_port <= 65535:
        raise ConfigError(f"--master_port {ns.master_port}: expected a port, 1 to 65535")
    try:
        _parse_rendezvous_config(ns.rdzv_conf)
    except ValueError as e:
        raise ConfigError(f"--rdzv_conf {ns.rdzv_conf}: {e}") from None
    static = ns.rdzv_backend == "static" and not ns.standalone
    if ns.node_rank < 0 or (static and ns.node_rank >= max_nodes):
        raise ConfigError(f"--node_rank {ns.node_rank}: expected 0 to {max_nodes - 1} for "
                          f"--nnodes {ns.nnodes} (each node its own)")
    master_addr_given = hasattr(args, "master_addr") or "PET_MASTER_ADDR" in os.environ
    if max_nodes > 1:
        if ns.standalone:
            raise ConfigError(
                f"--standalone with --nnodes {ns.nnodes}: --standalone meets on this machine "
                "only; give every node the same --rdzv_endpoint HOST:PORT (HOST: the first "
                "node) with --rdzv_backend c10d and --rdzv_id")
        if not ns.rdzv_endpoint and not (static and master_addr_given):
            raise ConfigError(
                f"--nnodes {ns.nnodes}: the nodes need a place to meet: --rdzv_backend c10d "
                "--rdzv_endpoint HOST:PORT --rdzv_id JOB (the same on every node), or "
                "--master_addr HOST --master_port PORT with each node's --node_rank")
        if static and min_nodes != max_nodes:
            raise ConfigError(f"--nnodes {ns.nnodes}: a range needs --rdzv_backend c10d "
                              "(the static rendezvous takes a fixed number of nodes)")
        node_rank_given = hasattr(args, "node_rank") or "PET_NODE_RANK" in os.environ
        if static and not node_rank_given:
            # NOTE: torchrun accepts this, and every node then takes rank 0 and waits for ever
            # for the others at its own store.
            raise ConfigError(
                f"--nnodes {ns.nnodes} with the static rendezvous: give each node its own "
                f"--node_rank (0 to {max_nodes - 1}), or meet with --rdzv_backend c10d "
                "--rdzv_endpoint HOST:PORT --rdzv_id JOB")
    argv = list(given)
    if max_nodes == 1 and not ns.standalone and not ns.rdzv_endpoint \
            and ns.master_port is None and not master_addr_given:
        # One node, nowhere to meet given: a local rendezvous on a free port (two runs on one
        # machine never collide), torchrun's --standalone.
        argv.append("--standalone")
    return Launch(argv=argv, nproc_per_node=nproc, min_nodes=min_nodes, max_nodes=max_nodes,
                  max_restarts=ns.max_restarts)


def exit_without_finalization(code: int = 0) -> None:
    """End a finished torchrun rank: atexit handlers and stream flushes, then ``os._exit``.

    NOTE: keep this. A rank that finished (checkpoint saved, process group destroyed) was seen
    to abort in interpreter finalization on gloo ("terminate called without an active
    exception", exit -6, once in ~80 CI launches), and torchrun then reports the whole run
    failed. Interpreter teardown has nothing left to do for a finished rank: the atexit
    handlers (the output_dir lock) and the flushes are all of it; the recipe closed its
    metric logger in cleanup(). Non-daemon threads still running are not joined.
    """
    import atexit

    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def separate_restart_rounds() -> None:
    """Give a restarted torchrun round's process group keys of its own in the agent's store.

    NOTE: keep this while torchrun restarts need it. After a rank dies, torchrun
    (``--max_restarts``, torch 2.13) starts the new round's processes against the same agent
    store (the same MASTER_PORT) as the dead round, where gloo's rendezvous keys still hold the
    dead processes' addresses: the new round fails with "Gloo connectFullMesh failed ...
    Connection refused" (reproduced with plain torchrun and a ten-line script). The ``env://``
    handler that ``init_process_group`` uses is wrapped to prefix the store with the round
    (``TORCHELASTIC_RESTART_COUNT``); the first round is left exactly as torch makes it. torch's
    own ``_create_c10d_store`` assumes a new store per retry, which the agent store is not.
    That count is kept per node (a healthy node restarted with a failed one does not count),
    so across several nodes the prefixes can disagree: restarts are tested on one node only
    (docs/multinode.md, "Known gap").
    """
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if restart in ("", "0") or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return
    import importlib

    from torch.distributed import PrefixStore

    # The module (torch.distributed.rendezvous is also the name of a function).
    rdzv = importlib.import_module("torch.distributed.rendezvous")

    env_handler = getattr(rdzv, "_rendezvous_handlers", {}).get("env")
    if env_handler is None:  # torch's private registry moved: leave rendezvous as torch makes it
        return

    def per_round(url: str, **kwargs):
        for store, rank, world_size in env_handler(url, **kwargs):
            yield PrefixStore(f"/tune_recipes/restart_{restart}", store), rank, world_size

    # NOTE: set directly: register_rendezvous_handler refuses a scheme that has a handler.
    rdzv._rendezvous_handlers["env"] = per_round


if __name__ == "__main__":
    # A torchrun rank: SIGTERM from the agent ends it by default; a Ctrl-C swallowed by a
    # callback is sent again, as in `tune`.
    sys.unraisablehook = redeliver_swallowed_interrupt
    die_with_launcher()
    separate_restart_rounds()
    if len(sys.argv) < 2:
        sys.exit("usage: python -m tune_recipes._cli.launch <recipe.py> [args ...]")
    try:
        run_script(Path(sys.argv[1]), sys.argv[2:])
    except SystemExit as e:  # recipes end with sys.exit(recipe_main())
        if e.code not in (None, 0):
            raise
    if "TORCHELASTIC_RUN_ID" in os.environ:  # a torchrun rank
        exit_without_finalization(0)
