"""A frozen token embedding kept in CPU memory: ``embedding_on_cpu`` for LoRA/QLoRA.

LoRA never trains the token embedding, yet the table sits in GPU memory for the whole run:
128256 x 4096 bf16 = 0.98 GiB for Llama-3.1-8B, 10% of a QLoRA 8B run's peak. A step only
needs the rows of its own tokens (4096 tokens x 8 KB = 32 MB at batch 2 x 2048).

``HostEmbedding`` keeps the table in pinned (page-locked) CPU memory and gathers the step's
rows on the GPU: a Triton kernel reads them straight from host memory over the bus (CUDA's
unified addressing maps pinned memory into the GPU's address space), so the lookup is one
asynchronous kernel like any other: no host sync, no copy of the tokens to the CPU, and the
host never touches the rows. Elsewhere (CPU runs, tests) it is a plain ``embedding`` call.

The table is the original Parameter, frozen, under its name (``weight``): ``state_dict()``
keys and values are those of ``nn.Embedding``, so the adapter save, the merged save and a
resume are unchanged. Not for tied embeddings (the output projection reads the same table for
the logits, on the GPU, every step): refused with a ``ConfigError``.
"""

import functools

import torch
import torch.nn.functional as F
from torch import nn

from tune_recipes.config import ConfigError

# Elements per program and block: one program per token row.
BLOCK = 1024


@functools.lru_cache(maxsize=None)
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def gather_rows(table_ptr, index_ptr, out_ptr, dim, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        index = tl.load(index_ptr + row).to(tl.int64)
        for start in range(0, dim, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < dim
            values = tl.load(table_ptr + index * dim + cols, mask=mask)
            tl.store(out_ptr + row * dim + cols, values, mask=mask)

    return gather_rows


def gather_from_host(table: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``table[tokens]`` on ``tokens.device`` (CUDA) with ``table`` in pinned CPU memory."""
    flat = tokens.reshape(-1)
    # An id outside the table would read outside it: checked on the device (no sync), as
    # nn.Embedding's CUDA kernel does.
    torch._assert_async(((flat >= 0) & (flat < table.shape[0])).all(),
                        "a token id is outside the embedding table")
    out = torch.empty(flat.numel(), table.shape[1], dtype=table.dtype, device=tokens.device)
    if flat.numel():
        _kernel()[(flat.numel(),)](table, flat, out, table.shape[1], BLOCK=BLOCK)
    return out.view(*tokens.shape, table.shape[1])


class HostEmbedding(nn.Module):
    """A frozen ``nn.Embedding`` whose table lives in pinned CPU memory (module docstring)."""

    def __init__(self, embedding: nn.Embedding) -> None:
        super().__init__()
        if embedding.weight.requires_grad:
            raise ConfigError("embedding_on_cpu=True: the token embedding trains; only a frozen "
                              "one (LoRA, QLoRA) can stay in CPU memory")
        if embedding.padding_idx is not None or embedding.max_norm is not None:
            raise ConfigError("embedding_on_cpu=True supports a plain nn.Embedding only "
                              "(no padding_idx or max_norm)")
        self.num_embeddings, self.embedding_dim = embedding.weight.shape
        weight = embedding.weight.detach().to("cpu")
        if torch.cuda.is_available():
            weight = weight.pin_memory()
        self.weight = nn.Parameter(weight, requires_grad=False)

    # NOTE: a graph break under whole-model compile: dynamo does not trace a Triton kernel
    # reading host memory, and the lookup is one kernel either way.
    @torch.compiler.disable
    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if tokens.is_cuda and self.weight.is_pinned():
            return gather_from_host(self.weight, tokens)
        return F.embedding(tokens.to(self.weight.device), self.weight).to(tokens.device)


def keep_embedding_on_cpu(model: nn.Module) -> int:
    """Move ``model.tok_embeddings`` (a torchtune decoder's) to CPU memory, in place; returns
    the bytes of GPU memory it held. A ``ConfigError`` when the output projection is tied to it
    or the model has no such embedding."""
    embedding = getattr(model, "tok_embeddings", None)
    if not isinstance(embedding, nn.Embedding):
        raise ConfigError("embedding_on_cpu=True: the model has no tok_embeddings nn.Embedding")
    output = getattr(model, "output", None)
    tied = getattr(output, "tied_module", None) is embedding or \
        getattr(output, "weight", None) is embedding.weight
    if tied:
        raise ConfigError(
            "embedding_on_cpu=True, but the output projection shares the embedding table (tied "
            "embeddings, e.g. Llama-3.2 1B/3B, Qwen2.5 0.5B-3B): the logits need it on the GPU "
            "every step; set embedding_on_cpu=False")
    held = embedding.weight.numel() * embedding.weight.element_size() \
        if embedding.weight.is_cuda else 0
    model.tok_embeddings = HostEmbedding(embedding)
    return held
