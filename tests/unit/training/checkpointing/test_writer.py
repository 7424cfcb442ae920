"""tune_recipes.training.checkpointing.writer: every recipe's save_checkpoint (one device here;
the distributed path runs in tests/recipes)."""

import json

import pytest
import torch
from omegaconf import OmegaConf
from torchtune import training

from tune_recipes.models.tiny import lora_tiny_llama3, tiny_llama3
from tune_recipes.training.checkpointing.io import LoRASpec
from tune_recipes.training.checkpointing.state import RecipeState
from tune_recipes.training.checkpointing.writer import CheckpointWriter

pytestmark = pytest.mark.unit


class _Checkpointer:
    def __init__(self):
        self.saved = []

    def save_checkpoint(self, ckpt, epoch, intermediate_checkpoint, adapter_only):
        self.saved.append((ckpt, epoch, intermediate_checkpoint, adapter_only))


def _lora_model():
    torch.manual_seed(0)
    model = lora_tiny_llama3(["q_proj", "v_proj"], lora_rank=4, lora_alpha=8)
    for n, p in model.named_parameters():
        if "lora_b" in n:
            torch.nn.init.normal_(p)  # a nonzero delta, so a merge into live weights would show
    return model


def _spec():
    return LoRASpec.from_model_config(OmegaConf.create(
        {"_component_": "x", "lora_rank": 4, "lora_alpha": 8, "lora_attn_modules": ["q_proj", "v_proj"]}))


def test_lora_save_never_writes_the_merge_into_the_live_weights(tmp_path):
    model = _lora_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    (tmp_path / "epoch_0").mkdir()
    (tmp_path / "epoch_0" / "adapter_config.json").write_text("{}")
    ckpt = _Checkpointer()
    writer = CheckpointWriter(ckpt, output_dir=str(tmp_path), lora=_spec(), base_checkpoint_dir="/base")
    writer.save(model, torch.optim.SGD(model.parameters(), lr=0.1),
                RecipeState(seed=0, total_epochs=1, max_steps_per_epoch=None, epochs_run=1), epoch=0)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    saved, epoch, intermediate, adapter_only = ckpt.saved[0]
    assert (epoch, intermediate, adapter_only) == (0, False, False)
    assert training.ADAPTER_KEY in saved and training.MODEL_KEY in saved
    assert training.OPT_KEY not in saved  # the last epoch keeps no optimizer state
    q = "layers.0.attn.q_proj.weight"
    assert not torch.equal(saved[training.MODEL_KEY][q], before[q])  # the merge happened
    assert json.loads((tmp_path / "epoch_0" / "adapter_config.json").read_text()) == {
        "base_model_name_or_path": "/base"}


def test_intermediate_full_save_carries_state_and_optimizer(tmp_path):
    torch.manual_seed(0)
    model = tiny_llama3()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ckpt = _Checkpointer()
    state = RecipeState(seed=3, total_epochs=2, max_steps_per_epoch=None, epochs_run=1)
    CheckpointWriter(ckpt, output_dir=str(tmp_path)).save(model, opt, state, epoch=0)
    saved, epoch, intermediate, adapter_only = ckpt.saved[0]
    assert (epoch, intermediate, adapter_only) == (0, True, False)
    assert saved[training.EPOCHS_KEY] == 1 and saved[training.SEED_KEY] == 3
    assert saved[training.OPT_KEY] == opt.state_dict()
    assert saved[training.MODEL_KEY].keys() == model.state_dict().keys()
    assert training.ADAPTER_KEY not in saved
