"""tune_recipes.training.setup.recipe: where a (resumed) run starts, and the driver it builds."""

from pathlib import Path

import pytest
import torch
from torchtune import config as tt_config

from tune_recipes.config import ConfigError, load_config
from tune_recipes.training.checkpointing.state import RecipeState
from tune_recipes.training.setup.recipe import setup_data_and_schedule

pytestmark = pytest.mark.unit
CONFIG = Path(__file__).resolve().parents[4] / "configs" / "tiny" / "full_single_device.yaml"


def _plan(cfg, epochs_run, ga=1, max_steps=None, world_size=1, rank=0, optimizer_state=None):
    tokenizer = tt_config.instantiate(cfg.tokenizer)
    param = torch.nn.Parameter(torch.zeros(3))
    optimizer = torch.optim.AdamW([param], lr=cfg.optimizer.lr)
    if optimizer_state is not None:  # as a resume loads it, before the schedule is built
        optimizer.load_state_dict(optimizer_state)
    cfg = cfg.copy()
    cfg.gradient_accumulation_steps = ga
    state = RecipeState(seed=cfg.seed, total_epochs=3, max_steps_per_epoch=max_steps,
                        epochs_run=epochs_run)
    plan = setup_data_and_schedule(cfg, tokenizer, optimizer, state, ignore_index=-100,
                                   world_size=world_size, rank=rank)
    return plan, optimizer


def test_resumed_run_starts_at_the_step_and_lr_of_the_interrupted_one():
    cfg = load_config(CONFIG)
    fresh, fresh_opt = _plan(cfg, epochs_run=0, max_steps=6)
    assert fresh.global_step == 0 and fresh.steps_per_epoch == 6
    lrs = [fresh_opt.param_groups[0]["lr"]]
    for _ in range(2 * fresh.steps_per_epoch):
        fresh_opt.step()
        fresh.lr_schedule.step()
        lrs.append(fresh_opt.param_groups[0]["lr"])
    state = fresh_opt.state_dict()
    state["param_groups"][0]["lr"] = 0.123  # the schedule, not the saved lr, must set it
    resumed, resumed_opt = _plan(cfg, epochs_run=2, max_steps=6, optimizer_state=state)
    assert resumed.global_step == 2 * resumed.steps_per_epoch == 12
    assert resumed_opt.param_groups[0]["lr"] == pytest.approx(lrs[12], rel=1e-12)
    # ... and keeps following the same schedule.
    resumed_opt.step()
    resumed.lr_schedule.step()
    fresh_opt.step()
    fresh.lr_schedule.step()
    assert resumed_opt.param_groups[0]["lr"] == pytest.approx(fresh_opt.param_groups[0]["lr"], rel=1e-12)
    assert lrs[12] != lrs[0]  # the schedule really moved (warmup + cosine)


def test_steps_count_micro_batches_per_rank_and_accumulation():
    cfg = load_config(CONFIG)
    one, _ = _plan(cfg, epochs_run=0)
    batches = len(one.dataloader)
    assert one.steps_per_epoch == batches
    two_ranks, _ = _plan(cfg, epochs_run=0, ga=2, world_size=2, rank=1)
    assert len(two_ranks.dataloader) == batches // 2
    assert two_ranks.steps_per_epoch == batches // 2 // 2


def test_too_few_batches_for_accumulation_names_the_keys():
    cfg = load_config(CONFIG)
    with pytest.raises(ConfigError, match="gradient_accumulation_steps=10000"):
        _plan(cfg, epochs_run=0, ga=10000)


def test_resume_is_applied_before_the_dataloader_is_built(capsys):
    """The saved seed, max_steps_per_epoch and epochs_run decide data order, steps and schedule."""
    from tune_recipes.training.checkpointing.state import SavedState

    cfg = load_config(CONFIG)
    tokenizer = tt_config.instantiate(cfg.tokenizer)
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(3))], lr=cfg.optimizer.lr)
    optimizer.param_groups[0]["initial_lr"] = cfg.optimizer.lr  # as a loaded optimizer state has
    state = RecipeState(seed=cfg.seed + 1, total_epochs=3, max_steps_per_epoch=None)
    saved = SavedState(optimizer=None, seed=cfg.seed, epochs_run=1, total_epochs=3,
                       max_steps_per_epoch=4)
    plan = setup_data_and_schedule(cfg, tokenizer, optimizer, state, ignore_index=-100,
                                   resume=saved)
    assert (state.seed, state.max_steps_per_epoch, state.epochs_run) == (cfg.seed, 4, 1)
    assert plan.dataloader.sampler.seed == cfg.seed
    assert plan.steps_per_epoch == 4 and plan.global_step == 4
    # seed and max_steps_per_epoch differed from the config: a line each
    assert capsys.readouterr().err.count("differs from the checkpoint") == 2


def test_training_dtype_rejects_fp16():
    from tune_recipes.training.setup.recipe import training_dtype

    cfg = load_config(CONFIG)
    assert training_dtype(cfg, torch.device("cpu")) == torch.float32
    cfg.dtype = "fp16"
    with pytest.raises(ConfigError, match="fp16 is not supported"):
        training_dtype(cfg, torch.device("cpu"))


def test_setup_step_driver_runs_the_path_the_recipe_chose(tmp_path):
    from tune_recipes.training.setup.recipe import setup_step_driver
    from tune_recipes.training.setup.runtime import Runtime
    from tune_recipes.training.step.normalization import NormalizationPath

    cfg = load_config(CONFIG, [f"output_dir={tmp_path}", "gradient_accumulation_steps=2"])
    model = torch.nn.Linear(2, 2)
    model.bias.requires_grad_(False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    kwargs = dict(runtime=Runtime(torch.device("cpu")), resume=None, model=model,
                  tokenizer=tt_config.instantiate(cfg.tokenizer), optimizer=optimizer,
                  ignore_index=-100, save_checkpoint=print)
    state = RecipeState(seed=0, total_epochs=1, max_steps_per_epoch=2)
    driver = setup_step_driver(cfg, path=NormalizationPath.RESCALE, state=state, **kwargs)
    assert driver._save_on_data_error is print  # one device: a data error saves through it
    assert driver.normalizer.path is NormalizationPath.RESCALE
    assert driver.gradient_accumulation_steps == 2 and driver.steps_per_epoch == 2
    assert driver.parameters == [model.weight]  # trainable parameters only
    driver.close()
    with pytest.raises(ValueError, match="does not match"):
        setup_step_driver(cfg, path=NormalizationPath.SKIP, state=state, **kwargs)


def test_setup_step_driver_pads_both_loaders_for_the_runtimes_device(tmp_path, monkeypatch):
    """The training and the validation loaders ask how to pad for the device the run is on
    (``padded_batch_multiple``), whatever it is: a CPU run here, its answer recorded."""
    from tune_recipes.training.setup import data, recipe
    from tune_recipes.training.setup.runtime import Runtime
    from tune_recipes.training.step.normalization import NormalizationPath

    asked = []
    for module in (data, recipe):
        monkeypatch.setattr(module, "padded_batch_multiple", lambda device, m=module: asked.append((m, device)) or 1)
    cfg = load_config(CONFIG, [f"output_dir={tmp_path}"])
    cfg.dataset_val = cfg.dataset
    model = torch.nn.Linear(2, 2)
    driver = recipe.setup_step_driver(
        cfg, path=NormalizationPath.SKIP, state=RecipeState(seed=0, total_epochs=1, max_steps_per_epoch=2),
        runtime=Runtime(torch.device("cpu")), resume=None, model=model,
        tokenizer=tt_config.instantiate(cfg.tokenizer), optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        ignore_index=-100, eval_loss=torch.nn.CrossEntropyLoss(), save_checkpoint=None)
    driver.close()
    assert asked == [(recipe, torch.device("cpu")), (data, torch.device("cpu"))], asked


def test_rows_stay_within_what_every_model_fed_takes(tmp_path, monkeypatch):
    """A distillation teacher shorter than its student caps the rows as the student would."""
    from tune_recipes.training.setup import recipe
    from tune_recipes.training.setup.runtime import Runtime
    from tune_recipes.training.step.normalization import NormalizationPath

    def with_length(n):
        m = torch.nn.Linear(2, 2)
        m.max_seq_len = n
        return m

    assert recipe.longest_row_all_take(with_length(4096), with_length(1024)) == 1024
    assert recipe.longest_row_all_take(torch.nn.Linear(2, 2), with_length(512)) == 512
    assert recipe.longest_row_all_take(torch.nn.Linear(2, 2)) is None
    caps = []
    real = recipe.setup_data_and_schedule
    monkeypatch.setattr(recipe, "setup_data_and_schedule",
                        lambda *a, **kw: caps.append(kw["max_seq_len"]) or real(*a, **kw))
    monkeypatch.setattr(recipe, "build_validation_dataloader",
                        lambda *a, **kw: caps.append(kw["max_seq_len"]))
    cfg = load_config(CONFIG, [f"output_dir={tmp_path}"])
    student, teacher = with_length(4096), with_length(1024)
    recipe.setup_step_driver(
        cfg, path=NormalizationPath.SKIP, state=RecipeState(seed=0, total_epochs=1, max_steps_per_epoch=2),
        runtime=Runtime(torch.device("cpu")), resume=None, model=student,
        tokenizer=tt_config.instantiate(cfg.tokenizer), optimizer=torch.optim.SGD(student.parameters(), lr=0.1),
        ignore_index=-100, also_fed=(teacher,), save_checkpoint=None).close()
    assert caps == [1024, 1024]


def test_a_checkpoint_the_checkpointer_cannot_convert_is_one_line(tmp_path):
    """torchtune's Meta checkpointer on HF-format files raises a bare Exception from its
    converter: one ConfigError naming the checkpointer, the folder and the model type."""
    from omegaconf import OmegaConf

    from tune_recipes.resolvers import tiny_checkpoint
    from tune_recipes.training.setup.recipe import read_checkpoint

    folder = tiny_checkpoint()
    cfg = OmegaConf.create({"_component_": "torchtune.training.FullModelMetaCheckpointer",
                            "checkpoint_dir": folder, "checkpoint_files": ["model.safetensors"],
                            "model_type": "LLAMA3", "output_dir": str(tmp_path)})
    checkpointer = tt_config.instantiate(cfg, should_load_recipe_state=False)
    with pytest.raises(ConfigError) as info:
        read_checkpoint(checkpointer, cfg)
    message = str(info.value)
    assert "\n" not in message and "FullModelMetaCheckpointer could not load" in message
    assert folder in message and "model_type=LLAMA3" in message


@pytest.mark.parametrize("padding_free", [False, True])
def test_the_data_setup_collates_as_the_padding_free_key_says(padding_free):
    """Every recipe's data goes through this setup: padding_free=True gives each rank's
    micro-batch as one row with a document mask, False padded rows."""
    cfg = load_config(CONFIG)
    cfg.padding_free = padding_free
    plan, _ = _plan(cfg, epochs_run=0, world_size=2, rank=1)
    batch = next(iter(plan.dataloader))
    if padding_free:
        assert batch["tokens"].shape[0] == 1 and {"mask", "input_pos"} <= set(batch)
    else:
        assert batch["tokens"].shape[0] == cfg.batch_size and "mask" not in batch


def test_a_warmup_longer_than_the_dataset_makes_the_run_is_named_once_the_length_is_known(capsys):
    """Without max_steps_per_epoch the dataset sets the run's length, which validation cannot
    see: the setup warns (one rank) when lr_scheduler.num_warmup_steps exceeds it, naming the
    counts; a run bounded by max_steps_per_epoch is validation's to warn about, not again here."""
    cfg = load_config(CONFIG)
    cfg.lr_scheduler.num_warmup_steps = 100_000
    plan, _ = _plan(cfg, epochs_run=0)
    said = capsys.readouterr().err
    assert "lr_scheduler.num_warmup_steps=100000 is as long as the whole run or longer" in said
    assert f"3 epoch(s) of {plan.steps_per_epoch} steps" in said and "batch_size=" in said
    _plan(cfg, epochs_run=0, world_size=2, rank=1)
    _plan(cfg, epochs_run=0, max_steps=6)
    _plan(cfg, epochs_run=0, max_steps=20_000)  # past even that bound (60,000): validation warns
    cfg.lr_scheduler.num_warmup_steps = 1
    _plan(cfg, epochs_run=0)
    assert "num_warmup_steps" not in capsys.readouterr().err
    # a bound the config sets but the dataset ends first, the warmup between the two
    cfg.lr_scheduler.num_warmup_steps = 3 * plan.steps_per_epoch + 1
    _plan(cfg, epochs_run=0, max_steps=20_000)
    assert "is as long as the whole run or longer" in capsys.readouterr().err


def test_a_save_every_n_steps_that_saves_nothing_mid_epoch_is_named(capsys):
    """save_every_n_steps at or past every step inside an epoch (a mid-epoch checkpoint is never
    written at an epoch's last step): one warning at the start, not a run with none."""
    cfg = load_config(CONFIG, ["save_every_n_steps=6"])
    _plan(cfg, epochs_run=0, max_steps=6)  # 3 epochs of 6: every multiple is an epoch end
    assert "warning: save_every_n_steps=6 writes no mid-epoch checkpoint in this run " \
           "(3 epoch(s) of 6 steps, each saved at its end)" in capsys.readouterr().err
    for every in (4, 5, 11):  # step 4 of epoch 1; step 5 of epoch 1; step 5 of epoch 2
        cfg.save_every_n_steps = every
        _plan(cfg, epochs_run=0, max_steps=6)
        assert "save_every_n_steps" not in capsys.readouterr().err
    _, optimizer = _plan(cfg, epochs_run=0, max_steps=6)
    capsys.readouterr()
    # resumed for the last epoch (steps 13-18): none is a multiple of 11
    _plan(cfg, epochs_run=2, max_steps=6, optimizer_state=optimizer.state_dict())
    assert "warning: save_every_n_steps=11 writes no mid-epoch checkpoint" in capsys.readouterr().err


def test_the_run_pads_batches_for_its_device_up_to_the_tokenizers_max_seq_len():
    """The recipes' data setup pads padded batches on to 128-token multiples for a CUDA device
    only, never past the tokenizer's max_seq_len (nothing touches the device to build them).
    The tiny rows are 52-102 tokens: on to 128, or to 90 where the tokenizer cuts rows at 90."""
    def lengths(device, *overrides, max_seq_len=None):
        cfg = load_config(CONFIG, list(overrides))
        tokenizer = tt_config.instantiate(cfg.tokenizer)
        optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(3))], lr=1e-3)
        state = RecipeState(seed=cfg.seed, total_epochs=1, max_steps_per_epoch=4, epochs_run=0)
        plan = setup_data_and_schedule(cfg, tokenizer, optimizer, state, ignore_index=-100,
                                       device=device, max_seq_len=max_seq_len)
        return {b["tokens"].shape[1] for b in plan.dataloader}

    assert len(lengths(torch.device("cpu"))) > 1  # padded to each batch's longest row
    assert lengths(torch.device("cuda")) == {128}
    assert len(lengths("cpu", "tokenizer.max_seq_len=90")) > 1
    assert lengths("cuda", "tokenizer.max_seq_len=90") == {90}
    # the model's max_seq_len caps it too (rows uncut by the tokenizer: none is over 110)
    assert lengths("cuda", "tokenizer.max_seq_len=null", max_seq_len=110) == {110}


@pytest.mark.parametrize("overrides, size, said", [
    (["shuffle=False"], 400, r"written with other data settings: .*shuffle=False \(the checkpoint's: True\)"),
    (["batch_size=4"], 400, r"written with other data settings: .*batch_size=4 \(the checkpoint's: 8\)"),
    # a row removed (the way out a bad example's line also names): not a setting to set back
    ([], 401, r"written on a dataset of 401 examples, this run's holds 400 \(a row removed or "
              r"added\).*or start a new run from its weights"),
])
def test_a_mid_epoch_resume_with_other_data_settings_is_refused_by_name(overrides, size, said):
    """A mid-epoch checkpoint's position is a count of batches in one order: another batch size
    or shuffle setting would continue with other examples (some twice, some never), and so
    would a dataset of another size, where the line says the data changed."""
    from tune_recipes.training.checkpointing.state import SavedState
    from tune_recipes.training.step.driver import DATA_SHAPE, DATALOADER_STATE

    cfg = load_config(CONFIG, overrides)
    tokenizer = tt_config.instantiate(cfg.tokenizer)
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(3))], lr=1e-3)
    state = RecipeState(seed=cfg.seed, total_epochs=3, max_steps_per_epoch=6, epochs_run=0)
    written = {"batch_size": 8, "dataset_size": size, "gradient_accumulation_steps": 1, "shuffle": True}
    resume = SavedState(optimizer=None, seed=cfg.seed, epochs_run=0, total_epochs=3,
                        max_steps_per_epoch=6, global_step=2,
                        rank_states=[{DATALOADER_STATE: {"_num_yielded": 2}, DATA_SHAPE: written}])
    with pytest.raises(ConfigError, match=said):
        setup_data_and_schedule(cfg, tokenizer, optimizer, state, ignore_index=-100, resume=resume)


def test_a_mid_epoch_resume_on_other_examples_of_the_same_count_is_refused():
    """The data settings alike, the examples not (another file of as many rows, or rows cut by
    another max_seq_len): the checkpoint's position would continue on examples it never saw
    in that order. The resume on its own data goes on."""
    from tune_recipes.training.checkpointing.state import SavedState
    from tune_recipes.training.step.driver import DATA_SHAPE, DATALOADER_STATE, data_shape

    def setup(overrides, resume=None):
        cfg = load_config(CONFIG, overrides)
        optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(3))], lr=1e-3)
        state = RecipeState(seed=cfg.seed, total_epochs=3, max_steps_per_epoch=6, epochs_run=0)
        return setup_data_and_schedule(cfg, tt_config.instantiate(cfg.tokenizer), optimizer,
                                       state, ignore_index=-100, resume=resume)

    written = data_shape(setup([]).dataloader, 1)
    resume = SavedState(optimizer=None, seed=0, epochs_run=0, total_epochs=3,
                        max_steps_per_epoch=6, global_step=2,
                        rank_states=[{DATALOADER_STATE: {"_num_yielded": 2}, DATA_SHAPE: written}])
    setup(["seed=0"], resume)  # its own data
    with pytest.raises(ConfigError, match=r"written on other examples than this run's dataset "
                                          r"holds \(as many, \d+, but not the same tokens"):
        setup(["seed=0", "tokenizer.max_seq_len=40"], resume)


def test_a_fake_quant_start_past_the_run_is_named_once_the_length_is_known(capsys):
    def warned(after):
        cfg = load_config(CONFIG, [f"fake_quant_after_n_steps={after}"])
        tokenizer = tt_config.instantiate(cfg.tokenizer)
        optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(3))], lr=1e-3)
        state = RecipeState(seed=cfg.seed, total_epochs=1, max_steps_per_epoch=4, epochs_run=0)
        setup_data_and_schedule(cfg, tokenizer, optimizer, state, ignore_index=-100)
        return [l for l in capsys.readouterr().err.splitlines() if "fake_quant_after_n_steps" in l]

    (line,) = warned(4)
    assert "fake_quant_after_n_steps=4 is not before the run's last step (4 optimizer steps)" in line
    assert warned(3) == []


def test_a_finished_runs_record_is_read_from_its_final_folder_else_its_last_state(tmp_path):
    from tune_recipes.training.checkpointing.io import CheckpointError
    from tune_recipes.training.setup.recipe import finished_run_record

    final = tmp_path / "epoch_1"
    final.mkdir()
    assert finished_run_record(final, tmp_path) == {}  # a one-epoch run of an older version
    (tmp_path / "recipe_state").mkdir()
    torch.save({"seed": 4, "max_steps_per_epoch": 2, "epochs_run": 1},
               tmp_path / "recipe_state" / "recipe_state.pt")
    assert finished_run_record(final, tmp_path)["seed"] == 4  # its last intermediate epoch's
    (final / "finished_run.json").write_text('{"seed": 5, "max_steps_per_epoch": 3, "epochs_run": 2}')
    assert finished_run_record(final, tmp_path) == {"seed": 5, "max_steps_per_epoch": 3, "epochs_run": 2}
    (final / "finished_run.json").write_text('{"seed": 5, ')
    with pytest.raises(CheckpointError, match="finished_run.json is unreadable"):
        finished_run_record(final, tmp_path)


def test_a_ctrl_c_inside_a_checkpoint_read_stays_a_ctrl_c():
    """torchtune wraps what its file reader raised in a ValueError; an interrupt among its
    causes is the user's stop (exit 130, the resume line), not an unreadable checkpoint."""
    from omegaconf import OmegaConf

    from tune_recipes.config import ConfigError
    from tune_recipes.training.setup.recipe import read_checkpoint

    class Reader:
        def __init__(self, inner):
            self.inner = inner

        def load_checkpoint(self):
            try:
                raise self.inner
            except BaseException as e:
                raise ValueError("Unable to load checkpoint from x.safetensors. ") from e

    cfg = OmegaConf.create({"_component_": "c", "checkpoint_dir": "/d", "model_type": "LLAMA3"})
    with pytest.raises(KeyboardInterrupt):
        read_checkpoint(Reader(KeyboardInterrupt()), cfg)
    with pytest.raises(ConfigError, match="could not load /d"):
        read_checkpoint(Reader(OSError("truncated")), cfg)

    class SwallowingReader:
        """A reader that turns the interrupt into an error of its own with no trace of it
        (safetensors' Rust code checks for signals), then wrapped by torchtune."""

        def load_checkpoint(self):
            try:
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(1)  # the handler runs here
            except KeyboardInterrupt:
                pass
            raise ValueError("Unable to load checkpoint from x.safetensors. ")

    import os
    import signal
    import time

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal
    try:
        with pytest.raises(KeyboardInterrupt):
            read_checkpoint(SwallowingReader(), cfg)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert signal.getsignal(signal.SIGINT) is previous  # the handler put back


def test_too_few_examples_for_one_step_names_the_dataset_size_and_a_batch_size_that_fits():
    from tune_recipes.training.setup.recipe import steps_per_epoch

    with pytest.raises(ConfigError, match=r"^the dataset yields 0 batches of batch_size=8 per process, "
                                          r"fewer than gradient_accumulation_steps=1 \(the dataset "
                                          r"holds 3 examples: batch_size=3 at most fits one step\)$"):
        steps_per_epoch(0, 1, None, 8, num_examples=3)
    # 3 examples over 2 processes: 2 a process (the sampler repeats one), batch_size=2 fits.
    with pytest.raises(ConfigError, match=r"holds 3 packs, 2 a process: batch_size=2 at most fits "
                                          r"one step\)$"):
        steps_per_epoch(0, 1, None, 4, num_examples=3, world_size=2, unit="packs")
    with pytest.raises(ConfigError, match=r"holds 1 examples, 1 a process: batch_size=1 at most"):
        steps_per_epoch(0, 1, None, 2, num_examples=1, world_size=2)
    # 2 micro-batches a step with 1 example a process: no batch size fits, none offered.
    with pytest.raises(ConfigError, match=r"holds 2 examples, 1 a process\)$"):
        steps_per_epoch(0, 2, None, 1, num_examples=2, world_size=2)
    assert steps_per_epoch(4, 2, None, 2, num_examples=8) == 2
