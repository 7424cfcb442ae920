"""tune_recipes.training.setup.fp8: which Linear modules train in FP8, and when FP8 is refused."""

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from tune_recipes.config import ConfigError
from tune_recipes.training.setup import fp8 as fp8_setup
from tune_recipes.training.setup.fp8 import convert_to_fp8, fp8_lora_wanted, fp8_recipe_wanted, should_convert
from tune_recipes.training.setup.model import setup_full_model

pytestmark = pytest.mark.unit

PROJECTIONS = ("attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.output_proj",
               "mlp.w1", "mlp.w2", "mlp.w3")


def _float8_linear():
    from torchao.float8.float8_linear import Float8Linear

    return Float8Linear


def _tiny():
    from tune_recipes.models import tiny_llama3

    torch.manual_seed(0)
    return tiny_llama3()


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_every_projection_is_swapped_and_the_output_head_is_not(recipe):
    model = _tiny()
    converted = convert_to_fp8(model, recipe)
    expected = [f"layers.{i}.{p}" for i in range(2) for p in PROJECTIONS]
    assert sorted(converted) == sorted(expected)
    swapped = sorted(n for n, m in model.named_modules() if isinstance(m, _float8_linear()))
    assert swapped == sorted(expected)
    # The untied LM head (vocab 272, a multiple of 16) stays a plain Linear, by name.
    assert type(model.output) is nn.Linear
    assert model.layers[0].mlp.w1.config.pad_inner_dim  # any token count works
    granularity = model.layers[0].attn.q_proj.config.cast_config_input.scaling_granularity.value
    assert granularity == {"tensorwise": "tensorwise", "rowwise": "axiswise"}[recipe]


def test_the_schema_offers_exactly_torchaos_recipes():
    # validation.py lists them by hand (the parent process of `tune run` does not import
    # torchao); a torchao upgrade that adds or renames one must fail here.
    from torchao.float8.config import Float8LinearRecipeName

    from tune_recipes.validation import FP8_RECIPES

    assert set(FP8_RECIPES) == {r.value for r in Float8LinearRecipeName}


def test_layers_whose_dims_are_not_multiples_of_16_stay_plain():
    model = nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 30), nn.Linear(30, 48), nn.Linear(48, 16))
    converted = convert_to_fp8(model, "tensorwise")
    assert converted == ["0", "3"]
    assert [type(m) is nn.Linear for m in model] == [False, True, True, False]
    assert not should_convert(nn.Embedding(16, 16), "tok_embeddings")
    assert not should_convert(nn.Linear(64, 64), "output")


def test_off_converts_nothing_and_a_model_without_eligible_layers_is_an_error():
    model = _tiny()
    assert convert_to_fp8(model, None) == []
    assert not any(isinstance(m, _float8_linear()) for m in model.modules())
    with pytest.raises(ConfigError, match="no nn.Linear whose dims are multiples of 16"):
        convert_to_fp8(nn.Sequential(nn.Linear(10, 10)), "tensorwise")


def test_setup_full_model_loads_the_same_state_dict_into_the_fp8_model():
    base = _tiny().state_dict()
    cfg = OmegaConf.create({"_component_": "tune_recipes.models.tiny_llama3"})
    model = setup_full_model(cfg, dtype=torch.float32, device=torch.device("cpu"), state_dict=base,
                             fp8_recipe="tensorwise")  # strict load: names unchanged
    assert isinstance(model.layers[1].mlp.w2, _float8_linear())
    assert set(model.state_dict()) == set(base)
    assert torch.equal(model.layers[1].mlp.w2.weight, base["layers.1.mlp.w2.weight"])


def _accumulation(module):
    """(forward, input gradient, weight gradient): whether each product of a Float8Linear asks
    torch._scaled_mm for fast accumulation (the config its float8 matmuls read)."""
    mm = module.linear_mm_config
    return mm.output.use_fast_accum, mm.grad_input.use_fast_accum, mm.grad_weight.use_fast_accum


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fast_accum_backward_reaches_both_backward_products_of_every_layer(recipe):
    default, fast = _tiny(), _tiny()
    convert_to_fp8(default, recipe)
    converted = convert_to_fp8(fast, recipe, fast_accum_backward=True)
    for name in converted:
        assert _accumulation(default.get_submodule(name)) == (True, False, False), name  # torchao's
        assert _accumulation(fast.get_submodule(name)) == (True, True, True), name
    # Nothing else of the recipe changes: its casts and the padding stay as they were.
    layer, fast_layer = default.layers[0].attn.q_proj, fast.layers[0].attn.q_proj
    assert fast_layer.config.cast_config_input == layer.config.cast_config_input
    assert fast_layer.config.cast_config_grad_output == layer.config.cast_config_grad_output
    assert fast_layer.config.pad_inner_dim


def test_setup_full_model_passes_fast_accum_backward_on():
    cfg = OmegaConf.create({"_component_": "tune_recipes.models.tiny_llama3"})
    model = setup_full_model(cfg, dtype=torch.float32, device=torch.device("cpu"),
                             state_dict=_tiny().state_dict(), fp8_recipe="tensorwise",
                             fp8_fast_accum_backward=True)
    assert _accumulation(model.layers[1].mlp.w2) == (True, True, True)


def test_meta_model_converts_before_sharding():
    # The distributed recipe swaps on the meta model (before fully_shard).
    with torch.device("meta"):
        model = _tiny()
    converted = convert_to_fp8(model, "tensorwise")
    assert len(converted) == 14 and model.layers[0].attn.q_proj.weight.is_meta


def _cfg(**kw):
    return OmegaConf.create({"enable_fp8_training": True, "compile": True, **kw})


def test_fp8_wanted_is_off_by_default_and_refused_off_cuda():
    assert fp8_recipe_wanted(OmegaConf.create({}), torch.device("cpu")) is None
    assert fp8_recipe_wanted(_cfg(enable_fp8_training=False), torch.device("cpu")) is None
    with pytest.raises(ConfigError, match="needs a CUDA GPU with FP8 tensor cores"):
        fp8_recipe_wanted(_cfg(), torch.device("cpu"))
    with pytest.raises(ConfigError, match="fp8_recipe_name=blockwise"):
        fp8_recipe_wanted(_cfg(fp8_recipe_name="blockwise"), torch.device("cpu"))


@pytest.mark.parametrize("capability,ok", [((8, 0), False), ((8, 6), False), ((8, 9), True), ((9, 0), True)])
def test_fp8_needs_compute_capability_8_9(monkeypatch, capability, ok):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Some GPU")
    if ok:
        assert fp8_recipe_wanted(_cfg(fp8_recipe_name="rowwise"), torch.device("cuda")) == "rowwise"
        assert fp8_recipe_wanted(_cfg(), torch.device("cuda")) == "tensorwise"
    else:
        with pytest.raises(ConfigError, match=f"Some GPU is {capability[0]}.{capability[1]}"):
            fp8_recipe_wanted(_cfg(), torch.device("cuda"))


def test_fp8_without_compile_warns(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    warnings = []
    monkeypatch.setattr(fp8_setup.log, "warning", lambda msg, *a: warnings.append(msg % a))
    assert fp8_recipe_wanted(_cfg(compile=False), torch.device("cuda")) == "tensorwise"
    assert len(warnings) == 1 and "set compile=True" in warnings[0]
    fp8_recipe_wanted(_cfg(compile=True), torch.device("cuda"))
    assert len(warnings) == 1


def test_fp8_compile_on_unpacked_data_warns_of_dynamic_shape_recompiles(monkeypatch):
    """Each new batch length recompiled the FP8 layers for minutes on 2 H200s: packed data
    (one length) is quiet, unpacked data (or one unpacked dataset of a list) warns."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    warnings = []
    monkeypatch.setattr(fp8_setup.log, "warning", lambda msg, *a: warnings.append(msg % a))
    packed = {"_component_": "torchtune.datasets.alpaca_dataset", "packed": True}
    for dataset, warns in ((packed, False), ({**packed, "packed": False}, True),
                           ([packed, {"_component_": "x"}], True), ([packed, packed], False)):
        warnings.clear()
        fp8_recipe_wanted(_cfg(compile=True, dataset=dataset), torch.device("cuda"))
        assert bool(warnings) == warns, dataset
        assert not warnings or "dataset.packed=True" in warnings[0]


def test_fp8_on_packed_data_warns_of_its_loss(monkeypatch):
    """FP8's loss strayed from bf16's on packed data on an H200 (faster, up to 1.3% a step off):
    said with either compile scope; only recipes with a compile_scope key (the full fine-tune,
    where it was measured) are told."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    warnings = []
    monkeypatch.setattr(fp8_setup.log, "warning", lambda msg, *a: warnings.append(msg % a))
    packed = {"_component_": "torchtune.datasets.alpaca_dataset", "packed": True}
    cuda = torch.device("cuda")
    for extra, has_scope, warns in (({}, True, True), ({"compile_scope": "layers"}, True, True),
                                    ({"compile_scope": "model"}, True, True), ({}, False, False),
                                    ({"dataset": [packed, packed]}, True, True)):
        # (a list with an unpacked dataset gets the unpacked warning instead; see above)
        warnings.clear()
        cfg = _cfg(compile=True, **{"dataset": packed, **extra})
        assert fp8_recipe_wanted(cfg, cuda, has_compile_scope=has_scope) == "tensorwise"
        assert bool(warnings) == warns, (extra, has_scope)
        assert not warnings or ("set enable_fp8_training=False" in warnings[0]
                                and "1.3% a step above" in warnings[0])
    warnings.clear()  # without compile: only the no-compile warning
    fp8_recipe_wanted(_cfg(compile=False, dataset=packed), cuda, has_compile_scope=True)
    assert len(warnings) == 1 and "set compile=True" in warnings[0]
    warnings.clear()  # a list with an unpacked dataset: the unpacked warning, not this one
    fp8_recipe_wanted(_cfg(compile=True, dataset=[packed, {"_component_": "x"}]), cuda,
                      has_compile_scope=True)
    assert len(warnings) == 1 and "dataset.packed=True" in warnings[0]
    warnings.clear()  # not the main rank: silent
    fp8_recipe_wanted(_cfg(compile=True, dataset=packed), cuda, is_main=False, has_compile_scope=True)
    assert not warnings


def _lora_cfg(**model):
    return _cfg(model={"_component_": "torchtune.models.llama3_1.lora_llama3_1_8b",
                       "lora_attn_modules": ["q_proj", "v_proj"], **model})


def test_fp8_lora_wanted_refuses_qlora_dora_other_recipes_and_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    cuda = torch.device("cuda")
    assert fp8_lora_wanted(_lora_cfg(), cuda) is True
    off = _lora_cfg(quantize_base=True)  # nothing to refuse while FP8 is off
    off.enable_fp8_training = False
    assert fp8_lora_wanted(off, cuda) is False
    for cfg, message in (
            (_lora_cfg(quantize_base=True), "enable_fp8_training=True with model.quantize_base=True"),
            (_cfg(model={"_component_": "torchtune.models.llama3_1.qlora_llama3_1_8b"}),
             "enable_fp8_training=True with model._component_=torchtune.models.llama3_1.qlora_llama3_1_8b"),
            (_lora_cfg(use_dora=True), "enable_fp8_training=True with model.use_dora=True"),
            (_cfg(fp8_recipe_name="rowwise", model={"_component_": "a.lora_b", "lora_rank": 8}),
             "fp8_recipe_name=rowwise with a LoRA model: .* only tensorwise")):
        with pytest.raises(ConfigError, match=message):
            fp8_lora_wanted(cfg, cuda)
    assert fp8_lora_wanted(_cfg(fp8_recipe_name="tensorwise", model={"_component_": "a.lora_b"}), cuda)
    with pytest.raises(ConfigError, match="needs a CUDA GPU with FP8 tensor cores"):
        fp8_lora_wanted(_lora_cfg(), torch.device("cpu"))


def _train_losses(recipe, steps=8, fast_accum_backward=False):
    """Losses of ``steps`` AdamW steps of a small Llama (dims multiples of 16) in bf16, on one
    fixed batch, with the linear layers in FP8 when ``recipe`` names one."""
    from torchtune.models.llama3 import llama3

    torch.manual_seed(0)
    with torch.device("cuda"):
        model = llama3(vocab_size=4096, num_layers=4, num_heads=8, num_kv_heads=2, embed_dim=512,
                       intermediate_dim=1536, max_seq_len=512).to(torch.bfloat16)
    convert_to_fp8(model, recipe, fast_accum_backward=fast_accum_backward)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator(device="cuda").manual_seed(1)
    # 4 x 250 = 1000 tokens per step: not a multiple of 16 (the padded inner dim is exercised).
    tokens = torch.randint(0, 4096, (4, 251), device="cuda", generator=g)
    losses = []
    for _ in range(steps):
        logits = model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.float().reshape(-1, 4096), tokens[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.gpu
@pytest.mark.parametrize("recipe, fast", [("tensorwise", False), ("rowwise", False), ("tensorwise", True)])
def test_fp8_loss_follows_bf16(recipe, fast):
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("no FP8 tensor cores")
    bf16 = _train_losses(None)
    fp8 = _train_losses(recipe, fast_accum_backward=fast)
    # Over 8 steps of memorizing one batch the loss falls from ~8.45 to ~0.66. Measured on an
    # H200 (torch 2.11, torchao 0.15; docs/results/fp8_numerics_h200.txt): largest
    # per-step gap 1.6% (tensorwise) / 1.9% (rowwise) of the bf16 loss, 0.02-0.04 nats.
    # Tolerance 3% + 0.01 nats: room for another GPU's kernels, far inside what a broken cast
    # or scale gives (a wrong scale diverges by nats within a step or two).
    assert bf16[-1] < bf16[0] - 1.0 and fp8[-1] < fp8[0] - 1.0, (bf16, fp8)
    for a, b in zip(bf16, fp8):
        assert abs(a - b) <= 0.03 * a + 0.01, (bf16, fp8)


def test_distributed_path_swaps_on_the_meta_model_then_shards_and_loads(one_rank):
    # What full_finetune_distributed does: convert_to_fp8 as shard_and_load's before_shard.
    from torchtune import training

    from tune_recipes.training.setup.distributed import shard_and_load

    full = _tiny().state_dict()
    model, _ = shard_and_load(OmegaConf.create({"_component_": "tune_recipes.models.tiny_llama3"}),
                              dtype=torch.float32, device=torch.device("cpu"), world_size=1,
                              full_state_dict=full,
                              before_shard=lambda meta: convert_to_fp8(meta, "tensorwise"))
    assert isinstance(model.layers[0].mlp.w1, _float8_linear()) and type(model.output) is nn.Linear
    gathered = training.gather_cpu_state_dict(model, True, device=None)
    assert set(gathered) == set(full)
    for k, v in full.items():
        assert torch.equal(gathered[k], v), k
