"""Regenerate the math word-problem set (deterministic): `python examples/data/make_math.py`.

Short one-step word problems over small numbers, in lower-case words a character model can read: adding
(`gets`, `finds`, `buys`), taking away (`eats`, `loses`, `gives away`), equal groups (`3 bags of 2`) and
halving (`shares 3 pies with a friend`), whose answers are fractions. The `answer` column is what a grader
would write: an integer, or LaTeX (`\\frac{3}{2}`) for halves, so `flowrl.rewards.math_equal` accepts `3/2`,
`1.5` and `\\frac{3}{2}` alike. Every character is in `CHARSET`, the charset of examples/math_word.flow.
"""

from __future__ import annotations

import itertools
import json
import random
from fractions import Fraction
from pathlib import Path

HERE = Path(__file__).parent
CHARSET = "abcdefghijklmnopqrstuvwxyz0123456789 .?/"
NAMES = ("ann", "bob", "kim", "sam", "tom", "eve")
THINGS = ("apple", "pen", "card", "egg", "cup", "hat")
ADD = ("gets", "finds", "buys")
TAKE = ("eats", "loses", "gives away")


def count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _answer(value: Fraction) -> str:
    return str(value.numerator) if value.denominator == 1 else f"\\frac{{{value.numerator}}}{{{value.denominator}}}"


def problems(seed: int = 0) -> list[dict[str, object]]:
    """Every (kind, numbers) once, names and things drawn from a seeded generator; shuffled."""
    rng = random.Random(seed)
    rows: list[tuple[str, Fraction]] = []
    for a, b in itertools.product(range(5), repeat=2):
        name, thing = rng.choice(NAMES), rng.choice(THINGS)
        rows.append((f"{name} has {count(a, thing)} and {rng.choice(ADD)} {b} more. how many now?", Fraction(a + b)))
        if a >= b:
            name, thing = rng.choice(NAMES), rng.choice(THINGS)
            rows.append((f"{name} has {count(a, thing)} and {rng.choice(TAKE)} {b}. how many left?", Fraction(a - b)))
    for a, b in itertools.product(range(1, 4), repeat=2):
        name, thing = rng.choice(NAMES), rng.choice(THINGS)
        rows.append((f"{name} has {count(a, 'bag')} of {count(b, thing)}. how many {thing}s?", Fraction(a * b)))
    for a in range(1, 7):
        name = rng.choice(NAMES)
        rows.append((f"{name} shares {count(a, 'pie')} with a friend. how much each?", Fraction(a, 2)))
    rng.shuffle(rows)
    out: list[dict[str, object]] = []
    for prompt, value in rows:
        assert set(prompt) <= set(CHARSET), prompt
        out.append({"prompt": prompt + " ", "answer": _answer(value)})
    return out


def write(path: Path, rows: list[dict[str, object]]) -> None:
    with path.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    write(HERE / "math_word.jsonl", problems())
