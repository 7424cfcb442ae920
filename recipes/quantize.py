"""Convert a fine-tuned checkpoint into a really quantized model.

    tune run quantize --config tiny/quantize
    tune run quantize --config llama3_2/1B_quantize checkpointer.checkpoint_dir=/path/epoch_0

With a QAT quantizer (e.g. ``Int8DynActInt4WeightQATQuantizer``), the model is first prepared
exactly as during QAT (same fake-quantized linears), the QAT checkpoint is loaded, and the
quantizer's ``convert`` swaps in real int8/int4 kernels whose numerics match the fake
quantization. A post-training quantizer (``Int8DynActInt4WeightQuantizer``) quantizes a plain
checkpoint directly.

Writes ``<output_dir>/model-<mode>.pt`` (the quantized state dict) and
``<output_dir>/quantize.json`` (mode, group size, source files), and runs one forward pass on the
result as a smoke check.
"""

import json
import sys
import time
from pathlib import Path

import torch
from omegaconf import DictConfig
from torchtune import config as tt_config, training, utils

from tune_recipes.config import ConfigError, check_known_keys, parse
from tune_recipes.training.setup.model import load_weights
from tune_recipes.training.setup.qat import (
    build_quantizer,
    check_group_size,
    check_quantizer_against_the_qat_run,
)
from tune_recipes.training.setup.recipe import read_checkpoint

CONFIG_KEYS = {"output_dir", "model", "checkpointer", "quantizer", "device", "dtype", "seed"}


def quantize_model(model: torch.nn.Module, quantizer, mode: str) -> torch.nn.Module:
    """Prepared (QAT) -> converted; plain -> quantized. ``model`` must already hold its weights."""
    with torch.no_grad():
        if "qat" in mode:
            return quantizer.convert(model)
        return quantizer.quantize(model)


def check_nothing_earlier_is_replaced(output_dir: Path, mode: str, source: str) -> None:
    """Refuse an ``output_dir`` whose quantized model (recorded in its ``quantize.json``) came
    from another checkpoint or in another mode: this run would overwrite its metadata, or the
    model itself. Quantizing the same checkpoint the same way again replaces it with the same
    result."""
    meta_path = output_dir / "quantize.json"
    if not meta_path.exists():
        return
    try:
        earlier = json.loads(meta_path.read_text())
        earlier_mode, earlier_source = earlier["mode"], earlier["source"]
    except (OSError, ValueError, KeyError, TypeError):
        raise ConfigError(f"output_dir={output_dir} holds a quantize.json this recipe cannot "
                          "read: set output_dir to another folder") from None
    if not (output_dir / f"model-{earlier_mode}.pt").exists():
        return
    if earlier_mode == mode and Path(earlier_source).resolve() == Path(source).resolve():
        return
    raise ConfigError(
        f"output_dir={output_dir} already holds model-{earlier_mode}.pt, quantized from "
        f"{earlier_source}; this run ({mode}, from {source}) would replace what quantize.json "
        "records: set output_dir to another folder")


class QuantizationRecipe:
    def __init__(self, cfg: DictConfig) -> None:
        check_known_keys(cfg, CONFIG_KEYS, "quantize")
        self._device = utils.get_device(cfg.get("device", "cuda"))
        self._dtype = training.get_dtype(cfg.get("dtype", "bf16"), device=self._device)
        self._quantizer, self._mode = build_quantizer(cfg.get("quantizer"), self._dtype,
                                                      require_qat=False)
        self._output_dir = Path(cfg.output_dir)
        check_nothing_earlier_is_replaced(self._output_dir, self._saved_mode,
                                          str(cfg.checkpointer.checkpoint_dir))
        training.set_seed(seed=cfg.get("seed", 0))

    @property
    def _saved_mode(self) -> str:
        """The mode in the saved file's name: a QAT quantizer's converted model is the same
        kind of model as the post-training one's."""
        return self._mode.replace("-qat", "")

    def setup(self, cfg: DictConfig) -> None:
        if "qat" in self._mode:
            check_quantizer_against_the_qat_run(cfg.quantizer, cfg.checkpointer.checkpoint_dir)
        self._checkpointer = tt_config.instantiate(cfg.checkpointer)
        ckpt = read_checkpoint(self._checkpointer, cfg.checkpointer)
        with training.set_default_dtype(self._dtype), self._device:
            model = tt_config.instantiate(cfg.model)
        check_group_size(model, self._quantizer)
        if "qat" in self._mode:
            model = self._quantizer.prepare(model)
        load_weights(model, ckpt[training.MODEL_KEY], cfg.model)
        self._model = model
        self._source = str(cfg.checkpointer.checkpoint_dir)

    def quantize(self) -> None:
        t0 = time.perf_counter()
        self._model = quantize_model(self._model, self._quantizer, self._mode)
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
        tmp.replace(path)  # a crash mid-write never leaves a truncated model-*.pt
        meta = {"mode": mode, "groupsize": getattr(self._quantizer, "groupsize", None),
                "source": self._source}
        (self._output_dir / "quantize.json").write_text(json.dumps(meta, indent=2) + "\n")
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
