"""One declarative schema for every config value our recipes read, checked before any work.

``check_config`` runs in three places with the same rules: the recipe's ``@parse`` entry point
(every process, before the model is built), ``tune run`` (the parent, before torchrun starts)
and ``tune validate``. A problem is a ``ConfigError`` printed as one line naming the key path
and value; the caller exits with status 2.

What is checked, in order:

1. top-level keys against the recipe's ``CONFIG_KEYS`` (``check_top_level_keys``): a typo is
   an error with a did-you-mean; a helper key that another value reads through interpolation
   (``base_dir: /data`` with ``output_dir: ${base_dir}/run``) is accepted; a torchtune 0.6.1
   key the recipe does not implement (``TORCHTUNE_KEYS``) is an error only when its value
   turns the feature on, otherwise a one-line warning. A key in ``CONFIG_KEYS`` is never
   looked up in ``TORCHTUNE_KEYS``: a recipe that implements a feature declares its key and
   this table steps aside.
2. required keys (``REQUIRED``), those the recipe declares only.
3. each value in ``SCHEMA`` whose key the recipe declares and the config has (type, range,
   enum; ``env=True`` rules look at this machine: paths exist, device and dtype available).
4. ``CROSS_KEY`` rules (optimizer_in_bwd with accumulation or clipping, tensor parallelism
   with what it cannot run with, ...).
5. launcher arguments (``check_launch``), in ``tune run`` only.

``env=False`` (``tune validate --portable``) skips the machine checks, for a config written for
another machine (the stock configs' ``/tmp/<model>`` paths, ``device: cuda`` on a laptop).
"""

import contextlib
import difflib
import functools
import math
import re
import sys
from collections import abc
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from tune_recipes.constants import DEFAULT_COLLATE


class ConfigError(ValueError):
    """A problem with a config file or override; the message names the file, key or value.

    Defined here, below ``tune_recipes.config`` (which re-exports it), so that the schema sits
    one layer under the loader that calls it."""


def brief(e: BaseException, limit: int = 300) -> str:
    """An exception's message for a one-line error: its first line; past ``limit`` characters,
    its first sentence (torch's read errors go on for three more), cut with an ellipsis if
    still longer."""
    lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
    text = lines[0] if lines else type(e).__name__
    if len(text) > limit:
        text = text.split(". ", 1)[0]
    return text if len(text) <= limit else text[:limit - 3] + "..."


Check = Callable[[Any], Optional[str]]  # value -> what is wrong with it, or None


# ----------------------------------------------------------------------------- value checks
def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def integer(minimum: int) -> Check:
    return lambda v: None if _is_int(v) and v >= minimum else f"expected an integer >= {minimum}"


def number(minimum: float = -math.inf, exclusive: bool = False, maximum: float = math.inf,
           finite: bool = True, strings: bool = False, below_maximum: bool = False) -> Check:
    """A number in range; ``strings`` also takes a string float() parses (YAML's ``inf``);
    ``below_maximum``: ``maximum`` itself is out of range too."""
    lo = f"> {minimum:g}" if exclusive else f">= {minimum:g}"
    hi = "<" if below_maximum else "<="
    want = f"a number {lo}" + (f" and {hi} {maximum:g}" if maximum != math.inf else "")

    def check(v):
        if strings and isinstance(v, str):
            try:
                v = float(v)
            except ValueError:
                return f"expected {want}"
        if not _is_number(v) or math.isnan(v) or (finite and math.isinf(v)):
            return f"expected {want}"
        if (v <= minimum if exclusive else v < minimum) or v > maximum \
                or (below_maximum and v >= maximum):
            return f"expected {want}"
        return None

    return check


def boolean(v) -> Optional[str]:
    return None if isinstance(v, bool) else "expected True or False"


def one_of(*choices: str, hint: str = "") -> Check:
    return lambda v: None if v in choices else (
        f"expected one of {', '.join(choices)}" + (f" ({hint})" if hint else ""))


# torch.set_deterministic_debug_mode's values, as torchtune's set_seed hands them over (a bool is
# an int there: False is 0, "default", which also turns cuDNN benchmark on).
DETERMINISTIC_MODES = ("default", "warn", "error")


def deterministic_mode(v) -> Optional[str]:
    if v in DETERMINISTIC_MODES or (isinstance(v, int) and 0 <= v <= 2):
        return None
    return "expected null, default, warn, error, 0, 1 or 2 (torch.set_deterministic_debug_mode)"


def optional(check: Check) -> Check:
    return lambda v: None if v is None else check(v)


def text(v) -> Optional[str]:
    return None if isinstance(v, str) and v.strip() else "expected a non-empty string"


def list_of(item: Check, nonempty: bool = False, unique: bool = False) -> Check:
    def check(v):
        if not isinstance(v, list) or (nonempty and not v):
            return "expected a " + ("non-empty " if nonempty else "") + "list"
        for x in v:
            problem = item(x)
            if problem:
                return f"item {x!r}: {problem}"
        if unique:
            twice = sorted({str(x) for x in v if v.count(x) > 1})
            if twice:
                return f"{', '.join(twice)} named more than once"
        return None

    return check


def no_dict(feature: str) -> Check:
    def check(v):
        if isinstance(v, dict):
            return f"{feature} is not implemented; use True or False"
        return boolean(v)

    return check


def component(v) -> Optional[str]:
    """A ``{_component_: dotted.path, ...}`` mapping (whether the path imports and its keys bind
    is checked with every other component, by ``tune_recipes.config.validate_config``)."""
    if isinstance(v, dict) and isinstance(v.get("_component_"), str) and v["_component_"].strip():
        return None
    return "expected a mapping with a _component_"


def components(v) -> Optional[str]:
    """One component, or a non-empty list of them (``dataset``: concatenated)."""
    if isinstance(v, list):
        if not v:
            return "expected a mapping with a _component_, or a non-empty list of them"
        problems = [component(x) for x in v]
        return next((f"item {i}: {p}" for i, p in enumerate(problems) if p), None)
    return component(v)


def checkpoint_files(v) -> Optional[str]:
    """torchtune's two forms: a list of file names, or {filename_format, max_filename}."""
    if isinstance(v, list) and v and all(isinstance(x, str) and x for x in v):
        return None
    if isinstance(v, dict) and {"filename_format", "max_filename"} <= set(v):
        return None
    return ("expected a list of file names ([model.safetensors]) or a mapping with "
            "filename_format and max_filename")


_LORA_MODULES = ("q_proj", "k_proj", "v_proj", "output_proj")


# torchtune 0.6.1's ac_mode values (training/activations.py; "none" is its docstring's "off").
AC_MODES = ("none", "full", "selective")


def ac_option_value(v) -> Optional[str]:
    """torchtune's ``ac_option`` for ``ac_mode: selective``: k >= 0 (checkpoint every k-th
    layer; 0 and 1 every layer), an integer or a string of digits (torchtune int()s it)."""
    if (_is_int(v) and v >= 0) or (isinstance(v, str) and v.isascii() and v.isdigit()):
        return None
    if v == "op":
        return ("selective op checkpointing is not implemented (torchtune 0.6.1 cannot run it "
                "either: it int()s ac_option); use an integer k to checkpoint every k-th "
                "transformer layer")
    return "expected an integer >= 0 (checkpoint every k-th transformer layer)"


def device_name(v) -> Optional[str]:
    if v in ("cpu", "cuda") or (isinstance(v, str) and v.startswith("cuda:") and v[5:].isdigit()):
        return None
    return "expected cpu, cuda or cuda:<index>"


# ----------------------------------------------------------------------------- machine checks
def device_available(v) -> Optional[str]:
    if not str(v).startswith("cuda"):
        return None
    import torch

    if not torch.cuda.is_available():
        return "CUDA is not available on this machine; set device=cpu"
    if ":" in str(v) and int(str(v)[5:]) >= torch.cuda.device_count():
        return f"this machine has {torch.cuda.device_count()} CUDA device(s)"
    return None


def existing_dir(v) -> Optional[str]:
    p = Path(str(v)).expanduser()
    if p.is_dir():
        return None
    return "a file, not a directory" if p.exists() else "no such directory"


def existing_file(v) -> Optional[str]:
    return None if Path(str(v)).expanduser().is_file() else "no such file"


def writable_dir(v) -> Optional[str]:
    import os

    p = Path(str(v)).expanduser()
    while not p.exists() and p != p.parent:
        p = p.parent
    if not p.is_dir():
        return f"{p} exists and is not a directory"
    if not os.access(p, os.W_OK | os.X_OK):
        return f"{p} is not writable"
    return None


# on_nonfinite's values (training/step/nonfinite.py implements them).
NONFINITE_MODES = ("raise", "skip")

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "WARN", "ERROR", "CRITICAL")


def log_level_name(v) -> Optional[str]:
    """torchtune's ``log_level``: a logging level name, any case."""
    if isinstance(v, str) and v.upper() in LOG_LEVELS:
        return None
    return f"expected one of {', '.join(LOG_LEVELS)}"


def importable(v) -> Optional[str]:
    """A dotted path to a function (``collate_fn``) that imports."""
    if not isinstance(v, str) or "." not in v:
        return "expected a dotted path to a function (e.g. torchtune.data.padded_collate_sft)"
    if _resolves_to(v) is None:
        return "does not resolve to an importable object"
    return None


@dataclass(frozen=True)
class Rule:
    key: str            # dotted path into the config
    check: Check
    env: bool = False   # depends on this machine (skipped by ``tune validate --portable``)

    @property
    def owner(self) -> str:
        """The top-level key the recipe must declare for the rule to apply."""
        return self.key.split(".")[0]


# torchao 0.15's float8 training recipes (Float8LinearRecipeName), for ``fp8_recipe_name``.
FP8_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")

_bf16_or_fp32 = one_of("bf16", "fp32", hint="fp16 needs loss scaling, which no recipe does")

# torch._functorch.config.activation_memory_budget: 0 (the least memory the partitioner can
# reach, recomputing all it can) to 1 (torch's default plan). Also checked by the library
# function that sets it (training/setup/model.py), for callers that skip the config check.
activation_memory_budget_value = optional(number(0, maximum=1))

# NOTE: one table for every recipe. A rule applies when its top-level key is in the recipe's
# CONFIG_KEYS and the key is present in the config; defaults live in the recipes.
SCHEMA: List[Rule] = [
    Rule("output_dir", text),
    Rule("output_dir", writable_dir, env=True),
    Rule("metric_logger.log_dir", optional(writable_dir), env=True),
    Rule("seed", optional(integer(0))),
    Rule("shuffle", boolean),
    Rule("batch_size", integer(1)),
    Rule("epochs", integer(1)),
    Rule("max_steps_per_epoch", optional(integer(1))),
    Rule("gradient_accumulation_steps", integer(1)),
    Rule("log_every_n_steps", integer(1)),
    Rule("log_peak_memory_stats", boolean),
    # auto: resume from the newest checkpoint in output_dir if there is one, else start afresh.
    Rule("resume_from_checkpoint", lambda v: None if isinstance(v, bool) or v == "auto"
         else "expected True, False or auto"),
    Rule("save_every_n_steps", optional(integer(1))),
    Rule("keep_last_n_checkpoints", optional(integer(1))),
    Rule("save_adapter_weights_only", boolean),
    Rule("enable_activation_checkpointing", boolean),
    Rule("enable_activation_offloading", boolean),
    Rule("ac_mode", optional(one_of(*AC_MODES, hint="null or none: off"))),
    Rule("ac_option", optional(ac_option_value)),
    # null is a value of its own here: "not set", so that fsdp.cpu_offload decides
    # (fsdp_offload_problem below); any other non-bool is a mistake.
    Rule("fsdp_cpu_offload", optional(boolean)),
    Rule("fsdp_reshard_after_forward", boolean),
    Rule("optimizer_in_bwd", boolean),
    Rule("compile", no_dict("torchtune's per-part compile dict")),
    Rule("compile_scope", optional(one_of("layers", "model"))),
    Rule("activation_memory_budget", activation_memory_budget_value),
    Rule("compile_optimizer_step", boolean),
    Rule("embedding_on_cpu", boolean),
    Rule("fp8_mlp_activations", boolean),
    Rule("fp8_mlp_layers", optional(integer(1))),
    Rule("fp8_adapter_inputs", boolean),
    Rule("fp8_transposed_weight_layers", integer(0)),
    Rule("custom_sharded_layers", optional(list_of(text))),
    Rule("collate_fn", text),
    Rule("padding_free", boolean),
    Rule("clip_grad_norm", optional(number(0, exclusive=True, finite=False, strings=True))),
    Rule("optimizer.lr", number(0, exclusive=True)),
    Rule("optimizer.weight_decay", number(0)),
    Rule("lr_scheduler.num_warmup_steps", integer(0)),
    Rule("device", device_name),
    Rule("device", device_available, env=True),
    Rule("dtype", _bf16_or_fp32),
    Rule("model.lora_rank", integer(1)),
    Rule("model.lora_alpha", number(0, exclusive=True)),
    # 1.0 drops every adapter input: the adapters never train, silently.
    Rule("model.lora_dropout", number(0, maximum=1, below_maximum=True)),
    Rule("model.lora_attn_modules", list_of(one_of(*_LORA_MODULES), nonempty=True, unique=True)),
    Rule("model.apply_lora_to_mlp", boolean),
    Rule("model.apply_lora_to_output", boolean),
    Rule("model.use_dora", boolean),
    Rule("model.quantize_base", boolean),
    Rule("tokenizer.max_seq_len", optional(integer(1))),
    Rule("tokenizer.path", existing_file, env=True),
    Rule("tokenizer.merges_file", existing_file, env=True),
    Rule("dataset.packed", boolean),
    Rule("checkpointer.checkpoint_dir", existing_dir, env=True),
    Rule("teacher_checkpointer.checkpoint_dir", existing_dir, env=True),
    # Whether it divides each quantized layer's input size is checked where the layers are
    # known (training/setup/qat.py), naming the layer.
    Rule("quantizer.groupsize", integer(1)),
    Rule("fake_quant_after_n_steps", optional(integer(0))),
    Rule("kd_ratio", number(0, maximum=1)),
    Rule("enable_fp8_training", boolean),
    Rule("fp8_recipe_name", optional(one_of(*FP8_RECIPES))),
    Rule("fp8_fast_accum_backward", boolean),
    Rule("tensor_parallel_dim", integer(1)),
    Rule("tensor_parallel_plan", optional(component)),
    Rule("low_cpu_ram", boolean),
    Rule("cudnn_deterministic_mode", optional(deterministic_mode)),
    Rule("metric_logger", component),
    Rule("model", component),
    Rule("teacher_model", component),
    Rule("tokenizer", component),
    Rule("checkpointer", component),
    Rule("teacher_checkpointer", component),
    Rule("optimizer", component),
    Rule("loss", component),
    Rule("kd_loss", component),
    Rule("lr_scheduler", optional(component)),
    Rule("dataset", components),
    Rule("dataset_val", optional(components)),
    Rule("checkpointer.checkpoint_files", checkpoint_files),
    Rule("teacher_checkpointer.checkpoint_files", checkpoint_files),
    Rule("log_level", optional(log_level_name)),
    Rule("on_nonfinite", one_of(*NONFINITE_MODES)),
    Rule("collate_fn", importable),
    Rule("batch_size_val", optional(integer(1))),
    Rule("run_val_every_n_steps", optional(integer(1))),
    # torch.profiler.schedule's own ranges (it asserts them when the run starts).
    Rule("profiler.enabled", boolean),
    Rule("profiler.wait_steps", integer(0)),
    Rule("profiler.warmup_steps", integer(0)),
    Rule("profiler.active_steps", integer(1)),
    Rule("profiler.num_cycles", integer(0)),
]

# Keys a recipe reads without a default (cfg.<key>): required when the recipe declares them.
REQUIRED = ("output_dir", "model", "checkpointer", "tokenizer", "dataset", "optimizer", "loss",
            "batch_size", "epochs", "seed", "shuffle", "teacher_model", "teacher_checkpointer",
            "kd_loss", "metric_logger")


def _checkpoint_files(cfg: DictConfig, env: bool, key: str) -> None:
    """Each listed checkpoint file exists under checkpoint_dir (names the key and the path)."""
    node = cfg.get(key)
    if not env or not isinstance(node, DictConfig):
        return
    files, where = _value(node, "checkpoint_files"), _value(node, "checkpoint_dir")
    if not isinstance(files, list) or not isinstance(where, str) or not Path(where).is_dir():
        return
    for f in files:
        p = Path(where) / str(f)
        if not p.is_file():
            raise ConfigError(f"{key}.checkpoint_files: {p}: no such file")
        problem = safetensors_problem(p)
        if problem:
            raise ConfigError(f"{key}.checkpoint_files: {p}: {problem}")


def safetensors_problem(path: Path) -> Optional[str]:
    """What makes a ``.safetensors`` file unreadable (empty, truncated, not safetensors), read
    from its header alone (no tensor is loaded), or None; other formats are not looked into."""
    if path.suffix != ".safetensors":
        return None
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), "pt") as f:
            f.keys()
    except (SafetensorError, OSError) as e:
        return (f"not a readable safetensors file ({str(e).strip() or type(e).__name__}; "
                f"{path.stat().st_size} bytes): download it again")
    return None


def _in_backward_rules(cfg: DictConfig) -> Optional[str]:
    if cfg.get("optimizer_in_bwd", False) is not True:
        return None
    ga = cfg.get("gradient_accumulation_steps", 1)
    if ga != 1:
        return (f"optimizer_in_bwd=True with gradient_accumulation_steps={ga}: the optimizer "
                "steps inside each backward; set gradient_accumulation_steps=1")
    clip = cfg.get("clip_grad_norm", None)
    if clip is not None:
        return (f"optimizer_in_bwd=True with clip_grad_norm={clip}: clipping needs every "
                "gradient at once; set clip_grad_norm=null")
    problem = skip_in_backward_problem(cfg.get("on_nonfinite", "raise"), optimizer_in_bwd=True)
    return f"optimizer_in_bwd=True with {problem}" if problem else None


def skip_in_backward_problem(on_nonfinite: Any, optimizer_in_bwd: bool) -> Optional[str]:
    """The one rule (``tune validate`` here, the step driver through
    training.step.nonfinite.check_mode): ``skip`` drops a step before the optimizer runs, which
    is impossible once the optimizer has stepped inside backward."""
    if on_nonfinite == "skip" and optimizer_in_bwd:
        return ("on_nonfinite=skip needs to drop a step before the optimizer runs, but "
                "optimizer_in_bwd=True steps inside backward: use on_nonfinite=raise")
    return None


# The optimizers whose step ``compile_optimizer_step`` compiles, each taking the learning rate
# as a tensor, so a changing rate does not recompile: torch's capturable foreach Adam/AdamW, and
# our AdamW8bit (torchao keeps the rate a tensor) as one graph a param group.
COMPILED_STEP_OPTIMIZERS = ("torch.optim.Adam", "torch.optim.AdamW", "tune_recipes.optim.AdamW8bit")


def compiled_step_problem(cfg: DictConfig) -> Optional[str]:
    """What rules out ``compile_optimizer_step: True`` in a config (``compiled_step_refusal``);
    ``tune validate`` and the recipe's start check it (CROSS_KEY)."""
    if cfg.get("compile_optimizer_step", False) is not True:
        return None
    optimizer = cfg.get("optimizer", None)
    name = optimizer.get("_component_", None) if isinstance(optimizer, DictConfig) else None
    return compiled_step_refusal(cfg.get("optimizer_in_bwd", False) is True, name)


def compiled_step_refusal(optimizer_in_bwd: bool, optimizer_component: Any) -> Optional[str]:
    """Why the optimizer step cannot be compiled, or None: the in-backward optimizer (one
    optimizer per parameter, stepped inside backward: there is no one step to compile) or an
    optimizer other than torch's Adam/AdamW and our AdamW8bit. The one check of the config rule above and of
    ``training/step/optim.build_optimizer``."""
    if optimizer_in_bwd:
        return ("compile_optimizer_step=True with optimizer_in_bwd=True: the in-backward optimizer "
                "steps each parameter inside backward, so there is no one optimizer step to "
                "compile; set one of them False")
    # By the class: torch.optim.adamw.AdamW is torch.optim.AdamW.
    if _resolves_to(optimizer_component) not in [_resolves_to(n) for n in COMPILED_STEP_OPTIMIZERS]:
        return (f"compile_optimizer_step=True with optimizer._component_={_show(optimizer_component)}: "
                f"only {', '.join(COMPILED_STEP_OPTIMIZERS[:-1])} and {COMPILED_STEP_OPTIMIZERS[-1]} "
                "are supported (their step takes "
                "the learning rate as a tensor); set compile_optimizer_step=False")
    return None


def _fake_quant_needs_quantizer(cfg: DictConfig) -> Optional[str]:
    if cfg.get("fake_quant_after_n_steps", None) is not None and cfg.get("quantizer") is None:
        return (f"fake_quant_after_n_steps={cfg.fake_quant_after_n_steps} without a quantizer: "
                "set quantizer._component_ (e.g. Int8DynActInt4WeightQATQuantizer)")
    return None


def int4_weight_only_dtype_problem(quantizer_component: Any, dtype: Any) -> Optional[str]:
    """The quantize recipe converts an int4 weight-only quantizer's linears (QAT-prepared or
    not) to torchao's int4 weight-only kernels, which take bf16 only. The one check of ``tune
    validate`` (CROSS_KEY) and the quantize recipe's start."""
    from torchtune.training import quantization as tt_quant

    cls = _resolves_to(quantizer_component)
    int4_weight_only = (tt_quant.Int4WeightOnlyQuantizer, tt_quant.Int4WeightOnlyQATQuantizer,
                        tt_quant.Int4WeightOnlyQATQuantizerModuleSwap)
    dtype = "bf16" if dtype is None else dtype
    if isinstance(cls, type) and issubclass(cls, int4_weight_only) and dtype != "bf16":
        return (f"dtype={_show(dtype)}: quantizer._component_={quantizer_component} "
                "converts the linears to int4 weight-only kernels, which take bf16 only; set "
                "dtype=bf16")
    return None


def _quantize_dtype_rule(cfg: DictConfig) -> Optional[str]:
    quantizer = cfg.get("quantizer", None)
    if not isinstance(quantizer, DictConfig):
        return None
    return int4_weight_only_dtype_problem(quantizer.get("_component_", None), cfg.get("dtype", None))


def _fp8_needs_cuda(cfg: DictConfig) -> Optional[str]:
    # Whether the GPU has FP8 tensor cores (SM >= 8.9) is checked by the recipe, on the GPU.
    if cfg.get("enable_fp8_training", False) is True and not str(cfg.get("device", "cuda")).startswith("cuda"):
        return (f"enable_fp8_training=True with device={cfg.device}: FP8 matmuls need a CUDA "
                "GPU with compute capability >= 8.9; set enable_fp8_training=False")
    return None


def dataset_unpacked(dataset) -> bool:
    """True when a dataset config (or any of a list of them) is known not to be packed."""
    if isinstance(dataset, (list, ListConfig)):
        return any(dataset_unpacked(d) for d in dataset)
    return isinstance(dataset, (dict, DictConfig)) and not dataset.get("packed", False)


def dataset_packed(dataset) -> bool:
    """True when a dataset config (or every one of a list of them) is packed."""
    return isinstance(dataset, (dict, DictConfig, list, ListConfig)) and bool(dataset) \
        and not dataset_unpacked(dataset)


def mixed_packing_problem(cfg: DictConfig) -> Optional[str]:
    """A list of datasets (torchtune's ConcatDataset) is all packed or all unpacked: it
    refuses a mix, and only once every dataset is built (after the model loads)."""
    for key in ("dataset", "dataset_val"):
        entries = cfg.get(key)
        if not isinstance(entries, (list, ListConfig)):
            continue
        packed = [i for i, d in enumerate(entries)
                  if isinstance(d, (dict, DictConfig)) and d.get("packed", False) is True]
        if packed and len(packed) < len(entries):
            unpacked = next(i for i in range(len(entries)) if i not in packed)
            return (f"{key}[{packed[0]}].packed=True but {key}[{unpacked}] is not packed: a list "
                    "of datasets is all packed or none (torchtune's ConcatDataset); set packed "
                    "the same in every entry")
    return None


def packing_length_problem(cfg: DictConfig) -> Optional[str]:
    """A packed dataset's packs are ``tokenizer.max_seq_len`` tokens long: torchtune's
    PackedDataset refuses a tokenizer without one, once the model has loaded."""
    tokenizer = cfg.get("tokenizer")
    if not isinstance(tokenizer, (dict, DictConfig)) or tokenizer.get("max_seq_len") is not None:
        return None
    for key in ("dataset", "dataset_val"):
        entries = cfg.get(key)
        for i, entry in enumerate(entries if isinstance(entries, (list, ListConfig)) else [entries]):
            if isinstance(entry, (dict, DictConfig)) and entry.get("packed", False) is True:
                where = f"{key}[{i}]" if isinstance(entries, (list, ListConfig)) else key
                return (f"{where}.packed=True needs tokenizer.max_seq_len (each pack is that many "
                        "tokens; torchtune's PackedDataset takes no other length): set it, e.g. "
                        "tokenizer.max_seq_len=2048")
    return None


def padding_free_problem(cfg: DictConfig) -> Optional[str]:
    """``padding_free`` lays an unpacked micro-batch's rows end to end, replacing the padding
    ``collate_fn``. (With a packed dataset it removes each pack's padding instead
    (``training.setup.data.packs_without_padding``) and takes no ``collate_fn``: not checked
    here, so that ``dataset.packed=True`` works on the shipped configs, which set it.)"""
    if cfg.get("padding_free", False) is not True or dataset_packed(cfg.get("dataset")):
        return None
    collate_fn = cfg.get("collate_fn", DEFAULT_COLLATE)
    if collate_fn != DEFAULT_COLLATE:
        return (f"padding_free=True with collate_fn={collate_fn}: padding-free batches are "
                f"collated by tune_recipes.data.collate; leave collate_fn at {DEFAULT_COLLATE}")
    return None


def _model_builder(cfg: DictConfig) -> str:
    """The last part of ``model._component_`` (e.g. ``lora_llama3_1_8b``), or ""."""
    component = _value(cfg, "model._component_")
    return component.rpartition(".")[2] if isinstance(component, str) else ""


def is_lora_model(cfg: DictConfig) -> bool:
    """Whether ``model`` names a LoRA-type builder (lora_*/qlora_*, or one given lora_rank)."""
    return (_model_builder(cfg).startswith(("lora_", "qlora_"))
            or _value(cfg, "model.lora_rank") is not _MISSING)


# Keys that modify FP8 LoRA only (key, what it does, its off value): an error without
# enable_fp8_training, not a warning (NO_EFFECT_WITHOUT): a run would silently lose its saving.
FP8_LORA_ONLY_KEYS = [
    ("fp8_adapter_inputs", "the adapters' inputs are taken from the FP8 base product's e4m3 copy",
     "False"),
    ("fp8_transposed_weight_layers", "it keeps a second layout of the FP8 base weights", "0"),
]


def _not_tensorwise(cfg: DictConfig) -> Optional[str]:
    """``fp8_recipe_name`` when it is set to anything but ``tensorwise`` (the one recipe our own
    FP8 products implement: FP8 LoRA's base and the full fine-tune's FP8 MLP), else None."""
    recipe = cfg.get("fp8_recipe_name", None)
    return recipe if recipe is not None and recipe != "tensorwise" else None


def fp8_lora_problem(cfg: DictConfig) -> Optional[str]:
    """What ``enable_fp8_training`` cannot do with a LoRA model, or None. FP8 LoRA quantizes the
    frozen bf16 base of each LoRALinear once, with one scale per tensor
    (tune_recipes/modules/fp8_lora.py): an NF4 base (QLoRA) has no bf16 base to quantize, DoRA
    is not implemented, and ``fp8_recipe_name`` can only be ``tensorwise``; ``fp8_adapter_inputs``
    needs ``enable_fp8_training`` and no LoRA dropout, ``fp8_transposed_weight_layers`` needs
    ``enable_fp8_training``. The one check both
    ``tune validate`` (CROSS_KEY) and the recipe's start (training/setup/fp8.fp8_lora_wanted)
    make; the conversion itself refuses the same layers by type, for builders this cannot
    read."""
    if cfg.get("enable_fp8_training", False) is not True:
        for key, what, off in FP8_LORA_ONLY_KEYS:
            if cfg.get(key, None):
                return (f"{key}={_show(cfg.get(key))} needs enable_fp8_training=True: {what}; set "
                        f"enable_fp8_training=True or {key}={off}")
    if cfg.get("fp8_adapter_inputs", False) is True:
        dropout = _value(cfg, "model.lora_dropout")
        if isinstance(dropout, (int, float)) and not isinstance(dropout, bool) and dropout > 0:
            return (f"fp8_adapter_inputs=True with model.lora_dropout={dropout}: the adapters' "
                    "input is then not the base product's; set model.lora_dropout=0.0 or "
                    "fp8_adapter_inputs=False")
    if cfg.get("enable_fp8_training", False) is not True or not is_lora_model(cfg):
        return None
    if _model_builder(cfg).startswith("qlora_"):
        return (f"enable_fp8_training=True with model._component_={_value(cfg, 'model._component_')}: a QLoRA "
                "builder keeps the frozen base in NF4 (model.quantize_base), and FP8 quantizes "
                "a bf16 base; use the lora_* builder or set enable_fp8_training=False")
    if _value(cfg, "model.quantize_base") is True:
        return ("enable_fp8_training=True with model.quantize_base=True: the frozen base is NF4 "
                "(QLoRA), and FP8 quantizes a bf16 base; set one of them to False")
    if _value(cfg, "model.use_dora") is True:
        return ("enable_fp8_training=True with model.use_dora=True: FP8 for DoRA is not "
                "implemented (its magnitude needs the bf16 base weight's column norms every "
                "step); set one of them to False")
    recipe = _not_tensorwise(cfg)
    if recipe:
        return (f"fp8_recipe_name={recipe} with a LoRA model: the frozen base projections are "
                "quantized once with one scale per tensor, so only tensorwise is implemented; "
                "set fp8_recipe_name=tensorwise (or null)")
    return None


def fp8_mlp_problem(cfg: DictConfig) -> Optional[str]:
    """``fp8_mlp_activations`` in a full fine-tune with FP8 training runs the down projection's
    products itself (tune_recipes/modules/fp8_mlp.py, ``_SwiGLUTrainedDown``) with one scale
    per tensor: only the ``tensorwise`` recipe is implemented. (LoRA models: fp8_lora_problem.)
    Checked by ``tune validate`` and, by the layers' types, where the MLPs are swapped."""
    if cfg.get("fp8_mlp_activations", False) is not True or cfg.get("enable_fp8_training", False) is not True \
            or is_lora_model(cfg):
        return None
    recipe = _not_tensorwise(cfg)
    if recipe:
        return (f"fp8_mlp_activations=True with fp8_recipe_name={recipe}: the MLP's down product "
                "is computed with one scale per tensor, so only tensorwise is implemented; set "
                "fp8_recipe_name=tensorwise (or null) or fp8_mlp_activations=False")
    return None


def _resolves_to(dotted: Any) -> Any:
    """The object a ``_component_`` path names, or None when it does not import (that is
    reported, naming the key, by the component check)."""
    import importlib

    if not isinstance(dotted, str) or "." not in dotted:
        return None
    module, _, name = dotted.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name, None)
    except Exception:  # noqa: BLE001 - any import failure is the component check's to report
        return None


def tensor_parallel_model_problem(model, tensor_parallel_dim: int) -> Optional[str]:
    """What tensor parallelism over ``tensor_parallel_dim`` ranks cannot do with ``model`` (a
    torchtune decoder, on the meta device is enough), or None: every attention module's heads
    and kv heads must split evenly, and the output projection must be a layer of its own."""
    from torchtune.modules import MultiHeadAttention, TiedLinear

    tp = tensor_parallel_dim
    if isinstance(getattr(model, "output", None), TiedLinear):
        return (f"tensor_parallel_dim={tp}: this model ties its output projection to "
                "tok_embeddings (Llama-3.2 1B/3B, Qwen2.5 up to 3B), which the tensor-parallel "
                "plan slices as two layers; use tensor_parallel_dim=1 (FSDP only)")
    for name, m in model.named_modules():
        if isinstance(m, MultiHeadAttention):
            for what, n in (("num_heads", m.num_heads), ("num_kv_heads", m.num_kv_heads)):
                if n % tp:
                    return (f"tensor_parallel_dim={tp}: the model's {what}={n} ({name}) is not "
                            "divisible by it; each rank needs whole heads")
    return None


def _tensor_parallel_rules(cfg: DictConfig) -> Optional[str]:
    tp = cfg.get("tensor_parallel_dim", 1)
    if not _is_int(tp) or tp == 1:
        return None  # the schema reports a malformed value; 1 ignores the plan, as stock does
    if cfg.get("tensor_parallel_plan", None) is None:
        return (f"tensor_parallel_dim={tp} needs tensor_parallel_plan._component_ "
                "(e.g. torchtune.models.llama3.base_llama_tp_plan)")
    optimizer = cfg.get("optimizer", None)
    if isinstance(optimizer, DictConfig) and optimizer.get("fused", False) is True:
        return (f"tensor_parallel_dim={tp} with optimizer.fused=True: the fused optimizer does "
                "not take tensor-parallel (DTensor) parameters; set optimizer.fused=False")
    if cfg.get("optimizer_in_bwd", False) is True:
        return (f"tensor_parallel_dim={tp} with optimizer_in_bwd=True: the in-backward "
                "optimizer is not supported with tensor parallelism; set optimizer_in_bwd=False")
    if cfg.get("enable_fp8_training", False) is True:
        return (f"tensor_parallel_dim={tp} with enable_fp8_training=True: FP8 linears need "
                "torchao's float8 tensor-parallel styles, not built here; set one of them off")
    if cfg.get("save_every_n_steps", None) is not None:
        return (f"tensor_parallel_dim={tp} with save_every_n_steps: mid-epoch checkpoints keep "
                "one data position per data-parallel rank, not yet per tensor-parallel group; "
                "set save_every_n_steps=null (epoch checkpoints resume exactly)")
    loss = cfg.get("loss", None)
    if isinstance(loss, DictConfig) and getattr(
            _resolves_to(loss.get("_component_")), "is_fused_linear_loss", False):
        return (f"tensor_parallel_dim={tp} with loss._component_={loss._component_}: the fused "
                "loss multiplies by the whole output weight, which tensor parallelism slices; "
                "use torchtune.modules.loss.CEWithChunkedOutputLoss or torch.nn.CrossEntropyLoss")
    model = _meta_model(cfg)
    return tensor_parallel_model_problem(model, tp) if model is not None else None


def _meta_model(cfg: DictConfig):
    """``model`` built on the meta device (no memory, no weights; a second for 70B), or None
    when it does not build (reported, naming the key, where the recipe builds it)."""
    model_cfg = cfg.get("model", None)
    if not isinstance(model_cfg, DictConfig) or not _resolves_to(model_cfg.get("_component_")):
        return None
    import torch
    from torchtune import config as tt_config

    try:
        with torch.device("meta"):
            return tt_config.instantiate(model_cfg)
    except Exception:  # noqa: BLE001 - a bad model config is reported where it is built
        return None


def group_size_problem(model, group: Any) -> Optional[str]:
    """A linear of ``model`` whose in_features ``group`` (a quantizer's group size) does not
    divide, or None. torchao leaves such a linear unquantized without a word. The one check of
    ``tune validate`` (CROSS_KEY) and the QAT and quantize recipes' start."""
    import torch

    if not group or not _is_int(group):
        return None
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and module.in_features % group != 0:
            return (f"quantizer.groupsize={group} does not divide layer '{name}' "
                    f"(in_features={module.in_features}, out_features={module.out_features}); "
                    f"pick a groupsize that divides {module.in_features}")
    return None


def _quantizer_group_size_rule(cfg: DictConfig) -> Optional[str]:
    quantizer_cfg = cfg.get("quantizer", None)
    # A LoRA model's quantizer (QAT + LoRA) fake-quantizes its own linears; quantize refuses a
    # LoRA builder at its start.
    if not isinstance(quantizer_cfg, DictConfig) or is_lora_model(cfg) \
            or not _resolves_to(quantizer_cfg.get("_component_")):
        return None
    from torchtune import config as tt_config

    try:
        quantizer = tt_config.instantiate(quantizer_cfg)
    except Exception:  # noqa: BLE001 - a bad quantizer is reported where the recipe builds it
        return None
    group = getattr(quantizer, "groupsize", None) or getattr(quantizer, "group_size", None)
    model = _meta_model(cfg) if group else None
    return group_size_problem(model, group) if model is not None else None


def activation_offloading_problem(cfg: DictConfig) -> Optional[str]:
    """``enable_activation_offloading`` without activation checkpointing, or None. The one check
    both ``tune validate`` (CROSS_KEY) and the recipe's start
    (training/setup/offloading.activation_offloading_wanted) make, so they cannot disagree."""
    if cfg.get("enable_activation_offloading", False) and \
            not cfg.get("enable_activation_checkpointing", False):
        if cfg.get("ac_mode") not in (None, "none"):
            return (f"enable_activation_offloading=True needs enable_activation_checkpointing=True, "
                    f"not ac_mode={cfg.get('ac_mode')}: offloading is built for every layer "
                    "checkpointed, as torchtune's is (which refuses this too)")
        return ("enable_activation_offloading=True needs enable_activation_checkpointing=True: "
                "without it every intermediate activation crosses to CPU memory and back, which "
                "costs more time than it saves memory (torchtune refuses it too)")
    return None


def activation_checkpointing_problem(cfg: DictConfig) -> Optional[str]:
    """What is wrong with the activation checkpointing keys together, or None. The one check
    both ``tune validate`` (CROSS_KEY) and the recipe's start
    (training/setup/activations.ac_interval) make. torchtune 0.6.1 applies its full
    checkpointing only when ac_mode is null and its selective one only when
    enable_activation_checkpointing is False: with both set it checkpoints nothing, silently."""
    mode = cfg.get("ac_mode", None)
    if mode is None:
        return None
    if cfg.get("enable_activation_checkpointing", False):
        return (f"enable_activation_checkpointing=True with ac_mode={_show(mode)}: torchtune "
                "0.6.1 would silently checkpoint no layer at all with both set; set one: "
                "enable_activation_checkpointing=False to use ac_mode, or ac_mode=null")
    if mode == "selective" and cfg.get("ac_option", None) is None:
        return ("ac_mode=selective needs ac_option: an integer k checkpoints every k-th "
                "transformer layer (k=2: the 2nd, 4th, ...; 0 or 1: every layer)")
    return None


def fsdp_offload_problem(cfg: DictConfig) -> Optional[str]:
    """What is wrong with the ``fsdp:`` section, or None.

    torchtune 0.6.1's recipes never read ``fsdp`` (three of its QLoRA configs for
    lora_finetune_distributed carry ``fsdp: {cpu_offload: False}``); ours read
    ``fsdp.cpu_offload`` as another spelling of ``fsdp_cpu_offload``
    (training/setup/distributed.fsdp_cpu_offload_requested, which raises this same message), so
    the section takes that one field, and the two spellings must not disagree. Checked by
    ``tune validate`` and at the run's start alike."""
    section = _value(cfg, "fsdp")
    if section is _MISSING or section is None:
        return None
    if not isinstance(section, dict):
        return (f"fsdp={_show(section)}: expected a mapping with cpu_offload "
                "(fsdp: {cpu_offload: True}), or use fsdp_cpu_offload")
    unknown = sorted(str(k) for k in section if k != "cpu_offload")
    if unknown:
        return (f"{', '.join('fsdp.' + k for k in unknown)}: unknown key(s); the fsdp section "
                "takes only cpu_offload (the same as fsdp_cpu_offload)")
    nested = section.get("cpu_offload", None)
    if nested is not None and not isinstance(nested, bool):
        return (f"fsdp.cpu_offload={_show(nested)}: expected True or False"
                f"{_string_note(nested, boolean)}")
    flat = cfg.get("fsdp_cpu_offload", None)
    if flat is not None and nested is not None and bool(flat) != nested:
        return (f"fsdp_cpu_offload={flat} contradicts fsdp.cpu_offload={nested}: they are one "
                "setting; set one of them (or both alike)")
    return None


def _call_problem(fn: Callable, args: tuple, kwargs: dict) -> Optional[str]:
    """What ``fn(*args, **kwargs)`` raises for a bad argument value, or None."""
    try:
        fn(*args, **kwargs)
    except (ValueError, TypeError, IndexError, KeyError) as e:
        text = str(e).strip().splitlines()[0] if str(e).strip() else ""
        return text if isinstance(e, ValueError) and text else f"{type(e).__name__}: {text}"
    return None


def optimizer_problem(cfg: DictConfig) -> Optional[str]:
    """The optimizer's own argument checks (``betas``, ``eps``, ``lr`` ...), run by building it
    on a one-element CPU parameter, or None. The same constructor the recipe calls, so ``tune
    validate`` and the run's start refuse exactly what the run would crash on, naming the
    argument (each one is tried alone to find it). An optimizer that cannot be built on a CPU
    tensor at all (a CUDA-only one) is a warning that its arguments were not checked."""
    section = _value(cfg, "optimizer")
    if not isinstance(section, dict):
        return None
    component = section.get("_component_")
    fn = _resolves_to(component)
    if fn is None:
        return None  # a path that does not import is the component check's to report
    import torch

    kwargs = {k: v for k, v in section.items() if k != "_component_"}

    def params():
        return [torch.nn.Parameter(torch.zeros(1))]

    try:
        problem = _call_problem(fn, (params(),), kwargs)
    except Exception as e:  # noqa: BLE001 - e.g. an optimizer that needs CUDA tensors
        _warn(f"optimizer: {component}'s arguments were not checked: it cannot be built on a "
              f"CPU tensor here ({type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''})")
        return None
    if problem is None:
        return None
    for key, value in kwargs.items():
        try:
            alone = _call_problem(fn, (params(),), {key: value})
        except Exception:  # noqa: BLE001 - only looking for the argument to name
            continue
        if alone is not None:
            unquoted = _string_note(value, lambda v, k=key: _call_problem(fn, (params(),), {k: v}))
            return (f"optimizer.{key}={_show(value)}: {component} refuses it: {alone}"
                    f"{unquoted or _default_of(fn, key)}")
    shown = ", ".join(f"{k}={_show(v)}" for k, v in kwargs.items())
    return f"optimizer ({component} with {shown}): {problem}"


def _default_of(fn, key: str) -> str:
    """`` (its default: key=value)`` from ``fn``'s signature: what a well-formed value looks
    like where the refusal (e.g. an IndexError) does not say; empty where there is none."""
    import inspect

    try:
        default = inspect.signature(fn).parameters[key].default
    except (TypeError, ValueError, KeyError):
        return ""
    if default is inspect.Parameter.empty:
        return ""
    return f" (its default: {key}={_show(default)})"


# The label that marks a token without a loss in every dataset torchtune builds (its
# CROSS_ENTROPY_IGNORE_INDEX); the loss must skip the same value.
IGNORE_INDEX = -100

# What a recipe's loss must be: a token-level loss that skips ignore_index (CausalLMLoss reads
# loss_fn.ignore_index).
_TOKEN_LOSSES = ("torch.nn.CrossEntropyLoss, torchtune.modules.loss.CEWithChunkedOutputLoss or "
                 "tune_recipes.modules.loss.FusedLinearCrossEntropyLoss")


def _built(cfg: DictConfig, key: str) -> Any:
    """The component ``key`` configures, built from its arguments (a loss: no tensors), or None
    where it does not resolve or refuses its arguments (reported where the recipe builds it)."""
    section = _value(cfg, key)
    fn = _resolves_to(section.get("_component_")) if isinstance(section, dict) else None
    if fn is None:
        return None
    try:
        return fn(**{k: v for k, v in section.items() if k != "_component_"})
    except Exception:  # noqa: BLE001 - bad arguments are reported where the component is built
        return None


def loss_problem(cfg: DictConfig) -> Optional[str]:
    """The ``loss`` section: a loss with ``ignore_index`` equal to the datasets' -100, or None.
    A loss without one (``torch.nn.MSELoss``) fails at the recipe's start and any other index
    at the first step (a label -100 is then out of the vocabulary's range)."""
    section = _value(cfg, "loss")
    if not isinstance(section, dict):
        return None
    component = section.get("_component_")
    index = section.get("ignore_index", None)
    if index is not None and index != IGNORE_INDEX:
        return (f"loss.ignore_index={_show(index)}: the datasets mark the tokens without a loss "
                f"(prompt, padding) with {IGNORE_INDEX}; set loss.ignore_index={IGNORE_INDEX}")
    loss = _built(cfg, "loss")
    if loss is None:
        return None
    if not _is_int(getattr(loss, "ignore_index", None)):
        return (f"loss._component_={component}: the recipes need a token-level loss that skips "
                f"masked tokens (its ignore_index); use {_TOKEN_LOSSES}")
    if loss.ignore_index != IGNORE_INDEX:
        return (f"loss._component_={component}: its ignore_index is {loss.ignore_index}, the "
                f"datasets mark tokens without a loss with {IGNORE_INDEX}; set "
                f"loss.ignore_index={IGNORE_INDEX}")
    return None


def distillation_losses_problem(ce_loss: Any, kd_loss: Any) -> Optional[str]:
    """What distillation needs of its two losses, built: the student's logits (not a fused
    linear loss, which never makes them), chunked alike by ``loss`` and ``kd_loss`` (both
    read the same chunks of the student's output); None when they fit. The recipes' loss and
    ``tune validate`` (``distillation_config_problem``) both ask it."""
    if getattr(ce_loss, "is_fused_linear_loss", False):
        return ("loss: distillation needs the student's logits, which a fused linear loss never "
                "makes; use a logits loss (torchtune.modules.loss.CEWithChunkedOutputLoss)")
    ce_chunks = getattr(ce_loss, "num_output_chunks", None)
    kd_chunks = getattr(kd_loss, "num_output_chunks", None)
    if ce_chunks != kd_chunks:
        return (f"loss and kd_loss must chunk the logits alike (loss.num_output_chunks="
                f"{ce_chunks}, kd_loss.num_output_chunks={kd_chunks})")
    return None


def distillation_config_problem(cfg: DictConfig) -> Optional[str]:
    """``distillation_losses_problem`` on the config's ``loss`` and ``kd_loss``, built as the
    recipe builds them; None where either cannot be built (reported where it is built)."""
    ce_loss, kd_loss = _built(cfg, "loss"), _built(cfg, "kd_loss")
    if ce_loss is None or kd_loss is None:
        return None
    return distillation_losses_problem(ce_loss, kd_loss)


def lr_scheduler_problem(cfg: DictConfig) -> Optional[str]:
    """The recipes build ``lr_scheduler`` as ``component(optimizer, num_training_steps=N,
    last_epoch=S)`` (training/step/optim.LRSchedule): a scheduler that takes no
    ``num_training_steps`` (torch's own, e.g. StepLR) cannot be built; None when it can."""
    component = _value(cfg, "lr_scheduler._component_")
    fn = _resolves_to(component)
    if fn is None:
        return None
    import inspect

    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return None
    missing = [k for k in ("num_training_steps", "last_epoch") if k not in params]
    if missing:
        return (f"lr_scheduler._component_={component}: the recipes build the schedule as "
                "component(optimizer, num_training_steps=..., last_epoch=...) and it takes no "
                f"{' or '.join(missing)}; use a torchtune schedule (e.g. torchtune.training."
                "lr_schedulers.get_cosine_schedule_with_warmup) or ~lr_scheduler for a constant "
                "learning rate")
    return None


# Hugging Face's packaged loaders: with one of these as ``source`` a relative ``data_files`` is
# a local path (from ``data_dir`` when given); with a hub id or a local folder as ``source`` it
# is relative to that repository or folder.
_LOCAL_FILE_LOADERS = {"json", "csv", "parquet", "text", "arrow"}

# The fields of a message in each conversation style of torchtune 0.6.1's chat_dataset.
CHAT_MESSAGE_FIELDS = {"sharegpt": {"from", "value"}, "openai": {"role", "content"}}
CHAT_STYLES = tuple(CHAT_MESSAGE_FIELDS)


def _dataset_parts(cfg: DictConfig, key: str):
    """(where, plain dict) for ``key``'s dataset, or each entry of a list of datasets."""
    section = _value(cfg, key)
    return [(key, section)] if isinstance(section, dict) else \
        [(f"{key}[{i}]", s) for i, s in enumerate(section)] if isinstance(section, list) else []


def local_data_files(part) -> List[tuple]:
    """``(as written, the path it names)`` for each local path of a dataset config's
    ``data_files`` (one, a list, or a mapping from split to either; from ``data_dir`` when
    given; not a URL or a glob), where ``source`` is a packaged file loader: what ``tune
    validate`` checks and the dataset setup's error lines name (a config's ``~`` is expanded
    when it is loaded: config._home_expanded)."""
    if not isinstance(part, abc.Mapping) or part.get("source") not in _LOCAL_FILE_LOADERS:
        return []
    base = Path(str(part["data_dir"])).expanduser() if part.get("data_dir") else Path(".")
    files = part.get("data_files")
    def several(v) -> bool:
        return isinstance(v, abc.Sequence) and not isinstance(v, str)

    if isinstance(files, abc.Mapping):  # split -> file(s)
        files = [f for v in files.values() for f in (v if several(v) else [v])]
    elif not several(files):
        files = [files]
    return [(path, base / Path(path).expanduser()) for path in files
            if isinstance(path, str) and "://" not in path and not any(c in path for c in "*?[")]


def data_files_problem(cfg: DictConfig, key: str = "dataset") -> Optional[str]:
    """A local ``data_files`` path (a file or folder, not a URL or a glob) that does not exist,
    in ``key`` or any part of a list of datasets, where ``source`` is a packaged loader
    (``json``, ``csv`` ...): named here, as ``tune run`` names it when it loads the data. None
    when every such path exists."""
    for where, part in _dataset_parts(cfg, key):
        for path, resolved in local_data_files(part):
            if not resolved.exists():
                relative = "" if resolved.is_absolute() else \
                    f" (a relative path is read from the folder tune runs in, {Path.cwd()})"
                return f"{where}.data_files={path}: no such file{relative}"
    return None


# What each packaged file loader reads, by file suffix, and the pattern of its files.
_LOADER_BY_SUFFIX = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet",
                     ".txt": "text", ".arrow": "arrow"}
_PATTERN_BY_LOADER = {"json": "*.jsonl", "csv": "*.csv", "parquet": "*.parquet", "text": "*.txt",
                      "arrow": "*.arrow"}
# A file format's name written as ``source`` where a loader's goes: the fix for each.
_LOADER_BY_ALIAS = {"jsonl": ("json", "JSON Lines are read by json"),
                    "ndjson": ("json", "JSON Lines are read by json"),
                    "txt": ("text", "plain text is read by text"),
                    "tsv": ("csv", "tab-separated files are read by csv (with sep set to a tab)"),
                    "pq": ("parquet", "parquet files are read by parquet")}


def source_format_problem(cfg: DictConfig, key: str = "dataset") -> Optional[str]:
    """A file format's name as ``source`` beside ``data_files`` (``jsonl`` for ``json``): wrong
    on every machine. Hugging Face reads it as a Hub dataset's name and retries the network for
    it (~30 s offline) before it fails."""
    for where, part in _dataset_parts(cfg, key):
        source = part.get("source") if isinstance(part, dict) else None
        alias = _LOADER_BY_ALIAS.get(source.lower()) if isinstance(source, str) else None
        if alias and part.get("data_files") is not None and not Path(source).exists():
            loader, why = alias
            return (f"{where}.source={source}: not one of Hugging Face's file loaders "
                    f"({', '.join(sorted(_LOCAL_FILE_LOADERS))}); {why}: {where}.source={loader}")
    return None


def local_source_problem(cfg: DictConfig, key: str = "dataset") -> Optional[str]:
    """``source`` naming a local data file, or ``data_files`` a folder: Hugging Face's loaders
    read ``source`` as a dataset name, loader or script ("Couldn't find any data file at
    <file>", which exists) and a folder as a pattern ("Unable to find <folder>", which exists)."""
    for where, part in _dataset_parts(cfg, key):
        if not isinstance(part, dict):
            continue
        source = part.get("source")
        loader = _LOADER_BY_SUFFIX.get(Path(source).suffix.lower()) if isinstance(source, str) else None
        # (a .py source is a loading script, which datasets runs: not a data file)
        if loader and source not in _LOCAL_FILE_LOADERS and Path(source).expanduser().is_file():
            return (f"{where}.source={source}: a file; source names the loader and data_files "
                    f"the file: {where}.source={loader} {where}.data_files={source}")
        for path, resolved in local_data_files(part):
            if resolved.is_dir():
                return (f"{where}.data_files={path}: a folder; name its files, e.g. "
                        f"{where}.data_files={path.rstrip('/')}/{_PATTERN_BY_LOADER[part['source']]}")
    return None


@functools.lru_cache(maxsize=None)
def _loader_argument_names(loader: Optional[str]) -> Optional[frozenset]:
    """The names ``datasets.load_dataset`` takes beside its own parameters for ``loader``, a
    packaged file loader (its config's fields: json's ``field``, csv's ``names`` ...); None
    for any other source (a hub dataset's or a script's config: unknown here)."""
    import dataclasses
    import importlib

    if loader not in _LOCAL_FILE_LOADERS:
        return None
    from datasets import BuilderConfig  # (only here: ~1 s to import)

    module = importlib.import_module(f"datasets.packaged_modules.{loader}.{loader}")
    names = set()
    for obj in vars(module).values():
        if isinstance(obj, type) and issubclass(obj, BuilderConfig) and dataclasses.is_dataclass(obj):
            names |= {f.name for f in dataclasses.fields(obj)}
    return frozenset(names)


# torchtune's builders of chosen/rejected pairs (for DPO-style training, not these recipes).
_PREFERENCE_BUILDERS = ("torchtune.datasets.preference_dataset",
                        "torchtune.datasets.stack_exchange_paired_dataset",
                        "torchtune.datasets.hh_rlhf_helpful_dataset")


def dataset_arguments_problem(cfg: DictConfig) -> Optional[str]:
    """A dataset builder's argument the loader would misread, or a builder these recipes cannot
    train on. torchtune's builders pass every key they do not name on to
    ``datasets.load_dataset`` (``data_file`` failed there as "JsonConfig got an unexpected
    keyword argument"): with a packaged file loader as ``source`` a key neither names is an
    error (a did-you-mean where one is close); with another source only a key close to a name
    is. Also: a chat_dataset ``conversation_style`` it does not know; a preference builder."""
    import inspect

    from torchtune.datasets import chat_dataset

    for key in ("dataset", "dataset_val"):
        for where, part in _dataset_parts(cfg, key):
            if not isinstance(part, dict):
                continue
            builder = _resolves_to(part.get("_component_"))
            if builder is None or not callable(builder):
                continue
            if builder in [_resolves_to(b) for b in _PREFERENCE_BUILDERS]:
                return (f"{where}._component_={part['_component_']}: its examples are preference "
                        "pairs (chosen/rejected), made for DPO-style training, which these "
                        "recipes do not do; they train on examples of tokens and labels (e.g. "
                        "torchtune.datasets.instruct_dataset or chat_dataset, on the chosen "
                        "responses)")
            if builder is chat_dataset and part.get("conversation_style") not in (None, *CHAT_STYLES):
                return (f"{where}.conversation_style={part['conversation_style']}: expected one "
                        f"of {', '.join(CHAT_STYLES)}")
            try:
                params = inspect.signature(builder).parameters
            except (TypeError, ValueError):
                continue
            if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
                continue  # unknown keys are the component check's
            from datasets import load_dataset

            source = part.get("source")
            loader_names = _loader_argument_names(source if isinstance(source, str) else None)
            named = set(params) | set(inspect.signature(load_dataset).parameters) | (loader_names or set())
            for k in part:
                if k in named or k == "_component_":
                    continue
                others = [other for other in sorted(_LOCAL_FILE_LOADERS)
                          if loader_names is not None and k in _loader_argument_names(other)]
                if others:
                    return (f"{where}.{k}: an argument of the {' and '.join(others)} loader(s), not "
                            f"of source={part['source']}'s (its arguments: "
                            f"{', '.join(sorted(loader_names))})")
                close = difflib.get_close_matches(str(k), sorted(named), n=1, cutoff=0.85)
                if close:
                    return (f"{where}.{k}: did you mean {where}.{close[0]}? ({part['_component_']} "
                            "passes keys it does not name on to datasets.load_dataset)")
                if loader_names is not None:
                    return (f"{where}.{k}: neither {part['_component_']} nor datasets.load_dataset "
                            f"with source={part['source']} takes it (its loader's arguments: "
                            f"{', '.join(sorted(loader_names))})")
    return None


def tokenizer_problem(cfg: DictConfig) -> Optional[str]:
    """Build the tokenizer as the recipe will (a machine check: it reads ``tokenizer.path``):
    a file that is not a tokenizer, or a builder's own refusal, is one line here rather than a
    traceback in the recipe. None when it builds or its component does not import."""
    section = _value(cfg, "tokenizer")
    if not isinstance(section, dict) or _resolves_to(section.get("_component_")) is None:
        return None
    from torchtune import config as tt_config

    try:
        tt_config.instantiate(OmegaConf.create(section))
    except Exception as e:  # noqa: BLE001 - whatever stops the tokenizer stops the run
        text = str(e).strip().splitlines()[0] if str(e).strip() else ""
        if len(text) > 300:  # a parser quoting a minified tokenizer.json whole
            text = text[:300] + " ..."
        where = f" from tokenizer.path={_show(section['path'])}" if "path" in section else ""
        return (f"tokenizer: {section['_component_']} cannot be built{where} "
                f"({type(e).__name__}: {text})")
    return None


def _model_type_problem(cfg: DictConfig, key: str) -> Optional[str]:
    """``<key>.model_type`` against torchtune's ``ModelType`` names, for torchtune's
    checkpointers (which look it up as ``ModelType[model_type]``); None for any other."""
    component = _value(cfg, f"{key}._component_")
    model_type = _value(cfg, f"{key}.model_type")
    if not isinstance(component, str) or not component.startswith("torchtune.") \
            or model_type is _MISSING:
        return None
    from torchtune.training import ModelType

    names = list(ModelType.__members__)
    if isinstance(model_type, str) and model_type in names:
        return None
    close = difflib.get_close_matches(str(model_type), names, n=1)
    hint = f"did you mean {close[0]}? " if close else ""
    return (f"{key}.model_type={_show(model_type)}: not a model type torchtune's checkpointers "
            f"know ({hint}one of {', '.join(names)})")


def checkpointer_model_type_problem(cfg: DictConfig) -> Optional[str]:
    return _model_type_problem(cfg, "checkpointer")


def teacher_model_type_problem(cfg: DictConfig) -> Optional[str]:
    return _model_type_problem(cfg, "teacher_checkpointer")


def lora_model_problem(cfg: DictConfig) -> Optional[str]:
    """A LoRA-type recipe (one that declares ``save_adapter_weights_only``) given a model
    without LoRA adapters (a full fine-tune config), or None. A ``lora_*``/``qlora_*`` builder
    or ``lora_rank`` passes by name; any other builder is built on the meta device (no memory,
    no weights) and its adapter parameters are looked for, as the recipe does after building
    it (training/setup/model.py, distributed.py)."""
    if is_lora_model(cfg):
        return None
    model_cfg = cfg.get("model", None)
    component = _value(cfg, "model._component_")
    if not isinstance(model_cfg, DictConfig) or _resolves_to(component) is None:
        return None
    import torch
    from torchtune import config as tt_config
    from torchtune.modules.peft import get_adapter_params

    try:
        with torch.device("meta"):
            model = tt_config.instantiate(model_cfg)
    except Exception:  # noqa: BLE001 - a bad model config is reported where it is built
        return None
    if get_adapter_params(model):
        return None
    return (f"model._component_={component}: this model has no LoRA adapters, and this recipe "
            "trains only adapters; use a lora_*/qlora_* builder (e.g. a LoRA config) or a "
            "full fine-tune recipe")


def warmup_problem(num_warmup_steps: Any, total_steps: int, how: str = "") -> Optional[str]:
    """``lr_scheduler.num_warmup_steps`` as long as the run's ``total_steps`` optimizer steps or
    longer (the learning rate never reaches ``optimizer.lr``: warmup's last step runs at
    (warmup - 1) / warmup of it), or None. ``how``: where the total comes from, appended to it."""
    if not _is_int(num_warmup_steps) or not _is_int(total_steps) or num_warmup_steps < total_steps:
        return None
    return (f"lr_scheduler.num_warmup_steps={num_warmup_steps} is as long as the whole run or longer "
            f"({total_steps} optimizer steps{how}): the learning rate never reaches optimizer.lr")


def _warmup_warning(cfg: DictConfig) -> None:
    """``warmup_problem`` with what the config alone bounds: epochs x max_steps_per_epoch."""
    warmup = _value(cfg, "lr_scheduler.num_warmup_steps")
    epochs, max_steps = cfg.get("epochs", None), cfg.get("max_steps_per_epoch", None)
    if _is_int(epochs) and _is_int(max_steps):
        problem = warmup_problem(warmup, epochs * max_steps,
                                 f" at most: epochs={epochs} x max_steps_per_epoch={max_steps}")
        if problem:
            _warn(problem)


def wandb_credentials_problem(mode: Any = None) -> Optional[str]:
    """Why W&B would stop a run at ``wandb.init`` for want of an API key, found without the
    network, or None. W&B logs in from ``WANDB_API_KEY``, a netrc entry for its host
    (``WANDB_BASE_URL``, default api.wandb.ai; ``NETRC`` or ~/.netrc) or an identity token
    file; ``mode`` (or ``WANDB_MODE``) ``offline``/``disabled`` needs none."""
    import netrc
    import os
    from urllib.parse import urlparse

    mode = mode or os.environ.get("WANDB_MODE")
    if mode in ("offline", "disabled", "dryrun") or os.environ.get("WANDB_DISABLED") in ("true", "1"):
        return None
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return None
    host = urlparse(os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").hostname or ""
    files = [os.environ["NETRC"]] if os.environ.get("NETRC") else \
        [os.path.expanduser("~/.netrc"), os.path.expanduser("~/_netrc")]
    for f in files:
        try:
            if netrc.netrc(f).authenticators(host):
                return None
        except (OSError, netrc.NetrcParseError):
            continue
    return (f"W&B has no API key on this machine (no WANDB_API_KEY, no {host} entry in "
            f"{files[0]}): run `wandb login`, or log without it with metric_logger.mode=offline "
            "(`wandb sync` uploads later) or metric_logger.mode=disabled")


# The W&B logger classes whose start needs credentials (ours wraps torchtune's).
WANDB_LOGGERS = ("tune_recipes.loggers.WandBLogger", "torchtune.training.metric_logging.WandBLogger")


def metric_logger_problem(cfg: DictConfig) -> Optional[str]:
    """A W&B ``metric_logger`` on a machine with no W&B credentials (``env`` check)."""
    component = _value(cfg, "metric_logger._component_")
    if not isinstance(component, str):
        return None
    target = _resolves_to(component)
    if target is None or target not in [_resolves_to(n) for n in WANDB_LOGGERS]:
        return None
    mode = _value(cfg, "metric_logger.mode")
    problem = wandb_credentials_problem(None if mode is _MISSING else mode)
    return f"metric_logger._component_={component}: {problem}" if problem else None


# (the keys the rule reads, the rule): the rule applies when the recipe declares every key,
# and none of those written "!key" (a key the recipe must not declare).
CROSS_KEY: List[tuple] = [
    (("tensor_parallel_dim",), _tensor_parallel_rules),
    (("optimizer_in_bwd",), _in_backward_rules),
    (("compile_optimizer_step", "optimizer"), compiled_step_problem),
    (("fake_quant_after_n_steps", "quantizer"), _fake_quant_needs_quantizer),
    # Only the quantize recipe converts to real int4 kernels: the recipe with a quantizer and no
    # optimizer (the QAT recipes fake-quantize, in any dtype).
    (("quantizer", "dtype", "!optimizer"), _quantize_dtype_rule),
    (("quantizer", "model"), _quantizer_group_size_rule),
    (("enable_fp8_training", "device"), _fp8_needs_cuda),
    (("padding_free", "dataset"), padding_free_problem),
    (("dataset",), mixed_packing_problem),
    (("dataset",), dataset_arguments_problem),
    (("dataset", "tokenizer"), packing_length_problem),
    (("enable_fp8_training", "model"), fp8_lora_problem),
    (("fp8_mlp_activations", "enable_fp8_training"), fp8_mlp_problem),
    (("enable_activation_offloading",), activation_offloading_problem),
    (("ac_mode",), activation_checkpointing_problem),
    (("fsdp",), fsdp_offload_problem),
    (("optimizer",), optimizer_problem),
    (("loss",), loss_problem),
    (("loss", "kd_loss"), distillation_config_problem),
    (("lr_scheduler",), lr_scheduler_problem),
    (("checkpointer",), checkpointer_model_type_problem),
    (("teacher_checkpointer",), teacher_model_type_problem),
    # LoRA-type recipes are the ones with save_adapter_weights_only.
    (("save_adapter_weights_only", "model"), lora_model_problem),
]


# Keys that only modify another feature: set while that feature is off, a one-line warning.
# The feature is a key that must be truthy, or ``key=value`` for a key that must equal value.
NO_EFFECT_WITHOUT: List[tuple] = [
    ("keep_last_n_checkpoints", "save_every_n_steps",
     "limits the mid-epoch step_<n>/ checkpoints, which only save_every_n_steps writes "
     "(epoch_<n>/ folders are all kept)"),
    ("fp8_recipe_name", "enable_fp8_training", "picks the recipe FP8 training uses"),
    ("fp8_fast_accum_backward", "enable_fp8_training", "changes how FP8 products accumulate"),
    ("compile_scope", "compile", "picks what compile=True compiles"),
    ("fp8_mlp_layers", "fp8_mlp_activations", "limits which MLPs fp8_mlp_activations converts"),
    ("activation_memory_budget", "compile", "limits what the compiled graphs keep for backward"),
    # torchtune ignores it too for any other ac_mode.
    ("ac_option", "ac_mode=selective", "picks the transformer layers selective activation "
     "checkpointing recomputes"),
]


def _feature_off(cfg: DictConfig, needs: str) -> bool:
    key, _, value = needs.partition("=")
    return cfg.get(key, None) != value if value else not cfg.get(key, None)


# ----------------------------------------------------------------------------- torchtune keys
@dataclass(frozen=True)
class StockKey:
    """A torchtune 0.6.1 recipe key: what it turns on and whether a value asks for it."""

    feature: str
    asks: Callable[[Any], bool]
    field: str = ""  # for a mapping: the field that decides (profiler.enabled)
    # The value that leaves the feature off, for the error's "set it to ...": the one value
    # ``asks`` accepts, said exactly (False is not "off" for a key that only takes null).
    off: str = "False"


def _true(v) -> bool:
    return v is True


def _enabled(v) -> bool:
    return isinstance(v, dict) and bool(v.get("enabled", False))


# Read from torchtune 0.6.1's recipes (cfg.get(key, <off value>)).
TORCHTUNE_KEYS = {
    "profiler": StockKey("torchtune's profiler", _enabled, field="enabled"),
    "enable_activation_offloading": StockKey("activation offloading to CPU", _true),
    "activation_offloading_use_streams": StockKey(
        "activation offloading streams (only used with enable_activation_offloading)",
        lambda v: False),
    "fsdp_cpu_offload": StockKey("FSDP CPU offload of parameters and optimizer state", _true),
    # Only in a recipe without FSDP: the distributed recipes declare ``fsdp`` (see
    # fsdp_offload_problem), so this entry speaks to the single-device ones.
    "fsdp": StockKey("FSDP CPU offload",
                     lambda v: isinstance(v, dict) and bool(v.get("cpu_offload", False)),
                     field="cpu_offload"),
    # torchtune: the QLoRA state-dict hook that dequantizes NF4 weights at save time builds
    # them through a memory-mapped file (common_utils._use_low_cpu_ram).
    "low_cpu_ram": StockKey("building the merged model at save time with little CPU memory",
                            _true),
    "tensor_parallel_dim": StockKey("tensor parallelism",
                                    lambda v: _is_number(v) and v > 1, off="1"),
    "tensor_parallel_plan": StockKey(
        "a tensor parallel plan (only used with tensor_parallel_dim > 1)", lambda v: False),
    "optimizer_in_bwd": StockKey("the optimizer step inside backward", _true),
    "enable_async_checkpointing": StockKey("asynchronous checkpointing", _true),
    "profile_memory": StockKey("memory profiling (profile_memory)", _true),
}

_WARNED: set = set()


# Set by ``tune run`` before torchrun starts: the parent printed the warnings once already.
WARNED_ENV = "TUNE_RECIPES_CONFIG_WARNED"


# Warnings held back while a check that may still fail runs (``warnings_after_checks``).
_HELD: List[List[str]] = []


def _warn(line: str) -> None:
    # Once per run: the @parse hook and the recipe's own check both see the config, and so
    # does every torchrun process after the parent.
    import os

    if os.environ.get(WARNED_ENV) == "1" or line in _WARNED:
        return
    if _HELD:
        if line not in _HELD[-1]:
            _HELD[-1].append(line)
        return
    _WARNED.add(line)
    print(f"warning: {line}", file=sys.stderr)


@contextlib.contextmanager
def warnings_after_checks(print_them: bool = True):
    """Hold the config warnings raised inside until it ends: printed then if nothing inside
    raised (``print_them``), dropped if something did, so a config an error stops prints that
    error alone, whichever check comes last (the keys, the launch, output_dir)."""
    _HELD.append([])
    try:
        yield
    except BaseException:
        _HELD.pop()
        raise
    held = _HELD.pop()
    if print_them:
        for line in held:
            _warn(line)


# How ``_show`` spells values YAML spells otherwise: a string spelt so is quoted, and its note
# names YAML's spelling (the string "None" is not null; null is written null).
_PYTHON_SPELLINGS = {"None": (None, "null"), "inf": (math.inf, ".inf"),
                     "-inf": (-math.inf, "-.inf"), "nan": (math.nan, ".nan")}


def _unquoted(text: str) -> Any:
    """What ``text`` reads as written without quotes, in a YAML file or a ``key=value``
    override (OmegaConf's YAML: ``4`` an int, ``3e-2`` a float, ``yes`` a bool, ``~`` null,
    ``[a, b]`` a list); ``text`` itself where that is a string or does not parse."""
    try:
        return OmegaConf.to_container(OmegaConf.from_dotlist([f"v={text}"]), resolve=False)["v"]
    except Exception:  # noqa: BLE001 - not YAML (an unmatched quote, a stray %): a string
        return text


def _other_reading(text: str) -> Optional[tuple]:
    """(value, spelling) where the string ``text`` would be a value of another type written
    without quotes (``'4'``: (4, "4"), ``'yes'``: (True, "True"), ``'None'``: (None, "null")),
    or where ``_show`` spells such a value so; None for an ordinary string (a path, a name)."""
    if text.strip() in _PYTHON_SPELLINGS:
        return _PYTHON_SPELLINGS[text.strip()]
    value = _unquoted(text)
    if isinstance(value, str):
        return None
    if value is None or isinstance(value, bool):
        return value, {None: "null", True: "True", False: "False"}[value]
    return value, text.strip()


def _show(v: Any) -> str:
    """A value as a message shows it: a string as written (``/tmp/out``, ``torch.optim.AdamW``),
    quoted where it would read as another type (``'4'``, ``'True'``, ``'None'``, ``''``), so a
    number written in quotes is not shown as a number; anything else as Python prints it."""
    if isinstance(v, (DictConfig, ListConfig)):
        v = OmegaConf.to_container(v, resolve=False)
    if isinstance(v, str):
        s = repr(v) if not v or _other_reading(v) is not None else v
    else:
        s = str(v)
    return s if len(s) <= 60 else s[:57] + "..."


def _string_note(value: Any, check: Check) -> str:
    """`` (a string; write 4 without quotes)`` for a string that ``check`` refuses where it
    accepts what the same text reads as unquoted (``'4'``, ``'3e-2'``, ``'True'``; ``'None'``:
    null); empty otherwise (``'0'`` for an integer >= 1: the quotes ``_show`` puts around it
    already say it is a string, and unquoted it is refused too)."""
    if not isinstance(value, str):
        return ""
    other = _other_reading(value)
    if other is None:
        return ""
    try:
        accepted = check(other[0]) is None
    except Exception:  # noqa: BLE001 - a check that cannot take that type: no advice
        accepted = False
    if not accepted:
        return ""
    if value.strip() in _PYTHON_SPELLINGS:  # written without quotes, likely: YAML's word differs
        return f" (YAML reads {value.strip()} as a string; write {other[1]})"
    return f" (a string; write {other[1]} without quotes)"


# OmegaConf's resolvers whose first argument names a config key (``${oc.select:base_dir,/tmp}``).
_KEY_RESOLVERS = ("oc.select", "oc.dict.keys", "oc.dict.values")


def _interpolated_keys(text: str) -> List[tuple]:
    """The config keys the string ``text`` reads through OmegaConf interpolation, each as
    (leading dots, first key): ``${base_dir}/run`` gives (0, "base_dir"), ``${a.b}`` (0, "a"),
    ``${..lr}`` (2, "lr") (relative: one dot is the mapping or list holding the value, each
    further dot the one above). Parsed with OmegaConf's
    grammar: ``\\${x}`` is no interpolation, a resolver (``${oc.env:HOME}``) is no key but the
    interpolations in its arguments are, and so is the key ``oc.select`` and ``oc.dict.*``
    take; ``${${k}}`` gives ``k`` (the outer key is known only once it resolves). Empty for
    text that does not parse (OmegaConf names that when the value is read)."""
    if "${" not in text:
        return []
    try:
        from omegaconf.grammar.gen.OmegaConfGrammarParser import OmegaConfGrammarParser as G
        from omegaconf.grammar_parser import parse

        tree = parse(text)
    except Exception:  # noqa: BLE001 - GrammarParseError, or a grammar this code does not know
        return []
    found: List[tuple] = []

    def key_path(spelling: str) -> None:
        # a key written as a resolver's argument: dots, then parts split on . and [ ]
        rest = spelling.lstrip(".")
        first = rest.replace("[", ".").split(".")[0].rstrip("]")
        if first:
            found.append((len(spelling) - len(rest), first))

    def walk(node) -> None:
        if isinstance(node, G.InterpolationNodeContext):
            dots = 0
            for child in node.getChildren():
                if isinstance(child, G.ConfigKeyContext):
                    if not isinstance(child.getChild(0), G.InterpolationContext):
                        # unescaped as OmegaConf does (a\.b is the key "a.b")
                        found.append((dots, re.sub(r"\\([\\.\[\]:=])", r"\1", child.getText())))
                    break
                if child.getText() == ".":
                    dots += 1
        elif isinstance(node, G.InterpolationResolverContext) and node.getChildCount() == 5 \
                and node.getChild(1).getText() in _KEY_RESOLVERS:
            first = node.getChild(3).getChild(0)
            spelling = first.getText().strip() if isinstance(first, G.ElementContext) else ""
            if len(spelling) >= 2 and spelling[0] in "'\"" and spelling[-1] == spelling[0]:
                spelling = spelling[1:-1]  # ${oc.select:'base_dir',/tmp}
            if spelling and "${" not in spelling and spelling[0] not in "[{'\"":
                key_path(spelling)
        for i in range(node.getChildCount()):  # a terminal (a token) has none
            walk(node.getChild(i))

    try:
        walk(tree)
    except Exception:  # noqa: BLE001 - a grammar this code does not know: the key stays unread
        pass
    return found


def interpolation_reads(cfg: DictConfig) -> Dict[str, set]:
    """For each top-level key, the other top-level keys its values read through interpolation
    (``output_dir: ${base_dir}/run`` reads ``base_dir``; so does ``${..base_dir}`` one level
    down), from the raw, unresolved values, nested ones included. A key read only from inside
    itself (``a: {x: 1, y: ${a.x}}``) is not counted."""
    reads: Dict[str, set] = {}

    def walk(value: Any, where: list) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(v, where + [k])
        elif isinstance(value, list):
            for i, v in enumerate(value):
                walk(v, where + [i])
        elif isinstance(value, str):
            container = where[:-1]
            for dots, first in _interpolated_keys(value):
                if dots == 0:
                    top = first
                elif dots - 1 <= len(container):
                    base = container[:len(container) - (dots - 1)]
                    top = base[0] if base else first
                else:
                    continue  # above the root: OmegaConf refuses it when the value is read
                if str(top) != str(where[0]):
                    reads.setdefault(str(where[0]), set()).add(str(top))

    raw = OmegaConf.to_container(cfg, resolve=False)
    for key, value in raw.items():
        walk(value, [key])
    return reads


def helper_keys(cfg: DictConfig, known: Iterable[str]) -> set:
    """The top-level keys outside ``known`` that a key in ``known`` reads through interpolation,
    directly or through other helpers (``base_dir`` for ``output_dir: ${base_dir}/run``). A key
    that only unknown keys read is not one: ``micro_bach: ${bach_size}`` leaves both typos."""
    reads, known = interpolation_reads(cfg), set(known)
    found, todo = set(), [k for k in reads if k in known]
    while todo:
        for key in reads.get(todo.pop(), ()):
            if key not in known and key not in found:
                found.add(key)
                todo.append(key)
    return found


# The helper keys of this process's run, as ``check_top_level_keys`` last found them: the run's
# saved config.yaml leaves them out (``resolved_config_yaml``): its values are resolved there, so
# nothing reads them, and kept they would make that file fail this check when run again.
RUN_HELPER_KEYS: set = set()


def resolved_config(config: DictConfig) -> dict:
    """``config`` as a run records it (config.yaml, W&B's and MLflow's copies): interpolations
    resolved, and the helper keys only interpolations read (``RUN_HELPER_KEYS``) left out."""
    values = OmegaConf.to_container(config, resolve=True)
    return {k: v for k, v in values.items() if k not in RUN_HELPER_KEYS}


def resolved_config_yaml(config: DictConfig) -> str:
    """``resolved_config`` as YAML (a plain value as OmegaConf writes it)."""
    if not RUN_HELPER_KEYS or not isinstance(config, DictConfig):
        return OmegaConf.to_yaml(config, resolve=True)
    return OmegaConf.to_yaml(resolved_config(config))


def check_top_level_keys(cfg: DictConfig, known: Iterable[str], recipe: str,
                         recipe_file: Optional[str] = None) -> None:
    """Unknown keys: a typo is an error with a did-you-mean; a torchtune key whose feature
    ``recipe`` does not implement is an error when the value asks for it, else a warning. A key
    another value reads through interpolation (``base_dir`` for ``output_dir:
    ${base_dir}/run``) is a helper, not a typo: accepted, as torchtune accepts any key.
    ``recipe_file``: a user's recipe script (a ``tune cp`` copy), whose CONFIG_KEYS the error
    points to (a key its edited code reads must be listed there)."""
    known = set(known)
    unknown = [str(k) for k in cfg.keys() if k not in known]
    stock = [k for k in unknown if k in TORCHTUNE_KEYS]
    typos = [k for k in unknown if k not in TORCHTUNE_KEYS]
    RUN_HELPER_KEYS.clear()
    if typos:
        helpers = helper_keys(cfg, known)
        RUN_HELPER_KEYS.update(k for k in typos if k in helpers)
        typos = [k for k in typos if k not in helpers]
    if typos:
        parts = []
        for k in typos:
            # torchtune's keys too: a misspelt stock key (cudnn_determinstic_mode) is as
            # likely as a misspelt one of ours.
            close = difflib.get_close_matches(k, sorted(known | set(TORCHTUNE_KEYS)), n=1)
            parts.append(f"'{k}'" + (f" (did you mean '{close[0]}'?)" if close else ""))
        hint = "" if any("did you mean" in p for p in parts) else f"; its keys are: {', '.join(sorted(known))}"
        if recipe_file:
            hint += f" (add the keys your edited script reads to the CONFIG_KEYS set in {recipe_file})"
        raise ConfigError(f"{recipe} does not use config key(s) {', '.join(parts)}{hint}")
    for k in stock:
        spec, value = TORCHTUNE_KEYS[k], _plain(cfg, k)
        shown = f"{k}={_show(value)}"
        if spec.field and isinstance(value, dict) and spec.field in value:
            shown = f"{k}.{spec.field}={_show(value.get(spec.field))}"
        if spec.asks(value):
            # Name the one accepted value, exactly (tensor_parallel_dim's off value is 1, not False).
            target = f"{k}.{spec.field}" if spec.field else k
            raise ConfigError(
                f"{shown}: {spec.feature} is not implemented by {recipe} "
                f"(a torchtune 0.6.1 key; set {target}={spec.off} or remove {k}; "
                "docs/migrating.md)")
        _warn(f"{recipe} ignores {shown} ({spec.feature} is not implemented; "
              "this value leaves it off)")


# ----------------------------------------------------------------------------- the checks
def _plain(node: DictConfig, key: str) -> Any:
    try:
        v = node[key]
    except OmegaConfBaseException as e:
        raise ConfigError(f"{key}: cannot resolve: {str(e).splitlines()[0]}") from None
    if isinstance(v, (DictConfig, ListConfig)):
        try:
            return OmegaConf.to_container(v, resolve=True)
        except OmegaConfBaseException:
            return OmegaConf.to_container(v, resolve=False)
    return v


_MISSING = object()


def _value(cfg: DictConfig, dotted: str) -> Any:
    """The resolved value at ``dotted``, or _MISSING (also under a non-mapping parent)."""
    *parents, leaf = dotted.split(".")
    node: Any = cfg
    for p in parents:
        if not isinstance(node, DictConfig) or p not in node:
            return _MISSING
        node = node[p]
    if not isinstance(node, DictConfig) or leaf not in node:
        return _MISSING
    return _plain(node, leaf)


def _declares(keys: Optional[set], needs: tuple) -> bool:
    """Whether a recipe declaring ``keys`` gets a CROSS_KEY rule of ``needs`` (None: keys
    unknown, every rule but those that need a key absent)."""
    absent = {n[1:] for n in needs if n.startswith("!")}
    if keys is None:
        return not absent
    return set(needs) - {"!" + a for a in absent} <= keys and not absent & keys


def check_values(cfg: DictConfig, keys: Optional[Iterable[str]], env: bool = True) -> None:
    """Required keys, ``SCHEMA`` and ``CROSS_KEY`` for a recipe declaring ``keys``."""
    keys = set(keys) if keys is not None else None
    if keys is not None:
        missing = [k for k in REQUIRED if k in keys and k not in cfg]
        if missing:
            empty = " (the config is empty)" if len(cfg) == 0 else ""
            raise ConfigError(f"missing required key(s) {', '.join(missing)}{empty}")
    for rule in SCHEMA:
        if (keys is not None and rule.owner not in keys) or (rule.env and not env):
            continue
        value = _value(cfg, rule.key)
        if value is _MISSING:
            continue
        problem = rule.check(value)
        if problem:
            note = _string_note(value, rule.check)
            raise ConfigError(f"{rule.key}={_show(value)}: {problem}{note}")
    for key in ("dataset", "dataset_val"):
        if keys is None or key in keys:
            problem = source_format_problem(cfg, key)
            if problem:
                raise ConfigError(problem)
    if env:
        for key in ("checkpointer", "teacher_checkpointer"):
            if keys is None or key in keys:
                _checkpoint_files(cfg, env, key)
        if keys is None or "tokenizer" in keys:
            problem = tokenizer_problem(cfg)
            if problem:
                raise ConfigError(problem)
        for key in ("dataset", "dataset_val"):
            if keys is None or key in keys:
                problem = data_files_problem(cfg, key) or local_source_problem(cfg, key)
                if problem:
                    raise ConfigError(problem)
        if keys is None or "metric_logger" in keys:
            problem = metric_logger_problem(cfg)
            if problem:
                raise ConfigError(problem)
        dtype = cfg.get("dtype", None)
        if dtype == "bf16" and str(cfg.get("device", "cpu")).startswith("cuda"):
            import torch

            if torch.cuda.is_available() and not torch.cuda.is_bf16_supported():
                raise ConfigError("dtype=bf16: this GPU does not support bf16; set dtype=fp32")
    # NOTE: padding_free=True with dataset.packed=True is a valid pair, not a conflict: the
    # shipped single-device configs set padding_free and the documented way to pack is
    # dataset.packed=True on top; padding-free, each pack's padding is removed.
    for needs, rule in CROSS_KEY:
        if not _declares(keys, needs):
            continue
        problem = rule(cfg)
        if problem:
            raise ConfigError(problem)
    # Warnings last: a config that an error above stops prints that error alone.
    for key, needs, what in NO_EFFECT_WITHOUT:
        # An explicit False (or null) asks for nothing, so it cannot be without effect.
        value = cfg.get(key, None)
        if (keys is None or key in keys) and value is not None and value is not False \
                and _feature_off(cfg, needs):
            # A warning, not an error: a config may set both and a command line turn one off.
            _warn(f"{key}={_show(cfg.get(key))} has no effect without {needs}: it {what}")
    if keys is None or {"lr_scheduler", "epochs", "max_steps_per_epoch"} <= keys:
        _warmup_warning(cfg)


def check_launch(recipe: str, nproc_per_node: Optional[int], cfg: DictConfig, env: bool = True,
                 keys: Iterable[str] = (), nodes: int = 1) -> None:
    """``tune run`` launcher arguments against the recipe and this machine (``nodes``: the most
    nodes the launch may span)."""
    if nproc_per_node is None:
        return
    if nproc_per_node < 1:
        raise ConfigError(f"--nproc_per_node {nproc_per_node}: expected an integer >= 1")
    # Our distributed recipes say so in their name; a renamed copy (tune cp) by its FSDP key.
    distributed = "distributed" in recipe or "fsdp_reshard_after_forward" in set(keys)
    if not distributed and nproc_per_node > 1:
        raise ConfigError(
            f"--nproc_per_node {nproc_per_node}: {recipe} runs on one device; use its "
            "_distributed recipe or drop --nproc_per_node")
    if not distributed and nodes > 1:
        raise ConfigError(
            f"--nnodes {nodes}: {recipe} runs on one device; use its _distributed recipe or "
            "drop --nnodes")
    tp = cfg.get("tensor_parallel_dim", 1) if "tensor_parallel_dim" in set(keys) else 1
    if _is_int(tp) and tp > 1 and nproc_per_node % tp:
        # `tune run` starts one node: the world size is nproc_per_node.
        raise ConfigError(
            f"tensor_parallel_dim={tp} with --nproc_per_node {nproc_per_node}: the number of "
            "processes must be a multiple of tensor_parallel_dim")
    if env and str(cfg.get("device", "cuda")).startswith("cuda"):
        import torch

        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if have and nproc_per_node > have:
            raise ConfigError(
                f"--nproc_per_node {nproc_per_node}: this machine has {have} CUDA device(s)")


def check_config(cfg: DictConfig, recipe: str, keys: Optional[Iterable[str]], *,
                 env: bool = True, nproc_per_node: Optional[int] = None, nodes: int = 1,
                 recipe_file: Optional[str] = None) -> None:
    """Everything above, for ``recipe`` (its CONFIG_KEYS as ``keys``; None: a recipe that
    declares none, e.g. torchtune's stock one, gets no schema: its rules are its own;
    ``recipe_file``: a user's recipe script, see check_top_level_keys)."""
    RUN_HELPER_KEYS.clear()  # a recipe without CONFIG_KEYS has none; a stale set must not stay
    if keys is None:
        return
    with warnings_after_checks():
        check_top_level_keys(cfg, keys, recipe, recipe_file)
        check_values(cfg, keys, env=env)
        check_launch(recipe, nproc_per_node, cfg, env=env, keys=keys, nodes=nodes)
