"""Every command a shipped config's header shows (its run line and its example overrides) passes
``tune validate`` for the recipe it names: a user who copies one does not meet an error the
config itself causes (e.g. more accumulation where the optimizer steps inside backward)."""

import re
import shlex
from pathlib import Path

import pytest

from tune_recipes._cli.main import main
from tune_recipes._cli.registry import recipe_for_config

pytestmark = pytest.mark.unit
CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def _header_commands():
    found = []
    for path in sorted(CONFIGS.glob("*/*.yaml")):
        header = []
        for line in path.read_text().splitlines():
            if not line.startswith("#"):
                break  # the header: the comment lines before the first key
            header.append(line.lstrip("#").strip())
        # a command continued over lines (a trailing backslash) is one command
        config = f"{path.parent.name}/{path.stem}"
        for match in re.finditer(r"\btune run ([^\n]*)", "\n".join(header).replace("\\\n", " ")):
            found.append((config, match.group(1).strip()))
        # a line of overrides alone (key=value ...) is for this config's own recipe
        for line in header:
            words = line.split()
            if words and all(re.fullmatch(r"[A-Za-z_][\w.]*=\S+", w) for w in words):
                found.append((config, f"{recipe_for_config(config)} --config {config} {line}"))
    return found


def test_every_shipped_config_shows_a_run_command_of_its_own():
    named = {config for config, command in _header_commands() if f"--config {config}" in command}
    assert named == {f"{p.parent.name}/{p.stem}" for p in CONFIGS.glob("*/*.yaml")}


@pytest.mark.parametrize("config,command", _header_commands(), ids=[f"{c}: {cmd}" for c, cmd in _header_commands()])
def test_a_header_command_validates(config, command, capsys):
    words = shlex.split(command.replace("<output_dir>", "/tmp/out"))
    while words[0].startswith("--"):  # torchrun's options: --nproc_per_node N, --nnodes=2
        words = words[1:] if "=" in words[0] else words[2:]
    recipe, rest = words[0], words[1:]
    assert rest[0] == "--config", command
    # --portable: the configs point at /tmp/<model> downloads and a CUDA device, absent here
    rc = main(["validate", "--portable", *rest[1:], "--recipe", recipe])
    assert rc == 0, f"{config}: `tune run {command}`: {capsys.readouterr().err[-500:]}"


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*/*distributed.yaml")), ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_a_distributed_config_does_not_promise_the_single_device_skip(path):
    # NOTE: distributed recipes normalize by the all-reduced token count at every accumulation
    # (tune_recipes/training/step/normalization.py): a comment promising the skip misleads
    text = path.read_text()
    assert "skips the multiply" not in text, f"{path}: distributed recipes never skip the normalization"
