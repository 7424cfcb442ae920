"""Distributed recipes on CPU with gloo: 2 ranks == 1 rank == one device, on ragged data.

Same global batch: 2 ranks x batch 4 vs 1 rank x batch 8 (and the single-device recipe with
batch 8). The tiny data has a different number of unmasked tokens in every example, so each
rank's count differs every step; only the global token normalization makes these agree.
Tolerances (fp32): losses rtol 1e-5, weights rtol 1e-4 / atol 1e-5.
"""

import pytest
import torch

from helpers import assert_runs_agree, assert_same_weights, losses, run_dist, run_recipe, tune, weights
from tune_recipes.training.metrics import read_metrics

pytestmark = pytest.mark.integration
STEPS = ["max_steps_per_epoch=4", "lr_scheduler.num_warmup_steps=1"]



@pytest.mark.parametrize("ga", [1, 2])
def test_full_two_ranks_equal_one_rank_and_single_device(tmp_path, ga):
    common = [*STEPS, f"gradient_accumulation_steps={ga}"]
    run_dist(2, "full_finetune_distributed", "tiny/full_distributed", tmp_path / "r2",
             [*common, "batch_size=4"])
    # One rank at GA 2 only (CI time): at GA 1 the two ranks are held to the single device,
    # whose GA-1 path skips the token rescale the distributed recipe keeps.
    runs = [tmp_path / "r2"]
    if ga == 2:
        run_dist(1, "full_finetune_distributed", "tiny/full_distributed", tmp_path / "r1",
                 [*common, "batch_size=8"])
        runs.append(tmp_path / "r1")
    run_recipe("full_finetune_single_device", "tiny/full_single_device", tmp_path / "sd",
               [*common, "batch_size=8"])
    assert_runs_agree(*runs, tmp_path / "sd", steps=4)


def test_full_distributed_fused_loss_equals_plain(tmp_path):
    fused = "loss._component_=tune_recipes.modules.loss.FusedLinearCrossEntropyLoss"
    common = [*STEPS, "batch_size=4", "gradient_accumulation_steps=2"]
    run_dist(2, "full_finetune_distributed", "tiny/full_distributed", tmp_path / "plain", common)
    run_dist(2, "full_finetune_distributed", "tiny/full_distributed", tmp_path / "fused",
             [*common, fused])
    torch.testing.assert_close(torch.tensor(losses(tmp_path / "fused")),
                               torch.tensor(losses(tmp_path / "plain")), rtol=1e-5, atol=0)
    assert_same_weights(weights(tmp_path / "fused"), weights(tmp_path / "plain"), rtol=1e-4, atol=1e-5)


def test_distributed_resume_equals_uninterrupted(tmp_path):
    import shutil

    steps = ["max_steps_per_epoch=2", "epochs=2", "lr_scheduler.num_warmup_steps=1"]
    run_dist(2, "full_finetune_distributed", "tiny/full_distributed", tmp_path / "straight", steps)
    # A crash after epoch 0: a copy of the finished run without its epoch_1 (a second run of
    # the same command would write the same files, at the cost of two more processes).
    shutil.copytree(tmp_path / "straight", tmp_path / "resumed")
    shutil.rmtree(tmp_path / "resumed" / "epoch_1")
    run_dist(2, "full_finetune_distributed", "tiny/full_distributed", tmp_path / "resumed",
             [*steps, "resume_from_checkpoint=True"])
    assert_same_weights(weights(tmp_path / "resumed", 1), weights(tmp_path / "straight", 1),
                        rtol=0, atol=0)


def test_distributed_mid_epoch_resume_equals_uninterrupted(tmp_path):
    """2 gloo ranks resumed from step_2/ in the first epoch (no epoch folder yet): each rank
    continues its own data shard and RNG; same losses and weights as the uninterrupted run."""
    import shutil

    args = ["max_steps_per_epoch=3", "lr_scheduler.num_warmup_steps=1", "save_every_n_steps=2"]
    out, killed = tmp_path / "straight", tmp_path / "killed"
    run_dist(2, "full_finetune_distributed", "tiny/full_distributed", out, args)
    state = torch.load(out / "step_2" / "recipe_state.pt", weights_only=True)
    assert [r["dataloader"]["_num_yielded"] for r in state["rank_states"]] == [2, 2]
    shutil.copytree(out, killed)
    shutil.rmtree(killed / "epoch_0")
    run_dist(2, "full_finetune_distributed", "tiny/full_distributed", killed,
             [*args, "resume_from_checkpoint=True"])
    assert [r["step"] for r in read_metrics(killed / "metrics.jsonl")] == [1, 2, 3]
    assert losses(killed) == losses(out)
    assert_same_weights(weights(killed), weights(out), rtol=0, atol=0)


def test_distributed_recipe_outside_torchrun_says_how(tmp_path):
    proc = tune("run", "full_finetune_distributed", "--config", "tiny/full_distributed",
                f"output_dir={tmp_path}", check=False)
    assert proc.returncode == 2 and "--nproc_per_node" in proc.stderr


def test_one_ranks_data_error_is_its_line_not_a_traceback_of_the_other(tmp_path):
    """Only the rank that reads the bad row fails; the other's collective then fails too,
    which it says in one line pointing at the first (not a gloo traceback burying it)."""
    import json

    # Past the 16 examples every rank checks before training, and a refusal of the template's
    # that no column count sees (two user turns in a row): only rank 1 meets it, mid-run.
    rows = [{"conversations": [{"from": "human", "value": f"say {i}"},
                               {"from": "human" if i == 19 else "gpt", "value": f"ok {i}"}]}
            for i in range(24)]
    data = tmp_path / "rows.json"
    data.write_text(json.dumps(rows))
    proc = run_dist(2, "lora_finetune_distributed", "tiny/lora_distributed", tmp_path / "out",
                    [f"dataset.data_files={data}", "dataset.source=json",
                     "dataset._component_=torchtune.datasets.chat_dataset",
                     "dataset.conversation_column=conversations", "dataset.conversation_style=sharegpt",
                     "shuffle=False", "batch_size=1", "max_steps_per_epoch=null"], check=False)
    assert proc.returncode != 0
    # printed once, by `tune` after the launch, naming the rank that met it
    assert proc.stderr.count("example 19 cannot be made into tokens") == 1, proc.stderr[-3000:]
    assert "tune: error: rank 1: dataset: example 19 cannot be made into tokens" in proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]


_VOCAB_320 = ["model._component_=torchtune.models.llama3.llama3", "model.vocab_size=320",
              "model.num_layers=2", "model.num_heads=8", "model.num_kv_heads=2", "model.embed_dim=256",
              "model.intermediate_dim=512", "model.max_seq_len=512", "model.norm_eps=1e-5",
              "model.rope_base=500000"]


def _llama3(prefix: str, **changes) -> list:
    args = {**dict(vocab_size=272, num_layers=2, num_heads=8, num_kv_heads=2, embed_dim=256,
                   intermediate_dim=512, max_seq_len=512, norm_eps=1e-5, rope_base=500000), **changes}
    return [f"{prefix}.{k}={v}" for k, v in args.items()]


@pytest.mark.parametrize("recipe,config,overrides,prefix,detail", [
    ("full_finetune_distributed", "tiny/full_distributed",
     ["model._component_=torchtune.models.llama3.llama3", *_llama3("model", vocab_size=320)],
     "model", "size mismatch for "),
    # A checkpoint of more layers than the model: torchtune's sharded load fails on the key it
    # cannot find (an AttributeError) before any size is compared.
    ("full_finetune_distributed", "tiny/full_distributed",
     ["model._component_=torchtune.models.llama3.llama3", *_llama3("model", num_layers=1)],
     "model", 'Unexpected key(s) in state_dict: "layers.1.'),
    ("lora_finetune_distributed", "tiny/lora_distributed",
     ["model._component_=torchtune.models.llama3.lora_llama3", *_llama3("model", num_layers=1)],
     "model", 'Unexpected key(s) in state_dict: "layers.1.'),
    ("knowledge_distillation_distributed", "tiny/kd_distributed",
     ["teacher_model._component_=torchtune.models.llama3.llama3", *_llama3("teacher_model", embed_dim=512)],
     "teacher_model", "size mismatch for "),
])
def test_weights_of_another_shape_are_one_line_naming_the_key(tmp_path, recipe, config, overrides,
                                                              prefix, detail):
    # The sharded load's failure was torch's list of every weight, a traceback a rank.
    proc = run_dist(2, recipe, config, tmp_path / "out", [*overrides, "max_steps_per_epoch=1"], check=False)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if "does not fit the checkpoint's weights" in line]
    component = overrides[0].split("=", 1)[1]
    assert lines and all(line.startswith(f"tune: error: {prefix}: {component} does not fit the "
                                         f"checkpoint's weights ({detail}") for line in lines), lines


def test_a_qlora_base_that_cannot_be_split_among_the_ranks_is_one_line(tmp_path):
    # The tiny model's k/v projections hold one NF4 quantization block of scales: torchao's
    # split for FSDP2 asserted, a traceback a rank.
    proc = run_dist(2, "lora_finetune_distributed", "tiny/lora_distributed", tmp_path / "out",
                    ["model.quantize_base=True", "max_steps_per_epoch=1"], check=False)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert ("tune: error: model: tune_recipes.models.lora_tiny_llama3 with a quantized (NF4) base "
            "cannot be sharded over 2 ranks (") in proc.stderr
    assert "set quantize_base=False" in proc.stderr


@pytest.mark.parametrize("ga", [1, 2])
def test_lora_two_ranks_equal_one_rank_and_single_device(tmp_path, ga):
    common = [*STEPS, f"gradient_accumulation_steps={ga}", "optimizer.lr=3e-3"]
    run_dist(2, "lora_finetune_distributed", "tiny/lora_distributed", tmp_path / "r2",
             [*common, "batch_size=4"])
    others = ["sd"] if ga == 1 else ["r1", "sd"]  # one rank at GA 2 only, as in the full test
    if ga == 2:
        run_dist(1, "lora_finetune_distributed", "tiny/lora_distributed", tmp_path / "r1",
                 [*common, "batch_size=8"])
    run_recipe("lora_finetune_single_device", "tiny/lora_single_device", tmp_path / "sd",
               [*common, "batch_size=8"])
    assert_runs_agree(tmp_path / "r2", *(tmp_path / o for o in others), steps=4,
                      name="adapter_model.safetensors")


def test_dora_two_ranks_equal_single_device(tmp_path):
    """DoRA (model.use_dora=True, as torchtune's LoRA recipes take it): fresh magnitudes are in no
    state dict, so the sharded model gives them storage and computes them from the loaded base
    weights; the run then trains as the single-device one does."""
    common = [*STEPS, "optimizer.lr=3e-3", "model.use_dora=True"]
    run_dist(2, "lora_finetune_distributed", "tiny/lora_distributed", tmp_path / "r2",
             [*common, "batch_size=4"])
    run_recipe("lora_finetune_single_device", "tiny/lora_single_device", tmp_path / "sd",
               [*common, "batch_size=8"])
    assert_runs_agree(tmp_path / "r2", tmp_path / "sd", steps=4, name="adapter_model.safetensors")
    from safetensors.torch import load_file

    adapter = load_file(tmp_path / "r2" / "epoch_0" / "adapter_model.safetensors")
    assert any("magnitude" in k for k in adapter), sorted(adapter)


# Slow: in CI, test_shipped_configs.py runs every distributed recipe on 2 ranks (its shipped
# configs, shrunk) and reloads the checkpoint, and test_activation_checkpointing.py runs each
# tiny distributed config; this stays as the one-command check of the tiny configs themselves.
@pytest.mark.slow
@pytest.mark.parametrize("recipe, config", [
    ("full_finetune_distributed", "tiny/full_distributed"),
    ("lora_finetune_distributed", "tiny/lora_distributed"),
    ("qat_distributed", "tiny/qat_distributed"),
    ("qat_lora_finetune_distributed", "tiny/qat_lora_distributed"),
    ("knowledge_distillation_distributed", "tiny/kd_distributed"),
])
def test_every_distributed_recipe_runs_two_steps_and_saves_a_loadable_checkpoint(tmp_path, recipe, config):
    from torchtune import training

    from tune_recipes.models import tiny_llama3

    run_dist(2, recipe, config, tmp_path, ["max_steps_per_epoch=2", "fake_quant_after_n_steps=1"]
             if "qat" in recipe else ["max_steps_per_epoch=2"])
    assert len(losses(tmp_path)) == 2
    sd = training.FullModelHFCheckpointer(
        checkpoint_dir=str(tmp_path / "epoch_0"),
        checkpoint_files=["model-00001-of-00001.safetensors"], model_type="LLAMA3",
        output_dir=str(tmp_path / "reload"),
    ).load_checkpoint()[training.MODEL_KEY]
    model = tiny_llama3()
    model.load_state_dict(sd, strict=True)  # every weight present, names and shapes right
    with torch.no_grad():
        assert torch.isfinite(model(torch.arange(12)[None])).all()
    if "lora" in recipe or "distillation" in recipe:
        assert (tmp_path / "epoch_0" / "adapter_model.safetensors").is_file()


def test_kd_two_ranks_equal_single_device(tmp_path):
    common = [*STEPS, "gradient_accumulation_steps=2"]
    run_dist(2, "knowledge_distillation_distributed", "tiny/kd_distributed", tmp_path / "r2",
             [*common, "batch_size=4"])
    run_recipe("knowledge_distillation_single_device", "tiny/kd_single_device", tmp_path / "sd",
               [*common, "batch_size=8"])
    from tune_recipes.training.metrics import read_metrics

    for key in ("loss", "class_loss", "kd_loss"):
        a = read_metrics(tmp_path / "r2" / "metrics.jsonl", key)
        b = read_metrics(tmp_path / "sd" / "metrics.jsonl", key)
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=1e-5, atol=0)


def test_qat_two_ranks_equal_single_device_before_fake_quant(tmp_path):
    common = [*STEPS, "fake_quant_after_n_steps=1000"]
    run_dist(2, "qat_distributed", "tiny/qat_distributed", tmp_path / "r2", [*common, "batch_size=4"])
    run_recipe("qat_single_device", "tiny/qat_single_device", tmp_path / "sd", [*common, "batch_size=8"])
    torch.testing.assert_close(torch.tensor(losses(tmp_path / "r2")),
                               torch.tensor(losses(tmp_path / "sd")), rtol=1e-5, atol=0)
    assert_same_weights(weights(tmp_path / "r2"), weights(tmp_path / "sd"), rtol=1e-4, atol=1e-5)


def test_adamw8bit_steps_fsdp2_shards_in_slices_as_torchaos_steps_them_whole(tmp_path):
    """torchao's 8-bit states under FSDP2, in the recipe: ours steps each rank's local shards, in
    row slices (chunk_numel is below the tiny model's larger weights), torchao's class each
    DTensor whole; the same gradients give the same weights, bit for bit. (Against one device
    the 8-bit codes may flip where the gradients' reduction order differs.)"""
    common = ["gradient_accumulation_steps=2", "batch_size=4", *STEPS]
    run_dist(2, "full_finetune_distributed", "tiny/full_distributed", tmp_path / "ours",
             [*common, "optimizer._component_=tune_recipes.optim.AdamW8bit",
              "optimizer.chunk_numel=8192"])
    run_dist(2, "full_finetune_distributed", "tiny/full_distributed", tmp_path / "torchao",
             [*common, "optimizer._component_=torchao.optim.AdamW8bit"])
    assert losses(tmp_path / "ours") == losses(tmp_path / "torchao")
    assert_same_weights(weights(tmp_path / "ours"), weights(tmp_path / "torchao"), rtol=0, atol=0)
