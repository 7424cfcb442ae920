"""Every training recipe runs with activation checkpointing on and off, on its tiny config, and
the two train identically: recomputing activations in backward must not change a number.
tiny/full_single_device also runs torchtune's selective layer checkpointing (``ac_mode:
selective``, ``ac_option: 2``: the second of the tiny model's two layers), which must train
identically too (the layer choice and every model setup: tests/unit/training/setup/test_activations.py).

The single-device recipes' checkpointed layers run torch's reentrant checkpoint (eager, no
offloading), the distributed recipes' the non-reentrant one: the logged line says which.

Both runs also save a mid-epoch checkpoint after step 1 (save_every_n_steps=1), so every recipe
family's save path runs in CI. Tolerance (fp32 CPU): the recomputed forward runs the same kernels on the same inputs, so
losses and gradient norms agree to rtol 1e-6 (observed: bit-identical).
"""

import pytest
import torch

from helpers import losses, tune
from shipped_configs import DISTRIBUTED_RECIPES
from tune_recipes._cli import registry
from tune_recipes.training.metrics import read_metrics

pytestmark = pytest.mark.integration

TINY_TRAINING_CONFIGS = [c for c in registry.list_configs()
                         if c.startswith("tiny/") and registry.recipe_for_config(c) != "quantize"]


def test_every_training_recipe_has_a_tiny_config_here():
    recipes = {registry.recipe_for_config(c) for c in TINY_TRAINING_CONFIGS}
    assert recipes == set(registry.list_recipes()) - {"quantize"}
    assert len(TINY_TRAINING_CONFIGS) == 9


# One extra short run, on the cheapest recipe: the overrides and the line its setup logs.
SELECTIVE = {"tiny/full_single_device": (
    ["enable_activation_checkpointing=False", "ac_mode=selective", "ac_option=2"],
    "activation checkpointing: 1 of 2 transformer layers (model.layers 1; reentrant)")}


@pytest.mark.parametrize("config_name", TINY_TRAINING_CONFIGS)
def test_activation_checkpointing_on_equals_off(tmp_path, config_name):
    recipe = registry.recipe_for_config(config_name)
    # NOTE: 2 ranks for the full distributed recipe (checkpointed layers inside FSDP2 units,
    # gathered again for the recompute); the other distributed recipes wrap their layers the
    # same way through the same library call, so they run at 1 rank (CI time: ~15 s each).
    ranks = "2" if recipe == "full_finetune_distributed" else "1"
    launch = ["--nproc_per_node", ranks] if recipe in DISTRIBUTED_RECIPES else []
    settings = {"off": ["enable_activation_checkpointing=False"],
                "on": ["enable_activation_checkpointing=True"]}
    if config_name in SELECTIVE:
        settings["selective"] = SELECTIVE[config_name][0]
    runs = {}
    for name, overrides in settings.items():
        out = tmp_path / f"ac_{name}"
        proc = tune("run", *launch, recipe, "--config", config_name, f"output_dir={out}",
                    "max_steps_per_epoch=2", "lr_scheduler.num_warmup_steps=1",
                    *overrides, "save_every_n_steps=1")
        if name == "selective":  # the recipe did checkpoint the one layer ac_option picks
            assert SELECTIVE[config_name][1] in proc.stdout + proc.stderr
        if name == "on":  # eager on one device: the reentrant checkpoint; FSDP2: torchtune's
            kind = "non-reentrant" if recipe in DISTRIBUTED_RECIPES else "reentrant"
            assert f"transformer layers (model.layers 0, 1; {kind})" in proc.stdout + proc.stderr
        runs[name] = out
    off = losses(runs["off"])
    off_norms = read_metrics(runs["off"] / "metrics.jsonl", "grad_norm")
    for name in settings:
        on = losses(runs[name])
        assert len(on) == 2
        torch.testing.assert_close(torch.tensor(on), torch.tensor(off), rtol=1e-6, atol=0)
        norms = read_metrics(runs[name] / "metrics.jsonl", "grad_norm")
        torch.testing.assert_close(torch.tensor(norms), torch.tensor(off_norms), rtol=1e-6, atol=0)
    assert (runs["on"] / "epoch_0").is_dir()
    # Every recipe writes a mid-epoch checkpoint through the library (its resume is tested
    # bit for bit in test_reliability.py and test_distributed.py).
    assert (runs["on"] / "step_1" / "recipe_state.pt").is_file()
