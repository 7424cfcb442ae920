"""tune_recipes.config: YAML + overrides, strict keys, signature validation."""

import pytest
from omegaconf import OmegaConf

from tune_recipes.config import (
    ConfigError,
    check_known_keys,
    load_config,
    parse_recipe_argv,
    resolve_component,
    validate_config,
)

pytestmark = pytest.mark.unit


def _yaml(tmp_path, text):
    p = tmp_path / "c.yaml"
    p.write_text(text)
    return p


def test_overrides_set_and_delete(tmp_path):
    p = _yaml(tmp_path, "a: 1\nb:\n  c: 2\n  d: 3\n")
    cfg = load_config(p, ["a=5", "b.c=x", "~b.d"])
    assert cfg.a == 5 and cfg.b.c == "x" and "d" not in cfg.b
    with pytest.raises(ConfigError, match="no such key"):
        load_config(p, ["~b.zz"])
    with pytest.raises(ConfigError, match="expected key=value"):
        load_config(p, ["oops"])
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "missing.yaml")


def test_validation_binds_keys_to_the_component_signature():
    ok = OmegaConf.create({"optimizer": {"_component_": "torch.optim.AdamW", "lr": 1e-3}})
    assert validate_config(ok) == ["optimizer"]
    bad = OmegaConf.create({"optimizer": {"_component_": "torch.optim.AdamW", "learning_rate": 1}})
    with pytest.raises(ConfigError, match="optimizer.learning_rate: torch.optim.AdamW has no argument"):
        validate_config(bad)
    with pytest.raises(ConfigError, match="loss._component_"):
        validate_config(OmegaConf.create({"loss": {"_component_": "torch.nn.NoSuchLoss"}}))


def test_resolve_component_and_known_keys():
    import torch

    assert resolve_component("torch.optim.SGD") is torch.optim.SGD
    with pytest.raises(ConfigError, match="does not use config key"):
        check_known_keys(OmegaConf.create({"a": 1, "typo": 2}), {"a"}, "r")


def test_recipe_argv_needs_a_config(tmp_path):
    p = _yaml(tmp_path, "a: 1\n")
    assert parse_recipe_argv(["--config", str(p), "a=2"]).a == 2
    with pytest.raises(ConfigError, match="missing --config"):
        parse_recipe_argv(["a=2"])


def test_config_does_not_import_the_demo_model():
    import subprocess
    import sys

    code = ("import sys, tune_recipes.config; "
            "print('tune_recipes.models.tiny' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
