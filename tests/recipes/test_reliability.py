"""Reliability end to end: unsafe checkpoints refused, non-finite steps caught.

Tiny full fine-tunes on the CPU; each test states the fault it injects and what must hold.
"""

import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

from helpers import assert_same_weights, losses, run_recipe, tune_cmd, weights
from tune_recipes.training.metrics import read_metrics

pytestmark = pytest.mark.integration
FULL = ("full_finetune_single_device", "tiny/full_single_device")
TWO_EPOCHS = ["max_steps_per_epoch=2", "epochs=2"]


class _RunsCode:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        import os

        return os.system, (f"touch {self.marker}",)


def test_resume_refuses_a_malicious_recipe_state_and_runs_nothing(tmp_path):
    out = tmp_path / "run"
    run_recipe(*FULL, out, TWO_EPOCHS)
    shutil.rmtree(out / "epoch_1")
    marker = tmp_path / "pwned"
    # The epoch folder's own state (what resume reads), then a run without it (older layout:
    # recipe_state/recipe_state.pt).
    for state_path in (out / "epoch_0" / "recipe_state.pt", out / "recipe_state" / "recipe_state.pt"):
        state = torch.load(state_path, weights_only=True)
        state["evil"] = _RunsCode(marker)
        # A new file under the name: the two names are one file (a hard link) until now.
        state_path.unlink()
        torch.save(state, state_path)
        proc = run_recipe(*FULL, out, [*TWO_EPOCHS, "resume_from_checkpoint=True"], check=False)
        assert proc.returncode == 2, proc.stderr[-2000:]
        last = proc.stderr.strip().splitlines()[-1]
        assert str(state_path) in last and "refusing to unpickle" in last, last
        assert "Traceback" not in proc.stderr
        assert not marker.exists()
        if state_path.parent.name == "epoch_0":
            state_path.unlink()


def test_a_huge_lr_stops_at_the_first_nan_step_without_saving(tmp_path):
    """optimizer.lr=1e10 makes the loss NaN within steps: the run stops there, and no NaN
    checkpoint is written."""
    out = tmp_path / "run"
    proc = run_recipe(*FULL, out, ["max_steps_per_epoch=6", "optimizer.lr=1e10"], check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert "non-finite loss or gradient norm at epoch 0, step " in last, last
    assert "Traceback" not in proc.stderr
    assert not (out / "epoch_0").exists()
    # The step it names is the first logged non-finite one.
    rows = read_metrics(out / "metrics.jsonl")
    first_bad = next(r["step"] for r in rows
                     if not all(math.isfinite(float(r[k])) for k in ("loss", "grad_norm")))
    assert f"step {first_bad} (" in last and rows[-1]["step"] == first_bad


def test_skip_drops_nan_steps_counts_them_and_saves_finite_weights(tmp_path):
    out = tmp_path / "run"
    args = ["max_steps_per_epoch=6", "optimizer.lr=1e10", "on_nonfinite=skip", "save_every_n_steps=3"]
    run_recipe(*FULL, out, args)
    rows = read_metrics(out / "metrics.jsonl")
    assert rows[-1]["skipped_steps"] > 0
    assert all(torch.isfinite(v).all() for v in weights(out, 0).values())
    # The running total is checkpointed: a run resumed at step 3 counts on from there.
    killed = tmp_path / "killed"
    _killed_after(out, killed, keep={"step_3"})
    run_recipe(*FULL, killed, [*args, "resume_from_checkpoint=True"])
    assert read_metrics(killed / "metrics.jsonl", "skipped_steps") == [r["skipped_steps"] for r in rows]


# Runs the CLI in-process after wrapping one kind of write: its ``nth`` call writes a partial
# file (or nothing) and the process SIGKILLs itself, as a power cut or the OOM killer would.
_KILL_DURING_WRITE = r'''
import os, signal, sys
import torch
import tune_recipes.training.checkpointing.writer as writer
import torchtune.training.checkpointing._checkpointer as tt
from tune_recipes._cli.main import main

kind, nth, argv = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
calls = [0]

def killing(write):
    def wrapped(*args, **kwargs):
        calls[0] += 1
        if calls[0] == nth:
            if kind != "publish":
                with open(args[1], "wb") as f:
                    f.write(b"half a file")
            os.kill(os.getpid(), signal.SIGKILL)
        return write(*args, **kwargs)
    return wrapped

if kind == "weights":
    tt.save_file = killing(tt.save_file)
elif kind == "state":
    torch.save = killing(torch.save)
else:  # between publishing epoch_<n>/ and replacing recipe_state/recipe_state.pt
    writer.replace_file_atomically = killing(writer.replace_file_atomically)
sys.exit(main(argv))
'''
THREE_EPOCHS = ["max_steps_per_epoch=2", "epochs=3", "lr_scheduler.num_warmup_steps=1"]


@pytest.fixture(scope="module")
def three_epochs(tmp_path_factory):
    out = tmp_path_factory.mktemp("straight")
    run_recipe(*FULL, out, THREE_EPOCHS)
    return out


@pytest.mark.parametrize("kind, resumes_after", [("weights", 0), ("state", 0), ("publish", 1)])
def test_sigkill_during_a_checkpoint_write_resumes_from_the_newest_complete_one(
        tmp_path, three_epochs, kind, resumes_after):
    out = tmp_path / "run"
    args = ["run", *FULL[:1], "--config", FULL[1], f"output_dir={out}", *THREE_EPOCHS]
    # The 2nd write of that kind is epoch 1's save.
    proc = subprocess.run([sys.executable, "-c", _KILL_DURING_WRITE, kind, "2", *args],
                          capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "2"})
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    complete = sorted(p.name for p in out.glob("epoch_*"))
    assert complete == [f"epoch_{i}" for i in range(resumes_after + 1)], complete
    proc = run_recipe(*FULL, out, [*THREE_EPOCHS, "resume_from_checkpoint=True"])
    assert_same_weights(weights(out, 2), weights(three_epochs, 2), rtol=0, atol=0)
    # Every step logged once, with the uninterrupted run's losses exactly.
    assert read_metrics(out / "metrics.jsonl", "step") == list(range(1, 7))
    assert losses(out) == losses(three_epochs)


def test_a_second_run_into_a_busy_output_dir_is_refused(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    # A live process owns it (this test's own pid); a dead one's lock would be taken over.
    (out / ".lock").write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid()}))
    proc = run_recipe(*FULL, out, ["max_steps_per_epoch=1"], check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"is in use by another run (pid {os.getpid()}" in proc.stderr.strip().splitlines()[-1]
    assert not (out / "metrics.jsonl").exists()


def test_a_fresh_run_beside_an_earlier_runs_step_checkpoints_is_refused(tmp_path):
    """A resume takes the newest step_<n>/; a fresh run into a folder holding an older run's
    step_<n>/ would make that the one resumed later. Refused before anything is written, and
    the old checkpoint is left as it was."""
    out = tmp_path / "run"
    (out / "step_7").mkdir(parents=True)
    (out / "step_7" / "recipe_state.pt").write_bytes(b"earlier run")
    proc = run_recipe(*FULL, out, ["max_steps_per_epoch=1"], check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert "step_7" in last and "resume_from_checkpoint=True" in last, last
    assert not (out / "metrics.jsonl").exists()
    assert (out / "step_7" / "recipe_state.pt").read_bytes() == b"earlier run"


def test_ctrl_c_prints_one_line_and_exits_130(tmp_path):
    out = tmp_path / "run"
    cmd = [*tune_cmd(), "run", *FULL[:1], "--config", FULL[1], f"output_dir={out}",
           "max_steps_per_epoch=1", "epochs=200"]
    # NOTE: pytest-xdist workers ignore SIGINT, and an ignored signal stays ignored in their
    # children, where Python then never raises KeyboardInterrupt; restore the default as a
    # terminal would have it.
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "2"},
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.time() + 300
    while not (out / "epoch_0").exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("interrupted at step "), last
    assert f"last checkpoint {out}/epoch_" in last and "resume_from_checkpoint=True" in last, last
    assert not (out / ".lock").exists()


def test_ctrl_c_while_resuming_names_the_checkpoint_it_resumes_from(tmp_path):
    """A run stopped as it resumes has saved nothing itself; its line still names a checkpoint
    to resume from (the one it was resuming), never "no checkpoint saved by this run"."""
    import threading

    out = tmp_path / "run"
    base = [*tune_cmd(), "run", *FULL[:1], "--config", FULL[1], f"output_dir={out}", "max_steps_per_epoch=1"]
    subprocess.run([*base, "epochs=1"], check=True, capture_output=True, timeout=300)
    proc = subprocess.Popen([*base, "epochs=200", "resume_from_checkpoint=True"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "2"},
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    lines, resuming = [], threading.Event()

    def read():
        for line in proc.stderr:
            lines.append(line)
            if "continuing the finished run" in line:
                resuming.set()

    reader = threading.Thread(target=read)
    reader.start()
    assert resuming.wait(300), "".join(lines)[-2000:]
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=120)
    reader.join(timeout=60)
    assert proc.returncode == 130, "".join(lines)[-2000:]
    last = lines[-1].strip()
    assert last.startswith(f"interrupted while resuming from {out}/epoch_0, before its first step; "
                           "resume with: "), last
    assert last.endswith("resume_from_checkpoint=True"), last


# Mid-epoch checkpoints (save_every_n_steps). A kill is simulated by copying a finished run's
# output_dir and deleting everything written after the chosen step_<n>/: what remains is what a
# run killed right after logging its last step would leave (metrics rows after the checkpoint
# included). Resuming must then reproduce the uninterrupted run bit for bit.
def _killed_after(out, killed, keep):
    shutil.copytree(out, killed)
    for path in killed.iterdir():
        if path.is_dir() and path.name.startswith(("epoch_", "step_")) and path.name not in keep:
            shutil.rmtree(path)


def test_mid_epoch_resume_equals_uninterrupted_and_keeps_last_n(tmp_path):
    """GA 1, full fine-tune: a step checkpoint in epoch 1 is newer than epoch_0/ and is the one
    resumed; saving changes nothing (the reference run saves no step checkpoints); each step is
    logged once; keep_last_n_checkpoints=1 left only the newest step folder."""
    steps = ["max_steps_per_epoch=3", "epochs=2", "lr_scheduler.num_warmup_steps=1"]
    saving = [*steps, "save_every_n_steps=2", "keep_last_n_checkpoints=1"]
    ref, out, killed = tmp_path / "ref", tmp_path / "saving", tmp_path / "killed"
    run_recipe(*FULL, ref, steps)
    run_recipe(*FULL, out, saving)
    # Steps 2 and 4 are mid-epoch (3 and 6 end epochs: epoch_<n>/ instead); step_2 was
    # deleted once step_4 was complete.
    assert sorted(p.name for p in out.glob("*_*") if p.is_dir()) == [
        "epoch_0", "epoch_1", "recipe_state", "step_4"]
    state = torch.load(out / "step_4" / "recipe_state.pt", weights_only=True)
    assert state["global_step"] == 4 and state["epochs_run"] == 1 and "optimizer" in state
    assert state["rank_states"][0]["dataloader"]["_num_yielded"] == 1
    _killed_after(out, killed, keep={"epoch_0", "step_4"})
    # Another batch_size would continue on other data (the sampler resumes by sample count):
    # refused in one line naming it, before anything is written.
    before = (killed / "metrics.jsonl").read_bytes()
    proc = run_recipe(*FULL, killed, [*saving, "resume_from_checkpoint=True", "batch_size=4"],
                      check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "batch_size=4 (the checkpoint's: 8)" in proc.stderr.strip().splitlines()[-1]
    assert (killed / "metrics.jsonl").read_bytes() == before
    run_recipe(*FULL, killed, [*saving, "resume_from_checkpoint=True"])
    assert read_metrics(killed / "metrics.jsonl", "step") == list(range(1, 7))
    assert losses(killed) == losses(ref)
    assert_same_weights(weights(killed, 1), weights(ref, 1), rtol=0, atol=0)
    # The same command again, afresh: the finished run's step folder (older than its last
    # epoch) moves aside with its epochs instead of refusing the run.
    run_recipe(*FULL, out, saving)
    kept = [p for p in out.glob("checkpoints.*") if p.is_dir()]
    assert len(kept) == 1 and sorted(p.name for p in kept[0].iterdir()) == [
        "epoch_0", "epoch_1", "recipe_state", "step_4"]


def test_mid_epoch_resume_with_accumulation_dropout_and_an_adapter(tmp_path):
    """GA 4, LoRA with dropout (the resumed run must continue the saved RNG stream): resumed
    in the first epoch from step_1/, which holds the adapter only."""
    recipe = ("lora_finetune_single_device", "tiny/lora_single_device")
    args = ["max_steps_per_epoch=3", "batch_size=2", "gradient_accumulation_steps=4",
            "model.lora_dropout=0.1", "lr_scheduler.num_warmup_steps=1", "save_every_n_steps=1"]
    out, killed = tmp_path / "straight", tmp_path / "killed"
    run_recipe(*recipe, out, args)
    assert sorted(p.name for p in (out / "step_1").iterdir()) == [
        "adapter_config.json", "adapter_model.pt", "adapter_model.safetensors", "config.json",
        "recipe_state.pt"]
    _killed_after(out, killed, keep={"step_1"})
    run_recipe(*recipe, killed, [*args, "resume_from_checkpoint=True"])
    assert read_metrics(killed / "metrics.jsonl", "step") == [1, 2, 3]
    assert losses(killed) == losses(out)
    for name in ("adapter_model.safetensors", "model-00001-of-00001.safetensors"):
        assert_same_weights(weights(killed, 0, name), weights(out, 0, name), rtol=0, atol=0)


def test_a_bad_example_mid_epoch_keeps_the_steps_before_it_and_resumes_exactly_once_fixed(tmp_path):
    """Example 19 of a chat file is refused by the template (two user turns in a row): past the
    examples checked before training, so it stops the run at step 20. The 19 steps before it
    are saved first and the line says so; with the row fixed in place, the same command with
    resume_from_checkpoint=True ends where an uninterrupted run on the fixed file ends."""
    rows = [{"conversations": [{"from": "human", "value": f"say {i}"},
                               {"from": "human" if i == 19 else "gpt", "value": f"ok {i}"}]}
            for i in range(24)]
    data = tmp_path / "rows.json"
    data.write_text(json.dumps(rows))
    args = [f"dataset.data_files={data}", "dataset.source=json",
            "dataset._component_=torchtune.datasets.chat_dataset",
            "dataset.conversation_column=conversations", "dataset.conversation_style=sharegpt",
            "shuffle=False", "batch_size=1", "max_steps_per_epoch=null", "epochs=1"]
    out, ref = tmp_path / "run", tmp_path / "ref"
    proc = run_recipe(*FULL, out, args, check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert "example 19 cannot be made into tokens" in last, last
    assert "The training up to step 19 is saved as step_19/ in output_dir" in last, last
    assert "first saving the training up to step 19" in proc.stderr
    assert "Traceback" not in proc.stderr
    state = torch.load(out / "step_19" / "recipe_state.pt", weights_only=True)
    assert state["global_step"] == 19 and state["rank_states"][0]["dataloader"]["_num_yielded"] == 19
    rows[19]["conversations"][1]["from"] = "gpt"
    data.write_text(json.dumps(rows))
    run_recipe(*FULL, out, [*args, "resume_from_checkpoint=True"])
    run_recipe(*FULL, ref, args)
    assert read_metrics(out / "metrics.jsonl", "step") == list(range(1, 25))
    assert losses(out) == losses(ref)
    assert_same_weights(weights(out, 0), weights(ref, 0), rtol=0, atol=0)


@pytest.mark.parametrize("saved_with,resumed_with,named", [
    (["optimizer._component_=tune_recipes.optim.AdamW8bit"], [],
     "made by optimizer._component_=tune_recipes.optim.AdamW8bit, this run's is torch.optim.AdamW"),
    ([], ["optimizer_in_bwd=True", "clip_grad_norm=null"],
     "saved with optimizer_in_bwd=False, this run has optimizer_in_bwd=True"),
    (["optimizer_in_bwd=True", "clip_grad_norm=null"], [],
     "saved with optimizer_in_bwd=True, this run has optimizer_in_bwd=False"),
])
def test_a_resume_with_another_optimizer_is_refused_by_name_and_keeps_the_runs_record(
        tmp_path, saved_with, resumed_with, named):
    out = tmp_path / "run"
    run_recipe(*FULL, out, [*TWO_EPOCHS, *saved_with])
    shutil.rmtree(out / "epoch_1")
    recorded = (out / "config.yaml").read_text()
    proc = run_recipe(*FULL, out, [*TWO_EPOCHS, *resumed_with, "resume_from_checkpoint=True"],
                      check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert named in last and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    # nothing the first run wrote is replaced: its config (what the checkpoint needs) and weights
    assert (out / "config.yaml").read_text() == recorded and not (out / "config.1.yaml").exists()
    assert (out / "epoch_0" / "model-00001-of-00001.safetensors").is_file()


@pytest.mark.integration
def test_a_resume_with_another_lora_rank_is_one_line_naming_the_key(tmp_path):
    # The adapter's tensors are of the checkpoint's rank: torch's size-mismatch list would be a
    # traceback on every rank; the line names the first tensor and model.lora_rank.
    lora = ("lora_finetune_single_device", "tiny/lora_single_device")
    out = tmp_path / "run"
    run_recipe(*lora, out, TWO_EPOCHS)
    shutil.rmtree(out / "epoch_1")
    proc = run_recipe(*lora, out, [*TWO_EPOCHS, "model.lora_rank=4", "resume_from_checkpoint=True"],
                      check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert "the adapter being resumed does not fit this run's LoRA settings (layers.0." in last
    assert "in the checkpoint" in last and "model.lora_rank" in last, last
    assert (out / "epoch_0" / "adapter_model.safetensors").is_file()
    # Another lora_alpha fits every shape but scales the adapter otherwise: refused alike.
    proc = run_recipe(*lora, out, [*TWO_EPOCHS, "model.lora_alpha=64", "resume_from_checkpoint=True"],
                      check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert "does not fit this run's LoRA settings (lora_alpha is " in last
    assert "64 in this run's config" in last, last
    # A finished run continued with more epochs is checked alike.
    done = tmp_path / "done"
    run_recipe(*lora, done, ["max_steps_per_epoch=2", "epochs=1"])
    proc = run_recipe(*lora, done, [*TWO_EPOCHS, "model.lora_alpha=64", "resume_from_checkpoint=True"],
                      check=False)
    assert proc.returncode == 2 and "(lora_alpha is " in proc.stderr, proc.stderr[-2000:]


def test_a_resume_by_the_other_kind_of_recipe_names_the_writer_and_keeps_the_folder(tmp_path):
    """A LoRA run's mid-epoch folder (adapter only) resumed by the full fine-tune, and a full
    run's resumed by the LoRA recipe: one line saying another kind of recipe wrote it, never
    advice to remove a complete checkpoint."""
    lora = ("lora_finetune_single_device", "tiny/lora_single_device")
    for writer, reader, holds in ((lora, FULL, "a LoRA adapter"),
                                  (FULL, lora, "model weights and no LoRA adapter")):
        out = tmp_path / writer[0]
        run_recipe(*writer, out, ["max_steps_per_epoch=4", "save_every_n_steps=2", "epochs=2"])
        shutil.rmtree(out / "epoch_1")  # resume mid-run, from the checkpoints before it
        proc = run_recipe(*reader, out, ["max_steps_per_epoch=4", "epochs=2",
                                         "resume_from_checkpoint=True"], check=False)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
        last = proc.stderr.strip().splitlines()[-1]
        assert f"with this recipe: it holds {holds}" in last and "remove" not in last, last
        assert sorted(p.name for p in out.glob("epoch_*")) == ["epoch_0"]


def test_a_resume_by_another_kind_of_training_with_alike_files_is_refused(tmp_path):
    """A full run's checkpoint resumed by QAT, a LoRA run's by distillation: the files fit, so
    only the recorded kind of training tells; one line naming both, the folder kept."""
    lora = ("lora_finetune_single_device", "tiny/lora_single_device")
    for writer, reader, said in (
            (FULL, ("qat_single_device", "tiny/qat_single_device"),
             "was written by a full fine-tune (full_finetune_*), and this config runs "
             "quantization-aware training"),
            (lora, ("knowledge_distillation_single_device", "tiny/kd_single_device"),
             "was written by a LoRA-type fine-tune (lora_finetune_*), and this config runs "
             "knowledge distillation")):
        out = tmp_path / writer[0]
        run_recipe(*writer, out, TWO_EPOCHS)
        shutil.rmtree(out / "epoch_1")
        proc = run_recipe(*reader, out, [*TWO_EPOCHS, "resume_from_checkpoint=True"], check=False)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
        last = proc.stderr.strip().splitlines()[-1]
        assert said in last and "start a new run from its weights" in last, last
        assert sorted(p.name for p in out.glob("epoch_*")) == ["epoch_0"]


@pytest.mark.integration
def test_a_resumed_checkpoints_file_cut_short_is_named_with_its_folder(tmp_path):
    # The line names the folder being resumed (not the base checkpoint_dir) and the way on.
    out = tmp_path / "run"
    run_recipe(*FULL, out, TWO_EPOCHS)
    shutil.rmtree(out / "epoch_1")
    weights_file = out / "epoch_0" / "model-00001-of-00001.safetensors"
    weights_file.write_bytes(weights_file.read_bytes()[:1000])
    proc = run_recipe(*FULL, out, [*TWO_EPOCHS, "resume_from_checkpoint=True"], check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert f"could not load the checkpoint being resumed, {out / 'epoch_0'}:" in last, last
    assert f"remove {out / 'epoch_0'} to resume from the checkpoint before it" in last, last
