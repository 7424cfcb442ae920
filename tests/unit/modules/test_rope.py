"""tune_recipes.modules.rope: Llama's RoPE in fewer kernels, equal bit for bit to torchtune's,
swapped in by the eager single-device model setups only."""

import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from torchtune.models.llama3_1._position_embeddings import Llama3ScaledRoPE
from torchtune.modules import RotaryPositionalEmbeddings

from tune_recipes.modules.rope import InterleavedRoPE, use_interleaved_rope

pytestmark = pytest.mark.unit

ROPES = [RotaryPositionalEmbeddings(dim=64, max_seq_len=512, base=500_000),
         Llama3ScaledRoPE(dim=64, max_seq_len=512, base=500_000, scale_factor=32)]


def _theirs_and_ours(rope, x, grad, input_pos):
    """(output, input gradient) of torchtune's ``rope`` and of an InterleavedRoPE of its cache."""
    results = []
    for module in (rope, InterleavedRoPE(rope.cache)):
        inp = x.clone().requires_grad_()
        out = module(inp, input_pos=input_pos)
        out.backward(grad)
        results.append((out.detach(), inp.grad))
    return results


@pytest.mark.parametrize("rope", ROPES, ids=lambda r: type(r).__name__)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("packed", [False, True])
def test_interleaved_rope_equals_torchtunes_forward_and_backward_bit_for_bit(rope, dtype, packed):
    g = torch.Generator().manual_seed(0)
    x = (3 * torch.randn(2, 40, 4, 64, generator=g)).to(dtype)
    # packed rows: each document's positions from 0 (two documents a row here)
    input_pos = torch.cat([torch.arange(25), torch.arange(15)]).repeat(2, 1) if packed else None
    grad = torch.randn(2, 40, 4, 64, generator=g).to(dtype)
    (theirs, theirs_grad), (ours, ours_grad) = _theirs_and_ours(rope, x, grad, input_pos)
    assert ours.dtype == dtype and ours.shape == x.shape
    assert torch.equal(ours, theirs) and torch.equal(ours_grad, theirs_grad)
    assert not torch.equal(ours, x)  # it did rotate


sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/unit: script_loader
from script_loader import load_script  # noqa: E402

# the benchmark's own counter (scripts/bench_host_overhead.py)
CountOps = load_script("bench_host_overhead").CountOps


@pytest.mark.parametrize("packed", [False, True])
def test_interleaved_rope_dispatches_about_half_the_operators(packed):
    rope = ROPES[1]
    input_pos = torch.cat([torch.arange(10), torch.arange(6)]).unsqueeze(0) if packed else None
    counts = []
    for module in (rope, InterleavedRoPE(rope.cache)):
        inp = torch.randn(1, 16, 4, 64, dtype=torch.bfloat16, requires_grad=True)
        with CountOps() as ops:
            module(inp, input_pos=input_pos).backward(torch.ones(1, 16, 4, 64, dtype=torch.bfloat16))
        counts.append(ops.count)
    theirs, ours = counts  # forward and backward: 40 and 21 with torch 2.13, packed or not
    assert ours <= 0.55 * theirs, counts


def _lora_cfg():
    return OmegaConf.create({"_component_": "tune_recipes.models.lora_tiny_llama3",
                             "lora_attn_modules": ["q_proj", "v_proj"], "lora_rank": 4,
                             "lora_alpha": 8})


@pytest.mark.parametrize("family", ["tiny_llama3", "tiny_llama3_1"])  # the plain RoPE; Llama3ScaledRoPE
def test_the_eager_setups_swap_it_in_and_compiled_ones_do_not(family):
    from tune_recipes import models
    from tune_recipes.training.setup.model import setup_full_model, setup_lora_model

    cpu, f32 = torch.device("cpu"), torch.float32
    full_cfg = OmegaConf.create({"_component_": f"tune_recipes.models.{family}"})
    base = getattr(models, family)().state_dict()
    rope_class = type(getattr(models, family)().layers[0].attn.pos_embeddings)
    assert rope_class is {"tiny_llama3": RotaryPositionalEmbeddings,
                          "tiny_llama3_1": Llama3ScaledRoPE}[family]
    eager = setup_full_model(full_cfg, dtype=f32, device=cpu, state_dict=base)
    ropes = {id(layer.attn.pos_embeddings) for layer in eager.layers}
    assert len(ropes) == 1  # shared, as torchtune's one RoPE is
    assert all(type(layer.attn.pos_embeddings) is InterleavedRoPE for layer in eager.layers)
    assert eager.state_dict().keys() == base.keys()  # the caches stay out of checkpoints
    lora_cfg = OmegaConf.create({**_lora_cfg(), "_component_": f"tune_recipes.models.lora_{family}"})
    lora, _ = setup_lora_model(lora_cfg, dtype=f32, device=cpu, seed=0, base_state_dict=base,
                               lora_state_dict=None)
    assert all(type(layer.attn.pos_embeddings) is InterleavedRoPE for layer in lora.layers)
    compiled = setup_full_model(full_cfg, dtype=f32, device=cpu, state_dict=base, compile_model=True)
    assert all(type(layer.attn.pos_embeddings) is rope_class for layer in compiled.layers)


@pytest.mark.parametrize("family", ["tiny_llama3", "tiny_llama3_1"])
def test_a_swapped_model_computes_the_same_logits_and_gradients(family):
    from tune_recipes import models

    torch.manual_seed(0)
    theirs = getattr(models, family)()
    ours = getattr(models, family)()
    ours.load_state_dict(theirs.state_dict())
    assert use_interleaved_rope(ours) == len(ours.layers)
    assert use_interleaved_rope(ours) == 0  # nothing left to swap
    tokens = torch.randint(0, 272, (2, 32), generator=torch.Generator().manual_seed(1))
    results = []
    for model in (theirs, ours):
        logits = model(tokens)
        logits.square().mean().backward()
        results.append((logits.detach(), [p.grad for p in model.parameters()]))
    assert torch.equal(results[0][0], results[1][0])
    for a, b in zip(results[0][1], results[1][1]):
        assert torch.equal(a, b)


def test_a_model_on_the_meta_device_keeps_torchtunes():
    """A model built on the meta device (no cache values to copy) is left as it is."""
    from tune_recipes import models

    with torch.device("meta"):
        model = models.tiny_llama3_1()
    assert use_interleaved_rope(model) == 0
    assert type(model.layers[0].attn.pos_embeddings) is Llama3ScaledRoPE


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("packed", [False, True])
def test_interleaved_rope_equals_torchtunes_on_a_gpu(packed):
    """On CUDA in bf16, at Llama-3.1-8B's head dim: the same bits forward and backward (the same
    IEEE products and sums, a kernel each)."""
    rope = Llama3ScaledRoPE(dim=128, max_seq_len=4096, base=500_000, scale_factor=8).cuda()
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(1, 2048, 32, 128, device="cuda", generator=g).to(torch.bfloat16)
    grad = torch.randn(1, 2048, 32, 128, device="cuda", generator=g).to(torch.bfloat16)
    input_pos = (torch.cat([torch.arange(1000), torch.arange(1048)]).view(1, -1).cuda()
                 if packed else None)
    (theirs, theirs_grad), (ours, ours_grad) = _theirs_and_ours(rope, x, grad, input_pos)
    assert torch.equal(ours, theirs) and torch.equal(ours_grad, theirs_grad)
