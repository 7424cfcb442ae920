"""Quantization-aware training helpers shared by the QAT recipes and the quantize recipe."""

from pathlib import Path
from typing import Dict, Optional, Tuple

import torch
from torch import nn
from torchtune import config as tt_config
from torchtune.training import quantization as tt_quant

from tune_recipes.config import ConfigError
from tune_recipes.validation import group_size_problem


def build_quantizer(cfg_quantizer, dtype: Optional[torch.dtype] = None, require_qat: bool = True
                    ) -> Tuple[object, str]:
    """Instantiate ``quantizer`` and return it with its mode (e.g. "8da4w-qat")."""
    if cfg_quantizer is None:
        raise ConfigError("quantizer: missing; e.g. _component_: "
                          "torchtune.training.quantization.Int8DynActInt4WeightQATQuantizer")
    quantizer = tt_config.instantiate(cfg_quantizer)
    mode = tt_quant.get_quantizer_mode(quantizer)
    name = cfg_quantizer.get("_component_", type(quantizer).__name__)
    if mode is None:
        raise ConfigError(
            f"quantizer._component_: {name} is not a quantizer torchtune knows; use one of "
            "torchtune.training.quantization.{Int8DynActInt4WeightQATQuantizer, "
            "Int4WeightOnlyQATQuantizer, Int8DynActInt4WeightQuantizer, Int4WeightOnlyQuantizer}"
        )
    if require_qat and "qat" not in mode:
        raise ConfigError(f"quantizer._component_: {name} (mode {mode}) is not a QAT quantizer")
    if dtype is not None and hasattr(quantizer, "precision"):
        quantizer.precision = dtype
    return quantizer, mode


def check_group_size(model: nn.Module, quantizer) -> None:
    """Every linear layer the quantizer will touch must split into whole groups (a ConfigError
    naming the layer and its dims otherwise: torchao would leave it unquantized)."""
    group = getattr(quantizer, "groupsize", None) or getattr(quantizer, "group_size", None)
    problem = group_size_problem(model, group)
    if problem:
        raise ConfigError(problem)


class FakeQuantSchedule:
    """A step hook: fake quantization off for the first ``after_n_steps`` optimizer steps, then
    on; logs ``fake_quant`` (0/1) with every step."""

    def __init__(self, model: nn.Module, mode: str, after_n_steps: Optional[int]) -> None:
        self.model = model
        self.after_n_steps = after_n_steps
        self._disable = tt_quant._get_disable_fake_quant(mode)
        self._enable = tt_quant._get_enable_fake_quant(mode)
        self.enabled = True

    def before_step(self, global_step: int) -> None:
        """Runs before the step numbered ``global_step`` (0-based)."""
        if self.after_n_steps is None:
            return
        want = global_step >= self.after_n_steps
        if want != self.enabled:
            if self._enable is not None and self._disable is not None:
                try:
                    self.model.apply(self._enable if want else self._disable)
                except AttributeError:
                    # torchao 0.15's Int4WeightOnlyQATLinear has no activation fake quantizer
                    # (None) and its toggle sets one's flag: the loop below sets those it has.
                    pass
            # Also any fake quantizer outside torchao's QAT linears (our QAT + LoRA linears).
            for m in self.model.modules():
                if _is_fake_quantizer(m):
                    m.enabled = want
            self.enabled = want

    def metrics(self) -> Dict[str, int]:
        return {"fake_quant": int(self.enabled)}


def _is_fake_quantizer(module: nn.Module) -> bool:
    try:
        from torchao.quantization.qat.fake_quantizer import FakeQuantizerBase
    except ImportError:
        return False
    return isinstance(module, FakeQuantizerBase)


# The settings that decide which int4 values a weight rounds to (its groups' scales, the packed
# layout): a conversion must take the QAT run's.
_GROUPING = ("groupsize", "inner_k_tiles")


def _converts_as_trained(trained_mode: str, mode: str, same_class: bool) -> bool:
    """Whether a quantizer of ``mode`` converts a checkpoint whose QAT ran in ``trained_mode``
    into the model the fake quantization trained: the same class; a QAT quantizer of the same
    scheme (module swap or not: the same fake quantization); or, for 8da4w, the post-training
    ``Int8DynActInt4WeightQuantizer``, torchtune's documented conversion (its model equals the
    QAT conversion's, tested). Int4 weight-only's post-training quantizer rounds through another
    kernel path in torchao 0.15 (not shown equal): refused."""
    if same_class:
        return True
    scheme, trained_scheme = mode.split("-qat")[0], trained_mode.split("-qat")[0]
    if scheme != trained_scheme:
        return False
    return "qat" in mode or scheme == "8da4w"


def check_quantizer_against_the_qat_run(quantizer, cfg_quantizer, checkpoint_dir) -> None:
    """Converting a QAT checkpoint: ``quantizer`` (built from ``cfg_quantizer``) must quantize
    as the run trained (``_converts_as_trained``), with the same group size and layout
    (``_GROUPING``, compared on the built quantizers, so a default counts as its value). The
    run's ``config.yaml`` beside the checkpoint folder (``<output_dir>/epoch_<n>/``'s parent)
    records its quantizer; anything else is a ConfigError naming both. No record, or a run
    without a quantizer (not QAT): nothing to check."""
    import yaml
    from omegaconf import OmegaConf

    record = Path(str(checkpoint_dir)).parent / "config.yaml"
    if not record.is_file():
        return
    try:
        trained_cfg = (yaml.safe_load(record.read_text()) or {}).get("quantizer") or {}
    except (yaml.YAMLError, AttributeError):
        return
    if not isinstance(trained_cfg, dict) or not trained_cfg.get("_component_"):
        return
    theirs_name, ours_name = trained_cfg["_component_"], cfg_quantizer.get("_component_")
    where = f"the QAT run that wrote {checkpoint_dir} trained with"
    try:
        trained, trained_mode = build_quantizer(OmegaConf.create(trained_cfg), require_qat=False)
    except Exception:  # a record this torchtune cannot build: only the class can be compared
        trained, trained_mode = None, None
    mode = tt_quant.get_quantizer_mode(quantizer)
    if trained_mode is None or mode is None or not _converts_as_trained(
            trained_mode, mode, type(quantizer) is type(trained)):
        if ours_name != theirs_name:
            raise ConfigError(
                f"quantizer._component_={ours_name}, but {where} quantizer._component_="
                f"{theirs_name} ({record}): set quantizer._component_={theirs_name}, the "
                "quantization its fake quantization trained")
    for key in _GROUPING:
        # a record this torchtune cannot build: its written values against the config's
        theirs = getattr(trained, key, None) if trained is not None else trained_cfg.get(key)
        ours = getattr(quantizer, key, None) if trained is not None else cfg_quantizer.get(key)
        if theirs is not None and ours is not None and ours != theirs:
            raise ConfigError(
                f"quantizer.{key}={ours}, but {where} quantizer.{key}={theirs} ({record}): set "
                f"quantizer.{key}={theirs}, the quantization its fake quantization trained")
