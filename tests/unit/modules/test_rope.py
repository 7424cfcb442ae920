"""tune_recipes.modules.rope: Llama's RoPE in fewer kernels, equal bit for bit to torchtune's,
swapped in by the eager single-device model setups only."""

import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from torchtune.models.llama3_1._position_embeddings import Llama3ScaledRoPE
from torchtune.modules import RotaryPositionalEmbeddings

from tune_recipes.models.tiny import TINY_LLAMA3_ARGS
from tune_recipes.modules.rope import InterleavedRoPE, use_interleaved_rope

pytestmark = pytest.mark.unit

ROPES = [RotaryPositionalEmbeddings(dim=64, max_seq_len=512, base=500_000),
         Llama3ScaledRoPE(dim=64, max_seq_len=512, base=500_000, scale_factor=32)]


@pytest.mark.parametrize("rope", ROPES, ids=lambda r: type(r).__name__)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("packed", [False, True])
def test_interleaved_rope_equals_torchtunes_forward_and_backward_bit_for_bit(rope, dtype, packed):
    g = torch.Generator().manual_seed(0)
    x = (3 * torch.randn(2, 40, 4, 64, generator=g)).to(dtype)
    # packed rows: each document's positions from 0 (two documents a row here)
    input_pos = torch.cat([torch.arange(25), torch.arange(15)]).repeat(2, 1) if packed else None
    grad = torch.randn(2, 40, 4, 64, generator=g).to(dtype)
    results = []
    for module in (rope, InterleavedRoPE(rope.cache)):
        inp = x.clone().requires_grad_()
        out = module(inp, input_pos=input_pos)
        out.backward(grad)
        results.append((out.detach(), inp.grad))
    (theirs, theirs_grad), (ours, ours_grad) = results
    assert ours.dtype == dtype and ours.shape == x.shape
    assert torch.equal(ours, theirs) and torch.equal(ours_grad, theirs_grad)
    assert not torch.equal(ours, x)  # it did rotate


sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/unit: script_loader
from script_loader import load_script  # noqa: E402

# the benchmark's own counter (scripts/bench_host_overhead.py)
CountOps = load_script("bench_host_overhead").CountOps


def test_interleaved_rope_dispatches_far_fewer_operators():
    rope = ROPES[1]
    counts = []
    for module in (rope, InterleavedRoPE(rope.cache)):
        inp = torch.randn(1, 16, 4, 64, dtype=torch.bfloat16, requires_grad=True)
        with CountOps() as ops:
            module(inp).float().sum().backward()
        counts.append(ops.count)
    theirs, ours = counts  # forward and backward (+ the sum's): 45 and 26 with torch 2.13
    assert 3 * ours <= 2 * theirs, counts


def _lora_cfg():
    return OmegaConf.create({"_component_": "tune_recipes.models.lora_tiny_llama3",
                             "lora_attn_modules": ["q_proj", "v_proj"], "lora_rank": 4,
                             "lora_alpha": 8})


def test_the_eager_setups_swap_it_in_and_compiled_ones_do_not():
    from tune_recipes.models import tiny_llama3
    from tune_recipes.training.setup.model import setup_full_model, setup_lora_model

    cpu, f32 = torch.device("cpu"), torch.float32
    full_cfg = OmegaConf.create({"_component_": "tune_recipes.models.tiny_llama3"})
    base = tiny_llama3().state_dict()
    eager = setup_full_model(full_cfg, dtype=f32, device=cpu, state_dict=base)
    ropes = {id(layer.attn.pos_embeddings) for layer in eager.layers}
    assert len(ropes) == 1  # shared, as torchtune's one RoPE is
    assert all(type(layer.attn.pos_embeddings) is InterleavedRoPE for layer in eager.layers)
    assert eager.state_dict().keys() == base.keys()  # the caches stay out of checkpoints
    lora, _ = setup_lora_model(_lora_cfg(), dtype=f32, device=cpu, seed=0, base_state_dict=base,
                               lora_state_dict=None)
    assert all(type(layer.attn.pos_embeddings) is InterleavedRoPE for layer in lora.layers)
    compiled = setup_full_model(full_cfg, dtype=f32, device=cpu, state_dict=base, compile_model=True)
    assert all(type(layer.attn.pos_embeddings) is RotaryPositionalEmbeddings
               for layer in compiled.layers)


def test_a_swapped_model_computes_the_same_logits_and_gradients():
    from torchtune.models.llama3 import llama3

    torch.manual_seed(0)
    theirs = llama3(**TINY_LLAMA3_ARGS)
    ours = llama3(**TINY_LLAMA3_ARGS)
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
