"""Resuming a finished run: with more epochs it continues from its final weights; with no
more, it trains nothing (what a torchrun restart after the final save needs with
resume_from_checkpoint=auto).

The final epoch_<e>/ holds no optimizer state (only an unfinished run's checkpoints do), so
the continued run's optimizer starts from fresh state: without an LR schedule, the first
continued step's loss (computed before its update) equals that step of a run that trained
all epochs at once (same weights, same data order, which depends on seed and epoch only);
the next one differs, because AdamW's moments restarted.
"""

import pytest

from helpers import assert_same_weights, losses, run_recipe, weights
from tune_recipes.training.metrics import read_metrics

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("recipe, config, name", [
    ("full_finetune_single_device", "tiny/full_single_device", "model-00001-of-00001.safetensors"),
    ("lora_finetune_single_device", "tiny/lora_single_device", "adapter_model.safetensors"),
])
def test_a_finished_run_continues_with_more_epochs(tmp_path, recipe, config, name):
    args = ["max_steps_per_epoch=2", "~lr_scheduler"]
    run_recipe(recipe, config, tmp_path / "straight", [*args, "epochs=2"])
    out = tmp_path / "extended"
    run_recipe(recipe, config, out, [*args, "epochs=1"])
    before = weights(out, 0, name=name)
    proc = run_recipe(recipe, config, out, [*args, "epochs=2", "resume_from_checkpoint=True"])
    assert "continuing the finished run" in proc.stderr and "no optimizer state" in proc.stderr
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl") if "loss" in r] == [1, 2, 3, 4]
    assert_same_weights(weights(out, 0, name=name), before, rtol=0, atol=0)  # untouched
    straight, extended = losses(tmp_path / "straight"), losses(out)
    assert extended[:3] == straight[:3]
    assert extended[3] != straight[3]  # the optimizer state restarted at step 3
    assert (out / "epoch_1" / name).is_file()


def test_a_finished_one_epoch_run_continues_with_its_own_steps_per_epoch_and_seed(tmp_path):
    """A one-epoch run keeps no recipe_state.pt; its final folder records seed and steps per
    epoch, which win over a config that changed them: the step count continues (no metrics
    row is cut), and the data order is the run's own."""
    args = ["~lr_scheduler"]
    run_recipe("full_finetune_single_device", "tiny/full_single_device", tmp_path / "straight",
               [*args, "epochs=2", "max_steps_per_epoch=3"])
    out = tmp_path / "extended"
    run_recipe("full_finetune_single_device", "tiny/full_single_device", out,
               [*args, "epochs=1", "max_steps_per_epoch=3"])
    proc = run_recipe("full_finetune_single_device", "tiny/full_single_device", out,
                      [*args, "epochs=2", "max_steps_per_epoch=2", "seed=7",
                       "resume_from_checkpoint=True"])
    lines = proc.stderr.splitlines()
    assert "warning: config seed=7 differs from the checkpoint's 0; using the checkpoint's" in lines
    assert ("warning: config max_steps_per_epoch=2 differs from the checkpoint's 3; using the "
            "checkpoint's") in lines
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl") if "loss" in r] == [1, 2, 3, 4, 5, 6]
    # Same weights, same data order: the first continued step's loss (before its update).
    assert losses(out)[3] == losses(tmp_path / "straight")[3]


def test_auto_on_a_finished_run_with_no_more_epochs_trains_nothing(tmp_path):
    args = ["max_steps_per_epoch=2", "epochs=1"]
    run_recipe("full_finetune_single_device", "tiny/full_single_device", tmp_path, args)
    before = weights(tmp_path)
    files = {p.relative_to(tmp_path): (p.stat().st_mtime_ns, p.read_bytes())
             for p in tmp_path.rglob("*") if p.is_file()}
    proc = run_recipe("full_finetune_single_device", "tiny/full_single_device", tmp_path,
                      [*args, "resume_from_checkpoint=auto"])
    assert proc.returncode == 0
    assert proc.stderr.strip().splitlines()[-1].startswith(
        f"{tmp_path} holds a finished run (1 epoch(s), final checkpoint epoch_0/): nothing to train")
    # It ends there: no file written, rewritten (config.yaml, metrics.png) or added.
    assert {p.relative_to(tmp_path): (p.stat().st_mtime_ns, p.read_bytes())
            for p in tmp_path.rglob("*") if p.is_file()} == files
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl") if "loss" in r] == [1, 2]
    assert_same_weights(weights(tmp_path), before, rtol=0, atol=0)


def test_resuming_an_unfinished_run_with_no_epochs_left_is_refused_before_anything_is_written(tmp_path):
    """A run stopped after epoch 2 of 3 (its final folder gone, as if the run died saving it),
    resumed with epochs=2: nothing is left to train, and the resume says so naming the
    checkpoint and the epochs it was written for, before config.yaml or the metrics are
    rewritten (a quiet exit here would look like a finished run), and before the weights are
    read: the checkpoint's weights are cut short here, and the refusal is still the epochs one."""
    import shutil

    args = ["max_steps_per_epoch=2", "~lr_scheduler"]
    run_recipe("full_finetune_single_device", "tiny/full_single_device", tmp_path, [*args, "epochs=3"])
    shutil.rmtree(tmp_path / "epoch_2")
    (weights_file,) = (tmp_path / "epoch_1").glob("*.safetensors")
    whole = weights_file.read_bytes()
    weights_file.write_bytes(whole[:64])
    files = {p.relative_to(tmp_path): p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    proc = run_recipe("full_finetune_single_device", "tiny/full_single_device", tmp_path,
                      [*args, "epochs=2", "resume_from_checkpoint=True"], check=False)
    assert proc.returncode != 0
    assert (f"epochs=2: the checkpoint being resumed, {tmp_path / 'epoch_1'}, is after epoch 2 of the 3 "
            "it was written for, so nothing is left to train from there: resume with epochs=3") in proc.stderr, proc.stderr
    assert {p.relative_to(tmp_path): p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == files
    weights_file.write_bytes(whole)
    proc = run_recipe("full_finetune_single_device", "tiny/full_single_device", tmp_path,
                      [*args, "epochs=3", "resume_from_checkpoint=True"])
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl") if "loss" in r] == [1, 2, 3, 4, 5, 6]
