"""Optimizer and LR-scheduler construction shared by the recipes."""

from typing import Any, Dict, Optional

import torch
from torch import nn
from torchtune import config as tt_config, training

from tune_recipes.modules.peft import state_dict_key


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
            raise RuntimeError(
                "optimizer state in the checkpoint was not saved with optimizer_in_bwd=True "
                f"(missing {sorted(missing)[:3]}...); resume with the same optimizer_in_bwd"
            )
        for n, o in self.optim_map.items():
            o.load_state_dict(state[n])


def build_optimizer(cfg_optimizer, model: nn.Module, optimizer_in_bwd: bool = False,
                    state_dict: Optional[Dict[str, Any]] = None, distributed: bool = False,
                    device: Optional[torch.device] = None):
    """The optimizer over ``model``'s trainable parameters, with a resumed run's state loaded.

    ``distributed``: the parameters are FSDP2 shards and ``state_dict`` is the full (gathered)
    state a distributed checkpoint holds; each rank loads its shard of it onto ``device``.
    """
    if optimizer_in_bwd:
        opt = OptimizerInBackward(cfg_optimizer, model)
    else:
        opt = tt_config.instantiate(cfg_optimizer, [p for p in model.parameters() if p.requires_grad])
    if state_dict is not None:
        if distributed:
            training.load_from_full_optimizer_state_dict(model, opt, state_dict, device)
        else:
            opt.load_state_dict(state_dict)
    return opt


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
