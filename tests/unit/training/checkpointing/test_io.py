"""tune_recipes.training.checkpointing.io: resume lookup, PEFT adapter config, LoRA entries."""

import json
import logging

import pytest
import torch
from omegaconf import OmegaConf
from torchtune import training

from tune_recipes.config import ConfigError
from tune_recipes.training.checkpointing.io import (
    LoRASpec,
    checkpointer_config_for_resume,
    complete_peft_adapter_config,
    keep_earlier_checkpoints_aside,
    latest_epoch_dir,
    lora_checkpoint_entries,
    newest_checkpoint_dir,
    refuse_stale_step_checkpoints,
    step_dirs,
)

pytestmark = pytest.mark.unit


def _lora_cfg(component="tune_recipes.models.lora_tiny_llama3"):
    cfg = {"_component_": component}
    if "lora" in component:
        cfg.update(lora_attn_modules=["q_proj", "v_proj"], apply_lora_to_mlp=False,
                   apply_lora_to_output=False, lora_rank=4, lora_alpha=8)
    return OmegaConf.create(cfg)


def test_lora_spec_of_a_non_lora_builder_names_the_missing_keys():
    from tune_recipes.training.checkpointing.io import LoRASpec

    with pytest.raises(ConfigError, match="model.lora_rank, model.lora_alpha, model.lora_attn_modules"):
        LoRASpec.from_model_config(_lora_cfg("tune_recipes.models.tiny_llama3"))
    spec = LoRASpec.from_model_config(_lora_cfg())
    assert (spec.rank, spec.alpha, spec.attn_modules) == (4, 8, ["q_proj", "v_proj"])


def test_latest_epoch_dir_is_numeric_not_lexical(tmp_path):
    assert latest_epoch_dir(tmp_path) is None
    for n in (2, 10, 9):
        (tmp_path / f"epoch_{n}").mkdir()
    (tmp_path / "epoch_x").mkdir()
    assert latest_epoch_dir(tmp_path).name == "epoch_10"


def _state(tmp_path, epochs_run):
    (tmp_path / "recipe_state").mkdir(exist_ok=True)
    torch.save({"epochs_run": epochs_run}, tmp_path / "recipe_state" / "recipe_state.pt")


def test_resume_names_the_newest_epoch_files(tmp_path):
    cfg = OmegaConf.create({"checkpoint_dir": "/base", "checkpoint_files": ["model.safetensors"]})
    with pytest.raises(ConfigError, match="run without resume_from_checkpoint first"):
        checkpointer_config_for_resume(cfg, str(tmp_path), full_weights=True)
    for n in (0, 1):  # a full fine-tune's folders: model weights (and torchtune's copy of the
        (tmp_path / f"epoch_{n}").mkdir()  # base's adapter_config.json, where it has one)
        (tmp_path / f"epoch_{n}" / "model-00001-of-00001.safetensors").write_bytes(b"")
        (tmp_path / f"epoch_{n}" / "adapter_config.json").write_text("{}")
    _state(tmp_path, epochs_run=1)
    with pytest.raises(ConfigError, match="written after epoch 0 but the newest checkpoint is"):
        checkpointer_config_for_resume(cfg, str(tmp_path), full_weights=True)
    _state(tmp_path, epochs_run=2)
    out = checkpointer_config_for_resume(cfg, str(tmp_path), full_weights=True)
    assert list(out.checkpoint_files) == ["epoch_1/model-00001-of-00001.safetensors"]
    assert list(cfg.checkpoint_files) == ["model.safetensors"]  # the input is not modified
    # A LoRA recipe on a full fine-tune's folder: which recipe wrote it, not "remove it".
    with pytest.raises(ConfigError, match=r"epoch_1 with this recipe: it holds model weights and no "
                                          r"LoRA adapter, written by a recipe that trains every weight "
                                          r"\(or it lost its adapter files\); resume it with the recipe "
                                          r"that wrote it"):
        checkpointer_config_for_resume(cfg, str(tmp_path), full_weights=False)
    for n in (0, 1):  # a LoRA run's folders: the merged weights and the adapter
        (tmp_path / f"epoch_{n}" / "adapter_model.safetensors").write_bytes(b"")
        (tmp_path / f"epoch_{n}" / "adapter_model.pt").write_bytes(b"")
    # ... and the other way round
    with pytest.raises(ConfigError, match=r"epoch_1 with this recipe: it holds a LoRA adapter, "
                                          r"written by a LoRA-type recipe"):
        checkpointer_config_for_resume(cfg, str(tmp_path), full_weights=True)
    lora = checkpointer_config_for_resume(cfg, str(tmp_path), full_weights=False)
    assert list(lora.checkpoint_files) == ["model.safetensors"]  # base weights stay
    assert lora.adapter_checkpoint == "epoch_1/adapter_model.pt"
    # a LoRA checkpoint without its adapter: one line saying how to go on
    (tmp_path / "epoch_1" / "adapter_model.pt").unlink()
    with pytest.raises(ConfigError, match=r"epoch_1: adapter_model.pt is missing; restore it, or "
                                          r"remove that folder to resume from the checkpoint before it"):
        checkpointer_config_for_resume(cfg, str(tmp_path), full_weights=False)


def test_peft_adapter_config_names_the_base_once(tmp_path):
    complete_peft_adapter_config(tmp_path, "/base")  # no adapter: nothing to do
    path = tmp_path / "adapter_config.json"
    path.write_text(json.dumps({"r": 8}))
    complete_peft_adapter_config(tmp_path, "/base")
    assert json.loads(path.read_text())["base_model_name_or_path"] == "/base"
    complete_peft_adapter_config(tmp_path, "/other")
    assert json.loads(path.read_text())["base_model_name_or_path"] == "/base"


def test_lora_entries_hold_adapter_merged_model_and_peft_config():
    from tune_recipes.models.tiny import lora_tiny_llama3

    torch.manual_seed(0)
    model = lora_tiny_llama3(["q_proj", "v_proj"], lora_rank=4, lora_alpha=8)
    for n, p in model.named_parameters():
        if "lora_b" in n:
            torch.nn.init.normal_(p)
    spec = LoRASpec.from_model_config(_lora_cfg())
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    out = lora_checkpoint_entries(sd, spec, adapter_only=False)
    adapter = out[training.ADAPTER_KEY]
    assert adapter and all("lora_" in k for k in adapter)
    merged = out[training.MODEL_KEY]
    assert not any("lora_" in k for k in merged)
    q = "layers.0.attn.q_proj"
    delta = (8 / 4) * model.state_dict()[f"{q}.lora_b.weight"] @ model.state_dict()[f"{q}.lora_a.weight"]
    torch.testing.assert_close(merged[f"{q}.weight"], model.state_dict()[f"{q}.weight"] + delta)
    assert out[training.ADAPTER_CONFIG]["r"] == 4 and out[training.ADAPTER_CONFIG]["peft_type"] == "LORA"
    only = lora_checkpoint_entries({k: v.clone() for k, v in model.state_dict().items()}, spec,
                                   adapter_only=True)
    assert training.MODEL_KEY not in only


class _RunsCode:
    """Unpickling this runs a shell command (what a crafted recipe_state.pt would do)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        import os

        return os.system, (f"touch {self.marker}",)


def test_a_malicious_recipe_state_is_refused_and_nothing_runs(tmp_path):
    from tune_recipes.training.checkpointing.io import CheckpointError, load_recipe_state

    marker = tmp_path / "pwned"
    path = tmp_path / "recipe_state" / "recipe_state.pt"
    path.parent.mkdir()
    torch.save({"epochs_run": 1, "x": _RunsCode(marker)}, path)
    with pytest.raises(CheckpointError, match=f"{path}.*refusing to unpickle"):
        load_recipe_state(path)
    assert not marker.exists()
    # The resume lookup reads it the same way.
    (tmp_path / "epoch_0").mkdir()
    cfg = OmegaConf.create({"checkpoint_dir": "/base", "checkpoint_files": ["model.safetensors"]})
    with pytest.raises(CheckpointError, match="refusing to unpickle"):
        checkpointer_config_for_resume(cfg, str(tmp_path), full_weights=True)
    assert not marker.exists()


def test_a_truncated_recipe_state_names_the_file(tmp_path):
    from tune_recipes.training.checkpointing.io import CheckpointError, load_recipe_state

    path = tmp_path / "recipe_state.pt"
    path.write_bytes(b"")
    with pytest.raises(CheckpointError, match=f"cannot read the recipe state {path}"):
        load_recipe_state(path)
    # A file cut short: torch's first sentence, not its four cut at a fixed width.
    torch.save({"a": torch.zeros(1000)}, path)
    path.write_bytes(path.read_bytes()[:600])
    with pytest.raises(CheckpointError) as e:
        load_recipe_state(path)
    assert str(e.value).startswith(f"cannot read the recipe state {path}: RuntimeError: ") and \
        "high likelihood" not in str(e.value), str(e.value)
    # What the recipes save (tensors, numbers, None, nested dicts) loads with weights_only.
    state = {"seed": 1, "epochs_run": 1, "max_steps_per_epoch": None, "rng_state": torch.get_rng_state(),
             "optimizer": torch.optim.AdamW([torch.nn.Parameter(torch.ones(2))]).state_dict()}
    torch.save(state, path)
    assert load_recipe_state(path)["epochs_run"] == 1


def _step_dir(out, step, epochs_run, global_step=None, adapter=False):
    d = out / f"step_{step}"
    d.mkdir()
    (d / ("adapter_model.pt" if adapter else "model-00001-of-00001.safetensors")).write_bytes(b"")
    torch.save({training.EPOCHS_KEY: epochs_run, "global_step": step if global_step is None
                else global_step, "rank_states": [{}]}, d / "recipe_state.pt")
    return d


def test_the_newest_checkpoint_is_the_one_written_last(tmp_path):
    """step_<n>/ of epoch e (its state says e epochs ran) is newer than epoch_<e-1>/ and older
    than epoch_<e>/; among step folders the largest n (numeric, not lexical)."""
    assert newest_checkpoint_dir(tmp_path) is None
    _step_dir(tmp_path, 2, epochs_run=0)
    assert newest_checkpoint_dir(tmp_path).name == "step_2"  # no epoch finished yet
    (tmp_path / "epoch_0").mkdir()
    assert newest_checkpoint_dir(tmp_path).name == "epoch_0"  # epoch 0 ended after step 2
    _step_dir(tmp_path, 10, epochs_run=1)
    _step_dir(tmp_path, 9, epochs_run=1)
    assert newest_checkpoint_dir(tmp_path).name == "step_10"
    assert [p.name for p in step_dirs(tmp_path)] == ["step_2", "step_9", "step_10"]


def test_resume_from_a_step_checkpoint_names_its_files(tmp_path):
    cfg = OmegaConf.create({"checkpoint_dir": "/base", "checkpoint_files": ["model.safetensors"]})
    (tmp_path / "epoch_0").mkdir()
    _step_dir(tmp_path, 5, epochs_run=1, adapter=True)
    full = _step_dir(tmp_path, 6, epochs_run=1)
    out = checkpointer_config_for_resume(cfg, str(tmp_path), full_weights=True)
    assert list(out.checkpoint_files) == ["step_6/model-00001-of-00001.safetensors"]
    assert out.recipe_checkpoint == "step_6/recipe_state.pt"
    import shutil

    shutil.rmtree(full)
    lora = checkpointer_config_for_resume(cfg, str(tmp_path), full_weights=False)
    assert list(lora.checkpoint_files) == ["model.safetensors"]  # base weights stay
    # Named: torchtune itself would look only in the newest epoch_* folder.
    assert lora.adapter_checkpoint == "step_5/adapter_model.pt"
    assert lora.recipe_checkpoint == "step_5/recipe_state.pt"


def test_a_step_folder_whose_state_is_not_its_own_is_refused(tmp_path):
    cfg = OmegaConf.create({"checkpoint_dir": "/base", "checkpoint_files": ["model.safetensors"]})
    _step_dir(tmp_path, 4, epochs_run=0, global_step=3)
    with pytest.raises(ConfigError, match=r"step_4/recipe_state.pt is not the state of a "
                                          r"mid-epoch checkpoint at step 4"):
        checkpointer_config_for_resume(cfg, str(tmp_path), full_weights=True)


def test_refuse_stale_step_checkpoints_names_them_and_passes_an_empty_dir(tmp_path):

    refuse_stale_step_checkpoints(tmp_path)  # nothing there: a fresh run may start
    (tmp_path / "epoch_0").mkdir()
    refuse_stale_step_checkpoints(tmp_path)  # epoch folders are overwritten, as in torchtune
    for n in (2, 4, 6, 8):
        _step_dir(tmp_path, n, epochs_run=1)  # newer than epoch_0/: an unfinished run
    with pytest.raises(ConfigError, match=r"step_2, step_4, step_6 \.\.\..*resume_from_checkpoint=True"):
        refuse_stale_step_checkpoints(tmp_path)


def test_resume_from_a_folder_missing_its_weights_names_them(tmp_path):
    import json

    cfg = OmegaConf.create({"checkpoint_dir": "/base", "checkpoint_files": ["model.safetensors"]})
    step = _step_dir(tmp_path, 4, epochs_run=0)
    (step / "model-00001-of-00001.safetensors").unlink()
    with pytest.raises(ConfigError, match=r"cannot resume from .*step_4: it holds no model weights"):
        checkpointer_config_for_resume(cfg, str(tmp_path), full_weights=True)
    # An index that names a file no longer there (torchtune would fail deep in its loader).
    (step / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"tok_embeddings.weight": "model-00001-of-00001.safetensors"}}))
    with pytest.raises(ConfigError, match=r"model-00001-of-00001.safetensors \(named by its index\) is missing"):
        checkpointer_config_for_resume(cfg, str(tmp_path), full_weights=True)
    # An index emptied or cut short (a kill or a full disk): one line naming it, not a traceback.
    for broken in ("", '{"weight_map": {"tok_', '{"metadata": {}}', "[]"):
        (step / "model.safetensors.index.json").write_text(broken)
        with pytest.raises(ConfigError, match=rf"cannot read {step}/model.safetensors.index.json: "
                                              rf".*; restore it, or remove {step} to resume"):
            checkpointer_config_for_resume(cfg, str(tmp_path), full_weights=True)


def test_a_finished_runs_folder_says_so_for_resume_and_for_a_fresh_run(tmp_path):
    """A finished run leaves its last epoch_<n>/ without recipe state, and maybe older step
    folders: resume says the run finished (not 'run without resume first'), and a fresh run
    moves the superseded step folders aside with the epochs (a step folder newer than every
    epoch is an interrupted run: refused)."""
    cfg = OmegaConf.create({"checkpoint_dir": "/base", "checkpoint_files": ["model.safetensors"]})
    _step_dir(tmp_path, 19, epochs_run=0)
    (tmp_path / "epoch_0").mkdir()
    (tmp_path / "epoch_0" / "model-00001-of-00001.safetensors").write_bytes(b"")
    with pytest.raises(ConfigError, match=r"epoch_0 is the final checkpoint of a finished run"):
        checkpointer_config_for_resume(cfg, str(tmp_path), full_weights=True)
    refuse_stale_step_checkpoints(tmp_path)  # nothing to refuse
    kept = keep_earlier_checkpoints_aside(str(tmp_path))
    assert sorted(p.name for p in kept.iterdir()) == ["epoch_0", "step_19"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [kept.name]
    # A step folder newer than the newest epoch: an interrupted run, refused.
    _step_dir(tmp_path, 30, epochs_run=1)
    (tmp_path / "epoch_0").mkdir()
    with pytest.raises(ConfigError, match=r"mid-epoch checkpoints of an earlier run \(step_30\): "
                                          "resume it with resume_from_checkpoint=True"):
        refuse_stale_step_checkpoints(tmp_path)


def test_resume_point_auto_resumes_what_true_would_and_starts_afresh_on_nothing(tmp_path):
    from tune_recipes.training.checkpointing.io import resume_point

    assert resume_point(str(tmp_path), False) is None
    assert resume_point(str(tmp_path), "auto") is None  # nothing yet: a fresh start
    with pytest.raises(ConfigError, match="or with resume_from_checkpoint=auto"):
        resume_point(str(tmp_path), True)
    step = _step_dir(tmp_path, 4, epochs_run=0)
    for setting in (True, "auto"):
        point = resume_point(str(tmp_path), setting)
        assert point.checkpoint == step and not point.finished


def test_a_finished_runs_final_epoch_is_a_point_to_continue_from(tmp_path):
    """The final epoch_<e>/ has no recipe state of its own: a finished run, continued with
    more epochs (not an error telling the user to delete it). An intermediate epoch of the
    older layout (one shared recipe_state/ written after it) still resumes as before."""
    from tune_recipes.training.checkpointing.io import (
        checkpointer_config_for_output_dir,
        resume_point,
    )

    cfg = OmegaConf.create({"checkpoint_dir": "/base", "checkpoint_files": ["model.safetensors"]})
    for n in (0, 1):
        (tmp_path / f"epoch_{n}").mkdir()
        (tmp_path / f"epoch_{n}" / "model-00001-of-00001.safetensors").write_bytes(b"")
    _state(tmp_path, epochs_run=2)  # older layout: written after epoch_1
    assert not resume_point(str(tmp_path), True).finished
    _state(tmp_path, epochs_run=1)  # written after epoch_0: epoch_1 is the final one
    point = resume_point(str(tmp_path), "auto")
    assert point.finished and point.epochs_done == 2 and point.checkpoint.name == "epoch_1"
    full = checkpointer_config_for_output_dir(cfg, str(tmp_path), True, full_weights=True)
    assert list(full.checkpoint_files) == [
        str((tmp_path / "epoch_1" / "model-00001-of-00001.safetensors").resolve())]
    with pytest.raises(ConfigError, match=r"epoch_1 with this recipe: it holds model weights and no "
                                          r"LoRA adapter, written by a recipe that trains every weight"):
        checkpointer_config_for_output_dir(cfg, str(tmp_path), True, full_weights=False)


@pytest.mark.parametrize("full_weights", [True, False], ids=["full", "lora"])
def test_a_resume_takes_weights_adapter_and_state_from_one_checkpoint(tmp_path, full_weights, caplog,
                                                                     monkeypatch):
    """torchtune's way of resuming names the recipe state (and a LoRA run's adapter) by hand:
    ``recipe_state/recipe_state.pt`` is the newest epoch's state, while the weights come from a
    newer ``step_<n>/``. Mixed, the run would continue from step n's weights with the epoch's
    optimizer state and data position. The step's own files are used, with a warning naming the
    key; a value naming those files says nothing."""
    from tune_recipes.training.checkpointing import io
    from tune_recipes.training.checkpointing.io import (
        ADAPTER_FILE, EPOCH_STATE_FILE, GLOBAL_STEP_KEY, RANK_STATES_KEY)

    (tmp_path / "epoch_0").mkdir()
    (tmp_path / "epoch_0" / "model-00001-of-00001.safetensors").write_bytes(b"")
    _state(tmp_path, epochs_run=1)
    step = tmp_path / "step_6"
    step.mkdir()
    (step / "model-00001-of-00001.safetensors").write_bytes(b"")
    if not full_weights:  # a LoRA run's folders hold its adapter too
        (tmp_path / "epoch_0" / ADAPTER_FILE).write_bytes(b"")
        (step / ADAPTER_FILE).write_bytes(b"")
    torch.save({"epochs_run": 1, GLOBAL_STEP_KEY: 6, RANK_STATES_KEY: [{}]}, step / EPOCH_STATE_FILE)
    torchtunes_way = OmegaConf.create({
        "checkpoint_dir": str(tmp_path / "epoch_0"), "checkpoint_files": ["model.safetensors"],
        "recipe_checkpoint": "recipe_state/recipe_state.pt",
        "adapter_checkpoint": f"epoch_0/{ADAPTER_FILE}"})
    monkeypatch.setattr(io, "_SAID", set())
    with caplog.at_level(logging.WARNING):
        out = checkpointer_config_for_resume(torchtunes_way, str(tmp_path), full_weights=full_weights)
        checkpointer_config_for_resume(torchtunes_way, str(tmp_path), full_weights=full_weights)
    assert out.recipe_checkpoint == f"step_6/{EPOCH_STATE_FILE}"
    lines = [r.getMessage() for r in caplog.records]
    said = [m for m in lines if "checkpointer.recipe_checkpoint=recipe_state/recipe_state.pt is not used" in m]
    assert len(said) == 1 and "step_6/" in said[0], lines  # once, though asked twice
    if full_weights:
        assert list(out.checkpoint_files) == ["step_6/model-00001-of-00001.safetensors"]
    else:
        assert out.adapter_checkpoint == f"step_6/{ADAPTER_FILE}"
        assert any("checkpointer.adapter_checkpoint" in m for m in lines), lines
    # naming the step's own files (here, absolute paths) is no mistake
    own = OmegaConf.create({**OmegaConf.to_container(torchtunes_way),
                            "recipe_checkpoint": str(step / EPOCH_STATE_FILE),
                            "adapter_checkpoint": str(step / ADAPTER_FILE)})
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        again = checkpointer_config_for_resume(own, str(tmp_path), full_weights=full_weights)
    assert again.recipe_checkpoint == f"step_6/{EPOCH_STATE_FILE}"
    assert not caplog.records


def test_an_earlier_runs_checkpoints_move_aside_under_its_metrics_name(tmp_path, capsys):
    from tune_recipes.training.checkpointing.io import keep_earlier_checkpoints_aside
    from tune_recipes.training.reporting.metrics import earlier_run_suffix

    assert keep_earlier_checkpoints_aside(str(tmp_path / "absent")) is None
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    assert keep_earlier_checkpoints_aside(str(tmp_path)) is None  # metrics only: the logger's
    for name in ("epoch_0", "epoch_10", "epoch_2", "recipe_state", "profiling_outputs"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "f").write_text(name)
    suffix = earlier_run_suffix(tmp_path / "metrics.jsonl")
    kept = keep_earlier_checkpoints_aside(str(tmp_path))
    assert kept == tmp_path / f"checkpoints.{suffix}"
    assert sorted(p.name for p in kept.iterdir()) == ["epoch_0", "epoch_10", "epoch_2", "recipe_state"]
    assert (kept / "epoch_10" / "f").read_text() == "epoch_10"
    assert (tmp_path / "profiling_outputs").is_dir()  # not a checkpoint: left where it is
    assert "epoch_0/, epoch_2/, epoch_10/, recipe_state/ moved to" in capsys.readouterr().err
    # The metrics keep their name when the logger moves them afterwards.
    assert earlier_run_suffix(tmp_path / "metrics.jsonl") == suffix
    # Without metrics: named by the checkpoints' last write, never over an earlier kept folder.
    (tmp_path / "metrics.jsonl").unlink()
    (tmp_path / "epoch_0").mkdir()
    again = keep_earlier_checkpoints_aside(str(tmp_path))
    assert again is not None and again != kept and (again / "epoch_0").is_dir()


def test_checkpoints_the_new_run_reads_from_stay_where_they_are(tmp_path, capsys):
    """A new run trained on from an earlier epoch (checkpoint_dir=<output_dir>/epoch_0, as
    torchtune's examples do): nothing moves, the run reads from there."""
    from tune_recipes.training.checkpointing.io import keep_earlier_checkpoints_aside

    for name in ("epoch_0", "epoch_1"):
        (tmp_path / name).mkdir()
    reads = {"checkpointer.checkpoint_dir": str(tmp_path / "epoch_0")}
    assert keep_earlier_checkpoints_aside(str(tmp_path), read_by_the_run=reads) is None
    assert (tmp_path / "epoch_0").is_dir() and (tmp_path / "epoch_1").is_dir()
    assert "checkpointer.checkpoint_dir=" in capsys.readouterr().err
    # The earlier run's older step folders still move: a resume would take them over this
    # run's own epochs. A step folder the run reads from is refused (copy it out first).
    _step_dir(tmp_path, 5, epochs_run=0)
    kept = keep_earlier_checkpoints_aside(str(tmp_path), read_by_the_run=reads)
    assert sorted(p.name for p in kept.iterdir()) == ["step_5"]
    assert (tmp_path / "epoch_0").is_dir() and (tmp_path / "epoch_1").is_dir()
    _step_dir(tmp_path, 7, epochs_run=0)
    with pytest.raises(ConfigError, match=r"reads from step_7/, a mid-epoch checkpoint of an "
                                          "earlier run"):
        # Refused whatever another key reads (the epoch read first must not hide it).
        keep_earlier_checkpoints_aside(str(tmp_path), read_by_the_run={
            "checkpointer.checkpoint_dir": str(tmp_path / "epoch_1"),
            "teacher_checkpointer.checkpoint_dir": str(tmp_path / "step_7")})
    assert (tmp_path / "step_7").is_dir()
    elsewhere = {"checkpointer.checkpoint_dir": str(tmp_path.parent / "base"),
                 "tokenizer.path": str(tmp_path / "tokenizer.model")}
    assert keep_earlier_checkpoints_aside(str(tmp_path), read_by_the_run=elsewhere) is not None


def test_torchtunes_recipe_state_copy_of_the_chosen_epoch_says_nothing(tmp_path, caplog, monkeypatch):
    """recipe_state/recipe_state.pt is the copy of the newest epoch's state: naming it, as
    torchtune's way of resuming does, takes the same state, and no warning is due."""
    from tune_recipes.training.checkpointing import io
    from tune_recipes.training.checkpointing.io import EPOCH_STATE_FILE

    monkeypatch.setattr(io, "_SAID", set())
    for n in (0, 1):
        (tmp_path / f"epoch_{n}").mkdir()
        (tmp_path / f"epoch_{n}" / "model-00001-of-00001.safetensors").write_bytes(b"")
        torch.save({"epochs_run": n + 1}, tmp_path / f"epoch_{n}" / EPOCH_STATE_FILE)
    _state(tmp_path, epochs_run=2)
    cfg = OmegaConf.create({"checkpoint_dir": "/base", "checkpoint_files": ["model.safetensors"],
                            "recipe_checkpoint": "recipe_state/recipe_state.pt"})
    with caplog.at_level(logging.WARNING):
        out = checkpointer_config_for_resume(cfg, str(tmp_path), full_weights=True)
    assert out.recipe_checkpoint == f"epoch_1/{EPOCH_STATE_FILE}"
    assert not caplog.records
    _state(tmp_path, epochs_run=1)  # a stale copy: another state, said
    monkeypatch.setattr(io, "_SAID", set())
    with caplog.at_level(logging.WARNING):
        checkpointer_config_for_resume(cfg, str(tmp_path), full_weights=True)
    assert any("is not used" in r.getMessage() for r in caplog.records)


def test_a_fresh_run_moves_a_quantized_model_of_the_earlier_checkpoints_with_them(tmp_path):
    """The shipped quantize configs write <output_dir>/quantized/ from <output_dir>/epoch_<n>/:
    left behind by a fresh run, its quantize.json would name the new run's epoch_0 as the
    source of the earlier run's quantized model. A folder quantized from elsewhere stays."""
    import json

    (tmp_path / "epoch_0").mkdir()
    for name, source in (("quantized", tmp_path / "epoch_0"), ("from_elsewhere", tmp_path.parent)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "model-8da4w.pt").write_bytes(b"q")
        (tmp_path / name / "quantize.json").write_text(json.dumps({"source": str(source)}))
    kept = keep_earlier_checkpoints_aside(str(tmp_path))
    assert sorted(p.name for p in kept.iterdir()) == ["epoch_0", "quantized"]
    assert (kept / "quantized" / "model-8da4w.pt").read_bytes() == b"q"
    # Its record names the moved epoch folder, not the new run's epoch_0 to come.
    record = json.loads((kept / "quantized" / "quantize.json").read_text())
    assert record["source"] == str((kept / "epoch_0").resolve())
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([kept.name, "from_elsewhere"])


def test_checkpoints_written_elsewhere_than_output_dir_are_refused_before_anything(tmp_path):
    """torchtune's checkpointer writes epoch folders into checkpointer.output_dir, while resume
    and the guards over an earlier run's checkpoints read output_dir: apart, a resume found
    nothing and a fresh run wrote over the earlier run's step folders."""
    from tune_recipes.training.checkpointing.io import checkpointer_config_for_output_dir

    out = tmp_path / "run"
    apart = OmegaConf.create({"checkpoint_dir": "/base", "output_dir": str(out / "ckpt")})
    for resume in (False, "auto", True):
        with pytest.raises(ConfigError, match=rf"checkpointer.output_dir={out / 'ckpt'} is not "
                                              rf"output_dir={out}: .*'checkpointer.output_dir=\$\{{output_dir\}}'"):
            checkpointer_config_for_output_dir(apart, str(out), resume, full_weights=True)
    assert not out.exists()
    # The same folder spelt another way is the same folder.
    same = OmegaConf.create({"checkpoint_dir": "/base", "output_dir": f"{tmp_path}/x/../run/"})
    assert checkpointer_config_for_output_dir(same, str(out), False, full_weights=True) is same


@pytest.mark.parametrize("safe_serialization", [True, False])
def test_a_qwen2_peft_adapter_gets_its_q_k_rows_back_in_the_models_order(tmp_path, safe_serialization):
    """torchtune permutes q/k lora_B rows into Llama's HF order for every model type; Qwen2's
    weights are never permuted, so the adapter's rows are put back (either file format)."""
    from safetensors.torch import load_file, save_file
    from torchtune.models.convert_weights import tune_to_peft_adapter_weights

    from tune_recipes.training.checkpointing.io import undo_rope_permutation_of_peft_adapter

    heads, kv_heads, head_dim, rank = 4, 2, 8, 3
    g = torch.Generator().manual_seed(0)
    tune = {"layers.0.attn.q_proj.lora_b.weight": torch.randn(heads * head_dim, rank, generator=g),
            "layers.0.attn.k_proj.lora_b.weight": torch.randn(kv_heads * head_dim, rank, generator=g),
            "layers.0.attn.v_proj.lora_b.weight": torch.randn(kv_heads * head_dim, rank, generator=g),
            "layers.0.attn.q_proj.lora_a.weight": torch.randn(rank, heads * head_dim, generator=g)}
    peft = tune_to_peft_adapter_weights(dict(tune), num_heads=heads, num_kv_heads=kv_heads,
                                        dim=heads * head_dim, head_dim=head_dim)
    prefix = "base_model.model.model.layers.0.self_attn."
    assert not torch.equal(peft[prefix + "q_proj.lora_B.weight"], tune["layers.0.attn.q_proj.lora_b.weight"])
    name = "adapter_model.safetensors" if safe_serialization else "adapter_model.bin"
    if safe_serialization:
        save_file(peft, tmp_path / name)
    else:
        torch.save(peft, tmp_path / name)
    undo_rope_permutation_of_peft_adapter(tmp_path, heads, kv_heads, head_dim)
    back = load_file(tmp_path / name) if safe_serialization else torch.load(tmp_path / name)
    for module in ("q_proj", "k_proj", "v_proj"):
        assert torch.equal(back[prefix + f"{module}.lora_B.weight"],
                           tune[f"layers.0.attn.{module}.lora_b.weight"]), module
    assert torch.equal(back[prefix + "q_proj.lora_A.weight"], tune["layers.0.attn.q_proj.lora_a.weight"])
