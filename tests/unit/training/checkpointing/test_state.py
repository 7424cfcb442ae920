"""tune_recipes.training.checkpointing.state: the run's counters and what resumes them."""

import pytest
import torch
from omegaconf import OmegaConf
from torchtune import training

from tune_recipes.config import ConfigError
from tune_recipes.training.checkpointing.state import RecipeState, SavedState

pytestmark = pytest.mark.unit


def test_from_config_seeds_and_reads_the_counters():
    cfg = OmegaConf.create({"seed": 5, "epochs": 3, "max_steps_per_epoch": 7})
    state = RecipeState.from_config(cfg)
    assert (state.seed, state.total_epochs, state.max_steps_per_epoch, state.epochs_run) == (5, 3, 7, 0)
    first = torch.rand(3)
    RecipeState.from_config(cfg)
    assert torch.equal(torch.rand(3), first)  # the seed was applied
    assert state.seed_configured
    assert not RecipeState.from_config(OmegaConf.create({"seed": None, "epochs": 1})).seed_configured


def test_checkpoint_round_trip_restores_counters_and_rng():
    state = RecipeState(seed=1, total_epochs=4, max_steps_per_epoch=None, epochs_run=2,
                        skipped_steps=3)
    entries = state.checkpoint_entries(optimizer_state={"opt": 1})
    assert entries[training.EPOCHS_KEY] == 2 and entries[training.OPT_KEY] == {"opt": 1}
    expected = torch.rand(4)  # what comes next after the checkpoint
    saved = SavedState.from_checkpoint(entries)
    assert saved.optimizer == {"opt": 1}
    resumed = RecipeState(seed=1, total_epochs=4, max_steps_per_epoch=None)
    resumed.resume(saved)
    assert resumed.epochs_run == 2 and resumed.skipped_steps == 3
    assert torch.equal(torch.rand(4), expected)


def test_saved_seed_and_steps_win_over_the_config_with_a_warning(capsys):
    saved = SavedState(optimizer=None, seed=1, epochs_run=1, total_epochs=2, max_steps_per_epoch=3)
    state = RecipeState(seed=9, total_epochs=2, max_steps_per_epoch=None)
    state.resume(saved)
    assert (state.seed, state.max_steps_per_epoch) == (1, 3)
    # One line each, naming the key as a config override would: not Python's two-line warning.
    assert capsys.readouterr().err.splitlines() == [
        "warning: config seed=9 differs from the checkpoint's 1; using the checkpoint's",
        "warning: config max_steps_per_epoch=None differs from the checkpoint's 3; "
        "using the checkpoint's"]
    # Other ranks keep quiet (rank 0 has said it) but resume the same way.
    other = RecipeState(seed=9, total_epochs=2, max_steps_per_epoch=None)
    other.resume(SavedState(optimizer=None, seed=1, epochs_run=1, total_epochs=2,
                            max_steps_per_epoch=3, rank_states=[{}, {}]), rank=1)
    assert (other.seed, other.max_steps_per_epoch) == (1, 3)
    assert capsys.readouterr().err == ""
    # `seed: null` (torchtune's configs): the seed drawn for this run is no config value to
    # warn about; the checkpoint's still wins.
    drawn = RecipeState(seed=2220475452, total_epochs=2, max_steps_per_epoch=3, seed_configured=False)
    drawn.resume(saved)
    assert drawn.seed == 1 and capsys.readouterr().err == ""


def test_state_not_written_by_a_recipe_is_a_config_error():
    with pytest.raises(ConfigError, match="lacks"):
        SavedState.from_checkpoint({training.SEED_KEY: 0})
    assert "optimizer" not in str(RecipeState(0, 1, None).checkpoint_entries(None))


@pytest.mark.parametrize("saved,resumed,refused", [
    ("torch.optim.AdamW", "torch.optim.AdamW", False),
    ("torch.optim.AdamW", "torch.optim.adamw.AdamW", False),  # another path to the class
    ("torchao.optim.AdamW8bit", "tune_recipes.optim.AdamW8bit", False),  # a subclass: same states
    ("tune_recipes.optim.AdamW8bit", "torchao.optim.AdamW8bit", False),
    ("tune_recipes.optim.AdamW8bit", "torch.optim.AdamW", True),
    ("torch.optim.AdamW", "torch.optim.SGD", True),
    ("no_longer.importable.Adam", "torch.optim.AdamW", True),
    (None, "torch.optim.SGD", False),  # an older checkpoint: nothing recorded to compare
])
def test_the_recorded_optimizer_must_fit_the_resumed_runs(saved, resumed, refused):
    cfg = OmegaConf.create({"seed": 1, "epochs": 2, "optimizer": {"_component_": saved}})
    state = RecipeState.from_config(cfg)
    entries = state.checkpoint_entries(optimizer_state={"state": {}, "param_groups": []})
    assert entries.get("optimizer_component") == saved
    restored = SavedState.from_checkpoint(entries)
    run = OmegaConf.create({"optimizer": {"_component_": resumed}})
    if refused:
        with pytest.raises(ConfigError, match=f"optimizer._component_={saved}, this run's is {resumed}"):
            restored.check_optimizer(run)
    else:
        restored.check_optimizer(run)


@pytest.mark.parametrize("saved_in_bwd,resumed_in_bwd", [(True, False), (False, True)])
def test_a_state_of_the_other_optimizer_in_bwd_form_is_refused(saved_in_bwd, resumed_in_bwd):
    cfg = OmegaConf.create({"seed": 1, "epochs": 2, "optimizer_in_bwd": saved_in_bwd,
                            "optimizer": {"_component_": "torch.optim.AdamW"}})
    entries = RecipeState.from_config(cfg).checkpoint_entries(optimizer_state={"state": {}})
    restored = SavedState.from_checkpoint(entries)
    def run(in_bwd):
        return OmegaConf.create({"optimizer_in_bwd": in_bwd,
                                 "optimizer": {"_component_": "torch.optim.AdamW"}})

    restored.check_optimizer(run(saved_in_bwd))  # as saved: fine
    with pytest.raises(ConfigError, match=f"saved with optimizer_in_bwd={saved_in_bwd}, this run "
                                          f"has optimizer_in_bwd={resumed_in_bwd}"):
        restored.check_optimizer(run(resumed_in_bwd))
    del entries["optimizer_in_bwd"]  # an older checkpoint: nothing recorded, nothing refused here
    SavedState.from_checkpoint(entries).check_optimizer(run(resumed_in_bwd))


def test_a_resume_with_no_epochs_left_from_its_checkpoint_is_refused(tmp_path):
    """Inside epoch 2 (1 run, mid-epoch at step 7) of 3: epochs=1 leaves nothing to train,
    epochs=2 finishes that epoch; after epoch 2 (2 run): epochs=2 leaves nothing."""
    from types import SimpleNamespace

    state = RecipeState(seed=1, total_epochs=3, max_steps_per_epoch=None, epochs_run=1)
    position = SimpleNamespace(global_step=7, ranks=[{}])
    mid = SavedState.from_checkpoint(state.checkpoint_entries(None, position=position))
    with pytest.raises(ConfigError, match=r"^epochs=1: the checkpoint being resumed, .*step_7, is at "
                                          r"step 7, inside epoch 2 of the 3 it was written for, so "
                                          r"nothing is left to train"):
        mid.check_epochs(OmegaConf.create({"epochs": 1}), tmp_path / "step_7")
    mid.check_epochs(OmegaConf.create({"epochs": 2}), tmp_path / "step_7")
    state.epochs_run = 2
    after = SavedState.from_checkpoint(state.checkpoint_entries(None))
    with pytest.raises(ConfigError, match=r"is after epoch 2 of the 3 .*resume with epochs=3 \(or more than 2\)"):
        after.check_epochs(OmegaConf.create({"epochs": 2}), tmp_path / "epoch_1")
    after.check_epochs(OmegaConf.create({"epochs": 3}), tmp_path / "epoch_1")


@pytest.mark.parametrize("in_backward", [False, True])
def test_a_resume_trains_with_the_checkpoints_lr_and_says_so(in_backward, capsys):
    """torch's load_state_dict restores the saved lr and weight_decay, whatever the config says
    now: the run warns, and its config (so its config.yaml) holds the values it trains with."""
    w = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.AdamW([w], lr=3e-3, weight_decay=0.01)
    torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5)  # group lr 1.5e-3, initial_lr 3e-3
    state = {"w": opt.state_dict()} if in_backward else opt.state_dict()
    saved = SavedState(optimizer=state, seed=0, epochs_run=1, total_epochs=2, max_steps_per_epoch=None)
    cfg = OmegaConf.create({"optimizer": {"_component_": "torch.optim.AdamW", "lr": 1e-4,
                                          "weight_decay": 0.01}})
    saved.keep_optimizer_settings(cfg)
    err = capsys.readouterr().err
    assert "config optimizer.lr=0.0001 differs from the checkpoint's 0.003; using the checkpoint's" in err
    assert "weight_decay" not in err  # unchanged: no line
    assert cfg.optimizer.lr == 3e-3 and cfg.optimizer.weight_decay == 0.01
    cfg.optimizer.weight_decay = 0.5
    saved.keep_optimizer_settings(cfg, is_main=False)  # other ranks: the values, no line
    assert capsys.readouterr().err == "" and cfg.optimizer.weight_decay == 0.01


def test_a_resume_of_an_8bit_adamw_state_reads_its_tensor_lr(capsys):
    """torchao's AdamW8bit (the 3B and 8B full configs' optimizer, through ours) keeps lr as a
    0-dim tensor: read as the number it holds, not a traceback from OmegaConf."""
    from tune_recipes.optim import AdamW8bit

    w = torch.nn.Parameter(torch.zeros(256, 4))
    opt = AdamW8bit([w], lr=3e-3, weight_decay=0.01)
    w.grad = torch.ones_like(w)
    opt.step()
    saved = SavedState(optimizer=opt.state_dict(), seed=0, epochs_run=1, total_epochs=2,
                       max_steps_per_epoch=None)
    assert isinstance(saved._saved_param_groups()[0]["lr"], torch.Tensor)
    cfg = OmegaConf.create({"optimizer": {"lr": 1e-4, "weight_decay": 0.01}})
    saved.keep_optimizer_settings(cfg)
    assert "config optimizer.lr=0.0001 differs from the checkpoint's 0.003;" in capsys.readouterr().err
    assert cfg.optimizer.lr == 0.003


def test_the_kind_of_training_is_recorded_and_an_unrecorded_one_is_not_compared():
    from tune_recipes.training.checkpointing.state import TRAINING_KIND_KEY, training_kind

    lora = OmegaConf.create({"model": {"lora_rank": 8}, "seed": 0, "epochs": 1,
                             "optimizer": {"_component_": "torch.optim.AdamW"}})
    assert training_kind(lora) == "lora"
    assert training_kind(OmegaConf.merge(lora, {"teacher_model": {"_component_": "x"}})) == "kd"
    assert training_kind(OmegaConf.merge(lora, {"quantizer": {"_component_": "x"}})) == "qat_lora"
    entries = RecipeState(seed=0, total_epochs=1, max_steps_per_epoch=None,
                          training_kind=training_kind(lora)).checkpoint_entries(None)
    assert entries[TRAINING_KIND_KEY] == "lora"
    kd = OmegaConf.merge(lora, {"teacher_model": {"_component_": "x"}})
    saved = SavedState(optimizer=None, seed=0, epochs_run=0, total_epochs=1,
                       max_steps_per_epoch=None, training_kind="lora")
    with pytest.raises(ConfigError, match="was written by a LoRA-type fine-tune"):
        saved.check_training_kind(kd, "/run/epoch_0")
    saved.training_kind = None  # written before the kind was recorded (or by torchtune)
    saved.check_training_kind(kd, "/run/epoch_0")
