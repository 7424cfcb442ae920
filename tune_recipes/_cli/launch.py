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
    except KeyboardInterrupt:
        # Ctrl-C: one line (where the run stood and how to resume), not a traceback.
        from tune_recipes.training.reporting.run_status import interrupted_message

        print(f"\n{interrupted_message(Path(path), list(args))}", file=sys.stderr)
        sys.exit(130)


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


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: python -m tune_recipes._cli.launch <recipe.py> [args ...]")
    try:
        run_script(Path(sys.argv[1]), sys.argv[2:])
    except SystemExit as e:  # recipes end with sys.exit(recipe_main())
        if e.code not in (None, 0):
            raise
    if "TORCHELASTIC_RUN_ID" in os.environ:  # a torchrun rank
        exit_without_finalization(0)
