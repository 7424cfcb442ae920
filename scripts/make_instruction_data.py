"""Write an alpaca-format JSON of instruction rows of spread lengths, offline (for benchmarks on
machines that cannot download a dataset).

    python3 scripts/make_instruction_data.py --rows 4000 --median-words 40 --out /tmp/instruct.json
    tune run ... dataset._component_=torchtune.datasets.alpaca_dataset dataset.source=json \
        dataset.data_files=/tmp/instruct.json

Each row has ``instruction``, ``input`` (empty in half the rows) and ``output``, with log-normal
word counts (sigma 0.8) whose medians add up to ``--median-words``, over a 2,000-word vocabulary
drawn with Zipf-like frequencies (so a model has something to learn). About 6 bytes a word: with
a byte-level tokenizer and alpaca's prompt (~200 tokens), 40 words give rows of ~490 tokens (5%
under 250, 5% over 1,000). The same seed gives the same first rows whatever ``--rows`` is.
"""

import argparse
import json
import math
import os
import random
from pathlib import Path


def instruction_rows(rows: int, median_words: int, seed: int = 0) -> list:
    rng = random.Random(seed)
    letters = "etaoinshrdlcumwfgypbvkjxqz"
    vocab = ["".join(rng.choice(letters) for _ in range(rng.randint(2, 9))) for _ in range(2000)]
    weights = [1 / (k + 1) for k in range(len(vocab))]

    def text(median: float) -> str:
        n = max(1, min(int(rng.lognormvariate(math.log(median), 0.8)), int(6 * median)))
        return " ".join(rng.choices(vocab, weights, k=n))

    return [{"instruction": text(0.2 * median_words),
             "input": text(0.3 * median_words) if rng.random() < 0.5 else "",
             "output": text(0.6 * median_words)} for _ in range(rows)]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, required=True)
    ap.add_argument("--median-words", type=int, default=40, help="median words of a row, all fields")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    if args.rows < 1 or args.median_words < 5:
        ap.error(f"need --rows >= 1 and --median-words >= 5, got {args.rows} and {args.median_words}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    # written aside and renamed into place: a run on another GPU may be reading the same file
    tmp = out.with_name(f"{out.name}.{os.getpid()}")
    tmp.write_text(json.dumps(instruction_rows(args.rows, args.median_words, args.seed)))
    tmp.replace(out)


if __name__ == "__main__":
    main()
