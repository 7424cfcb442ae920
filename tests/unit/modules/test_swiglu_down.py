"""A trained SwiGLU MLP recomputing its down projection's input in backward
(tune_recipes.modules.swiglu_down): torchtune's arithmetic, fewer saved bytes."""

import pytest
import torch
from torch import nn
from torchtune.modules import FeedForward

from tune_recipes.modules.swiglu_down import SwiGLUDownFeedForward, recompute_down_inputs

pytestmark = pytest.mark.unit


def _mlp(dim=16, hidden=48, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    mlp = FeedForward(gate_proj=nn.Linear(dim, hidden, bias=False), down_proj=nn.Linear(hidden, dim, bias=False),
                      up_proj=nn.Linear(dim, hidden, bias=False), activation=nn.SiLU())
    return mlp.to(dtype)


def _output_and_grads(mlp, x, grad_out):
    x = x.clone().requires_grad_()
    out = mlp(x)
    out.backward(grad_out)
    return [out.detach(), x.grad] + [p.grad for p in mlp.parameters()]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_same_bits_as_torchtunes_module_eagerly(dtype):
    """Output, input gradient and the three weights' gradients: the same bits as torchtune's
    FeedForward in fp32 and bf16 (autograd's ops, in autograd's order), on [batch, tokens, dim]."""
    x = torch.randn(2, 7, 16, generator=torch.Generator().manual_seed(1)).to(dtype)
    grad_out = torch.randn(2, 7, 16, generator=torch.Generator().manual_seed(2)).to(dtype)
    plain, ours = _mlp(dtype=dtype), _mlp(dtype=dtype)
    assert recompute_down_inputs(ours) == 1 and type(ours) is SwiGLUDownFeedForward
    for a, b in zip(_output_and_grads(plain, x, grad_out), _output_and_grads(ours, x, grad_out)):
        assert torch.equal(a, b)


def test_gradients_against_float64():
    """fp32 gradients within 1e-6 relative of the float64 computation."""
    x = torch.randn(3, 5, 16, generator=torch.Generator().manual_seed(3))
    grad_out = torch.randn(3, 5, 16, generator=torch.Generator().manual_seed(4))
    ref = _output_and_grads(_mlp(dtype=torch.float64), x.double(), grad_out.double())
    ours = _mlp()
    recompute_down_inputs(ours)
    for got, want in zip(_output_and_grads(ours, x, grad_out), ref):
        torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)


def _saved_of_the_mlps_width(mlp, run) -> int:
    """How many distinct tensors of the MLP's width (48) a token (14 tokens) ``run()`` saves for
    backward, the weights aside."""
    weights = {p.untyped_storage().data_ptr() for p in mlp.parameters()}
    saved = set()

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if t.numel() == 14 * 48 and ptr not in weights:
            saved.add(ptr)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return len(saved)


def test_backward_keeps_the_gate_and_up_products_not_their_product():
    """What the MLP saves for backward, eagerly: torchtune's module keeps four tensors of its
    width a token (g, silu(g), u and their product), this one two (g and u)."""
    def wide_saved(mlp):
        x = torch.randn(2, 7, 16, requires_grad=True)
        return _saved_of_the_mlps_width(mlp, lambda: mlp(x).sum().backward())

    ours = _mlp()
    recompute_down_inputs(ours)
    assert (wide_saved(_mlp()), wide_saved(ours)) == (4, 2)


def test_only_a_trained_plain_swiglu_mlp_is_swapped():
    """A frozen down projection (LoRA's base, a teacher), a down projection with a bias or
    forward hooks, another activation or another class of projection (LoRA, FP8,
    fake-quantized) keep torchtune's forward; the state dict's names never change."""
    from torchtune.modules.peft import LoRALinear

    frozen = _mlp()
    frozen.w2.weight.requires_grad_(False)
    biased = _mlp()
    biased.w2 = nn.Linear(48, 16, bias=True)
    gelu = _mlp()
    gelu.activation = nn.GELU()
    lora = _mlp()
    lora.w2 = LoRALinear(48, 16, rank=4, alpha=8)
    hooked, pre_hooked = _mlp(), _mlp()  # e.g. tensor parallelism's reduction of the product
    hooked.w2.register_forward_hook(lambda module, args, out: out * 2)
    pre_hooked.w2.register_forward_pre_hook(lambda module, args: None)
    model = nn.Sequential(_mlp(), frozen, biased, gelu, lora, hooked, pre_hooked)
    names = list(model.state_dict())
    assert recompute_down_inputs(model) == 1
    assert [type(m).__name__ for m in model] == ["SwiGLUDownFeedForward"] + ["FeedForward"] * 6
    assert list(model.state_dict()) == names


def test_compiled_the_graph_saves_two_of_the_mlps_width_a_token():
    """Compiled (Inductor, CPU), torch's partitioner keeps g, u and their product for
    torchtune's MLP; this one's graph keeps g and u, with gradients within 1e-5 of torchtune's
    module eagerly (fp32)."""
    import torch._dynamo

    def compiled_run(mlp, x, grad_out):
        torch._dynamo.reset()
        x = x.clone().requires_grad_()
        result = []
        count = _saved_of_the_mlps_width(mlp, lambda: result.append(torch.compile(mlp)(x)))
        result[0].backward(grad_out)
        torch._dynamo.reset()
        return count, [result[0].detach(), x.grad] + [p.grad for p in mlp.parameters()]

    x = torch.randn(2, 7, 16, generator=torch.Generator().manual_seed(5))
    grad_out = torch.randn(2, 7, 16, generator=torch.Generator().manual_seed(6))
    ours = _mlp()
    recompute_down_inputs(ours)
    plain_count, _ = compiled_run(_mlp(), x, grad_out)
    count, got = compiled_run(ours, x, grad_out)
    assert (plain_count, count) == (3, 2)
    for a, b in zip(got, _output_and_grads(_mlp(), x, grad_out)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
