"""The README's "Fastest settings" commands are the settings that were measured: each
command's overrides, on top of its shipped config, equal the benchmarked variant of ours
(scripts/bench_recipes.py) key for key, the shapes the bench ran (batch, LoRA layout, optimizer)
are the shipped config's, and `tune validate` accepts the command."""

import re
import shlex
from pathlib import Path

import pytest
import yaml
from script_loader import load_script

REPO = Path(__file__).resolve().parents[2]

# The README's commands, each named by its config and whether it packs the dataset, and the
# bench case whose claimed variant (bench_cases.CLAIM) it gives.
# (config, packed, padding_free) -> case.
MEASURED = {("llama3_2/1B_full_single_device", True, False): "full_1b_packed",
            ("llama3_2/1B_full_single_device", False, True): "full_1b_padded",
            ("llama3_2/1B_full_single_device", False, False): "full_1b",
            ("llama3_1/8B_lora_single_device", True, False): "lora_8b_packed"}
# The bench's own keys that the shipped configs set to something else and that change the step:
# the README's commands must set them as the bench ran (clip_grad_norm inf still computes a norm).
STEP_KEYS = ("clip_grad_norm", "gradient_accumulation_steps", "dtype", "optimizer_in_bwd",
             "enable_activation_checkpointing", "compile")


def _bench():
    return load_script("bench_recipes")


def _flat(d, prefix=""):
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def readme_fast_commands():
    text = (REPO / "README.md").read_text()
    section = text.split("### Fastest settings\n", 1)[1]
    block = section.split("```bash", 1)[1].split("```", 1)[0]
    joined = block.replace("\\\n", " ")
    commands = [shlex.split(line, comments=True) for line in joined.splitlines()]
    return [c for c in commands if c[:2] == ["tune", "run"]]


def _fast_config_overrides(config):
    """(the base config, the keys a ``<base>_fast`` config changes): a fast config is its base
    config with overrides, key for key (it may add keys, never drop one)."""
    base = config.removesuffix("_fast")
    fast = _flat(yaml.safe_load((REPO / "configs" / f"{config}.yaml").read_text()))
    shipped = _flat(yaml.safe_load((REPO / "configs" / f"{base}.yaml").read_text()))
    assert not set(shipped) - set(fast), f"{config} drops keys of {base}: {set(shipped) - set(fast)}"
    return base, {k: v for k, v in fast.items() if k != "output_dir" and shipped.get(k, "<unset>") != v}


def _parse(cmd):
    """(recipe, the shipped config, the overrides of it): a ``_fast`` config's changes count as
    overrides of its base config."""
    recipe, config = cmd[2], cmd[cmd.index("--config") + 1]
    overrides = {}
    if config.endswith("_fast"):
        config, overrides = _fast_config_overrides(config)
    for arg in cmd[cmd.index("--config") + 2:]:
        key, value = arg.split("=", 1)
        overrides[key] = yaml.safe_load(value)
    return recipe, config, overrides


def _key(cmd):
    _, config, overrides = _parse(cmd)
    shipped = yaml.safe_load((REPO / "configs" / f"{config}.yaml").read_text())
    packed = overrides.get("dataset.packed", shipped["dataset"].get("packed", False)) is True
    # the third element tells the unpacked commands apart (packed ones: padding_free as measured)
    return (config, packed, not packed and overrides.get("padding_free", shipped.get("padding_free", False)) is True)


def _command(key):
    (cmd,) = [c for c in readme_fast_commands() if _key(c) == key]
    return cmd


def test_the_readme_lists_a_command_for_each_measured_config():
    keys = [_key(cmd) for cmd in readme_fast_commands()]
    assert sorted(keys) == sorted(MEASURED)


@pytest.mark.parametrize("key", sorted(MEASURED))
def test_a_fast_command_is_the_benchmarked_variant(key, tmp_path):
    bench = _bench()
    config = key[0]
    case_name = MEASURED[key]
    variant_name = bench.CLAIM[case_name]
    case = bench.CASES[case_name]
    variant = next(v for v in case["variants"] if v["name"] == variant_name)
    assert variant["head"], f"{variant_name} is not a head variant of {case_name}: not in the claim table"
    recipe, _, overrides = _parse(_command(key))
    assert recipe == case["recipe"]

    shipped = yaml.safe_load((REPO / "configs" / f"{config}.yaml").read_text())
    effective = {**_flat(shipped), **overrides}
    if "loss._component_" in overrides:  # a new loss component starts from its own defaults
        effective = {k: v for k, v in effective.items() if not k.startswith("loss.") or k in overrides}
    common = bench.write_config(tmp_path / "bench.yaml", case, variant, tmp_path / "ckpt", tmp_path / "out")
    measured = {**{k: common[k] for k in STEP_KEYS if k in common}, **_flat(case["extra"]), **_flat(variant["cfg"])}
    measured.pop("save_adapter_weights_only", None)  # the bench's output choice, not a speed setting
    if case["data"].get("packed"):  # packed instruction rows: the command packs the dataset
        measured["dataset.packed"] = True
    measured.setdefault("padding_free", False)  # the bench's own configs pad unpacked rows
    if measured["padding_free"] == shipped.get("padding_free"):
        measured.pop("padding_free")  # the shipped config's own setting: no override needed
    if effective.get("dataset.packed") is False and shipped["dataset"].get("packed", False) is False:
        overrides.pop("dataset.packed", None)  # unpacked as the shipped config is
    missing = {k: v for k, v in measured.items() if effective.get(k, "<unset>") != v}
    extra = {k: v for k, v in overrides.items() if k not in measured}
    assert not missing, f"README's {config} command lacks or differs in: {missing}"
    assert not extra, f"README's {config} command sets what was not measured: {extra}"

    assert overrides.get("batch_size", shipped["batch_size"]) == case["batch_size"]
    model = {**shipped["model"], **{k[6:]: v for k, v in overrides.items() if k.startswith("model.")}}
    assert {k: model.get(k) for k in case["model"]} == case["model"]
    optimizer = _flat(case["optimizer"])
    assert {k: shipped["optimizer"].get(k) for k in optimizer if k != "lr"} == {
        k: v for k, v in optimizer.items() if k != "lr"}


@pytest.mark.parametrize("key", sorted(MEASURED))
def test_tune_validate_accepts_a_fast_command(key, capsys):
    from tune_recipes._cli.main import main

    cmd = _command(key)
    # --portable: the shipped configs point at /tmp/<model> and device cuda, absent here.
    assert main(["validate", "--portable", *cmd[cmd.index("--config") + 1:]]) == 0, capsys.readouterr().err


def test_each_fast_config_is_its_base_config_with_overrides_and_says_what_it_measured():
    """Every shipped ``*_fast`` config: the recipe of its base config, the base's keys all kept
    (only values changed or keys added), and a header with its measured factor against stock."""
    from tune_recipes._cli import registry

    fast = [c for c in registry.list_configs() if c.endswith("_fast")]
    assert fast
    for config in fast:
        base, overrides = _fast_config_overrides(config)
        assert registry.recipe_for_config(config) == registry.recipe_for_config(base)
        assert overrides, f"{config} changes nothing"
        header = (REPO / "configs" / f"{config}.yaml").read_text().split("output_dir:")[0]
        assert re.search(r"\d\.\d+x its (label )?tokens/s", header) and "torchtune 0.6.1" in header, config


def test_the_full_row_8b_figure_is_the_fast_configs_settings():
    """The README's full-length-rows 8B LoRA figure (lora_8b's ours_best) is the fast config's
    settings on unpacked full rows: the two bench variants are one set of settings, but for
    padding_free (packed: each pack's padding removed; full rows hold none)."""
    bench = _bench()
    cfg = {c: dict(next(v for v in bench.CASES[c]["variants"] if v["name"] == "ours_best")["cfg"])
           for c in ("lora_8b", "lora_8b_packed")}
    assert cfg["lora_8b_packed"].pop("padding_free") is True
    assert cfg["lora_8b"] == cfg["lora_8b_packed"]
    assert bench.CASES["lora_8b"]["extra"] == bench.CASES["lora_8b_packed"]["extra"]


def test_the_lora_fast_configs_less_memory_variants_are_the_ones_measured():
    """The 8B LoRA fast config's "fp8_transposed_weight_layers=0" figures (lora_8b_packed's
    ours_fp8_ain_embcpu, and qlora_8b_packed's ours_fp8_instead: the same settings on the
    bf16-base LoRA model in place of NF4) are that config less that key."""
    bench = _bench()
    _, config, overrides = _parse(_command(("llama3_1/8B_lora_single_device", True, False)))
    assert overrides.pop("fp8_transposed_weight_layers") == 20
    overrides.pop("dataset.packed")
    effective = {**_flat(yaml.safe_load((REPO / "configs" / f"{config}.yaml").read_text())), **overrides}
    for case_name, variant_name in (("lora_8b_packed", "ours_fp8_ain_embcpu"),
                                    ("qlora_8b_packed", "ours_fp8_instead")):
        case = bench.CASES[case_name]
        cfg = next(v for v in case["variants"] if v["name"] == variant_name)["cfg"]
        measured = {k: v for k, v in _flat(cfg).items() if not k.startswith("model.")}
        assert {k: effective.get(k) for k in measured} == measured, variant_name
        assert not [k for k in overrides if k not in measured and k not in _flat(case["extra"])
                    and k not in ("clip_grad_norm", "gradient_accumulation_steps", "padding_free")], variant_name
        if case_name == "qlora_8b_packed":  # the LoRA model, not the case's NF4 one
            assert cfg["model"]["_component_"] == "torchtune.models.llama3_1.lora_llama3_1_8b"
