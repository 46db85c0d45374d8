"""Regenerate examples/data/longtail.jsonl (deterministic): `python examples/data/make_longtail.py`.

Each prompt asks for a response of `length` characters (the `length_target` reward scores it). The requested
lengths are long-tailed, as RLHF response lengths are: most short, some medium, a few at the flows' max_tokens
(64). Every prompt opens with the same 15 characters, a stand-in for a system prompt, which `share-prefix`
computes once per batch.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

HERE = Path(__file__).parent
SYSTEM = "12+34+56+78+90="  # shared by every prompt
MAX_TOKENS = 64


def rows(count: int, seed: int = 0) -> list[dict[str, object]]:
    rng = random.Random(seed)
    out: list[dict[str, object]] = []
    for _ in range(count):
        u = rng.random()
        length = rng.randint(2, 8) if u < 0.85 else rng.randint(16, 32) if u < 0.95 else MAX_TOKENS
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        out.append({"prompt": f"{SYSTEM}{a}+{b}={length}=", "length": length, "answer": a + b})
    return out


if __name__ == "__main__":
    with (HERE / "longtail.jsonl").open("w", encoding="utf-8") as f:
        for row in rows(512):
            f.write(json.dumps(row) + "\n")
