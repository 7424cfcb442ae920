"""tune_recipes.training.setup.offloading: ``enable_activation_offloading``.

torchtune's OffloadActivations needs CUDA (it takes the default CUDA stream when built), so on
CPU the plumbing is tested with a real saved-tensors hooks context of the same kind, and the
torchtune context itself only on a GPU (``gpu`` mark; skipped here)."""

import pytest
import torch
from omegaconf import DictConfig

from tune_recipes.config import ConfigError
from tune_recipes.models import tiny_llama3
from tune_recipes.training.setup.offloading import (
    activation_offloading_wanted,
    offload_activations,
    wrap_forward,
)

pytestmark = pytest.mark.unit

CPU = torch.device("cpu")


def test_wanted_only_when_on_with_checkpointing_on_cuda():
    assert not activation_offloading_wanted(DictConfig({}), CPU)
    off = DictConfig({"enable_activation_offloading": False})
    assert not activation_offloading_wanted(off, torch.device("cuda", 0))
    on = DictConfig({"enable_activation_offloading": True, "enable_activation_checkpointing": True})
    assert activation_offloading_wanted(on, torch.device("cuda", 0))
    # CPU: activations already are in CPU memory; accepted, nothing to do (a warning)
    assert not activation_offloading_wanted(on, CPU)


def test_offloading_without_checkpointing_is_a_config_error():
    cfg = DictConfig({"enable_activation_offloading": True, "enable_activation_checkpointing": False})
    with pytest.raises(ConfigError, match="enable_activation_checkpointing=True"):
        activation_offloading_wanted(cfg, torch.device("cuda", 0))
    with pytest.raises(ConfigError):  # on CPU too: the same YAML fails the same way everywhere
        activation_offloading_wanted(cfg, CPU)


def test_off_installs_nothing():
    model = tiny_llama3()
    assert offload_activations(model, False) is None
    assert not model._forward_pre_hooks and not model._forward_hooks


class CountingCopyHooks(torch.autograd.graph.saved_tensors_hooks):
    """Saves a copy of every saved tensor (as an offload does) and counts packs and unpacks."""

    def __init__(self):
        self.packed = self.unpacked = 0

        def pack(t):
            self.packed += 1
            return t.detach().clone()

        def unpack(t):
            self.unpacked += 1
            return t

        super().__init__(pack, unpack)


def _loss_and_grads(model, tokens):
    model.zero_grad(set_to_none=True)
    loss = model(tokens).float().logsumexp(-1).mean()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_wrap_forward_runs_each_forward_inside_the_context_and_changes_no_number():
    torch.manual_seed(0)
    model = tiny_llama3()
    tokens = torch.randint(0, 100, (2, 16))
    ref_loss, ref_grads = _loss_and_grads(model, tokens)
    ctx = CountingCopyHooks()
    wrap_forward(model, ctx)
    loss, grads = _loss_and_grads(model, tokens)
    assert ctx.packed > 0 and ctx.unpacked > 0
    packed = ctx.packed
    # the context is left after the forward: the loss's own saved tensors are not packed
    x = torch.ones(3, requires_grad=True)
    (x.exp() * 2).sum().backward()
    assert ctx.packed == packed
    _loss_and_grads(model, tokens)  # reusable: a second forward packs as many again
    assert ctx.packed == 2 * packed
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=0)
    for n in ref_grads:
        torch.testing.assert_close(grads[n], ref_grads[n], rtol=0, atol=0)


@pytest.mark.gpu
def test_torchtune_offloading_on_cuda_gives_the_same_gradients():
    from torchtune import training
    from torchtune.modules import TransformerSelfAttentionLayer

    torch.manual_seed(0)
    model = tiny_llama3().cuda()
    training.set_activation_checkpointing(model, auto_wrap_policy={TransformerSelfAttentionLayer})
    tokens = torch.randint(0, 100, (2, 16), device="cuda")
    ref_loss, ref_grads = _loss_and_grads(model, tokens)
    assert offload_activations(model, True) is not None
    loss, grads = _loss_and_grads(model, tokens)
    torch.testing.assert_close(loss, ref_loss)
    for n in ref_grads:
        torch.testing.assert_close(grads[n], ref_grads[n])
