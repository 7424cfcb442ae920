"""Validation loss (dataset_val, run_val_every_n_steps): the token-mean loss over the whole
validation set, checked against a float64 reference computed from the saved weights (torchtune's
RMSNorm computes in fp32 internally even there), and the
same on 2 gloo ranks as on one device.

Tolerances: the run is fp32 on the CPU; its sum over ~3k tokens agrees with float64 to ~1e-6
relative, so rtol 1e-5. 2 ranks vs 1 device: the same per-example losses summed in another
order, rtol 1e-5.
"""

import pytest
import torch
from torch.nn.functional import cross_entropy
from torchtune.data import padded_collate_sft
from torchtune.training import FullModelHFCheckpointer

from helpers import run_recipe, tune
from tune_recipes.data import tiny_tokenizer
from tune_recipes.data.tiny import tiny_alpaca_dataset
from tune_recipes.models import tiny_llama3
from tune_recipes.training.metrics import read_metrics

pytestmark = pytest.mark.integration
VAL = ["dataset_val._component_=tune_recipes.data.tiny_alpaca_dataset",
       "dataset_val.split=train[-37:]", "batch_size_val=6", "run_val_every_n_steps=2",
       "max_steps_per_epoch=4", "lr_scheduler.num_warmup_steps=1"]


def _val_losses(out):
    return {r["step"]: r["val_loss"] for r in read_metrics(out / "metrics.jsonl") if "val_loss" in r}


def _float64_reference(epoch_dir):
    sd = FullModelHFCheckpointer(checkpoint_dir=str(epoch_dir),
                                 checkpoint_files=["model-00001-of-00001.safetensors"],
                                 model_type="LLAMA3", output_dir=str(epoch_dir.parent / "ref")
                                 ).load_checkpoint()["model"]
    model = tiny_llama3().double()
    model.load_state_dict({k: v.double() for k, v in sd.items()})
    model.eval()
    tok = tiny_tokenizer(max_seq_len=256)
    ds = tiny_alpaca_dataset(tok, split="train[-37:]")
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(len(ds)):
            b = padded_collate_sft([ds[i]], padding_idx=tok.pad_id, ignore_idx=-100)
            logits = model(b["tokens"])[:, :-1]
            labels = b["labels"][:, 1:]
            total += float(cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1),
                                         ignore_index=-100, reduction="sum"))
            count += int((labels != -100).sum())
    return total / count


@pytest.mark.parametrize("loss", ["chunked", "fused"])
def test_validation_loss_is_the_token_mean_over_the_whole_set(tmp_path, loss):
    fused = ["loss._component_=tune_recipes.modules.loss.FusedLinearCrossEntropyLoss"] if loss == "fused" else []
    run_recipe("full_finetune_single_device", "tiny/full_single_device", tmp_path, [*VAL, *fused])
    val = _val_losses(tmp_path)
    assert sorted(val) == [2, 4]  # every 2 steps; the epoch end (step 4) is not run twice
    ref = _float64_reference(tmp_path / "epoch_0")
    assert val[4] == pytest.approx(ref, rel=1e-5)
    assert val[2] != pytest.approx(val[4], rel=1e-6)  # measured on the weights of its step


def test_two_ranks_give_the_single_device_validation_loss(tmp_path):
    # 37 examples: 19 and 18 per rank, 4 and 3 batches of 6, so the shorter rank pads its
    # forwards with a zero-weight batch; any double count or mean of means would show.
    run_recipe("full_finetune_single_device", "tiny/full_single_device", tmp_path / "one",
               [*VAL, "batch_size=8"])
    tune("run", "--nproc_per_node", "2", "full_finetune_distributed", "--config",
         "tiny/full_distributed", f"output_dir={tmp_path / 'two'}", *VAL, "batch_size=4")
    one, two = _val_losses(tmp_path / "one"), _val_losses(tmp_path / "two")
    assert sorted(two) == [2, 4]
    for step in (2, 4):
        assert two[step] == pytest.approx(one[step], rel=1e-5)
