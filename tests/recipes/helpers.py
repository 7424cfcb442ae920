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


def tune(*args: str, check: bool = True, timeout: int = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    # Two pytest workers share the CI machine's 2 cores: one thread per recipe process, or
    # the workers' thread pools oversubscribe the cores and spin.
    env.setdefault("OMP_NUM_THREADS", "1" if os.environ.get("PYTEST_XDIST_WORKER") else "2")
    proc = subprocess.run([*tune_cmd(), *args], capture_output=True, text=True, env=env,
                          timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"tune {' '.join(args)} exited {proc.returncode}\nSTDOUT:\n{proc.stdout[-4000:]}"
            f"\nSTDERR:\n{proc.stderr[-4000:]}"
        )
    return proc


def run_recipe(recipe: str, config: str, output_dir: Path, overrides: Sequence[str] = (),
               check: bool = True):
    return tune("run", recipe, "--config", config, f"output_dir={output_dir}", *overrides,
                check=check)


def losses(output_dir: Path) -> List[float]:
    return read_metrics(Path(output_dir) / "metrics.jsonl", "loss")


def weights(output_dir: Path, epoch: int = 0, name: str = "model-00001-of-00001.safetensors"
            ) -> Dict[str, torch.Tensor]:
    return load_file(str(Path(output_dir) / f"epoch_{epoch}" / name))


def assert_same_weights(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor], rtol: float, atol: float):
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=rtol, atol=atol, msg=lambda m: f"{k}: {m}")
