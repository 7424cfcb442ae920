"""Convert a fine-tuned checkpoint into a really quantized model.

    tune run quantize --config tiny/quantize
    tune run quantize --config llama3_2/1B_quantize checkpointer.checkpoint_dir=/path/epoch_0

With a QAT quantizer (e.g. ``Int8DynActInt4WeightQATQuantizer``), the model is first prepared
exactly as during QAT (same fake-quantized linears), the QAT checkpoint is loaded, and the
quantizer's ``convert`` swaps in real int8/int4 kernels whose numerics match the fake
quantization. A post-training quantizer (``Int8DynActInt4WeightQuantizer``) quantizes a plain
checkpoint directly.

Writes ``<output_dir>/model-<mode>.pt`` (the quantized state dict) and
``<output_dir>/quantize.json`` (mode, group size, quantizer, source folder), and runs one forward
pass on the result as a smoke check.
"""

import filecmp
import json
import sys
import time
from pathlib import Path
from typing import Optional

import torch
from omegaconf import DictConfig
from torchtune import config as tt_config, training, utils
from torchtune.modules.peft import get_adapter_params

from tune_recipes.config import ConfigError, check_known_keys, parse
from tune_recipes.training.checkpointing.io import (
    QUANTIZED_RECORD_FILE,
    move_into_new_folder,
    quantized_record,
)
from tune_recipes.training.checkpointing.state import seed_everything
from tune_recipes.training.reporting.metrics import time_stamp
from tune_recipes.training.setup.model import load_weights
from tune_recipes.training.setup.qat import (
    build_quantizer,
    check_group_size,
    check_quantizer_against_the_qat_run,
)
from tune_recipes.training.setup.recipe import read_checkpoint
from tune_recipes.validation import brief, int4_weight_only_dtype_problem

CONFIG_KEYS = {"output_dir", "model", "checkpointer", "quantizer", "device", "dtype", "seed",
               "cudnn_deterministic_mode"}


def quantize_model(model: torch.nn.Module, quantizer, mode: str) -> torch.nn.Module:
    """Prepared (QAT) -> converted; plain -> quantized. ``model`` must already hold its weights."""
    with torch.no_grad():
        if "qat" in mode:
            return quantizer.convert(model)
        return quantizer.quantize(model)


def keep_earlier_quantized_model_aside(output_dir: Path, path: Path, written: Path,
                                      meta: dict) -> Optional[Path]:
    """Before ``written`` (this run's model, not yet renamed) becomes ``path`` and ``meta``
    ``quantize.json``: an earlier quantized model there that this run would replace with other
    bytes, or whose ``quantize.json`` records another mode or source, moves with that file into
    ``output_dir/earlier.<time>/`` (returned; None when nothing moved). The same checkpoint
    quantized the same way again replaces nothing that differs. NOTE: compared by bytes, not by
    the source's path: a retrained run's new ``epoch_0/`` sits where the old one did."""
    meta_path = output_dir / QUANTIZED_RECORD_FILE
    earlier = quantized_record(output_dir)
    earlier_mode = earlier.get("mode") if earlier is not None else None
    moving = []
    if path.exists() and not filecmp.cmp(path, written, shallow=False):
        moving.append(path)
    if meta_path.exists() and (moving or earlier != meta):
        other = output_dir / f"model-{earlier_mode}.pt" if isinstance(earlier_mode, str) else None
        moving += [f for f in (other, meta_path) if f is not None and f.exists() and f not in moving]
    if not moving:
        return None
    stamp = time_stamp(max(f.stat().st_mtime for f in moving))
    kept = move_into_new_folder(output_dir, f"earlier.{stamp}", moving)
    print(f"{output_dir} held an earlier quantized model: {', '.join(f.name for f in moving)} "
          f"moved to {kept.name}/", file=sys.stderr)
    return kept


class QuantizationRecipe:
    def __init__(self, cfg: DictConfig) -> None:
        check_known_keys(cfg, CONFIG_KEYS, "quantize")
        self._device = utils.get_device(cfg.get("device", "cuda"))
        self._dtype = training.get_dtype(cfg.get("dtype", "bf16"), device=self._device)
        self._quantizer, self._mode = build_quantizer(cfg.get("quantizer"), self._dtype,
                                                      require_qat=False)
        problem = int4_weight_only_dtype_problem(cfg.quantizer.get("_component_"),
                                                 cfg.get("dtype", "bf16"))
        if problem:
            # Found by the smoke forward otherwise, after the conversion: a dtype traceback.
            raise ConfigError(problem)
        # Recorded: a QAT quantizer's converted model and a post-training one's are saved under
        # the same name (torchtune's) but load into different module trees (docs: Load it).
        self._quantizer_component = cfg.quantizer.get("_component_")
        self._output_dir = Path(cfg.output_dir)
        seed_everything(cfg.get("seed", 0), cfg)

    @property
    def _saved_mode(self) -> str:
        """The mode in the saved file's name: a QAT quantizer's converted model is the same
        kind of model as the post-training one's."""
        return self._mode.replace("-qat", "")

    def setup(self, cfg: DictConfig) -> None:
        # any quantizer: a post-training one converts a QAT checkpoint too (torchtune's way)
        check_quantizer_against_the_qat_run(self._quantizer, cfg.quantizer, cfg.checkpointer.checkpoint_dir)
        self._checkpointer = tt_config.instantiate(cfg.checkpointer)
        ckpt = read_checkpoint(self._checkpointer, cfg.checkpointer)
        with training.set_default_dtype(self._dtype), self._device:
            model = tt_config.instantiate(cfg.model)
        if get_adapter_params(model):
            # A LoRA builder's adapters would be quantized (or fail the group size) as layers.
            raise ConfigError(
                f"model._component_={cfg.model._component_} builds LoRA adapters; quantize takes "
                "the plain model's builder (a LoRA run's epoch_<n>/ holds the merged plain model)")
        check_group_size(model, self._quantizer)
        if "qat" in self._mode:
            model = self._quantizer.prepare(model)
        load_weights(model, ckpt[training.MODEL_KEY], cfg.model)
        self._model = model
        # Absolute: what quantize.json records is compared across runs from any folder.
        self._source = str(Path(cfg.checkpointer.checkpoint_dir).resolve())

    def quantize(self) -> None:
        t0 = time.perf_counter()
        try:
            self._model = quantize_model(self._model, self._quantizer, self._mode)
        except ImportError as e:
            # torchao 0.15's int4 weight-only conversion (Int4WeightOnlyQuantizer) imports
            # fbgemm-gpu-genai, a CUDA package that is not among our dependencies.
            raise ConfigError(
                f"quantizer._component_={type(self._quantizer).__module__}."
                f"{type(self._quantizer).__name__}: torchao cannot convert with it here "
                f"({brief(e)}); install what it names, or use another quantizer") from None
        print(f"quantized ({self._mode}) in {time.perf_counter() - t0:.2f}s")
        # Smoke check: the quantized model runs and gives finite logits.
        with torch.no_grad():
            vocab = self._model.tok_embeddings.num_embeddings
            tokens = torch.arange(16, device=self._device)[None] % vocab
            logits = self._model(tokens)
        if not torch.isfinite(logits).all():
            raise RuntimeError("the quantized model produced non-finite logits")

    def save_checkpoint(self) -> Path:
        self._output_dir.mkdir(parents=True, exist_ok=True)
        mode = self._saved_mode
        path = self._output_dir / f"model-{mode}.pt"
        tmp = path.with_suffix(".pt.tmp")
        torch.save(self._model.state_dict(), tmp)
        meta = {"mode": mode, "groupsize": getattr(self._quantizer, "groupsize", None),
                "quantizer": self._quantizer_component, "source": self._source}
        keep_earlier_quantized_model_aside(self._output_dir, path, tmp, meta)
        tmp.replace(path)  # a crash mid-write never leaves a truncated model-*.pt
        (self._output_dir / QUANTIZED_RECORD_FILE).write_text(json.dumps(meta, indent=2) + "\n")
        print(f"saved {path}")
        return path


@parse
def recipe_main(cfg: DictConfig) -> None:
    recipe = QuantizationRecipe(cfg)
    recipe.setup(cfg)
    recipe.quantize()
    recipe.save_checkpoint()


if __name__ == "__main__":
    sys.exit(recipe_main())
