"""``python -m tune_recipes._cli.launch <recipe.py> [args ...]``: run a recipe script as
``__main__``, the way ``python <recipe.py> [args ...]`` would.

``tune run --nproc_per_node`` starts each torchrun process through this module rather than the
script itself, so ``import tune_recipes`` (and its noise filters, tune_recipes/_cli/quiet.py)
runs before the recipe's own ``import torchtune``.
"""

import os
import runpy
import sys
from pathlib import Path
from typing import List

import tune_recipes  # noqa: F401  (installs the filters)


def run_script(path: Path, args: List[str]) -> None:
    """Execute ``path`` as ``__main__`` with ``sys.argv = [path, *args]``; like ``python path``,
    the script's folder comes first on ``sys.path``."""
    sys.argv = [str(path), *args]
    sys.path.insert(0, str(Path(path).parent))
    try:
        runpy.run_path(str(path), run_name="__main__")
    except KeyboardInterrupt as e:
        # Ctrl-C (or SIGTERM, raised as Terminated by `tune`'s handler): one line (where the
        # run stood and how to resume), not a traceback; sys.exit runs the exit handlers,
        # which release the output_dir lock.
        from tune_recipes._cli.signals import exit_code, how_stopped
        from tune_recipes.training.reporting.run_status import interrupted_message

        if "TORCHELASTIC_RUN_ID" in os.environ:
            # A torchrun rank: `tune` (torchrun's agent) prints the one line for all of them.
            sys.exit(exit_code(e))
        print(f"\n{interrupted_message(Path(path), list(args), how=how_stopped(e))}",
              file=sys.stderr)
        sys.exit(exit_code(e))


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
    (``TORCHELASTIC_RESTART_COUNT``); the first round is left exactly as torch makes it.
    """
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if restart in ("", "0") or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return
    import importlib

    from torch.distributed import PrefixStore

    # The module (torch.distributed.rendezvous is also the name of a function).
    rdzv = importlib.import_module("torch.distributed.rendezvous")

    env_handler = rdzv._rendezvous_handlers["env"]

    def per_round(url: str, **kwargs):
        for store, rank, world_size in env_handler(url, **kwargs):
            yield PrefixStore(f"/tune_recipes/restart_{restart}", store), rank, world_size

    # NOTE: set directly: register_rendezvous_handler refuses a scheme that has a handler.
    rdzv._rendezvous_handlers["env"] = per_round


if __name__ == "__main__":
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
