"""The `tune` command: name resolution, ls/cp/validate, and one-line errors."""

import os
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

from tune_recipes._cli import registry
from tune_recipes._cli.main import main

pytestmark = pytest.mark.unit
REPO = Path(__file__).resolve().parents[2]


def _run(capsys, *argv):
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_our_names_resolve_first():
    r = registry.resolve_recipe("lora_finetune_single_device")
    assert r.origin == "tune-recipes" and r.path.parent == registry.recipes_dir()
    c = registry.resolve_config("tiny/lora_single_device")
    assert c.origin == "tune-recipes"


def test_unknown_names_fall_back_to_torchtune_stock():
    # We ship no DPO recipe: the name resolves to torchtune 0.6.1's.
    r = registry.resolve_recipe("lora_dpo_single_device")
    assert r is not None and r.origin == "torchtune" and r.path.is_file()
    c = registry.resolve_config("llama2/7B_lora_dpo_single_device")
    assert c is not None and c.origin == "torchtune" and c.path.is_file()


def test_every_recipe_has_configs_and_every_config_a_recipe():
    by_recipe = registry.configs_by_recipe()
    assert set(by_recipe) == set(registry.list_recipes())
    for recipe, configs in by_recipe.items():
        assert configs, f"{recipe} has no config"
    for c in registry.list_configs():
        assert registry.recipe_for_config(c) in registry.list_recipes(), c


def test_ls_lists_recipes_with_configs(capsys):
    rc, out, _ = _run(capsys, "ls")
    assert rc == 0
    assert "lora_finetune_single_device" in out and "tiny/lora_single_device" in out
    assert "full_finetune_single_device" in out and "llama3_2/1B_full_single_device" in out


@pytest.mark.parametrize("argv, fragment", [
    (["run", "no_such_recipe", "--config", "tiny/lora_single_device"], "unknown recipe 'no_such_recipe'"),
    (["run", "lora_finetune_singl_device", "--config", "tiny/lora_single_device"],
     "unknown recipe 'lora_finetune_singl_device' (not ours, not torchtune's; did you mean "
     "lora_finetune_single_device?)"),
    (["run", "lora_finetune_single_device", "--config", "tiny/lora_singl_device"],
     "did you mean tiny/lora_single_device?"),
    (["run", "lora_finetune_single_device", "--config", "tiny/nope"], "unknown config 'tiny/nope'"),
    (["run", "lora_finetune_single_device", "--config", "missing.yaml"], "config file not found: missing.yaml"),
    (["run", "lora_finetune_single_device", "--config", "tiny/lora_single_device.yaml"],
     "config file not found: tiny/lora_single_device.yaml; the shipped config is named without its "
     "suffix: tiny/lora_single_device"),
    (["cp", "tiny/lora_singel_device", "z.yaml"], "unknown recipe or config 'tiny/lora_singel_device'; "
     "did you mean tiny/lora_single_device?"),
    (["run", "missing_recipe.py", "--config", "tiny/lora_single_device"], "recipe file not found"),
    (["run", "lora_finetune_single_device", "--config", "tiny/lora_single_device", "batch_size"],
     "bad override 'batch_size'"),
    (["run", "lora_finetune_single_device", "--config", "tiny/lora_single_device", "a..b=1"],
     "not a valid dotted key"),
    (["validate", "tiny/lora_single_device", "optimizer.lrr=1"], "optimizer.lrr: torch.optim.AdamW has no argument 'lrr'"),
    (["validate", "tiny/lora_single_device", "model._component_=torch.nn.Linearr"],
     "model._component_: 'torch.nn.Linearr' does not resolve"),
    (["validate", "tiny/lora_single_device", "gradient_acumulation_steps=2"],
     "does not use config key(s) 'gradient_acumulation_steps'"),
])
def test_errors_are_one_clear_line(capsys, argv, fragment):
    rc, out, err = _run(capsys, *argv)
    assert rc == 2
    lines = [l for l in err.splitlines() if l.startswith("tune: error")]
    assert len(lines) == 1 and fragment in lines[0], err
    assert "Traceback" not in err


def test_broken_yaml_names_file_and_line(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("a: 1\nb: [1, 2\nc: 3\n")
    rc, _, err = _run(capsys, "validate", str(bad))
    assert rc == 2 and str(bad) in err and "line" in err


def test_cp_copies_and_refuses_to_overwrite(tmp_path, capsys):
    dest = tmp_path / "mine.yaml"
    assert _run(capsys, "cp", "tiny/lora_single_device", str(dest))[0] == 0
    assert dest.read_text() == (registry.configs_dir() / "tiny/lora_single_device.yaml").read_text()
    rc, _, err = _run(capsys, "cp", "tiny/lora_single_device", str(dest))
    assert rc == 2 and "already exists" in err
    assert _run(capsys, "cp", "full_finetune_single_device", str(tmp_path))[0] == 0
    assert (tmp_path / "full_finetune_single_device.py").is_file()


def test_every_shipped_config_parses_and_validates(capsys):
    configs = registry.list_configs()
    # Single device: 6 models x (full, lora) + 8B QLoRA; distributed: 4 models x (full, lora,
    # qat, qat_lora); QAT single device + quantize: 3 models x 2; KD 8B->1B: 2; tiny: 10;
    # the _fast variants: 2. Counted, so a config cannot silently vanish.
    assert len(configs) == 13 + 16 + 6 + 2 + 10 + 2, configs
    for name in configs:
        # --portable: the real-model configs point at /tmp/<model> downloads and device cuda.
        rc, out, err = _run(capsys, "validate", name, "--portable")
        assert rc == 0, f"{name}: {err}"
        assert "every top-level key is read by" in out and not err
    # Without --portable the tiny configs (CPU, built checkpoints) pass on this machine too;
    # tiny/quantize reads the QAT run's output, which no run has written here.
    for name in (c for c in configs if c.startswith("tiny/") and c != "tiny/quantize"):
        rc, out, err = _run(capsys, "validate", name)
        assert rc == 0, f"{name}: {err}"


def test_validate_finds_the_recipe_from_a_config_file_path(capsys, tmp_path):
    # A path (the shipped file, or a copy named like it) gets the recipe's key checks too, not
    # only the component bindings: a key only that recipe refuses must fail.
    shipped = Path(registry.resolve_config("tiny/lora_single_device").path)
    copy = tmp_path / "my_lora_single_device.yml"
    copy.write_text(shipped.read_text())
    for path in (shipped, copy):
        assert registry.recipe_for_config(str(path)) == "lora_finetune_single_device"
        rc, out, err = _run(capsys, "validate", str(path), "fp8_adapter_inputs=True", "--portable")
        assert rc != 0 and "fp8_adapter_inputs=True needs enable_fp8_training=True" in err, (out, err)


def test_every_shipped_configs_header_runs_it_with_the_recipe_its_name_maps_to():
    # What a copy under another name (tune cp ... my_run.yaml) is validated against.
    for name in registry.list_configs():
        path = Path(registry.resolve_config(name).path)
        assert registry.recipe_named_in_header(path) == registry.recipe_for_config(name), name


def test_every_torchtune_config_of_a_recipe_we_ship_finds_torchtunes_recipe():
    # What `tune validate <torchtune config>` checks it against: torchtune's own registry says
    # which recipe each of its configs is for (8B_to_1B_KD_lora_single_device is distillation,
    # not LoRA). The name decides, else the header; neither may name another recipe.
    from torchtune._recipe_registry import get_all_recipes

    ours, stock_configs = set(registry.list_recipes()), registry._stock()[1] / "configs"
    checked = 0
    for recipe in get_all_recipes():
        if recipe.name not in ours:
            continue
        for config in recipe.configs:
            found = (registry.recipe_for_config(config.name)
                     or registry.recipe_named_in_header(stock_configs / config.file_path))
            # llama3_3/70B_full_multinode: neither its name nor its header (a SLURM script)
            # says; validate then checks the components only and says so.
            assert found in (recipe.name, None), (config.name, found, recipe.name)
            checked += found is not None
    assert checked > 100


def test_validate_checks_torchtunes_distillation_config_against_the_distillation_recipe(capsys):
    rc, out, err = _run(capsys, "validate", "llama3_2/8B_to_1B_KD_lora_single_device", "--portable")
    assert rc == 0 and "config is valid" in out, (out, err)


def test_validate_finds_the_recipe_of_a_renamed_copy_from_its_header(capsys, tmp_path):
    shipped = Path(registry.resolve_config("tiny/lora_single_device").path)
    copy = tmp_path / "my_run.yaml"
    copy.write_text(shipped.read_text().replace("\nbatch_size:", "\nbatch_sizee:"))
    assert registry.recipe_for_config(str(copy)) is None  # the name says nothing
    rc, out, err = _run(capsys, "validate", str(copy), "--portable")
    assert rc == 2 and "lora_finetune_single_device does not use config key(s) 'batch_sizee'" in err
    # Without a header naming it, validate says what it did not check instead of "valid".
    bare = tmp_path / "bare.yaml"
    bare.write_text("output_dir: /tmp/x\nbatch_sizee: 2\n")
    rc, out, err = _run(capsys, "validate", str(bare))
    assert rc == 0 and "config is valid" not in out
    assert "its keys, values, paths and output_dir were not checked: add --recipe NAME" in out
    # torchtune's own recipes declare no keys to check against: said too.
    rc, out, err = _run(capsys, "validate", "generation")
    assert rc == 0 and "config is valid" not in out
    assert "generate declares no CONFIG_KEYS, so its keys, values, paths" in out


@pytest.mark.parametrize("header, recipe", [
    # torchtune's headers: no "# Run" label; every run line names the same recipe.
    ("# To launch:\n#   tune run lora_finetune_single_device --config llama3_2/1B_lora_single_device\n"
     "#   tune run lora_finetune_single_device --config x.yaml batch_size=2\n",
     "lora_finetune_single_device"),
    ("#   tune run qat_single_device --config a\n#   tune run quantize --config b\n", None),
    # ours: the line after "# Run" decides, whatever else the header mentions
    ("# Afterwards: tune run quantize --config q\n# Run:\n"
     "#   tune run --nproc_per_node 8 qat_distributed --config a\n", "qat_distributed"),
    ("# Run:\n#   tune run no_such_recipe --config a\n", None),
    ("# Run:\n#   tune run --standalone --nproc_per_node=2 lora_finetune_distributed --config a\n",
     "lora_finetune_distributed"),
    ("output_dir: /tmp/x\n# Run:\n#   tune run quantize --config a\n", None),  # not a header
])
def test_the_header_names_a_recipe_only_when_it_is_unambiguous(tmp_path, header, recipe):
    path = tmp_path / "c.yaml"
    path.write_text(header + "output_dir: /tmp/x\n")
    assert registry.recipe_named_in_header(path) == recipe


def test_a_header_naming_two_recipes_names_the_one_that_takes_the_files_keys(tmp_path, capsys):
    """torchtune's distillation configs tell to fine-tune the teacher first (a LoRA recipe's
    line) and then run distillation: a renamed copy is validated against the recipe whose keys
    its keys are (teacher_model is distillation's alone); where both take them, none."""
    header = ("# Fine-tune the teacher first:\n#   tune run lora_finetune_single_device --config t\n"
              "# Then:\n#   tune run knowledge_distillation_single_device --config kd\n")
    path = tmp_path / "my_kd.yaml"
    path.write_text(header + "output_dir: /tmp/x\nteacher_model:\n  _component_: x\n")
    assert registry.recipe_named_in_header(path) == "knowledge_distillation_single_device"
    path.write_text(header + "output_dir: /tmp/x\n")
    assert registry.recipe_named_in_header(path) is None
    # torchtune's own distillation config, copied under a name that says nothing
    copy = tmp_path / "distill_run.yaml"
    assert _run(capsys, "cp", "llama3_2/8B_to_1B_KD_lora_single_device", str(copy))[0] == 0
    rc, out, err = _run(capsys, "validate", str(copy), "--portable")
    assert rc == 0 and "read by knowledge_distillation_single_device" in out, (out, err)


def test_installed_tune_script_is_ours():
    exe = Path(sys.executable).parent / "tune"
    if not exe.exists():
        pytest.skip("no tune script next to this interpreter")
    assert "tune_recipes" in exe.read_text()
    alias = Path(sys.executable).parent / "tune-recipes"
    assert alias.exists() and "tune_recipes" in alias.read_text()


def test_recipes_are_not_an_importable_top_level_package():
    # torchtune owns the top-level `recipes` package; ours must never shadow it.
    assert not (REPO / "recipes" / "__init__.py").exists()
    proc = subprocess.run([sys.executable, "-c", "import recipes, os; print(os.path.dirname(recipes.__file__))"],
                          capture_output=True, text=True, cwd="/")
    if proc.returncode == 0:
        assert Path(proc.stdout.strip()).resolve() != (REPO / "recipes").resolve()


def test_wheel_ships_recipes_and_configs(tmp_path):
    """A normal (non-editable) install must find recipes and configs inside the package."""
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(REPO), "--no-deps", "--no-build-isolation",
         "-q", "-w", str(tmp_path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    wheel = next(tmp_path.glob("tune_recipes-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    for recipe in registry.list_recipes():
        assert f"tune_recipes/_shipped/recipes/{recipe}.py" in names
    for config in registry.list_configs():
        assert f"tune_recipes/_shipped/configs/{config}.yaml" in names
    assert "tune_recipes/data/assets/tiny_tokenizer.model" in names
    assert not any(n.startswith("recipes/") for n in names)


def test_version_names_ours_and_the_stack(capsys):
    from importlib.metadata import version

    import tune_recipes

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    out = capsys.readouterr().out.strip()
    assert out.startswith(f"tune-recipes {tune_recipes.__version__} (")
    for dist in ("torch", "torchtune", "torchao"):
        assert f"{dist} {version(dist)}" in out


@pytest.mark.parametrize("command", ["run", "validate"])
def test_run_and_validate_help_explain_overrides(capsys, command):
    with pytest.raises(SystemExit) as e:
        main([command, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "key=value" in out and "~key" in out and "optimizer.lr=1e-4" in out
    assert f"tune {command} " in out  # an example command line


def test_override_example_from_help_validates(capsys):
    # The example in `tune validate --help` is a real, valid command line.
    rc, out, err = _run(capsys, "validate", "tiny/lora_single_device", "optimizer.lr=1e-4",
                        "~lr_scheduler")
    assert rc == 0, err


def test_cp_help_describes_its_arguments(capsys):
    with pytest.raises(SystemExit):
        main(["cp", "--help"])
    out = capsys.readouterr().out
    for fragment in ("name", "destination", "directory", "--force", "overwrite",
                     "tiny/lora_single_device"):
        assert fragment in out


def test_cp_into_a_directory_keeps_the_file_name(tmp_path, capsys, monkeypatch):
    src = registry.configs_dir() / "tiny/lora_single_device.yaml"
    # An existing directory.
    assert _run(capsys, "cp", "tiny/lora_single_device", str(tmp_path))[0] == 0
    assert (tmp_path / "lora_single_device.yaml").read_text() == src.read_text()
    # A path ending in / that does not exist yet: made, and the file lands inside it.
    assert _run(capsys, "cp", "tiny/lora_single_device", str(tmp_path / "new") + "/")[0] == 0
    assert (tmp_path / "new" / "lora_single_device.yaml").read_text() == src.read_text()
    monkeypatch.chdir(tmp_path)
    assert _run(capsys, "cp", "lora_finetune_single_device", "rel/")[0] == 0
    assert (tmp_path / "rel" / "lora_finetune_single_device.py").is_file()
    # Without the slash, a new name is a file (suffix added), as before.
    assert _run(capsys, "cp", "tiny/lora_single_device", "mine")[0] == 0
    assert (tmp_path / "mine.yaml").is_file()
    rc, _, err = _run(capsys, "cp", "tiny/lora_single_device", str(tmp_path) + "/")
    assert rc == 2 and "already exists" in err


def test_cp_takes_torchtunes_make_parents_flag(tmp_path, capsys):
    # torchtune 0.6.1's spelling of "create the missing folders" (ours always creates them).
    dest = tmp_path / "a" / "b" / "mine.yaml"
    rc, out, err = _run(capsys, "cp", "--make-parents", "llama3_2/1B_lora_single_device", str(dest))
    assert rc == 0 and not err, err
    assert dest.read_text() == Path(registry.resolve_config("llama3_2/1B_lora_single_device").path).read_text()


def test_distributed_config_error_is_caught_before_torchrun(capsys, monkeypatch):
    import torch.distributed.run as torchrun

    started = []
    monkeypatch.setattr(torchrun, "main", lambda *a, **k: started.append(a))
    rc, out, err = _run(capsys, "run", "--nproc_per_node", "2", "full_finetune_distributed",
                        "--config", "tiny/full_distributed", "gradient_acumulation_steps=2")
    assert rc == 2 and not started
    lines = [l for l in err.splitlines() if l.strip()]
    assert len(lines) == 1 and "'gradient_acumulation_steps'" in lines[0], err
    rc, _, err = _run(capsys, "run", "--nproc_per_node", "2", "full_finetune_distributed",
                      "--config", "tiny/full_distributed", "optimizer.lrr=1")
    assert rc == 2 and not started and "optimizer.lrr" in err


def test_failed_child_processes_end_in_one_line_not_a_torchrun_traceback(capsys, monkeypatch):
    import torch.distributed.run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    def fail(argv):
        failure = ProcessFailure(local_rank=0, pid=1, exitcode=3, error_file="")
        raise ChildFailedError("tune_recipes._cli.launch", {0: failure})

    monkeypatch.setattr(torchrun, "main", fail)
    rc, _, err = _run(capsys, "run", "--nproc_per_node", "2", "full_finetune_distributed",
                      "--config", "tiny/full_distributed")
    assert rc == 3
    assert "Traceback" not in err and "ChildFailedError" not in err
    assert err.strip().splitlines() == ["tune: error: 1 of 2 processes failed (exit code 3); their output is above"]

    def fail_and_stop_the_other(argv):  # torchrun ends the other rank with SIGTERM: not a failure
        raise ChildFailedError("tune_recipes._cli.launch", {
            0: ProcessFailure(local_rank=0, pid=1, exitcode=-15, error_file=""),
            1: ProcessFailure(local_rank=1, pid=2, exitcode=1, error_file="")})

    monkeypatch.setattr(torchrun, "main", fail_and_stop_the_other)
    rc, _, err = _run(capsys, "run", "--nproc_per_node", "2", "full_finetune_distributed",
                      "--config", "tiny/full_distributed")
    assert rc == 1 and err.strip().splitlines() == [
        "tune: error: 1 of 2 processes failed (exit code 1) and torchrun stopped 1 other(s); "
        "their output is above"]


def test_a_config_error_every_process_meets_prints_once(capsys, monkeypatch):
    """Under torchrun each process checks the same config and data: the first process's line
    prints at once, and after the launch `tune` prints only the lines another process met that
    the first did not, naming its rank; the folder they were left in is gone afterwards."""
    import torch.distributed.run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from tune_recipes.config import RANK_ERRORS_ENV, ConfigError, report_config_error

    folders = []

    def three_ranks_fail(argv):
        folders.append(Path(os.environ[RANK_ERRORS_ENV]))
        for rank, message in enumerate(["batch_size=300: too big", "batch_size=300: too big",
                                        "rank 2's shard holds no example"]):
            monkeypatch.setenv("LOCAL_RANK", str(rank))
            report_config_error(ConfigError(message))
        raise ChildFailedError("tune_recipes._cli.launch", {
            r: ProcessFailure(local_rank=r, pid=r + 1, exitcode=2, error_file="") for r in range(3)})

    monkeypatch.setattr(torchrun, "main", three_ranks_fail)
    rc, _, err = _run(capsys, "run", "--nproc_per_node", "3", "full_finetune_distributed",
                      "--config", "tiny/full_distributed")
    assert rc == 2
    assert err.strip().splitlines() == [
        "tune: error: batch_size=300: too big",
        "tune: error: rank 2: rank 2's shard holds no example",
        "tune: error: 3 of 3 processes failed (exit code 2); their output is above"], err
    assert not folders[0].exists() and RANK_ERRORS_ENV not in os.environ

    # A restarted round's lines name the restart; and however the launch ends (here `tune`
    # stopped by a signal), lines not yet printed are printed once.
    from torch.distributed.elastic.multiprocessing.api import SignalException

    def restarted_then_stopped(argv):
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
        monkeypatch.setenv("LOCAL_RANK", "1")
        report_config_error(ConfigError("rank 1's shard holds no example"))
        raise SignalException("stopped", signal.SIGTERM)

    monkeypatch.setattr(torchrun, "main", restarted_then_stopped)
    rc, _, err = _run(capsys, "run", "--nproc_per_node", "3", "full_finetune_distributed",
                      "--config", "tiny/full_distributed")
    assert rc == 143
    assert err.count("rank 1's shard") == 1 and \
        "tune: error: restart 1, rank 1: rank 1's shard holds no example" in err, err


def test_a_config_of_another_recipe_names_the_recipe_whose_keys_it_has(tmp_path, capsys):
    """A LoRA config given to the full fine-tune: the unknown key (save_adapter_weights_only)
    comes with the recipe to run it with (the distillation recipe takes a LoRA config's keys
    too, but needs a teacher the config lacks); a distillation config given to LoRA likewise;
    a plain typo names none."""
    for recipe, config, whose in (("full_finetune_single_device", "tiny/lora_single_device",
                                   "lora_finetune_single_device"),
                                  ("lora_finetune_single_device", "tiny/kd_single_device",
                                   "knowledge_distillation_single_device")):
        rc, _, err = _run(capsys, "run", recipe, "--config", config, f"output_dir={tmp_path / 'out'}")
        assert rc == 2 and err.strip().endswith(
            f"; the config's keys are those of {whose}: run it with that recipe"), err
    rc, _, err = _run(capsys, "run", "full_finetune_single_device", "--config", "tiny/full_single_device",
                      f"output_dir={tmp_path / 'out'}", "zzz=1")
    assert rc == 2 and "does not use config key(s) 'zzz'" in err and "run it with" not in err, err
    # A LoRA key on a full config: no LoRA recipe offered, the model has no adapters.
    rc, _, err = _run(capsys, "run", "full_finetune_single_device", "--config", "tiny/full_single_device",
                      f"output_dir={tmp_path / 'out'}", "save_adapter_weights_only=True")
    assert rc == 2 and "run it with" not in err, err
    # Distributed: both recipes that take a QAT config's keys are named.
    rc, _, err = _run(capsys, "run", "--nproc_per_node", "2", "lora_finetune_distributed", "--config",
                      "tiny/qat_distributed", f"output_dir={tmp_path / 'out'}")
    assert rc == 2 and err.strip().endswith("; the config's keys are those of qat_distributed: run it with "
                                            "that recipe"), err


def test_a_copied_recipes_unknown_key_points_to_its_config_keys(tmp_path, capsys):
    """A `tune cp` copy whose edited code reads a new key must list it in CONFIG_KEYS: the
    unknown-key error says where; our own recipe's error does not (its users do not edit it)."""
    assert _run(capsys, "cp", "full_finetune_single_device", str(tmp_path / "mine.py"))[0] == 0
    for recipe, hinted in ((str(tmp_path / "mine.py"), True), ("full_finetune_single_device", False)):
        rc, _, err = _run(capsys, "run", recipe, "--config", "tiny/full_single_device",
                          f"output_dir={tmp_path / 'out'}", "zzz_my_key=1")
        assert rc == 2 and "does not use config key(s) 'zzz_my_key'" in err, err
        assert (f"(add the keys your edited script reads to the CONFIG_KEYS set in "
                f"{tmp_path / 'mine.py'})" in err) is hinted, err


def test_a_killed_launchers_rank_errors_folder_goes_at_the_next_launch(capsys, monkeypatch, tmp_path):
    """A `tune` killed by SIGKILL never runs its ``finally``: its folder stays in the temp
    folder. The next torchrun launch removes the folders of launchers that are gone, by the pid
    in their name, and keeps a live launcher's."""
    import tempfile

    import torch.distributed.run as torchrun

    from tune_recipes._cli.main import RANK_ERRORS_PREFIX

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    left = tmp_path / f"{RANK_ERRORS_PREFIX}{gone.pid}_abc"
    live = tmp_path / f"{RANK_ERRORS_PREFIX}{os.getppid()}_def"
    recent = tmp_path / f"{RANK_ERRORS_PREFIX}{gone.pid}_ghi"  # gone, but touched lately
    for folder in (left, live, recent):
        folder.mkdir()
        (folder / "round_0").mkdir()
    hours_ago = time.time() - 2 * 3600
    for folder in (left, live):
        os.utime(folder, (hours_ago, hours_ago))
    during = []
    monkeypatch.setattr(torchrun, "main", lambda argv: during.append(
        [p.name for p in tmp_path.glob(f"{RANK_ERRORS_PREFIX}*")]))
    rc, _, err = _run(capsys, "run", "--nproc_per_node", "2", "full_finetune_distributed",
                      "--config", "tiny/full_distributed")
    assert rc == 0, err
    mine = [n for n in during[0] if n.startswith(f"{RANK_ERRORS_PREFIX}{os.getpid()}_")]
    assert left.name not in during[0] and live.name in during[0] and recent.name in during[0] \
        and len(mine) == 1, during
    assert sorted(p.name for p in tmp_path.glob(f"{RANK_ERRORS_PREFIX}*")) == sorted([live.name, recent.name])


def test_a_finished_torchrun_rank_exits_without_interpreter_finalization(tmp_path):
    """launch.py ends a torchrun rank whose recipe finished with os._exit after the atexit
    handlers (a gloo rank once aborted in finalization, failing a finished run). Shown by a
    non-daemon thread: interpreter shutdown would join it and it would write its file."""
    script = tmp_path / "recipe.py"
    script.write_text(
        "import atexit, sys, threading, time\n"
        f"atexit.register(lambda: open({str(tmp_path / 'atexit_ran')!r}, 'w').close())\n"
        "def late():\n"
        "    time.sleep(2)\n"
        f"    open({str(tmp_path / 'joined')!r}, 'w').close()\n"
        "threading.Thread(target=late).start()\n"
        "code = int(sys.argv[1])\n"
        "sys.exit(None if code == 0 else code)\n"
    )
    run = lambda code, env: subprocess.run(  # noqa: E731
        [sys.executable, "-m", "tune_recipes._cli.launch", str(script), str(code)],
        env={**os.environ, **env}, capture_output=True, text=True, timeout=120)
    proc = run(0, {"TORCHELASTIC_RUN_ID": "test"})
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "atexit_ran").exists() and not (tmp_path / "joined").exists()
    (tmp_path / "atexit_ran").unlink()
    # A failing rank keeps its exit code; outside torchrun the interpreter shuts down as usual.
    assert run(3, {"TORCHELASTIC_RUN_ID": "test"}).returncode == 3
    env = {k: v for k, v in os.environ.items() if k != "TORCHELASTIC_RUN_ID"}
    proc = subprocess.run([sys.executable, "-m", "tune_recipes._cli.launch", str(script), "0"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and (tmp_path / "joined").exists()


# --------------------------------------------------------------------------- launcher
def _no_torchrun(monkeypatch):
    import torch.distributed.run as torchrun

    started = []
    monkeypatch.setattr(torchrun, "main", lambda argv: started.append(list(argv)))
    return started


_FULL = ["full_finetune_distributed", "--config", "tiny/full_distributed"]


@pytest.mark.parametrize("launcher, fragment", [
    (["--nnodes", "x"], "--nnodes x: expected a number of nodes N or a range MIN:MAX"),
    (["--nnodes", "3:2"], "--nnodes 3:2: expected N >= 1, or MIN:MAX"),
    (["--nnodes", "2", "--nproc_per_node", "1"], "--nnodes 2: the nodes need a place to meet"),
    (["--nnodes", "2", "--standalone"], "--standalone with --nnodes 2"),
    (["--nnodes", "2", "--node_rank", "2", "--master_addr", "h", "--master_port", "29500"],
     "--node_rank 2: expected 0 to 1 for --nnodes 2"),
    (["--nnodes", "1:2", "--master_addr", "h"], "--nnodes 1:2: a range needs --rdzv_backend c10d"),
    # torchrun itself accepts this; every node would take rank 0 and wait for ever
    (["--nnodes", "2", "--rdzv_endpoint", "localhost:29500"],
     "--nnodes 2 with the static rendezvous: give each node its own --node_rank"),
    (["--nproc_per_node", "gpu"], "--nproc_per_node gpu: this machine has no CUDA device"),
    (["--nproc-per-node", "lots"], "--nproc_per_node lots: expected a number of processes, or gpu"),
    (["--nproc_per_node", "0"], "--nproc_per_node 0: expected an integer >= 1"),
    (["--rdzv_backend", "zookeeper"], "--rdzv_backend zookeeper: expected one of c10d, "),
    (["--rdzv-endpoint", "h:p:q", "--nnodes", "2"], "--rdzv_endpoint h:p:q: expected HOST:PORT"),
    (["--max_restarts", "-1"], "--max_restarts -1: expected an integer >= 0"),
    (["--master_port", "70000"], "--master_port 70000: expected a port"),
    (["--node_rank", "x"], "argument --node-rank/--node_rank: invalid int value: 'x'"),
    (["--start_method", "thread"], "argument --start-method/--start_method: invalid choice"),
])
def test_every_launcher_mistake_is_one_line_before_anything_starts(launcher, fragment, capsys,
                                                                   monkeypatch):
    if "gpu" in launcher:
        import torch

        if torch.cuda.is_available():
            pytest.skip("this machine has a GPU")
    started = _no_torchrun(monkeypatch)
    try:
        rc = main(["run", *launcher, *_FULL])
    except SystemExit as e:  # argparse's own checks (types, choices)
        rc = e.code
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 2 and not started, err
    assert len(lines) == 1 and lines[0].startswith("tune: error: ") and fragment in lines[0], err


@pytest.mark.parametrize("launcher, expected", [
    # One node, nowhere to meet: torchrun's local rendezvous on a free port, as before.
    (["--nproc_per_node", "2"], ["--nproc_per_node", "2", "--standalone"]),
    # torchrun's dash spellings mean the same; the arguments go to torchrun as given.
    (["--nproc-per-node", "2", "--max-restarts", "3"],
     ["--nproc_per_node", "2", "--max_restarts", "3", "--standalone"]),
    (["--nnodes", "2", "--node-rank", "1", "--nproc_per_node", "2", "--rdzv-backend", "c10d",
      "--rdzv-endpoint", "node0:29400", "--rdzv-id", "job7"],
     ["--nnodes", "2", "--nproc_per_node", "2", "--rdzv_backend", "c10d",
      "--rdzv_endpoint", "node0:29400", "--rdzv_id", "job7", "--node_rank", "1"]),
    (["--nnodes", "2", "--node_rank", "0", "--master_addr", "node0", "--master_port", "29500",
      "--nproc_per_node", "cpu"],
     ["--nnodes", "2", "--nproc_per_node", "cpu", "--node_rank", "0", "--master_addr", "node0",
      "--master_port", "29500"]),
])
def test_launcher_arguments_reach_torchrun(launcher, expected, monkeypatch, tmp_path):
    started = _no_torchrun(monkeypatch)
    assert main(["run", *launcher, *_FULL, f"output_dir={tmp_path}"]) == 0
    assert len(started) == 1
    argv = started[0]
    assert argv[:argv.index("-m")] == expected
    assert argv[argv.index("-m"):][:3] == ["-m", "tune_recipes._cli.launch",
                                           str(registry.resolve_recipe(_FULL[0]).path)]


@pytest.mark.parametrize("resume, warns", [("False", True), ("auto", False), ("True", False)])
def test_restarts_without_a_resume_setting_warn_that_a_round_starts_over(resume, warns, monkeypatch,
                                                                         tmp_path, capsys):
    started = _no_torchrun(monkeypatch)
    (tmp_path / "epoch_0").mkdir()  # something to resume, so resume_from_checkpoint=True validates
    (tmp_path / "epoch_0" / "recipe_state.pt").write_bytes(b"")
    rc = main(["run", "--nproc_per_node", "2", "--max_restarts", "1", *_FULL,
               f"output_dir={tmp_path}", f"resume_from_checkpoint={resume}"])
    err = capsys.readouterr().err
    if rc == 0:
        assert started
    assert ("--max_restarts 1 with resume_from_checkpoint=False" in err) == warns, err
    assert not warns or "set resume_from_checkpoint=auto" in err


def test_without_launcher_arguments_the_recipe_runs_in_this_process(monkeypatch, tmp_path):
    from tune_recipes._cli import main as cli

    started, ran = _no_torchrun(monkeypatch), []
    monkeypatch.setattr(cli, "run_script", lambda path, args: ran.append(path))
    assert main(["run", "full_finetune_single_device", "--config", "tiny/full_single_device",
                 f"output_dir={tmp_path}"]) == 0
    assert ran and not started


def test_a_second_config_is_refused(capsys):
    with pytest.raises(SystemExit) as e:
        main(["run", "full_finetune_single_device", "--config", "tiny/full_single_device",
              "--config", "tiny/lora_single_device"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1
    assert "--config given twice (tiny/full_single_device and tiny/lora_single_device)" in err[0]


def test_help_names_the_launcher_and_portable(capsys):
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    out = capsys.readouterr().out
    for flag in ("--nnodes", "--node_rank", "--rdzv_endpoint", "--max_restarts", "--standalone"):
        assert flag in out
    with pytest.raises(SystemExit):
        main(["validate", "--help"])
    assert "[--portable]" in capsys.readouterr().out.split("\n\n")[0]


def test_validate_accepts_resume_auto_and_checks_it_as_the_recipe_does(tmp_path, capsys):
    assert main(["validate", "tiny/full_single_device", f"output_dir={tmp_path}",
                 "resume_from_checkpoint=auto"]) == 0
    rc, _, err = _run(capsys, "validate", "tiny/full_single_device", f"output_dir={tmp_path}",
                      "resume_from_checkpoint=maybe")
    assert rc == 2 and "resume_from_checkpoint=maybe: expected True, False or auto" in err
    # auto with an earlier run's mid-epoch checkpoint resumes it: checked like True.
    (tmp_path / "step_3").mkdir()
    rc, _, err = _run(capsys, "validate", "tiny/full_single_device", f"output_dir={tmp_path}",
                      "resume_from_checkpoint=auto")
    assert rc == 2 and "step_3/recipe_state.pt" in err


def test_validate_points_a_config_for_another_machine_at_portable(tmp_path, capsys):
    copied = tmp_path / "full_single_device.yaml"  # a file written where other paths exist
    copied.write_text((registry.configs_dir() / "tiny/full_single_device.yaml").read_text().replace(
        "checkpoint_dir: ${tiny_checkpoint:}", f"checkpoint_dir: {tmp_path / 'elsewhere'}"))
    rc, _, err = _run(capsys, "validate", str(copied))
    assert rc == 2 and err.count("\n") == 1
    assert "checkpointer.checkpoint_dir=" in err and "add --portable" in err
    # A mistake --portable would not excuse gets no such hint.
    rc, _, err = _run(capsys, "validate", "tiny/full_single_device", "batch_size=0")
    assert rc == 2 and "--portable" not in err
    # Nor does a path typed on this machine's command line.
    (tmp_path / "a_file").write_text("")
    (tmp_path / "empty").mkdir()
    for typed, failing in ((f"checkpointer.checkpoint_dir={tmp_path / 'elsewhere'}", "checkpointer.checkpoint_dir"),
                           (f"output_dir={tmp_path / 'a_file' / 'run'}", "output_dir"),
                           # a key of the component the typed one belongs to
                           (f"checkpointer.checkpoint_dir={tmp_path / 'empty'}", "checkpointer.checkpoint_files"),
                           (f"checkpointer={{checkpoint_dir: {tmp_path / 'elsewhere'}}}", "checkpointer.")):
        rc, _, err = _run(capsys, "validate", "tiny/full_single_device", typed)
        assert rc == 2 and err.startswith(f"tune: error: {failing}") and "--portable" not in err, err


# --------------------------------------------------------------------------- cp and plot
@pytest.mark.parametrize("name, dest, fragment", [
    ("tiny/lora_single_device", "mine.py", "is a config, so its copy needs a .yaml name "
                                           "(e.g. mine.yaml)"),
    ("lora_finetune_single_device", "mine.yaml", "is a recipe, so its copy needs a .py name"),
])
def test_cp_refuses_a_name_tune_run_would_not_read_as_that_kind(name, dest, fragment, tmp_path,
                                                                  capsys):
    rc, _, err = _run(capsys, "cp", name, str(tmp_path / dest))
    assert rc == 2 and fragment in err and err.count("\n") == 1
    assert not (tmp_path / dest).exists()
    # .yml is a config name too
    assert _run(capsys, "cp", "tiny/lora_single_device", str(tmp_path / "mine.yml"))[0] == 0


def test_cp_to_a_place_it_cannot_write_is_one_line(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    rc, _, err = _run(capsys, "cp", "tiny/lora_single_device", str(blocker / "sub" / "x.yaml"))
    assert rc == 2 and err.startswith(f"tune: error: cannot write {blocker / 'sub' / 'x.yaml'}")
    assert err.count("\n") == 1 and "Traceback" not in err


def _metrics(run, rows):
    import json

    run.mkdir(parents=True, exist_ok=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run


def test_plot_says_the_file_it_wrote(tmp_path, capsys, monkeypatch):
    run = _metrics(tmp_path / "run", [{"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.5}])
    monkeypatch.chdir(tmp_path)
    rc, out, _ = _run(capsys, "plot", str(run), "--out", "o26")
    assert rc == 0 and out.strip() == "wrote o26.png" and (tmp_path / "o26.png").is_file()
    assert not (tmp_path / "o26").exists()
    rc, out, _ = _run(capsys, "plot", str(run), "--out", "o27.pdf")
    assert rc == 0 and (tmp_path / "o27.pdf").is_file()


@pytest.mark.parametrize("case, fragment", [
    ("txt", "x.txt: cannot draw a .txt file; name a .png"),
    ("unwritable", "cannot write"),
    ("no rows", "holds no readable row"),
])
def test_plot_mistakes_are_one_line(case, fragment, tmp_path, capsys):
    run = _metrics(tmp_path / "run", [{"step": 1, "loss": 2.0}])
    out = str(tmp_path / "x.txt")
    if case == "unwritable":
        (tmp_path / "f").write_text("")
        out = str(tmp_path / "f" / "x.png")
    if case == "no rows":
        (run / "metrics.jsonl").write_text('{"loss": 1}\nnot json\n{"step": "x"}\n')
        out = str(tmp_path / "x.png")
    rc, _, err = _run(capsys, "plot", str(run), "--out", out)
    assert rc == 2 and fragment in err and err.count("\n") == 1 and "Traceback" not in err


_SWALLOWED = r"""
import os, signal, sys, time
from tune_recipes._cli.launch import handle_sigterm, restore_sigterm

class SignalledInAFinalizer:
    # The signal arrives while a finalizer runs (as an import's module-lock callback can):
    # the handler's exception is raised there, and Python prints it and carries on.
    def __del__(self):
        os.kill(os.getpid(), getattr(signal, sys.argv[1]))
        for _ in range(1000):
            pass

previous = handle_sigterm() if sys.argv[2] == "tune" else None
try:
    SignalledInAFinalizer()
    for _ in range(300):
        time.sleep(0.01)
    print("ran to the end")
    sys.exit(0)
except KeyboardInterrupt as e:
    print(type(e).__name__)
    sys.exit(3)
finally:
    restore_sigterm(previous)
"""


def _default_sigint():
    # NOTE: keep. Tests started in the background (`cmd &`, nohup) ignore SIGINT, and the
    # child inherits it; a terminal's `tune` has the default disposition, so this child too.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.parametrize("sig, raised", [("SIGTERM", "Terminated"),
                                         ("SIGINT", "KeyboardInterrupt")])
def test_a_signal_a_finalizer_swallowed_still_stops_the_run(sig, raised):
    proc = subprocess.run([sys.executable, "-c", _SWALLOWED, sig, "tune"],
                          capture_output=True, text=True, timeout=60, preexec_fn=_default_sigint)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert proc.stdout.strip() == raised
    assert "Exception ignored" not in proc.stderr
    assert "Traceback" not in proc.stderr


def test_without_tunes_handlers_the_finalizer_swallows_the_interrupt():
    """The case the handlers exist for: Python's own SIGINT handling loses this Ctrl-C."""
    proc = subprocess.run([sys.executable, "-c", _SWALLOWED, "SIGINT", "bare"],
                          capture_output=True, text=True, timeout=60, preexec_fn=_default_sigint)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "ran to the end" in proc.stdout
    assert "Exception ignored" in proc.stderr


def test_a_failed_download_is_one_line_not_torchtunes_traceback_chain(monkeypatch, tmp_path, capsys):
    import torchtune._cli.download as download

    def offline(*args, **kwargs):
        try:
            raise OSError("[Errno -3] Temporary failure in name resolution")
        except OSError as cause:
            raise ConnectionError("Max retries exceeded with url: /api/models/a/b") from cause

    monkeypatch.setattr(download, "snapshot_download", offline)
    with pytest.raises(SystemExit) as exited:
        main(["download", "a/b", "--output-dir", str(tmp_path / "dl")])
    assert exited.value.code == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1, err
    assert err[0].startswith("tune download: error: Failed to download a/b with error: 'Max retries")
    assert err[0].endswith("(no network? the download needs huggingface.co or kaggle.com)")


def test_an_offline_download_into_a_folder_with_files_fails_and_writes_nothing(tmp_path, capsys,
                                                                              monkeypatch):
    # huggingface_hub returns a non-empty local_dir untouched when the Hub cannot be reached;
    # torchtune then printed "Successfully downloaded" and wrote its repo-id file there.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    folder = tmp_path / "dl"
    folder.mkdir()
    (folder / "keep.txt").write_text("keep")
    with pytest.raises(SystemExit) as exited:
        main(["download", "Qwen/Qwen2.5-0.5B-Instruct", "--output-dir", str(folder)])
    assert exited.value.code == 2
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "the Hub could not be reached, so nothing was downloaded" in lines[0], err
    assert "(no network?" in lines[0] and "Successfully" not in out + err and "patterns: None" not in out
    assert sorted(p.name for p in folder.iterdir()) == ["keep.txt"]
    # However quiet the Hub's loggers are kept (its warning is what tells the case apart).
    import huggingface_hub.utils.logging as hub_logging

    hub_logging.set_verbosity_error()
    try:
        with pytest.raises(SystemExit) as exited:
            main(["download", "Qwen/Qwen2.5-0.5B-Instruct", "--output-dir", str(folder)])
    finally:
        hub_logging.set_verbosity_warning()
    assert exited.value.code == 2 and "nothing was downloaded" in capsys.readouterr().err
    # A folder holding an earlier download of this repo (torchtune's record of it) is used as
    # it is, with a note: a download script re-run offline goes on.
    import json

    (folder / "original_repo_id.json").write_text(json.dumps({"repo_id": "Qwen/Qwen2.5-0.5B-Instruct"}))
    assert main(["download", "Qwen/Qwen2.5-0.5B-Instruct", "--output-dir", str(folder)]) == 0
    assert "holds an earlier download of Qwen/Qwen2.5-0.5B-Instruct, left as it was" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # ... of this repo only
        main(["download", "Qwen/Qwen2.5-1.5B-Instruct", "--output-dir", str(folder)])


@pytest.mark.parametrize("ours", [True, False])
def test_ctrl_c_in_a_torchtune_recipe_claims_no_step_or_checkpoint(ours, tmp_path, monkeypatch, capsys):
    """Only our recipes report their steps and checkpoints to tune; a torchtune recipe stopped
    after 250 steps and 80 checkpoints was told "at step 0; no checkpoint saved by this run"."""
    from tune_recipes._cli.launch import run_script

    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    script = tmp_path / "lora_dpo_single_device.py"
    script.write_text(("import tune_recipes\n" if ours else "import torchtune\n") + "raise KeyboardInterrupt\n")
    with pytest.raises(SystemExit) as stopped:
        run_script(script, [])
    assert stopped.value.code == 130
    line = capsys.readouterr().err.strip()
    if ours:
        assert line.startswith("interrupted at step "), line
    else:
        assert line == ("interrupted: lora_dpo_single_device is torchtune's recipe, which reports no "
                        "steps or checkpoints to tune (its output above says where it stood)"), line


@pytest.mark.parametrize("torchrun_rank", [True, False])
def test_ctrl_c_while_a_rank_imports_torch_is_no_traceback(torchrun_rank, tmp_path, monkeypatch, capsys):
    """torchrun passes `tune`'s Ctrl-C on to every rank, and in a run's first seconds a rank is
    still importing torch (the training package): a rank stops silently (`tune` prints the
    line for all of them); `tune` itself passes the interrupt on to its main(), whose line says
    that nothing was written."""
    from tune_recipes._cli.launch import run_script

    class InterruptedImport:
        def find_spec(self, name, path=None, target=None):
            if name == "tune_recipes.training.reporting":
                raise KeyboardInterrupt
            return None

    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delitem(sys.modules, "tune_recipes.training.reporting", raising=False)
    monkeypatch.setattr(sys, "meta_path", [InterruptedImport(), *sys.meta_path])
    script = tmp_path / "full_finetune_distributed.py"
    script.write_text("raise AssertionError('the script ran')\n")
    if torchrun_rank:
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", "r")
        with pytest.raises(SystemExit) as stopped:
            run_script(script, [])
        assert stopped.value.code == 130 and capsys.readouterr().err == ""
    else:
        monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
        with pytest.raises(KeyboardInterrupt):
            run_script(script, [])
        rc, _, err = _run(capsys, "run", "full_finetune_single_device", "--config",
                          "tiny/full_single_device", f"output_dir={tmp_path / 'out'}")
        assert rc == 130 and err.strip() == (
            "tune: interrupted before the recipe started training; nothing was written"), err


@pytest.mark.parametrize("torchrun_rank", [True, False])
def test_a_rank_whose_peer_died_says_so_in_one_line(torchrun_rank, tmp_path, monkeypatch, capsys):
    """gloo's error in the surviving rank would bury the failed rank's own line under a
    traceback; under torchrun it is one line instead. Outside torchrun it is not ours to hide."""
    from tune_recipes._cli.launch import run_script

    monkeypatch.setattr(sys, "argv", list(sys.argv))  # run_script sets both, as python does
    monkeypatch.setattr(sys, "path", list(sys.path))
    script = tmp_path / "recipe.py"
    script.write_text("raise RuntimeError('[pair.cc:553] Connection closed by peer [127.0.0.1]:7365. "
                      "This is typically caused by a remote worker crashing.')\n")
    if torchrun_rank:
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", "r")
        monkeypatch.setenv("RANK", "0")
        with pytest.raises(SystemExit) as stopped:
            run_script(script, [])
        assert stopped.value.code == 1
        assert capsys.readouterr().err == (
            "tune: error: rank 0 stopped: another process of the run ended first (its error, or "
            "torchrun's line if it was killed, says why)\n")
    else:
        monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
        with pytest.raises(RuntimeError, match="Connection closed by peer"):
            run_script(script, [])
    # Any other error of a rank is its own: raised as it is.
    script.write_text("raise RuntimeError('CUDA out of memory')\n")
    with pytest.raises(RuntimeError, match="out of memory"):
        run_script(script, [])


def test_a_stopped_torchrun_launch_names_the_last_logged_step(tmp_path):
    """The processes that knew the step are gone: `tune` names the last training row of
    metrics.jsonl logged since the launch, skipping a row the stop cut short and rows without a
    loss (validation); an earlier run's rows (not yet moved aside or trimmed) name nothing."""
    from tune_recipes._cli.main import _last_logged_step

    assert _last_logged_step(str(tmp_path), since=0) is None and _last_logged_step(None, since=0) is None
    (tmp_path / "metrics.jsonl").write_text(
        '{"step": 3, "time": 100.0, "loss": 1.6}\n{"step": 6, "time": 200.0, "loss": 1.5}\n'
        '{"step": 7, "time": 201.0, "loss": 1.4}\n{"step": 7, "time": 202.0, "val_loss": 1.6}\n'
        '{"step": 8, "time": 203.0, "lo')
    assert _last_logged_step(str(tmp_path), since=150.0) == 7
    assert _last_logged_step(str(tmp_path), since=300.0) is None  # all from before the launch


def test_a_stopped_torchrun_launch_names_its_resume_or_that_the_run_finished(tmp_path):
    """`tune` (torchrun's agent) prints the line for every rank from what output_dir holds: a
    resume command beside an intermediate checkpoint, nothing to resume beside a final one."""
    from tune_recipes._cli.launch import Launch
    from tune_recipes._cli.main import _how_to_continue

    launch = Launch(argv=["--nproc_per_node", "2"], nproc_per_node=2, min_nodes=1, max_nodes=1)
    argv = ["recipes/full_finetune_distributed.py", "--config", "c.yaml", f"output_dir={tmp_path}"]
    assert _how_to_continue(launch, argv, str(tmp_path)) == f"no checkpoint in {tmp_path}"
    (tmp_path / "epoch_0").mkdir()
    (tmp_path / "epoch_0" / "model.safetensors").write_bytes(b"")
    # no recipe state anywhere: the run's final epoch
    assert _how_to_continue(launch, argv, str(tmp_path)) == (
        f"the run finished: its final checkpoint {tmp_path / 'epoch_0'} is complete, nothing to resume")
    import torch

    # with its recipe state: an intermediate epoch, one of two
    torch.save({"epochs_run": 1, "total_epochs": 2, "seed": 0, "max_steps_per_epoch": None},
               tmp_path / "epoch_0" / "recipe_state.pt")
    line = _how_to_continue(launch, argv, str(tmp_path))
    assert line.startswith(f"newest checkpoint {tmp_path / 'epoch_0'}; resume with: tune run "
                           "--nproc_per_node 2 full_finetune_distributed"), line


# --------------------------------------------------------------------------- cat
def test_cat_prints_a_shipped_config_as_written(capsys):
    for name in ("tiny/lora_single_device", "llama3_2/1B_full_single_device"):
        rc, out, err = _run(capsys, "cat", name)
        assert rc == 0 and not err
        assert out == (registry.configs_dir() / f"{name}.yaml").read_text()


def test_cat_sort_prints_the_same_config_with_its_keys_sorted(capsys):
    from omegaconf import OmegaConf

    from tune_recipes.config import load_config

    rc, out, _ = _run(capsys, "cat", "tiny/lora_single_device", "--sort")
    assert rc == 0
    printed = OmegaConf.create(out)
    assert printed == load_config(registry.configs_dir() / "tiny/lora_single_device.yaml")
    assert list(printed) == sorted(printed) and list(printed.model) == sorted(printed.model)
    # Interpolations are printed as written, not resolved.
    assert "${output_dir}" in out and "#" not in out


def test_cat_reads_a_yaml_file_and_falls_back_to_torchtunes_names(tmp_path, capsys):
    mine = tmp_path / "mine.yaml"
    mine.write_text("# my run\nb: 1\na: {d: 2, c: 3}\n")
    assert _run(capsys, "cat", str(mine))[1] == mine.read_text()
    assert _run(capsys, "cat", str(mine), "--sort")[1] == "a:\n  c: 3\n  d: 2\nb: 1\n"
    stock = registry.resolve_config("llama2/7B_lora_dpo_single_device")
    rc, out, _ = _run(capsys, "cat", "llama2/7B_lora_dpo_single_device")
    assert rc == 0 and stock.origin == "torchtune" and out == stock.path.read_text()


@pytest.mark.parametrize("argv, fragment", [
    (["cat", "tiny/lora_singl_device"], "unknown config 'tiny/lora_singl_device' (not ours, not "
                                        "torchtune's; did you mean tiny/lora_single_device?); "
                                        "see `tune ls`"),
    (["cat", "lora_finetune_single_device"], "'lora_finetune_single_device' is a recipe, not a "
                                             "config"),
    (["cat", "missing.yaml"], "config file not found: missing.yaml"),
    (["cat", "NOTES"], "NOTES: not a .yaml or .yml file"),
    (["cat", "bad.yaml"], "cannot parse bad.yaml"),
    (["cat", "list.yaml"], "list.yaml must hold a mapping of keys"),
    (["cat", "tiny/lora_single_device", "batch_size=4"], "unrecognized arguments: batch_size=4"),
])
def test_cat_mistakes_are_one_line(argv, fragment, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "NOTES").write_text("a: 1\n")
    (tmp_path / "bad.yaml").write_text("a: [1\nb: 2\n")
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    try:
        rc = main(argv)
    except SystemExit as e:  # argparse's own checks
        rc = e.code
    out, err = capsys.readouterr()
    assert rc == 2 and not out
    assert err.count("\n") == 1 and fragment in err and "Traceback" not in err, err


def test_tune_help_lists_cat(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "{run,ls,cp,cat,validate,plot,download}" in out
    assert any(line.split()[:1] == ["cat"] for line in out.splitlines())
    with pytest.raises(SystemExit):
        main(["cat", "--help"])
    assert "--sort" in capsys.readouterr().out
