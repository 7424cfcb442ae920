"""tune_recipes.training.setup.qat: quantizer checks and the fake-quant step hook."""

import re

import pytest
import torch
from omegaconf import OmegaConf

from tune_recipes.config import ConfigError
from tune_recipes.training.setup.qat import FakeQuantSchedule, build_quantizer, check_group_size

pytestmark = pytest.mark.unit
QAT = "torchtune.training.quantization.Int8DynActInt4WeightQATQuantizer"


def _quantizer(groupsize=32, component=QAT, require_qat=True):
    return build_quantizer(OmegaConf.create({"_component_": component, "groupsize": groupsize}),
                           torch.float32, require_qat=require_qat)


def test_build_quantizer_names_mode_and_rejects_non_qat():
    quantizer, mode = _quantizer()
    assert "qat" in mode
    with pytest.raises(ConfigError, match="missing"):
        build_quantizer(None)
    with pytest.raises(ConfigError, match="not a QAT quantizer"):
        _quantizer(component="torchtune.training.quantization.Int8DynActInt4WeightQuantizer")


def test_group_size_must_divide_every_linear():
    model = torch.nn.Sequential(torch.nn.Linear(64, 8), torch.nn.Linear(8, 2))
    quantizer, _ = _quantizer(groupsize=32)
    with pytest.raises(ConfigError, match="layer '1'.*in_features=8"):
        check_group_size(model, quantizer)
    check_group_size(torch.nn.Sequential(torch.nn.Linear(64, 8), torch.nn.Linear(96, 2)), quantizer)


def test_fake_quant_hook_turns_on_at_the_configured_step():
    from tune_recipes.models.tiny import tiny_llama3

    quantizer, mode = _quantizer(groupsize=32)
    model = quantizer.prepare(tiny_llama3())
    hook = FakeQuantSchedule(model, mode, after_n_steps=2)
    states = []
    for step in range(4):
        hook.before_step(step)
        states.append(hook.metrics()["fake_quant"])
    assert states == [0, 0, 1, 1]
    assert hook.enabled and hook.metrics() == {"fake_quant": 1}
    never = FakeQuantSchedule(model, mode, after_n_steps=None)
    never.before_step(0)
    assert never.enabled


@pytest.mark.parametrize("component", [QAT, "torchtune.training.quantization.Int4WeightOnlyQATQuantizer"])
def test_fake_quant_turns_off_and_on_in_every_qat_layer(component):
    """Each of torchtune's QAT quantizers: every fake quantizer the prepared layers hold is off
    before the configured step and on from it (the int4 weight-only layers have no activation
    quantizer, which torchao's own toggle trips over)."""
    from torchao.quantization.qat.fake_quantizer import FakeQuantizerBase

    from tune_recipes.models.tiny import tiny_llama3

    quantizer, mode = _quantizer(groupsize=32, component=component)
    model = quantizer.prepare(tiny_llama3())
    fakes = [m for m in model.modules() if isinstance(m, FakeQuantizerBase)]
    assert fakes
    hook = FakeQuantSchedule(model, mode, after_n_steps=1)
    hook.before_step(0)
    assert not any(m.enabled for m in fakes)
    hook.before_step(1)
    assert all(m.enabled for m in fakes)


TT = "torchtune.training.quantization."


@pytest.mark.parametrize("trained, converting, refused", [
    # the QAT quantizer itself, its module swap, or 8da4w's post-training counterpart, at the
    # trained group size: accepted
    ({"_component_": QAT, "groupsize": 32}, {"_component_": QAT, "groupsize": 32}, None),
    ({"_component_": QAT, "groupsize": 32}, {"_component_": TT + "Int8DynActInt4WeightQATQuantizerModuleSwap", "groupsize": 32}, None),
    ({"_component_": QAT, "groupsize": 32}, {"_component_": TT + "Int8DynActInt4WeightQuantizer", "groupsize": 32}, None),
    # a default counts as its value: the record's 256 is the QAT quantizer's default
    ({"_component_": QAT, "groupsize": 256}, {"_component_": QAT}, None),
    ({"_component_": QAT}, {"_component_": QAT, "groupsize": 64}, "quantizer.groupsize=64, but the QAT run"),
    ({"_component_": QAT, "groupsize": 32}, {"_component_": TT + "Int8DynActInt4WeightQuantizer", "groupsize": 64},
     "trained with quantizer.groupsize=32"),
    # another scheme, or int4 weight-only's post-training quantizer (not shown equal): refused
    ({"_component_": QAT, "groupsize": 32}, {"_component_": TT + "Int4WeightOnlyQATQuantizer", "groupsize": 32},
     f"trained with quantizer._component_={QAT}"),
    ({"_component_": TT + "Int4WeightOnlyQATQuantizer", "groupsize": 32},
     {"_component_": TT + "Int4WeightOnlyQuantizer", "groupsize": 32}, "set quantizer._component_="),
    ({"_component_": TT + "Int4WeightOnlyQATQuantizer", "groupsize": 32, "inner_k_tiles": 2},
     {"_component_": TT + "Int4WeightOnlyQATQuantizer", "groupsize": 32}, "quantizer.inner_k_tiles=8, but"),
    # a record this torchtune cannot build (an argument it does not take): its written group size
    ({"_component_": QAT, "groupsize": 64, "not_an_argument": 1}, {"_component_": QAT, "groupsize": 32},
     "trained with quantizer.groupsize=64"),
])
def test_a_conversion_must_quantize_as_the_qat_run_trained(tmp_path, trained, converting, refused):
    from tune_recipes.training.setup.qat import check_quantizer_against_the_qat_run

    (tmp_path / "epoch_0").mkdir()
    (tmp_path / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create({"quantizer": trained})))
    cfg = OmegaConf.create(converting)
    quantizer, _ = build_quantizer(cfg, torch.bfloat16, require_qat=False)
    if refused is None:
        check_quantizer_against_the_qat_run(quantizer, cfg, tmp_path / "epoch_0")
    else:
        with pytest.raises(ConfigError, match=re.escape(refused)):
            check_quantizer_against_the_qat_run(quantizer, cfg, tmp_path / "epoch_0")


def test_a_checkpoint_of_a_run_without_a_quantizer_is_not_checked(tmp_path):
    from tune_recipes.training.setup.qat import check_quantizer_against_the_qat_run

    (tmp_path / "epoch_0").mkdir()
    (tmp_path / "config.yaml").write_text("model:\n  _component_: tune_recipes.models.tiny_llama3\n")
    cfg = OmegaConf.create({"_component_": TT + "Int4WeightOnlyQuantizer", "groupsize": 32})
    quantizer, _ = build_quantizer(cfg, torch.bfloat16, require_qat=False)
    check_quantizer_against_the_qat_run(quantizer, cfg, tmp_path / "epoch_0")  # no error
