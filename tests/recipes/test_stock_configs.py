"""torchtune 0.6.1's own configs run on our recipes unchanged.

Every config torchtune's recipe registry lists for a recipe we ship is checked with
``tune validate --portable --recipe <ours> <stock yaml>`` (``--portable``: the stock configs
point at ``/tmp/<model>`` downloads, ``device: cuda`` and, for some, bitsandbytes or
torchvision, none of which this machine has). All pass, except the stock configs that turn on a
feature we do not implement: those must fail with the one-line "not implemented" error, and are
listed below with the key. A sample of four, shrunk like our own shipped configs
(tests/recipes/shipped_configs.py), trains 2 steps.
"""

import math
from pathlib import Path

import pytest

from helpers import tune
from shipped_configs import DISTRIBUTED_RECIPES, shrink
from tune_recipes._cli import registry
from tune_recipes._cli.main import main

pytestmark = pytest.mark.integration

# torchtune 0.6.1's registry (pinned): configs per recipe we ship. 132 in all.
STOCK_COUNTS = {
    "full_finetune_single_device": 17,
    "full_finetune_distributed": 27,
    "lora_finetune_single_device": 41,
    "lora_finetune_distributed": 36,
    "quantize": 1,
    "qat_distributed": 2,
    "qat_lora_finetune_distributed": 4,
    "knowledge_distillation_single_device": 2,
    "knowledge_distillation_distributed": 2,
}

# (recipe, stock config) -> the key that asks for a feature we do not implement. When a recipe
# declares the key in CONFIG_KEYS (the feature is built), the config must pass instead.
EXPECTED_FAILURES = {
    **{("full_finetune_single_device", c): "enable_activation_offloading" for c in (
        "llama2/7B_full_low_memory", "code_llama2/7B_full_low_memory",
        "mistral/7B_full_low_memory", "phi3/mini_full_low_memory", "phi4/14B_full_low_memory")},
    **{("full_finetune_distributed", c): "fsdp_cpu_offload" for c in (
        "llama3/70B_full", "llama3_1/70B_full", "llama3_3/70B_full")},
}


def _stock_configs():
    recipes, root = registry._stock()
    ours = set(registry.list_recipes())
    return [(r.name, c.name, root / "configs" / c.file_path)
            for r in recipes if r.name in ours for c in r.configs]


def _keys(recipe):
    return registry.recipe_config_keys(registry.recipes_dir() / f"{recipe}.py")


def test_every_stock_config_of_our_recipes_validates(capsys):
    configs = _stock_configs()
    counts = {}
    for recipe, _, _ in configs:
        counts[recipe] = counts.get(recipe, 0) + 1
    assert counts == STOCK_COUNTS, counts
    passed, failed_as_expected, problems = {}, {}, []
    for recipe, name, path in configs:
        rc = main(["validate", str(path), "--recipe", recipe, "--portable"])
        out = capsys.readouterr()
        key = EXPECTED_FAILURES.get((recipe, name))
        if key is not None and key not in _keys(recipe):
            lines = [l for l in out.err.splitlines() if not l.startswith("warning:")]
            if rc == 2 and len(lines) == 1 and f"{key}=True: " in lines[0] \
                    and "is not implemented by" in lines[0]:
                failed_as_expected[recipe] = failed_as_expected.get(recipe, 0) + 1
            else:
                problems.append(f"{recipe} {name}: expected '{key} ... not implemented', got "
                                f"rc {rc}: {out.err.strip()}")
        elif rc == 0:
            passed[recipe] = passed.get(recipe, 0) + 1
        else:
            problems.append(f"{recipe} {name}: {out.err.strip()}")
    summary = {r: f"{passed.get(r, 0)} pass, {failed_as_expected.get(r, 0)} not implemented"
               for r in STOCK_COUNTS}
    print(summary)  # visible with -s / in the report of a failure
    assert not problems, "\n".join(problems) + f"\n{summary}"
    assert sum(passed.values()) + sum(failed_as_expected.values()) == sum(STOCK_COUNTS.values())


def test_expected_failures_are_real_stock_configs():
    names = {(recipe, name) for recipe, name, _ in _stock_configs()}
    assert set(EXPECTED_FAILURES) <= names


SAMPLE = [  # (stock config, our recipe): Llama-3.2, Qwen2.5, Llama-3.1; single device and 2 ranks
    ("llama3_2/1B_lora_single_device", "lora_finetune_single_device"),
    ("qwen2_5/0.5B_full_single_device", "full_finetune_single_device"),
    ("llama3_1/8B_lora", "lora_finetune_distributed"),
    ("llama3_2/1B_full", "full_finetune_distributed"),
]


@pytest.mark.parametrize("config_name,recipe", SAMPLE)
def test_stock_config_trains_two_steps_shrunk(config_name, recipe, tmp_path):
    # By the registry's path: our own config of the same name would win a name lookup.
    [path] = [p for r, c, p in _stock_configs() if (r, c) == (recipe, config_name)]
    out = tmp_path / "run"
    _, yaml_path, facts = shrink(str(path), out, steps=2, recipe=recipe)
    launch = ["--nproc_per_node", "2"] if recipe in DISTRIBUTED_RECIPES else []
    # fp32: bf16 matmuls are ~10x slower on CPU (as in test_shipped_configs.py).
    proc = tune("run", *launch, recipe, "--config", str(yaml_path), "dtype=fp32", timeout=900)
    # Every stock key in these configs is implemented now (profiler included): nothing ignored.
    assert "ignores" not in proc.stderr, proc.stderr[-2000:]
    # Stock configs log with torchtune's DiskLogger into output_dir/logs.
    logs = list((out / "logs").glob("log_*.txt"))
    assert len(logs) == 1
    steps = [l for l in logs[0].read_text().splitlines() if l.startswith("Step ")]
    assert [int(l.split()[1]) for l in steps] == [1, 2]
    assert all(math.isfinite(float(l.split("loss:")[1].split()[0])) for l in steps)
    epoch = out / "epoch_0"
    assert list(epoch.glob("model-*.safetensors"))
    if facts["lora"]:
        assert (epoch / "adapter_model.safetensors").is_file()
