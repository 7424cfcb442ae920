"""``embedding_on_cpu`` (tune_recipes/modules/host_embedding.py): the frozen token embedding in
pinned CPU memory, its rows gathered by a GPU kernel.

On the CPU: the module equals ``nn.Embedding`` exactly, keeps the state dict, and the refusals
(tied embeddings, a trainable table, device=cpu) name the key; the Triton kernel runs under
Triton's interpreter where Triton is installed. On a GPU (``gpu``): the kernel reads the pinned
table and equals ``nn.Embedding``, the GPU holds no table, and the tiny LoRA recipe trains the
same losses with and without the option."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from tune_recipes.config import ConfigError
from tune_recipes.models.tiny import lora_tiny_llama3, lora_tiny_llama3_2
from tune_recipes.modules.host_embedding import HostEmbedding, gather_from_host, keep_embedding_on_cpu

pytestmark = pytest.mark.unit


def _frozen_embedding(v=300, d=48, dtype=torch.bfloat16):
    torch.manual_seed(0)
    emb = nn.Embedding(v, d).to(dtype)
    emb.weight.requires_grad_(False)
    return emb


def test_equals_nn_embedding_and_keeps_the_state_dict():
    emb = _frozen_embedding()
    host = HostEmbedding(emb)
    tokens = torch.randint(0, 300, (3, 17))
    assert torch.equal(host(tokens), emb(tokens))
    assert list(host.state_dict()) == list(emb.state_dict()) == ["weight"]
    assert torch.equal(host.state_dict()["weight"], emb.weight)
    assert host.weight.device.type == "cpu" and not host.weight.requires_grad


def test_lora_model_keeps_keys_and_outputs_and_tied_or_trainable_tables_are_refused():
    torch.manual_seed(0)
    model = lora_tiny_llama3(["q_proj", "v_proj"])
    for p in model.parameters():
        p.requires_grad_(False)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    tokens = torch.randint(0, 272, (2, 9))
    with torch.no_grad():
        ref = model(tokens)
    assert keep_embedding_on_cpu(model) == 0  # it was on the CPU already: no GPU bytes freed
    assert isinstance(model.tok_embeddings, HostEmbedding)
    after = model.state_dict()
    assert list(after) == list(before)
    assert all(torch.equal(after[k], before[k]) for k in before)
    with torch.no_grad():
        assert torch.equal(model(tokens), ref)

    tied = lora_tiny_llama3_2(["q_proj"])
    with pytest.raises(ConfigError, match="embedding_on_cpu=True, but the output projection shares"):
        keep_embedding_on_cpu(tied)
    trainable = nn.Embedding(10, 4)
    with pytest.raises(ConfigError, match="embedding_on_cpu=True: the token embedding trains"):
        HostEmbedding(trainable)


def test_on_a_cpu_device_it_is_refused_naming_the_key():
    from omegaconf import OmegaConf

    from tune_recipes.training.setup.model import embedding_on_cpu_wanted

    cfg = OmegaConf.create({"embedding_on_cpu": True})
    with pytest.raises(ConfigError, match="embedding_on_cpu=True needs device=cuda"):
        embedding_on_cpu_wanted(cfg, torch.device("cpu"))
    assert not embedding_on_cpu_wanted(OmegaConf.create({}), torch.device("cpu"))


def test_the_lora_setup_moves_the_table():
    from omegaconf import OmegaConf

    from tune_recipes.training.setup.model import setup_lora_model

    cfg = OmegaConf.create({"_component_": "tune_recipes.models.lora_tiny_llama3",
                            "lora_attn_modules": ["q_proj"], "lora_rank": 4, "lora_alpha": 8})
    sd = lora_tiny_llama3(["q_proj"], lora_rank=4).state_dict()
    base = {k: v for k, v in sd.items() if "lora" not in k}
    model, _ = setup_lora_model(cfg, dtype=torch.float32, device=torch.device("cpu"), seed=0,
                                base_state_dict=base, lora_state_dict=None, embedding_on_cpu=True)
    assert isinstance(model.tok_embeddings, HostEmbedding)
    assert torch.equal(model.tok_embeddings.weight, base["tok_embeddings.weight"])


def test_the_option_is_validated_as_a_boolean():
    from omegaconf import OmegaConf

    from tune_recipes.validation import check_values

    check_values(OmegaConf.create({"embedding_on_cpu": True}), {"embedding_on_cpu"})
    with pytest.raises(ConfigError, match="embedding_on_cpu"):
        check_values(OmegaConf.create({"embedding_on_cpu": "yes"}), {"embedding_on_cpu"})


def test_kernel_under_the_interpreter():
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, __file__, "interpreted"], env=env, capture_output=True,
                          text=True, timeout=300, cwd=Path(__file__).resolve().parents[3])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def _interpreted():
    """The kernel on CPU tensors: ids at 0 and V-1, a row longer than one block."""
    from tune_recipes.modules import host_embedding

    table = torch.randn(50, host_embedding.BLOCK + 37).half()
    tokens = torch.randint(0, 50, (2, 5))
    tokens[0, 0], tokens[1, 4] = 0, 49
    got = gather_from_host(table, tokens)
    assert got.shape == (2, 5, table.shape[1])
    assert torch.equal(got, table[tokens])


@pytest.mark.gpu
def test_gpu_gathers_from_pinned_memory_and_holds_no_table():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    emb = _frozen_embedding(v=5000, d=1024).cuda()
    tokens = torch.randint(0, 5000, (4, 333), device="cuda")
    ref = emb(tokens)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    model = nn.Module()
    model.tok_embeddings = emb
    del emb
    freed = keep_embedding_on_cpu(model)
    assert freed == 5000 * 1024 * 2
    assert model.tok_embeddings.weight.is_pinned()
    assert torch.cuda.memory_allocated() <= before - freed
    got = model.tok_embeddings(tokens)
    assert got.is_cuda and torch.equal(got, ref)


@pytest.mark.gpu
def test_gpu_lora_recipe_trains_the_same_losses(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "recipes"))
    from helpers import losses  # tests/recipes/helpers.py

    def run(out, *extra):
        cmd = [sys.executable, "-m", "tune_recipes", "run", "lora_finetune_single_device", "--config",
               "tiny/lora_single_device", f"output_dir={out}", "device=cuda", "dtype=bf16",
               "max_steps_per_epoch=4", *extra]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                              cwd=Path(__file__).resolve().parents[3])
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc

    run(tmp_path / "gpu")
    proc = run(tmp_path / "cpu_table", "embedding_on_cpu=True")
    assert "embedding_on_cpu: the token embedding" in proc.stdout + proc.stderr
    assert losses(tmp_path / "cpu_table") == losses(tmp_path / "gpu")


if __name__ == "__main__" and sys.argv[1:] == ["interpreted"]:
    _interpreted()
