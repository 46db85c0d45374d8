"""Regenerate the preference examples' data (deterministic): `python examples/data/make_prefs.py`.

sum_pairs.jsonl: preference pairs over single-digit sums `a+b=` with a hidden rule deciding which answer a person
preferred — the correct sum is `chosen`, a wrong one `rejected` (a near miss half the time, any other number
0-18 otherwise) — for DPO and reward-model training. sum_demos.jsonl: demonstrations (`prompt`, `response`: the
correct sum) for supervised fine-tuning; sum_demos_few.jsonl: the demonstrations of the sums whose first operand is
0-4 only (the pipeline example's SFT stage: demonstrations are scarce, preference labels cover every sum); sums.jsonl:
the 100 prompts with their answers (the pipeline's RL stage and the judge). Every row also carries `answer`, so `flowrl.rewards.arith_exact` judges
a policy's greedy answers by the same rule. The last 20 pairs are held out (`held_out: true`) for accuracy.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent
HELD_OUT = 20


def wrong_sum(rng: random.Random, right: int) -> int:
    """A wrong answer: a near miss (off by one or two) half the time, else any other sum 0-18."""
    if rng.random() < 0.5:
        near = [s for s in (right - 2, right - 1, right + 1, right + 2) if 0 <= s <= 18]
        return rng.choice(near)
    return rng.choice([s for s in range(19) if s != right])


def pairs(count: int = 400, seed: int = 0) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    out: list[dict[str, Any]] = []
    for i in range(count):
        a, b = rng.randrange(10), rng.randrange(10)
        out.append({"prompt": f"{a}+{b}=", "chosen": str(a + b), "rejected": str(wrong_sum(rng, a + b)),
                    "answer": a + b, "held_out": i >= count - HELD_OUT})
    return out


def demos() -> list[dict[str, Any]]:
    """Every single-digit sum once, its correct answer as the demonstration."""
    return [{"prompt": f"{a}+{b}=", "response": str(a + b), "answer": a + b} for a in range(10) for b in range(10)]


def write(path: Path, rows: list[dict[str, Any]]) -> None:
    with path.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    write(HERE / "sum_pairs.jsonl", pairs())
    write(HERE / "sum_demos.jsonl", demos())
    write(HERE / "sum_demos_few.jsonl", [r for r in demos() if int(str(r["prompt"])[0]) < 5])
    write(HERE / "sums.jsonl", [{"prompt": r["prompt"], "answer": r["answer"]} for r in demos()])
