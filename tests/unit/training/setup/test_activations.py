"""tune_recipes.training.setup.activations: which layers recompute their activations, and that
checkpointing them changes no number and no state-dict key."""

import copy

import pytest
import torch
from omegaconf import OmegaConf
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

from tune_recipes.config import ConfigError
from tune_recipes.models.tiny import TINY_LLAMA3_ARGS
from tune_recipes.training.setup.activations import (
    _reentrant_checkpoint,
    ac_interval,
    apply_activation_checkpointing,
    checkpoint_reentrant,
    layers_to_checkpoint,
)

pytestmark = pytest.mark.unit


def _four_layers(seed: int = 0):
    """The tiny Llama-3 with 4 layers (fp32, CPU), so every-2nd differs from every layer."""
    from torchtune.models.llama3 import llama3

    torch.manual_seed(seed)
    return llama3(**{**TINY_LLAMA3_ARGS, "num_layers": 4})


def _wrapped(model):
    return [i for i, layer in enumerate(model.layers) if isinstance(layer, CheckpointWrapper)]


@pytest.mark.parametrize("keys,expected", [
    ({"ac_mode": "selective", "ac_option": 2}, [1, 3]),  # the 2nd and 4th, counted from 1
    ({"ac_mode": "selective", "ac_option": "2"}, [1, 3]),  # torchtune int()s a string
    ({"ac_mode": "selective", "ac_option": 3}, [2]),
    ({"ac_mode": "selective", "ac_option": 5}, []),
    ({"ac_mode": "selective", "ac_option": 1}, [0, 1, 2, 3]),
    ({"ac_mode": "selective", "ac_option": 0}, [0, 1, 2, 3]),  # torchtune: 0 is every layer
    ({"ac_mode": "full"}, [0, 1, 2, 3]),
    ({"ac_mode": "full", "ac_option": 2}, [0, 1, 2, 3]),  # ignored (a warning), as in torchtune
    ({"enable_activation_checkpointing": True}, [0, 1, 2, 3]),
    ({"enable_activation_checkpointing": True, "ac_mode": None}, [0, 1, 2, 3]),
    ({"enable_activation_checkpointing": False, "ac_mode": "none"}, []),
    ({"ac_mode": None, "ac_option": None}, []),
    ({"enable_activation_checkpointing": False}, []),
    ({}, []),
])
def test_the_config_picks_the_layers(keys, expected):
    assert layers_to_checkpoint(ac_interval(OmegaConf.create(keys)), 4) == expected


@pytest.mark.parametrize("keys,fragment", [
    ({"enable_activation_checkpointing": True, "ac_mode": "selective", "ac_option": 2},
     "enable_activation_checkpointing=True with ac_mode=selective"),
    ({"ac_mode": "selective"}, "ac_mode=selective needs ac_option"),
    ({"ac_mode": "selective", "ac_option": "op"}, "ac_option=op: selective op checkpointing"),
    ({"ac_mode": "layers"}, "ac_mode=layers: expected one of none, full, selective"),
])
def test_a_direct_caller_gets_validates_error(keys, fragment):
    with pytest.raises(ConfigError, match=fragment):
        ac_interval(OmegaConf.create(keys))


def test_selective_wraps_exactly_those_layers_and_changes_no_number():
    plain = _four_layers()
    checkpointed = copy.deepcopy(plain)
    assert apply_activation_checkpointing(checkpointed, 2) == [1, 3]
    assert _wrapped(checkpointed) == [1, 3]
    # A checkpointed layer runs its forward again in backward; the others do not.
    calls = [0] * 4
    for i, layer in enumerate(checkpointed.layers):
        inner = layer._checkpoint_wrapped_module if i in (1, 3) else layer
        inner.register_forward_pre_hook(lambda *a, i=i: calls.__setitem__(i, calls[i] + 1))

    tokens = torch.randint(0, 272, (2, 24), generator=torch.Generator().manual_seed(1))
    labels = torch.roll(tokens, -1, dims=1)
    results = []
    for model in (plain, checkpointed):
        logits = model(tokens)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
        loss.backward()
        grads = {n.replace("._checkpoint_wrapped_module", ""): p.grad
                 for n, p in model.named_parameters()}
        results.append((loss.detach(), grads))
    assert calls == [1, 2, 1, 2]
    (loss_plain, grads_plain), (loss_ckpt, grads_ckpt) = results
    # fp32 CPU: the recomputed forward runs the same kernels on the same inputs.
    torch.testing.assert_close(loss_ckpt, loss_plain, rtol=1e-6, atol=0)
    assert grads_ckpt.keys() == grads_plain.keys() and len(grads_plain) > 10
    for name, grad in grads_plain.items():
        torch.testing.assert_close(grads_ckpt[name], grad, rtol=1e-6, atol=1e-8, msg=name)


def _tiny_lora(seed: int = 0, dropout: float = 0.0):
    """The tiny Llama-3 with 4 layers and LoRA on q/v and the MLP, only the adapters trainable
    (the frozen embedding: the first layer's input needs no gradient), lora_b nonzero."""
    from torchtune.models.llama3 import lora_llama3
    from torchtune.modules.peft import get_adapter_params, set_trainable_params

    torch.manual_seed(seed)
    model = lora_llama3(lora_attn_modules=["q_proj", "v_proj"], apply_lora_to_mlp=True,
                        lora_rank=4, lora_alpha=8, lora_dropout=dropout,
                        **{**TINY_LLAMA3_ARGS, "num_layers": 4})
    for name, param in model.named_parameters():
        if "lora_b" in name:
            torch.nn.init.normal_(param, std=0.05)
    set_trainable_params(model, get_adapter_params(model))
    return model


def _packed_batch():
    """Two rows of two documents each: a block-causal mask and per-document positions (the
    keyword arguments a packed batch gives every layer)."""
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 272, (2, 24), generator=g)
    lengths = [(10, 14), (17, 7)]
    mask = torch.zeros(2, 24, 24, dtype=torch.bool)
    input_pos = torch.zeros(2, 24, dtype=torch.long)
    for row, docs in enumerate(lengths):
        start = 0
        for n in docs:
            mask[row, start:start + n, start:start + n] = torch.tril(torch.ones(n, n, dtype=torch.bool))
            input_pos[row, start:start + n] = torch.arange(n)
            start += n
    return tokens, torch.roll(tokens, -1, dims=1), mask, input_pos


@pytest.mark.parametrize("kind", ["lora", "lora_dropout", "lora_bf16", "full"])
def test_reentrant_checkpointing_changes_no_number(kind):
    """The reentrant checkpoint (the single-device recipes' eager path) against none and the
    non-reentrant one, on a packed batch: the same loss and the same gradients, bit for bit
    (CPU, fp32 and bf16: the same kernels on the same inputs), every layer's adapters included. A LoRA
    model's first layer reads the frozen embedding: without the grad token its adapters (and
    every later layer's) would get no gradient. With dropout the recompute draws the same masks
    (the checkpoint restores the RNG state), and leaves the RNG where no checkpointing would."""
    build = {"lora": _tiny_lora, "lora_dropout": lambda: _tiny_lora(dropout=0.2),
             "lora_bf16": lambda: _tiny_lora().to(torch.bfloat16), "full": _four_layers}[kind]
    tokens, labels, mask, input_pos = _packed_batch()
    results = {}
    for mode in ("none", "non-reentrant", "reentrant"):
        model = build()
        torch.manual_seed(7)  # the dropout masks' draws
        if mode != "none":
            assert apply_activation_checkpointing(model, 1, reentrant=mode == "reentrant") == [0, 1, 2, 3]
        calls = [0]
        model.layers[0].register_forward_pre_hook(lambda *a: calls.__setitem__(0, calls[0] + 1))
        logits = model(tokens, mask=mask, input_pos=input_pos)
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), labels.flatten())
        loss.backward()
        grads = {n.replace("._checkpoint_wrapped_module", ""): p.grad
                 for n, p in model.named_parameters() if p.requires_grad}
        results[mode] = (loss.detach(), grads, calls[0], torch.rand(1))
    loss_plain, grads_plain, calls_plain, rng_after = results["none"]
    assert calls_plain == 1 and len(grads_plain) >= (16 if kind == "lora" else 30)
    for mode in ("non-reentrant", "reentrant"):
        loss, grads, calls, rng = results[mode]
        assert calls == 1  # the wrapper's own forward; the layer inside ran twice (below)
        assert torch.equal(loss, loss_plain), mode
        assert torch.equal(rng, rng_after), mode
        assert grads.keys() == grads_plain.keys(), mode
        for name, grad in grads_plain.items():
            assert grads[name] is not None and grad.abs().sum() > 0, (mode, name)
            assert torch.equal(grads[name], grad), (mode, name)


def test_reentrant_layers_run_twice_and_infer_without_gradients():
    model = _tiny_lora()
    reference = _tiny_lora()
    apply_activation_checkpointing(model, 1, reentrant=True)
    assert all(layer.checkpoint_fn.func is _reentrant_checkpoint for layer in model.layers)
    inner_calls = [0]
    model.layers[2]._checkpoint_wrapped_module.register_forward_pre_hook(
        lambda *a: inner_calls.__setitem__(0, inner_calls[0] + 1))
    outputs = []
    for layer in model.layers:
        layer.register_forward_hook(lambda mod, a, out: outputs.append(out))
    tokens, labels, mask, input_pos = _packed_batch()
    model(tokens, mask=mask, input_pos=input_pos).sum().backward()
    assert inner_calls[0] == 2  # forward under no_grad, then again in backward
    # torch's reentrant checkpoint ran every layer, the first too (its input needs no grad)
    assert [type(out.grad_fn).__name__ for out in outputs] == ["CheckpointFunctionBackward"] * 4
    # ... and the grad token that made the first layer's output need a gradient got none.
    from tune_recipes.training.setup.activations import _grad_token

    assert _grad_token().grad is None and _grad_token().numel() == 0
    # Validation runs under no_grad / inference_mode: one forward, the same logits, no graph.
    expected = reference(tokens, mask=mask, input_pos=input_pos)
    for context in (torch.no_grad, torch.inference_mode):
        with context():
            logits = model(tokens, mask=mask, input_pos=input_pos)
        assert not logits.requires_grad
        assert torch.equal(logits, expected.detach())


def test_a_layer_with_nothing_to_train_runs_once():
    """Frozen layers under a trainable head (a frozen encoder): no input needs a gradient and
    no parameter trains, so the layer runs once, outside any checkpoint."""
    model = _four_layers()
    for param in model.parameters():
        param.requires_grad_(False)
    model.output.weight.requires_grad_(True)
    apply_activation_checkpointing(model, 1, reentrant=True)
    calls = [0]
    model.layers[0]._checkpoint_wrapped_module.register_forward_pre_hook(
        lambda *a: calls.__setitem__(0, calls[0] + 1))
    tokens, labels, mask, input_pos = _packed_batch()
    model(tokens).sum().backward()
    assert calls[0] == 1 and model.output.weight.grad is not None


def test_the_first_layer_computes_no_input_gradient():
    """The grad token makes a LoRA model's first layer output need a gradient without asking
    for the layer's input gradient: its backward runs the non-reentrant checkpoint's matrix
    products plus one a layer (the reentrant checkpoint recomputes the whole forward; the
    non-reentrant one stops once what backward saved is back, before the down projection's
    rank-4 adapter product), not also the first layer's input products (an input alias)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class CountMatmuls(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            CountMatmuls.count += func.overloadpacket.__name__ in ("mm", "bmm", "addmm")
            return func(*args, **(kwargs or {}))

    tokens, labels, mask, input_pos = _packed_batch()
    counts = []
    for reentrant in (False, True):
        model = _tiny_lora()
        apply_activation_checkpointing(model, 1, reentrant=reentrant)
        loss = model(tokens, mask=mask, input_pos=input_pos).sum()
        CountMatmuls.count = 0
        with CountMatmuls():
            loss.backward()
        counts.append(CountMatmuls.count)
    assert counts[1] == counts[0] + 4 and counts[0] > 0, counts  # 4 layers


def test_a_keyword_tensor_that_needs_grad_goes_through_the_non_reentrant_checkpoint():
    """Llama-3.2-Vision's decoder passes its encoder's output to every layer as
    ``encoder_input``; a self-attention layer ignores it, but it requires grad when the encoder
    trains. That call takes the non-reentrant checkpoint (a closure would drop the gradient of
    a layer that read it): the same output and gradients as unwrapped."""
    torch.manual_seed(0)
    layer = _four_layers().layers[0]
    x = torch.randn(2, 24, 256, requires_grad=True)
    encoder_input = torch.randn(2, 5, 256, requires_grad=True)
    expected = layer(x, encoder_input=encoder_input)
    expected.sum().backward()
    expected_grad = x.grad.clone()
    x.grad = None
    out = _reentrant_checkpoint(layer, x, encoder_input=encoder_input)
    assert "CheckpointFunction" not in type(out.grad_fn).__name__  # the non-reentrant one
    out.sum().backward()
    assert torch.equal(out, expected) and torch.equal(x.grad, expected_grad)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_reentrant_checkpointing_on_a_gpu_in_bf16():
    """On CUDA in bf16 (SDPA picks its kernels by device and grad mode: the reentrant
    checkpoint's first forward runs without gradients): the loss and adapter gradients against
    the non-reentrant checkpoint's, to bf16 rounding."""
    tokens, labels, mask, input_pos = (t.cuda() for t in _packed_batch())
    results = []
    for reentrant in (False, True):
        model = _tiny_lora().to(device="cuda", dtype=torch.bfloat16)
        apply_activation_checkpointing(model, 1, reentrant=reentrant)
        logits = model(tokens, mask=mask, input_pos=input_pos)
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), labels.flatten())
        loss.backward()
        results.append((loss.detach(), {n.replace("._checkpoint_wrapped_module", ""): p.grad.float()
                                        for n, p in model.named_parameters() if p.requires_grad}))
    (loss_a, grads_a), (loss_b, grads_b) = results
    torch.testing.assert_close(loss_b, loss_a, rtol=1e-3, atol=0)
    for name, grad in grads_a.items():
        torch.testing.assert_close(grads_b[name], grad, rtol=2e-2, atol=1e-3, msg=name)


@pytest.mark.parametrize("keys,expected", [
    ({}, True),
    ({"enable_activation_checkpointing": True}, True),
    ({"enable_activation_checkpointing": True, "compile": True}, False),
    ({"enable_activation_checkpointing": True, "enable_activation_offloading": True}, False),
])
def test_checkpoint_reentrant_only_for_eager_layers_without_offloading(keys, expected):
    assert checkpoint_reentrant(OmegaConf.create(keys)) is expected


def test_a_selectively_checkpointed_state_dict_loads_into_a_plain_model(tmp_path):
    checkpointed = _four_layers(seed=3)
    apply_activation_checkpointing(checkpointed, 2)
    plain = _four_layers(seed=4)
    assert checkpointed.state_dict().keys() == plain.state_dict().keys()  # no wrapper names
    torch.save(checkpointed.state_dict(), tmp_path / "model.pt")
    plain.load_state_dict(torch.load(tmp_path / "model.pt"))  # strict
    for (name, a), b in zip(plain.state_dict().items(), checkpointed.state_dict().values()):
        assert torch.equal(a, b), name
    # ... and back: a plain checkpoint loads into a checkpointed model.
    other = _four_layers(seed=5)
    checkpointed.load_state_dict(other.state_dict())
    assert torch.equal(checkpointed.layers[1]._checkpoint_wrapped_module.attn.q_proj.weight,
                       other.layers[1].attn.q_proj.weight)


def test_every_layer_is_torchtunes_own_checkpointing():
    from torchtune import training
    from torchtune.modules import TransformerSelfAttentionLayer

    ours, theirs = _four_layers(), _four_layers()
    assert apply_activation_checkpointing(ours, 1) == [0, 1, 2, 3]
    training.set_activation_checkpointing(theirs, auto_wrap_policy={TransformerSelfAttentionLayer})
    assert [n for n, _ in ours.named_modules()] == [n for n, _ in theirs.named_modules()]
    assert apply_activation_checkpointing(_four_layers(), None) == []


def test_selective_needs_model_layers():
    with pytest.raises(ConfigError, match="model.layers"):
        apply_activation_checkpointing(torch.nn.Sequential(torch.nn.Linear(2, 2)), 2)


def test_the_model_setups_checkpoint_the_layers_they_are_given(one_rank):
    from tune_recipes.models import tiny_llama3
    from tune_recipes.training.setup.distributed import shard_and_load, shard_and_load_lora
    from tune_recipes.training.checkpointing.io import LoRASpec
    from tune_recipes.training.setup.model import setup_full_model, setup_lora_model

    cpu, f32 = torch.device("cpu"), torch.float32
    four = OmegaConf.create({"_component_": "torchtune.models.llama3.llama3",
                             **TINY_LLAMA3_ARGS, "num_layers": 4})
    model = setup_full_model(four, dtype=f32, device=cpu, state_dict=_four_layers().state_dict(),
                             ac_interval=2, ac_reentrant=True)
    assert _wrapped(model) == [1, 3]
    assert model.layers[1].checkpoint_fn.func is _reentrant_checkpoint
    lora_cfg = OmegaConf.create({"_component_": "tune_recipes.models.lora_tiny_llama3",
                                 "lora_attn_modules": ["q_proj", "v_proj"], "lora_rank": 4,
                                 "lora_alpha": 8})
    base = tiny_llama3().state_dict()  # 2 layers: every 2nd is the second
    lora, _ = setup_lora_model(lora_cfg, dtype=f32, device=cpu, seed=0, base_state_dict=base,
                               lora_state_dict=None, ac_interval=2)
    assert _wrapped(lora) == [1]
    # Not asked: torch's non-reentrant checkpoint, as torchtune's (and the distributed setups').
    assert lora.layers[1].checkpoint_fn.keywords == {"use_reentrant": False}
    sharded, _ = shard_and_load(OmegaConf.create({"_component_": "tune_recipes.models.tiny_llama3"}),
                                dtype=f32, device=cpu, world_size=1, full_state_dict=base,
                                ac_interval=2)
    assert _wrapped(sharded) == [1]
    assert sharded.layers[1].checkpoint_fn.keywords == {"use_reentrant": False}
    sharded_lora = shard_and_load_lora(lora_cfg, LoRASpec.from_model_config(lora_cfg), dtype=f32,
                                       device=cpu, world_size=1, base_state_dict=base,
                                       adapter_state_dict=None, seed=0, ac_interval=2)
    assert _wrapped(sharded_lora) == [1]
