"""A task where DAPO's dynamic sampling matters: `python examples/data/make_mix.py` writes mix.jsonl (deterministic).

One prompt in three is a one-digit sum `a+b=` (0 <= a, b <= 4: the tiny model of examples/grpo_arith.flow learns
these within a few hundred steps, after which its groups score all 1), two in three a sum of two three-digit numbers
(out of reach for that model in any budget here: its groups score all 0). So most groups have equal rewards: all 0
at first, then all 1 on the easy prompts and still all 0 on the hard ones, and GRPO's advantages are 0 on all of
them. `level` says which a row is (the reward ignores it)."""

from __future__ import annotations

import json
import random
from pathlib import Path

HERE = Path(__file__).parent


def mix(seed: int = 0) -> list[dict[str, object]]:
    rng = random.Random(seed)
    easy: list[dict[str, object]] = [{"prompt": f"{a}+{b}=", "answer": a + b, "level": "easy"}
                                     for a in range(5) for b in range(5)]
    hard: list[dict[str, object]] = []
    for _ in range(2 * len(easy)):
        a, b = rng.randrange(100, 1000), rng.randrange(100, 1000)
        hard.append({"prompt": f"{a}+{b}=", "answer": a + b, "level": "hard"})
    rows = easy + hard
    rng.shuffle(rows)
    return rows


if __name__ == "__main__":
    with (HERE / "mix.jsonl").open("w", encoding="utf-8") as f:
        for row in mix():
            f.write(json.dumps(row) + "\n")
