"""``tune run``'s launcher arguments: torchrun's own, checked before anything starts.

The options come from torchrun's parser (``torch.distributed.run.get_args_parser``), so every
spelling torchrun accepts (``--nproc_per_node`` and ``--nproc-per-node``, ``--rdzv_endpoint``
and ``--rdzv-endpoint`` ...) is accepted here with torchrun's meaning, and a torch upgrade brings
its new options along. ``tune run`` decides only how the recipe starts in each process
(``-m tune_recipes._cli.launch``), so ``--module``, ``--no-python`` and ``--run-path`` are not
offered.

Any launcher argument runs the recipe under torchrun; none runs it in the ``tune`` process. On
one node without a rendezvous endpoint, torchrun's ``--standalone`` is added: a local rendezvous
on a free port, so two runs on one machine never collide.

torchrun itself reports a bad launcher value as a traceback from inside its agent, after the
config was loaded, or not at all (a ``--node_rank`` past ``--nnodes`` waits for ever); here each
is one line (a ConfigError) before anything starts.
"""

import argparse
import functools
import os
from dataclasses import dataclass
from typing import List, Optional

from tune_recipes.config import ConfigError

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
    argv = list(given)
    if max_nodes == 1 and not ns.standalone and not ns.rdzv_endpoint \
            and ns.master_port is None and not master_addr_given:
        # One node, nowhere to meet given: a local rendezvous on a free port (two runs on one
        # machine never collide), torchrun's --standalone.
        argv.append("--standalone")
    return Launch(argv=argv, nproc_per_node=nproc, min_nodes=min_nodes, max_nodes=max_nodes)
