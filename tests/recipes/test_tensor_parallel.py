"""Tensor parallelism in full_finetune_distributed, on CPU with gloo (DTensor tensor parallelism
runs there in torch 2.13, so CI tests it; the same code runs NCCL on GPUs).

Two ranks with tensor_parallel_dim=2 form one tensor-parallel group and a single data-parallel
replica (dp=1): each rank holds half of every planned layer, both see the whole batch. That must
equal one device on the same ragged data: if the ranks read different batches (sampling by
world rank), counted tokens twice (all-reduce over the world), or clipped only part of the
gradients, losses or weights move. Gradient accumulation 2 and a clip norm below the gradient
norm put the token rescale and the clip (both over DTensor and plain gradients) on the path.
Tolerances (fp32), as tests/recipes/test_distributed.py: losses rtol 1e-5, weights rtol 1e-4 /
atol 1e-5.
"""

import pytest
import torch

from helpers import assert_same_weights, losses, run_recipe, tune, weights

pytestmark = pytest.mark.integration
# Activation checkpointing on: its wrappers rename the layers, so it must come after the plan
# is applied (a plan matching nothing would leave full replicas that train the same numbers;
# the log line below proves the slicing).
COMMON = ["max_steps_per_epoch=3", "lr_scheduler.num_warmup_steps=1", "batch_size=4",
          "gradient_accumulation_steps=2", "clip_grad_norm=1.0",
          "enable_activation_checkpointing=True"]
TP = ["tensor_parallel_dim=2",
      "tensor_parallel_plan._component_=torchtune.models.llama3.base_llama_tp_plan"]


def test_two_rank_tensor_parallel_equals_one_device_and_saves_a_plain_checkpoint(tmp_path):
    from torchtune import training

    from tune_recipes.models import tiny_llama3

    proc = tune("run", "--nproc_per_node", "2", "full_finetune_distributed", "--config",
                "tiny/full_distributed", f"output_dir={tmp_path / 'tp'}", *COMMON, *TP)
    # tiny_llama3: 2 layers x (q, k, v, output_proj, w1, w2, w3) + tok_embeddings + output are
    # sliced; the 5 RMSNorm weights stay whole. dp = 2 / 2 = 1.
    assert ("tensor parallelism: 16 of 21 parameters sliced over 2 ranks, FSDP2 over 1 "
            "replicas") in proc.stdout + proc.stderr
    run_recipe("full_finetune_single_device", "tiny/full_single_device", tmp_path / "sd", COMMON)
    tp, sd = losses(tmp_path / "tp"), losses(tmp_path / "sd")
    assert len(tp) == 3
    torch.testing.assert_close(torch.tensor(tp), torch.tensor(sd), rtol=1e-5, atol=0)
    assert_same_weights(weights(tmp_path / "tp"), weights(tmp_path / "sd"), rtol=1e-4, atol=1e-5)
    # The clip was live: the logged norm (before clipping) is above clip_grad_norm=1.0.
    from tune_recipes.training.metrics import read_metrics

    assert min(read_metrics(tmp_path / "tp" / "metrics.jsonl", "grad_norm")) > 1.0
    # Gathered from the slices: full-shape weights a plain (untouched) model loads strictly.
    sd_tp = training.FullModelHFCheckpointer(
        checkpoint_dir=str(tmp_path / "tp" / "epoch_0"),
        checkpoint_files=["model-00001-of-00001.safetensors"], model_type="LLAMA3",
        output_dir=str(tmp_path / "reload"),
    ).load_checkpoint()[training.MODEL_KEY]
    model = tiny_llama3()
    model.load_state_dict(sd_tp, strict=True)
    with torch.no_grad():
        assert torch.isfinite(model(torch.arange(12)[None])).all()
