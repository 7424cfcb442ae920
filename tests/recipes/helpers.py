"""Run recipes the way users do (`tune run ...` in a subprocess) and read their outputs."""

import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Sequence

import torch
from safetensors.torch import load_file

from tune_recipes.training.metrics import read_metrics


def tune_cmd() -> List[str]:
    exe = Path(sys.executable).parent / "tune"
    # Prefer the installed script (what the README uses); fall back to the module.
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "tune_recipes"]


def _env() -> Dict[str, str]:
    env = dict(os.environ)
    # Two pytest workers share the CI machine's 2 cores: one thread per recipe process, or
    # the workers' thread pools oversubscribe the cores and spin.
    env.setdefault("OMP_NUM_THREADS", "1" if os.environ.get("PYTEST_XDIST_WORKER") else "2")
    return env


def _checked(args, rc: int, stdout: str, stderr: str, check: bool) -> subprocess.CompletedProcess:
    if check and rc != 0:
        raise AssertionError(
            f"tune {' '.join(args)} exited {rc}\nSTDOUT:\n{stdout[-4000:]}"
            f"\nSTDERR:\n{stderr[-4000:]}"
        )
    return subprocess.CompletedProcess(["tune", *args], rc, stdout, stderr)


def tune_subprocess(*args: str, check: bool = True, timeout: int = 600) -> subprocess.CompletedProcess:
    """``tune ARGS`` through the installed script in a fresh interpreter."""
    proc = subprocess.run([*tune_cmd(), *args], capture_output=True, text=True, env=_env(),
                          timeout=timeout)
    return _checked(args, proc.returncode, proc.stdout, proc.stderr, check)


_WARM = None


def tune(*args: str, check: bool = True, timeout: int = 600) -> subprocess.CompletedProcess:
    """``tune ARGS``: the CLI's entry point in a process forked from a warm server (see
    warm_launcher.py; ~6.5 s of imports saved per command), or through the real script when
    TUNE_TESTS_WARM=0."""
    global _WARM
    if os.environ.get("TUNE_TESTS_WARM", "1") == "0":
        return tune_subprocess(*args, check=check, timeout=timeout)
    import tempfile

    from warm_launcher import WarmLauncher

    if _WARM is None:
        _WARM = WarmLauncher()
    with tempfile.TemporaryDirectory(prefix="tune-cmd-") as workdir:
        rc, out, err = _WARM.run(args, _env(), timeout, workdir)
    return _checked(args, rc, out, err, check)


def run_recipe(recipe: str, config: str, output_dir: Path, overrides: Sequence[str] = (),
               check: bool = True):
    return tune("run", recipe, "--config", config, f"output_dir={output_dir}", *overrides,
                check=check)


def run_on_gpu(recipe: str, config: str, output_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    """A tiny config on the GPU in bf16 for 4 steps, checked.
    NOTE: python -m tune_recipes, not the warm test launcher (a forked server and CUDA) or a
    `tune` script (on the GPU machine that may be torchtune's)."""
    cmd = [sys.executable, "-m", "tune_recipes", "run", recipe, "--config", config,
           f"output_dir={output_dir}", "device=cuda", "dtype=bf16", "max_steps_per_epoch=4", *overrides]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    return _checked(cmd[3:], proc.returncode, proc.stdout, proc.stderr, True)


def run_dist(nproc: int, recipe: str, config: str, out: Path, overrides: Sequence[str] = (),
             check: bool = True):
    return tune("run", "--nproc_per_node", str(nproc), recipe, "--config", config,
                f"output_dir={out}", *overrides, check=check)


def assert_runs_agree(reference: Path, *others: Path, steps: int, name: str = "model-00001-of-00001.safetensors"):
    """fp32 CPU runs that must train alike: losses rtol 1e-5, final weights rtol 1e-4 / atol 1e-5."""
    ref = losses(reference)
    assert len(ref) == steps
    for other in others:
        torch.testing.assert_close(torch.tensor(ref), torch.tensor(losses(other)), rtol=1e-5, atol=0)
        assert_same_weights(weights(reference, name=name), weights(other, name=name), rtol=1e-4, atol=1e-5)


def losses(output_dir: Path) -> List[float]:
    return read_metrics(Path(output_dir) / "metrics.jsonl", "loss")


def weights(output_dir: Path, epoch: int = 0, name: str = "model-00001-of-00001.safetensors"
            ) -> Dict[str, torch.Tensor]:
    return load_file(str(Path(output_dir) / f"epoch_{epoch}" / name))


def assert_same_weights(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor], rtol: float, atol: float):
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=rtol, atol=atol, msg=lambda m: f"{k}: {m}")
