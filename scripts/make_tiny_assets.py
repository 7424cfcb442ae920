"""Regenerate the tiny offline assets shipped in ``tune_recipes/data/assets``.

- ``tiny_alpaca.json``: a few hundred instruction examples in alpaca format, written by this
  script from simple deterministic tasks (no third-party text).
- ``tiny_tokenizer.model``: a byte-level tiktoken BPE file (256 byte tokens, no merges). Special
  tokens are not in this file; they live in ``tune_recipes.data.tokenizer.TINY_SPECIAL_TOKENS``.

Usage: python scripts/make_tiny_assets.py   (output is deterministic; diff it after a change)
"""

import base64
import json
import random
from pathlib import Path

ASSETS = Path(__file__).resolve().parents[1] / "tune_recipes" / "data" / "assets"

WORDS = [
    "river", "garden", "window", "pencil", "rocket", "planet", "silver", "market", "candle",
    "forest", "bridge", "castle", "orange", "tiger", "violin", "winter", "summer", "mirror",
    "basket", "ladder", "meadow", "harbor", "lantern", "pepper", "thunder", "marble", "falcon",
    "puzzle", "copper", "velvet", "glacier", "island", "jacket", "kettle", "lemon", "magnet",
]
OPPOSITES = [
    ("hot", "cold"), ("up", "down"), ("early", "late"), ("open", "closed"), ("light", "dark"),
    ("fast", "slow"), ("full", "empty"), ("high", "low"), ("wet", "dry"), ("loud", "quiet"),
    ("old", "new"), ("hard", "soft"), ("near", "far"), ("rich", "poor"), ("thick", "thin"),
]


def _examples(rng: random.Random):
    out = []
    for _ in range(110):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        out.append(("Add the two numbers.", f"{a} + {b}", str(a + b)))
    for _ in range(70):
        w = rng.choice(WORDS)
        out.append(("Reverse the letters of the word.", w, w[::-1]))
    for _ in range(70):
        w = rng.choice(WORDS)
        out.append(("Write the word in capital letters.", w, w.upper()))
    for _ in range(60):
        nums = [rng.randint(0, 50) for _ in range(rng.randint(3, 6))]
        out.append(("Sort the numbers from smallest to largest.", " ".join(map(str, nums)),
                    " ".join(map(str, sorted(nums)))))
    for _ in range(50):
        x, y = rng.choice(OPPOSITES)
        if rng.random() < 0.5:
            x, y = y, x
        out.append(("Give the opposite of the word.", x, y))
    for _ in range(40):
        w = rng.choice(WORDS)
        n = sum(ch in "aeiou" for ch in w)
        out.append(("How many vowels does the word have?", w, f"The word {w} has {n} vowels."))
    rng.shuffle(out)
    return [{"instruction": i, "input": x, "output": y} for i, x, y in out]


def main() -> None:
    ASSETS.mkdir(parents=True, exist_ok=True)
    data = _examples(random.Random(1234))
    (ASSETS / "tiny_alpaca.json").write_text(json.dumps(data, indent=1) + "\n")
    lines = [f"{base64.b64encode(bytes([i])).decode()} {i}" for i in range(256)]
    (ASSETS / "tiny_tokenizer.model").write_text("\n".join(lines) + "\n")
    print(f"wrote {len(data)} examples and a 256-token byte vocabulary to {ASSETS}")


if __name__ == "__main__":
    main()
