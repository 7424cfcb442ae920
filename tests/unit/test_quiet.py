"""Third-party notices we cannot act on stay out of `tune`'s output (tune_recipes/_cli/quiet.py);
our own messages stay in."""

import os
import subprocess
import sys

import pytest

NOISE = (
    "Skipping import of cpp extensions",  # torchao, at import
    "set_vital",                          # torchdata's StatefulDataLoader, every run
    "Setting manual seed",                # torchtune's set_seed debug line, every run
    "_stable_hash_for_caching",           # torch, compiling torchao's 8-bit optimizer update
)


def _tune(*args, verbose=False, tmp_path=None):
    env = dict(os.environ, OMP_NUM_THREADS="2")
    env.pop("TUNE_RECIPES_VERBOSE", None)
    if verbose:
        env["TUNE_RECIPES_VERBOSE"] = "1"
    proc = subprocess.run([sys.executable, "-m", "tune_recipes", *args], capture_output=True,
                          text=True, env=env, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def _assert_quiet(output):
    for noise in NOISE:
        assert noise not in output, f"{noise!r} printed:\n{output[-3000:]}"


@pytest.mark.unit
def test_ls_and_validate_print_only_ours():
    out = _tune("ls")
    _assert_quiet(out)
    assert out.startswith("RECIPE")
    _assert_quiet(_tune("validate", "tiny/lora_single_device"))


@pytest.mark.unit
def test_ls_all_listing_is_clean_and_verbose_brings_the_notices_back():
    out = _tune("ls", "--all")
    _assert_quiet(out)
    assert "torchtune 0.6.1 stock recipes" in out
    # The filter is what keeps it out: with TUNE_RECIPES_VERBOSE=1 torchao's notice is back
    # (on a torch that torchao 0.15.0 was not built for, which is every torch we support).
    verbose = _tune("ls", "--all", verbose=True)
    assert "Skipping import of cpp extensions" in verbose


@pytest.mark.integration
def test_a_run_prints_no_third_party_noise(tmp_path):
    out = _tune("run", "full_finetune_single_device", "--config", "tiny/full_single_device",
                "max_steps_per_epoch=2", f"output_dir={tmp_path / 'run'}", tmp_path=tmp_path)
    _assert_quiet(out)
    # torchtune's INFO lines (where the checkpoint went) are ours to keep.
    assert "saved to" in out and (tmp_path / "run" / "epoch_0").is_dir()


@pytest.mark.unit
def test_the_8bit_optimizer_compile_notice_is_dropped_and_verbose_brings_it_back():
    """torch warns once per process while compiling torchao's AdamW8bit update (the 3B and 8B
    full configs' optimizer): the notice, as torch words it, stays out unless verbose."""
    code = ("import tune_recipes, warnings; warnings.warn('OptimState8bit does not implement "
            "_stable_hash_for_caching(self) -> str for stable AOT autograd caching.')")
    for verbose, shown in ((False, False), (True, True)):
        env = dict(os.environ)
        env.pop("TUNE_RECIPES_VERBOSE", None)
        if verbose:
            env["TUNE_RECIPES_VERBOSE"] = "1"
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
        assert proc.returncode == 0 and ("_stable_hash_for_caching" in proc.stderr) == shown, proc.stderr


@pytest.mark.unit
def test_torchtune_info_prints_once_a_torchrun_launch_its_warnings_on_every_rank():
    """torchtune's INFO lines ("Loading the recipe state using: ...") repeat in every process
    of a torchrun launch: only the first process's print; any rank's warning still prints."""
    code = ("import tune_recipes; from torchtune.utils import get_logger; log = get_logger('INFO'); "
            "log.info('an info line'); log.warning('a warning line')")
    for rank_env, info_shown in (({}, True), ({"TORCHELASTIC_RUN_ID": "r", "RANK": "0"}, True),
                                 ({"TORCHELASTIC_RUN_ID": "r", "RANK": "1"}, False)):
        env = {k: v for k, v in os.environ.items()
               if k not in ("TUNE_RECIPES_VERBOSE", "TORCHELASTIC_RUN_ID", "RANK")}
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              env={**env, **rank_env}, timeout=300)
        assert proc.returncode == 0, proc.stderr
        assert ("an info line" in proc.stderr) == info_shown, (rank_env, proc.stderr)
        assert "a warning line" in proc.stderr, (rank_env, proc.stderr)
