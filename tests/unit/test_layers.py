"""The library's shape: layers import only downwards, and every module has its unit tests.

Layers, bottom to top: constants, validation (the config schema), config, plotting, modules,
optim (the optimizers configs name), data.collate (batches with document masks), training.reporting, training.step,
training.losses, training.checkpointing, training.setup. A module may import its own package
and anything below it; recipes sit on top and nothing imports them.
"""

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "tune_recipes"
LAYERS = [
    "tune_recipes.constants",
    "tune_recipes.validation",
    "tune_recipes.config",
    "tune_recipes.plotting",
    "tune_recipes.modules",
    "tune_recipes.optim",
    "tune_recipes.data.collate",
    "tune_recipes.training.reporting",
    "tune_recipes.training.step",
    "tune_recipes.training.losses",
    "tune_recipes.training.checkpointing",
    "tune_recipes.training.setup",
]

# Every library module -> the unit test file that covers it.
TESTS = {
    "__init__.py": "test_resolvers.py",
    "__main__.py": "test_cli.py",
    "constants.py": "test_layers.py",
    "config.py": "test_config.py",
    "validation.py": "test_validation.py",
    "resolvers.py": "test_resolvers.py",
    "loggers.py": "test_loggers.py",
    "plotting.py": "test_plotting.py",
    "optim.py": "test_adamw8bit.py",
    "_cli/__init__.py": "test_cli.py",
    "_cli/launch.py": "test_cli.py",
    "_cli/quiet.py": "test_quiet.py",
    "_cli/main.py": "test_cli.py",
    "_cli/registry.py": "test_cli.py",
    "data/__init__.py": "test_tiny.py",
    "data/tiny.py": "test_tiny.py",
    "data/collate.py": "data/test_collate.py",
    "data/synthetic.py": "test_tiny.py",
    "models/__init__.py": "test_tiny.py",
    "models/tiny.py": "test_tiny.py",
    "modules/__init__.py": "modules/test_peft.py",
    "modules/loss.py": "test_fused_loss.py",
    "modules/_triton_ce.py": "test_fused_loss_gpu.py",
    "modules/fp8_lora.py": "modules/test_fp8_lora.py",
    "modules/host_embedding.py": "modules/test_host_embedding.py",
    "modules/nf4.py": "modules/test_nf4.py",
    "modules/rms_norm.py": "modules/test_rms_norm.py",
    "modules/rope.py": "modules/test_rope.py",
    "modules/fp8_mlp.py": "modules/test_fp8_mlp.py",
    "modules/swiglu_down.py": "modules/test_swiglu_down.py",
    "modules/document_attention.py": "modules/test_document_attention.py",
    "modules/varlen_attention.py": "modules/test_varlen_attention.py",
    "modules/output.py": "modules/test_output.py",
    "modules/peft.py": "modules/test_peft.py",
    "modules/qat_lora.py": "modules/test_qat_lora.py",
    "training/__init__.py": "training/step/test_normalization.py",
    "training/metrics.py": "training/reporting/test_metrics.py",
    "training/reporting/__init__.py": "training/reporting/test_progress.py",
    "training/reporting/progress.py": "training/reporting/test_progress.py",
    "training/reporting/metrics.py": "training/reporting/test_metrics.py",
    "training/reporting/run_status.py": "training/reporting/test_run_status.py",
    "training/step/__init__.py": "training/step/test_driver.py",
    "training/step/batch.py": "training/step/test_batch.py",
    "training/step/normalization.py": "training/step/test_normalization.py",
    "training/step/optim.py": "training/step/test_optim.py",
    "training/step/driver.py": "training/step/test_driver.py",
    "training/step/validation.py": "training/step/test_validator.py",
    "training/step/nonfinite.py": "training/step/test_nonfinite.py",
    "training/losses/__init__.py": "training/losses/test_lm_loss.py",
    "training/losses/lm_loss.py": "training/losses/test_lm_loss.py",
    "training/losses/kd.py": "training/losses/test_kd.py",
    "training/checkpointing/__init__.py": "training/checkpointing/test_io.py",
    "training/checkpointing/io.py": "training/checkpointing/test_io.py",
    "training/checkpointing/lock.py": "training/checkpointing/test_lock.py",
    "training/checkpointing/state.py": "training/checkpointing/test_state.py",
    "training/checkpointing/writer.py": "training/checkpointing/test_writer.py",
    "training/checkpointing/low_ram.py": "training/checkpointing/test_low_ram.py",
    "training/setup/__init__.py": "training/setup/test_recipe.py",
    "training/setup/activations.py": "training/setup/test_activations.py",
    "training/setup/data.py": "training/setup/test_data.py",
    "training/setup/distributed.py": "training/setup/test_setup_distributed.py",
    "training/setup/fp8.py": "training/setup/test_fp8.py",
    "training/setup/model.py": "training/setup/test_model.py",
    "training/setup/offloading.py": "training/setup/test_offloading.py",
    "training/setup/profiling.py": "training/setup/test_profiling.py",
    "training/setup/qat.py": "training/setup/test_setup_qat.py",
    "training/setup/recipe.py": "training/setup/test_recipe.py",
    "training/setup/runtime.py": "training/setup/test_runtime.py",
}


def _modules():
    return sorted(str(p.relative_to(PKG)) for p in PKG.rglob("*.py") if "_shipped" not in p.parts)


def _dotted(rel: str) -> str:
    parts = rel[:-3].split("/")
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(["tune_recipes", *parts])


def _imports(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):  # function-level imports count too
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module
        elif isinstance(node, ast.Import):
            yield from (a.name for a in node.names)


def _layer(name: str):
    hits = [i for i, layer in enumerate(LAYERS) if name == layer or name.startswith(layer + ".")]
    return hits[-1] if hits else None


def test_every_library_module_has_a_unit_test_file():
    assert sorted(TESTS) == _modules(), "add the new module (and its tests) to TESTS"
    unit = ROOT / "tests" / "unit"
    missing = sorted({t for t in TESTS.values() if not (unit / t).is_file()})
    assert not missing


def test_layers_import_only_downwards():
    bad = []
    for rel in _modules():
        src = _dotted(rel)
        src_layer = _layer(src)
        if src_layer is None or src in ("tune_recipes.training",):
            continue
        for target in _imports(PKG / rel):
            if not target.startswith("tune_recipes"):
                continue
            tgt_layer = _layer(target)
            if tgt_layer is None or tgt_layer > src_layer:
                bad.append(f"{src} imports {target}")
    assert not bad, bad


def test_constants_import_nothing_and_loss_needs_no_training():
    assert list(_imports(PKG / "constants.py")) == []
    assert not [t for t in _imports(PKG / "modules" / "loss.py") if t.startswith("tune_recipes.training")]
    from tune_recipes.constants import CROSS_ENTROPY_IGNORE_INDEX

    assert CROSS_ENTROPY_IGNORE_INDEX == -100


def test_the_library_never_imports_recipes_or_the_cli():
    # The package __init__ installs the CLI's output filters (_cli/quiet.py) on import.
    for rel in _modules():
        if rel.startswith("_cli/") or rel in ("__main__.py", "__init__.py"):
            continue
        for target in _imports(PKG / rel):
            assert not target.startswith(("recipes", "tune_recipes._cli")), (rel, target)
