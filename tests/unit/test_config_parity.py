"""Our configs named like torchtune 0.6.1's train what torchtune's train: the same model and
adapter, the same learning rate and schedule, the same dataset, and the same examples in each
optimizer step (batch_size x gradient_accumulation_steps; how a step is split into micro-batches
does not change its gradient here, the loss being the mean over the whole step's tokens).

What is ours to choose are the settings that change speed and memory, not the result: the loss
kernel, padding-free batches, activation checkpointing, compile, the optimizer's implementation
(fused, stepped in backward, 8-bit as torchtune's own full configs), gradient-norm logging, the
seed (fixed, for exact resumes), where the download lives (the tokenizer's files) and the
tokenizer's max_seq_len (a cap on rows, where torchtune's configs leave rows uncut). The
optimizer's math is the same AdamW; torchtune's full configs keep its states in 8 bits."""

import pytest
import yaml

from tune_recipes._cli import registry

pytestmark = pytest.mark.unit

# The keys whose values are the run's speed and memory settings, not what it trains.
OURS_TO_CHOOSE = ("output_dir", "checkpointer", "metric_logger", "profiler", "log_", "device",
                  "dtype", "tokenizer.max_seq_len", "tokenizer.path", "tokenizer.merges_file", "loss.", "compile", "enable_activation", "optimizer_in_bwd",
                  "padding_free", "resume_from_checkpoint", "clip_grad_norm", "optimizer._component_",
                  "optimizer.fused", "optimizer.optim_bits", "optimizer.paged", "dataset.packed", "seed", "batch_size", "gradient_accumulation_steps", "low_cpu_ram",
                  "save_adapter_weights_only",
                  "enable_fp8", "fp8_", "embedding_on_cpu", "compile_")
# What the builders and torch.optim.AdamW default to when a config leaves a key out.
DEFAULTS = {"optimizer.weight_decay": 0.01, "model.use_dora": False, "model.apply_lora_to_output": False}


def _flat(d, prefix=""):
    out = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def _twins():
    stock_root = registry._stock()[1] / "configs"
    return [(name, stock_root / f"{name}.yaml") for name in registry.list_configs()
            if (stock_root / f"{name}.yaml").is_file()]


def test_there_are_same_named_twins():
    assert len(_twins()) >= 13


@pytest.mark.parametrize("name,stock_path", _twins(), ids=[n for n, _ in _twins()])
def test_a_same_named_config_trains_what_torchtunes_trains(name, stock_path):
    ours = yaml.safe_load(registry.resolve_config(name).path.read_text())
    stock = yaml.safe_load(stock_path.read_text())
    step = lambda c: c["batch_size"] * c.get("gradient_accumulation_steps", 1)  # noqa: E731
    assert step(ours) == step(stock), f"{name}: {step(ours)} examples a step, torchtune's {step(stock)}"
    o, s = ({**DEFAULTS, **_flat(c)} for c in (ours, stock))
    differ = {k: (s.get(k, "absent"), o.get(k, "absent")) for k in set(o) | set(s)
              if not k.startswith(OURS_TO_CHOOSE) and str(o.get(k, "absent")) != str(s.get(k, "absent"))}
    assert not differ, f"{name}: (torchtune's, ours) {differ}"
    # of the keys ours chooses: clipping only measured (inf) or off, as torchtune's configs
    # leave it; the optimizer an AdamW (torch's, or 8-bit states as torchtune's full configs)
    assert ours.get("clip_grad_norm") in (None, "inf", float("inf")) or \
        ours.get("clip_grad_norm") == stock.get("clip_grad_norm"), ours.get("clip_grad_norm")
    assert ours["optimizer"]["_component_"].rsplit(".", 1)[-1].startswith(("AdamW", "PagedAdamW")), \
        ours["optimizer"]["_component_"]


def _ours_single_device_training():
    return [name for name in registry.list_configs() if not name.startswith("tiny/")
            and registry.recipe_for_config(name).endswith("single_device")]


@pytest.mark.parametrize("name", _ours_single_device_training())
def test_a_single_device_config_on_unpacked_data_lays_its_rows_end_to_end(name):
    """The shipped single-device configs train unpacked rows padding-free, and packs without
    their padding: the same examples and loss, without the padding's compute (docs/configs.md
    names them)."""
    cfg = yaml.safe_load(registry.resolve_config(name).path.read_text())
    assert cfg.get("padding_free") is True, f"{name}: padding_free is {cfg.get('padding_free')}"
