"""Where our recipes and configs live, and how names resolve (ours first, then torchtune's)."""

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional

import tune_recipes

# A config named <size>_<suffix>.yaml runs with the recipe this table maps its suffix to.
# Longest suffix wins (qat_lora_distributed before lora_distributed).
CONFIG_SUFFIX_TO_RECIPE: Dict[str, str] = {
    "full_single_device": "full_finetune_single_device",
    "lora_single_device": "lora_finetune_single_device",
    "qlora_single_device": "lora_finetune_single_device",
    "dora_single_device": "lora_finetune_single_device",
    "qat_single_device": "qat_single_device",
    "quantize": "quantize",
    "full_distributed": "full_finetune_distributed",
    "lora_distributed": "lora_finetune_distributed",
    "qat_distributed": "qat_distributed",
    "qat_lora_distributed": "qat_lora_finetune_distributed",
    "kd_distributed": "knowledge_distillation_distributed",
    "kd_single_device": "knowledge_distillation_single_device",
    # torchtune's distillation configs (8B_to_1B_KD_lora_single_device): before lora_*.
    "KD_lora_distributed": "knowledge_distillation_distributed",
    "KD_lora_single_device": "knowledge_distillation_single_device",
}


def _root(kind: str) -> Path:
    """Top-level ``recipes/`` or ``configs/`` of a source checkout (editable install), else the
    copy shipped inside the installed package under ``tune_recipes/_shipped/``."""
    pkg = Path(tune_recipes.__file__).resolve().parent
    checkout = pkg.parent / kind
    if (pkg.parent / "pyproject.toml").is_file() and checkout.is_dir():
        return checkout
    return pkg / "_shipped" / kind


def recipes_dir() -> Path:
    return _root("recipes")


def configs_dir() -> Path:
    return _root("configs")


def list_recipes() -> List[str]:
    return sorted(p.stem for p in recipes_dir().glob("*.py") if not p.name.startswith("_"))


def list_configs() -> List[str]:
    root = configs_dir()
    return sorted(str(p.relative_to(root).with_suffix("")) for p in root.rglob("*.yaml"))


# A config named ``<base>_fast`` is its base config with the benchmarked fastest settings.
FAST_SUFFIX = "_fast"


def recipe_for_config(config_name: str) -> Optional[str]:
    """The recipe a config is for, from its name or file path (``llama3_1/8B_lora_single_device``,
    ``configs/llama3_1/8B_lora_single_device.yaml``, a ``..._fast`` variant, or a copy named
    alike); None if unknown."""
    stem = Path(config_name).name
    if stem.lower().endswith((".yaml", ".yml")):  # a path: the name without its suffix
        stem = stem.rsplit(".", 1)[0]
    stem = stem.removesuffix(FAST_SUFFIX)
    for suffix in sorted(CONFIG_SUFFIX_TO_RECIPE, key=len, reverse=True):
        if stem == suffix or stem.endswith("_" + suffix):
            return CONFIG_SUFFIX_TO_RECIPE[suffix]
    return None


# ``tune run [launcher flags ...] RECIPE --config``, as a config's header comments say: the
# recipe is the word right before ``--config``.
_RUN_COMMAND = re.compile(r"\btune run\b.*?\s(?P<recipe>[\w.]+)\s+--config\b")


def recipe_named_in_header(config_path: Path) -> Optional[str]:
    """The recipe a config file's leading comments run it with, for a copy whose name does not
    say (``tune cp llama3_2/1B_lora_single_device my_run.yaml`` keeps the header). Ours name it
    on the line after ``# Run``; otherwise every ``tune run`` line there must name the same
    recipe (torchtune's headers), or exactly one of those named must take the file's top-level
    keys (torchtune's distillation configs first fine-tune the teacher with a LoRA recipe,
    which takes no ``teacher_model``). None: no header names one, or it names one neither we
    nor torchtune ship."""
    try:
        lines = config_path.read_text().splitlines()
    except (OSError, UnicodeDecodeError):
        return None
    header = []
    for line in lines:
        if line.strip() and not line.lstrip().startswith("#"):
            break
        header.append(line)
    labelled = [i for i, line in enumerate(header) if line.lstrip("# ").startswith("Run")]
    runs = []  # (line number, recipe) of each `tune run` line
    for i, line in enumerate(header):
        match = _RUN_COMMAND.search(line)
        if match:
            runs.append((i, match.group("recipe")))
    if labelled:
        after = [name for i, name in runs if i > labelled[0]]
        names = after[:1]
    else:
        names = sorted({name for _, name in runs})
        if len(names) > 1:
            names = [name for name in names if _takes_the_keys_of(config_path, name)]
    if len(names) != 1 or resolve_recipe(names[0]) is None:
        return None
    return names[0]


def _takes_the_keys_of(config_path: Path, recipe_name: str) -> bool:
    """Whether recipe ``recipe_name`` (ours, with CONFIG_KEYS) accepts every top-level key of
    the config file: its own keys, or torchtune's that it only warns about."""
    from omegaconf import DictConfig, OmegaConf

    try:
        cfg = OmegaConf.load(config_path)
    except Exception:  # noqa: BLE001 - not YAML we can read: the check itself will say so
        return False
    return isinstance(cfg, DictConfig) and takes_the_keys(recipe_name, cfg.keys())


def takes_the_keys(recipe_name: str, keys, complete: bool = False) -> bool:
    """Whether our recipe ``recipe_name`` accepts every one of the top-level ``keys``: its own
    CONFIG_KEYS, or torchtune's that it only warns about; ``complete``: and ``keys`` hold every
    key the recipe requires (a distillation recipe takes a LoRA config's keys, but needs its
    teacher's too)."""
    from tune_recipes.validation import REQUIRED, TORCHTUNE_KEYS

    recipe = resolve_recipe(recipe_name)
    known = recipe_config_keys(recipe.path) if recipe is not None else None
    keys = {str(k) for k in keys}
    if known is None or not all(k in known or k in TORCHTUNE_KEYS for k in keys):
        return False
    return not complete or all(k in keys for k in REQUIRED if k in known)


def recipes_taking_the_keys(keys, like: str = "") -> List[str]:
    """Our recipes that accept every one of the top-level ``keys`` and find every key they
    require there; only those that run where ``like`` runs (one device, or distributed), if
    any does."""
    fits = [name for name in list_recipes() if takes_the_keys(name, keys, complete=True)]
    alike = [name for name in fits if ("distributed" in name) == ("distributed" in like)]
    return alike or fits


def configs_by_recipe() -> Dict[str, List[str]]:
    out: Dict[str, List[str]] = {r: [] for r in list_recipes()}
    for c in list_configs():
        r = recipe_for_config(c)
        if r is not None:
            out.setdefault(r, []).append(c)
    return out


@dataclass
class Resolved:
    path: Path
    origin: str  # "tune-recipes", "file" or "torchtune"


def _stock():
    """torchtune 0.6.1's registry and the root its recipes are installed under."""
    import torchtune
    from torchtune._recipe_registry import get_all_recipes

    return get_all_recipes(), Path(torchtune.__file__).resolve().parent.parent / "recipes"


def resolve_recipe(name: str) -> Optional[Resolved]:
    ours = recipes_dir() / f"{name}.py"
    if "/" not in name and ours.is_file():
        return Resolved(ours, "tune-recipes")
    if name.endswith(".py"):
        p = Path(name)
        return Resolved(p, "file") if p.is_file() else None
    recipes, root = _stock()
    for r in recipes:
        if r.name == name:
            return Resolved(root / r.file_path, "torchtune")
    return None


def resolve_config(name: str) -> Optional[Resolved]:
    ours = configs_dir() / f"{name}.yaml"
    if not name.lower().endswith((".yaml", ".yml")) and ours.is_file():
        return Resolved(ours, "tune-recipes")
    p = Path(name)
    if name.lower().endswith((".yaml", ".yml")):  # X.YAML too
        return Resolved(p, "file") if p.is_file() else None
    recipes, root = _stock()
    for r in recipes:
        for c in r.configs:
            if c.name == name:
                return Resolved(root / "configs" / c.file_path, "torchtune")
    return None


def recipe_config_keys(recipe_path: Path) -> Optional[set]:
    """The ``CONFIG_KEYS`` set a recipe declares, read without importing the script."""
    import ast

    try:
        tree = ast.parse(Path(recipe_path).read_text())
    except (OSError, SyntaxError):
        return None
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "CONFIG_KEYS" for t in node.targets
        ):
            try:
                return set(ast.literal_eval(node.value))
            except ValueError:
                return None
    return None
