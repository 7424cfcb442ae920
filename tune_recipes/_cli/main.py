"""The ``tune`` command: run, ls, cp, cat, validate, plot, download.

Names resolve to our recipes and configs first; a name we do not ship falls back to torchtune
0.6.1's stock recipe or config, so the baseline stays one command away. Installed as both
``tune`` and ``tune-recipes`` (the latter never collides with torchtune's script).
"""

import argparse
import json
import os
import re
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

from omegaconf import DictConfig

from tune_recipes._cli import registry
from tune_recipes._cli.launch import (
    LAUNCHER_PID_ENV,
    Launch,
    add_launcher_arguments,
    exit_code,
    handle_sigterm,
    how_stopped,
    plan_launch,
    restore_sigterm,
    run_script,
)
from tune_recipes.config import (
    RANK_ERRORS_ENV,
    ConfigError,
    check_overrides,
    load_config,
    validate_config,
)
from tune_recipes.validation import WARNED_ENV, check_config, is_lora_model, warnings_after_checks


class CliError(Exception):
    """Printed as one line on stderr, exit status 2, no traceback."""


def _recipe_or_fail(name: str) -> registry.Resolved:
    r = registry.resolve_recipe(name)
    if r is None:
        if name.endswith(".py"):
            raise CliError(f"recipe file not found: {name}")
        raise CliError(f"unknown recipe '{name}' (not ours, not torchtune's"
                       f"{_did_you_mean(name, registry.list_recipes())}); see `tune ls`")
    return r


def _config_or_fail(name: str) -> registry.Resolved:
    c = registry.resolve_config(name)
    if c is None:
        if name.endswith((".yaml", ".yml")):
            shipped = name.rsplit(".", 1)[0]
            hint = (f"; the shipped config is named without its suffix: {shipped}"
                    if registry.resolve_config(shipped) is not None else "")
            raise CliError(f"config file not found: {name}{hint}")
        raise CliError(f"unknown config '{name}' (not ours, not torchtune's"
                       f"{_did_you_mean(name, registry.list_configs())}); see `tune ls`")
    return c


def _did_you_mean(name: str, names: List[str]) -> str:
    """``; did you mean x?`` for the closest of our ``names``, or nothing."""
    import difflib

    close = difflib.get_close_matches(name, names, n=1)
    return f"; did you mean {close[0]}?" if close else ""


def cmd_run(args: argparse.Namespace, rest: List[str]) -> int:
    recipe = _recipe_or_fail(args.recipe)
    if args.config is None:
        raise CliError("tune run needs --config NAME_OR_PATH")
    config = _config_or_fail(args.config)
    check_overrides(rest)
    # Check now, in this process, everything `tune validate` checks: a bad file, key, value,
    # path or launcher argument fails here in one line (exit 2), before torchrun starts.
    launch = plan_launch(args)
    cfg = load_config(config.path, rest)
    validate_config(cfg)
    _check_recipe(cfg, recipe, args.recipe,
                  nproc_per_node=launch.nproc_per_node if launch else None,
                  nodes=launch.max_nodes if launch else 1)
    recipe_argv = [str(recipe.path), "--config", str(config.path), *rest]
    if launch is not None and launch.max_restarts > 0 \
            and cfg.get("resume_from_checkpoint", False) not in (True, "auto"):
        print(f"warning: --max_restarts {launch.max_restarts} with resume_from_checkpoint="
              f"{cfg.get('resume_from_checkpoint', False)}: a restarted round starts the run over "
              "(or stops beside the first round's checkpoints); set resume_from_checkpoint=auto "
              "to continue from the newest checkpoint", file=sys.stderr)
    if launch is not None:
        return _run_under_torchrun(launch, recipe_argv, cfg.get("output_dir"))
    # Recipes are scripts (not importable modules): run the file as __main__ in this process.
    run_script(recipe.path, recipe_argv[1:])
    return 0


def _run_under_torchrun(launch: Launch, recipe_argv: List[str], output_dir) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    os.environ[WARNED_ENV] = "1"  # the processes need not repeat our warnings
    os.environ[LAUNCHER_PID_ENV] = str(os.getpid())  # the ranks' parent: see die_with_launcher
    on_node = "" if launch.max_nodes == 1 else " on this node"
    _remove_stale_rank_error_folders()
    errors = Path(tempfile.mkdtemp(prefix=f"{RANK_ERRORS_PREFIX}{os.getpid()}_"))
    os.environ[RANK_ERRORS_ENV] = str(errors)  # see config.report_config_error
    rank_label = "rank" if launch.max_nodes == 1 else "local rank"
    started = time.time()
    # Each process starts in our launcher, which imports tune_recipes (its noise filters)
    # before the recipe imports torchtune, then runs the script as __main__.
    try:
        torchrun_main(launch.argv + ["-m", "tune_recipes._cli.launch"] + recipe_argv)
    except ChildFailedError as e:
        # The failing process already printed its own error above (the other processes' lines
        # that differ from the first's follow); torchrun's traceback and summary would only
        # bury it.
        _print_other_ranks_errors(errors, rank_label)
        # A process torchrun itself stopped (SIGTERM, once another had failed) did not fail.
        stopped = [f for f in e.failures.values() if f.exitcode == -signal.SIGTERM]
        failed = [f for f in e.failures.values() if f.exitcode != -signal.SIGTERM] or stopped
        codes = sorted({f.exitcode for f in failed})
        also = (f" and torchrun stopped {len(stopped)} other(s)" if stopped and failed is not stopped
                else "")
        print(f"tune: error: {len(failed)} of {launch.nproc_per_node} processes{on_node} "
              f"failed (exit code {', '.join(map(str, codes))}){also}; their output is above",
              file=sys.stderr)
        return codes[-1] if codes and codes[-1] > 0 else 1
    except SignalException as e:
        # torchrun's agent turns SIGINT/SIGTERM into this after stopping the processes, which
        # say nothing themselves under torchrun (launch.run_script): this is the one line.
        name = signal.Signals(e.sigval).name
        step = _last_logged_step(output_dir, since=started)
        after = f" after step {step} (the last in metrics.jsonl)" if step is not None else ""
        print(f"\ntune: stopped by {name}{after}; "
              f"{_how_to_continue(launch, recipe_argv, output_dir)}", file=sys.stderr)
        return 128 + int(e.sigval)
    finally:
        os.environ.pop(WARNED_ENV, None)
        os.environ.pop(RANK_ERRORS_ENV, None)
        _print_other_ranks_errors(errors, rank_label)  # any not printed above (none twice)
        shutil.rmtree(errors, ignore_errors=True)
        if isinstance(output_dir, str):
            # A process killed by a signal leaves its lock behind: remove it (only a lock
            # whose process on this machine is gone).
            from tune_recipes.training.checkpointing.lock import OutputDirLock

            OutputDirLock(output_dir).remove_if_stale()
    return 0


RANK_ERRORS_PREFIX = "tune_rank_errors_"
STALE_AFTER_S = 3600  # a rank-errors folder of a launcher that is gone, removed after


def _remove_stale_rank_error_folders() -> None:
    """The rank-errors folders of `tune` launchers that are gone (killed by SIGKILL: their
    ``finally`` never ran), found by the launcher's pid in the folder's name. NOTE: only those
    untouched for an hour: a launcher in another pid namespace (a container sharing /tmp) looks
    gone from here while its launch runs."""
    for folder in Path(tempfile.gettempdir()).glob(f"{RANK_ERRORS_PREFIX}*_*"):
        pid = folder.name[len(RANK_ERRORS_PREFIX):].split("_", 1)[0]
        try:
            recent = time.time() - folder.stat().st_mtime < STALE_AFTER_S
        except OSError:
            continue
        if not pid.isdigit() or recent:
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(folder, ignore_errors=True)
        except OSError:
            pass  # alive, another user's process


def _last_logged_step(output_dir, since: float) -> Optional[int]:
    """The step of the last training row in ``output_dir``'s metrics.jsonl logged at or after
    ``since`` (a ``time.time()``; None: no such file or row). An earlier run's rows (a fresh
    run moves them aside, a resume trims them, only once it gets that far) and a row cut short
    by the stop are skipped."""
    if not isinstance(output_dir, str):
        return None
    from tune_recipes.plotting import METRICS_FILE, metric_rows

    try:
        rows = metric_rows((Path(output_dir) / METRICS_FILE).read_text())
    except (OSError, UnicodeDecodeError):
        return None
    for row in reversed(rows):
        if not isinstance(row.get("time"), (int, float)) or row["time"] < since:
            return None  # rows are in time order: the rest are older still
        if "loss" in row and isinstance(row.get("step"), int):
            return row["step"]
    return None


def _print_other_ranks_errors(folder: Path, label: str) -> None:
    """Print, once, the config errors this node's other processes left in ``folder``
    (``config.report_config_error``) that its first process did not print: each distinct one
    once a round, naming the local ranks that met it (and the round, after a torchrun
    restart). Printed lines are removed, so a second call prints nothing."""
    rounds = sorted((int(d.name.split("_")[1]), d) for d in folder.glob("round_*")
                    if d.name.split("_")[1].isdigit())
    for number, round_dir in rounds:
        texts = {}
        for f in round_dir.glob("local_rank_*"):
            try:
                texts[int(f.name.rsplit("_", 1)[1])] = f.read_text()
            except (OSError, ValueError):
                continue
        shutil.rmtree(round_dir, ignore_errors=True)
        printed = texts.get(0)
        ranks_of: Dict[str, List[int]] = {}
        for rank in sorted(texts):
            if rank != 0 and texts[rank] != printed:
                ranks_of.setdefault(texts[rank], []).append(rank)
        when = f"restart {number}, " if number > 0 else ""
        for text, ranks in ranks_of.items():
            print(f"tune: error: {when}{label}{'' if len(ranks) == 1 else 's'} "
                  f"{', '.join(map(str, ranks))}: {text}", file=sys.stderr)


def _how_to_continue(launch: Launch, recipe_argv: List[str], output_dir) -> str:
    """``newest checkpoint ...; resume with: ...``, read from output_dir (the processes that
    knew where the run stood are gone)."""
    from tune_recipes.training.checkpointing.io import newest_checkpoint_dir, resume_point
    from tune_recipes.training.reporting.run_status import resume_hint

    try:
        newest = newest_checkpoint_dir(Path(output_dir)) if isinstance(output_dir, str) else None
        finished = newest is not None and resume_point(output_dir, True).finished
    except ConfigError:  # a step_<n>/ it cannot read: the recipe will say so on resume
        newest, finished = None, False
    if newest is None:
        return f"no checkpoint in {output_dir}"
    if finished:
        return f"the run finished: its final checkpoint {newest} is complete, nothing to resume"
    launcher = [a for a in launch.argv if a != "--standalone"]  # the one-node default
    hint = resume_hint(Path(recipe_argv[0]), recipe_argv[1:], newest, launcher=launcher)
    return f"newest checkpoint {newest}; {hint}"


def _check_recipe(cfg, recipe: registry.Resolved, recipe_name: str, *, env: bool = True,
                  nproc_per_node: Optional[int] = None, nodes: int = 1,
                  output_dir_check: bool = True) -> bool:
    """Keys and values against the schema (tune_recipes/validation.py) with the recipe's
    CONFIG_KEYS, then (``output_dir_check``) what output_dir allows; False when the recipe
    declares none (a torchtune stock recipe or a user's script), whose keys and values are its
    own business. ``nodes``: how many nodes the launch may span (``--nnodes``' maximum)."""
    known = registry.recipe_config_keys(recipe.path)
    if known is None:
        if nproc_per_node is not None and nproc_per_node < 1:
            raise ConfigError(f"--nproc_per_node {nproc_per_node}: expected an integer >= 1")
        return False
    with warnings_after_checks():
        name = Path(recipe_name).stem
        try:
            check_config(cfg, name, known, env=env, nproc_per_node=nproc_per_node, nodes=nodes,
                         recipe_file=str(recipe.path) if recipe.origin == "file" else None)
        except ConfigError as e:
            # A config of another recipe (a LoRA config given to the full fine-tune): say whose.
            # Not for a user's own recipe (its CONFIG_KEYS may be what lacks the key).
            fits = registry.recipes_taking_the_keys(cfg.keys(), like=name) \
                if recipe.origin != "file" and str(e).startswith(f"{name} does not use config key(s)") \
                else []
            # A LoRA-type recipe (it saves adapters) only for a model with adapters.
            fits = [f for f in fits if is_lora_model(cfg)
                    or "save_adapter_weights_only" not in registry.recipe_config_keys(
                        registry.resolve_recipe(f).path)]
            if fits:
                raise ConfigError(f"{e}; the config's keys are those of {' or '.join(fits)}: run "
                                  "it with that recipe") from None
            raise
        if env and output_dir_check:
            _check_output_dir(cfg, known, nodes)
    return True


def _check_output_dir(cfg, known, nodes: int = 1) -> None:
    # Recipes that resume (quantize reads a checkpoint and writes one: no resume, no check).
    output_dir, checkpointer = cfg.get("output_dir"), cfg.get("checkpointer")
    if {"output_dir", "checkpointer", "resume_from_checkpoint"} <= set(known) \
            and isinstance(output_dir, str) and isinstance(checkpointer, DictConfig):
        from tune_recipes.training.checkpointing.io import (
            check_output_dir_allows_the_run,
            paths_the_run_reads,
        )

        # NOTE: on several nodes the lock is not checked here: rank 0 takes it on whichever
        # node the rendezvous makes it, and a node that joins or restarts later would find it
        # held by its own job. The recipe still takes it, so two jobs cannot share output_dir.
        check_output_dir_allows_the_run(output_dir, checkpointer,
                                        cfg.get("resume_from_checkpoint", False),
                                        check_lock=nodes == 1,
                                        read_by_the_run=paths_the_run_reads(cfg))


def cmd_ls(args: argparse.Namespace, rest: List[str]) -> int:
    by_recipe = registry.configs_by_recipe()
    width = max(len(r) for r in by_recipe) if by_recipe else 10
    print(f"{'RECIPE':<{width}}  CONFIG")
    for recipe in sorted(by_recipe):
        configs = by_recipe[recipe] or ["-"]
        for i, c in enumerate(configs):
            print(f"{recipe if i == 0 else '':<{width}}  {c}")
    if args.all:
        print("\ntorchtune 0.6.1 stock recipes (fallback when a name is not ours):")
        recipes, _ = registry._stock()
        for r in recipes:
            print(f"  {r.name}: {', '.join(c.name for c in r.configs) or '-'}")
    return 0


def cmd_cp(args: argparse.Namespace, rest: List[str]) -> int:
    src = registry.resolve_recipe(args.name)
    if src is None or not src.path.suffix == ".py":
        src = registry.resolve_config(args.name)
    if src is None:
        raise CliError(f"unknown recipe or config '{args.name}'"
                       f"{_did_you_mean(args.name, registry.list_recipes() + registry.list_configs())}"
                       "; see `tune ls`")
    dest = Path(args.destination)
    # An existing directory, or a path written as one (``dir/``), receives the file by its name.
    if dest.is_dir() or args.destination.endswith(("/", os.sep)):
        dest = dest / src.path.name
    elif dest.suffix == "":
        dest = dest.with_suffix(src.path.suffix)
    kinds = {".py": "recipe", ".yaml": "config", ".yml": "config"}
    if kinds.get(dest.suffix) != kinds.get(src.path.suffix):
        # `tune run` tells a recipe from a config by the suffix: a config saved as .py (or a
        # recipe as .yaml) would then be "unknown". Refused rather than renamed, so the file
        # is where the user asked or nowhere.
        want = src.path.suffix
        raise CliError(f"{args.destination}: {args.name} is a {kinds[want]}, so its copy needs "
                       f"a {want} name (e.g. {dest.with_suffix(want).name}); `tune run` reads "
                       "recipes from .py files and configs from .yaml files")
    if dest.exists() and not args.force:
        raise CliError(f"{dest} already exists (pass --force to overwrite)")
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src.path, dest)
    except OSError as e:
        raise CliError(f"cannot write {dest}: {e.strerror or e}") from None
    print(f"copied {src.path} -> {dest}")
    return 0


def cmd_cat(args: argparse.Namespace, rest: List[str]) -> int:
    """Print a config (ours, torchtune's stock one, or a YAML file) as it is written, comments
    included; ``--sort``: its keys sorted at every level (the YAML written anew, so without
    comments). Interpolations (``${output_dir}``) are printed as written, not resolved."""
    config = registry.resolve_config(args.config)
    if config is None:
        if not args.config.lower().endswith((".yaml", ".yml")):
            if registry.resolve_recipe(args.config) is not None:
                raise CliError(f"'{args.config}' is a recipe, not a config: `tune cat` prints "
                               "configs (`tune ls` lists each recipe's); `tune cp "
                               f"{args.config} DEST.py` copies the recipe")
            if Path(args.config).is_file():
                raise CliError(f"{args.config}: not a .yaml or .yml file; `tune cat` prints "
                               "a config: a name from `tune ls` or a YAML file")
        config = _config_or_fail(args.config)
    cfg = load_config(config.path)  # a file that is not a config fails here, naming the line
    if args.sort:
        from omegaconf import OmegaConf

        text = OmegaConf.to_yaml(cfg, resolve=False, sort_keys=True)
    else:
        try:
            text = config.path.read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise CliError(f"cannot read {config.path}: {getattr(e, 'strerror', None) or e}") \
                from None
    sys.stdout.write(text if text.endswith("\n") or not text else text + "\n")
    return 0


def _names_a_typed_key(message: str, overrides: List[str]) -> bool:
    """Whether ``message`` (``key=value: ...``, as the checks word it) is about a top-level key
    ``overrides`` set or set a part of: ``checkpointer.checkpoint_dir=...`` typed makes
    ``checkpointer.checkpoint_files`` this machine's too."""
    failing = re.match(r"([\w.]+)[=:]", message)
    typed = {a.split("=", 1)[0].lstrip("~+").split(".")[0] for a in overrides if "=" in a}
    return failing is not None and failing.group(1).split(".")[0] in typed


def cmd_validate(args: argparse.Namespace, rest: List[str]) -> int:
    config = _config_or_fail(args.config)
    recipe_name = (args.recipe or registry.recipe_for_config(args.config)
                   or registry.recipe_named_in_header(config.path))
    recipe = _recipe_or_fail(recipe_name) if recipe_name else None
    with warnings_after_checks():
        try:
            cfg, note = _validate(config, rest, recipe, recipe_name, portable=args.portable)
        except ConfigError as e:
            if args.portable or _names_a_typed_key(str(e), rest):
                raise  # a value typed on this machine's command line is not another machine's
            # A path or device of another machine (a GPU config on a laptop): say so, if the
            # portable checks pass (their warnings unprinted: the error is the answer).
            try:
                with warnings_after_checks(print_them=False):
                    _validate(config, rest, recipe, recipe_name, portable=True)
            except ConfigError:
                raise e from None
            raise ConfigError(f"{e} (a config written for another machine: add --portable to "
                              "skip this machine's paths and devices)") from None
        # Not a matter of another machine: what this output_dir holds (a live run, a checkpoint).
        known = registry.recipe_config_keys(recipe.path) if recipe is not None else None
        if not args.portable and known is not None:
            _check_output_dir(cfg, known)
    # NOTE: not "valid" where the keys, values and paths went unchecked.
    if recipe is None:
        print(f"components bind: {config.path} ({note}); its recipe is named neither by the "
              "file name nor by a `tune run` line in its header, so its keys, values, paths "
              "and output_dir were not checked: add --recipe NAME")
        return 0
    if known is None:
        print(f"components bind: {config.path} ({note}); {recipe_name} declares no "
              "CONFIG_KEYS, so its keys, values, paths and output_dir were not checked")
        return 0
    print(f"config is valid: {config.path} ({note})")
    return 0


def _validate(config: registry.Resolved, rest: List[str], recipe: Optional[registry.Resolved],
              recipe_name: Optional[str], portable: bool):
    cfg = load_config(config.path, rest)
    skipped: Optional[List[str]] = [] if portable else None
    checked = validate_config(cfg, skipped=skipped)
    keys_note = ""
    if recipe is not None and _check_recipe(cfg, recipe, recipe_name, env=not portable,
                                            output_dir_check=False):
        keys_note = f", every top-level key is read by {recipe_name}, values in range"
        if portable:
            keys_note += " (--portable: paths and devices not checked)"
    if skipped:
        keys_note += f"; not checked here: {', '.join(skipped)}"
    return cfg, f"{len(checked)} components bind{keys_note}"


def cmd_plot(args: argparse.Namespace, rest: List[str]) -> int:
    from tune_recipes import plotting

    try:
        out = plotting.plot_runs(args.output_dirs, out=args.out)
    except plotting.PlotError as e:
        raise CliError(str(e)) from None
    print(f"wrote {out}")
    return 0


def version_line() -> str:
    """Ours and the stack underneath, read from package metadata (imports nothing heavy)."""
    from importlib.metadata import PackageNotFoundError, version

    import tune_recipes

    def v(dist: str) -> str:
        try:
            return version(dist)
        except PackageNotFoundError:
            return "not installed"

    deps = ", ".join(f"{d} {v(d)}" for d in ("torch", "torchtune", "torchao"))
    return f"tune-recipes {tune_recipes.__version__} ({deps})"


def cmd_download(args: argparse.Namespace, rest: List[str]) -> int:
    # Delegates to torchtune's downloader (Hugging Face Hub / Kaggle), same flags.
    from unittest import mock

    from torchtune._cli.tune import main as torchtune_main

    import torchtune._cli.download as download

    sys.argv = ["tune", "download", *rest]
    # NOTE: torchtune's downloader reports a failed download through argparse's error() with
    # the whole traceback chain in the message (five chained tracebacks when offline); here it
    # is the one line of what failed.
    with mock.patch.object(argparse.ArgumentParser, "error", _download_error), \
            mock.patch.object(download, "snapshot_download",
                              _downloaded_or_failed(download.snapshot_download)), \
            mock.patch.object(download, "print", _without_no_patterns_line, create=True):
        torchtune_main()
    return 0


def _downloaded_or_failed(snapshot_download):
    """huggingface_hub's ``snapshot_download``, failing where it would return an existing
    ``local_dir`` untouched because the Hub could not be reached (its warning, dropped here):
    torchtune would then write its repo-id file into that folder and print "Successfully
    downloaded" over whatever the folder held."""
    import logging

    def download(repo_id, *args, local_dir=None, **kwargs):
        gave_up = []

        def note(record) -> bool:
            if "Returning existing local_dir" in record.getMessage():
                gave_up.append(record)
                return False
            return True

        hub_log = logging.getLogger("huggingface_hub._snapshot_download")
        # NOTE: its own level, so the warning is made (and dropped here) however quiet
        # HF_HUB_VERBOSITY keeps the Hub's loggers.
        level_before = hub_log.level
        hub_log.setLevel(logging.WARNING)
        hub_log.addFilter(note)
        try:
            path = snapshot_download(repo_id, *args, local_dir=local_dir, **kwargs)
        finally:
            hub_log.removeFilter(note)
            hub_log.setLevel(level_before)
        if gave_up:
            if _earlier_download_of(local_dir) == repo_id:
                print(f"note: the Hub could not be reached; {local_dir} holds an earlier download "
                      f"of {repo_id}, left as it was", file=sys.stderr)
                return path
            raise ConnectionError(f"the Hub could not be reached, so nothing was downloaded; "
                                  f"{local_dir} holds only what it held before")
        return path

    return download


def _earlier_download_of(folder) -> Optional[str]:
    """The repo id torchtune recorded in ``folder`` after a download that completed there
    (``original_repo_id.json``), or None."""
    try:
        from tune_recipes.constants import DOWNLOADED_REPO_FILE

        return json.loads((Path(folder) / DOWNLOADED_REPO_FILE).read_text()).get("repo_id")
    except (OSError, ValueError, TypeError, AttributeError):
        return None


def _without_no_patterns_line(*args, **kwargs) -> None:
    # torchtune announces "Ignoring files matching the following patterns: None" even when no
    # pattern was given.
    if args and str(args[0]).endswith("following patterns: None"):
        return
    print(*args, **kwargs)


def _download_error(parser: argparse.ArgumentParser, message: str) -> None:
    what = message.split(" and traceback:")[0].strip()
    what = (what.splitlines() or [""])[0][:500]
    hint = ""
    if any(w in message for w in ("NameResolution", "Max retries", "ConnectionError",
                                  "ConnectTimeout", "OfflineModeIsEnabled", "Network is unreachable")):
        hint = " (no network? the download needs huggingface.co or kaggle.com)"
    print(f"tune download: error: {what}{hint}", file=sys.stderr)
    sys.exit(2)


_OVERRIDES_HELP = """\
overrides (any number, after the config):
  key=value     set a value; dotted keys reach nested ones (optimizer.lr=1e-4); null (or None,
                as torchtune reads it) is None
  ~key          delete a key (~lr_scheduler: train without a schedule)
Values parse as YAML (4 is an int, 1e-4 a float, [a,b] a list); keys a recipe does not read,
unknown components and arguments they do not take are reported in one line before any work.
"""


class _Parser(argparse.ArgumentParser):
    """argparse's mistakes in one line, as ours: ``tune: error: ...`` (exit 2), where to look
    next instead of the usage block."""

    def error(self, message: str):
        print(f"tune: error: {message} (see `{self.prog} --help`)", file=sys.stderr)
        sys.exit(2)


class _Once(argparse.Action):
    """An option that may be given once: a second ``--config`` is a mistake, not an override."""

    def __call__(self, parser, namespace, values, option_string=None):
        if getattr(namespace, self.dest, None) is not None:
            parser.error(f"{option_string} given twice ({getattr(namespace, self.dest)} and "
                         f"{values}); give it once")
        setattr(namespace, self.dest, values)


def build_parser(launcher: bool = True) -> argparse.ArgumentParser:
    """``launcher=False`` leaves torchrun's options off ``tune run`` (importing torchrun costs
    seconds): for commands other than ``run``."""
    fmt = argparse.RawDescriptionHelpFormatter
    p = _Parser(
        prog="tune",
        description="tune-recipes: fine-tuning recipes (ours first, torchtune 0.6.1 as fallback)",
        epilog="`tune <command> --help` explains each command. Docs: docs/cli.md.",
    )
    p.add_argument("--version", action="version", version=version_line(),
                   help="print our version and torch/torchtune/torchao's, then exit")
    sub = p.add_subparsers(dest="command", metavar="{run,ls,cp,cat,validate,plot,download}")
    run = sub.add_parser(
        "run", help="run a recipe with a config and key=value overrides", formatter_class=fmt,
        usage="tune run [LAUNCHER OPTIONS] RECIPE --config CONFIG [key=value ...] [~key ...]",
        description="Run RECIPE with CONFIG, changed by overrides. Any launcher option (torchrun's\n"
                    "own, e.g. --nproc_per_node, --nnodes) runs it under torchrun; see\n"
                    "docs/multinode.md for several machines.",
        epilog=_OVERRIDES_HELP + """
examples:
  tune run lora_finetune_single_device --config tiny/lora_single_device
  tune run full_finetune_single_device --config tiny/full_single_device \\
      batch_size=4 optimizer.lr=1e-4 ~lr_scheduler
  tune run --nproc_per_node 2 full_finetune_distributed --config tiny/full_distributed
  tune run --nnodes 2 --node_rank 0 --nproc_per_node 8 --rdzv_backend c10d \\
      --rdzv_endpoint node0:29500 --rdzv_id job1 full_finetune_distributed --config ...
""")
    run.add_argument("recipe", help="recipe name (see `tune ls`) or path to a .py file")
    run.add_argument("--config", action=_Once, default=None,
                     help="config name (see `tune ls`) or path to a .yaml file")
    if launcher:
        add_launcher_arguments(run)
    run.set_defaults(fn=cmd_run)
    ls = sub.add_parser("ls", help="list our recipes and their configs")
    ls.add_argument("--all", action="store_true", help="also list torchtune's stock recipes")
    ls.set_defaults(fn=cmd_ls)
    cp = sub.add_parser(
        "cp", help="copy a recipe or config out to edit", formatter_class=fmt,
        description="Copy a recipe or config (ours, else torchtune's) to a file you can edit\n"
                    "and run: `tune run my_lora.py --config my_config.yaml`.",
        epilog="""examples:
  tune cp lora_finetune_single_device my_lora.py
  tune cp tiny/lora_single_device configs_mine/      # -> configs_mine/lora_single_device.yaml
""")
    cp.add_argument("name", help="recipe (e.g. lora_finetune_single_device) or config "
                                 "(e.g. tiny/lora_single_device); see `tune ls`")
    cp.add_argument("destination",
                    help="file to write (no suffix: .py or .yaml is added), or a directory "
                         "(existing, or written with a trailing /) to copy into under the "
                         "source's file name")
    cp.add_argument("--force", action="store_true", help="overwrite an existing file")
    # torchtune's `tune cp` creates missing folders only with this flag; ours always does, and
    # accepts the flag so torchtune users' commands run unchanged.
    cp.add_argument("--make-parents", action="store_true",
                    help="accepted as torchtune's; missing parent folders are always created")
    cp.set_defaults(fn=cmd_cp)
    cat = sub.add_parser(
        "cat", help="print a config, to see the keys `tune run` can override",
        formatter_class=fmt,
        description="Print CONFIG as its file is written, comments included: ours (the names\n"
                    "`tune ls` shows), else torchtune 0.6.1's stock config of that name, or a\n"
                    ".yaml file. Interpolations (${output_dir}) are printed as written.",
        epilog="""examples:
  tune cat tiny/lora_single_device
  tune cat llama3_2/1B_full_single_device --sort
  tune cat my_config.yaml

then override what you found:
  tune run lora_finetune_single_device --config tiny/lora_single_device batch_size=4
""")
    cat.add_argument("config", help="config name (see `tune ls`) or path to a .yaml file")
    cat.add_argument("--sort", action="store_true",
                     help="print the keys sorted at every level (the YAML written anew, "
                          "without the file's comments)")
    cat.set_defaults(fn=cmd_cat)
    val = sub.add_parser(
        "validate", help="check a config: components resolve and kwargs bind",
        formatter_class=fmt,
        usage="tune validate CONFIG [key=value ...] [~key ...] [--recipe RECIPE] [--portable]",
        description="Check CONFIG with its overrides applied, without building anything:\n"
                    "every _component_ imports, every key binds to its signature, every\n"
                    "top-level key is one the recipe reads, and every value has the right type\n"
                    "and range, paths exist and the device is available, and output_dir allows\n"
                    "the run (no live run in it; a checkpoint to resume, or for a fresh run no\n"
                    "earlier run's step_<n>/): the checks `tune run` and the recipe make before\n"
                    "any work.",
        epilog=_OVERRIDES_HELP + """
example:
  tune validate llama3_2/1B_lora_single_device optimizer.lr=1e-4 ~lr_scheduler
""")
    val.add_argument("config", help="config name (see `tune ls`) or path to a .yaml file")
    val.add_argument("--recipe", default=None,
                     help="the recipe to check the config against (default: by the config's name, "
                          "else by the `tune run` line in its header, as `tune cp` keeps it; "
                          "with neither, only the components are checked)")
    val.add_argument("--portable", action="store_true",
                     help="skip the checks of this machine (paths exist, device and dtype "
                          "available, components from packages not installed here): for a "
                          "config written for another machine")
    val.set_defaults(fn=cmd_validate)
    plot = sub.add_parser(
        "plot", help="draw loss, lr, grad norm and tokens/s of runs into a PNG",
        formatter_class=fmt,
        description="Read each OUTPUT_DIR's metrics.jsonl and draw train (and validation)\n"
                    "loss, learning rate, gradient norm and tokens/s against the step into one\n"
                    "PNG; several runs are overlaid, the legend naming each by its folder.\n"
                    "An earlier run's metrics.<time>.jsonl, kept aside when a fresh run\n"
                    "started in its output_dir, is drawn into its own metrics.<time>.png.",
        epilog="""examples:
  tune plot outputs/tiny_lora_single_device
  tune plot outputs/tiny_lora_single_device/metrics.20261205-215244.jsonl
  tune plot outputs/run_a outputs/run_b --out compare.png
""")
    plot.add_argument("output_dirs", nargs="+", metavar="OUTPUT_DIR",
                      help="a run's output_dir (or its metrics.jsonl)")
    plot.add_argument("--out", default=None,
                      help="PNG to write (default: the first run's own picture: "
                           "FIRST_OUTPUT_DIR/metrics.png; for a metrics.<time>.jsonl, "
                           "metrics.<time>.png beside it)")
    plot.set_defaults(fn=cmd_plot)
    dl = sub.add_parser("download", help="download a model (delegates to torchtune)",
                        add_help=False)
    dl.set_defaults(fn=cmd_download)
    return p


def main(argv: Optional[List[str]] = None) -> int:
    """The ``tune`` command. Ctrl-C or SIGTERM anywhere before the recipe runs (imports,
    config, checks, model build, torchrun's start) ends in one line, as it does during
    training (``launch.run_script``), and the lock a run took is released (exit handlers)."""
    previous = handle_sigterm()
    try:
        return _main(argv)
    except KeyboardInterrupt as e:
        print(f"\ntune: {how_stopped(e)} before the recipe started training; nothing was "
              "written", file=sys.stderr)
        return exit_code(e)
    finally:
        restore_sigterm(previous)


def _main(argv: Optional[List[str]]) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(launcher=argv[:1] == ["run"])
    if argv and argv[0] == "download":
        args, rest = parser.parse_args(argv[:1]), argv[1:]
    else:
        args, rest = parser.parse_known_args(argv)
    if getattr(args, "fn", None) is None:
        parser.print_help()
        return 2
    if args.command in ("ls", "cp", "cat", "plot") and rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    try:
        return args.fn(args, rest)
    except (CliError, ConfigError) as e:
        print(f"tune: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
