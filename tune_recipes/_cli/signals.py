"""SIGTERM handled as Ctrl-C: ``kill`` or a scheduler stopping a job ends `tune` in one line.

Light on purpose (no torch): ``tune``'s ``main`` installs the handler before anything slow is
imported, so a signal during start-up is caught too.
"""

import signal
from typing import Optional


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread by ``raise_terminated``: handled where Ctrl-C is
    (``_cli/launch.run_script``, ``_cli/main.main``), so the exit handlers run (the output_dir
    lock is released) and one line says where the run stood."""


def raise_terminated(signum, frame) -> None:
    raise Terminated()


def handle_sigterm():
    """Install ``raise_terminated`` for SIGTERM; returns the previous handler (None where
    handlers cannot be set: not the main thread, e.g. an app that embeds ``main``)."""
    try:
        return signal.signal(signal.SIGTERM, raise_terminated)
    except ValueError:
        return None


def restore_sigterm(previous: Optional[object]) -> None:
    if previous is not None:
        signal.signal(signal.SIGTERM, previous)


def how_stopped(e: KeyboardInterrupt) -> str:
    return "terminated (SIGTERM)" if isinstance(e, Terminated) else "interrupted"


def exit_code(e: KeyboardInterrupt) -> int:
    """128 + the signal's number, as a shell reports a process the signal ended."""
    return 128 + (signal.SIGTERM if isinstance(e, Terminated) else signal.SIGINT)
