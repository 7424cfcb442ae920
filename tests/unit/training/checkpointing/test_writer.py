"""tune_recipes.training.checkpointing.writer: every recipe's save_checkpoint (one device here;
the distributed path runs in tests/recipes)."""

import json
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from torchtune import training

from tune_recipes.models.tiny import lora_tiny_llama3, tiny_llama3
from tune_recipes.training.checkpointing.io import LoRASpec
from tune_recipes.training.checkpointing.state import RecipeState
from tune_recipes.training.checkpointing.writer import CheckpointWriter

pytestmark = pytest.mark.unit


class _Checkpointer:
    """Writes like torchtune's checkpointers: everything under ``_output_dir``."""

    def __init__(self, output_dir, fail_with=None):
        self._output_dir = Path(output_dir)
        self.saved = []
        self.fail_with = fail_with

    def save_checkpoint(self, ckpt, epoch, intermediate_checkpoint, adapter_only):
        self.saved.append((dict(ckpt), epoch, intermediate_checkpoint, adapter_only))
        d = self._output_dir / f"epoch_{epoch}"
        d.mkdir(parents=True, exist_ok=True)
        (d / "model.safetensors").write_bytes(b"half")
        if self.fail_with is not None:
            raise self.fail_with
        (d / "model.safetensors").write_bytes(b"weights %d" % epoch)
        if training.ADAPTER_CONFIG in ckpt:
            (d / "adapter_config.json").write_text("{}")
        if intermediate_checkpoint:
            # as torchtune's: the state dict loses its weights and adapter entries here
            for key in (training.MODEL_KEY, training.ADAPTER_KEY, training.ADAPTER_CONFIG):
                ckpt.pop(key, None)
            (self._output_dir / "recipe_state").mkdir(exist_ok=True)
            torch.save({training.EPOCHS_KEY: ckpt[training.EPOCHS_KEY]},
                       self._output_dir / "recipe_state" / "recipe_state.pt")


def _lora_model():
    torch.manual_seed(0)
    model = lora_tiny_llama3(["q_proj", "v_proj"], lora_rank=4, lora_alpha=8)
    for n, p in model.named_parameters():
        if "lora_b" in n:
            torch.nn.init.normal_(p)  # a nonzero delta, so a merge into live weights would show
    return model


def _spec():
    return LoRASpec.from_model_config(OmegaConf.create(
        {"_component_": "x", "lora_rank": 4, "lora_alpha": 8, "lora_attn_modules": ["q_proj", "v_proj"]}))


def test_lora_save_never_writes_the_merge_into_the_live_weights(tmp_path):
    model = _lora_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    (tmp_path / "epoch_0").mkdir()
    (tmp_path / "epoch_0" / "adapter_config.json").write_text("{}")
    ckpt = _Checkpointer(tmp_path)
    writer = CheckpointWriter(ckpt, output_dir=str(tmp_path), lora=_spec(), base_checkpoint_dir="/base")
    writer.save(model, torch.optim.SGD(model.parameters(), lr=0.1),
                RecipeState(seed=0, total_epochs=1, max_steps_per_epoch=None, epochs_run=1), epoch=0)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    saved, epoch, intermediate, adapter_only = ckpt.saved[0]
    assert (epoch, intermediate, adapter_only) == (0, False, False)
    assert training.ADAPTER_KEY in saved and training.MODEL_KEY in saved
    assert training.OPT_KEY not in saved  # the last epoch keeps no optimizer state
    q = "layers.0.attn.q_proj.weight"
    assert not torch.equal(saved[training.MODEL_KEY][q], before[q])  # the merge happened
    assert json.loads((tmp_path / "epoch_0" / "adapter_config.json").read_text()) == {
        "base_model_name_or_path": "/base", "task_type": "CAUSAL_LM"}


def test_intermediate_full_save_carries_state_and_optimizer(tmp_path):
    torch.manual_seed(0)
    model = tiny_llama3()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ckpt = _Checkpointer(tmp_path)
    state = RecipeState(seed=3, total_epochs=2, max_steps_per_epoch=None, epochs_run=1)
    CheckpointWriter(ckpt, output_dir=str(tmp_path)).save(model, opt, state, epoch=0)
    saved, epoch, intermediate, adapter_only = ckpt.saved[0]
    assert (epoch, intermediate, adapter_only) == (0, True, False)
    assert saved[training.EPOCHS_KEY] == 1 and saved[training.SEED_KEY] == 3
    assert saved[training.OPT_KEY] == opt.state_dict()
    assert saved[training.MODEL_KEY].keys() == model.state_dict().keys()
    assert training.ADAPTER_KEY not in saved


def test_nan_weights_are_never_written(tmp_path):
    from tune_recipes.training.checkpointing.writer import CheckpointWriter
    from tune_recipes.training.step.nonfinite import NonFiniteError

    class _Never:
        def save_checkpoint(self, *a, **k):
            raise AssertionError("a NaN checkpoint was written")

    model = torch.nn.Linear(2, 2)
    with torch.no_grad():
        model.weight[0, 0] = float("nan")
    writer = CheckpointWriter(_Never(), output_dir=str(tmp_path))
    state = RecipeState(seed=0, total_epochs=1, max_steps_per_epoch=None)
    with pytest.raises(NonFiniteError, match="epoch 0 hold NaN/inf.*weight"):
        writer.save(model, torch.optim.SGD(model.parameters(), lr=1), state, epoch=0)



def test_saves_are_published_whole_with_their_state(tmp_path):
    torch.manual_seed(0)
    model = tiny_llama3()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    writer = CheckpointWriter(_Checkpointer(tmp_path), output_dir=str(tmp_path))
    for epoch in (0, 1):
        state = RecipeState(seed=3, total_epochs=3, max_steps_per_epoch=None, epochs_run=epoch + 1)
        writer.save(model, opt, state, epoch=epoch)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["epoch_0", "epoch_1", "recipe_state"]
    assert torch.load(tmp_path / "epoch_1" / "recipe_state.pt")[training.EPOCHS_KEY] == 2
    assert torch.load(tmp_path / "recipe_state" / "recipe_state.pt")[training.EPOCHS_KEY] == 2


@pytest.mark.parametrize("error", [OSError(28, "No space left on device", "/out/model.safetensors"),
                                   PermissionError(13, "Permission denied", "/out/x")])
def test_a_failed_save_names_the_path_and_keeps_earlier_checkpoints(tmp_path, error):
    from tune_recipes.training.checkpointing.io import CheckpointError

    torch.manual_seed(0)
    model = tiny_llama3()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ckpt = _Checkpointer(tmp_path)
    writer = CheckpointWriter(ckpt, output_dir=str(tmp_path))
    writer.save(model, opt, RecipeState(seed=3, total_epochs=3, max_steps_per_epoch=None,
                                        epochs_run=1), epoch=0)
    before = {p.relative_to(tmp_path): p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    ckpt.fail_with = error
    # A full disk says how much space is left; another failure does not.
    free = "; [0-9.]+ MiB free on that disk" if error.errno == 28 else ""
    with pytest.raises(CheckpointError, match=f"{error.strerror} \\({error.filename}{free}\\).*intact"):
        writer.save(model, opt, RecipeState(seed=3, total_epochs=3, max_steps_per_epoch=None,
                                            epochs_run=2), epoch=1)
    after = {p.relative_to(tmp_path): p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()
             and ".saving" not in p.parts}
    assert after == before


def test_step_checkpoints_keep_the_last_n_and_delete_only_after_a_newer_one_is_complete(tmp_path):
    from tune_recipes.training.checkpointing.io import CheckpointError
    from tune_recipes.training.step.driver import Position

    model = tiny_llama3()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = RecipeState(seed=3, total_epochs=1, max_steps_per_epoch=None)
    ckpt = _Checkpointer(tmp_path)
    writer = CheckpointWriter(ckpt, output_dir=str(tmp_path), keep_last_n_checkpoints=2)
    for step in (2, 4, 6):
        writer.save(model, opt, state, epoch=0, position=Position(step, [{"dataloader": {}}]))
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_4", "step_6"]
    saved, epoch, intermediate, _ = ckpt.saved[-1]
    assert intermediate and saved["global_step"] == 6 and saved["rank_states"] == [{"dataloader": {}}]
    assert torch.load(tmp_path / "step_6" / "recipe_state.pt", weights_only=True)[training.EPOCHS_KEY] == 0
    # Only epoch checkpoints update the shared recipe_state/ (the state after an epoch).
    assert not (tmp_path / "recipe_state").exists()
    # A save that fails deletes nothing: both older step folders stay, the new one never appears.
    ckpt.fail_with = OSError(28, "No space left on device")
    with pytest.raises(CheckpointError, match="cannot write the step 8 checkpoint: No space left"):
        writer.save(model, opt, state, epoch=0, position=Position(8, [{}]))
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_4", "step_6"]
    with pytest.raises(ValueError, match="keep_last_n_checkpoints must be a positive int"):
        CheckpointWriter(ckpt, output_dir=str(tmp_path), keep_last_n_checkpoints=0)


def test_a_lora_step_checkpoint_holds_the_adapter_only(tmp_path):
    from tune_recipes.training.step.driver import Position

    model = _lora_model()
    ckpt = _Checkpointer(tmp_path)
    writer = CheckpointWriter(ckpt, output_dir=str(tmp_path), lora=_spec(), base_checkpoint_dir="/b")
    writer.save(model, torch.optim.SGD(model.parameters(), lr=0.1),
                RecipeState(seed=3, total_epochs=1, max_steps_per_epoch=None), epoch=0,
                position=Position(1, [{}]))
    saved, _, _, adapter_only = ckpt.saved[-1]
    assert adapter_only and training.ADAPTER_KEY in saved and training.MODEL_KEY not in saved
    assert (tmp_path / "step_1" / "adapter_config.json").is_file()


class _LoggingCheckpointer(_Checkpointer):
    """Also logs what it wrote, as torchtune's checkpointers do (under the staging folder)."""

    def save_checkpoint(self, ckpt, epoch, intermediate_checkpoint, adapter_only):
        from torchtune.utils import get_logger

        super().save_checkpoint(ckpt, epoch, intermediate_checkpoint, adapter_only)
        log = get_logger("INFO")
        for f in ("model.safetensors", "adapter_config.json"):
            log.info(f"Adapter checkpoint of size 0.00 GiB saved to {self._output_dir / f'epoch_{epoch}' / f}")
        log.warning("a torchtune warning")


def test_the_save_line_names_each_file_where_it_ends_up(tmp_path, capsys, caplog):
    model = _lora_model()
    ckpt = _LoggingCheckpointer(tmp_path)
    writer = CheckpointWriter(ckpt, output_dir=str(tmp_path), lora=_spec(), base_checkpoint_dir="/b")
    with caplog.at_level("INFO"):
        writer.save(model, torch.optim.SGD(model.parameters(), lr=0.1),
                    RecipeState(seed=3, total_epochs=1, max_steps_per_epoch=None), epoch=0)
    # torchtune's lines name the staging folder, gone after the save: dropped; its warnings stay.
    logged = [r.getMessage() for r in caplog.records]
    assert logged == ["a torchtune warning"], logged
    err = capsys.readouterr().err
    size = (tmp_path / "epoch_0" / "adapter_config.json").stat().st_size
    record = (tmp_path / "epoch_0" / "finished_run.json").stat().st_size
    # Largest first.
    listing = sorted([("finished_run.json", record), ("adapter_config.json", size),
                      ("model.safetensors", 9)], key=lambda f: (-f[1], f[0]))
    assert err == (f"epoch 0 checkpoint saved to {tmp_path / 'epoch_0'}: "
                   + ", ".join(f"{name} ({n} B)" for name, n in listing) + "\n"), err
    # The final epoch records what a continuation keeps (it has no recipe_state.pt).
    assert json.loads((tmp_path / "epoch_0" / "finished_run.json").read_text()) == {
        "seed": 3, "max_steps_per_epoch": None, "epochs_run": 1}
    # Later INFO lines (not a save) print again.
    from torchtune.utils import get_logger

    with caplog.at_level("INFO"):
        get_logger("INFO").info("after the save")
    assert "after the save" in caplog.text


def test_a_full_disk_reported_by_safetensors_is_one_line_and_frees_the_staging_folder(tmp_path):
    # safetensors raises its own SafetensorError for ENOSPC, not an OSError.
    from safetensors import SafetensorError

    from tune_recipes.training.checkpointing.io import CheckpointError

    model = tiny_llama3()
    ckpt = _Checkpointer(tmp_path, fail_with=SafetensorError(
        "Error while serializing: I/O error: No space left on device (os error 28)"))
    writer = CheckpointWriter(ckpt, output_dir=str(tmp_path))
    with pytest.raises(CheckpointError, match=r"cannot write the epoch 0 checkpoint: .*No space "
                                              r"left on device.*\.saving; [0-9.]+ MiB free on that disk\); earlier checkpoints"):
        writer.save(model, torch.optim.SGD(model.parameters(), lr=0.1),
                    RecipeState(seed=3, total_epochs=1, max_steps_per_epoch=None), epoch=0)
    assert not (tmp_path / ".saving").exists()  # the partial files are gone


@pytest.mark.parametrize("message", [
    "[enforce fail at inline_container.cc:672] . unexpected pos 6345152 vs 6345044",  # a large file
    "basic_ios::clear: iostream error"])  # a small one
def test_a_full_disk_reported_by_torch_save_is_one_line_and_frees_the_staging_folder(tmp_path, message):
    # torch.save's zip writer raises RuntimeError for a failed write (both messages are what it
    # raises on a full disk); a RuntimeError of anything else is not a write failure and goes
    # through unchanged.
    import re

    from tune_recipes.training.checkpointing.io import CheckpointError

    model = tiny_llama3()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = RecipeState(seed=3, total_epochs=1, max_steps_per_epoch=None)
    ckpt = _Checkpointer(tmp_path, fail_with=RuntimeError(message))
    writer = CheckpointWriter(ckpt, output_dir=str(tmp_path))
    with pytest.raises(CheckpointError, match=rf"cannot write the epoch 0 checkpoint: {re.escape(message)} "
                                              r"\(.*\.saving; [0-9.]+ MiB free on that disk\); "
                                              r"earlier checkpoints"):
        writer.save(model, opt, state, epoch=0)
    assert not (tmp_path / ".saving").exists()
    ckpt.fail_with = RuntimeError("CUDA error: an illegal memory access was encountered")
    with pytest.raises(RuntimeError, match="illegal memory access") as e:
        writer.save(model, opt, state, epoch=0)
    assert not isinstance(e.value, CheckpointError)


def test_an_interrupt_right_after_the_rename_still_reports_the_checkpoint(tmp_path, monkeypatch):
    """A Ctrl-C landing between the folder's rename into place and its record must not print
    "no checkpoint saved" beside a complete checkpoint."""
    from tune_recipes.training.checkpointing import writer as writer_module
    from tune_recipes.training.reporting import run_status

    real_publish = writer_module.publish_dir

    def publish_then_interrupt(*args):
        real_publish(*args)
        raise KeyboardInterrupt

    monkeypatch.setattr(writer_module, "publish_dir", publish_then_interrupt)
    monkeypatch.setattr(run_status, "_status", {"step": 0, "checkpoint": None, "publishing": None})
    model = tiny_llama3()
    state = RecipeState(seed=0, total_epochs=2, max_steps_per_epoch=None, epochs_run=1)
    with pytest.raises(KeyboardInterrupt):
        CheckpointWriter(_Checkpointer(tmp_path), output_dir=str(tmp_path)).save(
            model, torch.optim.SGD(model.parameters(), lr=0.1), state, epoch=0)
    assert (tmp_path / "epoch_0" / "model.safetensors").exists()
    assert run_status.last_checkpoint() == str(tmp_path / "epoch_0")


@pytest.mark.parametrize("total_epochs,final", [(2, False), (1, True)])
def test_the_final_checkpoint_leaves_nothing_to_resume_in_the_interrupt_line(tmp_path, monkeypatch,
                                                                             total_epochs, final):
    """The writer tells the run's status whether a checkpoint is the run's last (it carries
    finished_run.json): a Ctrl-C after it has nothing to resume; after any other, a resume."""
    from tune_recipes.training.reporting import run_status

    monkeypatch.setattr(run_status, "_status", {})
    run_status.reset()
    model = tiny_llama3()
    state = RecipeState(seed=0, total_epochs=total_epochs, max_steps_per_epoch=None, epochs_run=1)
    CheckpointWriter(_Checkpointer(tmp_path), output_dir=str(tmp_path)).save(
        model, torch.optim.SGD(model.parameters(), lr=0.1), state, epoch=0)
    assert (tmp_path / "epoch_0" / "finished_run.json").exists() == final
    line = run_status.interrupted_message("r/full.py", [])
    assert ("nothing to resume" in line) == final and ("resume with:" in line) != final, line


def test_checkpoint_files_get_the_permissions_the_umask_allows(tmp_path):
    """safetensors writes through a private temporary file (0600): the weights of a checkpoint
    end up readable as every other file of it is (0644 under umask 022; 0640 under 027)."""
    import os
    import stat

    from tune_recipes.training.checkpointing.writer import readable_as_umask_allows

    (tmp_path / "sub").mkdir()
    files = [tmp_path / "model.safetensors", tmp_path / "sub" / "x.json"]
    for f in files:
        f.write_bytes(b"x")
        f.chmod(0o600)
    old = os.umask(0o027)
    try:
        readable_as_umask_allows(tmp_path)
        assert [stat.S_IMODE(f.stat().st_mode) for f in files] == [0o640, 0o640]
        os.umask(0o022)
        readable_as_umask_allows(tmp_path)
        assert [stat.S_IMODE(f.stat().st_mode) for f in files] == [0o644, 0o644]
    finally:
        os.umask(old)


def test_a_distributed_save_writes_no_all_gather_padding(tmp_path, monkeypatch):
    """Gathered FSDP shards of a dimension the ranks do not divide evenly come back as views of
    the padded all-gather buffer; torch.save (the adapter's .pt, the optimizer state) would write
    each view's whole storage. What reaches the checkpointer owns storage of its own size, with
    the same values."""
    from tune_recipes.training.checkpointing import writer as writer_module

    def padded(t):  # t's values at the front of a storage 1/8 larger, as FSDP's gather leaves
        buffer = torch.zeros(t.numel() + t.numel() // 8, dtype=t.dtype)
        buffer[:t.numel()] = t.reshape(-1)
        return buffer[:t.numel()].view(t.shape)

    model = _lora_model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.zeros(1, 4, dtype=torch.long)).sum().backward()
    opt.step()
    monkeypatch.setattr(writer_module.training, "gather_cpu_state_dict",
                        lambda m, is_main, device=None, adapter_weights_only=False:
                        {k: padded(v.detach()) for k, v in m.state_dict().items()})
    monkeypatch.setattr(writer_module.training, "get_full_optimizer_state_dict",
                        lambda m, o, is_main, device=None: {
                            "state": {i: {k: padded(v) if v.dim() else v for k, v in s.items()}
                                      for i, s in o.state_dict()["state"].items()},
                            "param_groups": o.state_dict()["param_groups"]})
    monkeypatch.setattr(writer_module.dist, "barrier", lambda: None)
    ckpt = _Checkpointer(tmp_path)
    CheckpointWriter(ckpt, output_dir=str(tmp_path), lora=_spec(), base_checkpoint_dir="/b",
                     distributed=True).save(
        model, opt, RecipeState(seed=0, total_epochs=2, max_steps_per_epoch=None, epochs_run=1),
        epoch=0)
    saved = ckpt.saved[0][0]
    tensors = [*saved[training.ADAPTER_KEY].values(),
               *(v for s in saved[training.OPT_KEY]["state"].values() for v in s.values())]
    assert len(tensors) > 4
    for t in tensors:
        assert t.untyped_storage().nbytes() == t.numel() * t.element_size()
    for k, v in saved[training.ADAPTER_KEY].items():
        assert torch.equal(v, model.state_dict()[k]), k
    exp_avg = next(iter(saved[training.OPT_KEY]["state"].values()))["exp_avg"]
    assert torch.equal(exp_avg, next(iter(opt.state_dict()["state"].values()))["exp_avg"])


def test_the_shared_recipe_state_is_the_epochs_own_file_not_a_second_copy(tmp_path):
    """recipe_state/recipe_state.pt (where torchtune's tools look) is a hard link to the newest
    epoch folder's recipe_state.pt: an 8B full run's optimizer state is written once an epoch,
    not twice. The next epoch replaces the name, never the bytes, so the older epoch keeps its own."""
    model = tiny_llama3()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    writer = CheckpointWriter(_Checkpointer(tmp_path), output_dir=str(tmp_path))
    for epoch in (0, 1):
        writer.save(model, opt, RecipeState(seed=3, total_epochs=3, max_steps_per_epoch=None,
                                            epochs_run=epoch + 1), epoch=epoch)
        shared = tmp_path / "recipe_state" / "recipe_state.pt"
        own = tmp_path / f"epoch_{epoch}" / "recipe_state.pt"
        assert shared.stat().st_ino == own.stat().st_ino
    assert torch.load(tmp_path / "epoch_0" / "recipe_state.pt", weights_only=True)[training.EPOCHS_KEY] == 1
    assert torch.load(shared, weights_only=True)[training.EPOCHS_KEY] == 2
    assert not list(tmp_path.rglob("*.tmp"))
