"""How much of torchtune's packs is padding: a rows file (alpaca format, such as
scripts/make_instruction_data.py writes) through torchtune's ``alpaca_dataset`` packed, tokenized
by the tiny byte-level tokenizer the benchmarks use, and each pack's padding counted (as
``tune_recipes.data.collate.pack_padding`` counts it).

    python3 scripts/pack_padding.py --rows /tmp/instruct.json --seq-len 2048

Prints the packs, the share of their tokens that is padding, the mean padding a pack and the
share of their tokens that is scored (label tokens). ``padding_free: True`` leaves the padding
out of packed batches (``tune_recipes.data.collate.packed_padding_free_collate``).
"""

import argparse
import json


def pack_padding(rows_file: str, seq_len: int = 2048) -> dict:
    from torchtune.datasets import alpaca_dataset

    from tune_recipes.constants import CROSS_ENTROPY_IGNORE_INDEX
    from tune_recipes.data import tiny_tokenizer
    from tune_recipes.data.collate import pack_padding as padding_of

    packs = alpaca_dataset(tiny_tokenizer(max_seq_len=seq_len), source="json", data_files=rows_file,
                           split="train", packed=True)
    padding = scored = 0
    for pack in packs:
        padding += padding_of(pack)
        scored += int((pack["labels"] != CROSS_ENTROPY_IGNORE_INDEX).sum())
    tokens = len(packs) * seq_len
    return {"packs": len(packs), "padding_share": padding / tokens, "padding_a_pack": padding / len(packs),
            "label_share": scored / tokens}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", required=True, help="alpaca-format JSON rows file")
    ap.add_argument("--seq-len", type=int, default=2048, help="the packs' length (tokenizer.max_seq_len)")
    args = ap.parse_args(argv)
    out = pack_padding(args.rows, args.seq_len)
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
