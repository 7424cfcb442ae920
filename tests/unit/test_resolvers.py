"""tune_recipes.resolvers: the ${tiny_checkpoint:} interpolation of the shipped configs."""

from pathlib import Path

import pytest
from omegaconf import OmegaConf

import tune_recipes  # noqa: F401  (registers the resolvers)

pytestmark = pytest.mark.unit


def test_tiny_checkpoint_resolves_to_a_built_checkpoint_per_variant():
    cfg = OmegaConf.create({"base": "${tiny_checkpoint:}", "teacher": "${tiny_checkpoint:teacher}"})
    base, teacher = Path(cfg.base), Path(cfg.teacher)
    assert base.is_dir() and teacher.is_dir() and base != teacher
    assert any(base.glob("*.safetensors"))
