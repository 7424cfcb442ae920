"""tune_recipes.modules.fp8_lora: LoRA's frozen base projections in FP8.

On CPU the FP8 product is emulated (``emulate=True``: the same e4m3/e5m2 operands, dequantized
to fp32, a plain matmul), so the quantization numerics are checked here; the GPU tests (marked
``gpu``) check the real ``torch._scaled_mm`` path against the emulation, under compile.

Tolerances come from the formats, not from runs. Rounding to nearest with p mantissa bits has a
relative error of at most u = 2^-(p+1) in the normal range: e4m3 (p=3) u4 = 2^-4, e5m2 (p=2)
u5 = 2^-3; within a binade the absolute error is spread evenly, so the relative error's RMS lies
between u/(2*sqrt(3)) and u/sqrt(3). A product whose two operands carry independent such errors
has a normwise (Frobenius) relative error equal to the RMS of the per-term error, so
    forward x(e4m3) @ W(e4m3):     between sqrt(u4^2 + u4^2) / (2 sqrt 3) and sqrt(u4^2 + u4^2) / sqrt 3
    grad_x  g(e5m2) @ W(e4m3):     between sqrt(u5^2 + u4^2) / (2 sqrt 3) and sqrt(u5^2 + u4^2) / sqrt 3
(0.0255-0.0510 and 0.0404-0.0807; measured 0.037 and 0.058). The lower ends show the product
really is FP8 (a bf16 path would be ~50x closer).
"""

import copy
import math

import pytest
import torch
from torch import nn
from torchtune.modules.peft import LoRALinear, get_adapter_params, get_merged_lora_ckpt, set_trainable_params

from tune_recipes.config import ConfigError
from tune_recipes.models.tiny import lora_tiny_llama3
from tune_recipes.modules.fp8_lora import (
    E4M3,
    E4M3_MAX,
    FP8LoRALinear,
    convert_lora_to_fp8,
    frozen_fp8_linear,
    to_float8,
)

pytestmark = pytest.mark.unit

U4, U5 = 2.0 ** -4, 2.0 ** -3
FWD_BAND = (math.hypot(U4, U4) / (2 * math.sqrt(3)), math.hypot(U4, U4) / math.sqrt(3))
BWD_BAND = (math.hypot(U5, U4) / (2 * math.sqrt(3)), math.hypot(U5, U4) / math.sqrt(3))
ALL_LORA = ["q_proj", "k_proj", "v_proj", "output_proj"]


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.float() - ref.float()).norm() / ref.float().norm()).item()


def _lora(in_dim=512, out_dim=256, dtype=torch.bfloat16, use_bias=False, seed=0) -> LoRALinear:
    torch.manual_seed(seed)
    lora = LoRALinear(in_dim, out_dim, rank=8, alpha=16, use_bias=use_bias).to(dtype)
    nn.init.normal_(lora.weight, std=in_dim ** -0.5)
    nn.init.normal_(lora.lora_b.weight, std=0.02)  # a nonzero adapter: the LoRA path counts too
    if use_bias:
        nn.init.normal_(lora.bias)
    lora.weight.requires_grad_(False)
    if use_bias:
        lora.bias.requires_grad_(False)
    return lora


def test_weight_quantization_error_is_within_e4m3_rounding():
    torch.manual_seed(0)
    w = torch.randn(256, 512, dtype=torch.bfloat16)
    w[0, :4] = torch.tensor([30.0, -0.0, 1e-6, -1e-3])  # an outlier, a zero, tiny values
    q, inv = to_float8(w, E4M3)
    assert q.dtype == E4M3 and inv.dtype == torch.float32 and inv.dim() == 0
    assert q.float().abs().max().item() == E4M3_MAX  # the amax lands on the format's max
    deq = q.float() * inv
    # Per element: 2^-4 relative in the normal range, half the subnormal spacing (2^-10 in
    # scaled units) below it.
    bound = U4 * w.float().abs() + 2.0 ** -10 * inv
    assert ((deq - w.float()).abs() <= bound).all()
    assert torch.count_nonzero(deq - w.float()) > w.numel() // 2  # it really rounds


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_forward_and_grad_input_agree_with_the_reference_within_fp8_precision(dtype):
    lora = _lora(dtype=dtype)
    q, inv = to_float8(lora.weight, E4M3)
    torch.manual_seed(1)
    x = torch.randn(4, 64, 512, dtype=dtype, requires_grad=True)
    g = torch.randn(4, 64, 256, dtype=dtype)
    out = frozen_fp8_linear(x, q, inv, emulate=True)
    out.backward(g)
    assert out.dtype == dtype and out.shape == (4, 64, 256) and x.grad.dtype == dtype
    w = lora.weight.float()
    fwd, bwd = _rel(out, x.detach().float() @ w.T), _rel(x.grad, g.float() @ w)
    assert FWD_BAND[0] < fwd < FWD_BAND[1], fwd
    assert BWD_BAND[0] < bwd < BWD_BAND[1], bwd


def test_the_real_fp8_path_meets_scaled_mm_layout_and_dtype_rules():
    # On the meta device torch._scaled_mm runs its shape/stride/dtype checks (mat1 row-major,
    # mat2 column-major, fp32 scales; e5m2 x e4m3 in backward) without a GPU.
    q, inv = to_float8(torch.empty(256, 512, dtype=torch.bfloat16, device="meta"), E4M3)
    x = torch.empty(4, 64, 512, dtype=torch.bfloat16, device="meta", requires_grad=True)
    out = frozen_fp8_linear(x, q, inv)
    out.backward(torch.empty_like(out))
    assert out.shape == (4, 64, 256) and out.dtype == torch.bfloat16
    assert x.grad.shape == x.shape and x.grad.dtype == torch.bfloat16
    with pytest.raises(RuntimeError, match="mat2 must be col_major"):  # the check is live
        torch._scaled_mm(q, q.t().contiguous(), scale_a=inv, scale_b=inv, out_dtype=torch.bfloat16)


def test_weight_never_gets_a_gradient_and_the_adapters_train_as_before():
    ref = _lora(use_bias=True)
    fp8 = FP8LoRALinear.from_lora_linear(copy.deepcopy(ref), emulate=True)
    torch.manual_seed(2)
    x = torch.randn(2, 32, 512, dtype=torch.bfloat16)
    g = torch.randn(2, 32, 256, dtype=torch.bfloat16)
    # A loss linear in the output: the gradient reaching the layer is g on both sides, so the
    # adapters' gradients see no FP8 at all and must be identical.
    for m in (ref, fp8):
        (m(x) * g).sum().backward()
    assert fp8.weight.grad is None and not fp8.weight.requires_grad
    assert not fp8.weight_fp8.requires_grad
    for name in ("lora_a.weight", "lora_b.weight"):
        assert torch.equal(fp8.get_parameter(name).grad, ref.get_parameter(name).grad), name
    assert [n for n, p in fp8.named_parameters() if p.requires_grad] == ["lora_a.weight", "lora_b.weight"]


def test_gradients_through_an_fp8_layer_stay_within_its_precision():
    # Two layers: the first one's adapters get their gradient through the second's FP8
    # backward (grad_x: the e5m2 x e4m3 bound); the second's adapters see the first's FP8
    # forward output (the e4m3 x e4m3 bound).
    ref = nn.Sequential(_lora(512, 512, seed=3), _lora(512, 256, seed=4))
    fp8 = copy.deepcopy(ref)
    assert convert_lora_to_fp8(fp8, emulate=True) == ["0", "1"]
    torch.manual_seed(5)
    x = torch.randn(2, 64, 512, dtype=torch.bfloat16)
    g = torch.randn(2, 64, 256, dtype=torch.bfloat16)
    for m in (ref, fp8):
        (m(x) * g).sum().backward()
    for name in ("0.lora_a.weight", "0.lora_b.weight"):
        assert _rel(fp8.get_parameter(name).grad, ref.get_parameter(name).grad) < BWD_BAND[1], name
    for name in ("1.lora_a.weight", "1.lora_b.weight"):
        assert _rel(fp8.get_parameter(name).grad, ref.get_parameter(name).grad) < FWD_BAND[1], name


def _tiny_lora(**kw):
    torch.manual_seed(0)
    model = lora_tiny_llama3(ALL_LORA, apply_lora_to_mlp=True, apply_lora_to_output=True, **kw)
    set_trainable_params(model, get_adapter_params(model))
    return model


def test_state_dict_keys_and_values_are_unchanged_and_the_merge_uses_the_bf16_base():
    model = _tiny_lora().to(torch.bfloat16)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    converted = convert_lora_to_fp8(model, emulate=True)
    # 2 layers x (4 attention + 3 MLP projections); the LoRA output head stays as it is.
    assert len(converted) == 14 and "output" not in converted
    assert type(model.output) is LoRALinear
    assert all(isinstance(model.get_submodule(n), FP8LoRALinear) for n in converted)
    after = model.state_dict()
    assert list(after) == list(before)  # same keys, same order; the FP8 buffers are not saved
    for k, v in before.items():
        assert after[k].dtype == v.dtype and torch.equal(after[k], v), k
    # The merged model: the original bf16 base plus the adapter delta, as without FP8.
    for m in model.modules():
        if isinstance(m, LoRALinear):
            nn.init.normal_(m.lora_b.weight, std=0.02)
    merged = get_merged_lora_ckpt({k: v.clone() for k, v in model.state_dict().items()}, rank=8, alpha=16)
    w = "layers.0.attn.q_proj"
    delta = 2.0 * model.get_submodule(w).lora_b.weight @ model.get_submodule(w).lora_a.weight
    assert torch.equal(merged[f"{w}.weight"], before[f"{w}.weight"] + delta)
    assert f"{w}.lora_a.weight" not in merged


def test_a_converted_model_loads_its_own_state_dict_and_resumes_adapters():
    model = _tiny_lora()
    convert_lora_to_fp8(model, emulate=True)
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    nn.init.normal_(model.layers[0].mlp.w1.lora_a.weight)
    model.load_state_dict(sd)  # strict: the same keys
    assert torch.equal(model.layers[0].mlp.w1.lora_a.weight, sd["layers.0.mlp.w1.lora_a.weight"])


def test_qlora_dora_and_other_lora_subclasses_are_refused_by_name():
    with pytest.raises(ConfigError, match=r"enable_fp8_training=True with a quantized base "
                                          r"\(layers.0.attn.q_proj\).*model.quantize_base"):
        convert_lora_to_fp8(_tiny_lora(quantize_base=True), emulate=True)
    with pytest.raises(ConfigError, match=r"enable_fp8_training=True with DoRA .*model.use_dora=True"):
        convert_lora_to_fp8(_tiny_lora(use_dora=True), emulate=True)
    from tune_recipes.modules.qat_lora import swap_lora_linears_for_qat

    qat = _tiny_lora()
    swap_lora_linears_for_qat(qat, None, None)
    with pytest.raises(ConfigError, match="is a FakeQuantizedLoRALinear; FP8 converts plain LoRALinear"):
        convert_lora_to_fp8(qat, emulate=True)


def test_the_real_fp8_matmul_needs_cuda_and_small_or_odd_layers_stay():
    with pytest.raises(ConfigError, match=r"needs the model on a CUDA GPU; the base weight \(0\) is on cpu"):
        convert_lora_to_fp8(nn.Sequential(_lora()))
    model = nn.Sequential(_lora(512, 256), _lora(512, 40), _lora(24, 256))
    assert convert_lora_to_fp8(model, emulate=True) == ["0"]
    assert [type(m).__name__ for m in model] == ["FP8LoRALinear", "LoRALinear", "LoRALinear"]
    assert convert_lora_to_fp8(model, emulate=True) == ["0"]  # already converted: left alone
    with pytest.raises(ConfigError, match="no LoRALinear whose dims are multiples of 16"):
        convert_lora_to_fp8(nn.Sequential(_lora(24, 256)), emulate=True)


@pytest.mark.parametrize("adapter_inputs,transposed", [(False, False), (True, False), (True, True)])
def test_compiles_as_one_graph_forward_and_backward(adapter_inputs, transposed):
    # fullgraph: no .item(), no branch on tensor values (the recipe compiles every layer).
    layer = FP8LoRALinear.from_lora_linear(_lora(use_bias=True), emulate=True,
                                           fp8_adapter_inputs=adapter_inputs)
    if transposed:
        layer.keep_transposed_weight()
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    torch.manual_seed(6)
    x = torch.randn(2, 48, 512, dtype=torch.bfloat16)
    g = torch.randn(2, 48, 256, dtype=torch.bfloat16)
    grads = []
    for m in (layer, compiled):
        xi = x.clone().requires_grad_(True)
        out = m(xi)
        (out * g).sum().backward()
        grads.append((out.detach(), xi.grad, layer.lora_a.weight.grad.clone()))
        layer.zero_grad()
    for eager, comp in zip(*grads):
        torch.testing.assert_close(comp, eager, rtol=0, atol=0)


def _train_losses(fp8: bool, device: str, steps: int, compile_layers: bool = False, dim: int = 256,
                  num_layers: int = 2, tokens=(4, 65), adapter_inputs: bool = False):
    """Losses of ``steps`` AdamW steps (lr 1e-2) of a LoRA Llama in bf16 on one fixed batch; the
    frozen base projections in FP8 when ``fp8`` (emulated on CPU), with ``fp8_adapter_inputs``
    when ``adapter_inputs``."""
    from torchtune import training
    from torchtune.models.llama3 import lora_llama3

    torch.manual_seed(0)
    vocab = 4096 if dim >= 512 else 1024
    with torch.device(device):
        model = lora_llama3(lora_attn_modules=["q_proj", "v_proj", "output_proj"],
                            apply_lora_to_mlp=True, vocab_size=vocab, num_layers=num_layers,
                            num_heads=8, num_kv_heads=2, embed_dim=dim, intermediate_dim=3 * dim,
                            max_seq_len=512, lora_rank=8, lora_alpha=16).to(torch.bfloat16)
    set_trainable_params(model, get_adapter_params(model))
    if compile_layers:
        training.compile_model(model, verbose=False)  # per layer, as the recipe does
    if fp8:
        # After compile marks the layers, as setup_lora_model does (they trace at first call).
        convert_lora_to_fp8(model, emulate=device == "cpu", fp8_adapter_inputs=adapter_inputs)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    batch = torch.randint(0, vocab, tokens, generator=gen).to(device)
    losses = []
    for _ in range(steps):
        logits = model(batch[:, :-1])
        loss = nn.functional.cross_entropy(logits.float().reshape(-1, vocab), batch[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _assert_follows(bf16, fp8, fall):
    # test_fp8.py's tolerance for the full fine-tune (3% + 0.01 nats); emulated here the
    # largest gap was 0.05% (dim 256) and 0.5% (dim 512, 4 layers). A wrong scale or a lost
    # gradient moves the loss by nats within a step or two.
    assert bf16[-1] < bf16[0] - fall and fp8[-1] < fp8[0] - fall, (bf16, fp8)
    for a, b in zip(bf16, fp8):
        assert abs(a - b) <= 0.03 * a + 0.01, (bf16, fp8)


@pytest.mark.parametrize("adapter_inputs", [False, True])
def test_lora_with_an_emulated_fp8_base_trains_like_bf16(adapter_inputs):
    # Measured: 7.09 -> 5.49 over 8 steps (6 here), both ways.
    _assert_follows(_train_losses(False, "cpu", 6),
                    _train_losses(True, "cpu", 6, adapter_inputs=adapter_inputs), fall=0.5)


# ----------------------------------------------------------------------------- on a GPU
def _fp8_gpu():
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("no FP8 tensor cores")


@pytest.mark.gpu
def test_gpu_scaled_mm_matches_the_emulation():
    _fp8_gpu()
    lora = _lora().cuda()
    q, inv = to_float8(lora.weight, E4M3)
    torch.manual_seed(1)
    x = torch.randn(4, 64, 512, dtype=torch.bfloat16, device="cuda")
    g = torch.randn(4, 64, 256, dtype=torch.bfloat16, device="cuda")
    res = {}
    for emulate in (False, True):
        xi = x.clone().requires_grad_(True)
        out = frozen_fp8_linear(xi, q, inv, emulate=emulate)
        out.backward(g)
        res[emulate] = (out.detach(), xi.grad)
    # Same quantized operands: only the accumulation differs (fp32 in the emulation; the FP8
    # forward uses Hopper's fast accumulation, as torchao's tensorwise recipe does) and the
    # bf16 output rounding (2^-9): 2^-6 normwise is 4x below the FP8 error itself.
    assert _rel(res[False][0], res[True][0]) < 2 ** -6
    assert _rel(res[False][1], res[True][1]) < 2 ** -6
    w = lora.weight.float()
    assert FWD_BAND[0] < _rel(res[False][0], x.float() @ w.T) < FWD_BAND[1]
    assert BWD_BAND[0] < _rel(res[False][1], g.float() @ w) < BWD_BAND[1]


@pytest.mark.gpu
def test_gpu_conversion_halves_the_base_weights_memory():
    _fp8_gpu()
    with torch.device("cuda"):
        model = _tiny_lora().to(torch.bfloat16)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    converted = convert_lora_to_fp8(model)
    numel = sum(model.get_submodule(n).weight.numel() for n in converted)
    freed = before - torch.cuda.memory_allocated()
    # bf16 (2 bytes) -> e4m3 (1 byte) per element; the scales and allocator rounding are noise.
    assert 0.98 * numel <= freed <= 1.02 * numel, (freed, numel)
    assert all(model.get_submodule(n).weight.device.type == "cpu" for n in converted)
    assert model.get_submodule(converted[0]).weight_fp8.device.type == "cuda"


@pytest.mark.gpu
@pytest.mark.parametrize("adapter_inputs", [False, True])
def test_gpu_compiled_fp8_lora_follows_bf16(adapter_inputs):
    _fp8_gpu()
    kw = dict(device="cuda", steps=8, compile_layers=True, dim=512, num_layers=4, tokens=(4, 251))
    _assert_follows(_train_losses(False, **kw), _train_losses(True, adapter_inputs=adapter_inputs, **kw),
                    fall=1.0)


# ---------------------------------------------------------------- fp8_adapter_inputs
def _saved_bytes_by_dtype(fn):
    """Bytes of the tensors ``fn`` saves for backward (each storage once), by dtype."""
    seen = {}

    def pack(t):
        seen.setdefault(t.untyped_storage().data_ptr(), (t.dtype, t.untyped_storage().nbytes()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    by_dtype = {}
    for dtype, nbytes in seen.values():
        by_dtype[dtype] = by_dtype.get(dtype, 0) + nbytes
    return out, by_dtype


def _adapter_pair(dtype=torch.bfloat16, use_bias=True):
    """The same LoRA layer converted twice: the default FP8 path and fp8_adapter_inputs."""
    ref = FP8LoRALinear.from_lora_linear(_lora(dtype=dtype, use_bias=use_bias), emulate=True)
    new = FP8LoRALinear.from_lora_linear(_lora(dtype=dtype, use_bias=use_bias), emulate=True,
                                         fp8_adapter_inputs=True)
    return ref, new


def _run(m, x, g):
    xi = x.detach().clone().requires_grad_(x.requires_grad)
    out = m(xi)
    out.backward(g)
    return out, xi.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_adapter_inputs_change_only_lora_a_grad_to_the_e4m3_input(dtype):
    ref, new = _adapter_pair(dtype)
    torch.manual_seed(6)
    x = torch.randn(2, 48, 512, dtype=dtype, requires_grad=True)
    g = torch.randn(2, 48, 256, dtype=dtype)
    (out_ref, gx_ref), (out_new, gx_new) = _run(ref, x, g), _run(new, x, g)
    # Forward: the default path's operations in its order (on [tokens, features] rows). The
    # input and lora_b gradients: the same up to rounding (the scale multiplies the rank-sized
    # products instead of grad_out), one rounding step of the dtype.
    assert torch.equal(out_new, out_ref)
    eps = torch.finfo(dtype).eps
    assert _rel(gx_new, gx_ref) < eps
    assert _rel(new.lora_b.weight.grad, ref.lora_b.weight.grad) < eps
    # lora_a's gradient: grad_a^T @ x8 (x rounded to e4m3, one scale), checked in float64 from
    # the same grad_a; within e4m3 rounding of the unrounded one, but not equal to it.
    scale = new.alpha / new.rank
    grad_a = (scale * g.reshape(-1, 256)).double() @ new.lora_b.weight.double()
    x8, inv = to_float8(x.detach().reshape(-1, 512), E4M3)
    want = grad_a.t() @ (x8.double() * inv.double())
    got = new.lora_a.weight.grad.double()
    assert _rel(got, want) < (2e-6 if dtype == torch.float32 else 1e-2)
    rel_to_bf16_input = _rel(got, ref.lora_a.weight.grad)
    assert 1e-3 < rel_to_bf16_input < U4 / math.sqrt(3), rel_to_bf16_input


@pytest.mark.parametrize("frozen", ["lora_a", "lora_b"])
def test_adapter_inputs_with_one_factor_frozen(frozen):
    ref, new = _adapter_pair(torch.float32)
    for m in (ref, new):
        m.get_submodule(frozen).weight.requires_grad_(False)
    torch.manual_seed(7)
    x = torch.randn(2, 32, 512, requires_grad=True)
    g = torch.randn(2, 32, 256)
    (_, gx_ref), (_, gx_new) = _run(ref, x, g), _run(new, x, g)
    assert _rel(gx_new, gx_ref) < 1e-6
    assert new.get_submodule(frozen).weight.grad is None
    trained = "lora_b" if frozen == "lora_a" else "lora_a"
    got, want = new.get_submodule(trained).weight.grad, ref.get_submodule(trained).weight.grad
    if trained == "lora_b":
        assert _rel(got, want) < 1e-6
    else:  # the e4m3 input: close, not equal
        assert 1e-3 < _rel(got, want) < U4 / math.sqrt(3)


def test_adapter_inputs_save_the_input_in_e4m3_not_in_the_training_dtype():
    ref, new = _adapter_pair(use_bias=False)
    x = torch.randn(4, 64, 512, dtype=torch.bfloat16, requires_grad=True)
    _, ref_saved = _saved_bytes_by_dtype(lambda: ref(x))
    _, new_saved = _saved_bytes_by_dtype(lambda: new(x))
    x_bytes = x.numel() * x.element_size()
    assert ref_saved[torch.bfloat16] >= x_bytes  # plain LoRA keeps x for lora_a's gradient
    assert new_saved[torch.bfloat16] < x_bytes / 8  # only the adapter weights and [tokens, rank]
    assert new_saved[E4M3] == x.numel() + ref_saved[E4M3]  # x8, beside the e4m3 weight both keep


def test_adapter_inputs_without_an_input_gradient_skip_the_base_backward(monkeypatch):
    from tune_recipes.modules import fp8_lora

    ref, new = _adapter_pair()
    x = torch.randn(2, 16, 512, dtype=torch.bfloat16)  # a frozen embedding's output: no grad
    g = torch.randn(2, 16, 256, dtype=torch.bfloat16)
    _run(ref, x, g)

    def refuse(*args, **kwargs):
        raise AssertionError("the base product's input gradient was computed for an input without grad")

    monkeypatch.setattr(fp8_lora, "_base_grad_input", refuse)
    _run(new, x, g)
    assert _rel(new.lora_b.weight.grad, ref.lora_b.weight.grad) < torch.finfo(torch.bfloat16).eps
    assert new.lora_a.weight.grad is not None


def test_adapter_inputs_a_disabled_adapter_is_the_base_product_only():
    ref, new = _adapter_pair()
    new.disabled = ref.disabled = True
    x = torch.randn(2, 16, 512, dtype=torch.bfloat16)
    base = frozen_fp8_linear(x, new.weight_fp8, new.weight_inv_scale, emulate=True) + new.bias
    assert torch.equal(new(x), base) and torch.equal(ref(x), base)


def test_adapter_inputs_refuse_dropout_and_need_fp8():
    lora = _lora()
    lora.dropout = nn.Dropout(0.1)
    with pytest.raises(ConfigError, match="fp8_adapter_inputs=True with LoRA dropout"):
        FP8LoRALinear.from_lora_linear(lora, name="layers.0.attn.q_proj", emulate=True,
                                       fp8_adapter_inputs=True)
    # A model converted before without the key gets it on a second conversion, checked alike.
    model = nn.Sequential(_lora())
    convert_lora_to_fp8(model, emulate=True)
    assert not model[0].fp8_adapter_inputs
    convert_lora_to_fp8(model, emulate=True, fp8_adapter_inputs=True)
    assert model[0].fp8_adapter_inputs
    from omegaconf import OmegaConf

    from tune_recipes.validation import fp8_lora_problem

    cfg = OmegaConf.create({"fp8_adapter_inputs": True, "model": {
        "_component_": "torchtune.models.llama3_1.lora_llama3_1_8b", "lora_dropout": 0.0}})
    assert "fp8_adapter_inputs=True needs enable_fp8_training=True" in fp8_lora_problem(cfg)
    cfg.enable_fp8_training = True
    assert fp8_lora_problem(cfg) is None
    cfg.model.lora_dropout = 0.05
    assert "fp8_adapter_inputs=True with model.lora_dropout=0.05" in fp8_lora_problem(cfg)


@pytest.mark.gpu
@pytest.mark.parametrize("transposed", [False, True])
def test_gpu_adapter_inputs_scaled_mm_matches_the_emulation(transposed):
    _fp8_gpu()
    lora = _lora(use_bias=True).cuda()
    real = FP8LoRALinear.from_lora_linear(copy.deepcopy(lora), fp8_adapter_inputs=True)
    if transposed:  # fp8_transposed_weight_layers: backward's operand stored, not copied
        real.keep_transposed_weight()
    emul = FP8LoRALinear.from_lora_linear(copy.deepcopy(lora), emulate=True, fp8_adapter_inputs=True)
    torch.manual_seed(8)
    x = torch.randn(4, 64, 512, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    g = torch.randn(4, 64, 256, dtype=torch.bfloat16, device="cuda")
    (out_r, gx_r), (out_e, gx_e) = _run(real, x, g), _run(emul, x, g)
    # As test_gpu_scaled_mm_matches_the_emulation: only the accumulation and output rounding differ.
    assert _rel(out_r, out_e) < 2 ** -6 and _rel(gx_r, gx_e) < 2 ** -6
    for name in ("lora_a.weight", "lora_b.weight"):
        assert _rel(real.get_parameter(name).grad, emul.get_parameter(name).grad) < 2 ** -6, name


# ---------------------------------------------------------------- fp8_transposed_weight_layers
@pytest.mark.parametrize("adapter_inputs", [False, True])
def test_a_stored_transposed_weight_gives_the_same_gradients(adapter_inputs):
    plain = FP8LoRALinear.from_lora_linear(_lora(use_bias=True), emulate=True,
                                           fp8_adapter_inputs=adapter_inputs)
    stored = copy.deepcopy(plain)
    stored.keep_transposed_weight()
    assert plain.weight_fp8_t is None
    assert stored.weight_fp8_t.shape == (512, 256) and stored.weight_fp8_t.is_contiguous()
    assert torch.equal(stored.weight_fp8_t, stored.weight_fp8.t())  # same e4m3 values
    assert "weight_fp8_t" not in stored.state_dict()  # not persistent, like weight_fp8
    torch.manual_seed(9)
    x = torch.randn(2, 32, 512, dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(2, 32, 256, dtype=torch.bfloat16)
    (out_p, gx_p), (out_s, gx_s) = _run(plain, x, g), _run(stored, x, g)
    assert torch.equal(out_s, out_p) and torch.equal(gx_s, gx_p)
    for name in ("lora_a.weight", "lora_b.weight"):
        assert torch.equal(stored.get_parameter(name).grad, plain.get_parameter(name).grad), name


def test_the_stored_transposed_weight_meets_scaled_mm_layout_rules():
    # On the meta device: the stored copy's .t() must be the column-major operand backward needs.
    q, inv = to_float8(torch.empty(256, 512, dtype=torch.bfloat16, device="meta"), E4M3)
    x = torch.empty(4, 64, 512, dtype=torch.bfloat16, device="meta", requires_grad=True)
    out = frozen_fp8_linear(x, q, inv, weight_fp8_t=q.t().contiguous())
    out.backward(torch.empty_like(out))
    assert x.grad.shape == x.shape


def test_transposed_weight_layers_pick_the_first_layers_and_need_fp8():
    from tune_recipes.modules.fp8_lora import layer_index

    assert layer_index("layers.3.attn.q_proj") == 3 and layer_index("layers.12.mlp.w1") == 12
    assert layer_index("output") is None and layer_index("my_layers.1.x") is None
    model = _tiny_lora().to(torch.bfloat16)
    converted = convert_lora_to_fp8(model, emulate=True, transposed_weight_layers=1)
    kept = {n for n in converted if model.get_submodule(n).weight_fp8_t is not None}
    assert kept and kept == {n for n in converted if n.startswith("layers.0.")}
    with pytest.raises(ConfigError, match="fp8_transposed_weight_layers=2: no FP8 projection"):
        convert_lora_to_fp8(nn.Sequential(_lora()), emulate=True, transposed_weight_layers=2)
    from omegaconf import OmegaConf

    from tune_recipes.validation import fp8_lora_problem

    cfg = OmegaConf.create({"fp8_transposed_weight_layers": 2, "model": {
        "_component_": "torchtune.models.llama3_1.lora_llama3_1_8b"}})
    assert "needs enable_fp8_training=True" in fp8_lora_problem(cfg)
    cfg.enable_fp8_training = True
    assert fp8_lora_problem(cfg) is None
