"""tune_recipes.training.setup.recipe and .model: where a (resumed) run starts; the LoRA model."""

from pathlib import Path

import pytest
import torch
from torchtune import config as tt_config

from tune_recipes.config import ConfigError, load_config
from tune_recipes.training.checkpointing.state import RecipeState
from tune_recipes.training.setup.recipe import setup_data_and_schedule

pytestmark = pytest.mark.unit
CONFIG = Path(__file__).resolve().parents[2] / "configs" / "tiny" / "full_single_device.yaml"


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


def _lora_cfg(component="tune_recipes.models.lora_tiny_llama3"):
    from omegaconf import OmegaConf

    cfg = {"_component_": component}
    if "lora" in component:
        cfg.update(lora_attn_modules=["q_proj", "v_proj"], apply_lora_to_mlp=False,
                   apply_lora_to_output=False, lora_rank=4, lora_alpha=8)
    return OmegaConf.create(cfg)


def _base_state_dict():
    from tune_recipes.models import tiny_llama3

    torch.manual_seed(0)
    return tiny_llama3().state_dict()


def test_lora_model_trains_only_seeded_adapters_over_the_loaded_base():
    from tune_recipes.training.setup.model import setup_lora_model

    base = _base_state_dict()
    built = {}
    for seed in (7, 7, 8):
        model, lora = setup_lora_model(_lora_cfg(), dtype=torch.float32, device=torch.device("cpu"),
                                       seed=seed, base_state_dict=base, lora_state_dict=None)
        built.setdefault(seed, []).append(model)
    model = built[7][0]
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    assert lora.attn_modules == ["q_proj", "v_proj"] and not lora.apply_to_output
    sd = model.state_dict()
    for k, v in base.items():  # the base weights are the checkpoint's
        assert torch.equal(sd[k], v), k
    a7 = [p for n, p in built[7][0].named_parameters() if "lora_a" in n]
    a7_again = [p for n, p in built[7][1].named_parameters() if "lora_a" in n]
    a8 = [p for n, p in built[8][0].named_parameters() if "lora_a" in n]
    assert all(torch.equal(x, y) for x, y in zip(a7, a7_again))  # init depends on the seed only
    assert not all(torch.equal(x, y) for x, y in zip(a7, a8))


def test_lora_model_resumes_the_given_adapters():
    from tune_recipes.training.setup.model import setup_lora_model

    base = _base_state_dict()
    first, _ = setup_lora_model(_lora_cfg(), dtype=torch.float32, device=torch.device("cpu"),
                                seed=1, base_state_dict=base, lora_state_dict=None)
    adapters = {n: p.detach() + 1.0 for n, p in first.named_parameters() if p.requires_grad}
    resumed, _ = setup_lora_model(_lora_cfg(), dtype=torch.float32, device=torch.device("cpu"),
                                  seed=2, base_state_dict=base, lora_state_dict=adapters)
    for n, p in resumed.named_parameters():
        if n in adapters:
            assert torch.equal(p, adapters[n]), n


def test_lora_model_rejects_a_builder_without_adapters_naming_it():
    from tune_recipes.training.setup.model import setup_lora_model

    with pytest.raises(ConfigError, match="tune_recipes.models.tiny_llama3 has no LoRA adapters"):
        setup_lora_model(_lora_cfg("tune_recipes.models.tiny_llama3"), dtype=torch.float32,
                         device=torch.device("cpu"), seed=0, base_state_dict=_base_state_dict(),
                         lora_state_dict=None)


def test_lora_spec_of_a_non_lora_builder_names_the_missing_keys():
    from tune_recipes.training.checkpointing.io import LoRASpec

    with pytest.raises(ConfigError, match="model.lora_rank, model.lora_alpha, model.lora_attn_modules"):
        LoRASpec.from_model_config(_lora_cfg("tune_recipes.models.tiny_llama3"))
    spec = LoRASpec.from_model_config(_lora_cfg())
    assert (spec.rank, spec.alpha, spec.attn_modules) == (4, 8, ["q_proj", "v_proj"])
