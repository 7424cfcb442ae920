"""Tiny offline tokenizer and dataset for tests and the README demo.

torchtune's Llama-3 tokenizer pins its special tokens at ids 128000+, which forces a 128256-row
output layer: even a 2-layer, dim-64 model then spends seconds per step in that layer on a CPU.
Here the same Llama-3 chat format runs over a byte-level vocabulary with its own small
special-token map, so the whole vocabulary is 272 tokens.
"""

from pathlib import Path
from typing import Optional

from typing import Any, Mapping

from torchtune.data import Message
from torchtune.datasets import SFTDataset
from torchtune.models.llama3 import Llama3Tokenizer
from torchtune.modules.transforms import Transform

ASSETS_DIR = Path(__file__).resolve().parent / "assets"
TINY_TOKENIZER_PATH = ASSETS_DIR / "tiny_tokenizer.model"
TINY_DATA_PATH = ASSETS_DIR / "tiny_alpaca.json"

_SPECIAL_NAMES = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>",
    "<|finetune_right_pad_id|>",
    "<|step_id|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eom_id|>",
    "<|eot_id|>",
    "<|python_tag|>",
    "<|image|>",
    "<|video|>",
]
# Byte tokens take ids 0..255; special tokens follow directly.
TINY_SPECIAL_TOKENS = {name: 256 + i for i, name in enumerate(_SPECIAL_NAMES)}
# Rounded up to a multiple of 16 so the output layer has friendly shapes.
TINY_VOCAB_SIZE = 272


def tiny_tokenizer(max_seq_len: Optional[int] = 256) -> Llama3Tokenizer:
    """Llama-3 chat-format tokenizer over bytes, vocabulary size ``TINY_VOCAB_SIZE``."""
    return Llama3Tokenizer(
        path=str(TINY_TOKENIZER_PATH),
        special_tokens=dict(TINY_SPECIAL_TOKENS),
        max_seq_len=max_seq_len,
    )


class AlpacaToShortChat(Transform):
    """Alpaca record -> one user and one assistant message, without alpaca's long preamble
    (which would be most of every tiny sequence). ``train_on_input=False`` masks the user turn."""

    def __init__(self, train_on_input: bool = False):
        self.train_on_input = train_on_input

    def __call__(self, sample: Mapping[str, Any]) -> Mapping[str, Any]:
        prompt = sample["instruction"]
        if sample.get("input"):
            prompt = f"{prompt}\n{sample['input']}"
        messages = [
            Message(role="user", content=prompt, masked=not self.train_on_input),
            Message(role="assistant", content=sample["output"]),
        ]
        return {"messages": messages}


def tiny_alpaca_dataset(tokenizer, train_on_input: bool = False, packed: bool = False,
                        split: str = "train"):
    """The shipped 400-example instruction dataset (alpaca format, written by
    ``scripts/make_tiny_assets.py``), tokenized in the Llama-3 chat format. ``packed=True``
    packs examples into ``tokenizer.max_seq_len``-long sequences, as torchtune's datasets do.
    ``split`` takes Hugging Face slicing (``"train[:40]"``, ``"train[-40:]"``), e.g. to hold out
    a validation set."""
    ds = SFTDataset(
        source="json",
        data_files=str(TINY_DATA_PATH),
        split=split,
        message_transform=AlpacaToShortChat(train_on_input),
        model_transform=tokenizer,
    )
    if not packed:
        return ds
    from torchtune.datasets import PackedDataset

    if tokenizer.max_seq_len is None:
        raise ValueError("dataset.packed=True needs tokenizer.max_seq_len")
    return PackedDataset(ds, max_seq_len=tokenizer.max_seq_len)
