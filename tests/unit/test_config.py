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


def test_none_on_the_command_line_is_null_as_in_torchtune(tmp_path):
    # torchtune's parser reads key=None as null; "None" as a string failed type checks
    # (optimizer.fused=None: "expected True or False").
    p = _yaml(tmp_path, "a: 1\nb:\n  c: 2\n")
    cfg = load_config(p, ["a=None", "b.c=None", "d=None"])
    assert cfg.a is None and cfg.b.c is None and cfg.d is None
    assert load_config(p, ["a='None'"]).a == "None" and load_config(p, ["a=Nonesuch"]).a == "Nonesuch"


def test_validation_binds_keys_to_the_component_signature():
    ok = OmegaConf.create({"optimizer": {"_component_": "torch.optim.AdamW", "lr": 1e-3}})
    assert validate_config(ok) == ["optimizer"]
    bad = OmegaConf.create({"optimizer": {"_component_": "torch.optim.AdamW", "learning_rate": 1}})
    with pytest.raises(ConfigError, match="optimizer.learning_rate: torch.optim.AdamW has no argument"):
        validate_config(bad)
    with pytest.raises(ConfigError, match="loss._component_"):
        validate_config(OmegaConf.create({"loss": {"_component_": "torch.nn.NoSuchLoss"}}))


@pytest.mark.parametrize("section, key", [
    ({"_component_": "torch.optim.AdamW", "lr": 1e-3}, "amsgrad"),  # a bool default
    ({"_component_": "torch.optim.AdamW", "lr": 1e-3}, "foreach"),  # Optional[bool], default None
    ({"_component_": "torchtune.datasets.alpaca_dataset"}, "train_on_input"),
])
def test_a_flag_given_a_word_is_one_line_not_silently_true(section, key):
    """A string is truthy: 'Flase' (or 'maybe') would turn the option on without a word."""
    for word in ("Flase", "maybe"):
        cfg = OmegaConf.create({"optimizer": {**section, key: word}})
        with pytest.raises(ConfigError, match=rf"^optimizer.{key}={word}: expected True or False"):
            validate_config(cfg)
    # a quoted "True" (or an environment variable read as a string) is said to be a string
    quoted = OmegaConf.create({"optimizer": {**section, key: "false"}})
    with pytest.raises(ConfigError, match=rf"^optimizer.{key}='false': expected True or False, .*"
                                          r"a quoted string, or an environment variable"):
        validate_config(quoted)
    for value in (True, False, None, 0, 1):
        assert validate_config(OmegaConf.create({"optimizer": {**section, key: value}})) == ["optimizer"]
    # an argument that is no flag takes a word
    assert validate_config(OmegaConf.create({"dataset": {"_component_": "torchtune.datasets.alpaca_dataset",
                                                         "source": "json"}})) == ["dataset"]


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


def test_parse_checks_values_with_the_recipes_own_config_keys(tmp_path, capsys):
    # @parse finds CONFIG_KEYS and the recipe's name in the decorated function's module.
    from tune_recipes.config import parse

    ran = []
    namespace = {"__file__": str(tmp_path / "my_recipe.py"), "parse": parse, "ran": ran,
                 "CONFIG_KEYS": {"output_dir", "batch_size", "seed"}}
    exec("@parse\ndef recipe_main(cfg):\n    ran.append(cfg)\n", namespace)
    p = _yaml(tmp_path, f"output_dir: {tmp_path}\nbatch_size: 2\nseed: 0\n")
    namespace["recipe_main"](["--config", str(p)])
    assert len(ran) == 1
    # The one prefix `tune` prints too (tune_recipes/_cli/main.py).
    for bad, fragment in ((["batch_size=0"], "tune: error: batch_size=0: expected an integer >= 1"),
                          (["bach_size=2"], "my_recipe does not use config key(s) 'bach_size' "
                                            "(did you mean 'batch_size'?)")):
        with pytest.raises(SystemExit) as e:
            namespace["recipe_main"](["--config", str(p), *bad])
        assert e.value.code == 2 and fragment in capsys.readouterr().err
    assert len(ran) == 1


def test_an_override_of_another_container_type_replaces_the_node(tmp_path):
    # torchtune's sharded form {filename_format, max_filename} replaced by a list, and back;
    # OmegaConf's merge refuses both ("Cannot merge incompatible container types").
    p = _yaml(tmp_path, "ckpt:\n  files:\n    filename_format: m-{}-of-{}.safetensors\n"
                        "    max_filename: '00002'\n  dir: d\nlst: [1, 2]\nopt: {lr: 1, eps: 2}\n")
    cfg = load_config(p, ["ckpt.files=[a.safetensors,b.safetensors]", "lst={k: 1}",
                          "opt={lr: 3}"])
    assert OmegaConf.to_container(cfg) == {
        "ckpt": {"files": ["a.safetensors", "b.safetensors"], "dir": "d"},
        "lst": {"k": 1},
        "opt": {"lr": 3, "eps": 2},  # a mapping over a mapping still merges
    }
    cfg = load_config(p, ["lst.0=5", "ckpt.files=[x]", "ckpt.files={f: 1}"])
    assert list(cfg.lst) == [5, 2] and dict(cfg.ckpt.files) == {"f": 1}


def test_an_override_into_a_list_by_name_or_out_of_range_is_one_line(tmp_path):
    p = _yaml(tmp_path, "lst: [1, 2]\n")
    with pytest.raises(ConfigError, match=r"bad override 'lst.key=3': lst is a list here \(\[1, 2\]\)"):
        load_config(p, ["lst.key=3"])
    with pytest.raises(ConfigError, match="cannot apply override 'lst.5=3'"):
        load_config(p, ["lst.5=3"])


def test_an_override_value_that_is_not_yaml_and_an_unresolvable_one_name_the_key(tmp_path):
    p = _yaml(tmp_path, "a: 1\nb:\n  c: 2\n")
    with pytest.raises(ConfigError, match=r"bad override 'a=\[x,\$\{y\}\]': its value is not "
                                          r"valid YAML \(did not find expected ',' or '\]'"):
        load_config(p, ["a=[x,${y}]"])
    cfg = load_config(p, ["b.c=${nope}"])
    with pytest.raises(ConfigError, match=r"^b.c: interpolation failed: Interpolation key 'nope'"):
        validate_config(cfg)
