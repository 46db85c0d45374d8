"""Regenerate the multi-turn examples' data (deterministic): `python examples/data/make_calc.py`.

calc.jsonl (examples/calc_tool.flow, calc_notool.flow): every `a*b=` of a 2-digit and a 1-digit number (both
orders) whose product has 2 digits, 212 rows, shuffled; `question` the expression (what the tool reads: a tool is
not passed the prompt), `answer` the product. guess.jsonl (examples/guess_number.flow): the prompt `?` and a hidden
`number` 0-9, each number as often (the policy cannot learn a favourite), 500 rows.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

HERE = Path(__file__).parent


def write(name: str, rows: list[dict[str, object]]) -> None:
    with (HERE / name).open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def calc(seed: int = 0) -> list[dict[str, object]]:
    pairs = [(a, b) for a in range(10, 100) for b in range(2, 10) if a * b < 100]
    pairs += [(b, a) for a, b in pairs]
    random.Random(seed).shuffle(pairs)
    return [{"prompt": f"{a}*{b}=", "question": f"{a}*{b}", "answer": a * b} for a, b in pairs]


def guess(count: int = 500, seed: int = 0) -> list[dict[str, object]]:
    numbers = [i % 10 for i in range(count)]
    random.Random(seed).shuffle(numbers)
    return [{"prompt": "?", "number": k} for k in numbers]


if __name__ == "__main__":
    write("calc.jsonl", calc())
    write("guess.jsonl", guess())
