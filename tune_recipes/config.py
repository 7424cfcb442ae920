"""YAML configs with ``key=value`` overrides, validated by binding constructor signatures.

Config keys mirror constructor kwargs: a node with ``_component_: dotted.path`` is instantiated
as ``dotted.path(**other_keys)`` (plus positional arguments the recipe passes, such as the
tokenizer for a dataset). ``validate_config`` checks that every component resolves and that its
keys bind to its signature, naming the key path of anything that does not. ``parse`` (every
recipe's entry point) then checks every value against the schema in
``tune_recipes/validation.py`` with the recipe's ``CONFIG_KEYS``.
"""

import functools
import importlib.util
import inspect
import os
import re
import sys
from pathlib import Path
from typing import Any, Callable, Iterable, List, Optional, Sequence

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

# ConfigError is re-exported: recipes and the library import it from here.
from tune_recipes.validation import ConfigError, check_config, check_top_level_keys  # noqa: F401

_OVERRIDE_KEY = re.compile(r"^~?[A-Za-z_][A-Za-z0-9_\-]*(\.[A-Za-z0-9_\-]+)*$")


def positive_int_or_none(key: str, value: Any) -> Optional[int]:
    """``value`` for an ``every N`` / ``keep N`` argument: a positive int (not a bool) or None.
    Config files are checked earlier by the schema (validation.py); this guards direct calls."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"{key} must be a positive int or None, got {value!r}")
    return value


def check_overrides(overrides: Sequence[str]) -> None:
    for item in overrides:
        if item.startswith("~"):
            key = item
        elif "=" not in item:
            raise ConfigError(
                f"bad override '{item}': expected key=value (e.g. batch_size=4) or ~key to delete"
            )
        else:
            key = item.split("=", 1)[0]
        if not _OVERRIDE_KEY.match(key):
            raise ConfigError(f"bad override '{item}': '{key}' is not a valid dotted key")


def load_config(path: str | Path, overrides: Sequence[str] = ()) -> DictConfig:
    """Load ``path`` and apply ``overrides`` (``a.b=value`` sets, ``~a.b`` deletes)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    check_overrides(overrides)
    try:
        cfg = OmegaConf.load(path)
    except (OmegaConfBaseException, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"cannot parse {path}: {first}") from None
    except Exception as e:  # yaml.YAMLError and friends
        raise ConfigError(f"cannot parse {path}: {' '.join(str(e).split())}") from None
    if not isinstance(cfg, DictConfig):
        raise ConfigError(f"{path} must hold a mapping of keys, not a {type(cfg).__name__}")
    for item in overrides:
        if not item.startswith("~"):
            cfg = _apply_override(cfg, item)
    for item in overrides:
        if item.startswith("~"):
            _delete_key(cfg, item[1:], path)
    return _home_expanded(cfg)


def _home_expanded(cfg: DictConfig) -> DictConfig:
    """Every value that starts with ``~/`` (or is ``~``) with the home folder written out, as a
    shell would and as ``tune validate`` reads paths: torchtune's checkpointers, Hugging Face's
    loaders and the recipes' own files take ``~`` as a folder's name (output_dir, checkpoint_dir,
    tokenizer.path, data_files, log_dir alike)."""
    def expand(node):
        if isinstance(node, dict):
            return {k: expand(v) for k, v in node.items()}
        if isinstance(node, list):
            return [expand(v) for v in node]
        if isinstance(node, str) and (node == "~" or node.startswith("~/")):
            return os.path.expanduser(node)
        return node

    plain = OmegaConf.to_container(cfg, resolve=False)
    expanded = expand(plain)
    return cfg if expanded == plain else OmegaConf.create(expanded)


def _apply_override(cfg: DictConfig, item: str) -> DictConfig:
    """``key=value`` merged into ``cfg``: a mapping merges into a mapping (``optimizer={lr: 1}``
    keeps the other keys), anything else replaces the node.

    NOTE: OmegaConf's merge refuses a list where the config holds a mapping or the reverse
    ("Cannot merge incompatible container types", a TypeError): a user writing
    ``checkpointer.checkpoint_files=[a.safetensors]`` over torchtune's
    ``{filename_format, max_filename}`` form, or ``some_list.0=x``, means to replace that node
    or item, so it is replaced and the result is validated like any other config."""
    key, _, value = item.partition("=")
    if value == "None":  # as torchtune's parser reads it: null, not the string "None"
        item = f"{key}=null"
    try:
        part = OmegaConf.from_dotlist([item])
    except (OmegaConfBaseException, ValueError) as e:
        raise ConfigError(f"bad override '{item}': {str(e).splitlines()[0]}") from None
    except Exception as e:  # yaml.YAMLError: the value is parsed as YAML ([a,b], {k: v})
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"bad override '{item}': its value is not valid YAML ({problem}; "
                          "quote the value if it is meant as a string)") from None
    try:
        return OmegaConf.merge(cfg, part)
    except TypeError:
        pass  # incompatible container types: replace the node below
    except OmegaConfBaseException as e:
        raise ConfigError(f"cannot apply override '{item}': {str(e).splitlines()[0]}") from None
    parts = key.split(".")
    for i in range(1, len(parts)):
        node = OmegaConf.select(cfg, ".".join(parts[:i]), default=None)
        if isinstance(node, ListConfig) and not parts[i].isdigit():
            raise ConfigError(
                f"bad override '{item}': {'.'.join(parts[:i])} is a list here ({_short(node)}), "
                f"whose items are numbered; replace it whole ({'.'.join(parts[:i])}=...)")
    try:
        OmegaConf.update(cfg, key, OmegaConf.select(part, key), merge=False)
    except (OmegaConfBaseException, TypeError, ValueError) as e:
        raise ConfigError(f"cannot apply override '{item}': {str(e).splitlines()[0]}") from None
    return cfg


def _short(node: Any) -> str:
    text = str(OmegaConf.to_container(node, resolve=False))
    return text if len(text) <= 60 else text[:57] + "..."


def _delete_key(cfg: DictConfig, dotted: str, path: Path) -> None:
    *parents, leaf = dotted.split(".")
    node = cfg
    for p in parents:
        if not isinstance(node, DictConfig) or p not in node:
            raise ConfigError(f"cannot delete '{dotted}': no such key in {path}")
        node = node[p]
    if not isinstance(node, DictConfig) or leaf not in node:
        raise ConfigError(f"cannot delete '{dotted}': no such key in {path}")
    del node[leaf]


def resolve_component(dotted: str, key_path: str = "") -> Callable:
    """Import ``dotted`` (``pkg.module.attr``), with an error naming the config key."""
    where = f"{key_path}._component_" if key_path else "_component_"
    parts = dotted.split(".")
    for i in range(len(parts) - 1, 0, -1):
        module_name = ".".join(parts[:i])
        try:
            obj: Any = __import__(module_name, fromlist=[parts[i]])
        except ModuleNotFoundError as e:
            if e.name and module_name.startswith(e.name):
                continue
            err = ConfigError(f"{where}: importing '{dotted}' failed: {e}")
            err.missing_module = e.name  # a package this machine lacks (see validate_config)
            raise err from None
        try:
            for attr in parts[i:]:
                obj = getattr(obj, attr)
            return obj
        except AttributeError:
            break
    err = ConfigError(f"{where}: '{dotted}' does not resolve to an importable object")
    if importlib.util.find_spec(parts[0]) is None:
        err.missing_module = parts[0]
    raise err


def _iter_components(node: Any, key_path: str = ""):
    if isinstance(node, DictConfig):
        if "_component_" in node:
            yield key_path, node
        for k in node.keys():
            if k == "_component_":
                continue
            child = node._get_node(k)
            if child is not None and not OmegaConf.is_interpolation(node, k):
                yield from _iter_components(node[k], f"{key_path}.{k}" if key_path else str(k))
    elif isinstance(node, ListConfig):
        for i, item in enumerate(node):
            yield from _iter_components(item, f"{key_path}[{i}]")


# What the recipes pass a top-level component besides its config keys: (how many positional
# arguments, keyword arguments). The optimizer gets the parameters, a dataset the tokenizer,
# the LR scheduler the optimizer and the run's length (training/step/optim.LRSchedule).
PASSED_BY_RECIPES = {
    "optimizer": (1, ()),
    "dataset": (1, ()),
    "dataset_val": (1, ()),
    "lr_scheduler": (1, ("num_training_steps", "last_epoch")),
}


def _missing_required(key_path: str, params, kwargs) -> List[str]:
    """Required arguments of the component at ``key_path`` that neither the config nor the
    recipe gives. Only top-level components (and the items of a top-level list) are checked:
    what a recipe passes anything nested is not known here."""
    top = re.sub(r"\[\d+\]$", "", key_path)
    if not top or "." in top:
        return []
    positional, passed = PASSED_BY_RECIPES.get(top, (0, ()))
    missing = []
    for i, (name, p) in enumerate(params.items()):
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) or p.default is not p.empty:
            continue
        if i < positional and p.kind is not p.KEYWORD_ONLY:
            continue
        if name not in kwargs and name not in passed:
            missing.append(name)
    return missing


def _unresolvable_key(node: Any, key_path: str = "") -> str:
    """The dotted key of the first value whose interpolation does not resolve, or ""."""
    items = (node.items_ex(resolve=False) if isinstance(node, DictConfig)
             else enumerate(node) if isinstance(node, ListConfig) else ())
    for k, _ in items:
        child = f"{key_path}.{k}" if key_path else str(k)
        try:
            value = node[k]
        except OmegaConfBaseException:
            return child
        found = _unresolvable_key(value, child)
        if found:
            return found
    return ""


def validate_config(cfg: DictConfig, skipped: Optional[List[str]] = None) -> List[str]:
    """Every ``_component_`` resolves and its other keys bind to its signature.

    Returns the list of key paths checked; raises ConfigError naming the first bad one.
    Arguments that recipes pass at instantiation (``PASSED_BY_RECIPES``: the model's parameters
    for an optimizer, the tokenizer for a dataset) may be absent; any other required argument
    of a top-level component must be set.
    ``skipped`` (a list): a component whose import fails only because a package is not
    installed here (``bitsandbytes``, ``torchvision``) is appended as ``"key (package)"``
    instead of raising, for checking a config meant for another machine.
    """
    try:
        OmegaConf.resolve(OmegaConf.create(OmegaConf.to_container(cfg, resolve=False)))
    except OmegaConfBaseException as e:
        where = _unresolvable_key(cfg)
        raise ConfigError(f"{where + ': ' if where else ''}interpolation failed: "
                          f"{str(e).splitlines()[0]}") from None
    checked = []
    for key_path, node in _iter_components(cfg):
        target = node["_component_"]
        try:
            fn = resolve_component(str(target), key_path)
        except ConfigError as e:
            missing = getattr(e, "missing_module", None)
            if skipped is None or not missing:
                raise
            skipped.append(f"{key_path} ({missing} not installed)")
            continue
        kwargs = {k: None for k in node.keys() if k != "_component_"}
        try:
            sig = inspect.signature(fn)
        except (TypeError, ValueError):
            checked.append(key_path)
            continue
        params = sig.parameters
        accepts_var_kw = any(p.kind is p.VAR_KEYWORD for p in params.values())
        missing = _missing_required(key_path, params, kwargs)
        if missing:
            raise ConfigError(f"{key_path}: {target} needs {', '.join(missing)} (not set in the "
                              f"config; add {', '.join(f'{key_path}.{m}=...' for m in missing)})")
        for k in kwargs:
            if k not in params and not accepts_var_kw:
                raise ConfigError(
                    f"{key_path}.{k}: {target} has no argument '{k}' "
                    f"(it takes: {', '.join(n for n in params if n not in ('self', 'args', 'kwargs'))})"
                )
            if k in params and params[k].kind is params[k].POSITIONAL_ONLY:
                raise ConfigError(f"{key_path}.{k}: {target} takes '{k}' only positionally")
            if k in params and _takes_a_bool(params[k]):
                value = node.get(k)
                if not (value is None or isinstance(value, bool) or value in (0, 1)):
                    # NOTE: a string is truthy: 'Flase' would silently turn the option on.
                    quoted = isinstance(value, str) and value.lower() in ("true", "false")
                    hint = (" (a quoted string, or an environment variable: unquote it, or "
                            "read the variable with ${oc.decode:${oc.env:NAME}})") if quoted else ""
                    shown = repr(value) if quoted else value
                    raise ConfigError(f"{key_path}.{k}={shown}: expected True or False, "
                                      f"{target}'s '{k}' is a flag{hint}")
        checked.append(key_path or "<root>")
    return checked


_BOOL_ANNOTATIONS = {bool, Optional[bool], "bool", "Optional[bool]", "bool | None"}


def _takes_a_bool(param: inspect.Parameter) -> bool:
    """Whether a component's argument is a flag: a bool default, or annotated bool (or
    Optional[bool])."""
    if isinstance(param.default, bool):
        return True
    try:
        return param.annotation in _BOOL_ANNOTATIONS
    except TypeError:  # an unhashable annotation
        return False


def check_known_keys(cfg: DictConfig, known: Iterable[str], recipe: str) -> None:
    """Reject top-level keys the recipe does not read, so a typo is never silently ignored.

    A typo gets a did-you-mean; a torchtune 0.6.1 key whose feature the recipe does not
    implement is an error only when its value turns the feature on, else a one-line warning
    (``tune_recipes.validation.check_top_level_keys``)."""
    check_top_level_keys(cfg, known, recipe)


def parse_recipe_argv(argv: Sequence[str]) -> DictConfig:
    """``--config PATH [key=value ...]`` as passed by ``tune run`` (or by hand)."""
    argv = list(argv)
    if "--config" not in argv:
        raise ConfigError("missing --config PATH")
    i = argv.index("--config")
    if i + 1 >= len(argv):
        raise ConfigError("--config needs a path")
    path = argv[i + 1]
    overrides = argv[:i] + argv[i + 2 :]
    return load_config(path, overrides)


def parse(recipe_main: Callable[[DictConfig], Any]) -> Callable[[], Any]:
    """Decorator for a recipe's entry point: parse sys.argv into a DictConfig and call it.

    Config problems print one line naming the key or file and exit with status 2.
    """

    @functools.wraps(recipe_main)
    def wrapper(argv: Optional[Sequence[str]] = None):
        try:
            cfg = parse_recipe_argv(sys.argv[1:] if argv is None else argv)
            # Bad component paths and kwargs fail here, in one line naming the key, before
            # any model is built.
            validate_config(cfg)
            # Every value (type, range, paths, device) against the one schema, with the
            # recipe's own CONFIG_KEYS: the same checks `tune run` made in the parent.
            g = getattr(recipe_main, "__globals__", {})
            check_config(cfg, Path(g.get("__file__") or "recipe").stem, g.get("CONFIG_KEYS"))
            return recipe_main(cfg)
        except ConfigError as e:
            report_config_error(e)
            sys.exit(2)

    return wrapper


# Set by `tune run` for the processes it starts under torchrun: a folder where each process of
# this node leaves its config error (``round_<restart>/local_rank_<n>``), for `tune` to print
# the lines once.
RANK_ERRORS_ENV = "TUNE_RECIPES_RANK_ERRORS"


def report_config_error(e: ConfigError) -> None:
    """``tune: error: ...`` on stderr, the prefix `tune` itself prints (one form everywhere).

    Under `tune run`'s torchrun (``RANK_ERRORS_ENV`` set) every process of a node usually meets
    the same error (a config value, the dataset's size): the node's first process prints its
    line at once, the others leave theirs in the folder, and `tune` prints afterwards each line
    the first did not (``_cli/main.py``), instead of one copy a process."""
    folder, local_rank = os.environ.get(RANK_ERRORS_ENV), os.environ.get("LOCAL_RANK", "0")
    if folder:
        try:
            round_dir = Path(folder, f"round_{int(os.environ.get('TORCHELASTIC_RESTART_COUNT') or 0)}")
            round_dir.mkdir(exist_ok=True)
            (round_dir / f"local_rank_{int(local_rank)}").write_text(str(e))
            if local_rank != "0":
                return
        except (OSError, ValueError):
            pass  # the line is printed here instead
    _end_progress_bars()
    print(f"tune: error: {e}", file=sys.stderr)


def _end_progress_bars() -> None:
    """Close every open tqdm bar (torchtune's "Packing dataset", the training bar, any other
    library's), each ending its line: an error met while a bar is drawn (a packed dataset's bad
    example) would otherwise print on the bar's unfinished line. Only for a process about to
    end on that error: a bar closed here draws no more."""
    tqdm = getattr(sys.modules.get("tqdm"), "tqdm", None)
    for bar in list(getattr(tqdm, "_instances", ())):
        try:
            bar.close()
        except Exception:  # noqa: BLE001 - a bar whose stream is gone: the error line matters more
            pass
