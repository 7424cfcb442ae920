"""tune_recipes.modules.nf4: QLoRA's NF4 dequantization in fewer kernels, equal bit for bit to
torchao's, installed where torchtune's QLoRA modules reach it."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torchao.dtypes.nf4tensor import NF4Tensor, linear_nf4, to_nf4

from tune_recipes.modules import nf4

pytestmark = pytest.mark.unit


def _torchao_dequantize():
    """torchao's own ``get_original_weight``, whether or not ours is installed."""
    return nf4.TORCHAO_DEQUANTIZE.get("get_original_weight", NF4Tensor.get_original_weight)


def _weights():
    g = torch.Generator().manual_seed(0)
    yield "normal", torch.randn(256, 512, generator=g) * 0.02
    yield "heavy tails", torch.randn(64, 256, generator=g) ** 3  # blocks of very different scales
    with_zeros = torch.randn(128, 128, generator=g)
    with_zeros[:, ::3] = 0
    with_zeros[5] = 0  # whole blocks of zeros
    yield "zeros", with_zeros
    yield "1-D", torch.randn(64 * 256, generator=g)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_dequantize_nf4_equals_torchaos_bit_for_bit(dtype):
    torchao_dequantize = _torchao_dequantize()
    assert torchao_dequantize is not nf4.dequantize_nf4
    for name, weight in _weights():
        quantized = to_nf4(weight.to(dtype))
        ours, theirs = nf4.dequantize_nf4(quantized), torchao_dequantize(quantized)
        assert ours.dtype == theirs.dtype == dtype and ours.shape == theirs.shape == weight.shape
        assert torch.equal(ours, theirs), name
        # ... and it is a dequantization: within NF4's error of the original weight.
        assert (ours.float() - weight).abs().max() <= 0.2 * weight.abs().max(), name


class _Kernels(TorchDispatchMode):
    """The operators that compute (not views), dispatched inside the context."""
    VIEWS = {"view", "_unsafe_view", "unsqueeze", "transpose", "t", "detach", "alias", "expand",
             "flatten", "reshape", "select", "slice", "as_strided"}

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in self.VIEWS:
            self.names.append(name)
        return func(*args, **(kwargs or {}))


def test_dequantize_nf4_runs_fewer_kernels_than_torchao():
    quantized = to_nf4(torch.randn(256, 256, dtype=torch.bfloat16))
    nf4.dequantize_nf4(quantized)  # the pair table is built once, on first use
    counts = []
    for dequantize in (nf4.dequantize_nf4, _torchao_dequantize()):
        with _Kernels() as kernels:
            dequantize(quantized)
        counts.append(kernels.names)
    ours, theirs = counts
    # the block scalers (torchao's code: 2 small kernels), the int32 widening, the lookup, the
    # scaling; torchao's: 13, two int64 widenings among them
    assert sorted(ours) == sorted(["div", "add", "_to_copy", "index", "mul"]), ours
    assert len(theirs) >= 2 * len(ours) and theirs.count("index") == 2, theirs


def test_installed_torchtunes_qlora_modules_train_to_the_same_bits(monkeypatch):
    """A QLoRA LoRALinear and a FrozenNF4Linear, forward and backward, with torchao's
    dequantization and then with ours installed: equal outputs and gradients."""
    from torchtune.modules.low_precision import FrozenNF4Linear
    from torchtune.modules.peft import LoRALinear

    torch.manual_seed(0)
    lora = LoRALinear(256, 512, rank=8, alpha=16, quantize_base=True).to(torch.bfloat16)
    torch.nn.init.normal_(lora.lora_b.weight, std=0.05)
    frozen = FrozenNF4Linear(256, 256, dtype=torch.bfloat16)
    x = torch.randn(3, 7, 256, dtype=torch.bfloat16)

    def run():
        lora.zero_grad()
        inp = x.clone().requires_grad_()
        out = frozen(lora(inp)[..., :256])
        out.float().square().sum().backward()
        return out.detach(), inp.grad, lora.lora_a.weight.grad.clone(), lora.lora_b.weight.grad.clone()

    monkeypatch.setattr(NF4Tensor, "get_original_weight", _torchao_dequantize())
    reference = run()
    assert nf4.use_lean_nf4_dequantization() is True
    assert NF4Tensor.get_original_weight is nf4.dequantize_nf4
    assert nf4.use_lean_nf4_dequantization() is True  # idempotent
    for theirs, ours in zip(reference, run()):
        assert torch.equal(ours, theirs)


def test_another_torchao_keeps_its_own(monkeypatch):
    import torchao

    monkeypatch.setattr(NF4Tensor, "get_original_weight", _torchao_dequantize())
    monkeypatch.setattr(torchao, "__version__", "0.16.0")
    assert nf4.use_lean_nf4_dequantization() is False
    assert NF4Tensor.get_original_weight is _torchao_dequantize()


def test_torch_compile_traces_it_and_the_cache_stays_real(monkeypatch):
    """Installed, and traced by torch.compile through torchao's NF4Tensor (aot_eager: the graph
    without Inductor's code generation), with an empty cache and a filled one: the same bits as
    eager, and no traced (fake) tensor left in the cache for later eager calls."""
    monkeypatch.setattr(nf4, "_PAIR_TABLES", {})
    monkeypatch.setattr(NF4Tensor, "get_original_weight", _torchao_dequantize())
    assert nf4.use_lean_nf4_dequantization()
    quantized = to_nf4(torch.randn(128, 256, dtype=torch.bfloat16))
    expected = _torchao_dequantize()(quantized)

    def project(x, weight):  # QLoRA's base product: dequantized through the NF4Tensor subclass
        return linear_nf4(x, weight)

    x = torch.randn(4, 256, dtype=torch.bfloat16)
    compiled = torch.compile(project, backend="aot_eager", fullgraph=False)
    for _ in range(2):  # first with an empty cache, then (after eager below) a filled one
        torch._dynamo.reset()
        assert torch.equal(compiled(x, quantized), torch.nn.functional.linear(x, expected))
        assert all(type(t) is torch.Tensor for t in nf4._PAIR_TABLES.values())
        assert torch.equal(nf4.dequantize_nf4(quantized), expected)
        assert len(nf4._PAIR_TABLES) == 1


def test_the_lora_setup_installs_it_for_a_qlora_model(monkeypatch):
    from omegaconf import OmegaConf

    from tune_recipes.models import tiny_llama3
    from tune_recipes.training.setup.model import setup_lora_model

    monkeypatch.setattr(NF4Tensor, "get_original_weight", _torchao_dequantize())
    cfg = OmegaConf.create({"_component_": "tune_recipes.models.lora_tiny_llama3",
                            "lora_attn_modules": ["q_proj", "v_proj"], "lora_rank": 4,
                            "lora_alpha": 8, "quantize_base": True})
    base = tiny_llama3().to(torch.bfloat16).state_dict()
    setup_lora_model(cfg, dtype=torch.bfloat16, device=torch.device("cpu"), seed=0,
                     base_state_dict=base, lora_state_dict=None, compile_model=True)
    assert NF4Tensor.get_original_weight is _torchao_dequantize()  # compiled: torchao's
    setup_lora_model(cfg, dtype=torch.bfloat16, device=torch.device("cpu"), seed=0,
                     base_state_dict=base, lora_state_dict=None)
    assert NF4Tensor.get_original_weight is nf4.dequantize_nf4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_dequantize_nf4_equals_torchaos_on_a_gpu():
    """On CUDA, at Llama-3.1-8B's MLP shape: the same bits as torchao's dequantization."""
    g = torch.Generator(device="cuda").manual_seed(0)
    quantized = to_nf4((torch.randn(4096, 14336, device="cuda", generator=g) * 0.02).to(torch.bfloat16))
    assert torch.equal(nf4.dequantize_nf4(quantized), _torchao_dequantize()(quantized))
