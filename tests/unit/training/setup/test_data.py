"""tune_recipes.training.setup.data: dataset and dataloader."""

from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from torchtune import config as tt_config

from tune_recipes.config import ConfigError, load_config
from tune_recipes.training.setup.data import build_dataloader, build_dataset

pytestmark = pytest.mark.unit
CONFIG = Path(__file__).resolve().parents[4] / "configs" / "tiny" / "full_single_device.yaml"


def _loader(seed=0, rank=0, world_size=1, **kw):
    cfg = load_config(CONFIG)
    tok = tt_config.instantiate(cfg.tokenizer)
    ds = build_dataset(cfg.dataset, tok)
    return build_dataloader(ds, batch_size=4, shuffle=True, seed=seed, pad_id=tok.pad_id,
                            world_size=world_size, rank=rank, **kw)


def _first_tokens(loader, epoch):
    loader.sampler.set_epoch(epoch)
    return next(iter(loader))["tokens"].tolist()


def test_order_depends_only_on_seed_epoch_and_rank():
    a, b = _loader(seed=0), _loader(seed=0)
    assert _first_tokens(a, 0) == _first_tokens(b, 0)
    assert _first_tokens(a, 1) == _first_tokens(b, 1)
    assert _first_tokens(a, 0) != _first_tokens(a, 1)
    assert _first_tokens(_loader(seed=1), 0) != _first_tokens(a, 0)
    r0, r1 = _loader(rank=0, world_size=2), _loader(rank=1, world_size=2)
    assert _first_tokens(r0, 0) != _first_tokens(r1, 0)


def test_a_list_of_datasets_is_concatenated():
    cfg = load_config(CONFIG)
    tok = tt_config.instantiate(cfg.tokenizer)
    one = build_dataset(cfg.dataset, tok)
    two = build_dataset(OmegaConf.create([cfg.dataset, cfg.dataset]), tok)
    assert len(two) == 2 * len(one)


def test_inference_collate_is_rejected():
    with pytest.raises(ConfigError, match="left_pad_sequence is for inference"):
        _loader(collate_fn="torchtune.data.left_pad_sequence")


def _batches(iterator, n):
    return [next(iterator)["tokens"].tolist() for _ in range(n)]


@pytest.mark.parametrize("world_size", [1, 2])
def test_a_saved_mid_epoch_position_continues_with_the_next_batch(tmp_path, world_size):
    """Mid-epoch checkpoints: the state after k batches, saved and loaded the way the recipe
    state is (``weights_only=True``), makes a fresh loader continue with batch k + 1 of the
    same epoch, on each rank."""
    import torch

    for rank in range(world_size):
        straight = _loader(rank=rank, world_size=world_size)
        straight.sampler.set_epoch(1)
        it = iter(straight)
        seen = _batches(it, 2)
        torch.save(straight.state_dict(), tmp_path / "dl.pt")
        rest = _batches(it, 2)

        resumed = _loader(rank=rank, world_size=world_size)
        resumed.load_state_dict(torch.load(tmp_path / "dl.pt", weights_only=True))
        resumed.sampler.set_epoch(1)
        assert _batches(iter(resumed), 2) == rest
        # The next epoch starts afresh (the loaded position applies to one iterator only).
        resumed.sampler.set_epoch(2)
        fresh = _loader(rank=rank, world_size=world_size)
        fresh.sampler.set_epoch(2)
        assert _batches(iter(resumed), 2) == _batches(iter(fresh), 2)
        assert seen != rest


def test_the_order_is_torchs_distributed_sampler_order():
    """The stateful sampler changes nothing about which examples a rank sees, or when."""
    from torch.utils.data import DistributedSampler

    loader = _loader(rank=1, world_size=2)
    loader.sampler.set_epoch(3)
    plain = DistributedSampler(loader.dataset, num_replicas=2, rank=1, shuffle=True, seed=0)
    plain.set_epoch(3)
    assert list(loader.sampler) == list(plain)


def test_a_single_packed_dataset_gets_the_packed_collate():
    """torchtune's PackedDataset has no ``packed`` attribute: a single packed dataset still gets
    the packed collate (a block-causal mask and per-document positions), not padding."""
    from torchtune.datasets import PackedDataset

    from tune_recipes.data.collate import packed_collate
    from tune_recipes.training.setup.data import make_collate

    rows = [{"tokens": [1] * n, "labels": [1] * n} for n in (2, 3, 4)]
    packed = PackedDataset(rows, max_seq_len=8, padding_idx=0)
    assert make_collate(packed, pad_id=0, collate_fn="torchtune.data.padded_collate_sft",
                        ignore_index=-100) is packed_collate
    batch = make_collate(packed, pad_id=0, collate_fn="torchtune.data.padded_collate_sft",
                         ignore_index=-100)([packed[0]])
    assert {"mask", "input_pos"} <= set(batch)


def test_packs_longer_than_the_model_takes_are_refused_naming_the_tokenizers_length():
    from torchtune.datasets import PackedDataset

    from tune_recipes.data.collate import packed_collate
    from tune_recipes.training.setup.data import make_collate

    rows = [{"tokens": [1] * n, "labels": [1] * n} for n in (2, 3, 4)]
    packed = PackedDataset(rows, max_seq_len=8, padding_idx=0)
    options = dict(pad_id=0, collate_fn="torchtune.data.padded_collate_sft", ignore_index=-100)
    assert make_collate(packed, max_seq_len=8, **options) is packed_collate
    with pytest.raises(ConfigError, match=r"packs rows of 8 tokens \(tokenizer.max_seq_len\), "
                                          r"more than the model takes in a row \(6;"):
        make_collate(packed, max_seq_len=6, **options)


def test_padded_batches_go_on_to_128_token_multiples_on_a_gpu_only():
    """On a CUDA device padded batches go on to a multiple of 128 tokens (a run's batches take a
    bounded set of lengths: each new one cost host time on an H200), never past the tokenizer's
    or the model's max_seq_len; elsewhere they stay padded to their longest row."""
    from tune_recipes.training.setup.data import padded_batch_multiple

    assert padded_batch_multiple("cuda") == padded_batch_multiple(torch.device("cuda", 1)) == 128
    assert padded_batch_multiple("cpu") == padded_batch_multiple(None) == 1
    plain = [b["tokens"].shape[1] for b in _loader()]
    assert any(n % 128 for n in plain), plain  # the data has lengths off the grid
    on_gpu = [b["tokens"].shape[1] for b in _loader(pad_to_multiple_of=128)]
    assert all(m == -(-n // 128) * 128 for n, m in zip(plain, on_gpu)), (plain, on_gpu)
    # capped: by the tokenizer's max_seq_len (longest_row) and the model's, the smaller
    for caps in ({"longest_row": 100}, {"max_seq_len": 110}, {"longest_row": 100, "max_seq_len": 100},
                 {"longest_row": 100, "max_seq_len": 300}):
        for capped, free in zip(_loader(pad_to_multiple_of=128, **caps), _loader()):
            n, m = capped["tokens"].shape[1], free["tokens"].shape[1]
            cap = min(caps.values())
            assert n == max(min(-(-m // 128) * 128, cap), m), (caps, n, m)
            assert torch.equal(capped["labels"][:, :m], free["labels"])


def test_examples_longer_than_the_model_takes_are_one_line_naming_tokenizer_max_seq_len():
    """A tokenizer.max_seq_len above the model's is refused when the dataloader is built; with
    none (null: rows uncut, as torchtune's configs leave them) the batch holding an example
    longer than the model takes (the tiny rows: 52-102 tokens) stops with one line, not the
    model's traceback mid-epoch. Padded and padding-free alike."""
    for padding_free in (False, True):
        with pytest.raises(ConfigError, match=r"^tokenizer.max_seq_len=300 lets an example hold "
                                              r"more tokens than the model takes in a row \(100;"):
            _loader(longest_row=300, max_seq_len=100, padding_free=padding_free)
        with pytest.raises(ConfigError, match=r"^an example of 10[0-9] tokens is longer than the "
                                              r"model takes in a row \(100\); tokenizer.max_seq_len=null"):
            for _ in _loader(max_seq_len=100, padding_free=padding_free):
                pass
        assert len(list(_loader(max_seq_len=102, padding_free=padding_free))) > 1


def test_document_spans_where_the_runs_device_and_dtype_run_flash_attention(monkeypatch):
    """Spans only for a CUDA run in bf16/fp16 on a GPU that runs flash attention, whose models'
    head sizes it takes (fp32 there keeps flex attention's BlockMask); the packed and
    padding-free collates then give them."""
    from torchtune.datasets import PackedDataset

    import tune_recipes.training.setup.data as data
    from tune_recipes.modules.varlen_attention import DocumentSpans

    monkeypatch.setattr(data, "flash_varlen_available", lambda: True)
    assert data.document_spans_wanted("cuda", "bf16") and data.document_spans_wanted("cuda:1", torch.float16)
    assert not data.document_spans_wanted("cuda", "fp32")
    assert not data.document_spans_wanted("cpu", "bf16") and not data.document_spans_wanted(None, "bf16")
    # every model fed the batches must have a head size flash attention takes
    from tune_recipes.models import tiny_llama3

    student, teacher = tiny_llama3(), tiny_llama3()
    assert data.document_spans_wanted("cuda", "bf16", student, teacher)
    teacher.layers[1].attn.head_dim = 260
    assert not data.document_spans_wanted("cuda", "bf16", student, teacher)
    monkeypatch.setattr(data, "flash_varlen_available", lambda: False)
    assert not data.document_spans_wanted("cuda", "bf16")

    rows = [{"tokens": [1] * n, "labels": [1] * n} for n in (2, 3, 4)]
    options = dict(pad_id=0, collate_fn="torchtune.data.padded_collate_sft", ignore_index=-100, spans=True)
    packed = PackedDataset(rows, max_seq_len=8, padding_idx=0)
    mask = data.make_collate(packed, **options)([packed[0]])["mask"]
    assert isinstance(mask, DocumentSpans) and mask.cu_seqlens.tolist() == [0, 2, 5, 8]
    free = data.make_collate(rows, padding_free=True, **options)(rows)
    # 9 tokens, padded on to 16 over spans (FP8's multiple), not flex attention's 128
    assert free["tokens"].shape == (1, 16)
    assert isinstance(free["mask"], DocumentSpans) and free["mask"].cu_seqlens.tolist() == [0, 2, 5, 9, 16]
    flex = data.make_collate(rows, padding_free=True, **{**options, "spans": False})(rows)
    assert flex["tokens"].shape == (1, 128)


def test_the_whole_model_compiled_on_padding_free_batches_warns_only_without_document_spans():
    """Padding-free batches change length every batch: through flex attention's block mask the
    whole-model graph took minutes to compile for dynamic shapes, through document spans it
    compiles dynamic from the first batch (the fastest unpacked setting). Only the first gets the warning."""
    from tune_recipes.training.setup import data

    def cfg(**over):
        return OmegaConf.create({"padding_free": True, "compile": True, "compile_scope": "model",
                                 "dataset": {"_component_": "x"}, **over})

    line = data.whole_model_dynamic_compile_warning(cfg(), "cuda", spans=False)
    assert line and "compile_scope=layers" in line and "flex attention" in line
    assert data.whole_model_dynamic_compile_warning(cfg(), "cuda", spans=True) is None
    assert data.whole_model_dynamic_compile_warning(cfg(), "cpu", spans=False) is None
    assert data.whole_model_dynamic_compile_warning(cfg(compile_scope="layers"), "cuda", spans=False) is None
    assert data.whole_model_dynamic_compile_warning(cfg(padding_free=False), "cuda", spans=False) is None
    # packs keep their one length on that path (packs_without_padding)
    packed = cfg(dataset={"_component_": "x", "packed": True})
    assert data.whole_model_dynamic_compile_warning(packed, "cuda", spans=False) is None
    # a list of datasets packs only if each packs
    mixed = cfg(dataset=[{"_component_": "x", "packed": True}, {"_component_": "y"}])
    assert data.whole_model_dynamic_compile_warning(mixed, "cuda", spans=False)


def test_packs_lose_their_padding_except_where_a_new_length_costs_a_slow_compile():
    """padding_free on packs: on the CPU, eagerly, compiled over document spans in bf16 and
    compiled per layer the packs go without their padding; compiled with FP8 products, or the
    whole model over flex attention's block mask, they keep their one length."""
    from torchtune.datasets import PackedDataset

    from tune_recipes.training.setup.data import packs_without_padding, training_padding_free

    def cfg(**over):
        return OmegaConf.create({"padding_free": True, "compile": True,
                                 "dataset": {"_component_": "x", "packed": True}, **over})

    assert packs_without_padding(cfg(), "cpu", spans=False)
    assert packs_without_padding(cfg(compile=False), "cuda", spans=False)
    assert packs_without_padding(cfg(compile_scope="model"), "cuda:1", spans=True)
    assert packs_without_padding(cfg(compile_scope="layers"), "cuda", spans=False)
    assert not packs_without_padding(cfg(compile_scope="model"), "cuda", spans=False)
    assert not packs_without_padding(cfg(enable_fp8_training=True), torch.device("cuda"), spans=True)
    assert packs_without_padding(cfg(enable_fp8_training=True, compile=False), "cuda", spans=True)
    assert not packs_without_padding(cfg(padding_free=False), "cpu", spans=False)
    # decided on the dataset built, packed or not, whatever its config says
    packs = PackedDataset([{"tokens": [1, 2, 3], "labels": [1, 2, 3]}] * 4, max_seq_len=8)
    rows = [{"tokens": [1, 2, 3], "labels": [1, 2, 3]}]
    fp8 = cfg(enable_fp8_training=True, dataset={"_component_": "my.builder"})
    assert not training_padding_free(fp8, packs, "cuda", spans=True)
    assert training_padding_free(fp8, rows, "cuda", spans=True)
    assert training_padding_free(fp8, packs, "cpu", spans=False)
