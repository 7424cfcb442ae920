"""tune_recipes.modules.rms_norm: torchtune's RMSNorm through torch's fused kernel (the weight
in fp32), the same arithmetic; swapped in by the eager single-device model setups only."""

import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from torchtune.modules import RMSNorm

from tune_recipes.modules.rms_norm import FusedWeightRMSNorm, use_fused_rms_norm

pytestmark = pytest.mark.unit

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/unit: script_loader
from script_loader import load_script  # noqa: E402

# the benchmark's own counter (scripts/bench_host_overhead.py), for the GPU test
CountOps = load_script("bench_host_overhead").CountOps


def _pair(dtype, dim=256):
    """torchtune's RMSNorm with a non-trivial weight, and a re-classed copy of it."""
    theirs = RMSNorm(dim, eps=1e-5)
    with torch.no_grad():
        theirs.scale.copy_(1 + 0.1 * torch.randn(dim, generator=torch.Generator().manual_seed(3)))
    theirs = theirs.to(dtype)
    ours = RMSNorm(dim, eps=1e-5).to(dtype)
    ours.load_state_dict(theirs.state_dict())
    assert use_fused_rms_norm(ours) == 1
    return theirs, ours


def _run(norm, x, grad):
    inp = x.clone().requires_grad_()
    out = norm(inp)
    out.backward(grad)
    return out.detach(), inp.grad, norm.scale.grad


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_fused_norm_equals_torchtunes_and_the_float64_norm(dtype):
    """Output, input gradient and weight gradient: bit for bit torchtune's on the CPU, and
    within the dtype's rounding of the float64 computation (fp32: 1e-6 relative)."""
    g = torch.Generator().manual_seed(0)
    x = (3 * torch.randn(2, 40, 256, generator=g)).to(dtype)
    grad = torch.randn(2, 40, 256, generator=g).to(dtype)
    theirs, ours = _pair(dtype)
    theirs_out, ours_out = _run(theirs, x, grad), _run(ours, x, grad)
    for a, b in zip(theirs_out, ours_out):
        assert a.dtype == b.dtype == dtype
        assert torch.equal(a, b)
    # float64 reference through autograd, from the same weight and input
    x64 = x.double().requires_grad_()
    w64 = theirs.scale.detach().double().requires_grad_()
    ref = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-5) * w64
    ref.backward(grad.double())
    tol = {torch.float32: 1e-6, torch.bfloat16: 8e-3}[dtype]
    for got, want in zip(ours_out, (ref.detach(), x64.grad, w64.grad)):
        err = (got.double() - want).abs().max() / want.abs().max()
        assert err < tol, (err, dtype)


def test_the_fused_norm_reaches_torchs_fused_entry_point():
    """bf16 weight and fp32 input: torchtune's falls back to the composite; ours reaches
    ``aten::_fused_rms_norm`` (on the CPU itself a composite of the same operators; on CUDA one
    kernel forward and one backward: the GPU test below counts them)."""
    def reaches_fused(fn):
        with torch.profiler.profile() as prof:
            fn()
        return "aten::_fused_rms_norm" in {e.name for e in prof.events()}

    x = torch.randn(1, 16, 256, dtype=torch.bfloat16)
    if not reaches_fused(lambda: torch.nn.functional.rms_norm(x.float(), (256,), torch.ones(256))):
        pytest.skip(f"torch {torch.__version__} has no fused rms_norm entry on the CPU")
    theirs, ours = _pair(torch.bfloat16)
    assert [reaches_fused(lambda: norm(x)) for norm in (theirs, ours)] == [False, True]


def test_the_swap_keeps_the_parameter_names_and_isinstance():
    from tune_recipes.models import tiny_llama3

    model = tiny_llama3()
    keys = list(model.state_dict())
    params = {n: p for n, p in model.named_parameters()}
    n_norms = sum(type(m) is RMSNorm for m in model.modules())
    assert n_norms == 2 * len(model.layers) + 1  # two a layer and the final norm
    assert use_fused_rms_norm(model) == n_norms
    assert use_fused_rms_norm(model) == 0  # nothing left to swap
    assert list(model.state_dict()) == keys
    assert all(p is params[n] for n, p in model.named_parameters())
    norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
    assert len(norms) == n_norms and all(type(m) is FusedWeightRMSNorm for m in norms)


def test_the_eager_setups_swap_it_in_and_compiled_ones_do_not():
    from tune_recipes.models import tiny_llama3
    from tune_recipes.training.setup.model import setup_full_model, setup_lora_model

    cpu, bf16 = torch.device("cpu"), torch.bfloat16
    full_cfg = OmegaConf.create({"_component_": "tune_recipes.models.tiny_llama3"})
    base = tiny_llama3().state_dict()

    def norm_types(model):
        return {type(m) for m in model.modules() if isinstance(m, RMSNorm)}

    eager = setup_full_model(full_cfg, dtype=bf16, device=cpu, state_dict=base)
    assert norm_types(eager) == {FusedWeightRMSNorm}
    lora_cfg = OmegaConf.create({"_component_": "tune_recipes.models.lora_tiny_llama3",
                                 "lora_attn_modules": ["q_proj", "v_proj"], "lora_rank": 4,
                                 "lora_alpha": 8})
    lora, _ = setup_lora_model(lora_cfg, dtype=bf16, device=cpu, seed=0, base_state_dict=base,
                               lora_state_dict=None)
    assert norm_types(lora) == {FusedWeightRMSNorm}
    compiled = setup_full_model(full_cfg, dtype=bf16, device=cpu, state_dict=base, compile_model=True)
    assert norm_types(compiled) == {RMSNorm}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_fused_norm_on_a_gpu_is_as_close_to_float64_as_torchtunes():
    """On CUDA in bf16 at Llama-3.1-8B's width: torch's fused kernel sums each row in its own
    order, so not the same bits; output and gradients as close to float64 as torchtune's
    composite (within one more bf16 rounding)."""
    theirs, ours = _pair(torch.bfloat16, dim=4096)
    theirs, ours = theirs.cuda(), ours.cuda()
    g = torch.Generator(device="cuda").manual_seed(0)
    x = (3 * torch.randn(2, 1024, 4096, device="cuda", generator=g)).to(torch.bfloat16)
    grad = torch.randn(2, 1024, 4096, device="cuda", generator=g).to(torch.bfloat16)
    theirs_out, ours_out = _run(theirs, x, grad), _run(ours, x, grad)
    counts = []
    for norm in (theirs, ours):
        with CountOps() as ops:
            _run(norm, x, grad)
        counts.append(ops.count)
    assert counts[1] < 0.6 * counts[0], counts  # the composite's operators, forward and backward
    x64 = x.double().requires_grad_()
    w64 = theirs.scale.detach().double().requires_grad_()
    ref = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-5) * w64
    ref.backward(grad.double())
    for a, b, want in zip(theirs_out, ours_out, (ref.detach(), x64.grad, w64.grad)):
        scale = want.abs().max()
        err_theirs = ((a.double() - want).abs().max() / scale).item()
        err_ours = ((b.double() - want).abs().max() / scale).item()
        assert err_ours <= err_theirs + 2 ** -8, (err_ours, err_theirs)
