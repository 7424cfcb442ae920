"""tune_recipes.training.setup.model: single-device models, ready to train."""

import pytest
import torch

from tune_recipes.config import ConfigError
from tune_recipes.training.setup.model import setup_full_model, setup_lora_model

pytestmark = pytest.mark.unit


def _lora_cfg(component="tune_recipes.models.lora_tiny_llama3"):
    from omegaconf import OmegaConf

    cfg = {"_component_": component}
    if "lora" in component:
        cfg.update(lora_attn_modules=["q_proj", "v_proj"], apply_lora_to_mlp=False,
                   apply_lora_to_output=False, lora_rank=4, lora_alpha=8)
    return OmegaConf.create(cfg)


def _base_state_dict():
    from tune_recipes.models import tiny_llama3

    torch.manual_seed(0)
    return tiny_llama3().state_dict()


def test_lora_model_trains_only_seeded_adapters_over_the_loaded_base():
    base = _base_state_dict()
    built = {}
    for seed in (7, 7, 8):
        model, lora = setup_lora_model(_lora_cfg(), dtype=torch.float32, device=torch.device("cpu"),
                                       seed=seed, base_state_dict=base, lora_state_dict=None)
        built.setdefault(seed, []).append(model)
    model = built[7][0]
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    assert lora.attn_modules == ["q_proj", "v_proj"] and not lora.apply_to_output
    sd = model.state_dict()
    for k, v in base.items():  # the base weights are the checkpoint's
        assert torch.equal(sd[k], v), k
    a7 = [p for n, p in built[7][0].named_parameters() if "lora_a" in n]
    a7_again = [p for n, p in built[7][1].named_parameters() if "lora_a" in n]
    a8 = [p for n, p in built[8][0].named_parameters() if "lora_a" in n]
    assert all(torch.equal(x, y) for x, y in zip(a7, a7_again))  # init depends on the seed only
    assert not all(torch.equal(x, y) for x, y in zip(a7, a8))


def test_lora_model_resumes_the_given_adapters():
    base = _base_state_dict()
    first, _ = setup_lora_model(_lora_cfg(), dtype=torch.float32, device=torch.device("cpu"),
                                seed=1, base_state_dict=base, lora_state_dict=None)
    adapters = {n: p.detach() + 1.0 for n, p in first.named_parameters() if p.requires_grad}
    resumed, _ = setup_lora_model(_lora_cfg(), dtype=torch.float32, device=torch.device("cpu"),
                                  seed=2, base_state_dict=base, lora_state_dict=adapters)
    for n, p in resumed.named_parameters():
        if n in adapters:
            assert torch.equal(p, adapters[n]), n


def test_lora_model_with_fp8_quantizes_the_loaded_base_and_keeps_the_state_dict(monkeypatch):
    # On CPU the FP8 product is emulated (the recipe refuses FP8 off CUDA before this point).
    import functools

    from tune_recipes.modules import fp8_lora
    from tune_recipes.training.setup import model as setup_model

    monkeypatch.setattr(setup_model, "convert_lora_to_fp8",
                        functools.partial(fp8_lora.convert_lora_to_fp8, emulate=True))
    base = _base_state_dict()
    plain, _ = setup_lora_model(_lora_cfg(), dtype=torch.bfloat16, device=torch.device("cpu"),
                                seed=3, base_state_dict=base, lora_state_dict=None)
    fp8, _ = setup_lora_model(_lora_cfg(), dtype=torch.bfloat16, device=torch.device("cpu"),
                              seed=3, base_state_dict=base, lora_state_dict=None, fp8=True)
    q = fp8.layers[1].attn.q_proj
    assert isinstance(q, fp8_lora.FP8LoRALinear)
    assert type(fp8.layers[1].attn.k_proj) is torch.nn.Linear  # no adapter: not converted
    # quantized from the loaded checkpoint weight (not the builder's random init)
    ref_q, ref_inv = fp8_lora.to_float8(base["layers.1.attn.q_proj.weight"].to(torch.bfloat16),
                                        fp8_lora.E4M3)
    assert torch.equal(q.weight_fp8.view(torch.uint8), ref_q.view(torch.uint8))
    assert torch.equal(q.weight_inv_scale, ref_inv)
    plain_sd, fp8_sd = plain.state_dict(), fp8.state_dict()
    assert list(fp8_sd) == list(plain_sd)
    assert all(torch.equal(fp8_sd[k], v) for k, v in plain_sd.items())
    assert {n for n, p in fp8.named_parameters() if p.requires_grad} == \
        {n for n, p in plain.named_parameters() if p.requires_grad}


def test_lora_model_rejects_a_builder_without_adapters_naming_it():
    with pytest.raises(ConfigError, match="tune_recipes.models.tiny_llama3 has no LoRA adapters"):
        setup_lora_model(_lora_cfg("tune_recipes.models.tiny_llama3"), dtype=torch.float32,
                         device=torch.device("cpu"), seed=0, base_state_dict=_base_state_dict(),
                         lora_state_dict=None)


def test_full_model_loads_strictly_after_before_load():
    base = _base_state_dict()
    calls = []

    def before_load(model):
        calls.append(type(model).__name__)
        return model

    cfg = _lora_cfg("tune_recipes.models.tiny_llama3")
    model = setup_full_model(cfg, dtype=torch.float32, device=torch.device("cpu"),
                             state_dict=base, before_load=before_load)
    assert calls == ["TransformerDecoder"]
    assert all(p.requires_grad for p in model.parameters())
    for k, v in model.state_dict().items():
        assert torch.equal(v, base[k]), k
    with pytest.raises(ConfigError, match="tiny_llama3 does not fit .*Missing key"):
        setup_full_model(cfg, dtype=torch.float32, device=torch.device("cpu"),
                         state_dict={k: v for k, v in base.items() if "output" not in k})


@pytest.fixture
def restore_activation_memory_budget():
    import torch._functorch.config as functorch_config

    before = functorch_config.activation_memory_budget
    yield
    functorch_config.activation_memory_budget = before


def _saved_bytes_of_a_step(saved_bytes, module, x):
    """Bytes ``module``'s forward saves for backward, after which the backward runs."""
    loss, saved = saved_bytes(lambda: module(x).square().sum())
    loss.backward()
    return saved


def _compiled_saved_bytes(saved_bytes, budget):
    """Bytes a compiled 3-block MLP saves for backward under ``budget``, and x's gradient.
    aot_eager_decomp_partition: the same partitioner as inductor's (the budget is its input),
    without generating kernels."""
    from tune_recipes.training.setup.model import set_activation_memory_budget

    torch._dynamo.reset()  # a fresh trace: the budget is read when a graph is partitioned
    set_activation_memory_budget(budget)
    torch.manual_seed(0)
    blocks = torch.nn.Sequential(*[torch.nn.Sequential(
        torch.nn.Linear(64, 256), torch.nn.SiLU(), torch.nn.Linear(256, 64)) for _ in range(3)])
    x = torch.randn(32, 64, requires_grad=True)
    compiled = torch.compile(blocks, backend="aot_eager_decomp_partition")
    saved = _saved_bytes_of_a_step(saved_bytes, compiled, x)
    torch._dynamo.reset()
    return saved, x.grad


def test_activation_memory_budget_makes_compiled_graphs_save_less_for_the_same_gradients(
        restore_activation_memory_budget, saved_bytes):
    import torch._functorch.config as functorch_config

    full, grad_full = _compiled_saved_bytes(saved_bytes, 1.0)
    half, grad_half = _compiled_saved_bytes(saved_bytes, 0.5)
    # The weights are saved at any budget; what goes is activations, recomputed in backward.
    assert half < full
    torch.testing.assert_close(grad_half, grad_full, rtol=1e-6, atol=0)
    assert functorch_config.activation_memory_budget == 0.5
    # None leaves the setting alone; 1.0 is torch's default again, and the graphs traced
    # under 0.5 are not reused.
    still, _ = _compiled_saved_bytes(saved_bytes, None)
    assert functorch_config.activation_memory_budget == 0.5 and still == half
    again, _ = _compiled_saved_bytes(saved_bytes, 1.0)
    assert functorch_config.activation_memory_budget == 1.0 and again == full


def test_a_changed_budget_is_not_ignored_by_an_already_compiled_module_class(
        restore_activation_memory_budget, saved_bytes):
    """torch.compile reuses the code it traced for one instance of a module class for the next
    one, without looking at the budget: set_activation_memory_budget clears it on a change."""
    from tune_recipes.training.setup.model import set_activation_memory_budget

    def saved_by_a_new_instance(budget):
        set_activation_memory_budget(budget)  # no dynamo reset here: the function's own
        torch.manual_seed(0)
        block = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.SiLU(), torch.nn.Linear(256, 64),
                                    torch.nn.SiLU(), torch.nn.Linear(64, 64))
        compiled = torch.compile(block, backend="aot_eager_decomp_partition")
        return _saved_bytes_of_a_step(saved_bytes, compiled, torch.randn(32, 64, requires_grad=True))

    torch._dynamo.reset()
    try:
        full = saved_by_a_new_instance(1.0)
        assert saved_by_a_new_instance(0.0) < full
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("bad", [1.5, -0.1, "half"])
def test_activation_memory_budget_out_of_range_is_named(bad, restore_activation_memory_budget):
    from tune_recipes.training.setup.model import set_activation_memory_budget

    with pytest.raises(ConfigError, match=f"activation_memory_budget={bad}"):
        set_activation_memory_budget(bad)


def test_weights_of_another_model_are_one_line_naming_the_builder():
    """A checkpoint of another size than model._component_ builds: one ConfigError naming the
    builder and the first mismatched weight (torch lists every one, over dozens of lines)."""
    from omegaconf import OmegaConf

    from tune_recipes.config import ConfigError
    from tune_recipes.models import tiny_llama3
    from tune_recipes.training.setup.model import load_weights

    model = tiny_llama3()
    other = {k: torch.zeros(*(2 * n for n in v.shape)) for k, v in model.state_dict().items()}
    cfg = OmegaConf.create({"_component_": "tune_recipes.models.tiny_llama3"})
    with pytest.raises(ConfigError) as info:
        load_weights(model, other, cfg)
    message = str(info.value)
    assert "\n" not in message and "tune_recipes.models.tiny_llama3" in message
    assert "size mismatch for" in message and "checkpointer.checkpoint_dir" in message
    assert load_weights(model, tiny_llama3().state_dict(), cfg).missing_keys == []


def test_compiled_per_layer_padding_free_batches_of_three_lengths_compile_once(monkeypatch, padding_free_batches):
    """compile_layers (torchtune's per-layer compile, aot_eager here): padding-free batches
    with spans of three lengths, moved as the step moves them, forward and backward, compile
    the layers' graph once
    (their input, the embedding's output, marked dynamic from the first batch), where marking
    the batch alone compiles it twice; the logits are the eager model's (fp32, 1e-5)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from tune_recipes.models import tiny_llama3
    from tune_recipes.modules.document_attention import route_document_attention
    from tune_recipes.training.setup.model import compile_layers

    monkeypatch.setenv("TORCH_COMPILE_BACKEND", "aot_eager")
    torch.manual_seed(0)
    eager, model = tiny_llama3().eval(), tiny_llama3().eval()
    model.load_state_dict(eager.state_dict())
    for m in (eager, model):
        route_document_attention(m)
    torch._dynamo.reset()
    counters.clear()
    compile_layers(model, verbose=False)
    for batch in padding_free_batches("cpu"):
        args = dict(mask=batch["mask"], input_pos=batch["input_pos"])
        out = model(batch["tokens"], **args)  # with autograd on, as in training
        out.square().mean().backward()
        with torch.no_grad():
            torch.testing.assert_close(out.detach(), eager(batch["tokens"], **args), rtol=1e-5, atol=1e-5)
    assert counters["stats"]["unique_graphs"] == 1
    assert not model._length_mark_handles  # the one-call hooks are gone
    torch._dynamo.reset()


def test_lora_key_mismatches_name_the_base_checkpoint_or_the_resumed_adapter():
    from omegaconf import OmegaConf

    from tune_recipes.training.checkpointing.io import LoRASpec
    from tune_recipes.training.setup.model import check_lora_keys

    cfg = OmegaConf.create({"_component_": "tune_recipes.models.lora_tiny_llama3",
                            "lora_attn_modules": ["q_proj"], "lora_rank": 4, "lora_alpha": 8})
    spec = LoRASpec.from_model_config(cfg)
    check_lora_keys(cfg, spec, ["layers.0.attn.q_proj.lora_a.weight"], [], None, [])  # fine
    with pytest.raises(ConfigError, match=r"^model: tune_recipes.models.lora_tiny_llama3 does not "
                                          r"fit the checkpoint's weights \(Missing non-LoRA key"):
        check_lora_keys(cfg, spec, ["tok_embeddings.weight"], [], None, [])
    with pytest.raises(ConfigError, match=r"^model: the adapter being resumed does not fit this "
                                          r"run's LoRA settings \(Unexpected key loading adapter\)"):
        check_lora_keys(cfg, spec, [], [], [], ["layers.0.mlp.w1.lora_a.weight"])


def test_resumed_adapter_shapes_are_checked_on_a_qlora_meta_model():
    # The distributed recipes check on the meta model they shard; a QLoRA model's state-dict
    # hook (NF4 -> bf16 on the CPU) cannot run there, so the check reads the parameters.
    from torchtune.modules.peft import get_adapter_state_dict

    from tune_recipes.models.tiny import lora_tiny_llama3
    from tune_recipes.training.setup.model import check_resumed_adapter_shapes

    saved = lora_tiny_llama3(["q_proj", "v_proj"], lora_rank=8, quantize_base=True)
    adapter = {k: v.clone() for k, v in get_adapter_state_dict(saved.state_dict()).items()}
    with torch.device("meta"):
        same = lora_tiny_llama3(["q_proj", "v_proj"], lora_rank=8, quantize_base=True)
        other = lora_tiny_llama3(["q_proj", "v_proj"], lora_rank=4, quantize_base=True)
    check_resumed_adapter_shapes(same, adapter)
    with pytest.raises(ConfigError, match=r"^model: the adapter being resumed does not fit this "
                                          r"run's LoRA settings \(layers\.0\.attn\.q_proj\.lora_a\.weight "
                                          r"is \[8, \d+\] in the checkpoint, \[4, \d+\] in this run's model\); "
                                          r"model\.lora_rank"):
        check_resumed_adapter_shapes(other, adapter)
