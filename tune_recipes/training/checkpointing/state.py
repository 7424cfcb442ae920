"""Where a run stands, and what a checkpoint holds, beyond the weights, to continue exactly."""

import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch
from omegaconf import DictConfig, OmegaConf
from torchtune import training

from tune_recipes.config import ConfigError
from tune_recipes.training.checkpointing.io import GLOBAL_STEP_KEY, RANK_STATES_KEY
from tune_recipes.training.step.driver import CUDA_RNG_STATE, RNG_STATE

RNG_KEY = "rng_state"
CUDA_RNG_KEY = "cuda_rng_state"
SKIPPED_STEPS_KEY = "skipped_steps"  # on_nonfinite=skip's running total of dropped updates
# The optimizer._component_ that made the checkpoint's optimizer state: a resume with another
# optimizer is refused by name (its states would fail deep inside the first step).
OPTIMIZER_COMPONENT_KEY = "optimizer_component"
# Whether that state was stepped inside backward (one state per parameter): a distributed run
# would load either form into the other without complaint and train on the wrong state.
OPTIMIZER_IN_BWD_KEY = "optimizer_in_bwd"
# Mid-epoch checkpoints (step_<n>/) only: GLOBAL_STEP_KEY, the optimizer steps run so far, and
# RANK_STATES_KEY, per rank (in rank order) its RNG state(s) and its dataloader's position.


# What kind of training wrote the checkpoint (``training_kind``): a resume by another kind,
# whose checkpoint files look alike (a full fine-tune's and QAT's, a LoRA run's and a
# distillation's), would continue one run under another objective.
TRAINING_KIND_KEY = "training_kind"
_TRAINING_KINDS = {
    "full": "a full fine-tune (full_finetune_*)",
    "lora": "a LoRA-type fine-tune (lora_finetune_*)",
    "qat": "quantization-aware training (qat_single_device, qat_distributed)",
    "qat_lora": "QAT with LoRA (qat_lora_finetune_distributed)",
    "kd": "knowledge distillation (knowledge_distillation_*)",
}


def training_kind(cfg: DictConfig) -> str:
    """The kind of training ``cfg`` configures, read from the keys each kind requires: a
    ``teacher_model`` (distillation), a ``quantizer`` (QAT), LoRA arguments of the model."""
    lora = OmegaConf.select(cfg, "model.lora_rank", default=None) is not None
    if cfg.get("teacher_model", None) is not None:
        return "kd"
    if cfg.get("quantizer", None) is not None:
        return "qat_lora" if lora else "qat"
    return "lora" if lora else "full"


def optimizer_identity(cfg: DictConfig) -> Tuple[Optional[str], bool]:
    """What a checkpoint's optimizer state depends on, from the run's config:
    (``optimizer._component_``, ``optimizer_in_bwd``). Recorded at save, compared at resume."""
    return (OmegaConf.select(cfg, "optimizer._component_", default=None),
            bool(cfg.get("optimizer_in_bwd", False)))


def seed_everything(seed: Optional[int], cfg: DictConfig) -> int:
    """torchtune's ``set_seed`` (every RNG; ``None`` picks one), with ``cudnn_deterministic_mode``
    as torchtune's recipes pass it: any value but null goes to torch.set_deterministic_debug_mode
    (False is its mode 0, which turns cuDNN benchmark on). Returns the seed."""
    return training.set_seed(seed=seed, debug_mode=cfg.get("cudnn_deterministic_mode", None))


@dataclass
class SavedState:
    """The recipe state a checkpoint holds (torchtune's key names, so stock tooling reads it)."""

    optimizer: Optional[Dict[str, Any]]
    seed: Optional[int]  # None: not recorded (a finished run continued), the config's stays
    epochs_run: int
    total_epochs: int
    max_steps_per_epoch: Optional[int]
    rng_state: Optional[torch.Tensor] = None
    cuda_rng_state: Optional[torch.Tensor] = None
    # Set for a mid-epoch checkpoint: it continues epoch ``epochs_run`` after ``global_step``.
    global_step: Optional[int] = None
    rank_states: Optional[List[Dict[str, Any]]] = None
    skipped_steps: int = 0
    optimizer_component: Optional[str] = None  # None: not recorded (an older checkpoint)
    optimizer_in_bwd: Optional[bool] = None  # likewise
    training_kind: Optional[str] = None  # likewise

    @property
    def mid_epoch(self) -> bool:
        return self.rank_states is not None

    @classmethod
    def from_checkpoint(cls, ckpt: Dict[str, Any]) -> "SavedState":
        missing = [k for k in (training.SEED_KEY, training.EPOCHS_KEY, training.TOTAL_EPOCHS_KEY)
                   if k not in ckpt]
        if missing:
            raise ConfigError(
                f"resume_from_checkpoint=True but the recipe state in output_dir lacks {missing}: "
                "was it written by this recipe? Point checkpointer.recipe_checkpoint at the "
                "right recipe_state.pt or set resume_from_checkpoint=False"
            )
        return cls(
            optimizer=ckpt.get(training.OPT_KEY),
            seed=ckpt[training.SEED_KEY],
            epochs_run=ckpt[training.EPOCHS_KEY],
            total_epochs=ckpt[training.TOTAL_EPOCHS_KEY],
            max_steps_per_epoch=ckpt.get(training.MAX_STEPS_KEY),
            rng_state=ckpt.get(RNG_KEY),
            cuda_rng_state=ckpt.get(CUDA_RNG_KEY),
            global_step=ckpt.get(GLOBAL_STEP_KEY),
            rank_states=ckpt.get(RANK_STATES_KEY),
            skipped_steps=ckpt.get(SKIPPED_STEPS_KEY, 0),
            optimizer_component=ckpt.get(OPTIMIZER_COMPONENT_KEY),
            optimizer_in_bwd=ckpt.get(OPTIMIZER_IN_BWD_KEY),
            training_kind=ckpt.get(TRAINING_KIND_KEY),
        )

    def check_optimizer(self, cfg: DictConfig) -> None:
        """Refuse to resume this state with the ``optimizer._component_`` and
        ``optimizer_in_bwd`` of ``cfg`` when the checkpoint's optimizer state was made otherwise
        (what the checkpoint recorded; older checkpoints and torchtune's record nothing and are
        not checked here). One class and its subclasses share states (torchao's ``AdamW8bit``
        and ``tune_recipes.optim``'s, torch's ``Adam`` and ``AdamW``); any other optimizer fails
        inside the first step (an 8-bit state handed to torch's AdamW, no ``momentum`` for SGD),
        and a distributed run would load a state of the other ``optimizer_in_bwd`` form and
        train on it wrongly."""
        if self.optimizer is None:
            return
        component, in_bwd = optimizer_identity(cfg)
        fresh = ("start a new run from its weights instead: another output_dir, with "
                 "checkpointer.checkpoint_dir pointing at the checkpoint folder")
        saved = self.optimizer_component
        if saved is not None and component is not None and saved != component \
                and not _same_state_family(saved, component):
            raise ConfigError(
                f"resume_from_checkpoint: the checkpoint's optimizer state was made by "
                f"optimizer._component_={saved}, this run's is {component}: resume with "
                f"optimizer._component_={saved}, or {fresh}")
        if self.optimizer_in_bwd is not None and bool(self.optimizer_in_bwd) != bool(in_bwd):
            raise ConfigError(
                f"resume_from_checkpoint: the checkpoint's optimizer state was saved with "
                f"optimizer_in_bwd={bool(self.optimizer_in_bwd)}, this run has "
                f"optimizer_in_bwd={bool(in_bwd)}: resume with "
                f"optimizer_in_bwd={bool(self.optimizer_in_bwd)}, or {fresh}")

    def _saved_param_groups(self) -> List[Dict[str, Any]]:
        """The saved optimizer's param groups: one optimizer's, or with ``optimizer_in_bwd``
        those of the optimizer of each parameter."""
        opt = self.optimizer
        if not isinstance(opt, dict):
            return []
        if isinstance(opt.get("param_groups"), list):
            return opt["param_groups"]
        return [g for v in opt.values() if isinstance(v, dict)
                for g in v.get("param_groups", []) if isinstance(g, dict)]

    def keep_optimizer_settings(self, cfg: DictConfig, is_main: bool = True) -> None:
        """The resumed optimizer state restores its ``lr`` and ``weight_decay`` (torch's
        ``load_state_dict``, as in torchtune): a config that changed them since trains with the
        checkpoint's. Say so, and put the checkpoint's values into ``cfg`` so that the run's
        config.yaml records what it trains with."""
        groups = self._saved_param_groups()
        optimizer = cfg.get("optimizer", None)
        if not groups or optimizer is None:
            return
        # lr: the base rate a scheduler started from (initial_lr), else the group's own.
        saved = {"lr": groups[0].get("initial_lr", groups[0].get("lr")),
                 "weight_decay": groups[0].get("weight_decay")}
        for key, kept in saved.items():
            configured = optimizer.get(key, None)
            try:
                # NOTE: float(): torchao's AdamW8bit (and tune_recipes.optim's) keeps lr as a
                # 0-dim fp32 tensor, which OmegaConf cannot hold and prints as 0.00300000002.
                if isinstance(kept, torch.Tensor):
                    kept = float(f"{kept.item():.7g}")  # fp32's 7 significant digits
                elif kept is not None:
                    kept = float(kept)
                same = configured is None or kept is None or math.isclose(
                    float(configured), kept, rel_tol=1e-6)
            except (TypeError, ValueError):
                continue
            if same:
                continue
            if is_main:
                print(f"warning: config optimizer.{key}={configured} differs from the "
                      f"checkpoint's {kept}; using the checkpoint's (its optimizer state holds "
                      "it; to train on with another value, start a new run from its weights: "
                      "another output_dir, checkpointer.checkpoint_dir at the checkpoint "
                      "folder)", file=sys.stderr)
            optimizer[key] = kept

    def check_training_kind(self, cfg: DictConfig, checkpoint: Path) -> None:
        """Refuse to resume a checkpoint another kind of training wrote (``training_kind``;
        older checkpoints record none and are not checked)."""
        kind = training_kind(cfg)
        if self.training_kind is None or self.training_kind == kind:
            return
        saved = _TRAINING_KINDS.get(self.training_kind, self.training_kind)
        raise ConfigError(
            f"resume_from_checkpoint: {checkpoint} was written by {saved}, and this config runs "
            f"{_TRAINING_KINDS[kind]}: resume it with its own recipe and config, or start a new "
            "run from its weights: another output_dir, with checkpointer.checkpoint_dir "
            "pointing at the checkpoint folder")

    def check_epochs(self, cfg: DictConfig, checkpoint: Path) -> None:
        """Refuse to resume this state with ``cfg.epochs`` at or below the epochs it has run:
        there is nothing to train from ``checkpoint`` (a mid-epoch one is inside epoch
        ``epochs_run``; an epoch one is after it). NOTE: a ConfigError, not the quiet exit of a
        finished run continued (``_continue_finished_run``): a run that stopped before its
        last epoch only reaches this with ``epochs`` lowered since, and the resume would
        otherwise rewrite config.yaml and the metrics of a run that trains nothing."""
        epochs = cfg.get("epochs", None)
        if not isinstance(epochs, int) or isinstance(epochs, bool) or epochs > self.epochs_run:
            return
        where = (f"at step {self.global_step}, inside epoch {self.epochs_run + 1}" if self.mid_epoch
                 else f"after epoch {self.epochs_run}")
        raise ConfigError(
            f"epochs={epochs}: the checkpoint being resumed, {checkpoint}, is {where} of the "
            f"{self.total_epochs} it was written for, so nothing is left to train from there: "
            f"resume with epochs={self.total_epochs} (or more than {self.epochs_run})")


def _same_state_family(a: str, b: str) -> bool:
    from tune_recipes.config import resolve_component

    try:
        cls_a, cls_b = (resolve_component(c, "optimizer") for c in (a, b))
    except Exception:  # the saved one no longer imports: nothing to compare but the names
        return False
    return cls_a is cls_b or isinstance(cls_a, type) and isinstance(cls_b, type) and (
        issubclass(cls_a, cls_b) or issubclass(cls_b, cls_a))


@dataclass
class RecipeState:
    """The run's counters and seed, owned by the recipe and advanced by the step driver.

    The data order depends only on (seed, epoch, rank), so at an epoch boundary this, with the
    RNG, is all a resumed run needs besides weights and optimizer state. A mid-epoch checkpoint
    adds the step driver's ``Position`` (global step; each rank's RNG and dataloader state).
    """

    seed: int
    total_epochs: int
    max_steps_per_epoch: Optional[int]
    epochs_run: int = 0
    skipped_steps: int = 0  # on_nonfinite=skip; kept in sync by the step driver
    optimizer_component: Optional[str] = None  # recorded with the optimizer state
    optimizer_in_bwd: bool = False  # likewise
    seed_configured: bool = True  # False: `seed: null`, a seed drawn for the run
    training_kind: Optional[str] = None  # recorded with the checkpoint (``training_kind``)

    @classmethod
    def from_config(cls, cfg: DictConfig) -> "RecipeState":
        """Seeds every RNG (``seed``), sets torch's deterministic mode
        (``cudnn_deterministic_mode``) and reads ``epochs``, ``max_steps_per_epoch`` and
        ``optimizer._component_``."""
        component, in_bwd = optimizer_identity(cfg)
        return cls(seed=seed_everything(cfg.seed, cfg), total_epochs=cfg.epochs,
                   max_steps_per_epoch=cfg.get("max_steps_per_epoch", None),
                   optimizer_component=component, optimizer_in_bwd=in_bwd,
                   seed_configured=cfg.get("seed", None) is not None,
                   training_kind=training_kind(cfg))

    def checkpoint_entries(self, optimizer_state: Optional[Dict[str, Any]],
                           position=None) -> Dict[str, Any]:
        """Checkpoint dict entries that let a run continue from here; ``position`` (the step
        driver's ``Position``, all ranks gathered) for a mid-epoch checkpoint."""
        out = {
            training.SEED_KEY: self.seed,
            training.EPOCHS_KEY: self.epochs_run,
            training.TOTAL_EPOCHS_KEY: self.total_epochs,
            training.MAX_STEPS_KEY: self.max_steps_per_epoch,
            RNG_KEY: torch.get_rng_state(),
            SKIPPED_STEPS_KEY: self.skipped_steps,
        }
        if self.training_kind is not None:
            out[TRAINING_KIND_KEY] = self.training_kind
        if optimizer_state is not None:
            out[training.OPT_KEY] = optimizer_state
            if self.optimizer_component is not None:
                out[OPTIMIZER_COMPONENT_KEY] = self.optimizer_component
            out[OPTIMIZER_IN_BWD_KEY] = self.optimizer_in_bwd
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            out[CUDA_RNG_KEY] = torch.cuda.get_rng_state()
        if position is not None:
            out[GLOBAL_STEP_KEY] = position.global_step
            out[RANK_STATES_KEY] = position.ranks
        return out

    def resume(self, saved: SavedState, rank: int = 0) -> None:
        """Continue from ``saved``: its counters and RNG (this ``rank``'s own, for a mid-epoch
        checkpoint); its seed and steps-per-epoch win over the config (changing them mid-run
        would change the data order)."""
        differing = []
        if saved.seed is not None and self.seed != saved.seed:
            if self.seed_configured:  # a seed drawn for this run (`seed: null`) differs silently
                differing.append(("seed", self.seed, saved.seed))
            self.seed = saved.seed
        if self.max_steps_per_epoch != saved.max_steps_per_epoch:
            differing.append(("max_steps_per_epoch", self.max_steps_per_epoch,
                              saved.max_steps_per_epoch))
            self.max_steps_per_epoch = saved.max_steps_per_epoch
        if rank == 0:
            for key, configured, kept in differing:
                print(f"warning: config {key}={configured} differs from the checkpoint's "
                      f"{kept}; using the checkpoint's", file=sys.stderr)
        self.epochs_run = saved.epochs_run
        self.skipped_steps = saved.skipped_steps
        rng, cuda_rng = saved.rng_state, saved.cuda_rng_state
        if saved.mid_epoch:
            if not 0 <= rank < len(saved.rank_states):
                raise ConfigError(
                    f"the mid-epoch checkpoint was written by {len(saved.rank_states)} "
                    f"process(es); this is rank {rank}: resume with the same --nproc_per_node"
                )
            # Ranks are seeded seed + rank (torchtune's set_seed): each restores its own.
            rng = saved.rank_states[rank].get(RNG_STATE)
            cuda_rng = saved.rank_states[rank].get(CUDA_RNG_STATE)
        if rng is not None:
            torch.set_rng_state(rng)
        if cuda_rng is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state(cuda_rng)
