"""tune_recipes.training.step.optim: optimizer construction, the in-backward optimizer, the LR
schedule."""

import copy
import sys

import pytest
import torch
from omegaconf import OmegaConf
from torchtune import training
from torchtune.modules import TransformerSelfAttentionLayer

from tune_recipes.config import ConfigError
from tune_recipes.models.tiny import lora_tiny_llama3
from tune_recipes.training.step.optim import (
    CompiledOptimizerStep,
    LRSchedule,
    OptimizerInBackward,
    build_optimizer,
    optimizer_in_bwd_flag,
)

pytestmark = pytest.mark.unit
SGD = OmegaConf.create({"_component_": "torch.optim.SGD", "lr": 0.1})
ADAMW = OmegaConf.create({"_component_": "torch.optim.AdamW", "lr": 0.01})
COSINE = OmegaConf.create({"_component_": "torchtune.training.lr_schedulers.get_cosine_schedule_with_warmup",
                           "num_warmup_steps": 2})


def _mlp(seed=0):
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    m[0].bias.requires_grad_(False)
    return m


def _step(model, opt, seed):
    g = torch.Generator().manual_seed(seed)
    model(torch.randn(3, 4, generator=g)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def test_optimizer_in_backward_is_keyed_like_the_state_dict():
    torch.manual_seed(0)
    model = lora_tiny_llama3(["q_proj", "v_proj"], apply_lora_to_mlp=True, lora_rank=4)
    for n, p in model.named_parameters():
        p.requires_grad_("lora" in n)
    training.set_activation_checkpointing(model, auto_wrap_policy={TransformerSelfAttentionLayer})
    opt = OptimizerInBackward(SGD, model)
    assert set(opt.optim_map) <= set(model.state_dict())


def test_optimizer_in_backward_equals_a_plain_optimizer():
    plain_model, bwd_model = _mlp(), _mlp()
    plain = build_optimizer(ADAMW, plain_model)
    bwd = build_optimizer(ADAMW, bwd_model, optimizer_in_bwd=True)
    assert len(bwd.optim_map) == 3  # trainable parameters only
    for s in range(3):
        _step(plain_model, plain, s)
        _step(bwd_model, bwd, s)
    for a, b in zip(plain_model.parameters(), bwd_model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
        assert b.grad is None  # freed inside backward


def test_build_optimizer_resumes_state_and_skips_frozen_parameters():
    model = _mlp()
    opt = build_optimizer(ADAMW, model)
    assert sum(len(g["params"]) for g in opt.param_groups) == 3
    _step(model, opt, 0)
    again = build_optimizer(ADAMW, model, state_dict=opt.state_dict())
    assert again.state_dict()["state"][0]["step"] == opt.state_dict()["state"][0]["step"] == 1


def test_in_backward_state_must_come_from_an_in_backward_run_and_the_other_way_round():
    model = _mlp()
    with pytest.raises(ConfigError, match="holds no state per parameter.*saved with "
                                          "optimizer_in_bwd=False, or by a distributed run"):
        build_optimizer(ADAMW, model, optimizer_in_bwd=True,
                        state_dict=build_optimizer(ADAMW, model).state_dict())
    with pytest.raises(ConfigError, match="saved with optimizer_in_bwd=True; resume with "
                                          "optimizer_in_bwd=True"):
        build_optimizer(ADAMW, model, optimizer_in_bwd=False,
                        state_dict=build_optimizer(ADAMW, model, optimizer_in_bwd=True).state_dict())


def test_lr_schedule_drives_every_in_backward_optimizer_and_resumes_mid_run():
    model = _mlp()
    opt = build_optimizer(ADAMW, model, optimizer_in_bwd=True)
    sched = LRSchedule(COSINE, opt, num_training_steps=10, last_epoch=-1)
    lrs = [sched.lr]
    for _ in range(4):
        sched.step()
        lrs.append(sched.lr)
    assert lrs[0] == 0.0 and lrs[2] == pytest.approx(0.01)
    assert {g["lr"] for g in opt.param_groups} == {lrs[-1]}
    # A resumed run loads the optimizer state (it carries initial_lr), then positions the schedule.
    again = build_optimizer(ADAMW, _mlp(), optimizer_in_bwd=True, state_dict=opt.state_dict())
    resumed = LRSchedule(COSINE, again, num_training_steps=10, last_epoch=3)
    assert resumed.lr == pytest.approx(lrs[4])


def test_no_scheduler_keeps_the_optimizer_lr():
    opt = build_optimizer(SGD, _mlp())
    sched = LRSchedule(None, opt, num_training_steps=10, last_epoch=-1)
    sched.step()
    assert sched.lr == 0.1


def test_optimizer_in_bwd_flag_refuses_clipping():
    assert not optimizer_in_bwd_flag(OmegaConf.create({"clip_grad_norm": 1.0}))
    assert optimizer_in_bwd_flag(OmegaConf.create({"optimizer_in_bwd": True, "clip_grad_norm": None}))
    with pytest.raises(ConfigError, match="clip_grad_norm=null or optimizer_in_bwd=False"):
        optimizer_in_bwd_flag(OmegaConf.create({"optimizer_in_bwd": True, "clip_grad_norm": "inf"}))


def test_in_backward_optimizer_iterates_its_per_parameter_optimizers():
    # torch.distributed.checkpoint's get/set_optimizer_state_dict take an iterable of optimizers
    model = _mlp()
    opt = build_optimizer(ADAMW, model, optimizer_in_bwd=True)
    optimizers = list(opt)
    assert len(optimizers) == len([p for p in model.parameters() if p.requires_grad])
    assert all(isinstance(o, torch.optim.AdamW) for o in optimizers)


def _half_tensor_parallel_model():
    """One DTensor weight (as a tensor-parallel plan makes it) beside plain ones (the rest)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    model = _mlp()
    mesh = init_device_mesh("cpu", (1,))
    model[0].weight = torch.nn.Parameter(distribute_tensor(model[0].weight.detach(), mesh, [Replicate()]))
    return model


def test_mixed_dtensor_and_plain_parameters_get_the_per_parameter_loop(one_rank):
    """Pure tensor parallelism on CUDA failed at the first step: the foreach kernels refuse a
    list mixing DTensors and plain tensors. The optimizer is built with foreach=False then (and
    still steps); an explicit foreach=True is a config error naming the key."""
    from tune_recipes.training.step.optim import build_optimizer

    model = _half_tensor_parallel_model()
    cfg = OmegaConf.create({"_component_": "torch.optim.AdamW", "lr": 1e-2})
    opt = build_optimizer(cfg, model)
    assert opt.defaults["foreach"] is False
    x = torch.randn(3, 4)
    from torch.distributed.tensor import DTensor, Replicate

    w0 = model[0].weight
    hidden = torch.nn.functional.linear(DTensor.from_local(x, w0.device_mesh, [Replicate()]), w0)
    (model[1](hidden.to_local() + model[0].bias)).sum().backward()
    before = model[1].weight.detach().clone()
    opt.step()
    assert not torch.equal(model[1].weight, before)
    with pytest.raises(ConfigError, match="optimizer.foreach=True"):
        build_optimizer(OmegaConf.create({**cfg, "foreach": True}), model)
    # Without the mix nothing is forced (CUDA keeps its foreach default).
    assert build_optimizer(cfg, _mlp()).defaults["foreach"] is None
    # Optimizers without a foreach argument (torchao's low-bit AdamW) are built as asked.
    low_bit = build_optimizer(OmegaConf.create({"_component_": "torchao.optim.AdamW8bit", "lr": 1e-2}), model)
    assert "foreach" not in low_bit.defaults


# ---------------------------------------------------------------- compile_optimizer_step

FUSED_ADAMW = OmegaConf.create({"_component_": "torch.optim.AdamW", "lr": 0.01, "fused": True,
                                "weight_decay": 0.01})


def _train_with_schedule(model, opt, steps):
    """``steps`` optimizer steps under torchtune's warmup + cosine schedule (the rate changes
    every step), as the recipes drive them."""
    schedule = LRSchedule(COSINE, opt, num_training_steps=steps, last_epoch=-1)
    rates = []
    for i in range(steps):
        rates.append(schedule.lr)
        _step(model, opt, seed=i)
        schedule.step()
    return rates


def _step64(model, opt, seed):
    g = torch.Generator().manual_seed(seed)
    model(torch.randn(3, 4, generator=g).double()).pow(2).mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def test_compiled_step_follows_the_fused_adamw_and_keeps_float_rates(monkeypatch):
    """compile_optimizer_step against the recipes' default (fused AdamW), fp32, 6 steps with a
    rate that changes every step, both measured against the same training in float64: both
    within fp32's 1e-6 of the largest weight (the compiled kernels order the operations
    differently: 2.2e-7 vs 5e-8 here); the same rates; param_groups hold floats between steps
    (logging and checkpoints read them); the state loads into a plain optimizer and back."""
    plain, compiled, ref = _mlp(), _mlp(), _mlp().double()
    opt_plain = build_optimizer(FUSED_ADAMW, plain)
    opt_compiled = build_optimizer(FUSED_ADAMW, compiled, compile_step=True)
    flags = opt_compiled.param_groups[0]
    assert flags["capturable"] and flags["foreach"] and not flags["fused"]
    rates_plain = _train_with_schedule(plain, opt_plain, 6)
    rates_compiled = _train_with_schedule(compiled, opt_compiled, 6)
    assert rates_plain == rates_compiled and len(set(rates_plain)) > 3
    opt_ref = build_optimizer(OmegaConf.merge(FUSED_ADAMW, {"fused": False}), ref)
    monkeypatch.setattr(sys.modules[__name__], "_step", _step64)
    _train_with_schedule(ref, opt_ref, 6)
    for a, b, r in zip(plain.parameters(), compiled.parameters(), ref.parameters()):
        err_fused, err_compiled = (a.double() - r).abs().max(), (b.double() - r).abs().max()
        bound = 1e-6 * r.abs().max()
        assert err_fused < bound and err_compiled < bound, (err_compiled, err_fused, bound)
    assert all(type(g["lr"]) is float for g in opt_compiled.param_groups)


@pytest.mark.parametrize("saved_compiled", [True, False])
def test_a_checkpoint_resumes_with_or_without_the_compiled_step(saved_compiled):
    """torch's load_state_dict takes the saved param groups' implementation flags: a compiled
    run's checkpoint would make a plain resume capturable (on the CPU its first step fails) and a
    fused checkpoint would quietly turn a compiled resume back into fused AdamW. Resuming
    across keeps this run's implementation, and the step goes on as it would have."""
    saver = _mlp()
    opt = build_optimizer(FUSED_ADAMW, saver, compile_step=saved_compiled)
    for i in range(3):
        _step(saver, opt, seed=i)
    resumed_model = _mlp()
    resumed_model.load_state_dict(saver.state_dict())
    # A deep copy, as from disk: a live state_dict shares its tensors with ``opt``.
    resumed = build_optimizer(FUSED_ADAMW, resumed_model, state_dict=copy.deepcopy(opt.state_dict()),
                              compile_step=not saved_compiled)
    flags = resumed.param_groups[0]
    assert (flags["capturable"], flags["fused"]) == ((True, False) if not saved_compiled
                                                     else (False, True))
    step = resumed.state[next(iter(resumed.state))]["step"]
    assert float(step) == 3.0 and step.dtype == torch.float32
    _step(saver, opt, seed=3)
    _step(resumed_model, resumed, seed=3)  # runs (no capturable assertion), and the same update
    for a, b in zip(saver.parameters(), resumed_model.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


def test_compiled_step_does_not_recompile_when_the_rate_changes(monkeypatch):
    """The rate is handed to the compiled step as a tensor: a changing rate must not recompile,
    even where Dynamo makes Python floats constants of the compiled code (specialize_float=True;
    torch 2.13's default, False, would hide a float rate's recompiles). Two compiles are
    expected at most (torch 2.13 on the CPU traces the lazily created state in one)."""
    from torch._dynamo.testing import CompileCounter

    counter = CompileCounter()
    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn: real_compile(fn, backend=counter))
    torch._dynamo.reset()
    # NOTE: the config's own patch, not monkeypatch: monkeypatch's undo deletes an attribute
    # the module's __dict__ did not hold, and a deleted dynamo config entry is hidden for the
    # rest of the process ("torch._dynamo.config.specialize_float does not exist" at the next
    # compile of any later test in the same worker).
    with torch._dynamo.config.patch(specialize_float=True):
        model = _mlp()
        opt = build_optimizer(ADAMW, model, compile_step=True)
        rates = _train_with_schedule(model, opt, 8)
    torch._dynamo.reset()
    assert len(set(rates)) > 4
    assert 1 <= counter.frame_count <= 2, counter.frame_count


def test_compiled_step_is_refused_with_in_backward_or_other_optimizers():
    with pytest.raises(ConfigError, match="optimizer_in_bwd=True"):
        build_optimizer(ADAMW, _mlp(), optimizer_in_bwd=True, compile_step=True)
    with pytest.raises(ConfigError, match="torch.optim.SGD: only torch.optim.Adam, torch.optim.AdamW "
                                          "and tune_recipes.optim.AdamW8bit are supported"):
        build_optimizer(SGD, _mlp(), compile_step=True)
    torchaos = OmegaConf.create({"_component_": "torchao.optim.AdamW8bit", "lr": 1e-2})
    with pytest.raises(ConfigError, match="torchao.optim.AdamW8bit: only"):
        build_optimizer(torchaos, _mlp(), compile_step=True)  # its step compiles per parameter


def test_compiled_step_of_adamw8bit_is_its_own_one_graph_step():
    """compile_optimizer_step with our AdamW8bit: the optimizer steps its parameters in one
    graph itself (``compile_whole_step``; tested against torchao's step in test_adamw8bit.py),
    not through CompiledOptimizerStep, whose foreach/capturable options it does not take."""
    from tune_recipes.optim import AdamW8bit

    cfg = OmegaConf.create({"_component_": "tune_recipes.optim.AdamW8bit", "lr": 1e-2})
    compiled, plain = build_optimizer(cfg, _mlp(), compile_step=True), build_optimizer(cfg, _mlp())
    assert compiled.compile_whole_step and not plain.compile_whole_step
    assert compiled.step.__func__ is AdamW8bit.step  # not replaced by CompiledOptimizerStep
    assert "capturable" not in compiled.param_groups[0]
    with pytest.raises(ConfigError, match="AdamW8bit compiles its own step"):
        CompiledOptimizerStep(plain)  # a compiled step around compiled calls: refused


# ---------------------------------------------------------------- torchao's 8-bit AdamW in backward


def test_adamw8bit_in_backward_resumes_exactly_from_a_saved_recipe_state(tmp_path):
    """The 3B and 8B full configs step AdamW8bit (torchao's states, large parameters stepped in
    row slices: here the 64 x 256 weight in four) inside backward. Its states are
    tensor subclasses (8-bit codes and block scales): they must survive the recipe state's
    ``weights_only`` load still quantized (loaded as fp32 they would double the optimizer's
    memory), and the resumed steps must equal the uninterrupted ones bit for bit."""
    from torchao.optim.subclass_8bit import OptimState8bit

    from tune_recipes.training.checkpointing.io import load_recipe_state

    adamw8bit = OmegaConf.create({"_component_": "tune_recipes.optim.AdamW8bit", "lr": 1e-2,
                                  "chunk_numel": 4096})

    def model_():
        torch.manual_seed(0)  # 256 x 64 = 16,384 elements: quantized (torchao keeps < 4,096 in fp32)
        return torch.nn.Sequential(torch.nn.Linear(256, 64, bias=False), torch.nn.Linear(64, 2))

    def step(model, seed):
        g = torch.Generator().manual_seed(seed)
        model(torch.randn(5, 256, generator=g)).pow(2).mean().backward()

    # NOTE: eager, not torchao's compiled step (minutes of CPU compile); the compiled step's
    # own numerics are torchao's, what is tested here is the state's round trip.
    with torch.compiler.set_stance("force_eager"):
        straight = model_()
        opt = build_optimizer(adamw8bit, straight, optimizer_in_bwd=True)
        for s in range(2):
            step(straight, s)
        torch.save({"optimizer": opt.state_dict()}, tmp_path / "recipe_state.pt")
        resumed = model_()
        resumed.load_state_dict(straight.state_dict())
        saved = load_recipe_state(tmp_path / "recipe_state.pt")["optimizer"]
        again = build_optimizer(adamw8bit, resumed, optimizer_in_bwd=True, state_dict=saved)
        state = again.optim_map["0.weight"].state_dict()["state"][0]
        for key in ("exp_avg", "exp_avg_sq"):
            assert isinstance(state[key], OptimState8bit) and state[key].codes.dtype == torch.uint8, key
        for s in range(2, 4):
            step(straight, s)
            step(resumed, s)
    for a, b in zip(straight.parameters(), resumed.parameters()):
        assert torch.equal(a, b)
    assert not torch.equal(straight[0].weight, model_()[0].weight)  # it trained
