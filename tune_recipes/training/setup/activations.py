"""Activation checkpointing: which transformer layers recompute their activations in backward.

Three config keys decide it, read here and nowhere else:

- ``enable_activation_checkpointing: True``: every transformer layer (torchtune's
  ``training.set_activation_checkpointing`` over every ``TransformerSelfAttentionLayer``).
- ``ac_mode`` / ``ac_option`` (torchtune 0.6.1's selective layer checkpointing, read there by
  full_finetune_distributed and qat_distributed; here by every training recipe), used with
  ``enable_activation_checkpointing: False``: ``ac_mode: full`` checkpoints every layer;
  ``ac_mode: selective`` with ``ac_option: k`` the layers whose 1-based index is a multiple of k
  (k=2 on 4 layers: the 2nd and 4th; k=0 or 1: every layer); ``ac_mode: none`` or null: none.

Trade-off: a checkpointed layer keeps only its input for backward and runs its forward twice
(about 30% more compute than no checkpointing when every layer is); checkpointing every k-th
layer keeps the other layers' activations, so memory and recompute sit between all and none.

Both being set is a config error here (``tune_recipes.validation.activation_checkpointing_problem``):
torchtune applies its full checkpointing only with ``ac_mode`` null and its selective one only
with ``enable_activation_checkpointing`` False, so with both set it silently checkpoints nothing.

A recipe carries the decision as one number, the interval::

    setup_full_model(..., ac_interval=ac_interval(cfg))   # or **fsdp_options(cfg), distributed

and the model setup calls ``apply_activation_checkpointing(model, interval, reentrant)``. The
wrappers are torch's ``CheckpointWrapper``, as torchtune's: state-dict keys are unchanged, so a
checkpoint saved from a selectively checkpointed model loads into a plain one and back.

Which checkpoint runs inside them (``checkpoint_reentrant(cfg)``, the single-device recipes):
torch's reentrant checkpoint when the layers run eagerly on one device without activation
offloading, torch's non-reentrant one (torchtune's) otherwise. The gradients are the same (both
recompute the same operations on the same inputs; bit for bit on the CPU, tested; on a GPU the
first forward runs without gradients, where SDPA may pick another kernel: a GPU test allows bf16
rounding).
What differs is host work: the non-reentrant checkpoint runs two Python hooks for every tensor
a layer saves, and recomputes from inside those hooks; the reentrant one runs the layer under
``no_grad`` (nothing saved) and, in backward, once more with gradients and a nested backward. Eager steps of small batches wait
on that host work: on the CPU, a 32-layer LoRA model of Llama-3.1-8B's layout at tiny widths
spent a third less host time a forward and backward (109 against 169 ms, one thread;
``scripts/bench_host_overhead.py``).
The price: the reentrant checkpoint recomputes a layer's whole forward, where the non-reentrant
one stops once what backward saved is back (in a LoRA layer one rank-r product more; in a full
fine-tune the MLP's down projection, ~7% more FLOPs a checkpointed step).
"""

from functools import partial
from typing import List, Optional

import torch
import torch.utils.checkpoint
from omegaconf import DictConfig
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper, checkpoint_wrapper
from torch.distributed.fsdp.wrap import lambda_auto_wrap_policy
from torchtune import training
from torchtune.modules import TransformerSelfAttentionLayer
from torchtune.utils import get_logger

from tune_recipes.config import ConfigError
from tune_recipes.validation import check_values

log = get_logger("INFO")

# The keys this module reads; their schema and cross-key rules live in tune_recipes.validation.
AC_KEYS = ("enable_activation_checkpointing", "ac_mode", "ac_option")


def ac_interval(cfg: DictConfig) -> Optional[int]:
    """The config's activation checkpointing as an interval: None (no layer), 1 (every
    transformer layer) or k (the layers whose 1-based index is a multiple of k). Raises the
    ConfigError ``tune validate`` reports for the same keys (one check: their rules in
    ``tune_recipes.validation``), so a direct caller cannot get past a bad value."""
    check_values(cfg, AC_KEYS, env=False)
    if cfg.get("enable_activation_checkpointing", False):
        return 1
    mode = cfg.get("ac_mode", None)
    if mode in (None, "none"):
        return None
    if mode == "full":
        return 1
    # selective; the schema took an int >= 0 or a digit string (torchtune int()s it too).
    every = int(cfg.get("ac_option"))
    return max(every, 1)  # torchtune: 0 checkpoints every layer, as 1 does


def layers_to_checkpoint(interval: Optional[int], num_layers: int) -> List[int]:
    """The 0-based indices of the ``num_layers`` layers that ``interval`` checkpoints: the
    k-th, 2k-th, ... counting from 1, as torchtune counts (k=2 on 4 layers: [1, 3])."""
    if interval is None:
        return []
    if interval < 1:
        raise ValueError(f"interval={interval}: expected None or an integer >= 1")
    return list(range(interval - 1, num_layers, interval))


def checkpoint_reentrant(cfg: DictConfig) -> bool:
    """Whether a single-device recipe's checkpointed layers use torch's reentrant checkpoint:
    yes unless ``compile`` (a compiled layer would be traced twice, once under ``no_grad``, and
    Inductor already saves little) or ``enable_activation_offloading`` (its saved-tensor hooks
    are built around the non-reentrant checkpoint's) is on. The distributed recipes never do:
    see ``apply_activation_checkpointing``."""
    return not cfg.get("compile", False) and not cfg.get("enable_activation_offloading", False)


_GRAD_TOKEN: List[torch.Tensor] = []


def _grad_token() -> torch.Tensor:
    """One empty CPU tensor that requires grad, shared by every checkpointed call (see
    ``_reentrant_checkpoint``); nothing reads it, so it never gets a gradient."""
    if not _GRAD_TOKEN:
        _GRAD_TOKEN.append(torch.empty(0, device="cpu", requires_grad=True))
    return _GRAD_TOKEN[0]


def _reentrant_checkpoint(layer: nn.Module, *args, **kwargs):
    """``layer(*args, **kwargs)`` through torch's reentrant checkpoint (the ``checkpoint_fn`` of
    a ``CheckpointWrapper``). Keyword arguments (the attention mask, positions) ride in a
    closure: the recompute reads the same objects, and they get no gradient, so a call with a
    keyword tensor that requires grad (Llama-3.2-Vision's decoder hands every layer its trained
    encoder's ``encoder_input``) goes through the non-reentrant checkpoint instead."""
    if not torch.is_grad_enabled():  # validation: nothing to recompute for
        return layer(*args, **kwargs)
    if any(torch.is_tensor(value) and value.requires_grad for value in kwargs.values()):
        return torch.utils.checkpoint.checkpoint(layer, *args, use_reentrant=False, **kwargs)
    run = partial(layer, **kwargs) if kwargs else layer
    if not any(torch.is_tensor(a) and a.requires_grad for a in args):
        if not any(p.requires_grad for p in layer.parameters()):
            return run(*args)  # nothing to train in it, nothing to backpropagate into
        # NOTE: the reentrant checkpoint's output requires grad only if an input does. A LoRA
        # model's first layer reads the frozen embedding's output, so without an input that
        # requires grad its output, and every later layer's, would need no gradient and no
        # adapter would get one. The token is that input: unread, so no input gradient is
        # computed for the layer and none is kept.
        return torch.utils.checkpoint.checkpoint(lambda *a: run(*a[:-1]), *args, _grad_token(),
                                                 use_reentrant=True)
    return torch.utils.checkpoint.checkpoint(run, *args, use_reentrant=True)


def apply_activation_checkpointing(model: nn.Module, interval: Optional[int],
                                   reentrant: bool = False) -> List[int]:
    """Wrap the transformer layers ``interval`` names in torch's checkpoint wrapper (the
    reentrant checkpoint inside with ``reentrant``, see ``checkpoint_reentrant``; else the
    non-reentrant one), in place, through torchtune's ``training.set_activation_checkpointing``.
    Returns the 0-based indices into ``model.layers`` now wrapped (empty for a model without
    ``layers``).

    NOTE: the distributed setup keeps ``reentrant=False``: FSDP2 unshards a layer's parameters
    in hooks around its forward and reshards them after, and the reentrant checkpoint's nested
    backward of the recomputed layer is not something those hooks are tested against.

    ``interval`` 1 wraps every ``TransformerSelfAttentionLayer`` wherever it sits, the call the
    recipes made before ``ac_mode`` existed. An interval k > 1 picks from ``model.layers`` (a
    torchtune ``TransformerDecoder``'s), as torchtune's selective checkpointing does, and wraps
    those layers with the same call and a narrower policy."""
    if interval is None:
        return []
    wrap = {"checkpoint_wrapper_fn": partial(checkpoint_wrapper, checkpoint_fn=_reentrant_checkpoint)} if reentrant else {}
    if interval == 1:
        # NOTE: not the index path below, though on a TransformerDecoder it wraps the same
        # modules: a model without ``layers`` (Llama-3.2-Vision's DeepFusionModel, whose encoder
        # and decoder layers are nested) keeps the checkpointing it always had.
        training.set_activation_checkpointing(model, auto_wrap_policy={TransformerSelfAttentionLayer}, **wrap)
    else:
        layers = getattr(model, "layers", None)
        if not isinstance(layers, nn.ModuleList):
            raise ConfigError(
                f"ac_mode=selective with ac_option={interval}: picks layers from model.layers (a "
                f"torchtune TransformerDecoder), which {type(model).__name__} does not have; use "
                "enable_activation_checkpointing=True (every transformer layer) instead")
        chosen = [layers[i] for i in layers_to_checkpoint(interval, len(layers))]
        policy = partial(lambda_auto_wrap_policy,
                         lambda_fn=lambda m: any(m is layer for layer in chosen))
        training.set_activation_checkpointing(model, auto_wrap_policy=policy, **wrap)
    layers = getattr(model, "layers", None)
    wrapped = [i for i, layer in enumerate(layers or []) if isinstance(layer, CheckpointWrapper)]
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        if layers is None:
            log.info("activation checkpointing: every transformer layer")
        else:
            log.info("activation checkpointing: %d of %d transformer layers (model.layers %s; %s)",
                     len(wrapped), len(layers), ", ".join(map(str, wrapped)) or "none",
                     "reentrant" if reentrant else "non-reentrant")
    return wrapped
