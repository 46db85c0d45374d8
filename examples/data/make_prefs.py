"""Regenerate the preference examples' data (deterministic): `python examples/data/make_prefs.py`.

sum_pairs.jsonl: preference pairs over single-digit sums `a+b=` with a hidden rule deciding which answer a person
preferred — the correct sum is `chosen` over every wrong sum 0-18 as `rejected` (100 sums x 18 = 1,800 pairs, in a
seeded shuffle), so no answer is preferred for itself (9, the most common sum, is rejected as often as any): only
the rule tells them apart. For DPO and reward-model training. sum_demos.jsonl: demonstrations (`prompt`, `response`: the
correct sum) for supervised fine-tuning; sum_demos_few.jsonl: the demonstrations of the sums whose first operand is
0-4 only (the pipeline example's SFT stage: demonstrations are scarce, preference labels cover every sum); sums.jsonl:
the 100 prompts with their answers (the pipeline's RL stage and the judge). Every row also carries `answer`, so `flowrl.rewards.arith_exact` judges
a policy's greedy answers by the same rule. The last 200 pairs are held out (`held_out: true`): a reward model is scored on pairs of a sum and a wrong answer
it never saw together.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent
HELD_OUT = 200


def pairs(seed: int = 0) -> list[dict[str, Any]]:
    """Each sum's correct answer over each of its 18 wrong ones, shuffled; the last HELD_OUT held out."""
    combos = [(a, b, w) for a in range(10) for b in range(10) for w in range(19) if w != a + b]
    random.Random(seed).shuffle(combos)
    return [{"prompt": f"{a}+{b}=", "chosen": str(a + b), "rejected": str(w), "answer": a + b,
             "held_out": i >= len(combos) - HELD_OUT} for i, (a, b, w) in enumerate(combos)]


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
