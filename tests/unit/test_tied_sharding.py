"""A tied-embedding model refuses tok_embeddings as its own FSDP unit, with a clear error."""

import pytest
import torch

from tune_recipes.config import ConfigError
from tune_recipes.models import tiny_llama3, tiny_llama3_2
from tune_recipes.training.setup.distributed import check_tied_embedding_sharding

pytestmark = pytest.mark.unit


def test_tied_model_rejects_separately_sharded_embedding():
    with torch.device("meta"):
        tied = tiny_llama3_2()
    with pytest.raises(ConfigError, match="custom_sharded_layers.*tok_embeddings"):
        check_tied_embedding_sharding(tied, ["tok_embeddings", "output"])
    check_tied_embedding_sharding(tied, [])
    check_tied_embedding_sharding(tied, None)


def test_untied_model_may_shard_embedding_and_output():
    with torch.device("meta"):
        untied = tiny_llama3()
    check_tied_embedding_sharding(untied, ["tok_embeddings", "output"])
