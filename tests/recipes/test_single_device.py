"""End-to-end runs of the single-device recipes on the tiny model (CPU, fp32).

Invariance: the same effective batch (micro_batch_size x gradient_accumulation_steps) gives the
same per-step losses and the same final weights whether it is one batch of 8, four
micro-batches of 2, or one batch stepped inside backward. Tolerances (fp32): losses rtol 1e-5,
weights rtol 1e-4 / atol 1e-6 after 6 AdamW steps (summation order differs between the paths).
"""

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from helpers import assert_same_weights, losses, run_on_gpu, run_recipe, tune, weights
from tune_recipes.training.metrics import read_metrics

pytestmark = pytest.mark.integration
STEPS = ["max_steps_per_epoch=6", "lr_scheduler.num_warmup_steps=1"]
# Adam turns last-bit differences of near-zero gradients into lr-sized weight differences;
# a smaller lr for the LoRA invariance runs keeps the weight tolerance tight.
LORA_LR = ["optimizer.lr=3e-3"]


@pytest.fixture(scope="module")
def full_reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("full_ref")
    run_recipe("full_finetune_single_device", "tiny/full_single_device", out,
               [*STEPS, "batch_size=8", "gradient_accumulation_steps=1"])
    return out


@pytest.fixture(scope="module")
def lora_reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("lora_ref")
    run_recipe("lora_finetune_single_device", "tiny/lora_single_device", out,
               [*STEPS, *LORA_LR, "batch_size=8", "gradient_accumulation_steps=1"])
    return out


@pytest.mark.parametrize(
    "micro_batch_size, gradient_accumulation_steps, optimizer_in_bwd, compile_step",
    [(8, 1, False, False), (2, 4, False, False), (8, 1, True, False),
     (8, 1, False, True)],  # compile_optimizer_step: the same training, one compiled step
)
def test_full_same_effective_batch_same_training(
    tmp_path, full_reference, micro_batch_size, gradient_accumulation_steps, optimizer_in_bwd,
    compile_step
):
    overrides = [*STEPS, f"batch_size={micro_batch_size}",
                 f"gradient_accumulation_steps={gradient_accumulation_steps}",
                 f"optimizer_in_bwd={optimizer_in_bwd}", f"compile_optimizer_step={compile_step}"]
    if optimizer_in_bwd:
        overrides.append("clip_grad_norm=null")
    run_recipe("full_finetune_single_device", "tiny/full_single_device", tmp_path, overrides)
    ref, got = losses(full_reference), losses(tmp_path)
    assert len(got) == 6
    torch.testing.assert_close(torch.tensor(got), torch.tensor(ref), rtol=1e-5, atol=0)
    # The compiled step orders Adam's operations differently from the default one: on weights
    # whose second moment is near zero (rare tokens' embedding rows) Adam scales that rounding
    # up to a fraction of the lr (3e-3): 1.7e-5 seen, so 1% of the lr there.
    atol = 3e-5 if compile_step else 1e-6
    assert_same_weights(weights(tmp_path), weights(full_reference), rtol=1e-4, atol=atol)
    assert got[-1] < got[0]


@pytest.mark.parametrize("micro_batch_size, gradient_accumulation_steps", [(8, 1), (2, 4)])
def test_lora_same_effective_batch_same_training(
    tmp_path, lora_reference, micro_batch_size, gradient_accumulation_steps
):
    run_recipe("lora_finetune_single_device", "tiny/lora_single_device", tmp_path,
               [*STEPS, *LORA_LR, f"batch_size={micro_batch_size}",
                f"gradient_accumulation_steps={gradient_accumulation_steps}"])
    ref, got = losses(lora_reference), losses(tmp_path)
    assert len(got) == 6
    torch.testing.assert_close(torch.tensor(got), torch.tensor(ref), rtol=1e-5, atol=0)
    assert_same_weights(weights(tmp_path, name="adapter_model.safetensors"),
                        weights(lora_reference, name="adapter_model.safetensors"),
                        rtol=1e-4, atol=1e-6)


def test_gradient_accumulation_is_not_a_mean_of_means(tmp_path, full_reference):
    """Guards the token weighting itself. At the starting weights, the first step's four
    micro-batches of 2 have means m_i over n_i tokens: the batch-8 run's first logged loss must be
    sum(m_i n_i) / sum(n_i), and the mean of the means must miss it by far more than the
    invariance tests' tolerance, so a mean-of-means GA would fail them."""
    from torchtune import config as tt_config, training

    from tune_recipes.config import load_config
    from tune_recipes.training.checkpointing.state import RecipeState
    from tune_recipes.training.losses.lm_loss import CausalLMLoss
    from tune_recipes.training.setup.model import setup_full_model
    from tune_recipes.training.setup.recipe import setup_data_and_schedule
    from tune_recipes.training.step.batch import count_valid_tokens
    from tune_recipes.training.step.optim import build_optimizer

    cfg = load_config(Path(__file__).resolve().parents[2] / "configs" / "tiny" / "full_single_device.yaml",
                      [f"output_dir={tmp_path}", "batch_size=2", "gradient_accumulation_steps=4"])
    ckpt = tt_config.instantiate(cfg.checkpointer).load_checkpoint()
    model = setup_full_model(cfg.model, dtype=torch.float32, device=torch.device("cpu"),
                             state_dict=ckpt[training.MODEL_KEY])
    lm_loss = CausalLMLoss(model, tt_config.instantiate(cfg.loss))
    plan = setup_data_and_schedule(
        cfg, tt_config.instantiate(cfg.tokenizer), build_optimizer(cfg.optimizer, model),
        RecipeState(seed=cfg.seed, total_epochs=1, max_steps_per_epoch=None), ignore_index=-100)
    plan.dataloader.sampler.set_epoch(0)
    means, counts = [], []
    with torch.no_grad():
        for batch, _ in zip(plan.dataloader, range(4)):
            counts.append(count_valid_tokens(batch["labels"]))
            means.append(lm_loss(batch).item())
    exact = sum(m * n for m, n in zip(means, counts)) / sum(counts)
    mean_of_means = sum(means) / len(means)
    assert len(set(counts)) > 1, "the first step's micro-batches must be ragged"
    assert losses(full_reference)[0] == pytest.approx(exact, rel=1e-5)
    assert abs(mean_of_means - exact) / exact > 100 * 1e-5


def test_default_lora_run_leaves_checkpoint_adapter_and_metrics(lora_reference):
    epoch = lora_reference / "epoch_0"
    for name in ["model-00001-of-00001.safetensors", "adapter_model.safetensors",
                 "adapter_config.json", "adapter_model.pt", "config.json"]:
        assert (epoch / name).is_file(), name
    cfg = json.loads((epoch / "adapter_config.json").read_text())
    assert cfg["peft_type"] == "LORA" and cfg["r"] == 8
    rows = [json.loads(l) for l in (lora_reference / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 7))
    assert {"loss", "lr", "grad_norm", "tokens_per_second_per_gpu"} <= rows[0].keys()
    assert rows[-1]["loss"] < rows[0]["loss"]


@pytest.mark.parametrize("recipe, config, extra", [
    ("full_finetune_single_device", "tiny/full_single_device", []),
    ("lora_finetune_single_device", "tiny/lora_single_device", []),
    # torchao's 8-bit AdamW stepped in backward (torchtune's full configs' memory without
    # bitsandbytes): its quantized states are saved and restored exactly too. Slow: torchao
    # compiles its step per parameter shape in each process (~1 minute on 2 CPU cores).
    pytest.param("full_finetune_single_device", "tiny/full_single_device",
                 ["optimizer._component_=tune_recipes.optim.AdamW8bit", "optimizer_in_bwd=True", "clip_grad_norm=null"],
                 marks=pytest.mark.slow),
], ids=["full", "lora", "full-adamw8bit-in-backward"])
def test_resume_equals_uninterrupted(tmp_path, recipe, config, extra):
    steps = ["max_steps_per_epoch=3", "epochs=2", "lr_scheduler.num_warmup_steps=1", *extra]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run_recipe(recipe, config, straight, steps)
    # Simulate a crash after epoch 0: only epoch_0 and its recipe state remain.
    shutil.copytree(straight, resumed)
    shutil.rmtree(resumed / "epoch_1")
    run_recipe(recipe, config, resumed, [*steps, "resume_from_checkpoint=True"])
    name = ("adapter_model.safetensors" if "lora" in recipe
            else "model-00001-of-00001.safetensors")
    assert_same_weights(weights(resumed, 1, name), weights(straight, 1, name), rtol=0, atol=0)
    # The resumed run logged steps 4..6 with the uninterrupted run's losses.
    assert losses(resumed)[-3:] == losses(straight)[-3:]


def test_all_masked_batch_fails_clearly(tmp_path):
    # max_seq_len=8 truncates every example before its response: no label survives.
    proc = tune(
        "run", "full_finetune_single_device", "--config", "tiny/full_single_device",
        f"output_dir={tmp_path}", "tokenizer.max_seq_len=8", check=False,
    )
    # Found when the dataset is built, before any step (a batch without a label token later in
    # a run is the step's own error: tests/unit/training/step).
    assert proc.returncode == 2
    assert "tokenizer.max_seq_len=8: none of the first 16 examples" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_micro_batch_cut_before_its_response_leaves_the_step_to_the_others(tmp_path):
    """batch_size=1 with accumulation: an example whose prompt fills max_seq_len has no label
    token; its step trains on the other micro-batches' tokens instead of stopping the run.
    A step of only such examples is one line naming it."""
    long_prompt = "describe " * 200
    rows = [{"instruction": long_prompt if i % 4 == 1 else f"say {i}", "input": "",
             "output": f"ok {i}"} for i in range(8)]
    data = tmp_path / "rows.json"
    data.write_text(json.dumps(rows))
    args = [f"dataset.data_files={data}", "dataset._component_=torchtune.datasets.alpaca_dataset",
            "dataset.source=json", "dataset.train_on_input=False", "shuffle=False",
            "batch_size=1", "gradient_accumulation_steps=4", "max_steps_per_epoch=2",
            "lr_scheduler.num_warmup_steps=1"]
    run_recipe("full_finetune_single_device", "tiny/full_single_device", tmp_path / "out", args)
    assert read_metrics(tmp_path / "out" / "metrics.jsonl", "step") == [1, 2]
    data.write_text(json.dumps([{**r, "instruction": long_prompt} if i < 4 else r
                                for i, r in enumerate(rows)]))
    proc = run_recipe("full_finetune_single_device", "tiny/full_single_device", tmp_path / "bad",
                      args, check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1].startswith(
        "tune: error: Every micro-batch of the step ending at epoch 0, step 1 (batch 3 of the "
        "epoch) has no unmasked label token")
    # on_nonfinite=skip (the error's advice that keeps the data, so a checkpoint still resumes):
    # that step is skipped and named, the run goes on; with each loss the recipes ship.
    for loss in ("torchtune.modules.loss.CEWithChunkedOutputLoss",
                 "tune_recipes.modules.loss.FusedLinearCrossEntropyLoss"):
        out = tmp_path / loss.rsplit(".", 1)[1]
        proc = run_recipe("full_finetune_single_device", "tiny/full_single_device", out,
                          [*args, "on_nonfinite=skip", f"loss._component_={loss}"])
        assert ("skipped the update of epoch 0, step 1 (batches 0-3 of the epoch): no unmasked "
                "label token (on_nonfinite=skip; 1 skipped so far)") in proc.stderr, proc.stderr[-2000:]
        assert read_metrics(out / "metrics.jsonl", "skipped_steps") == [1, 1]
        skipped, trained = read_metrics(out / "metrics.jsonl", "loss")
        assert skipped == "nan" and math.isfinite(trained)  # JSON has no NaN: written as "nan"


def test_unknown_config_key_named(tmp_path):
    proc = tune("run", "lora_finetune_single_device", "--config", "tiny/lora_single_device",
                f"output_dir={tmp_path}", "gradient_acumulation_steps=4", check=False)
    assert proc.returncode == 2
    assert "gradient_acumulation_steps" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_optimizer_in_bwd_rejects_clipping_and_accumulation(tmp_path):
    for bad in (["clip_grad_norm=1.0"], ["clip_grad_norm=null", "gradient_accumulation_steps=2"]):
        proc = tune("run", "full_finetune_single_device", "--config", "tiny/full_single_device",
                    f"output_dir={tmp_path}", "optimizer_in_bwd=True", *bad, check=False)
        assert proc.returncode == 2, proc.stderr
        assert "optimizer_in_bwd" in proc.stderr and "Traceback" not in proc.stderr


def test_qlora_and_dora_variants_train(tmp_path):
    common = ["max_steps_per_epoch=5", "lr_scheduler.num_warmup_steps=1",
              "model.apply_lora_to_output=False"]
    run_recipe("lora_finetune_single_device", "tiny/lora_single_device", tmp_path / "lora", common)
    run_recipe("lora_finetune_single_device", "tiny/lora_single_device", tmp_path / "qlora",
               [*common, "model.quantize_base=True"])
    run_recipe("lora_finetune_single_device", "tiny/lora_single_device", tmp_path / "dora",
               [*common, "model.use_dora=True"])
    lora, qlora, dora = (losses(tmp_path / n) for n in ("lora", "qlora", "dora"))
    # NF4 base: the first steps are close to the full-precision base's, but not identical (it
    # really is quantized). Later steps drift apart at this high demo learning rate.
    torch.testing.assert_close(torch.tensor(qlora[:3]), torch.tensor(lora[:3]), rtol=2e-2, atol=0)
    assert qlora[0] != lora[0]
    assert dora[-1] < dora[0] and qlora[-1] < qlora[0]
    dora_adapter = weights(tmp_path / "dora", name="adapter_model.safetensors")
    assert any("magnitude" in k for k in dora_adapter)
    assert not any("magnitude" in k for k in weights(tmp_path / "lora", name="adapter_model.safetensors"))
    # The merged QLoRA checkpoint is a plain bf16/fp32 HF checkpoint.
    merged = weights(tmp_path / "qlora")
    assert all(v.dtype in (torch.float32, torch.bfloat16) for v in merged.values())


def test_qlora_compiled_and_eager_train_alike(tmp_path):
    """QLoRA compiled (torchao's NF4 dequantization traced into the graph) and eager, with every
    layer checkpointed (tune_recipes.modules.nf4's dequantization, torch's reentrant checkpoint):
    both run, and their losses agree to compile's rounding (fp32 CPU; the in-process case, the
    dequantization installed and then traced: tests/unit/modules/test_nf4.py)."""
    common = ["max_steps_per_epoch=2", "model.quantize_base=True", "enable_activation_checkpointing=True"]
    eager = run_recipe("lora_finetune_single_device", "tiny/lora_single_device", tmp_path / "eager", common)
    assert "dequantized by tune_recipes.modules.nf4" in eager.stdout + eager.stderr
    compiled = run_recipe("lora_finetune_single_device", "tiny/lora_single_device", tmp_path / "compiled",
                          [*common, "compile=True"])
    assert "dequantized by tune_recipes.modules.nf4" not in compiled.stdout + compiled.stderr
    torch.testing.assert_close(torch.tensor(losses(tmp_path / "compiled")),
                               torch.tensor(losses(tmp_path / "eager")), rtol=1e-4, atol=0)


def test_kd_single_device_logs_both_parts_and_mixes_them(tmp_path):
    from tune_recipes.training.metrics import read_metrics

    run_recipe("knowledge_distillation_single_device", "tiny/kd_single_device", tmp_path,
               ["max_steps_per_epoch=3", "kd_ratio=0.25"])
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert len(rows) == 3
    for r in rows:
        assert r["loss"] == pytest.approx(0.75 * r["class_loss"] + 0.25 * r["kd_loss"], rel=1e-5)
    proc = tune("run", "knowledge_distillation_single_device", "--config", "tiny/kd_single_device",
                f"output_dir={tmp_path / 'bad'}", "kd_ratio=1.5", check=False)
    assert proc.returncode == 2 and "kd_ratio=1.5: expected a number >= 0 and <= 1" in proc.stderr


def test_a_teacher_that_does_not_fit_its_checkpoint_is_named_in_one_line(tmp_path):
    proc = tune("run", "knowledge_distillation_single_device", "--config", "tiny/kd_single_device",
                f"output_dir={tmp_path}", "teacher_model._component_=tune_recipes.models.tiny_qwen2_5",
                "max_steps_per_epoch=1", check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert ("teacher_model: tune_recipes.models.tiny_qwen2_5 does not fit the checkpoint's weights"
            in proc.stderr and "teacher_checkpointer.checkpoint_dir" in proc.stderr)
    assert "Traceback" not in proc.stderr
    # A teacher checkpointer for another format: one line naming teacher_checkpointer.
    proc = tune("run", "knowledge_distillation_single_device", "--config", "tiny/kd_single_device",
                f"output_dir={tmp_path}", "max_steps_per_epoch=1",
                "teacher_checkpointer._component_=torchtune.training.FullModelMetaCheckpointer",
                check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1].startswith(
        "tune: error: teacher_checkpointer: torchtune.training.FullModelMetaCheckpointer could "
        "not load")


@pytest.mark.parametrize("overrides, line", [
    (["checkpointer._component_=torchtune.training.FullModelTorchTuneCheckpointer"],
     "model: tune_recipes.models.lora_tiny_llama3 does not fit the checkpoint's weights (Missing "
     "non-LoRA key tok_embeddings.weight from base model dict); check model._component_ and "
     "checkpointer._component_"),
    (["model._component_=tune_recipes.models.lora_tiny_llama3_2", "model.apply_lora_to_output=True"],
     "model: tune_recipes.models.lora_tiny_llama3_2 refused its arguments (ValueError: "
     "apply_lora_to_output is currently not supporting"),
], ids=["another-checkpoint-format", "lora-on-a-tied-output"])
def test_a_lora_model_that_cannot_be_built_or_loaded_is_one_line(tmp_path, overrides, line):
    proc = tune("run", "lora_finetune_single_device", "--config", "tiny/lora_single_device",
                f"output_dir={tmp_path}", "max_steps_per_epoch=1", *overrides, check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1].startswith(f"tune: error: {line}")


def test_resume_keeps_the_checkpoints_seed_and_data_order(tmp_path):
    """A resumed run with a different seed in the config still continues the original run
    (same data order), and says so."""
    steps = ["max_steps_per_epoch=3", "epochs=2", "lr_scheduler.num_warmup_steps=1"]
    cfg = ("full_finetune_single_device", "tiny/full_single_device")
    run_recipe(*cfg, tmp_path / "straight", steps)
    shutil.copytree(tmp_path / "straight", tmp_path / "resumed")  # a crash after epoch 0
    shutil.rmtree(tmp_path / "resumed" / "epoch_1")
    proc = run_recipe(*cfg, tmp_path / "resumed", [*steps, "resume_from_checkpoint=True", "seed=5"])
    assert ("warning: config seed=5 differs from the checkpoint's 0; using the checkpoint's"
            in proc.stderr.splitlines())
    name = "model-00001-of-00001.safetensors"
    assert_same_weights(weights(tmp_path / "resumed", 1, name), weights(tmp_path / "straight", 1, name),
                        rtol=0, atol=0)


@pytest.mark.gpu
def test_adamw8bit_compiled_in_one_graph_trains_as_its_step_per_parameter(tmp_path):
    """compile_optimizer_step with our AdamW8bit, as a user turns it on: the parameters that
    step whole update in batches of alike ones, a compiled call a batch (tests/unit/
    test_adamw8bit.py: bit for bit against torchao's step on the CPU, and on a GPU in its cuda
    case). On the GPU in bf16 the recipe trains as with one compiled call a parameter: the same
    losses and weights (stochastic rounding off: its random bits are drawn per call), within a
    bf16 rounding of each weight, where a kernel fused otherwise may round one element the
    other way; and every weight moved from the checkpoint it started from."""
    from safetensors.torch import load_file

    from tune_recipes.resolvers import tiny_checkpoint

    # NOTE: no warmup. The tiny config warms up over 4 steps, and in bf16 an update below half
    # a bf16 spacing of the weight rounds away: layer 0's input norm (ones) kept its weights
    # through the 4 warm-up steps in both runs. At the full rate the first step moves every
    # weight whose gradient is not zero by the learning rate, more than half a spacing below 1.
    eight_bit = ["optimizer._component_=tune_recipes.optim.AdamW8bit", "optimizer.lr=3e-3",
                 "lr_scheduler.num_warmup_steps=0"]
    run_on_gpu("full_finetune_single_device", "tiny/full_single_device", tmp_path / "each", *eight_bit)
    run_on_gpu("full_finetune_single_device", "tiny/full_single_device", tmp_path / "one", *eight_bit,
               "compile_optimizer_step=True")
    each, one = losses(tmp_path / "each"), losses(tmp_path / "one")
    assert len(one) == 4 and one[-1] < one[0]
    torch.testing.assert_close(torch.tensor(one), torch.tensor(each), rtol=1e-3, atol=0)
    assert_same_weights(weights(tmp_path / "one"), weights(tmp_path / "each"), rtol=1e-2, atol=1e-3)
    start = load_file(str(Path(tiny_checkpoint()) / "model.safetensors"))
    trained = weights(tmp_path / "one")
    assert trained.keys() == start.keys()
    unmoved = [k for k in start if torch.equal(trained[k].float(), start[k].float())]
    assert not unmoved, unmoved
