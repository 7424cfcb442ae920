"""QAT on a single device and the quantize recipe (tiny model, CPU, fp32)."""

import json
import runpy
import shutil

import pytest
import torch

from helpers import assert_same_weights, losses, run_recipe, tune, weights
from tune_recipes.config import load_config
from tune_recipes.training.metrics import read_metrics

pytestmark = pytest.mark.integration
REPO_RECIPES = __import__("tune_recipes._cli.registry", fromlist=["x"]).recipes_dir()
STEPS = ["max_steps_per_epoch=6", "lr_scheduler.num_warmup_steps=1", "fake_quant_after_n_steps=2"]


@pytest.fixture(scope="module")
def qat_reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("qat_ref")
    run_recipe("qat_single_device", "tiny/qat_single_device", out,
               [*STEPS, "batch_size=8", "gradient_accumulation_steps=1"])
    return out


@pytest.fixture(scope="module")
def qat_reference_fq_off(tmp_path_factory):
    out = tmp_path_factory.mktemp("qat_ref_off")
    run_recipe("qat_single_device", "tiny/qat_single_device", out,
               [*STEPS, "fake_quant_after_n_steps=1000", "batch_size=8"])
    return out


SHAPES = [(8, 1, False), (2, 4, False), (8, 1, True)]


def _shape_overrides(micro_batch_size, gradient_accumulation_steps, optimizer_in_bwd):
    out = [f"batch_size={micro_batch_size}",
           f"gradient_accumulation_steps={gradient_accumulation_steps}",
           f"optimizer_in_bwd={optimizer_in_bwd}"]
    return out + (["clip_grad_norm=null"] if optimizer_in_bwd else [])


@pytest.mark.parametrize("micro_batch_size, gradient_accumulation_steps, optimizer_in_bwd", SHAPES)
def test_qat_normalization_gate_same_training(
    tmp_path, qat_reference_fq_off, micro_batch_size, gradient_accumulation_steps, optimizer_in_bwd
):
    """The gate itself, tight (fp32): QAT model with fake quantization not yet on."""
    run_recipe("qat_single_device", "tiny/qat_single_device", tmp_path,
               [*STEPS, "fake_quant_after_n_steps=1000",
                *_shape_overrides(micro_batch_size, gradient_accumulation_steps, optimizer_in_bwd)])
    got, ref = losses(tmp_path), losses(qat_reference_fq_off)
    assert len(got) == 6
    torch.testing.assert_close(torch.tensor(got), torch.tensor(ref), rtol=1e-5, atol=0)
    assert_same_weights(weights(tmp_path), weights(qat_reference_fq_off), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("micro_batch_size, gradient_accumulation_steps, optimizer_in_bwd", SHAPES[1:])
def test_qat_with_fake_quant_same_training(
    tmp_path, qat_reference, micro_batch_size, gradient_accumulation_steps, optimizer_in_bwd
):
    """With fake quantization on, last-bit differences between batch shapes (GEMM summation
    order) occasionally flip an int4/int8 rounding, so the tolerance is the quantization
    grid's, not fp32's: losses rtol 2e-3; weights within 1% relative L2 per tensor (Adam turns
    a flipped rounding into a full lr-sized step on the few weights it touches)."""
    run_recipe("qat_single_device", "tiny/qat_single_device", tmp_path,
               [*STEPS, *_shape_overrides(micro_batch_size, gradient_accumulation_steps,
                                          optimizer_in_bwd)])
    got, ref = losses(tmp_path), losses(qat_reference)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(ref), rtol=2e-3, atol=0)
    a, b = weights(tmp_path), weights(qat_reference)
    for k in a:
        rel = float((a[k] - b[k]).norm() / b[k].norm())
        assert rel < 1e-2, (k, rel)


def test_fake_quant_switches_on_at_step_n(tmp_path, qat_reference):
    run_recipe("qat_single_device", "tiny/qat_single_device", tmp_path / "never",
               [*STEPS, "fake_quant_after_n_steps=1000"])
    run_recipe("qat_single_device", "tiny/qat_single_device", tmp_path / "always",
               [*STEPS, "fake_quant_after_n_steps=0"])
    at2, never, always = losses(qat_reference), losses(tmp_path / "never"), losses(tmp_path / "always")
    # Steps 1-2 run without fake quantization: identical to the run that never enables it.
    assert at2[:2] == never[:2]
    # From step 3 on the forward is fake-quantized: the losses leave the unquantized run's.
    assert all(abs(a - b) > 1e-6 for a, b in zip(at2[2:], never[2:]))
    # A run quantized from step 1 differs from the start.
    assert abs(always[0] - never[0]) > 1e-6
    flags = [r["fake_quant"] for r in read_metrics(qat_reference / "metrics.jsonl")]
    assert flags == [0, 0, 1, 1, 1, 1]


def test_optimizer_steps_every_step_on_the_skip_path(tmp_path):
    """In-process: wrap optimizer.step and check the weights changed at every step."""
    cfg = load_config(REPO_RECIPES.parent / "configs" / "tiny" / "qat_single_device.yaml",
                      [f"output_dir={tmp_path}", "max_steps_per_epoch=4",
                       "lr_scheduler.num_warmup_steps=0", "gradient_accumulation_steps=1"])
    mod = runpy.run_path(str(REPO_RECIPES / "qat_single_device.py"), run_name="qat_under_test")
    recipe = mod["QATRecipeSingleDevice"](cfg)
    recipe.setup(cfg)
    assert recipe._driver.normalizer.path == "skip"
    w = recipe._model.layers[0].attn.q_proj.weight
    snapshots = [w.detach().clone()]
    step = recipe._optimizer.step

    def step_and_snapshot(*a, **k):
        out = step(*a, **k)
        snapshots.append(w.detach().clone())
        return out

    recipe._optimizer.step = step_and_snapshot
    recipe.train()
    recipe.cleanup()
    assert len(snapshots) == 5
    for before, after in zip(snapshots, snapshots[1:]):
        assert not torch.equal(before, after)


def test_quantize_matches_fake_quantized_model(tmp_path, qat_reference):
    from torchtune import training
    from torchtune.training.quantization import Int8DynActInt4WeightQATQuantizer

    from tune_recipes.models import tiny_llama3

    out = tmp_path / "quantized"
    tune("run", "quantize", "--config", "tiny/quantize", f"output_dir={out}",
         f"checkpointer.checkpoint_dir={qat_reference / 'epoch_0'}")
    assert (out / "model-8da4w.pt").is_file()
    # The record names the quantizer whose module tree the file loads into (below).
    record = json.loads((out / "quantize.json").read_text())
    assert record["quantizer"] == "torchtune.training.quantization.Int8DynActInt4WeightQATQuantizer"
    ckpt = training.FullModelHFCheckpointer(
        checkpoint_dir=str(qat_reference / "epoch_0"),
        checkpoint_files=["model-00001-of-00001.safetensors"], model_type="LLAMA3",
        output_dir=str(tmp_path / "unused"),
    ).load_checkpoint()[training.MODEL_KEY]
    quantizer = Int8DynActInt4WeightQATQuantizer(groupsize=32)
    fake = quantizer.prepare(tiny_llama3())
    fake.load_state_dict(ckpt)
    tokens = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        fake_logits = fake(tokens)
        # The saved quantized model, loaded into a freshly converted module tree.
        real = quantizer.convert(quantizer.prepare(tiny_llama3()))
        real.load_state_dict(torch.load(out / "model-8da4w.pt", weights_only=False))
        real_logits = real(tokens)
        plain = tiny_llama3()
        plain.load_state_dict(ckpt)
        plain_logits = plain(tokens)
    # 8da4w kernels reproduce the fake quantization (same rounding) to fp32 precision ...
    torch.testing.assert_close(real_logits, fake_logits, rtol=1e-4, atol=1e-4)
    # ... and quantization really happened (the unquantized model differs).
    assert (plain_logits - real_logits).abs().max() > 1e-3
    # Another group size than the QAT run trained with (its config.yaml records 32), or a
    # checkpoint of another model: one line each, before anything is written.
    other = tune("run", "quantize", "--config", "tiny/quantize", f"output_dir={tmp_path / 'q64'}",
                 f"checkpointer.checkpoint_dir={qat_reference / 'epoch_0'}", "quantizer.groupsize=64",
                 check=False)
    assert other.returncode == 2 and "Traceback" not in other.stderr, other.stderr[-2000:]
    assert "quantizer.groupsize=64, but the QAT run that wrote" in other.stderr
    assert "trained with quantizer.groupsize=32" in other.stderr
    assert not (tmp_path / "q64").exists()
    wider = tune("run", "quantize", "--config", "tiny/quantize", f"output_dir={tmp_path / 'qw'}",
                 f"checkpointer.checkpoint_dir={qat_reference / 'epoch_0'}",
                 "model._component_=tune_recipes.models.tiny_qwen2_5", check=False)
    assert wider.returncode == 2 and "Traceback" not in wider.stderr, wider.stderr[-2000:]
    assert "does not fit the checkpoint's weights" in wider.stderr
    # Quantized again from the same checkpoint: the same bytes, nothing moves.
    saved = {p.name: p.read_bytes() for p in out.iterdir()}
    tune("run", "quantize", "--config", "tiny/quantize", f"output_dir={out}",
         f"checkpointer.checkpoint_dir={qat_reference / 'epoch_0'}")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == saved
    # Other weights where the source was (a retrained epoch_0/): the earlier quantized model
    # and its record move aside, never overwritten.
    from safetensors.torch import load_file, save_file

    retrained = tmp_path / "retrained" / "epoch_0"
    shutil.copytree(qat_reference / "epoch_0", retrained)
    weights_file = retrained / "model-00001-of-00001.safetensors"
    save_file({k: v * 1.5 for k, v in load_file(weights_file).items()}, weights_file)
    shutil.copy(qat_reference / "config.yaml", retrained.parent / "config.yaml")
    proc = tune("run", "quantize", "--config", "tiny/quantize", f"output_dir={out}",
                f"checkpointer.checkpoint_dir={retrained}")
    kept = [p for p in out.iterdir() if p.name.startswith("earlier.")]
    assert len(kept) == 1, proc.stderr[-2000:]
    assert {p.name: p.read_bytes() for p in kept[0].iterdir()} == saved
    assert f"held an earlier quantized model: model-8da4w.pt, quantize.json moved to {kept[0].name}/" \
        in proc.stderr
    assert (out / "model-8da4w.pt").read_bytes() != saved["model-8da4w.pt"]


def test_a_post_training_quantizer_converts_a_qat_checkpoint_only_as_trained(tmp_path, qat_reference):
    """torchtune's way to convert a QAT checkpoint, its post-training counterpart at the run's
    group size, gives the QAT conversion's model; another group size or another scheme is an
    error naming the QAT run's, before anything is written."""
    from torchtune.training.quantization import (Int8DynActInt4WeightQATQuantizer,
                                                 Int8DynActInt4WeightQuantizer)

    from tune_recipes.models import tiny_llama3

    ptq = "quantizer._component_=torchtune.training.quantization.Int8DynActInt4WeightQuantizer"
    source = f"checkpointer.checkpoint_dir={qat_reference / 'epoch_0'}"
    tune("run", "quantize", "--config", "tiny/quantize", f"output_dir={tmp_path / 'qat'}", source)
    tune("run", "quantize", "--config", "tiny/quantize", f"output_dir={tmp_path / 'ptq'}", source, ptq)
    tokens = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        converted = Int8DynActInt4WeightQuantizer(groupsize=32).quantize(tiny_llama3())
        converted.load_state_dict(torch.load(tmp_path / "ptq" / "model-8da4w.pt", weights_only=False),
                                  assign=True)
        qat = Int8DynActInt4WeightQATQuantizer(groupsize=32)
        reference = qat.convert(qat.prepare(tiny_llama3()))
        reference.load_state_dict(torch.load(tmp_path / "qat" / "model-8da4w.pt", weights_only=False))
        torch.testing.assert_close(converted(tokens), reference(tokens), rtol=1e-4, atol=1e-4)
    for overrides, fragment in (
            ([ptq, "quantizer.groupsize=64"], "trained with quantizer.groupsize=32"),
            (["quantizer._component_=torchtune.training.quantization.Int4WeightOnlyQuantizer",
              "quantizer.groupsize=32", "dtype=bf16"],
             "trained with quantizer._component_=torchtune.training.quantization.Int8DynActInt4WeightQATQuantizer")):
        out = tmp_path / "refused"
        proc = tune("run", "quantize", "--config", "tiny/quantize", f"output_dir={out}", source, *overrides,
                    check=False)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
        assert fragment in proc.stderr, proc.stderr[-2000:]
        assert not out.exists()


@pytest.mark.parametrize("override, fragment", [
    ("quantizer._component_=torchtune.training.quantization.NoSuchQuantizer",
     "quantizer._component_: 'torchtune.training.quantization.NoSuchQuantizer' does not resolve"),
    ("quantizer._component_=torch.nn.Identity", "is not a quantizer torchtune knows"),
    ("quantizer.groupsize=48", "quantizer.groupsize=48 does not divide layer 'layers.0.attn.q_proj' (in_features=256"),
])
def test_bad_quantizer_is_named(tmp_path, override, fragment):
    extra = ["~quantizer.groupsize"] if "Identity" in override else []
    proc = tune("run", "qat_single_device", "--config", "tiny/qat_single_device",
                f"output_dir={tmp_path}", override, *extra, check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert fragment in proc.stderr and "Traceback" not in proc.stderr


_INT4 = "quantizer._component_=torchtune.training.quantization.Int4WeightOnly"


@pytest.mark.parametrize("overrides, line", [
    # int4 weight-only kernels take bf16 only: the converted model's smoke forward was a dtype
    # traceback after the conversion.
    ([f"{_INT4}QATQuantizer", "dtype=fp32"],
     "dtype=fp32: quantizer._component_=torchtune.training.quantization.Int4WeightOnlyQATQuantizer "
     "converts the linears to int4 weight-only kernels, which take bf16 only; set dtype=bf16"),
    # torchao 0.15's int4 weight-only conversion imports fbgemm-gpu-genai (not a dependency).
    ([f"{_INT4}Quantizer", "dtype=bf16"],
     "quantizer._component_=torchtune.training.quantization.Int4WeightOnlyQuantizer: torchao cannot "
     "convert with it here (Requires fbgemm-gpu-genai"),
    # A LoRA builder's adapters failed the group size check as if they were layers.
    (["model._component_=tune_recipes.models.lora_tiny_llama3", "model.lora_attn_modules=[q_proj]"],
     "model._component_=tune_recipes.models.lora_tiny_llama3 builds LoRA adapters; quantize takes "
     "the plain model's builder"),
])
def test_a_quantize_it_cannot_do_is_one_line_and_writes_nothing(tmp_path, overrides, line):
    import importlib.util

    if "fbgemm" in line and importlib.util.find_spec("fbgemm_gpu") is not None:
        pytest.skip("fbgemm-gpu is installed: the conversion runs")
    proc = tune("run", "quantize", "--config", "tiny/quantize", f"output_dir={tmp_path}",
                "checkpointer.checkpoint_dir=${tiny_checkpoint:}",
                "checkpointer.checkpoint_files=[model.safetensors]", *overrides, check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert line in proc.stderr, proc.stderr[-2000:]
    assert not list(tmp_path.glob("model-*.pt"))


def test_a_post_training_quantized_model_loads_as_the_docs_say(tmp_path):
    """A plain checkpoint quantized by a post-training quantizer: the file loads into the
    quantizer's own module tree (docs/recipes/quantize.md, Load it) and gives the logits of the
    plain model quantized in memory; quantize.json names that quantizer."""
    from torchtune import training
    from torchtune.training.quantization import Int8DynActInt4WeightQuantizer

    from tune_recipes.models import tiny_llama3
    from tune_recipes.resolvers import tiny_checkpoint

    ptq = "torchtune.training.quantization.Int8DynActInt4WeightQuantizer"
    out = tmp_path / "quantized"
    tune("run", "quantize", "--config", "tiny/quantize", f"output_dir={out}",
         f"checkpointer.checkpoint_dir={tiny_checkpoint()}",
         "checkpointer.checkpoint_files=[model.safetensors]", f"quantizer._component_={ptq}")
    assert json.loads((out / "quantize.json").read_text())["quantizer"] == ptq
    ckpt = training.FullModelHFCheckpointer(
        checkpoint_dir=tiny_checkpoint(), checkpoint_files=["model.safetensors"],
        model_type="LLAMA3", output_dir=str(tmp_path / "unused"),
    ).load_checkpoint()[training.MODEL_KEY]
    tokens = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        in_memory = tiny_llama3()
        in_memory.load_state_dict(ckpt)
        expected = Int8DynActInt4WeightQuantizer(groupsize=32).quantize(in_memory)(tokens)
        loaded = Int8DynActInt4WeightQuantizer(groupsize=32).quantize(tiny_llama3())
        loaded.load_state_dict(torch.load(out / "model-8da4w.pt", weights_only=False), assign=True)
        torch.testing.assert_close(loaded(tokens), expected, rtol=1e-5, atol=1e-5)
