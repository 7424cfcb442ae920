"""``fp8_mlp_activations`` (tune_recipes/modules/fp8_mlp.py): the MLP's intermediate products
kept in e4m3 for backward.

The forward is exact; the backward equals a float64 computation from the e4m3-rounded products
(tight), stays within e4m3 precision of the exact gradients, keeps about half the bytes for
backward, and a tiny LoRA model trains like bf16. CPU only; the GPU run is a benchmark step."""

import pytest
import torch
from torch import nn
from torchtune.modules import FeedForward
from torchtune.modules.peft import LoRALinear

from tune_recipes.config import ConfigError
from tune_recipes.models.tiny import lora_tiny_llama3
from tune_recipes.modules.fp8_lora import convert_lora_to_fp8
from tune_recipes.modules.fp8_lora import E4M3 as E4M3_, E5M2 as E5M2_, to_float8
from tune_recipes.modules.fp8_mlp import (
    FP8SavedFeedForward,
    _SwiGLUSavedInFP8,
    _SwiGLUTrainedDown,
    _trained_down,
    convert_mlps_to_fp8_saved,
)

pytestmark = pytest.mark.unit

DIM, HIDDEN = 64, 192


def _mlp(down_lora=True, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)

    def lora(i, o):
        m = LoRALinear(i, o, rank=4, alpha=8)
        nn.init.normal_(m.lora_b.weight, std=0.05)  # non-zero: the down adapter's path counts
        m.weight.requires_grad_(False)
        return m

    down = lora(HIDDEN, DIM) if down_lora else nn.Linear(HIDDEN, DIM, bias=False).requires_grad_(False)
    return FeedForward(gate_proj=lora(DIM, HIDDEN), down_proj=down, up_proj=lora(DIM, HIDDEN)).to(dtype)


def _grads(module, x):
    x = x.clone().requires_grad_()
    out = module(x)
    (out.float() * torch.linspace(-1, 1, out.shape[-1])).sum().backward()
    names = [n for n, p in module.named_parameters() if p.requires_grad]
    return out, x.grad, {n: p.grad.clone() for n, p in module.named_parameters() if p.requires_grad}, names


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("down_lora", [True, False])
def test_forward_is_exact_and_gradients_within_e4m3_precision(down_lora):
    ref = _mlp(down_lora)
    x = torch.randn(3, 11, DIM)
    out_ref, gx_ref, gp_ref, names = _grads(ref, x)
    for p in ref.parameters():
        p.grad = None
    fp8 = FP8SavedFeedForward(ref)
    out, gx, gp, names2 = _grads(fp8, x)
    assert names == names2
    assert torch.equal(out, out_ref)  # the forward is unchanged
    # e4m3 keeps 3 mantissa bits (relative error <= 2^-4, ~3.6% rms per element); the
    # gradients mix many elements, so their relative L2 error is a few percent at most.
    assert _rel(gx, gx_ref) < 0.05
    for n in names:
        assert _rel(gp[n], gp_ref[n]) < 0.05, n


@pytest.mark.parametrize("per_row", [True, False])
def test_backward_equals_a_float64_computation_from_the_rounded_products(per_row):
    torch.manual_seed(1)
    g = torch.randn(5, HIDDEN, requires_grad=True)
    u = torch.randn(5, HIDDEN, requires_grad=True)
    a_w = (torch.randn(4, HIDDEN) * 0.1).requires_grad_()
    gh, ga = torch.randn(5, HIDDEN), torch.randn(5, 4)
    h, a = _SwiGLUSavedInFP8.apply(g, u, a_w, per_row)
    torch.autograd.backward([h, a], [gh, ga])
    # The reference: the same products rounded to e4m3 (per row, LoRA's default, or per
    # tensor), everything else in float64.
    q = [_quantized(t.detach(), rows=per_row) for t in (g, u)]
    g64, u64 = (t.detach().clone().requires_grad_() for t in q)
    aw64 = a_w.detach().double().requires_grad_()
    h64 = torch.nn.functional.silu(g64) * u64
    torch.autograd.backward([h64, h64 @ aw64.t()], [gh.double(), ga.double()])
    for got, want in ((g.grad, g64.grad), (u.grad, u64.grad), (a_w.grad, aw64.grad)):
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)


def test_saves_about_half_the_bytes_for_backward(saved_bytes):
    x = torch.randn(4, 64, DIM, dtype=torch.bfloat16)
    plain = _mlp(dtype=torch.bfloat16)
    fp8 = FP8SavedFeedForward(_mlp(dtype=torch.bfloat16))
    # Eager keeps x (for the gate/up adapters), g, u, silu(g) and h in bf16; ours x in bf16, g
    # and u in e4m3 plus a scale per row. The ratio is at most ~0.4 at this width.
    assert saved_bytes(lambda: fp8(x))[1] < 0.45 * saved_bytes(lambda: plain(x))[1]


def test_state_dict_unchanged_and_refusals_name_the_key():
    torch.manual_seed(0)
    model = lora_tiny_llama3(["q_proj", "v_proj"], apply_lora_to_mlp=True)
    for n, p in model.named_parameters():
        p.requires_grad_("lora" in n)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    names = convert_mlps_to_fp8_saved(model)
    assert names == ["layers.0.mlp", "layers.1.mlp"]
    assert list(model.state_dict()) == list(before)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())

    dora = lora_tiny_llama3(["q_proj"], apply_lora_to_mlp=True, use_dora=True)
    with pytest.raises(ConfigError, match="fp8_mlp_activations=True with DoRA"):
        convert_mlps_to_fp8_saved(dora)
    dropout = lora_tiny_llama3(["q_proj"], apply_lora_to_mlp=True, lora_dropout=0.1)
    with pytest.raises(ConfigError, match="fp8_mlp_activations=True with LoRA dropout"):
        convert_mlps_to_fp8_saved(dropout)
    full = lora_tiny_llama3(["q_proj"], apply_lora_to_mlp=True)  # every weight trainable
    with pytest.raises(ConfigError, match="trainable base weights"):
        convert_mlps_to_fp8_saved(full)


def _losses(model, steps):
    """Losses of ``steps`` AdamW steps (lr 3e-3) of ``model``'s trainable parameters on one fixed
    batch of the tiny vocabulary."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    g = torch.Generator().manual_seed(1)
    seq = torch.randint(0, 64, (4, 33), generator=g)
    losses = []
    for _ in range(steps):
        logits = model(seq[:, :-1])
        loss = nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), seq[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _train(convert: bool, fp8_base: bool, steps: int = 25):
    torch.manual_seed(0)
    model = lora_tiny_llama3(["q_proj", "v_proj", "output_proj"], apply_lora_to_mlp=True).bfloat16()
    for n, p in model.named_parameters():
        p.requires_grad_("lora" in n)
    if fp8_base:
        # "adapter_inputs": with fp8_adapter_inputs too (the MLP's down adapter then follows
        # this module's rules; the others take the base product's e4m3 input).
        convert_lora_to_fp8(model, emulate=True, fp8_adapter_inputs=fp8_base == "adapter_inputs")
    if convert:
        convert_mlps_to_fp8_saved(model)
    return _losses(model, steps)


@pytest.mark.parametrize("fp8_base", [False, True, "adapter_inputs"])
def test_a_tiny_lora_model_trains_like_bf16(fp8_base):
    # Short runs for CI time (bf16 on the CPU: ~0.3 s a step): 15 steps, 10 with fp8_adapter_inputs.
    # At 15 steps the loss falls 2.03-2.06 and the largest difference stays 0.09, inside the
    # bound below.
    steps = 10 if fp8_base == "adapter_inputs" else 15
    ref, got = _train(False, fp8_base, steps), _train(True, fp8_base, steps)
    assert got[0] == ref[0]  # the forward is exact
    assert ref[-1] < ref[0] - (0.5 if steps == 15 else 0.2)  # it learns
    # bf16 noise plus e4m3 backward: within 2% + 0.02 nats of the same run without it.
    for a, b in zip(ref, got):
        assert abs(a - b) <= 0.02 * a + 0.02, (ref, got)


# --- a full fine-tune: the down projection trains (_SwiGLUTrainedDown) ------------------------

def _full_mlp(dtype=torch.float32, seed=0, bias=False):
    torch.manual_seed(seed)
    return FeedForward(gate_proj=nn.Linear(DIM, HIDDEN, bias=False), down_proj=nn.Linear(HIDDEN, DIM, bias=bias),
                       up_proj=nn.Linear(DIM, HIDDEN, bias=False)).to(dtype)


def test_full_finetune_forward_is_exact_and_every_gradient_within_e4m3_precision():
    ref = _full_mlp()
    x = torch.randn(3, 11, DIM)
    out_ref, gx_ref, gp_ref, names = _grads(ref, x)
    assert names == ["w1.weight", "w2.weight", "w3.weight"]
    for p in ref.parameters():
        p.grad = None
    out, gx, gp, _ = _grads(FP8SavedFeedForward(ref), x)
    assert torch.equal(out, out_ref)  # h from the exact g and u, the same product
    assert _rel(gx, gx_ref) < 0.05
    for n in names:
        assert 0 < _rel(gp[n], gp_ref[n]) < 0.05, n  # rounded (not equal), within e4m3's precision


def _quantized(t, dtype=E4M3_, rows=False):
    q, inv = to_float8(t, dtype, per_row=rows)
    return q.double() * inv.double()


@pytest.mark.parametrize("per_row", [False, True])
@pytest.mark.parametrize("fp8", [False, True])
def test_trained_down_backward_equals_a_float64_computation_from_the_rounded_operands(fp8, per_row):
    """The gradients of g, u and W equal float64 arithmetic on the operands this function
    rounds: g and u in e4m3, one scale per tensor (the default) or per row (h recomputed from
    them); with ``fp8`` also h and W in e4m3 and the output gradient in e5m2, one scale each
    (emulated products, so only the rounding of the operands differs from float64)."""
    torch.manual_seed(2)
    g = torch.randn(6, HIDDEN, requires_grad=True)
    u = torch.randn(6, HIDDEN, requires_grad=True)
    w = (torch.randn(DIM, HIDDEN) * 0.05).requires_grad_()
    go = torch.randn(6, DIM)
    out = _SwiGLUTrainedDown.apply(g, u, w, fp8, False, False, True, per_row)  # 6 rows: padded to 16
    out.backward(go)
    g64, u64 = _quantized(g.detach(), rows=per_row), _quantized(u.detach(), rows=per_row)
    h_exact = (nn.functional.silu(g.detach().double()) * u.detach().double())
    h_rec = nn.functional.silu(g64) * u64
    if fp8:
        want_out = _quantized(h_exact.float()) @ _quantized(w.detach()).t()
        go64, w64 = _quantized(go, E5M2_), _quantized(w.detach())
        grad_h, want_gw = go64 @ w64, go64.t() @ _quantized(h_rec.float())
    else:
        want_out = h_exact @ w.detach().double().t()
        grad_h, want_gw = go.double() @ w.detach().double(), go.double().t() @ h_rec
    torch.testing.assert_close(out.double(), want_out, rtol=1e-5, atol=1e-6)
    sig = torch.sigmoid(g64)
    want_gg = grad_h * u64 * sig * (1 + g64 * (1 - sig))
    want_gu = grad_h * nn.functional.silu(g64)
    for got, want in ((g.grad, want_gg), (u.grad, want_gu), (w.grad, want_gw)):
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)


def test_trained_down_in_fp8_follows_torchaos_float8_linear():
    """With the down projection a torchao Float8Linear (emulated here), the module runs its
    products with the layer's settings: the output equals the Float8Linear's own, and the
    gradients are as close to the exact (fp32) module's as the torchao module's are (at this
    tiny size the e5m2 output gradients put both ~8-9% away; ours rounds g and u too)."""
    import copy

    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    exact = _full_mlp()
    ref = copy.deepcopy(exact)
    convert_to_float8_training(ref, config=Float8LinearConfig(emulate=True))
    assert _trained_down(ref.w2) == (True, False, False, True)
    x = torch.randn(2, 16, DIM)
    _, gx_exact, gp_exact, names = _grads(exact, x)
    out_ref, gx_ref, gp_ref, _ = _grads(ref, x)
    for p in ref.parameters():
        p.grad = None
    out, gx, gp, _ = _grads(FP8SavedFeedForward(ref), x)
    torch.testing.assert_close(out, out_ref, rtol=1e-5, atol=1e-6)
    assert _rel(gx, gx_exact) <= 1.25 * _rel(gx_ref, gx_exact) + 0.01
    for n in names:
        assert _rel(gp[n], gp_exact[n]) <= 1.25 * _rel(gp_ref[n], gp_exact[n]) + 0.01, n


def test_fp8_products_get_scaled_mm_layouts_multiples_of_16_and_the_layers_accumulation(monkeypatch):
    """What torch._scaled_mm needs on a GPU (CPU tests emulate it, which needs none of it): the
    first operand row-major, the second column-major, the inner dimension and the second
    operand's dims multiples of 16, at a token count that is not (1000); and each product's
    fast accumulation as the layer's torchao config (fp8_fast_accum_backward) says."""
    from tune_recipes.modules import fp8_mlp
    from tune_recipes.training.setup.fp8 import convert_to_fp8

    calls = []
    emulated = fp8_mlp._mm

    def checked(a, a_inv, b, b_inv, out_dtype, fast_accum, emulate):
        assert a.stride(1) == 1 and b.stride(0) == 1, (a.stride(), b.stride())
        assert a.shape[1] % 16 == 0 and b.shape[0] % 16 == 0 and b.shape[1] % 16 == 0, (a.shape, b.shape)
        calls.append(fast_accum)
        return emulated(a, a_inv, b, b_inv, out_dtype, fast_accum, True)

    monkeypatch.setattr(fp8_mlp, "_mm", checked)
    x = torch.randn(4, 250, DIM)
    for fast in (False, True):
        mlp = _full_mlp()
        convert_to_fp8(mlp, "tensorwise", fast_accum_backward=fast)
        calls.clear()
        FP8SavedFeedForward(mlp)(x).sum().backward()
        assert calls == [True, fast, fast]  # forward, input gradient, weight gradient
        assert mlp.w2.weight.grad is not None and mlp.w1.weight.grad is not None


def test_full_finetune_mlp_under_torch_compile_equals_eager():
    """What the recipe runs with compile: the function traced into the graph (forward and its
    backward), the same outputs and gradients as eager."""
    eager, compiled = _full_mlp(), _full_mlp()
    x = torch.randn(2, 24, DIM)
    out, gx, gp, names = _grads(FP8SavedFeedForward(eager), x)
    module = FP8SavedFeedForward(compiled)
    module.compile(fullgraph=True)  # in place (names unchanged), and no graph break
    out_c, gx_c, gp_c, _ = _grads(module, x)
    torch.testing.assert_close(out_c, out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gx_c, gx, rtol=1e-4, atol=1e-6)
    for n in names:
        torch.testing.assert_close(gp_c[n], gp[n], rtol=1e-4, atol=1e-6)


def test_full_finetune_saves_under_half_the_bytes_for_backward(saved_bytes):
    x = torch.randn(4, 64, DIM, dtype=torch.bfloat16)
    plain = _full_mlp(dtype=torch.bfloat16)
    ours = FP8SavedFeedForward(_full_mlp(dtype=torch.bfloat16))
    # Eager plain keeps x and each weight for the three products, g, silu(g), u and h in bf16;
    # ours the same x and weights, g and u in e4m3 with one scale each: ~0.45 at this width.
    assert saved_bytes(lambda: ours(x))[1] < 0.5 * saved_bytes(lambda: plain(x))[1]


def test_full_finetune_refusals_name_the_key_and_the_layer():
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    with pytest.raises(ConfigError, match=r"mlp.w2 has a bias"):
        convert_mlps_to_fp8_saved(nn.ModuleDict({"mlp": _full_mlp(bias=True)}))
    class FakeQuantLinear(nn.Linear):  # a Linear with its own forward, which would be bypassed
        pass

    other = _full_mlp()
    other.w2 = FakeQuantLinear(HIDDEN, DIM, bias=False)
    with pytest.raises(ConfigError, match=r"mlp.w2 is a FakeQuantLinear"):
        convert_mlps_to_fp8_saved(nn.ModuleDict({"mlp": other}))
    rowwise = _full_mlp()
    convert_to_float8_training(rowwise, config=Float8LinearConfig.from_recipe_name("rowwise"))
    with pytest.raises(ConfigError, match="fp8_mlp_activations=True with fp8_recipe_name other than tensorwise"):
        convert_mlps_to_fp8_saved(nn.ModuleDict({"mlp": rowwise}))


def test_scales_per_tensor_with_a_trained_down_projection_and_per_token_with_lora(monkeypatch):
    """The measured defaults (fp8_mlp.py's NOTE): a full fine-tune's MLP rounds g and u with one
    scale per tensor (per token cost 12% of a 1B step), a LoRA MLP with one per token; an
    explicit ``per_row`` overrides either."""
    from tune_recipes.modules import fp8_mlp

    seen = []
    real = fp8_mlp.to_float8

    def recording(t, dtype, per_row=False):
        seen.append(per_row)
        return real(t, dtype, per_row=per_row)

    monkeypatch.setattr(fp8_mlp, "to_float8", recording)
    x = torch.randn(2, 8, DIM)
    for module, want in ((FP8SavedFeedForward(_full_mlp()), {False}), (FP8SavedFeedForward(_mlp()), {True}),
                         (FP8SavedFeedForward(_full_mlp(), per_row=True), {True}),
                         (FP8SavedFeedForward(_mlp(), per_row=False), {False})):
        seen.clear()
        module(x).sum().backward()
        assert len(seen) == 2 and set(seen) == want, (type(module.w2).__name__, seen)


def test_fp8_mlp_layers_converts_the_first_n_mlps_and_refuses_other_counts():
    """``fp8_mlp_layers`` N (``max_mlps``): the first N layers' MLPs, the rest unchanged; a count
    outside 1..layers is a ConfigError naming the key."""
    full = _tiny_full_model()
    names = convert_mlps_to_fp8_saved(full, max_mlps=1)
    assert names == ["layers.0.mlp"]
    assert type(full.layers[0].mlp) is FP8SavedFeedForward and type(full.layers[1].mlp) is FeedForward
    for bad in (0, 3):
        with pytest.raises(ConfigError, match=rf"fp8_mlp_layers={bad}: expected 1 to 2"):
            convert_mlps_to_fp8_saved(_tiny_full_model(), max_mlps=bad)
    assert convert_mlps_to_fp8_saved(_tiny_full_model(), max_mlps=2) == ["layers.0.mlp", "layers.1.mlp"]


def _tiny_full_model():
    from tune_recipes.models import tiny_llama3

    torch.manual_seed(0)
    return tiny_llama3()
