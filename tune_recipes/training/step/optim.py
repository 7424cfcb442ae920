"""Optimizer and LR-scheduler construction shared by the recipes."""

import inspect
import types
from typing import Any, Dict, Optional

import torch
from torch import nn
from torchtune import config as tt_config, training

from tune_recipes.config import ConfigError, resolve_component
from tune_recipes.modules.peft import state_dict_key
from tune_recipes.validation import compiled_step_refusal


def optimizer_in_bwd_flag(cfg) -> bool:
    """``optimizer_in_bwd`` from a config, refused with clipping (which needs every gradient at
    once; in-backward frees each one as soon as it has stepped)."""
    in_bwd = bool(cfg.get("optimizer_in_bwd", False))
    if in_bwd and cfg.get("clip_grad_norm", None) is not None:
        raise ConfigError(
            "clip_grad_norm needs every gradient at once, but optimizer_in_bwd=True frees "
            "each one inside backward: set clip_grad_norm=null or optimizer_in_bwd=False"
        )
    return in_bwd


def multi_tensor_options(cfg_optimizer, params) -> Dict[str, Any]:
    """``foreach=False`` where the trainable parameters mix DTensors and plain tensors, which
    torch's multi-tensor (foreach) kernels refuse ("got mixed torch.Tensor and DTensor").

    That mix is pure tensor parallelism (``tensor_parallel_dim`` = the world size): the plan
    slices the projections into DTensors, there is no FSDP to make the rest (norms) DTensors
    too, and on CUDA the optimizers default to foreach. Seen on 2 H200s; CPU optimizers default
    to the per-parameter loop, so CPU runs never showed it. An explicit ``foreach: True`` is a
    config error naming the key rather than a traceback at the first step."""
    from torch.distributed.tensor import DTensor

    kinds = {isinstance(p, DTensor) for p in params}
    if len(kinds) < 2:
        return {}
    foreach = cfg_optimizer.get("foreach", None)
    try:
        takes_foreach = "foreach" in inspect.signature(
            resolve_component(cfg_optimizer.get("_component_"), "optimizer")).parameters
    except (TypeError, ValueError):  # a builtin or C type without a readable signature
        takes_foreach = False
    if not takes_foreach:
        # torchao's low-bit AdamW, LBFGS, bitsandbytes: no foreach argument at all; they step
        # one parameter at a time, so the mix is no problem for them.
        return {}
    if foreach:
        raise ConfigError(
            "optimizer.foreach=True: the trainable parameters mix tensor-parallel DTensors and "
            "plain tensors (tensor parallelism without data parallelism), which the multi-tensor "
            "kernels refuse; set optimizer.foreach=False or leave it unset")
    return {} if foreach is False else {"foreach": False}


class OptimizerInBackward:
    """One optimizer per trainable parameter, stepped by a post-accumulate-grad hook as soon as
    that parameter's gradient is ready, then its gradient is freed. Peak memory never holds all
    gradients at once.

    ``step()`` and ``zero_grad()`` are no-ops because the hooks already did that work; recipes
    still call them on every path, so the step order reads the same in every configuration.
    """

    def __init__(self, cfg_optimizer, model: nn.Module) -> None:
        self.optim_map: Dict[str, torch.optim.Optimizer] = {}
        for name, p in model.named_parameters():
            # Keyed like the model's state dict, so a checkpoint saved with activation
            # checkpointing on resumes with it off and vice versa.
            name = state_dict_key(name)
            if not p.requires_grad:
                continue
            opt = tt_config.instantiate(cfg_optimizer, [p])
            self.optim_map[name] = opt
            p.register_post_accumulate_grad_hook(self._hook(opt))

    @staticmethod
    def _hook(opt: torch.optim.Optimizer):
        def step_and_free(param: torch.Tensor) -> None:
            opt.step()
            opt.zero_grad(set_to_none=True)

        return step_and_free

    def __iter__(self):
        """The per-parameter optimizers: torch.distributed.checkpoint's get/set
        ``optimizer_state_dict`` (torchtune's full-state helpers, FSDP2) take such an iterable,
        so a distributed checkpoint saves and loads them as one state keyed by parameter name."""
        return iter(self.optim_map.values())

    def step(self) -> None:
        pass

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass

    @property
    def first(self) -> torch.optim.Optimizer:
        return next(iter(self.optim_map.values()))

    @property
    def param_groups(self):
        return [g for o in self.optim_map.values() for g in o.param_groups]

    def set_lr(self, lr: float) -> None:
        for g in self.param_groups:
            g["lr"] = lr

    def state_dict(self) -> Dict[str, Any]:
        return {n: o.state_dict() for n, o in self.optim_map.items()}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        missing = set(self.optim_map) - set(state)
        if missing:
            raise ConfigError(
                "resume_from_checkpoint: the checkpoint's optimizer state holds no state per "
                f"parameter (missing {sorted(missing)[:3]}...): it was saved with "
                "optimizer_in_bwd=False, or by a distributed run; resume as it was saved")
        for n, o in self.optim_map.items():
            o.load_state_dict(state[n])


def build_optimizer(cfg_optimizer, model: nn.Module, optimizer_in_bwd: bool = False,
                    state_dict: Optional[Dict[str, Any]] = None, distributed: bool = False,
                    device: Optional[torch.device] = None, compile_step: bool = False):
    """The optimizer over ``model``'s trainable parameters, with a resumed run's state loaded.

    ``distributed``: the parameters are FSDP2 shards and ``state_dict`` is the full (gathered)
    state a distributed checkpoint holds; each rank loads its shard of it onto ``device``.
    ``compile_step`` (``compile_optimizer_step``): its ``step()`` runs compiled (torch's
    Adam/AdamW through ``CompiledOptimizerStep``; ``tune_recipes.optim.AdamW8bit`` as one graph
    a param group, its ``compile_whole_step``), not with ``optimizer_in_bwd``.
    """
    if compile_step:
        problem = compiled_step_refusal(optimizer_in_bwd, cfg_optimizer.get("_component_"))
        if problem:
            raise ConfigError(problem)
    if optimizer_in_bwd:
        opt = OptimizerInBackward(cfg_optimizer, model)
    else:
        params = [p for p in model.parameters() if p.requires_grad]
        options = multi_tensor_options(cfg_optimizer, params)
        # the refusal above has checked that the component resolves (to an allowed optimizer)
        compiles_itself = compile_step and _compiles_its_own_step(
            resolve_component(cfg_optimizer.get("_component_"), "optimizer"))
        if compiles_itself:
            options.update(compile_whole_step=True)
        elif compile_step:
            # The implementation torch.compile turns into a few fused kernels and that takes the
            # learning rate as a tensor (CompiledOptimizerStep); a fused=True in the config is
            # replaced, not an error: the compiled step is the faster one.
            options.update(fused=False, foreach=True, capturable=True)
        opt = tt_config.instantiate(cfg_optimizer, params, **options)
        if compile_step and not compiles_itself:
            CompiledOptimizerStep(opt).install()
    if state_dict is not None:
        if distributed and optimizer_in_bwd:
            # torchtune's helper takes one optimizer; torch's takes the per-parameter ones
            # (the checkpoint holds them as one full state keyed by parameter name).
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions,
                set_optimizer_state_dict,
            )

            set_optimizer_state_dict(
                model, optimizers=list(opt), optim_state_dict=state_dict,
                options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
        elif distributed:
            training.load_from_full_optimizer_state_dict(model, opt, state_dict, device)
        elif isinstance(opt, OptimizerInBackward):
            opt.load_state_dict(state_dict)  # per-parameter optimizers, one config: same flags
        else:
            if "param_groups" not in state_dict:  # per-parameter states, keyed by name
                raise ConfigError(
                    "resume_from_checkpoint: the checkpoint's optimizer state was saved with "
                    "optimizer_in_bwd=True; resume with optimizer_in_bwd=True, as it was saved")
            load_keeping_implementation(opt, state_dict)
    return opt


def _compiles_its_own_step(optimizer_class: Any) -> bool:
    """Our AdamW8bit, which compiles its step itself (``compile_whole_step``), not through
    ``CompiledOptimizerStep``."""
    from tune_recipes.optim import AdamW8bit

    return isinstance(optimizer_class, type) and issubclass(optimizer_class, AdamW8bit)


# The param-group entries that pick an optimizer's implementation, not its training settings.
IMPLEMENTATION_FLAGS = ("fused", "foreach", "capturable")


def load_keeping_implementation(opt: torch.optim.Optimizer, state_dict: Dict[str, Any]) -> None:
    """``opt.load_state_dict(state_dict)``, keeping the implementation this run chose.

    torch's ``load_state_dict`` replaces each param group with the saved one, implementation
    flags included, and places ``state["step"]`` by the saved flags. So a checkpoint of a
    ``compile_optimizer_step`` run (foreach, capturable) would make a plain resume run the
    slow eager foreach + capturable update (on the CPU: fail at its first step), and a plain
    fused checkpoint would turn a compiled resume's step back into fused AdamW, silently.
    NOTE: keep this; ``Optimizer.load_state_dict`` alone does not keep them.
    The flags are put back and each ``step`` moved where this run's implementation keeps it:
    float32 on the parameter's device for fused or capturable, the CPU otherwise."""
    chosen = [{k: g[k] for k in IMPLEMENTATION_FLAGS if k in g} for g in opt.param_groups]
    opt.load_state_dict(state_dict)
    for group, flags in zip(opt.param_groups, chosen):
        group.update(flags)
        on_device = bool(flags.get("fused")) or bool(flags.get("capturable"))
        for p in group["params"]:
            state = opt.state.get(p)
            step = state.get("step") if state else None
            if isinstance(step, torch.Tensor):
                state["step"] = (step.to(device=p.device, dtype=torch.float32) if on_device
                                 else step.to(device="cpu"))


class CompiledOptimizerStep:
    """``optimizer.step`` through ``torch.compile`` (``compile_optimizer_step``): Inductor fuses
    the multi-tensor Adam/AdamW update into a few kernels. On the H200 at Llama-3.2-1B's 146
    bf16 parameters: 4.52 ms a step against 6.44 for torch's fused AdamW (3.8 against 2.7 TB/s
    of the traffic a step needs).

    The learning rate: a Python float in ``param_groups`` can be a constant of the compiled
    code (Dynamo's ``specialize_float``; torch 2.13 defaults to passing it as a symbolic input
    instead), and then every scheduler change would recompile. Around each call the groups' ``lr`` is
    swapped for a 0-dim tensor on the parameters' device holding the same value (a fill, no
    host sync), and swapped back after; the scheduler, the logged rate and the checkpoint's
    ``param_groups`` keep seeing floats, so checkpoints load with or without this key.
    NOTE: keep the swap back; a tensor left in ``param_groups`` would make every read of the
    rate (logging) a device sync and change what the checkpoint holds.

    The first call compiles (~45 s at Llama-3.2-1B's shapes on the H200, the benchmark's
    warm-up; torch 2.13 on the CPU traces the lazily created state in that one compile). A
    parameter whose gradient is None on some steps and not on others recompiles for each new
    pattern. Optimizer step hooks, if any were registered, run inside the compiled call and
    see the tensor rate; the profiler's ``Optimizer.step`` range is not recorded there.
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        cls = type(optimizer)
        # torch's Adam/AdamW only: our AdamW8bit compiles its own step (build_optimizer)
        problem = compiled_step_refusal(False, f"{cls.__module__}.{cls.__qualname__}")
        if problem or _compiles_its_own_step(cls):
            raise ConfigError(problem or "CompiledOptimizerStep: AdamW8bit compiles its own step "
                              "(AdamW8bit(..., compile_whole_step=True))")
        self.optimizer = optimizer
        self._step = torch.compile(optimizer.step)  # the class's step, bound: no recursion
        self._lr = [torch.zeros((), dtype=torch.float32, device=g["params"][0].device)
                    for g in optimizer.param_groups]

    def install(self) -> None:
        """``optimizer.step()`` runs this from now on. A bound method, not this object: torch's
        LR schedulers re-wrap ``optimizer.step`` and need its ``__func__``."""
        runner = self

        def step(optimizer, closure=None):
            return runner(closure)

        self.optimizer.step = types.MethodType(step, self.optimizer)

    def __call__(self, closure=None):
        if closure is not None:
            raise ValueError("compile_optimizer_step: a closure is not supported")
        groups = self.optimizer.param_groups
        rates = [g["lr"] for g in groups]
        for group, tensor, rate in zip(groups, self._lr, rates):
            tensor.fill_(rate)
            group["lr"] = tensor
        try:
            return self._step()
        finally:
            for group, rate in zip(groups, rates):
                group["lr"] = rate


class LRSchedule:
    """Wraps an optional torch LR scheduler; works for a plain optimizer and for
    ``OptimizerInBackward`` (the scheduler drives the first optimizer, the others follow)."""

    def __init__(self, cfg_lr_scheduler, optimizer, num_training_steps: int, last_epoch: int) -> None:
        self.optimizer = optimizer
        self.scheduler = None
        if cfg_lr_scheduler is not None:
            base = optimizer.first if isinstance(optimizer, OptimizerInBackward) else optimizer
            self.scheduler = tt_config.instantiate(
                cfg_lr_scheduler, base, num_training_steps=num_training_steps,
                last_epoch=last_epoch,
            )
            self._sync()

    def _sync(self) -> None:
        if isinstance(self.optimizer, OptimizerInBackward):
            self.optimizer.set_lr(self.optimizer.first.param_groups[0]["lr"])

    def step(self) -> None:
        if self.scheduler is not None:
            self.scheduler.step()
            self._sync()

    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])
