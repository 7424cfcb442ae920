"""tune_recipes.training.checkpointing.low_ram (``low_cpu_ram``): the merged model built tensor by
tensor in a memory-mapped scratch file must hold exactly what the default save builds in CPU
memory (same keys in the same order, dtypes, bits), for LoRA, QLoRA (NF4 base) and QDoRA."""

import pytest
import torch
from torchtune.modules.peft import get_merged_lora_ckpt

from tune_recipes.models.tiny import lora_tiny_llama3
from tune_recipes.training.checkpointing.low_ram import file_backed_state_dict, merge_lora_in_place

pytestmark = pytest.mark.unit
RANK, ALPHA = 4, 8


def _model(quantize_base, use_dora=False):
    torch.manual_seed(0)
    model = lora_tiny_llama3(["q_proj", "v_proj"], apply_lora_to_mlp=True, lora_rank=RANK,
                             lora_alpha=ALPHA, quantize_base=quantize_base, use_dora=use_dora)
    for n, p in model.named_parameters():
        if "lora_b" in n or "magnitude" in n:
            torch.nn.init.normal_(p)  # a nonzero delta (and DoRA scale), so a merge shows
    if use_dora:
        for m in model.modules():
            if hasattr(m, "initialize_dora_magnitude"):
                m.initialize_dora_magnitude()
    return model


def _default(model):
    # What CheckpointWriter does with low_cpu_ram off: state_dict (NF4 hook), copies, merge.
    sd = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
    return get_merged_lora_ckpt(sd, rank=RANK, alpha=ALPHA)


def _scratch_mappings():
    with open("/proc/self/maps") as f:
        return [line for line in f if ".low_cpu_ram_" in line]


@pytest.mark.parametrize("quantize_base,use_dora", [(False, False), (True, False), (True, True)],
                         ids=["lora", "qlora", "qdora"])
def test_merged_state_dict_is_bitwise_the_default_one(tmp_path, quantize_base, use_dora):
    model = _model(quantize_base, use_dora)
    expected = _default(model)
    hooks_before = list(model._state_dict_hooks.items())
    got = merge_lora_in_place(file_backed_state_dict(model, tmp_path), rank=RANK, alpha=ALPHA)
    assert list(got) == list(expected)  # the checkpointer writes them in this order
    for k, v in expected.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k
    if quantize_base:
        # torchtune's NF4 hook dequantizes to bf16 whatever the training dtype (fp32 here);
        # its DoRA merge then returns the adapter's dtype. The low-RAM path reproduces both,
        # and leaves the hook registered as it was.
        want = torch.float32 if use_dora else torch.bfloat16
        assert got["layers.0.mlp.w1.weight"].dtype == want
    assert list(model._state_dict_hooks.items()) == hooks_before
    # The live weights are untouched by the in-place merge.
    assert not torch.equal(model.state_dict()["layers.0.attn.q_proj.weight"].float(),
                           got["layers.0.attn.q_proj.weight"].float())


def test_weights_live_in_an_unlinked_mapped_file_not_in_the_heap(tmp_path):
    model = _model(quantize_base=True)
    sd = file_backed_state_dict(model, tmp_path)
    # Nothing left in the folder (unlinked at once), but the mapping is there, deleted.
    assert list(tmp_path.iterdir()) == []
    maps = _scratch_mappings()
    assert maps and all("(deleted)" in line for line in maps)
    w = sd["layers.0.attn.q_proj.weight"]
    lo, hi = (int(x, 16) for x in maps[0].split()[0].split("-"))
    assert lo <= w.data_ptr() < hi
    # Adapters are small ordinary copies (torch.save of a view would write the whole file).
    assert not any(lo <= sd[k].data_ptr() < hi for k in sd if "lora" in k)
    del sd, w
    import gc

    gc.collect()
    assert _scratch_mappings() == []  # dropping the state dict releases the space
