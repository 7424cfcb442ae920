"""tune_recipes.training.losses.lm_loss: (model, batch) -> mean next-token loss, any loss."""

import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from torchtune import config as tt_config

from tune_recipes.models.tiny import tiny_llama3
from tune_recipes.training.losses.lm_loss import CausalLMLoss

pytestmark = pytest.mark.unit
IGNORE = -100


def _batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 272, (2, 9), generator=g)
    labels = tokens.clone()
    labels[0, :4] = IGNORE
    return {"tokens": tokens, "labels": labels}


def _reference(model, batch):
    logits = model(batch["tokens"])[:, :-1].float()
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), batch["labels"][:, 1:].reshape(-1),
                           ignore_index=IGNORE)


@pytest.mark.parametrize("component", [
    "torch.nn.CrossEntropyLoss",
    "torchtune.modules.loss.CEWithChunkedOutputLoss",
    "tune_recipes.modules.loss.FusedLinearCrossEntropyLoss",
])
def test_every_loss_component_gives_the_shifted_mean(component):
    torch.manual_seed(0)
    model = tiny_llama3()
    with torch.no_grad():
        ref = _reference(model, _batch())
    loss_fn = tt_config.instantiate(OmegaConf.create({"_component_": component}))
    if component == "torch.nn.CrossEntropyLoss":
        loss_fn.ignore_index = IGNORE
    got = CausalLMLoss(model, loss_fn)(_batch())
    torch.testing.assert_close(got.detach(), ref, rtol=1e-5, atol=1e-6)
